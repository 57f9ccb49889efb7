"""`kvrelay router`: the OpenAI front door of a disaggregated deployment.

`RouterClient` is an `EngineClient`, so `build_openai_app` serves exactly the endpoints
and errors of colocated mode. Per request it picks a (prefill, decode) pair
(`pairing.WorkerTable`), gives the request a `room`, sends both legs at once
(`worker_client.WorkerAPI`) and streams the decode leg's outputs back.

Invariants:
- Every admitted request ends exactly once: one final output (or a raised error before
  any output), one terminal log line, one `kvrelay_requests_finished` count.
- A try that ends for any reason stops both of its legs (`Attempt.stop`): a leg that has
  not sent its final line has its stream closed and gets `POST /abort`.
- A request of n > 1 choices goes to one pair as one try (P prefills and sends the KV
  once, D decodes the n choices); D's outputs carry each choice's `index`, and the
  request ends when each choice has had its final output. A failure ends every choice
  that has not ended, each with its own final (error or abort) output.
- A failed try is retried once on another pair, only while nothing has reached the
  client, and never for invalid requests, client aborts or an expired deadline. A
  request whose client sees only the final output (`GenerateRequest.whole`) has nothing
  reach it before then, so it may be retried mid-decode.
- No leg outlives its worker's lease: when `WorkerMonitor` declares a worker dead, every
  unfinished leg on it fails at once with peer_failed (`RouterClient.worker_dead`), so
  a worker that is alive on the network but wedged inside holds no client longer than
  --health-interval x --health-misses.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Coroutine, Protocol

import uvicorn
from fastapi import APIRouter, FastAPI

from kvrelay.core import aio, ids, mutation
from kvrelay.core.clock import Clock, MonotonicClock
from kvrelay.core.config import KVRelayConfig, ModelOptions, RouterConfig
from kvrelay.core.keys import ClusterKey
from kvrelay.engine.types import MAX_N, EngineClient, FinishReason, GenerateRequest, RequestRejected, StepOutput
from kvrelay.obs.logs import setup_logging
from kvrelay.obs.metrics import ServingMetrics, Snapshot
from kvrelay.server.errors import OpenAIError, StartupError, retry_headers
from kvrelay.server.observe import WORKERS_PATH, observability_router, scrape_workers
from kvrelay.server.openai_api import build_openai_app
from kvrelay.server.pairing import NoPair, Pair, WorkerTable, split
from kvrelay.server.security import Gate, api_gate, auth_headers, check_tls, load_cluster_key, worker_verify
from kvrelay.server.startup import access_logged, serving_url, stop_on_sigterm, uvicorn_options
from kvrelay.server.worker_client import (ABORT_TIMEOUT, PEER_FAILED, LegFailure, LegLines, WorkerAPI,
                                          WorkerMonitor, failure_of)
from kvrelay.server.worker_protocol import LegRequest, WireSampling

log = logging.getLogger("kvrelay.router")

PHASES = ("dispatched", "streaming")   # legs sent, no token yet / tokens flowing
PREFILL, DECODE, WAKE = "prefill", "decode", "wake"
NOT_RETRYABLE = frozenset({"invalid_request", "timeout:request"})
PREFILL_GRACE = 5.0     # after D finished, how long P's leg may take to report done before it is aborted
SHUTDOWN_GRACE = 30.0   # how long Ctrl-C / SIGTERM waits for streams in flight


@dataclass
class Event:
    side: str                          # PREFILL or DECODE; WAKE only wakes the reader (abort)
    out: StepOutput | None = None
    error: Exception | None = None     # LegFailure or RequestRejected


class Attempt:
    """One try of a request: its prefill and decode legs, started at once as tasks that
    feed `events`, so the router reacts to the first thing either side does."""

    def __init__(self, api: WorkerAPI, table: WorkerTable, pair: Pair, leg: LegRequest,
                 spawn: Callable[[Coroutine], None], on_broken: Callable[[str, str], None]) -> None:
        self.api, self.table, self.pair, self.rid = api, table, pair, leg.rid
        self._spawn, self._on_broken = spawn, on_broken
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._final: set[str] = set()    # sides whose final line has arrived
        self._dead: set[str] = set()     # sides whose worker died: nothing there to abort
        self._stopped = False
        if pair.prefill is None:   # the adaptive split: D prefills it, no prefill leg
            self.legs = {DECODE: (pair.decode.url, self._start(DECODE, pair.decode.url,
                                                               leg.model_copy(update={"prefill_here": True})))}
            return
        to_decode = leg.model_copy(update={"prefill_address": pair.prefill.health.transfer_address})
        self.legs = {PREFILL: (pair.prefill.url, self._start(PREFILL, pair.prefill.url, leg)),
                     DECODE: (pair.decode.url, self._start(DECODE, pair.decode.url, to_decode))}

    def _start(self, side: str, url: str, leg: LegRequest) -> asyncio.Task:
        # Counted from now (not from when the task first runs), so that requests arriving
        # in the same loop turn already see this leg's load.
        self.table.leg_started(url, len(leg.prompt_ids) if side == PREFILL or leg.prefill_here else 0)
        task = asyncio.create_task(self._run(side, url, leg), name=f"{side}-leg-{leg.rid}")
        task.add_done_callback(lambda _: self.table.leg_ended(url))
        return task

    async def _run(self, side: str, url: str, leg: LegRequest) -> None:
        lines = LegLines(leg)
        try:
            async for out in self.api.generate(url, leg):
                self.table.progress(url)
                lines.take(out)
                if lines.done:
                    self._final.add(side)
                self.events.put_nowait(Event(side, out=out))
        except LegFailure as exc:
            if exc.broken:
                self._on_broken(url, exc.detail)
            self.events.put_nowait(Event(side, error=exc))
        except RequestRejected as exc:
            self.events.put_nowait(Event(side, error=exc))
        except Exception as exc:  # a bug fails this request now rather than at its deadline
            log.exception("leg failed", extra={"rid": self.rid, "side": side, "worker": url})
            self.events.put_nowait(Event(side, error=LegFailure("internal_error", repr(exc), url)))

    def fail_legs_on(self, url: str, why: str) -> bool:
        """The worker at `url` is dead: every unfinished leg there ends now with
        peer_failed (its task is cancelled, so nothing of it arrives later)."""
        hit = False
        for side, (leg_url, task) in self.legs.items():
            if leg_url == url and side not in self._final and not self._stopped and not task.done():
                task.cancel()
                self._dead.add(side)
                self.events.put_nowait(Event(side, error=LegFailure(PEER_FAILED, f"{url} is dead: {why}", url,
                                                                    broken=True)))
                hit = True
        return hit

    def stop(self, prefill_grace: float = 0.0) -> None:
        """Idempotent. After it, nobody reads `events`. With `prefill_grace` (the decode
        leg succeeded), the prefill leg gets that long to report done on its own first."""
        if self._stopped:
            return
        self._stopped = True
        for side, (url, task) in self.legs.items():
            if side in self._final or side in self._dead:
                continue
            if side == PREFILL and prefill_grace > 0:
                self._spawn(self._end_after(url, task, prefill_grace))
            else:
                task.cancel()
                self._spawn(self.api.abort(url, self.rid))

    async def _end_after(self, url: str, task: asyncio.Task, grace: float) -> None:
        await asyncio.wait({task}, timeout=grace)
        if PREFILL not in self._final:
            task.cancel()
            await self.api.abort(url, self.rid)


@dataclass
class Routed:
    """A live client request as the router sees it."""
    rid: str
    prompt_tokens: int
    arrival: float
    deadline: float
    phase_since: float
    phase: str = "dispatched"
    room: int = 0
    attempt: int = 0
    current: Attempt | None = None
    yielded: int = 0                      # outputs handed to the consumer (nothing: a retry is invisible)
    tokens: int = 0                       # of every choice
    n: int = 1                            # choices
    counts: dict[int, int] = field(default_factory=dict)   # tokens per choice (of the current try)
    ended: set[int] = field(default_factory=set)           # choices whose final output went to the consumer
    first_token_at: float | None = None   # of the current try (TTFT is observed on the first)
    last_token_at: float | None = None    # of choice 0 in the current try (inter-token latency)
    aborted: bool = False                 # by the client
    outcome: tuple[str, str] = ("aborted", "aborted")   # (outcome, reason); a consumer that leaves early aborted

    def row(self, now: float) -> dict:
        pair = self.current.pair if self.current else None
        return {"id": self.rid, "room": self.room, "phase": self.phase, "age": round(now - self.arrival, 3),
                "in_phase": round(now - self.phase_since, 3), "deadline_in": round(self.deadline - now, 3),
                "prefill": pair.prefill_url if pair else None, "decode": pair.decode.url if pair else None,
                "attempt": self.attempt, "tokens": self.tokens}


class RouterClient(EngineClient):
    def __init__(self, cfg: RouterConfig, table: WorkerTable, api: WorkerAPI, monitor: WorkerMonitor,
                 tokenizer, model_name: str, max_model_len: int, clock: Clock | None = None) -> None:
        self.cfg, self.table, self.api, self.monitor = cfg, table, api, monitor
        self._tokenizer = tokenizer
        self.model_name, self.max_model_len = model_name, max_model_len
        self.clock = clock or MonotonicClock()
        self.metrics = ServingMetrics("router", PHASES, self.snapshot, model_name=model_name)
        self._live: dict[str, Routed] = {}
        self._units = 0                # completions (n of each live request): what --max-queued-requests counts
        self.prefilled_on_decode = 0   # requests the adaptive split sent to a decode worker whole
        self._background: dict[asyncio.Task, None] = {}   # insertion-ordered, not by id(): replayable
        monitor.on_dead = self.worker_dead

    def tokenizer(self):
        return self._tokenizer

    # -- EngineClient ----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        routed = self._admit(request)
        try:
            if not 1 <= request.params.n <= MAX_N:   # the workers refuse more (their pools, their batches)
                raise RequestRejected(f"n must be in [1, {MAX_N}]; got {request.params.n}", param="n")
            pair = self._first_pair(routed.prompt_tokens)
            while True:
                attempt = self._dispatch(routed, request, pair)
                held: dict[int, list[StepOutput]] = {}   # a whole request's outputs per choice, until its final one
                try:
                    while True:
                        out = await self._next_output(routed, attempt)
                        self._note(routed, out)
                        if request.whole and not out.finished:
                            held.setdefault(out.index, []).append(out)
                            continue
                        routed.yielded += 1
                        before = held.pop(out.index, [])
                        yield merged([*before, out]) if before else out
                        if out.finished:
                            routed.ended.add(out.index)
                            if len(routed.ended) == routed.n:
                                return
                except LegFailure as failure:
                    pair = self._retry_pair(routed, attempt, failure)   # or re-raises it
                finally:
                    attempt.stop(PREFILL_GRACE if routed.outcome[0] == "success" else 0.0)
        except LegFailure as failure:
            for out in self._failed(routed, failure):
                yield out
        except RequestRejected:
            routed.outcome = ("failed", "invalid_request")
            raise
        except OpenAIError as exc:
            routed.outcome = ("failed", exc.code or "error")
            raise
        finally:
            self._finish(routed)

    async def abort(self, rid: str) -> None:
        routed = self._live.get(rid)
        if routed is None or routed.aborted:
            return
        routed.aborted = True
        log.info("client aborted", extra={"rid": rid, "room": routed.room, "phase": routed.phase})
        if routed.current is not None:
            routed.current.stop()
            routed.current.events.put_nowait(Event(WAKE))

    def worker_dead(self, url: str, why: str) -> None:
        """`WorkerMonitor` ended `url`'s lease: every leg open there fails now."""
        if mutation.on("router_ignores_dead_worker"):  # a dead worker's open legs wait for their deadline
            return
        failed = [r.rid for r in list(self._live.values())
                  if r.current is not None and r.current.fail_legs_on(url, why)]
        if failed:
            log.warning("legs failed on a dead worker", extra={"worker": url, "requests": len(failed),
                                                               "rids": ",".join(failed[:8])})

    # -- one request -----------------------------------------------------------------------
    def check_capacity(self, units: int, param: str) -> None:
        """--max-queued-requests counts completions: `units` more must fit now, whole."""
        limit = self.cfg.max_queued_requests
        if units > limit:
            raise OpenAIError(400, f"this request asks for {units} completions (prompts x n), more than the router "
                              f"holds at once (--max-queued-requests {limit})", param, "too_many_completions")
        if self._units + units > limit:
            self.metrics.record_finish("failed", "overloaded")
            log.warning("request refused", extra={"reason": "overloaded", "units": units, "held": self._units})
            raise OpenAIError(503, f"the router already holds {self._units} completions and this request asks for "
                              f"{units} (--max-queued-requests {limit}); retry later", None, "overloaded",
                              retry_headers(503))

    def _admit(self, request: GenerateRequest) -> Routed:
        n = request.params.n
        self.check_capacity(n, "n")
        now = self.clock.now()
        routed = Routed(request.rid, len(request.prompt_ids), arrival=now, deadline=now + self.cfg.request_timeout,
                        phase_since=now, n=n)
        self._live[request.rid] = routed
        self._units += n
        return routed

    def _first_pair(self, prompt_tokens: int) -> Pair:
        pair = self.table.pick_pair()
        if isinstance(pair, NoPair):
            raise OpenAIError(503, pair.message, None, "no_healthy_worker", retry_headers(503))
        assert pair.prefill is not None
        placed = split(pair, prompt_tokens, self.cfg.decode_prefill_ttft)
        limit = self.cfg.shed_ttft
        if limit > 0:   # at the soonest place among the workers that answer checks
            rate = pair.prefill.health.prefill_s_per_token if pair.prefill.health else None
            wait = (placed.prefill or placed.decode).predicted_wait(prompt_tokens, rate)
            if wait is not None and wait > limit:
                raise OpenAIError(503, f"overloaded: the prompt tokens queued on the workers predict {wait:.1f} s "
                                  f"to this request's first token, over --shed-ttft {limit:g} s; retry later",
                                  None, "overloaded", retry_headers(503))
        if placed.prefill is None:
            self.prefilled_on_decode += 1
        return placed

    def _dispatch(self, routed: Routed, request: GenerateRequest, pair: Pair) -> Attempt:
        routed.attempt += 1
        routed.room = ids.randbits(63) or 1   # room 0 is never valid
        routed.tokens, routed.counts = 0, {}      # a retry starts the completion over
        routed.last_token_at = None
        if routed.phase != "dispatched":
            self._enter(routed, "dispatched", self.clock.now())
        # A retry may reach a worker that is still aborting the first try: new leg rid.
        rid = routed.rid if routed.attempt == 1 else f"{routed.rid}-try{routed.attempt}"
        leg = LegRequest(rid=rid, room=routed.room, prompt_ids=list(request.prompt_ids),
                         sampling=WireSampling.of(request.params))
        routed.current = Attempt(self.api, self.table, pair, leg, self._spawn, self.monitor.failed)
        log.info("request dispatched", extra={"rid": routed.rid, "room": routed.room, "attempt": routed.attempt,
                                              "prefill": pair.prefill_url, "decode": pair.decode.url})
        return routed.current

    async def _next_output(self, routed: Routed, attempt: Attempt) -> StepOutput:
        """The next output for the client. Raises LegFailure / RequestRejected."""
        while True:
            event = await self._next_event(routed, attempt)
            if routed.aborted:   # every open choice ends with an abort (`_failed`), never retried
                raise LegFailure("aborted", "the client aborted")
            if event.error is not None:
                raise event.error
            out = event.out
            failed = out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT)
            if failed:
                raise failure_of(out, attempt.legs[event.side][0])
            if event.side == DECODE:
                out.rid = routed.rid
                return out
            # The prefill leg's one line ("length"): D has the KV; the tokens come from D.

    async def _next_event(self, routed: Routed, attempt: Attempt) -> Event:
        try:
            async with asyncio.timeout(max(routed.deadline - self.clock.now(), 0.0)):
                return await attempt.events.get()
        except TimeoutError:
            raise LegFailure("timeout:request", f"no complete answer within --request-timeout "
                             f"{self.cfg.request_timeout:g} s (phase {routed.phase})") from None

    def _retry_pair(self, routed: Routed, attempt: Attempt, failure: LegFailure) -> Pair:
        if routed.yielded or routed.attempt > 1 or routed.aborted or failure.reason in NOT_RETRYABLE:
            raise failure
        pair = self.table.pick_pair(exclude=attempt.pair.urls)
        if isinstance(pair, NoPair):
            raise failure
        log.warning("request retried on another pair", extra={"rid": routed.rid, "room": routed.room,
                                                              "error": str(failure)})
        return pair

    def _note(self, routed: Routed, out: StepOutput) -> None:
        now = self.clock.now()
        if out.token_ids and out.index == 0:   # the choices decode side by side
            if routed.last_token_at is not None:
                self.metrics.observe_itl(now - routed.last_token_at)
            routed.last_token_at = now
        if out.token_ids and routed.phase == "dispatched":   # this try's first token
            if routed.first_token_at is None:
                self.metrics.observe_ttft(now - routed.arrival)
            routed.first_token_at = now
            self._enter(routed, "streaming", now)
        routed.tokens += len(out.token_ids)
        routed.counts[out.index] = routed.counts.get(out.index, 0) + len(out.token_ids)
        if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and len(routed.ended | {out.index}) == routed.n:
            routed.outcome = ("success", out.finish_reason.value)   # its last choice ended well

    def _enter(self, routed: Routed, phase: str, now: float) -> None:
        self.metrics.observe_phase(routed.phase, now - routed.phase_since)
        routed.phase, routed.phase_since = phase, now

    def _end_outputs(self, routed: Routed, reason: FinishReason, error: str | None = None) -> list[StepOutput]:
        """A final output for each choice that has not ended."""
        return [StepOutput(routed.rid, index=i, prompt_tokens=routed.prompt_tokens,
                           completion_tokens=routed.counts.get(i, 0), finish_reason=reason, error=error)
                for i in range(routed.n) if i not in routed.ended]

    def _failed(self, routed: Routed, failure: LegFailure) -> list[StepOutput]:
        if routed.aborted:
            routed.outcome = ("aborted", "aborted")
            return self._end_outputs(routed, FinishReason.ABORT)
        routed.outcome = ("failed", failure.reason)
        return self._end_outputs(routed, FinishReason.ERROR, str(failure))

    def _finish(self, routed: Routed) -> None:
        now = self.clock.now()
        if self._live.pop(routed.rid, None) is not None:
            self._units -= routed.n
        self.metrics.observe_phase(routed.phase, now - routed.phase_since)
        outcome, reason = routed.outcome
        self.metrics.record_finish(outcome, reason)
        self.metrics.observe_e2e(now - routed.arrival)
        longest = max(routed.counts.values(), default=0)   # the choices decode side by side
        if outcome == "success" and routed.first_token_at is not None and longest > 1:
            self.metrics.observe_tpot((now - routed.first_token_at) / (longest - 1))
        ttft = round(routed.first_token_at - routed.arrival, 3) if routed.first_token_at is not None else None
        pair = routed.current.pair if routed.current else None
        log.info("request finished", extra={
            "rid": routed.rid, "room": routed.room, "outcome": outcome, "reason": reason, "attempts": routed.attempt,
            "tokens": routed.tokens, "ttft": ttft, "duration": round(now - routed.arrival, 3),
            "prefill": pair.prefill_url if pair else None, "decode": pair.decode.url if pair else None})

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.create_task(coro)
        self._background[task] = None
        task.add_done_callback(lambda t: self._background.pop(t, None))

    # -- observability ---------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        # Runs on a scrape thread: list() copies the dict's values in one step under the GIL.
        live, now = list(self._live.values()), self.clock.now()
        workers = [self.table.get(url) for url in self.table.urls()]
        return Snapshot(phases={phase: [now - r.arrival for r in live if r.phase == phase] for phase in PHASES},
                        overdue={phase: sum(1 for r in live if r.phase == phase and now >= r.deadline)
                                 for phase in PHASES},
                        workers=[(w.url, w.role, w.up) for w in workers],
                        counters={"kvrelay_router_prefilled_on_decode": self.prefilled_on_decode,
                                  "kvrelay_router_lease_expiries": self.monitor.expired,
                                  "kvrelay_router_loop_stalls": self.monitor.stalls.count,
                                  "kvrelay_router_loop_stall_seconds": self.monitor.stalls.seconds})

    async def worker_metrics(self) -> bytes:
        """Every worker's /metrics, scraped now, with `worker` and `role` labels."""
        targets = [(url, self.table.get(url).role) for url in self.table.urls()]
        return await scrape_workers(self.api.control, targets, self.cfg.health_timeout)

    def debug_rows(self) -> list[dict]:
        now = self.clock.now()
        return [r.row(now) for r in list(self._live.values())]

    async def debug_view(self) -> dict:
        """The router's live requests, and every worker's view of its own ({role,
        requests, phases}, or {"error"} for a worker that did not answer)."""
        rows, urls = self.debug_rows(), self.table.urls()
        views = await asyncio.gather(*(self.api.debug_requests(url) for url in urls))
        return {"requests": rows, "workers": dict(zip(urls, views))}

    async def close(self) -> None:
        """Let the aborts already sent reach their workers (briefly)."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=ABORT_TIMEOUT)


def merged(outs: list[StepOutput]) -> StepOutput:
    """One output holding a whole choice's `outs` (the last one is final)."""
    last = outs[-1]
    return StepOutput(last.rid, index=last.index, token_ids=[t for o in outs for t in o.token_ids], text="".join(o.text for o in outs),
                      logprobs=[lp for o in outs for lp in o.logprobs], prompt_tokens=last.prompt_tokens,
                      completion_tokens=last.completion_tokens, finish_reason=last.finish_reason, error=last.error)


