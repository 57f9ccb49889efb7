"""`kvrelay serve` (disaggregated): prefill and decode workers as child processes on this
host, and the router in this process in front of them.

Invariants:
- No orphans. Children run in their own session (a terminal's Ctrl-C reaches only this
  process, which stops the router first and then the children), and the kernel sends
  them SIGTERM if this process dies without stopping them (PR_SET_PDEATHSIG).
- Every exit path stops every child: SIGTERM, up to STOP_GRACE seconds, then SIGKILL.
- The cluster always has a key (see `server.security`): --cluster-key-file or
  KVRELAY_CLUSTER_KEY, else one made for this run. Children get it as the file's path or
  in their environment, never on their command line; the router uses the same key.
- Fixed ports (`startup.worker_ports`): prefill worker i on --worker-base-port + i, decode
  worker j on base + --num-prefill + j (base: --port + 1 by default). Every one of them is
  checked free before anything loads; a taken one ends start-up with one line naming it.
- Supervised while serving (`server.supervisor`): a worker that exits is reaped, logged and
  restarted at its port, or, after --max-worker-restarts quick deaths in a row, serve
  stops every child and exits 1 with one line naming it (`WorkerFailed`).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

import httpx

from kvrelay.core import aio
from kvrelay.core.clock import MonotonicClock
from kvrelay.core.config import ClusterConfig, KVRelayConfig, SecurityConfig, to_cli_args
from kvrelay.core.keys import ENV as KEY_ENV
from kvrelay.core.keys import ClusterKey
from kvrelay.engine.core_share import host_cores
from kvrelay.obs.logs import json_line, setup_logging
from kvrelay.server.errors import StartupError
from kvrelay.server.pairing import WorkerTable
from kvrelay.server.router import RouterClient, router_tokenizer, run_router
from kvrelay.server.security import api_gate, auth_headers, check_tls, load_cluster_key
from kvrelay.server.startup import (WORKER_HOST, check_worker_ports, release_ports, serving_url,
                                    stop_on_sigterm, worker_ports)
from kvrelay.server.supervisor import Supervisor, WorkerFailed

STOP_GRACE = 15.0
TAIL_LINES = 30
READY_POLL = 0.25
PROGRESS_EVERY = 10.0   # seconds between "still waiting" lines while workers load
# Config sections forwarded to every worker as flags (server: with the worker's own port).
WORKER_SECTIONS = ("model", "kv", "scheduler", "lifecycle", "transfer")
PR_SET_PDEATHSIG = 1
SHARE_DIR = "/dev/shm"   # the --share-cores file: memory, not disk, where it exists

_stderr_lock = threading.Lock()
log = logging.getLogger("kvrelay.serve")


def _die_with_parent():
    """A preexec_fn that has the kernel SIGTERM the child when this process dies (Linux;
    None elsewhere). libc is resolved here, before the fork, so the child only calls."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


def worker_argv(config: KVRelayConfig, role: str, port: int, ordinal: int = 0,
                core_share: str | None = None) -> list[str]:
    """The command line of the `ordinal`-th worker (0-based over all of them). A fixed
    --transfer-port is the first worker's; the others take the ports after it. With
    `core_share` (a file), the worker takes slot `ordinal` of it."""
    args = [sys.executable, "-m", "kvrelay", role]
    own = {"transfer": config.transfer, "scheduler": config.scheduler}
    if config.transfer.transfer_port:
        own["transfer"] = dataclasses.replace(config.transfer, transfer_port=config.transfer.transfer_port + ordinal)
    if core_share:
        own["scheduler"] = dataclasses.replace(config.scheduler, core_share=f"{core_share}:{ordinal}")
    for section in WORKER_SECTIONS:
        args += to_cli_args(own.get(section) or getattr(config, section))
    args += to_cli_args(worker_security(config.security))
    return args + to_cli_args(dataclasses.replace(config.server, host=WORKER_HOST, port=port))


def shedding_at_the_router(config: KVRelayConfig) -> KVRelayConfig:
    """`serve`'s --shed-ttft (a scheduler flag) goes to its router, which sheds before it
    pairs, from the prefill workers' reported queues; the workers get none."""
    return dataclasses.replace(config, router=dataclasses.replace(config.router, shed_ttft=config.scheduler.shed_ttft),
                               scheduler=dataclasses.replace(config.scheduler, shed_ttft=0.0))


def worker_security(sec: SecurityConfig) -> SecurityConfig:
    """What of the security section a local worker gets: the key file, --protect-metrics
    and --replay-window. Not the API keys (only the router faces clients) and not TLS
    (workers listen on loopback, plain HTTP)."""
    return SecurityConfig(cluster_key_file=sec.cluster_key_file, protect_metrics=sec.protect_metrics,
                          replay_window=sec.replay_window)


