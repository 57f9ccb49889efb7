"""`kvrelay serve`'s supervisor: keeps the child workers of `server.cluster` running.

A worker that exits is reaped, logged and restarted at its port after a backoff (a new
incarnation); after --max-worker-restarts quick deaths in a row serve stops every child and
exits 1 with one line naming it (`WorkerFailed`). While a worker is down, the router's
/health names it (`Supervisor.about`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from typing import TYPE_CHECKING

import uvicorn
from prometheus_client.core import CounterMetricFamily

from kvrelay.server.errors import StartupError
from kvrelay.server.pairing import WorkerTable
from kvrelay.server.router import RouterClient

if TYPE_CHECKING:
    from kvrelay.server.cluster import LocalCluster, WorkerProcess

SUPERVISE_POLL = 0.2     # seconds between the supervisor's looks at its children
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0   # before a restart: doubling per quick death in a row
STABLE_AFTER = 60.0      # a restarted worker ready this long has recovered: its death ends the streak

log = logging.getLogger("kvrelay.serve")


class WorkerFailed(StartupError):
    """A worker kept dying (`Supervisor`): the CLI prints it as one line and exits 1."""


@dataclasses.dataclass
class Restarts:
    """One worker's restarts, over times from the caller's clock. A death is quick when
    the process that died was itself a restart and had not been ready for STABLE_AFTER
    seconds (or never became ready); a quick one lengthens `streak`, any other ends it."""
    limit: int                      # --max-worker-restarts
    total: int = 0                  # restarts since serve started
    streak: int = 0                 # quick deaths in a row
    ready_at: float | None = None   # when the running process became ready

    def after_death(self, now: float) -> float | None:
        """Seconds to wait before the next restart, or None: `limit` quick deaths in a
        row (0: any death), give up."""
        quick = self.total > 0 and (self.ready_at is None or now - self.ready_at < STABLE_AFTER)
        self.streak = self.streak + 1 if quick else 0
        self.ready_at = None
        if self.streak >= self.limit:
            return None
        return min(BACKOFF_FIRST * 2 ** self.streak, BACKOFF_MAX)


@dataclasses.dataclass
class Watched:
    """A worker as its supervisor sees it."""
    worker: WorkerProcess
    restarts: Restarts
    incarnation: str | None = None    # the last one the router saw up
    started_at: float = 0.0           # when the running process was started
    down: bool = False                # from its death until the router's checks see a new incarnation up
    exit: str | None = None           # how it last exited, while down
    last_line: str = ""               # its last error line then
    restart_at: float | None = None   # set while it waits out its backoff (no process runs)
    killed: str | None = None         # why the supervisor killed the running process


class Supervisor:
    """Keeps `kvrelay serve`'s workers running: a task on the router's loop
    (`run_router(supervisor=...)`), not a thread, so that it reads and marks the router's
    own WorkerTable without locks, forks restarts from the main thread (see
    `WorkerProcess.restart`), and ends serving the way a signal does (`server.should_exit`).

    Invariants:
    - Every child that exits is reaped (`poll()`) within SUPERVISE_POLL seconds, logged
      once (worker, exit code or signal, its last error line) and marked down at once.
    - A dead worker restarts at its port after its backoff (`Restarts`), never once
      serving ends (a signal, or giving up): `LocalCluster.stop` then stops what runs.
    - A restart is ready when the router's checks see a new incarnation up; one not ready
      within --startup-timeout is killed, and that is its (quick) death.
    - Giving up ends serving with `failure`: one line naming the worker and its last error.
    """

    def __init__(self, cluster: LocalCluster, table: WorkerTable) -> None:
        cl = cluster.config.cluster
        self.table, self.clock = table, table.clock
        self.limit, self.startup_timeout = cl.max_worker_restarts, cl.startup_timeout
        self.watched = {w.url: Watched(w, Restarts(self.limit)) for w in cluster.workers}
        self.failure: str | None = None
        self._server: uvicorn.Server | None = None
        self._model = ""

    async def run(self, router: RouterClient, server: uvicorn.Server) -> None:
        self._server, self._model = server, router.metrics.model_name
        router.metrics.registry.register(self)
        now = self.clock.now()
        for w in self.watched.values():
            health = self.table.get(w.worker.url).health
            w.incarnation, w.restarts.ready_at = (health.incarnation if health else None), now
        try:
            while not server.should_exit:
                for w in self.watched.values():
                    if not server.should_exit:
                        await self._look(w)
                await asyncio.sleep(SUPERVISE_POLL)
        except Exception as exc:  # a supervisor that fails must not leave serve unsupervised
            log.exception("worker supervision failed")
            self._end(f"worker supervision failed: {exc!r}")

    async def _look(self, w: Watched) -> None:
        now, code = self.clock.now(), w.worker.proc.poll()   # poll() reaps
        if w.restart_at is not None:
            if now >= w.restart_at:
                self._restart(w, now)
        elif code is not None:
            await self._died(w, code)
        elif w.down:
            self._await_ready(w, now)

    async def _died(self, w: Watched, code: int) -> None:
        w.last_line = await asyncio.to_thread(w.worker.last_error)   # joins its reader: off the loop
        now = self.clock.now()
        w.exit, w.killed = w.killed or exit_text(code), None
        w.down = True
        self.table.mark_failed(w.worker.url, f"exited ({w.exit}): {w.last_line}")
        delay = w.restarts.after_death(now)
        log.warning("worker exited", extra={"worker": w.worker.tag, "exit": w.exit, "error": w.last_line,
                                            "restarts": w.restarts.total, "restart_in": delay})
        if delay is None:
            self._give_up(w)
        else:
            w.restart_at = now + delay

    def _restart(self, w: Watched, now: float) -> None:
        w.restart_at, w.started_at = None, now
        w.worker.restart()
        w.restarts.total += 1
        log.info("worker restarting", extra={"worker": w.worker.tag, "url": w.worker.url,
                                             "pid": w.worker.proc.pid, "restarts": w.restarts.total})

    def _await_ready(self, w: Watched, now: float) -> None:
        row = self.table.get(w.worker.url)
        if row.up and row.health is not None and row.health.incarnation != w.incarnation:
            w.incarnation, w.down, w.exit, w.restarts.ready_at = row.health.incarnation, False, None, now
            log.info("worker ready", extra={"worker": w.worker.tag, "url": w.worker.url,
                                            "seconds": round(now - w.started_at, 1), "restarts": w.restarts.total})
        elif now - w.started_at > self.startup_timeout and w.killed is None:
            w.killed = f"not ready after {self.startup_timeout:g} s (--startup-timeout)"
            w.worker.proc.kill()

    def _give_up(self, w: Watched) -> None:
        if self.limit == 0:
            why = "and --max-worker-restarts is 0"
        else:
            why = (f"after {self.limit} restart{'s' * (self.limit != 1)} in a row, each dying within "
                   f"{STABLE_AFTER:g} s of becoming ready (--max-worker-restarts {self.limit})")
        self._end(f"{w.worker.name} exited ({w.exit}) {why}: {w.last_line}")

    def _end(self, failure: str) -> None:
        self.failure = failure
        log.error("stopping serve", extra={"reason": failure})
        if self._server is not None:
            self._server.should_exit = True

    def about(self, url: str) -> dict:
        """What /health adds to a down worker's entry: its name and restarts, and while its
        process is gone, how it exited and when it restarts."""
        w = self.watched.get(url)
        if w is None:
            return {}
        out = {"name": w.worker.name, "restarts": w.restarts.total}
        if w.exit is not None:
            out["why"] = f"exited ({w.exit}): {w.last_line}"
        if w.restart_at is not None:
            out["restart_in_s"] = round(max(0.0, w.restart_at - self.clock.now()), 3)
        return out

    def collect(self):
        """The router's kvrelay_serve_worker_restarts_total{worker,role} (a Prometheus
        collector, registered on its registry)."""
        family = CounterMetricFamily("kvrelay_serve_worker_restarts", "Times kvrelay serve restarted each worker "
                                     "(a new process at its port)", labels=["worker", "role", "model_name"])
        for w in list(self.watched.values()):
            family.add_metric([w.worker.url, w.worker.role, self._model], w.restarts.total)
        yield family


def exit_text(code: int) -> str:
    """A reaped child's return code as words: "code 1", "signal SIGKILL"."""
    if code >= 0:
        return f"code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"