# ---------------------------------------------------------------- serving

def router_app(router: RouterClient, gate: Gate | None = None, allowed_origins: tuple[str, ...] = (),
               about: Callable[[str], dict] | None = None) -> FastAPI:
    """The OpenAI API over the router, /metrics, /metrics/workers (every worker's series),
    /debug/requests (the router's requests and every worker's), GET /workers (the worker
    table) and /health (`WorkerTable.health_view`: 503 while a role has no up worker; each
    down worker's entry updated with `about(url)`), behind `gate` (API keys)."""
    extra = APIRouter()

    @extra.get("/workers")
    async def workers() -> dict:
        return {"workers": router.table.rows()}

    async def health() -> tuple[int, dict]:
        view = router.table.health_view()
        for entry in view.get("down", ()):
            entry.update(about(entry["url"]) if about else {})
        return (503 if view["status"] == "unavailable" else 200), view

    observe = observability_router(router.metrics, router.debug_view, router.worker_metrics)
    if gate is not None and "/metrics" in gate.open_paths:   # the workers' series are as open as its own
        gate = replace(gate, open_paths=gate.open_paths | {WORKERS_PATH})
    return build_openai_app(router, extra_routes=[observe, extra], gate=gate, allowed_origins=allowed_origins,
                            health=health)


