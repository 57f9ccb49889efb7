"""AsyncEngine: runs a core (an EngineCore, or a worker core holding one: `LoopCore`) on a
dedicated thread and serves it to asyncio callers.

The engine thread builds the core (loads the model) and is the only one that touches it,
or torch at all: OpenMP keeps one worker team per calling thread, and a second team (say,
from loading weights on the main thread) pushes the process past the core count, where
libgomp stops spinning and every parallel region pays a futex wake-up (measured: decode
steps 1.8x slower). Other threads talk to it
through `_inbox` (add, abort, call); outputs come back to each request's asyncio queue
through `loop.call_soon_threadsafe`. An abort is handled at the top of the next
iteration, so a disconnected client's pages are free within one scheduler step. Calls
marked `readonly` (debug views) are also answered inside a long prefill pass, between
its layers (`serve_reads`); every other command queued then waits for the step's end, in
its order.

What other threads read without a command: `published`, the core's health view and
metrics snapshot as the engine thread last published them (after every iteration, and
between the layers of a long pass), with the engine-clock time and the iteration count.
/health and /metrics answer from it, so a scrape never waits on, or wakes, the loop; a
wedged loop shows as a `loop_age()` that keeps growing.

One iteration (`iterate`) is the whole loop body; the thread only repeats it. The
deterministic simulation (`kvrelay.sim`) builds an engine with `threaded=False` and calls
`iterate()` itself, on its own clock, so it drives exactly this code.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from kvrelay.core.clock import Clock
from kvrelay.engine.core import EngineCore
from kvrelay.engine.types import EngineClient, FinishReason, GenerateRequest, StepOutput
from kvrelay.obs.metrics import Snapshot

log = logging.getLogger("kvrelay.engine")


@dataclass(frozen=True)
class Published:
    """What the engine thread last published for other threads: replaced whole, never
    changed, so a reader gets a consistent view from one attribute read (atomic under the
    GIL). Invariant: every field was read on the engine thread between steps or between
    the layers of a pass, where a readonly call would have run."""
    at: float                # the engine's clock (`core.clock`) when it was published
    iterations: int          # loop iterations completed by then
    health: dict | None      # `core.health()` (worker cores; a fresh dict, never changed); else None
    snapshot: Snapshot       # `core.snapshot()` (O(live requests): tens of microseconds at 64)


class LoopCore(Protocol):
    """What the engine thread drives: `EngineCore` (colocated), or a disaggregated worker
    core, which holds an `EngineCore` and steps its lifecycle beside it. Everything runs
    on the engine thread, except `validate` and `final_outputs`, which read fixed state,
    and `prepare`, which runs on the caller's loop and compiles in threads of its own."""
    loaded: object            # the model (name, tokenizer, compute info)
    max_model_len: int
    clock: Clock              # the time `published` is stamped with (the simulation's SimClock)
    serve_reads: Callable[[], None] | None   # installed here: read-only calls, answered between layers

    @property
    def has_work(self) -> bool:
        """A forward pass is due: the loop steps without waiting for a command."""

    @property
    def busy(self) -> bool:
        """Anything is live (what `check_idle` waits out)."""

    @property
    def idle_wait(self) -> float:
        """With no forward due, the longest the loop waits for a command before a step."""

    def validate(self, greq: GenerateRequest) -> None:
        """Raise RequestRejected if `greq` can never be served here."""

    async def prepare(self, greq: GenerateRequest) -> object:
        """What `greq` needs before it is queued, made off the engine thread and off the
        caller's loop (its grammar, compiled); RequestRejected if that fails. The caller
        holds the result until the request ends."""

    def final_outputs(self, greq: GenerateRequest) -> int:
        """How many final outputs `greq`'s sink gets."""

    def add(self, greq: GenerateRequest, sink: Callable[[StepOutput], None], **kwargs) -> None:
        """Take a request (`kwargs`: what `generate` was given, e.g. a worker leg's room)."""

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        """End request `rid` if it is live; its sink gets its final outputs."""

    def live_rids(self) -> list[str]:
        """Every request still owed a final output."""

    def step(self) -> None:
        """One iteration's work after the commands: a forward pass, if any is due."""

    def check_idle(self) -> None:
        """Raise AssertionError unless nothing is live and every page is free."""

    def snapshot(self) -> Snapshot:
        """The metrics view of the live state (read-only; published, see `Published`).
        A core with a health view (a worker core) also has `health() -> dict`."""


