"""Simulated processes: prefill and decode workers, the router over them, and the HTTP
between them, all on one `VirtualLoop`.

The seam (everything else is production code):
- clock: every component reads the one `SimClock`, which the loop advances;
- engine driver: a worker is an `AsyncEngine(threaded=False)` whose `iterate()` a task
  calls, then sleeps for the step's modelled cost (`Costs`) or the core's `idle_wait`
  (woken early by a command, as the engine thread is);
- worker transport: `SimWorkerAPI` has `WorkerAPI`'s methods and runs the worker HTTP
  app's own leg code (`worker_app.prepare_leg` / `leg_outputs`, NDJSON round trip
  included) instead of HTTP, the worker's end of a stream in a task of its own; each
  request (and a stream the router closes) reaches the worker after the seeded HTTP
  latency; a crash resets its open streams like a dropped connection;
- P<->D transport: `net.SimChannel` under the `fake` backend's real control logic.

A worker is `up`, `frozen` (it stops iterating: SIGSTOP) or `down` (crashed: its engine,
pool and channel are gone; `restart()` starts a new incarnation at the same addresses).
"""
from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass
from typing import AsyncIterator

from kvrelay.core.config import KVCacheConfig, RouterConfig
from kvrelay.disagg.decode_worker import DecodeCore
from kvrelay.disagg.faults import FaultSpec
from kvrelay.disagg.prefill_worker import PrefillCore
from kvrelay.engine.engine import AsyncEngine
from kvrelay.engine.scheduler import StepCosts
from kvrelay.engine.types import StepOutput
from kvrelay.server.router import RouterClient
from kvrelay.server.worker_app import health_body, leg_outputs, prepare_leg
from kvrelay.server.worker_client import ABORT_TIMEOUT, PEER_FAILED, LegFailure, LegLines, WorkerMonitor
from kvrelay.server.pairing import WorkerTable
from kvrelay.server.worker_protocol import LegRequest, WorkerHealth, output_from_json, output_to_json
from kvrelay.sim.faults import ROUTER
from kvrelay.sim.loop import in_process

CORES = {"prefill": PrefillCore, "decode": DecodeCore}


@dataclass
class Costs:
    """Modelled compute time of one engine iteration that ran a batch."""
    step: float = 0.002        # seconds per forward pass
    per_token: float = 0.0002  # seconds per token position computed


class ModelledCosts(StepCosts):
    """The engine times each pass on the sim clock, which stands still during a step: this
    keeps the pass's counts, and the worker's loop charges them the modelled cost, so the
    costs a worker reports (and the router predicts with) are the model's."""

    def __init__(self) -> None:
        super().__init__()
        self._pass: tuple[int, int] | None = None

    def observe(self, decodes: int, tokens: int, seconds: float) -> None:
        self._pass = (decodes, tokens)

    def charge(self, seconds: float) -> None:
        if self._pass is not None:
            super().observe(*self._pass, seconds)
            self._pass = None


class _KickQueue(queue.SimpleQueue):
    """The engine's inbox; a put wakes the worker's task (the engine thread's blocking get)."""

    def __init__(self, kick: asyncio.Event) -> None:
        super().__init__()
        self.kick = kick

    def put(self, item, block=True, timeout=None) -> None:
        super().put(item)
        self.kick.set()


class _Stream:
    """One open leg stream; `reset` marks it cut by a crash (not a cancel by the router)."""

    def __init__(self, task: asyncio.Task | None) -> None:
        self.task, self.reset, self.ended = task, False, False
        self.server: asyncio.Task | None = None   # the worker's end of the stream