def router_tokenizer(opts: ModelOptions):
    """The tokenizer of --model (no weights). Raises StartupError."""
    from kvrelay.engine.sources import ModelLoadError, load_tokenizer

    try:
        return load_tokenizer(opts)
    except ModelLoadError as exc:
        raise StartupError(str(exc)) from None


def worker_table(cfg: RouterConfig, clock: Clock) -> WorkerTable:
    """The table of --prefill and --decode workers, all down until their first check.
    Raises StartupError for a URL that is not http(s)://host:port or is listed twice."""
    for url in cfg.prefill + cfg.decode:
        if not url.startswith(("http://", "https://")):
            raise StartupError(f"worker URL {url!r} must start with http:// or https:// (e.g. http://10.0.0.5:8000)")
    try:
        return WorkerTable([u.rstrip("/") for u in cfg.prefill], [u.rstrip("/") for u in cfg.decode], clock)
    except ValueError as exc:
        raise StartupError(str(exc)) from None


class Supervisor(Protocol):
    """What `kvrelay serve` runs beside its router: `run` as a task on the router's loop
    while it serves (it may end serving: `server.should_exit`), `about(url)` for /health."""

    async def run(self, router: RouterClient, server: uvicorn.Server) -> None: ...

    def about(self, url: str) -> dict: ...