class AsyncEngine(EngineClient):
    def __init__(self, build_core: Callable[[], LoopCore], idle_wait: float = 0.05, *,
                 threaded: bool = True) -> None:
        """Starts the engine thread, which runs `build_core()`; returns once it has, or
        raises what it raised (e.g. ModelLoadError). `threaded=False`: build the core
        here and start no thread; the caller runs `iterate()` (the simulation)."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Commands `serve_reads` took from the inbox and left for the step's end, in order:
        # they run before anything still in the inbox (FIFO overall).
        self._deferred: collections.deque[tuple] = collections.deque()
        self._idle_wait = idle_wait
        self._stop = threading.Event()
        self._threaded = threaded
        self.iterations = 0
        self._publish_failed = False
        # Outputs produced since the last publish, handed to their consumers right after it
        # (engine thread only): a client that has an output finds its effects in `published`.
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, StepOutput]] = []
        if not threaded:
            self.core: LoopCore = build_core()
            self.published: Published = self._views()
        else:
            built: concurrent.futures.Future = concurrent.futures.Future()
            self._thread = threading.Thread(target=self._main, args=(build_core, built), name="kvrelay-engine",
                                            daemon=True)
            self._thread.start()
            self.core = built.result()
        self.model_name = self.core.loaded.name
        self.max_model_len = self.core.max_model_len

    def tokenizer(self):
        return self.core.loaded.tokenizer

    # -- the engine thread -----------------------------------------------------------------
    def _main(self, build_core: Callable[[], LoopCore], built: concurrent.futures.Future) -> None:
        try:
            self.core = build_core()
            self.core.serve_reads = self.serve_reads
            self.published = self._views()
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result(self.core)
        self._loop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.iterate(block=not self.core.has_work):
                self._stop.wait(self._idle_wait)  # a persistent fault logs at most 1/idle_wait per second

    def iterate(self, block: bool = False) -> bool:
        """One iteration: run the queued commands (with `block`, wait up to the idle wait
        for the first), then one `core.step()`, also when idle (a worker core's lifecycle
        steps every iteration). Returns False if it raised.
        Invariant: nothing a request or a command does ends the loop. An iteration that
        raises (a forward pass failing is already handled inside `step`) fails every live
        request with internal_error, so none waits on a loop that may keep failing.
        Either way it ends by publishing (`published`)."""
        try:
            self._drain(block)
            self.core.step()
            ok = True
        except Exception as exc:
            log.exception("engine iteration failed")
            self._fail_all(f"internal_error: {exc}")
            ok = False
        self.iterations += 1
        self._publish()
        return ok

    def _publish(self) -> None:
        """On the engine thread: replace `published`, then hand out the outputs produced
        since the last publish. Invariant: never raises into the loop, and never loses an
        output; a view that raises publishes nothing, so `loop_age()` grows and the router
        drops this worker as it would one whose loop hung (logged once per failing run)."""
        try:
            self.published = self._views()
            self._publish_failed = False
        except Exception:
            if not self._publish_failed:
                log.exception("publishing the engine's views failed; its published state grows old")
            self._publish_failed = True
        finally:
            self._hand_out()

    def _sink(self, loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue) -> Callable[[StepOutput], None]:
        """A request's sink: its outputs wait in the outbox for the next publish."""
        def sink(out: StepOutput) -> None:
            self._outbox.append((loop, outputs, out))
        return sink

    def _hand_out(self) -> None:
        outbox, self._outbox = self._outbox, []
        for loop, outputs, out in outbox:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the consumer's event loop is closed: nobody is left to tell
                pass

    def _views(self) -> Published:
        """The core's views now."""
        health = self.core.health() if hasattr(self.core, "health") else None
        return Published(self.core.clock.now(), self.iterations, health, self.core.snapshot())

    def loop_age(self, view: Published | None = None) -> float:
        """Seconds (engine clock) since the engine thread published `view` (default: the
        latest). Any thread."""
        return max(0.0, self.core.clock.now() - (view or self.published).at)

    def _fail_all(self, error: str) -> None:
        """After an iteration raised outside a forward pass: every live request ends now
        with `error` (and frees its pages) rather than waiting on a loop that may raise again."""
        for rid in self.core.live_rids():
            try:
                self.core.abort(rid, FinishReason.ERROR, error)
            except Exception:  # one broken request must not keep the others pinned
                log.exception("failing request %s after an engine error failed too", rid)

    def _drain(self, block: bool) -> None:
        while self._deferred:
            self._run(self._deferred.popleft())
            block = False
        try:
            wait = min(self._idle_wait, self.core.idle_wait)
            cmd = self._inbox.get(timeout=wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self, cmd: tuple) -> None:
        """Invariant: a command whose caller already gave up (its future was cancelled, e.g.
        the client left while the add was queued) is skipped, never run, and never ends
        the loop: `set_running_or_notify_cancel` makes the future uncancellable first."""
        kind, *args = cmd
        if kind == "add":
            greq, sink, add_kwargs, fut = args
            if not fut.set_running_or_notify_cancel():
                return  # the caller's abort for this rid follows and finds nothing
            try:
                self.core.add(greq, sink, **add_kwargs)
                fut.set_result(None)
            except Exception as exc:  # rejected: the caller raises it, the loop goes on
                fut.set_exception(exc)
        elif kind == "abort":
            self.core.abort(args[0])
        elif kind == "call":
            fn, fut, _ = args
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.core))
            except BaseException as exc:
                fut.set_exception(exc)

    def serve_reads(self) -> None:
        """On the engine thread, inside a step: publish, run the queued read-only calls
        now and keep every other command for the step's end (`_drain`), in order."""
        self._publish()
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "call" and cmd[3]:
                self._run(cmd)
            else:
                self._deferred.append(cmd)

    def call(self, fn: Callable[[LoopCore], object], timeout: float = 30.0, readonly: bool = False):
        """Run `fn(core)` on the engine thread between steps and return its result.
        `readonly`: `fn` changes nothing and reads only what is whole inside a step (counts,
        phases, queues): it may also run between the layers of a long prefill pass."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut, readonly))
        return fut.result(timeout)

    async def acall(self, fn: Callable[[LoopCore], object], timeout: float = 30.0, readonly: bool = False):
        """`call` for asyncio callers: waits without a thread of its own. Raises
        TimeoutError after `timeout` seconds (a wedged loop)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut, readonly))
        async with asyncio.timeout(timeout):   # not wait_for: on 3.11 it can swallow a cancel
            return await asyncio.wrap_future(fut)

    # -- EngineClient ----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest, **add_kwargs) -> AsyncIterator[StepOutput]:
        """`add_kwargs` go to `core.add` (a worker core's room, peer address, ...)."""
        self.core.validate(request)
        prepared = await self.prepare(request)   # its compiled grammar: held until the request ends
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        added: concurrent.futures.Future = concurrent.futures.Future()
        left = self.core.final_outputs(request)   # one final output per choice
        finished = False
        try:
            # Inside the try: a consumer cancelled while the add is in flight still aborts
            # (the inbox is FIFO, so the abort lands after the add).
            self._inbox.put(("add", request, self._sink(loop, outputs), add_kwargs, added))
            await asyncio.wrap_future(added)
            while not finished:
                out = await outputs.get()
                left -= out.finished
                finished = left == 0
                yield out
        finally:
            if not finished:
                self._inbox.put(("abort", request.rid))
            del prepared   # the engine thread copied every matcher it needs before the first output

    async def prepare(self, request: GenerateRequest) -> object:
        """`core.prepare`: a grammar compiled off the engine thread and off this loop; a
        refused one raises RequestRejected. `generate` runs it; a handler that must answer
        a refusal before it streams awaits it first (the second call finds it cached)."""
        return await self.core.prepare(request)

    async def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    # -- lifecycle -------------------------------------------------------------------------
    def check_idle(self, timeout: float = 10.0) -> None:
        """Wait until the engine holds no request, then prove that nothing leaked."""
        deadline = time.monotonic() + timeout
        while self.call(lambda core: core.busy) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.call(lambda core: core.check_idle())

    def shutdown(self) -> None:
        self._stop.set()
        if self._threaded:
            self._thread.join(timeout=10)


def build_engine(loaded, kv_cfg, sched_cfg, kv_buffer: memoryview | None = None) -> AsyncEngine:
    """An engine over an already loaded model (tests; the server loads on the engine thread)."""
    return AsyncEngine(lambda: EngineCore(loaded, kv_cfg, sched_cfg, kv_buffer=kv_buffer))
