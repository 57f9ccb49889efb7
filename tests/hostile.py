"""Hostile and careless clients against a real `kvrelay serve` (issue #53's acceptance):
`make hostile`, or

    python tests/hostile.py [--short] [--only NAME ...] [--model random:DIR | default]

One `kvrelay serve` (a keyed cluster, loopback only). For each attack in turn, four
streamed completions start, the attack runs while they stream, and then every stream must
end `stop` or `length` with no error event. The attacks:

    big-prompts   three clients each send a 4 MB chat message at once (a 400 each)
    big-tokenize  a 4 MB POST /tokenize (a 400)
    junk-frames   junk at full speed on the prefill and decode workers' transfer ports:
                  zmq senders without the cluster key (one-byte frames) and raw TCP bytes
    endless       3 zmq connections sending one multipart message of 1 MiB frames that
                  never ends, to the decode worker: its RSS grows less than 50 MB
    idle-conns    3,000 idle TCP connections to the router and to each worker's HTTP
                  port, plus header-trickling ones; /health stays 200 JSON meanwhile
    scrapes       200 scrapes a second of every /metrics (router, each worker)
    lexer-grammar a regex that hits llguidance's lexer limit (a 400, never a 500)
    big-batch     a 256-prompt completion; another client is still admitted

After all of them: no worker was declared dead by the router (its lease expiries stayed
0), nothing leaked, and a fresh request succeeds. `--short` shortens every attack (the
test suite's version: tests/test_hostile.py).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_helpers import assert_no_leak, gauge, metric_samples, running_server  # noqa: E402

STREAM_TOKENS = 2000          # each background stream (tiny model: about 7 s at 4 streams)
SHORT_STREAM_TOKENS = 800     # --short: about 3 s, as long as its attacks
BIG = 4_000_000               # characters of a "4 MB" prompt
CLIENT_TIMEOUT = 120.0


@dataclass
class Stream:
    """One background streamed completion and how it ended."""
    finish: str | None = None
    error: str | None = None
    chunks: int = 0


@dataclass
class Outcome:
    attack: str
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- the four streams
def stream_one(url: str, i: int, out: Stream, max_tokens: int) -> None:
    body = {"model": None, "prompt": f"Story {i}: the river ran past seven bridges", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        with httpx.Client(timeout=CLIENT_TIMEOUT) as c:
            body["model"] = c.get(f"{url}/v1/models").json()["data"][0]["id"]
            with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    out.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out.error = json.dumps(chunk["error"])[:300]
                    for choice in chunk.get("choices", []):
                        out.chunks += 1
                        out.finish = choice.get("finish_reason") or out.finish
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"


def with_streams(url: str, attack, max_tokens: int) -> tuple[list[Stream], object]:
    """Start four streams, run `attack()` while they stream, wait for them."""
    streams = [Stream() for _ in range(4)]
    threads = [threading.Thread(target=stream_one, args=(url, i, s, max_tokens), daemon=True)
               for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    time.sleep(0.5)   # every stream is under way
    result = attack()
    for t in threads:
        t.join(CLIENT_TIMEOUT)
    return streams, result


def stream_problems(streams: list[Stream]) -> list[str]:
    return [f"stream {i}: finish {s.finish}, error {s.error}" for i, s in enumerate(streams)
            if s.error or s.finish not in ("stop", "length")]


# ---------------------------------------------------------------- the cluster
@dataclass
class Target:
    url: str
    workers: list[dict]     # GET /workers rows: url, role, health (transfer_address, ...)

    def role(self, role: str) -> dict:
        return next(w for w in self.workers if w["role"] == role)

    @staticmethod
    def transfer(w: dict) -> tuple[str, int]:
        host, port = w["health"]["transfer_address"].removeprefix("tcp://").rsplit(":", 1)
        return host, int(port)

    @staticmethod
    def http(w: dict) -> tuple[str, int]:
        host, port = w["url"].removeprefix("http://").rsplit(":", 1)
        return host, int(port)


def target(url: str) -> Target:
    return Target(url, httpx.get(f"{url}/workers", timeout=10).json()["workers"])


def pid_listening(port: int) -> int | None:
    """The pid of the process with a listening TCP socket on `port` (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").rstrip("]") in inodes:
                    return int(pid)
        except OSError:
            continue
    return None


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