async def run_router(config: KVRelayConfig, table: WorkerTable, tokenizer, banner: Callable[[RouterClient], str],
                     *, key: ClusterKey | None, gate: Gate, supervisor: Supervisor | None = None) -> None:
    """Wait for the workers in `table` (bounded by --startup-timeout), print
    `banner(router)`, serve on --host/--port until SIGINT/SIGTERM (or `supervisor` ends
    it). Every call to a worker carries `key`'s token; clients must get past `gate`.
    Raises StartupError."""
    cfg, srv, sec = config.router, config.server, config.security
    api = WorkerAPI(cfg, headers=auth_headers(key), verify=worker_verify(sec))
    try:
        monitor = WorkerMonitor(table, api, cfg)
        model, max_model_len = await monitor.wait_ready(config.cluster.startup_timeout, table.clock)
        router = RouterClient(cfg, table, api, monitor, tokenizer, model, max_model_len, table.clock)
        app = router_app(router, gate, srv.allowed_origins, supervisor.about if supervisor else None)
        server = uvicorn.Server(uvicorn.Config(access_logged(app), **uvicorn_options(srv, sec),
                                               timeout_graceful_shutdown=SHUTDOWN_GRACE))
        print(banner(router), flush=True)
        health = asyncio.create_task(monitor.run())
        watch = asyncio.create_task(supervisor.run(router, server), name="supervisor") if supervisor else None
        try:
            await server.serve()
        finally:
            health.cancel()
            if watch is not None:
                watch.cancel()
            await router.close()
    finally:
        await api.close()


def serve_router(config: KVRelayConfig) -> None:
    """`kvrelay router --prefill URL... --decode URL...`; blocks. Raises StartupError."""
    table = worker_table(config.router, MonotonicClock())
    key, gate = load_cluster_key(config.security), api_gate(config.security)
    check_tls(config.security)
    tokenizer = router_tokenizer(config.model)
    setup_logging(config.server.log_level)
    stop_on_sigterm()
    srv, cfg = config.server, config.router

    def banner(router: RouterClient) -> str:
        return (f"kvrelay router: model {router.model_name} (max_model_len {router.max_model_len}), "
                f"{len(cfg.prefill)} prefill + {len(cfg.decode)} decode workers, "
                f"serving on {serving_url(srv, config.security)}")

    aio.run(run_router(config, table, tokenizer, banner, key=key, gate=gate))
