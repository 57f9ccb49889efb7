"""A disaggregated cluster of real processes for chaos tests: prefill and decode workers
(`kvrelay prefill|decode`) and a router (`kvrelay router`), each on its own port, with
their logs in files so a failing test can show them."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvrelay.core.keys import ENV as KEY_ENV
from kvrelay.core.keys import ClusterKey
from serving_helpers import free_port, gauge, metric_samples, wait_healthy

# Short leases so that failures show within seconds; long backstops so that a test passing
# proves the lease (not a fixed timeout) ended the request.
LIFECYCLE_FLAGS = ("--heartbeat-interval", "0.5", "--heartbeat-misses", "3", "--bootstrap-timeout", "30",
                   "--queue-timeout", "60", "--waiting-timeout", "60", "--transfer-timeout", "60",
                   "--quarantine-grace", "1")
LEASE = 0.5 * 3
QUARANTINE_S = 60 + 1 + 5   # --transfer-timeout + --quarantine-grace above, + slack
# The router holds each worker under a lease of its own: no good health check for
# --health-interval x --health-misses seconds and every leg open there fails. 3 s and a
# 2 s check timeout, as the defaults: a 1.5 s lease with a 1 s timeout expired on healthy
# workers of a loaded 2-core CI machine (64 concurrent streams, a 2 Mbit/s netns link).
HEALTH_INTERVAL, HEALTH_MISSES, HEALTH_TIMEOUT = 0.5, 6, 2.0
ROUTER_LEASE = HEALTH_INTERVAL * HEALTH_MISSES


class Proc:
    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path) -> None:
        self.name, self.argv, self.port = name, argv, port
        self.env: dict[str, str] = {}     # added to the process's environment (e.g. the cluster key)
        self.log = log_dir / f"{name}.log"
        self.popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Proc":
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "UCX_MODULES": "^ib", **self.env}   # self.env last: it may set OMP_NUM_THREADS
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen([sys.executable, "-m", "kvrelay", *self.argv, "--port", str(self.port)],
                                          stdout=out, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_healthy(self, timeout: float = 120.0) -> None:
        assert self.popen is not None
        wait_healthy(self.popen, self.url, timeout, self.tail)

    def signal(self, sig: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)

    def stop(self) -> None:
        self.terminate()
        self.reap()

    def terminate(self) -> None:
        """SIGTERM (after SIGCONT, should it be frozen); `reap` waits for it."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()

    def reap(self, timeout: float = 20.0) -> None:
        """Wait for the exit that `terminate` asked for; SIGKILL after `timeout` s."""
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Cluster:
    """1+ prefill and 1+ decode workers and a router over them, all on localhost. `keyed`:
    every process shares a generated cluster key (in KVRELAY_CLUSTER_KEY), so the workers
    sign their control messages and want the router's token on their HTTP API."""

    def __init__(self, model_args: list[str], worker_args: list[str] = (), num_prefill: int = 1,
                 num_decode: int = 2, backend: str = "shm", keyed: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvrelay-cluster-"))
        self.key = ClusterKey.generate() if keyed else None
        worker = [*model_args, *worker_args, "--transfer-backend", backend, *LIFECYCLE_FLAGS, "--enable-fault-injection"]
        self.prefill = [Proc(f"prefill-{i}", ["prefill", *worker], free_port(), self.dir) for i in range(num_prefill)]
        self.decode = [Proc(f"decode-{i}", ["decode", *worker], free_port(), self.dir) for i in range(num_decode)]
        router = ["router", *model_args, "--prefill", *[p.url for p in self.prefill],
                  "--decode", *[d.url for d in self.decode], "--health-interval", str(HEALTH_INTERVAL),
                  "--health-misses", str(HEALTH_MISSES), "--health-timeout", str(HEALTH_TIMEOUT),
                  "--request-timeout", "120"]
        self.router = Proc("router", router, free_port(), self.dir)

    @property
    def workers(self) -> list[Proc]:
        return self.prefill + self.decode

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def worker_headers(self) -> dict[str, str]:
        """What a call to a worker's API needs (the router's token in a keyed cluster)."""
        return {"Authorization": f"Bearer {self.key.http_token}"} if self.key else {}

    def start(self) -> "Cluster":
        if self.key is not None:
            for p in [self.router, *self.workers]:
                p.env[KEY_ENV] = self.key.export()
        # Side by side: the router waits for its workers itself (--startup-timeout).
        for p in [*self.workers, self.router]:
            p.start()
        for p in [*self.workers, self.router]:
            p.wait_healthy()
        self.wait_router_sees_all()
        return self

    def wait_router_sees_all(self, timeout: float = 30.0) -> None:
        """Until the router counts every worker as up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            table = httpx.get(f"{self.url}/workers", timeout=5).json()
            if all_up(table, len(self.workers)):
                return
            time.sleep(0.2)
        raise AssertionError(f"router does not see every worker up: {table}")

    def stop(self, keep_logs: bool = False) -> None:
        """Every process at once, as `kvrelay serve` stops its workers; then their log
        directory goes, unless `keep_logs` or KVRELAY_KEEP_TEST_LOGS=1 (a suite run would
        otherwise leave a few hundred in /tmp)."""
        procs = [self.router, *self.workers]
        for p in procs:
            p.terminate()
        for p in procs:
            p.reap()
        if not keep_logs and os.environ.get("KVRELAY_KEEP_TEST_LOGS") != "1":
            shutil.rmtree(self.dir, ignore_errors=True)

    def logs(self) -> str:
        return "\n\n".join(f"== {p.name}\n{p.tail()}" for p in [self.router, *self.workers])

    def set_faults(self, procs: list[Proc], spec: str) -> None:
        for p in procs:
            r = httpx.post(f"{p.url}/debug/faults", json={"spec": spec}, headers=self.worker_headers, timeout=10)
            assert r.status_code == 200, r.text

    def assert_no_leak(self, timeout: float = 15.0) -> None:
        """Every phase gauge 0 on every process; free pages == total pages on each worker.
        Pages a one-sided backend holds in quarantine (a failed write whose writer never
        confirmed it stopped) come back by design only at --transfer-timeout +
        --quarantine-grace: while quarantine alone explains the gap, wait that long."""
        start = time.monotonic()
        deadline = start + timeout
        while True:
            bad, quarantined = {}, False
            for p in [self.router, *self.workers]:
                s = metric_samples(p.url)
                phases = gauge(s, "kvrelay_requests")
                free, total = gauge(s, "kvrelay_kv_pages_free"), gauge(s, "kvrelay_kv_pages_capacity")
                held = sum(gauge(s, "kvrelay_kv_pages_quarantined"))
                if not phases or any(phases) or free != total or (p is not self.router and not total):
                    bad[p.name] = (phases, free, total, held)
                    quarantined = quarantined or (not any(phases) and sum(free) + held == sum(total) and held > 0)
            if not bad:
                return
            if quarantined:
                deadline = max(deadline, start + QUARANTINE_S)
            if time.monotonic() > deadline:
                raise AssertionError(f"leak: {bad}\n{self.logs()}")
            time.sleep(0.2)


def all_up(table, n: int) -> bool:
    rows = table.get("workers", table) if isinstance(table, dict) else table
    return len(rows) == n and all(w.get("up") for w in rows)


def phase_gauges(url: str) -> dict[str, float]:
    return {dict(ls)["phase"]: v for (n, ls), v in metric_samples(url).items() if n == "kvrelay_requests"}


def finished(url: str, **labels) -> float:
    return sum(gauge(metric_samples(url), "kvrelay_requests_finished_total", **labels))


@contextlib.asynccontextmanager
async def router_client(prefill: list[str], decode: list[str], **cfg):
    """A RouterClient over real workers, built as `run_router` builds it (no HTTP front,
    no tokenizer: requests go to `generate` as token ids). Health checks run only when the
    test calls `router.monitor.check_all()`."""
    from kvrelay.core.clock import MonotonicClock
    from kvrelay.core.config import RouterConfig
    from kvrelay.server.pairing import WorkerTable
    from kvrelay.server.router import RouterClient
    from kvrelay.server.worker_client import WorkerAPI, WorkerMonitor

    config = RouterConfig(prefill=tuple(prefill), decode=tuple(decode), health_timeout=2.0, **cfg)
    api = WorkerAPI(config)
    try:
        clock = MonotonicClock()
        table = WorkerTable(list(prefill), list(decode), clock)
        monitor = WorkerMonitor(table, api, config)
        model, max_model_len = await monitor.wait_ready(60, clock)
        router = RouterClient(config, table, api, monitor, None, model, max_model_len, clock)
        try:
            yield router
        finally:
            await router.close()
    finally:
        await api.close()
