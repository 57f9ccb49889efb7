"""Helpers for tests that run kvrelay as real processes."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def _port_block() -> range:
    """Where this test process takes the ports of the servers it starts: a block of its own
    (one per pytest-xdist worker) below the kernel's ephemeral range. A port taken from
    that range (bind to 0) is free only until some other socket takes it, and between the
    choice and the server's bind, the other worker's clients and servers take many."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    with contextlib.suppress(OSError, ValueError):
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        start = 10000 + 2000 * index
        if start + 2000 <= ephemeral:
            return range(start, start + 2000)
    return range(0)


_BLOCK = _port_block()
_next = [0]


def free_port_run(n: int = 1) -> int:
    """A port p such that p .. p + n - 1 are all free now, from this process's block
    (outside it, where a block cannot be had: any free port the kernel gives)."""
    for _ in range(len(_BLOCK) or 50):
        if _BLOCK:
            p = _BLOCK[_next[0] % (len(_BLOCK) - n)]
            _next[0] += n
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                p = s.getsockname()[1]
        try:
            with contextlib.ExitStack() as stack:
                for q in range(p, p + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise AssertionError(f"no run of {n} free ports")


def free_port() -> int:
    return free_port_run(1)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, output) -> None:
    """Until `url`/health answers 200; an AssertionError with `output()` if `proc` exits
    first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited with {proc.returncode}:\n{output()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not become healthy:\n{output()}")
        time.sleep(0.3)


SERVER_LOGS: dict[str, Path] = {}   # base URL -> the output file of the server running there


@contextlib.contextmanager
def running_server(*args: str, ready_timeout: float = 180.0):
    """Start `python -m kvrelay serve ...` on a free port; yield its base URL; stop it. Its
    output goes to a file (SERVER_LOGS[url] while it runs): a pipe nobody reads would fill
    up under logging and block it."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="kvrelay-serve-") as tmp:
        log = Path(tmp) / "serve.log"
        with open(log, "w") as out:
            colocated = "colocated" in args   # one process: no workers, and the flag is refused
            base = () if "--worker-base-port" in args or colocated else ("--worker-base-port", str(free_port_run(4)))
            proc = subprocess.Popen([sys.executable, "-m", "kvrelay", "serve", "--port", str(port), *base, *args],
                                    stdout=out, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        SERVER_LOGS[url] = log
        try:
            wait_healthy(proc, url, ready_timeout, lambda: log.read_text(errors="replace"))
            yield url
        finally:
            SERVER_LOGS.pop(url, None)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def gauge(samples, name: str, **labels) -> list[float]:
    want = set(labels.items())
    return [v for (n, ls), v in samples.items() if n == name and want <= set(ls)]


def worker_urls(url: str) -> list[str]:
    """The workers behind a router (its GET /workers); none for a colocated server."""
    r = httpx.get(f"{url}/workers", timeout=10)
    return [w["url"] for w in r.json()["workers"]] if r.status_code == 200 else []


def transfer_bytes(url: str) -> tuple[float, float]:
    """(KV bytes written ahead, all KV bytes written) by the workers behind router `url`:
    what layer-wise transfer sent while prompts computed, out of everything sent."""
    ahead = total = 0.0
    for u in worker_urls(url):
        s = metric_samples(u)
        ahead += sum(gauge(s, "kvrelay_transfer_ahead_bytes_total"))
        total += sum(gauge(s, "kvrelay_transfer_bytes_total"))
    return ahead, total


def assert_no_leak(url: str, timeout: float = 10.0) -> None:
    """On the server and every worker behind it: every phase gauge 0 and free pages ==
    pool pages (waiting briefly for aborts to land). A router has no pool to report."""
    deadline = time.monotonic() + timeout
    workers = worker_urls(url)
    for u in [url, *workers]:
        while True:
            s = metric_samples(u)
            phases = gauge(s, "kvrelay_requests")
            free, total = gauge(s, "kvrelay_kv_pages_free"), gauge(s, "kvrelay_kv_pages_capacity")
            pool = bool(total) or (u == url and bool(workers))
            if phases and all(v == 0 for v in phases) and free == total and pool:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"leak at {u}: phase gauges {phases}, free pages {free}, total pages {total}")
            time.sleep(0.2)


async def call_asgi(app, path: str, body: dict, disconnect_after_chunks: int, spec: str = "2.3",
                    headers: dict[str, str] | None = None) -> list[dict]:
    """Drive the ASGI app directly: the client sends `body`, then disconnects once it has
    received `disconnect_after_chunks` response body messages (0: right after sending).
    Starlette cancels a stream on disconnect under ASGI spec < 2.4 only; kvrelay must
    abort under both. `headers`: extra request headers (e.g. Authorization)."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": b"", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                         *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())],
             "client": ("127.0.0.1", 1), "server": ("kvrelay", 80)}
    sent: list[dict] = []
    gone = asyncio.Event()
    if disconnect_after_chunks == 0:
        gone.set()
    request_sent = False

    async def receive():
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and len(sent) > disconnect_after_chunks:
            gone.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=60)
    return sent
