"""An asyncio event loop on simulated time: no threads, no sockets, no waiting.

`VirtualLoop.time()` is the simulation's `SimClock`. When no callback is ready, the loop
does not sleep until its next timer: it advances the clock to it. So `asyncio.sleep`,
`asyncio.timeout` and every `call_later` run in simulated seconds, as fast as the CPU
allows, and in the same order on every run with the same inputs (ready callbacks run
first in, first out; timers in time order).

Invariant: nothing here reads wall time or does I/O. A loop with nothing scheduled at all
raises `Stalled` instead of blocking forever.

Processes: every task belongs to the simulated process named by `PROCESS` in the context
it was created in (tasks inherit it; "" for the simulation's own). `stall(process,
until)` makes that process's event loop stop until `until`: a step of one of its tasks
that comes due meanwhile runs at `until` instead, in the order they came due, while
every other process runs on (what a router whose loop is held by a long call looks like
to its workers). Plain callbacks (timers, I/O completions) still run: they only wake
tasks, whose steps wait.
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import weakref
from asyncio import tasks

from kvrelay.core.clock import SimClock


PROCESS: contextvars.ContextVar[str] = contextvars.ContextVar("sim_process", default="")


def in_process(name: str) -> contextvars.Context:
    """A context whose tasks belong to process `name` (pass it to `create_task`)."""
    ctx = contextvars.copy_context()
    ctx.run(PROCESS.set, name)
    return ctx


class _ProcessTask(tasks._PyTask):
    """A task whose steps wait while its process is stalled (`VirtualLoop.stall`)."""

    def __init__(self, coro, *, loop, **kwargs) -> None:
        self._process = (kwargs.get("context") or contextvars.copy_context()).get(PROCESS)
        super().__init__(coro, loop=loop, **kwargs)

    def _Task__step(self, exc=None):
        until = self._loop.stalled_until(self._process)
        if until is not None:
            self._loop.call_at(until, self._Task__step, exc, context=self._context)
            return
        super()._Task__step(exc)


class Stalled(RuntimeError):
    """Nothing is ready and no timer is set: the simulation can never move again."""


class _VirtualSelector:
    """What the loop's `_run_once` asks to wait for I/O: here it only moves the clock."""

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock

    def select(self, timeout: float | None) -> list:
        if timeout is None:
            raise Stalled("no callback is ready and no timer is set")
        if timeout > 0:
            self.clock.advance(timeout)
        return []

    def close(self) -> None:
        pass


class VirtualLoop(asyncio.BaseEventLoop):
    def __init__(self, clock: SimClock) -> None:
        super().__init__()
        self.clock = clock
        self._selector = _VirtualSelector(clock)
        self._clock_resolution = 1e-9
        self._born: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # task -> creation number
        self._births = itertools.count()
        self._stalls: dict[str, float] = {}   # process -> until when its loop stands still
        self.set_task_factory(lambda loop, coro, **kw: _ProcessTask(coro, loop=loop, **kw))

    def create_task(self, coro, **kwargs) -> asyncio.Task:
        task = super().create_task(coro, **kwargs)
        self._born[task] = next(self._births)
        return task

    def stall(self, process: str, until: float) -> None:
        """`process`'s tasks take no step before `until`."""
        self._stalls[process] = max(until, self._stalls.get(process, until))

    def stalled_until(self, process: str) -> float | None:
        until = self._stalls.get(process)
        if until is None or until <= self.clock.now():
            return None
        return until

    def tasks_in_creation_order(self) -> list[asyncio.Task]:
        """The loop's tasks not yet done, oldest first. (`asyncio.all_tasks` is a WeakSet:
        its order is the tasks' addresses, which differ from one process to the next.)"""
        tasks = [t for t in asyncio.all_tasks(self) if not t.done()]
        return sorted(tasks, key=lambda t: self._born.get(t, -1))

    def time(self) -> float:
        return self.clock.now()

    def _process_events(self, event_list) -> None:
        pass

    def _write_to_self(self) -> None:
        pass  # one thread: a callback scheduled "threadsafe" is seen on the next turn anyway


def run(main, clock: SimClock):
    """Run coroutine `main` to completion on a fresh VirtualLoop; returns its result."""
    loop = VirtualLoop(clock)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all(loop)
        finally:
            loop.close()


def _cancel_all(loop: VirtualLoop) -> None:
    """Cancel what is left (worker loops, health checks) and let it unwind; a task whose
    unwinding waits on something that will never come is simply dropped with the loop."""
    tasks = loop.tasks_in_creation_order()   # cancelled (and so unwound) in a replayable order
    for t in tasks:
        t.cancel()
    try:
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=60.0))
        loop.run_until_complete(loop.shutdown_asyncgens())
    except Stalled:
        pass
