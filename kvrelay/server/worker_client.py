"""The router's side of the router<->worker protocol (`kvrelay.server.worker_protocol`),
over httpx, and the health checks that keep the router's worker table current.

Three connection pools: `streams` for the `POST /generate` legs (no read timeout: a leg
streams for as long as its request decodes, bounded by the router's end-to-end
deadline), `control` for aborts and debug views (a short timeout), and `checks` for
health checks, so that neither a full stream pool nor aborts piling up on a frozen
worker ever delay noticing a dead worker. A check may take up to `check_limit`: one
slower than --health-timeout makes its worker slow, not down (a link busy with KV bytes
delays answers without the worker being dead), and its answer still counts when it comes. Every request of all three carries the
cluster token when the router has a key (`security.auth_headers`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
from typing import AsyncIterator, Callable

import httpx

from kvrelay.core import aio
from kvrelay.core.clock import Clock
from kvrelay.core.config import RouterConfig
from kvrelay.core.stall import StallWatch
from kvrelay.engine.types import ErrorCode, FinishReason, RequestRejected, StepOutput
from kvrelay.server.errors import StartupError
from kvrelay.server.pairing import ROLES, Change, WorkerTable
from kvrelay.server.worker_protocol import AbortRequest, LegRequest, WorkerHealth, output_from_json

log = logging.getLogger("kvrelay.router")

PEER_FAILED = "peer_failed"
CONNECT_TIMEOUT = 5.0
ABORT_TIMEOUT = 2.0
CHECKS_IN_FLIGHT = 4   # health checks of one worker at once: a new one every interval while earlier ones are late
MAX_LINE_BYTES = 16 * 1024 * 1024   # one output line of a leg (its text, its logprobs), far above any real one
WRONG_KEY = ("refuses the router's cluster token: the router and every worker need the same cluster key "
             "(--cluster-key-file or KVRELAY_CLUSTER_KEY)")


class LegFailure(Exception):
    """A leg (or a whole try) that failed. `reason` is a lifecycle reason code
    (peer_failed, timeout:<phase>, transfer_error, overloaded, aborted, ...); `broken`
    means the worker could not be reached or its stream broke, so it counts as down."""

    def __init__(self, reason: str, detail: str, url: str | None = None, broken: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.url, self.broken = reason, detail, url, broken


def failure_of(out: StepOutput, url: str) -> LegFailure:
    """The failure a worker reported as a final output ("<reason code>: <detail>")."""
    if out.error is None:
        aborted = out.finish_reason is FinishReason.ABORT
        return LegFailure(ErrorCode.ABORTED.value if aborted else ErrorCode.INTERNAL_ERROR.value,
                          "the worker aborted the leg" if aborted else "the worker failed the leg", url)
    return LegFailure((out.error_code or ErrorCode.INTERNAL_ERROR).value, out.error_detail or "no detail", url)


def leg_finals(leg: LegRequest) -> int:
    """Final lines a leg's stream owes: one per choice on a decode leg, the one answer of
    a prefill leg."""
    return leg.sampling.n if leg.is_decode else 1


class LegLines:
    """Where a leg's stream stands: it ends after a final line for each of its choices, or
    at its first error/abort line (the leg failed; the worker ended every choice). Any
    other line past that, or for a choice that ended or does not exist, is malformed."""

    def __init__(self, leg: LegRequest) -> None:
        self.finals, self.ended, self.done = leg_finals(leg), set(), False

    def take(self, out: StepOutput) -> None:
        """Account for `out`; raises ValueError for a line the leg cannot send."""
        if self.done or out.index >= self.finals or out.index in self.ended:
            raise ValueError(f"an output for choice {out.index} after its end (or of no choice)")
        if out.finished:
            self.ended.add(out.index)
            self.done = len(self.ended) == self.finals or out.finish_reason in (FinishReason.ERROR,
                                                                                FinishReason.ABORT)


def _http_failure(status: int, body: bytes, url: str) -> Exception:
    """HTTP 400 before streaming: the request can never be served (the client gets the
    same 400). Any other status: this try failed with the code the worker named."""
    try:
        err = json.loads(body)["error"]
        message, param, code = str(err["message"]), err.get("param"), err.get("code")
    except (ValueError, KeyError, TypeError):
        message, param, code = body.decode(errors="replace")[:200] or f"HTTP {status}", None, None
    if status == 400:
        return RequestRejected(message, param, code or "invalid_request")
    return LegFailure(code or f"http_{status}", f"{url} answered HTTP {status}: {message}", url)


def check_limit(cfg: RouterConfig) -> float:
    """The longest a health check is waited for: past --health-timeout it only makes its
    worker slow; an answer within this still counts."""
    return 2 * cfg.health_lease


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class WorkerAPI:
    def __init__(self, cfg: RouterConfig, transport: httpx.AsyncBaseTransport | None = None, *,
                 headers: dict[str, str] | None = None, verify: ssl.SSLContext | bool = True) -> None:
        """`transport` replaces the network (tests). `headers` go with every request (the
        cluster token); `verify` checks https:// workers (`security.worker_verify`)."""
        legs = 2 * cfg.max_queued_requests
        common = dict(transport=transport, headers=headers, verify=verify)
        self.streams = httpx.AsyncClient(
            **common, timeout=httpx.Timeout(CONNECT_TIMEOUT, read=None, pool=None),
            limits=httpx.Limits(max_connections=legs + 16, max_keepalive_connections=min(legs, 64)))
        self.control = httpx.AsyncClient(**common, timeout=cfg.health_timeout,
                                         limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))
        # Health checks have a pool of their own: aborts piling up on a frozen worker must
        # never delay the checks that keep every other worker's lease.
        self.checks = httpx.AsyncClient(**common, timeout=httpx.Timeout(check_limit(cfg), connect=cfg.health_timeout),
                                        limits=httpx.Limits(max_connections=128, max_keepalive_connections=64))

    async def close(self) -> None:
        await self.streams.aclose()
        await self.control.aclose()
        await self.checks.aclose()

    async def generate(self, url: str, leg: LegRequest) -> AsyncIterator[StepOutput]:
        """The outputs of one leg, each choice's last with `finish_reason` set (`LegLines`).
        Raises `RequestRejected` (HTTP 400) or `LegFailure`. Closing the iterator early
        closes the stream, which aborts the leg on the worker."""
        try:
            async with self.streams.stream("POST", f"{url}/generate", content=leg.model_dump_json(),
                                           headers={"content-type": "application/json"}) as resp:
                if resp.status_code != 200:
                    raise _http_failure(resp.status_code, await resp.aread(), url)
                lines = LegLines(leg)
                async for line in aio.lines(resp.aiter_bytes(), MAX_LINE_BYTES):
                    if not line.strip():
                        continue
                    out = output_from_json(line)
                    lines.take(out)
                    yield out
                    if lines.done:
                        return
            raise LegFailure(PEER_FAILED, f"{url} ended the stream before the final output", url, broken=True)
        except httpx.TransportError as exc:
            raise LegFailure(PEER_FAILED, f"{url}: {_describe(exc)}", url, broken=True) from None
        except (ValueError, KeyError, TypeError) as exc:  # a line that is not a StepOutput
            raise LegFailure("internal_error", f"{url} sent a malformed output: {_describe(exc)}", url) from None

    async def abort(self, url: str, rid: str) -> None:
        """Fire-and-forget: a worker that cannot be reached has nothing left to abort."""
        try:
            await self.control.post(f"{url}/abort", content=AbortRequest(rid=rid).model_dump_json(),
                                     headers={"content-type": "application/json"}, timeout=ABORT_TIMEOUT)
        except httpx.HTTPError as exc:
            log.debug("abort not delivered", extra={"rid": rid, "worker": url, "error": _describe(exc)})

    async def health(self, url: str) -> WorkerHealth:
        """Raises TimeoutError when the check did not complete in time (a busy or frozen
        worker, or a host too loaded to connect within --health-timeout), LegFailure when
        the worker cannot be reached (refused, reset) or answers anything but a valid
        WorkerHealth."""
        try:
            resp = await self.checks.get(f"{url}/health")
            if resp.status_code == 401:   # --protect-metrics: /health itself needs the token
                raise LegFailure(PEER_FAILED, WRONG_KEY, url, broken=True)
            resp.raise_for_status()
            return WorkerHealth.model_validate_json(resp.content)
        except httpx.TimeoutException as exc:
            # A connect that timed out is lateness too, not a definite failure: on a loaded
            # host the router's own loop can be off its core past the timeout (the likely
            # cause of a live worker marked down in a CI run; the log kept no error). The
            # lease ends a worker that stays late.
            raise TimeoutError(_describe(exc)) from None
        except (httpx.HTTPError, ValueError) as exc:
            raise LegFailure(PEER_FAILED, _describe(exc), url, broken=True) from None

    async def debug_requests(self, url: str) -> dict:
        """The worker's live requests ({role, requests, phases}), or {"error": ...}."""
        try:
            resp = await self.control.get(f"{url}/debug/requests")
            resp.raise_for_status()
            body = resp.json()
            return {"role": body.get("role"), "requests": body.get("requests", []), "phases": body.get("phases", {})}
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            return {"error": _describe(exc)}