# ---------------------------------------------------------------- the attacks
def chat_body(t: Target, content: str, **extra) -> dict:
    return {"model": t.role("decode")["health"]["model"], "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, **extra}


def big_prompts(t: Target, short: bool, o: Outcome) -> None:
    text = "word " * (BIG // 5)
    results: list[int] = [0, 0, 0]

    def send(i: int) -> None:
        results[i] = httpx.post(f"{t.url}/v1/chat/completions", json=chat_body(t, text), timeout=CLIENT_TIMEOUT).status_code
    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    o.notes.append(f"statuses {results}")
    if results != [400, 400, 400]:
        o.problems.append(f"4 MB prompts answered {results}, not three 400s")


def big_tokenize(t: Target, short: bool, o: Outcome) -> None:
    r = httpx.post(f"{t.url}/tokenize", json={"prompt": "word " * (BIG // 5)}, timeout=CLIENT_TIMEOUT)
    o.notes.append(f"status {r.status_code}")
    if r.status_code != 400 or r.json()["error"]["code"] != "context_length_exceeded":
        o.problems.append(f"a 4 MB /tokenize answered {r.status_code}: {r.text[:200]}")


def _flood_zmq(host: str, port: int, stop: threading.Event, counts: list[int]) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.connect(f"tcp://{host}:{port}")
    while not stop.is_set():
        try:
            s.send(b"x", zmq.NOBLOCK)
            counts[0] += 1
        except zmq.Again:
            time.sleep(0.001)
    s.close(0)
    ctx.term()


def _flood_tcp(host: str, port: int, stop: threading.Event, counts: list[int]) -> None:
    junk = random.Random(port).randbytes(65536)
    while not stop.is_set():
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                while not stop.is_set():
                    s.sendall(junk)
                    counts[1] += 1
        except OSError:
            time.sleep(0.01)   # the peer dropped the connection: connect again


def junk_frames(t: Target, short: bool, o: Outcome) -> None:
    stop, counts = threading.Event(), [0, 0]
    ports = [t.transfer(t.role(role)) for role in ("prefill", "decode")]
    threads = [threading.Thread(target=fn, args=(*hp, stop, counts), daemon=True)
               for hp in ports for fn in (_flood_zmq, _flood_zmq, _flood_tcp)]
    for th in threads:
        th.start()
    time.sleep(2.0 if short else 10.0)
    scrape = httpx.get(f"{t.role('decode')['url']}/metrics", timeout=10)   # D answers during the flood
    stop.set()
    for th in threads:
        th.join(10)
    o.notes.append(f"{counts[0]} zmq frames queued, {counts[1]} x 64 KiB of raw TCP")
    if scrape.status_code != 200:
        o.problems.append(f"the decode worker's /metrics answered {scrape.status_code} during the flood")


def endless(t: Target, short: bool, o: Outcome) -> None:
    import zmq

    d = t.role("decode")
    pid = pid_listening(t.http(d)[1])
    before = rss_mb(pid)
    ctx, frame, sent = zmq.Context(), b"\0" * (1 << 20), [0]
    socks = []
    for _ in range(3):
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.connect("tcp://%s:%d" % t.transfer(d))
        socks.append(s)
    end = time.monotonic() + (2.5 if short else 10.0)
    while time.monotonic() < end:
        for s in socks:
            try:
                s.send(frame, zmq.SNDMORE | zmq.NOBLOCK)
                sent[0] += 1
            except zmq.Again:
                time.sleep(0.01)
    grown = rss_mb(pid) - before
    for s in socks:
        s.close(0)
    ctx.term()
    o.notes.append(f"{sent[0]} frames of 1 MiB taken by the senders' zmq; decode worker RSS "
                   f"{before:.0f} -> {before + grown:.0f} MB")
    if grown >= 50:
        o.problems.append(f"the decode worker's RSS grew {grown:.0f} MB under unauthenticated frames")


def _open_idle(host: str, port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        try:
            out.append(socket.create_connection((host, port), timeout=5))
        except OSError:
            break
    return out


def idle_conns(t: Target, short: bool, o: Outcome) -> None:
    n = 3000
    ends = [("router", *t.http({"url": t.url})), *((w["role"], *t.http(w)) for w in t.workers)]
    held = {name: _open_idle(host, port, n) for name, host, port in ends}
    trickle = [socket.create_connection(t.http({"url": t.url})) for _ in range(20)]
    checks = []
    for _ in range(2 if short else 6):
        for name, host, port in ends:
            r = httpx.get(f"http://{host}:{port}/health", timeout=10)
            checks.append((name, r.status_code, r.headers.get("content-type", "")))
        for s in trickle:
            try:
                s.send(b"G")
            except OSError:
                pass
        time.sleep(1.0)
    o.notes.append(", ".join(f"{name}: {len(socks)} opened" for name, socks in held.items()))
    bad = [c for c in checks if c[1] != 200 or "json" not in c[2]]
    if bad:
        o.problems.append(f"/health during the flood: {bad[:4]}")
    for socks in [*held.values(), trickle]:
        for s in socks:
            s.close()


def _scrape(host: str, port: int, rate: float, end: float, statuses: list[int]) -> None:
    """GET /metrics `rate` times a second until `end`, on one keep-alive connection."""
    import http.client

    conn, due = http.client.HTTPConnection(host, port, timeout=10), time.monotonic()
    while due < end:
        try:
            conn.request("GET", "/metrics")
            r = conn.getresponse()
            r.read()
            statuses.append(r.status)
        except (OSError, http.client.HTTPException):
            statuses.append(0)
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=10)
        due += 1 / rate
        time.sleep(max(0.0, due - time.monotonic()))
    conn.close()


SCRAPERS = 60   # connections per process: a scrape may wait up to a render spacing for its answer


def scrapes(t: Target, short: bool, o: Outcome) -> None:
    """200 scrapes a second of each process's /metrics, offered whatever the answers'
    latency (SCRAPERS connections of 200 / SCRAPERS a second each)."""
    seconds = 2.0 if short else 8.0
    end, ends = time.monotonic() + seconds, [t.http({"url": t.url}), *(t.http(w) for w in t.workers)]
    statuses: dict[tuple, list[int]] = {hp: [] for hp in ends}
    threads = [threading.Thread(target=_scrape, args=(*hp, 200.0 / SCRAPERS, end, statuses[hp]), daemon=True)
               for hp in ends for _ in range(SCRAPERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(seconds + 30)
    rates = [len(v) / seconds for v in statuses.values()]
    o.notes.append("scrapes/s " + ", ".join(f"{r:.0f}" for r in rates))
    failed = sum(len(v) - v.count(200) for v in statuses.values())
    if failed:
        o.problems.append(f"{failed} scrapes failed")


def lexer_grammar(t: Target, short: bool, o: Outcome) -> None:
    body = chat_body(t, "say a lot of a", max_tokens=16,
                     response_format={"type": "regex", "regex": "(a{1000}){1000}b"})
    r = httpx.post(f"{t.url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT)
    o.notes.append(f"status {r.status_code}")
    if r.status_code != 400:
        o.problems.append(f"the lexer-limit grammar answered {r.status_code}: {r.text[:200]}")


def big_batch(t: Target, short: bool, o: Outcome) -> None:
    model = t.role("decode")["health"]["model"]
    batch = {"model": model, "prompt": [f"prompt {i}" for i in range(256)], "max_tokens": 8}
    results = {}

    def send() -> None:
        results["batch"] = httpx.post(f"{t.url}/v1/completions", json=batch, timeout=CLIENT_TIMEOUT).status_code
    th = threading.Thread(target=send)
    th.start()
    time.sleep(0.3)
    other = httpx.post(f"{t.url}/v1/completions", json={"model": model, "prompt": "another client",
                                                         "max_tokens": 4}, timeout=CLIENT_TIMEOUT)
    th.join()
    o.notes.append(f"batch {results.get('batch')}, another client {other.status_code}")
    if other.status_code != 200:
        o.problems.append(f"another client got {other.status_code} beside a 256-prompt batch: {other.text[:200]}")
    if results.get("batch") not in (200, 503):
        o.problems.append(f"the 256-prompt batch answered {results.get('batch')}")


ATTACKS = {"big-prompts": big_prompts, "big-tokenize": big_tokenize, "junk-frames": junk_frames,
           "endless": endless, "idle-conns": idle_conns, "scrapes": scrapes, "lexer-grammar": lexer_grammar,
           "big-batch": big_batch}


def lease_expiries(url: str) -> float:
    return sum(gauge(metric_samples(url), "kvrelay_router_lease_expiries_total"))


def run_attacks(url: str, names: list[str], short: bool, max_tokens: int | None = None) -> list[Outcome]:
    """Every attack in `names` in turn, four streams beside each; then the cluster-wide checks."""
    t, outcomes = target(url), []
    max_tokens = max_tokens or (SHORT_STREAM_TOKENS if short else STREAM_TOKENS)
    for name in names:
        o = Outcome(name)
        start = time.monotonic()
        streams, _ = with_streams(url, lambda: ATTACKS[name](t, short, o), max_tokens)
        o.seconds = time.monotonic() - start
        o.problems += stream_problems(streams)
        outcomes.append(o)
    end = Outcome("afterwards")
    if (gone := lease_expiries(url)) != 0:
        end.problems.append(f"the router declared {gone:g} worker(s) dead")
    try:
        assert_no_leak(url, timeout=30)
    except AssertionError as exc:
        end.problems.append(str(exc))
    r = httpx.post(f"{url}/v1/completions", json={"model": t.role("decode")["health"]["model"], "prompt": "fresh",
                                                  "max_tokens": 4}, timeout=CLIENT_TIMEOUT)
    if r.status_code != 200:
        end.problems.append(f"a fresh request answered {r.status_code}")
    return outcomes + [end]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="shorter attacks (the test suite's version)")
    ap.add_argument("--only", nargs="+", choices=sorted(ATTACKS), help="run only these attacks")
    ap.add_argument("--model", default=None, help="random:DIR, or 'default' for the default model "
                    "(default: a tiny random model made now)")
    ap.add_argument("--stream-tokens", type=int, default=None,
                    help=f"tokens of each background stream (default {STREAM_TOKENS}, --short {SHORT_STREAM_TOKENS})")
    args = ap.parse_args(argv)
    if args.model == "default":
        model = []
    else:
        if args.model is None:
            import tempfile

            from kvrelay.engine.models.testing import make_tiny_model_dir
            path = make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="kvrelay-hostile-")) / "tiny", arch="llama",
                                       seed=0, max_position_embeddings=8192)
            args.model = f"random:{path}"
        model = ["--model", args.model, "--dtype", "float32"]
    with running_server(*model) as url:
        outcomes = run_attacks(url, args.only or list(ATTACKS), args.short, args.stream_tokens)
    for o in outcomes:
        print(f"{o.attack:14} {'FAIL' if o.problems else 'ok':4} {o.seconds:6.1f} s  {'; '.join(o.notes)}")
        for p in o.problems:
            print(f"    {p}")
    return 1 if any(o.problems for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