class SimWorker:
    def __init__(self, sim, role: str, index: int, kv: KVCacheConfig) -> None:
        self.sim, self.role, self.index, self.kv = sim, role, index, kv
        self.name = f"{role}-{index}"
        self.url = f"http://{self.name}:8000"
        self.address = f"tcp://{self.name}:7000"
        self.state = "down"
        self.slow = 1.0                 # step cost multiplier (slow-step faults)
        self.http_ok = asyncio.Event()  # False while the router<->worker link is cut
        self.http_ok.set()
        self.engine: AsyncEngine | None = None
        self.streams: dict[_Stream, None] = {}   # insertion-ordered: a crash resets them in a replayable order
        self.iterations = 0
        self.incarnations = 0
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def core(self):
        return self.engine.core if self.engine is not None else None

    def start(self) -> None:
        sim = self.sim
        channel = sim.net.channel(self.address)

        def build():
            return CORES[self.role](sim.loaded, self.kv, sim.sched, sim.lifecycle, sim.transfer, clock=sim.clock,
                                    channel=channel)

        self.engine = AsyncEngine(build, threaded=False)
        self.engine._inbox = _KickQueue(self._kick)
        self.core.engine.scheduler.costs = ModelledCosts()
        m = self.core.manager
        m.write_iters, m.chunk_pages, m.chunk_interval = sim.write_iters, sim.chunk_pages, sim.chunk_interval
        m.frame_pages = 1 if sim.link_rate else 0
        m.land_delay = sim.land_delay
        self.state = "up"
        self.incarnations += 1
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-{self.name}",
                                                            context=in_process(self.name))

    async def _run(self) -> None:
        engine, runner = self.engine, self.core.engine.runner
        while True:
            if self.state != "up":
                self._kick.clear()
                await self._kick.wait()
                continue
            self._kick.clear()
            runner.work = 0
            engine.iterate(block=False)
            self.iterations += 1
            try:
                self.sim.after_iteration(self)
            except AssertionError as v:   # a Violation, or the allocator's integrity check
                self.sim.fail(v)
                return
            core = engine.core
            if runner.work:
                cost = (self.sim.costs.step + runner.work * self.sim.costs.per_token) * self.slow
                measured = core.engine.last_prefill
                if measured is not None:
                    core.engine.last_prefill = (measured[0], cost)   # what the step would have measured
                core.engine.scheduler.costs.charge(cost)
                await asyncio.sleep(cost)
            elif not self._kick.is_set():   # wait for a command, at most idle_wait (a timer kicks too)
                wake = asyncio.get_running_loop().call_later(core.idle_wait, self._kick.set)
                try:
                    await self._kick.wait()
                finally:
                    wake.cancel()

    # ---- faults --------------------------------------------------------------------------
    def freeze(self) -> None:
        if self.state == "up":
            self.state = "frozen"

    def thaw(self) -> None:
        if self.state == "frozen":
            self.state = "up"
            self._kick.set()

    def crash(self) -> None:
        """Everything in memory is lost; open connections are reset."""
        if self.state == "down":
            return
        self.state = "down"
        if self._task is not None:
            self._task.cancel()
        self.engine.core.manager.close()   # unbinds the channel, frees the pool; sends nothing
        self.engine = None
        for s in list(self.streams):
            s.reset = True
            if s.task is not None:
                s.task.cancel()
        self.streams.clear()

    def restart(self) -> None:
        if self.state == "down":
            self.start()

    def set_transfer_faults(self, spec: str) -> None:
        if self.core is not None:
            self.core.manager.faults.spec = FaultSpec.parse(spec)