class WorkerMonitor:
    """Holds every worker under a lease (`RouterConfig.health_lease`), the way P and D hold
    each other: each worker has its own check loop, which starts a check every
    --health-interval (up to CHECKS_IN_FLIGHT at once, each waited for up to
    `check_limit`), so a slow or frozen worker never delays the checks of the others, and
    answers slowed by a busy link keep coming. A check unanswered after --health-timeout
    makes its worker slow; an answer in which the worker says its own loop last ran longer
    ago than that (`loop_age`) is no good check either. A worker that has given no good
    check, and no output on any leg (`WorkerTable.progress`), for the lease is dead:
    `on_dead(url, why)` fails every leg open on it. The lease counts the router's own
    looking: the reaper measures its loop's stalls (`stalls`) and does not count them.
    Down workers are checked too, so they rejoin. A worker that reports the wrong role,
    another model than the router serves, or that it refused the router's cluster token,
    stays down."""

    def __init__(self, table: WorkerTable, api: WorkerAPI, cfg: RouterConfig,
                 on_dead: Callable[[str, str], None] | None = None) -> None:
        self.table, self.api, self.cfg = table, api, cfg
        self.on_dead = on_dead
        self.model: str | None = None     # fixed by wait_ready
        self.stalls = StallWatch(table.clock, tolerance=cfg.health_interval / 2,
                                 horizon=max(60.0, 10 * cfg.health_lease), name="router")
        self._checks: dict[str, set[asyncio.Task]] = {}
        self.expired = 0                  # leases ended since start (workers declared dead)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(url, self.cfg.health_timeout) for url in self.table.urls()))

    async def check(self, url: str, limit: float | None = None) -> None:
        """One health check, waited for up to `limit` (default `check_limit`)."""
        fired: list[bool] = []   # the worker was marked slow once for this check
        late = asyncio.get_running_loop().call_later(self.cfg.health_timeout, self._late, url, fired)
        try:
            async with asyncio.timeout(check_limit(self.cfg) if limit is None else limit):
                health = await self.api.health(url)
        except TimeoutError:
            if not fired:
                self._late(url, fired)
            return
        except LegFailure as exc:
            self.failed(url, exc.detail)
            return
        finally:
            late.cancel()
        role = self.table.get(url).role
        if health.auth == "refused":
            self.failed(url, WRONG_KEY)
        elif health.role != role:
            self.failed(url, f"reports role {health.role}, but was given as a {role} worker")
        elif self.model is not None and health.model != self.model:
            self.failed(url, f"serves model {health.model}, not {self.model}")
        elif health.loop_age > self.cfg.health_timeout:
            self._slow(url, f"its scheduler loop last ran {health.loop_age:.1f} s ago")
        else:
            change = self.table.mark_ok(url, health)
            if change is not None:
                level = logging.WARNING if change is Change.RESTARTED else logging.INFO
                log.log(level, f"worker {change.value}", extra={"worker": url, "role": role,
                                                                "incarnation": health.incarnation})

    def _late(self, url: str, fired: list[bool]) -> None:
        fired.append(True)
        self._slow(url, f"no answer to GET /health within --health-timeout {self.cfg.health_timeout:g} s")

    def _slow(self, url: str, error: str) -> None:
        if self.table.mark_slow(url, error) is Change.SLOW:
            log.warning("worker slow", extra={"worker": url, "role": self.table.get(url).role, "error": error})

    def failed(self, url: str, error: str) -> None:
        if self.table.mark_failed(url, error) is Change.WENT_DOWN:
            log.warning("worker down", extra={"worker": url, "role": self.table.get(url).role, "error": error})

    def reap(self) -> list[str]:
        """End the lease of every worker silent for too long (the reaper's own stalls not
        counted); returns their URLs."""
        self.stalls.look()
        dead = self.table.expire_leases(self.cfg.health_lease, self.stalls)
        self.expired += len(dead)
        for w in dead:
            log.warning("worker dead", extra={"worker": w.url, "role": w.role, "error": w.last_error,
                                              "outstanding": w.outstanding})
            if self.on_dead is not None:
                self.on_dead(w.url, w.last_error or "lease expired")
        return [w.url for w in dead]

    async def run(self) -> None:
        """The check loops and the lease reaper, until cancelled."""
        async with asyncio.TaskGroup() as group:
            for url in self.table.urls():
                group.create_task(self._watch(url), name=f"health-{url}")
            group.create_task(self._reap_forever(), name="health-reaper")

    async def _watch(self, url: str) -> None:
        clock, checks = self.table.clock, self._checks.setdefault(url, set())
        try:
            while True:
                started = clock.now()
                if len(checks) < CHECKS_IN_FLIGHT:
                    task = asyncio.create_task(self._guarded_check(url), name=f"health-check-{url}")
                    checks.add(task)
                    task.add_done_callback(checks.discard)
                await asyncio.sleep(max(0.0, started + self.cfg.health_interval - clock.now()))
        finally:
            for task in list(checks):
                task.cancel()

    async def _guarded_check(self, url: str) -> None:
        try:
            await self.check(url)
        except Exception:  # noqa: BLE001 - a bug in one check must not end the worker's lease keeping
            log.exception("health check failed", extra={"worker": url})

    async def _reap_forever(self) -> None:
        # Every quarter interval: a lease ends at most that long after it expired.
        while True:
            await asyncio.sleep(self.cfg.health_interval / 4)
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - see _guarded_check
                log.exception("lease reaper failed")

    async def wait_ready(self, timeout: float, clock: Clock) -> tuple[str, int]:
        """Wait until each role has an up worker; returns (model name, max_model_len).
        Raises StartupError after `timeout` seconds, or if the workers disagree on the model."""
        deadline = clock.now() + timeout
        while True:
            await self.check_all()
            missing = [role for role in ROLES if not self.table.up(role)]
            if not missing:
                break
            if clock.now() >= deadline:
                raise StartupError(f"no healthy {missing[0]} worker after {timeout:g} s "
                                   f"({self.table.down_reasons(missing[0])})")
            await asyncio.sleep(min(self.cfg.health_interval, 0.5))
        up = [w for role in ROLES for w in self.table.up(role)]
        models = {w.health.model for w in up}
        if len(models) > 1:
            raise StartupError("the workers serve different models: "
                               + ", ".join(f"{w.url} serves {w.health.model}" for w in up))
        self.model = models.pop()
        return self.model, min(w.health.max_model_len for w in up)