def worker_env(key: ClusterKey, sec: SecurityConfig, threads: int) -> dict[str, str]:
    """A child's environment: the generated (or inherited) key in KVRELAY_CLUSTER_KEY,
    unless it reads --cluster-key-file."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env.pop(KEY_ENV, None)
    if not sec.cluster_key_file:
        env[KEY_ENV] = key.export()
    return env


class WorkerProcess:
    """One child worker: the process, the thread that forwards its output to our stderr
    (text logs: each line after a `[prefill-0] ` prefix; json: with a "worker" field), and
    the last lines it printed. `restart()` replaces the process (a new incarnation) with
    the same command line and environment, so the same port and --core-share slot."""

    def __init__(self, role: str, index: int, ordinal: int, port: int, config: KVRelayConfig, threads: int,
                 key: ClusterKey, core_share: str | None = None) -> None:
        self.role, self.index = role, index
        self.port = port
        self.url = f"http://{WORKER_HOST}:{self.port}"
        self.json_logs = config.server.log_format == "json"
        self.env = worker_env(key, config.security, threads)
        self.argv = worker_argv(config, role, self.port, ordinal, core_share)
        self._spawn()

    @property
    def name(self) -> str:
        return f"{self.role} worker {self.index}"

    @property
    def tag(self) -> str:
        return f"{self.role}-{self.index}"

    def _spawn(self) -> None:
        """A new process, and its reader (not started) with a tail of its own."""
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                     preexec_fn=_die_with_parent())
        self._reader = threading.Thread(target=self._forward, args=(self.proc, self.tail),
                                        name=f"{self.tag}-output", daemon=True)

    def start_forwarding(self) -> None:
        self._reader.start()

    def restart(self) -> None:
        """Only from this process's main thread (the router's loop): PR_SET_PDEATHSIG
        fires when the thread that forked the child ends, not the process."""
        assert threading.current_thread() is threading.main_thread()
        self._spawn()
        self.start_forwarding()

    def _forward(self, proc: subprocess.Popen, tail: deque[str]) -> None:
        with proc.stdout:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                tail.append(line)
                out = _json_forwarded(line, self.tag) if self.json_logs else f"[{self.tag}] {line}"
                with _stderr_lock:
                    sys.stderr.write(out + "\n")
                    sys.stderr.flush()

    def last_error(self) -> str:
        """Its `kvrelay: error:` line if it printed one, else its last line. Not the
        leaked-segment warning of its resource tracker, a helper that outlives it (kill -9)."""
        self._reader.join(timeout=2)   # the process has exited: read what it printed last
        lines = [ln.strip() for ln in self.tail if ln.strip() and "resource_tracker" not in ln]
        for line in reversed(lines):
            if line.startswith("kvrelay: error: "):
                return line[len("kvrelay: error: "):]
        return lines[-1] if lines else "(no output)"

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=2)


def _json_forwarded(line: str, worker: str) -> str:
    """A child's line in the json log format, marked with the worker it came from: its
    log records as they are, its plain lines (start-up line, errors) as messages."""
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        return json.dumps({**obj, "worker": worker}, ensure_ascii=False)
    return json_line(line, "kvrelay.serve", worker=worker)


def worker_threads(cl: ClusterConfig, cores: int) -> tuple[int, bool]:
    """(threads each worker starts with, whether they share the cores). --worker-threads
    fixes the count. --share-cores applies while the workers are no more than the cores:
    beyond that each already gets one thread, and a worker taking two while another starts
    a step can only oversubscribe the cores (chaos, a saturated 2P+2D cluster on 2 cores:
    a request answered in 6.4, 2.1 and 7.7 s sharing, 2.8, 5.6, 1.7 and 5.4 s without)."""
    workers = cl.num_prefill + cl.num_decode
    if cl.worker_threads:
        return cl.worker_threads, False
    if cl.share_cores and workers <= cores:
        return cores, True
    return max(1, cores // workers), False


class LocalCluster:
    """The child workers of `kvrelay serve`, all under cluster key `key`."""

    def __init__(self, config: KVRelayConfig, key: ClusterKey) -> None:
        self.config, self.key = config, key
        self.workers: list[WorkerProcess] = []
        self.core_share: str | None = None   # the share file (--share-cores), removed in stop()

    def start(self, ports: list[int]) -> None:
        """Start one child per port of `worker_ports`, on `worker_threads` threads; sharing,
        every worker may use every core and takes its part before each step
        (`engine.core_share`)."""
        cl = self.config.cluster
        threads, shared = worker_threads(cl, host_cores())
        if shared:
            fd, self.core_share = tempfile.mkstemp(prefix="kvrelay-cores-", dir=SHARE_DIR if os.path.isdir(SHARE_DIR)
                                                   else None)
            os.close(fd)
        for role, count in (("prefill", cl.num_prefill), ("decode", cl.num_decode)):
            for i in range(count):
                n = len(self.workers)
                self.workers.append(WorkerProcess(role, i, n, ports[n], self.config, threads, self.key,
                                                  self.core_share))
        # Readers start after every fork: forking while threads run risks a child inheriting a held lock.
        for w in self.workers:
            w.start_forwarding()

    def urls(self, role: str) -> tuple[str, ...]:
        return tuple(w.url for w in self.workers if w.role == role)

    def wait_ready(self) -> None:
        """Until every worker's /health answers 200. Raises StartupError if one exits or
        --startup-timeout passes."""
        timeout = self.config.cluster.startup_timeout
        start = time.monotonic()
        deadline, next_note = start + timeout, start + PROGRESS_EVERY
        pending = list(self.workers)
        with httpx.Client(timeout=2.0, headers=auth_headers(self.key)) as http:
            while pending:
                for w in list(pending):
                    code = w.proc.poll()
                    if code is not None:
                        raise StartupError(f"{w.name} exited with code {code}: {w.last_error()}")
                    if _healthy(http, w.url):
                        pending.remove(w)
                        log.info("worker ready", extra={"worker": f"{w.role}-{w.index}", "url": w.url,
                                                        "seconds": round(time.monotonic() - start, 1)})
                now = time.monotonic()
                if pending and now > deadline:
                    raise StartupError(f"{pending[0].name} was not ready after {timeout:g} s (--startup-timeout); "
                                       f"its last line: {pending[0].last_error()}")
                if pending and now >= next_note:
                    next_note = now + PROGRESS_EVERY
                    log.info("waiting for workers", extra={
                        "pending": ",".join(f"{w.role}-{w.index}" for w in pending),
                        "seconds": round(now - start, 1)})
                if pending:
                    time.sleep(READY_POLL)

    def stop(self) -> None:
        """SIGTERM every child, wait up to STOP_GRACE seconds in all, then SIGKILL. A second
        Ctrl-C while waiting skips to SIGKILL."""
        for w in self.workers:
            w.terminate()
        deadline = time.monotonic() + STOP_GRACE
        try:
            for w in self.workers:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            pass
        finally:
            for w in self.workers:
                w.kill()
            if self.core_share:
                with contextlib.suppress(OSError):
                    os.unlink(self.core_share)


def _healthy(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def serve_cluster(config: KVRelayConfig) -> None:
    """`kvrelay serve`: start the workers, wait until all are ready, run the router on
    --host/--port until SIGINT/SIGTERM (or the supervisor gives up), then stop every
    worker. Raises StartupError (WorkerFailed: a worker kept dying)."""
    setup_logging(config.server.log_level)
    stop_on_sigterm()
    config = shedding_at_the_router(config)
    # A port in use, a bad --model, key or TLS file fails here, before any child starts.
    ports = worker_ports(config)
    check_worker_ports(config, ports)
    key, gate = load_cluster_key(config.security) or ClusterKey.generate(), api_gate(config.security)
    check_tls(config.security)
    tokenizer = router_tokenizer(config.model)
    cluster = LocalCluster(config, key)
    try:
        cluster.start(ports)
        log.info("starting workers", extra={
            "model": config.model.model, "workers": ",".join(f"{w.role}-{w.index}@{w.port}" for w in cluster.workers),
            "transfer": config.transfer.transfer_backend})
        cluster.wait_ready()
        table = WorkerTable(cluster.urls("prefill"), cluster.urls("decode"), MonotonicClock())
        srv, cl = config.server, config.cluster

        def banner(router: RouterClient) -> str:
            return (f"kvrelay serve: model {router.model_name}, {cl.num_prefill} prefill + {cl.num_decode} decode "
                    f"workers (transfer {config.transfer.transfer_backend}), serving on "
                    f"{serving_url(srv, config.security)}")

        supervisor = Supervisor(cluster, table)
        aio.run(run_router(config, table, tokenizer, banner, key=key, gate=gate, supervisor=supervisor))
        if supervisor.failure is not None:
            raise WorkerFailed(supervisor.failure)
    finally:
        release_ports()   # the router's port refuses at once while the workers drain
        cluster.stop()