class SimWorkerAPI:
    """`worker_client.WorkerAPI` over simulated workers (see the module docstring). Every
    call the router makes (a leg, an abort, a health check) takes `latency` seconds to
    reach its worker, as an HTTP request does, and so does the end of a stream the router
    closes; the lines of an open stream take none."""

    def __init__(self, workers: dict[str, SimWorker], cfg: RouterConfig, latency: float = 0.0) -> None:
        self.workers, self.cfg, self.latency = workers, cfg, latency

    async def _hop(self) -> None:
        if self.latency:
            await asyncio.sleep(self.latency)

    async def close(self) -> None:
        pass

    def _reach(self, url: str) -> SimWorker:
        w = self.workers.get(url)
        if w is None or w.state == "down":
            raise LegFailure(PEER_FAILED, f"{url}: connection refused", url, broken=True)
        return w

    async def _connected(self, w: SimWorker, url: str, timeout: float) -> None:
        """A cut link: the call hangs until it times out (no RST comes back)."""
        if not w.http_ok.is_set():
            try:
                async with asyncio.timeout(timeout):
                    await w.http_ok.wait()
            except TimeoutError:
                raise LegFailure(PEER_FAILED, f"{url}: ConnectTimeout", url, broken=True) from None

    async def generate(self, url: str, leg: LegRequest) -> AsyncIterator[StepOutput]:
        """The router's end of a leg's stream; the worker's end (`_serve`) is a task of its
        own, as it is a request handler in the worker: a stream the router closes ends on
        the worker one hop later."""
        await self._hop()
        w = self._reach(url)
        await self._connected(w, url, 5.0)
        engine = self._reach(url).engine
        greq, kwargs = prepare_leg(engine.core, leg)   # RequestRejected: the worker's 400
        lines: asyncio.Queue = asyncio.Queue()
        stream = _Stream(asyncio.current_task())
        stream.server = asyncio.get_running_loop().create_task(self._serve(engine, greq, kwargs, lines),
                                                               context=in_process(w.name))
        w.streams[stream] = None
        ends = LegLines(leg)
        try:
            while True:
                line = await lines.get()
                if isinstance(line, Exception):
                    raise line
                if line is None:
                    raise LegFailure(PEER_FAILED, f"{url} ended the stream before the final output", url, broken=True)
                if not w.http_ok.is_set():
                    await w.http_ok.wait()        # bytes wait in the socket until the link heals
                out = output_from_json(line)
                ends.take(out)
                yield out
                if ends.done:
                    stream.ended = True
                    return
        except asyncio.CancelledError:
            if not stream.reset:
                raise
            asyncio.current_task().uncancel()
            raise LegFailure(PEER_FAILED, f"{url}: connection reset", url, broken=True) from None
        finally:
            w.streams.pop(stream, None)
            if not stream.ended and not stream.server.done():
                if self.latency and not stream.reset:
                    asyncio.get_running_loop().call_later(self.latency, stream.server.cancel)
                else:
                    stream.server.cancel()

    @staticmethod
    async def _serve(engine, greq, kwargs, lines: asyncio.Queue) -> None:
        """The worker's request handler: the leg's outputs as NDJSON lines, then None (the
        stream's end: the router's end reads it only if a final line is missing); the
        exception if it raised (a late 400)."""
        outs = leg_outputs(engine, greq, kwargs)
        try:
            async for out in outs:
                lines.put_nowait(output_to_json(out))
            lines.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - handed to the router's end
            lines.put_nowait(exc)
        finally:
            await outs.aclose()

    async def abort(self, url: str, rid: str) -> None:
        await self._hop()
        try:
            w = self._reach(url)
            await self._connected(w, url, ABORT_TIMEOUT)
            await w.engine.acall(lambda c: c.abort_leg(rid), timeout=ABORT_TIMEOUT)
        except (LegFailure, TimeoutError, AttributeError):
            pass   # fire and forget, as over HTTP

    async def health(self, url: str) -> WorkerHealth:
        await self._hop()
        w = self._reach(url)
        try:
            await self._connected(w, url, self.cfg.health_timeout)
        except LegFailure:   # as WorkerAPI.health: a connect that timed out is lateness
            raise TimeoutError(f"{url}: ConnectTimeout") from None
        # The worker app's own answer: the view its engine last published, with its age (a
        # frozen worker's grows; the router judges it, `WorkerMonitor.check`)
        try:
            return health_body(w.engine, "off")
        except AttributeError:   # it crashed during the hop
            raise LegFailure(PEER_FAILED, f"{url}: ReadTimeout", url, broken=True) from None

    async def debug_requests(self, url: str) -> dict:
        try:
            w = self._reach(url)
            return await w.engine.acall(lambda c: c.debug_view(), timeout=self.cfg.health_timeout, readonly=True)
        except (LegFailure, TimeoutError, AttributeError) as exc:
            return {"error": str(exc)}


class SimRouter:
    """The production router (RouterClient + WorkerMonitor) over SimWorkerAPI."""

    def __init__(self, cfg: RouterConfig, workers: list[SimWorker], tokenizer, clock, latency: float = 0.0) -> None:
        self.cfg, self.clock, self.tokenizer = cfg, clock, tokenizer
        self.table = WorkerTable([w.url for w in workers if w.role == "prefill"],
                                 [w.url for w in workers if w.role == "decode"], clock)
        self.api = SimWorkerAPI({w.url: w for w in workers}, cfg, latency)
        self.monitor = WorkerMonitor(self.table, self.api, cfg)
        self.client: RouterClient | None = None
        self._health: asyncio.Task | None = None

    async def start(self, timeout: float = 30.0) -> None:
        model, max_model_len = await self.monitor.wait_ready(timeout, self.clock)
        self.client = RouterClient(self.cfg, self.table, self.api, self.monitor, self.tokenizer, model,
                                   max_model_len, self.clock)
        self._health = asyncio.get_running_loop().create_task(self.monitor.run(), name="sim-health",
                                                              context=in_process(ROUTER))

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
        if self.client is not None:
            await self.client.close()
