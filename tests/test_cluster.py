"""Chaos tests on real processes: one prefill worker, two decode workers and a router on a
tiny random model. Each test leaves the cluster healthy and proves nothing leaked."""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster_helpers import LEASE, ROUTER_LEASE, Cluster, finished, phase_gauges


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    c = Cluster(["--model", f"random:{tiny_llama_dir}"], ["--dtype", "float32", "--max-kv-tokens", "16384"])
    try:
        yield c.start()
    finally:
        c.stop()


def stream(url: str, prompt: str, max_tokens: int, *, on_line=None, timeout: float = 120.0) -> dict:
    """One streaming completion: its text, finish reason, error (if any), and whether it
    ended with [DONE]."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    got = {"text": "", "finish": None, "error": None, "done": False, "lines": 0, "ended": None, "id": None,
           "first": None}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            got["error"], got["ended"] = json.loads(r.read())["error"], time.monotonic()
            return got
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                got["done"], got["ended"] = True, time.monotonic()
                break
            chunk = json.loads(data)
            if "error" in chunk:
                got["error"] = chunk["error"]
                continue
            got["lines"] += 1
            got["id"] = chunk["id"]
            got["first"] = got["first"] or time.monotonic()
            for ch in chunk["choices"]:
                got["text"] += ch["text"]
                got["finish"] = ch["finish_reason"] or got["finish"]
            if on_line is not None:
                on_line(got)
    return got


def complete(url: str, prompt: str, max_tokens: int = 8, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                     "ignore_eos": True}, timeout=timeout)


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def whole(url: str, prompt: str, max_tokens: int, timeout: float = 120.0) -> dict:
    """One non-streaming completion: HTTP status, body, Retry-After, and when it ended."""
    r = complete(url, prompt, max_tokens, timeout)
    return {"status": r.status_code, "body": r.json(), "retry_after": r.headers.get("retry-after"),
            "ended": time.monotonic()}


def router_rows(cluster) -> list[dict]:
    return httpx.get(f"{cluster.url}/debug/requests", timeout=10).json()["requests"]


def test_64_concurrent_streams_complete_without_leak(cluster):
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda i: stream(cluster.url, f"request {i}: tell me about the number {i}", 24),
                                range(64)))
    assert all(r["done"] and r["error"] is None and r["finish"] == "length" for r in results), \
        [r for r in results if r["error"]][:3]
    cluster.assert_no_leak()
    # Both decode workers served some of them (pairing by load, not one favourite).
    assert all(finished(d.url, outcome="success") > 0 for d in cluster.decode)


def test_disconnect_frees_both_sides_within_a_second(cluster):
    before = {p.name: finished(p.url, outcome="aborted", reason="aborted") for p in cluster.decode}
    body = {"prompt": "Count forever:", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 10:
                break  # leave with the request still decoding
    left = time.monotonic()
    while any(sum(phase_gauges(p.url).values()) for p in [cluster.router, *cluster.workers]):
        assert time.monotonic() - left < 1.0, cluster.logs()
        time.sleep(0.02)
    after = {p.name: finished(p.url, outcome="aborted", reason="aborted") for p in cluster.decode}
    assert sum(after.values()) == sum(before.values()) + 1
    assert finished(cluster.url, outcome="aborted") >= 1
    cluster.assert_no_leak()


def test_stuck_inflight_transfer_drains_within_the_lease(cluster):
    """D stops acknowledging (it never completes a receive). P's transfer queue drains,
    the client gets an error naming the reason, and the next requests succeed."""
    cluster.set_faults(cluster.decode, "ignore_aux=1")
    try:
        t0 = time.monotonic()
        r = complete(cluster.url, "this transfer is never acknowledged")
        took = time.monotonic() - t0
    finally:
        cluster.set_faults(cluster.decode, "")
    assert r.status_code >= 500
    err = r.json()["error"]
    assert err["code"] in ("transfer_error", "peer_failed") and err["code"] in err["message"]
    # The router tries a second pair once; each attempt is bounded by the lease, not by
    # the 60 s --transfer-timeout.
    assert took < 2 * (LEASE + 2 * 0.5) + 4, took
    p = cluster.prefill[0]
    assert phase_gauges(p.url)["transfer"] == 0
    assert finished(p.url, outcome="failed", reason="transfer_error") >= 1
    ok = [complete(cluster.url, f"after the fault {i}") for i in range(4)]
    assert all(x.status_code == 200 and x.json()["usage"]["completion_tokens"] == 8 for x in ok)
    cluster.assert_no_leak()


def test_debug_view_agrees_with_the_phase_gauges(cluster):
    """Requests held mid-flight (D's destinations are dropped): every worker's
    /debug/requests lists each live request with its deadline and peer, and its rows agree
    with its /metrics phase gauges; the router aggregates them."""
    cluster.set_faults(cluster.decode, "drop:Destination=1")
    threads = [threading.Thread(target=stream, args=(cluster.url, f"held {i}", 4)) for i in range(6)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while sum(phase_gauges(cluster.prefill[0].url).values()) < 6:
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.1)
        for p in cluster.workers:
            view = httpx.get(f"{p.url}/debug/requests", timeout=10).json()
            gauges = phase_gauges(p.url)
            rows = view["requests"]
            counted = {ph: sum(1 for row in rows if row["phase"] == ph) for ph in gauges}
            assert counted == {ph: int(v) for ph, v in gauges.items()}, (p.name, rows, gauges)
            for row in rows:
                assert row["deadline_in"] is not None and row["deadline_in"] > 0
                assert row["rid"] and row["age"] >= 0 and row["backend"]
                # P learns its peer from D's destination; D knows P's from the start.
                assert row["peer"] or (row["side"], row["phase"]) == ("prefill", "bootstrap")
        agg = httpx.get(f"{cluster.url}/debug/requests", timeout=10).json()
        assert agg["count"] == 6
        assert sum(len(w["requests"]) for w in agg["workers"].values()) == 12
    finally:
        cluster.set_faults(cluster.decode, "")
        for t in threads:
            t.join(timeout=60)
    cluster.assert_no_leak()


def test_a_killed_decode_worker(cluster):
    """kill -9 one decode worker under load: each of its requests gets an answer within
    5 s, P frees everything, new requests go to the survivor, and after a restart the
    killed worker rejoins."""
    victim, survivor = cluster.decode
    results: list[dict] = []
    started = threading.Event()
    seen = [0]

    def on_line(got):
        if got["lines"] == 3:
            seen[0] += 1
            if seen[0] >= 8:
                started.set()

    def run(i):
        results.append(stream(cluster.url, f"long request {i}", 900, on_line=on_line))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert started.wait(60), cluster.logs()
    victim.signal(signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 8 and all(r["done"] for r in results)
    broken = [r for r in results if r["error"]]   # the victim's: tokens had reached the client
    assert broken and all(r["error"]["code"] == "peer_failed" for r in broken)
    assert all(r["ended"] - killed < 5.0 for r in broken), [r["ended"] - killed for r in broken]
    assert all(r["finish"] == "length" for r in results if not r["error"])
    p = cluster.prefill[0]
    deadline = time.monotonic() + 2 * LEASE + 3
    while sum(phase_gauges(p.url).values()):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    served_before = finished(survivor.url, outcome="success")
    ok = [complete(cluster.url, f"after the kill {i}") for i in range(4)]
    assert all(x.status_code == 200 for x in ok), [x.text for x in ok]
    assert finished(survivor.url, outcome="success") == served_before + 4
    victim.start().wait_healthy()
    cluster.wait_router_sees_all()
    ok = [complete(cluster.url, f"after the restart {i}") for i in range(6)]
    assert all(x.status_code == 200 for x in ok)
    assert finished(victim.url, outcome="success") > 0
    cluster.assert_no_leak()


def test_a_frozen_prefill_worker(cluster):
    """SIGSTOP the prefill worker while it holds 8 requests (4 streamed, 4 whole; D's
    destinations are dropped, so none has a token), then send 4 more. With no other
    prefill worker, every client gets a 503 peer_failed with Retry-After within the lease
    (P<->D and router->P alike) + 2 s of the freeze or of its own arrival; after SIGCONT
    the worker serves again and nothing leaks."""
    p = cluster.prefill[0]
    bound = max(LEASE, ROUTER_LEASE) + 2.0
    cluster.set_faults(cluster.decode, "drop:Destination=1")
    try:
        with ThreadPoolExecutor(12) as pool:
            open_ = [pool.submit(stream if i % 2 else whole, cluster.url, f"frozen {i}", 8) for i in range(8)]
            deadline = time.monotonic() + 30
            while sum(phase_gauges(p.url).values()) < 8:
                assert time.monotonic() < deadline, cluster.logs()
                time.sleep(0.05)
            p.signal(signal.SIGSTOP)
            frozen = time.monotonic()
            late = [(time.monotonic(), pool.submit(stream, cluster.url, f"frozen late {i}", 8)) for i in range(4)]
            results = [(frozen, f.result(timeout=120)) for f in open_] + [(t, f.result(timeout=120)) for t, f in late]
    finally:
        p.signal(signal.SIGCONT)
        cluster.set_faults(cluster.decode, "")
    for since, r in results:
        err = r["error"] if "error" in r else r["body"].get("error")
        assert err is not None and err["code"] in ("peer_failed", "no_healthy_worker"), r
        assert r["ended"] - since < bound, (r["ended"] - since, r)
        if "status" in r:
            assert r["status"] == 503 and r["retry_after"] == "1", r
    assert any((r.get("error") or r.get("body", {}).get("error"))["code"] == "peer_failed" for _, r in results)
    cluster.wait_router_sees_all()
    # Both sides declared each other dead during the freeze; they re-bootstrap on the next
    # request. A request racing that (seen rarely: peer_failed) is answered with its reason.
    deadline = time.monotonic() + 20
    while (first := complete(cluster.url, "thawed")).status_code != 200:
        assert first.json()["error"]["code"] in ("peer_failed", "no_healthy_worker"), first.text
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.5)
    ok = [complete(cluster.url, f"thawed {i}") for i in range(4)]
    assert all(x.status_code == 200 for x in ok), [x.text for x in ok]
    cluster.assert_no_leak()


def test_a_frozen_decode_worker_holds_no_client_beyond_the_routers_lease(cluster):
    """SIGSTOP a decode worker while it streams some requests, builds whole (non-streamed)
    answers for others, and holds others before their first token. Every client is
    answered within --health-interval x --health-misses + 2 s: a stream that already
    showed tokens ends with peer_failed and [DONE]; every request whose client had seen
    nothing yet (whole answers, streams before their first token) is retried on the other
    decode worker and returns the same text as without the fault. Meanwhile the other
    workers' health checks go on undelayed. After SIGCONT the worker rejoins and nothing
    leaked anywhere."""
    victim, survivor = cluster.decode
    bound = ROUTER_LEASE + 2.0
    long_prompts = [f"frozen decode {i}: count the ways" for i in range(12)]
    held_prompts = [f"held before its first token {i}" for i in range(4)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:   # references, fault-free
        ref = dict(zip(long_prompts + held_prompts,
                       pool.map(lambda p: text_of(complete(cluster.url, p, 300)),
                                long_prompts + held_prompts)))
    fault_free = time.monotonic() - t0
    streams, wholes, held = {}, {}, {}
    with ThreadPoolExecutor(16) as pool:
        for p in long_prompts[:6]:
            streams[p] = pool.submit(stream, cluster.url, p, 300)
        for p in long_prompts[6:]:
            wholes[p] = pool.submit(whole, cluster.url, p, 300)
        deadline = time.monotonic() + 30
        while sum(r["phase"] == "streaming" and r["decode"] == victim.url for r in router_rows(cluster)) < 4:
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.05)
        cluster.set_faults([victim], "drop:Destination=1")   # its next requests wait before any token
        try:
            for p in held_prompts:
                held[p] = pool.submit(stream, cluster.url, p, 300)
            while not any(r["phase"] == "dispatched" and r["decode"] == victim.url for r in router_rows(cluster)):
                assert time.monotonic() < deadline, cluster.logs()
                time.sleep(0.05)
            on_victim = {r["id"]: r["phase"] for r in router_rows(cluster) if r["decode"] == victim.url}
            victim.signal(signal.SIGSTOP)
            frozen = time.monotonic()
            time.sleep(bound)
            others = {w["url"]: w for w in httpx.get(f"{cluster.url}/workers", timeout=5).json()["workers"]}
            results = {p: f.result(timeout=120) for p, f in (*streams.items(), *wholes.items(), *held.items())}
        finally:
            victim.signal(signal.SIGCONT)
            cluster.set_faults([victim], "")
    # The frozen worker is dead to the router; the others kept answering their own checks.
    assert others[victim.url]["dead"] and not others[victim.url]["up"], others
    assert all(w["up"] and w["last_ok_s"] < 2.0 for url, w in others.items() if url != victim.url), others
    streamed_on_victim = [p for p in streams if results[p]["id"] in on_victim]
    assert streamed_on_victim, (on_victim, results)
    # Some whole answers were being decoded there: retried mid-decode, unseen by their client.
    assert any(results[p]["body"]["id"] in on_victim for p in wholes), (on_victim, results)
    for p, got in results.items():
        if p in wholes:
            assert got["status"] == 200, got
            assert got["body"]["choices"][0]["text"] == ref[p]
            assert got["ended"] - frozen < bound + 2 * fault_free, (got["ended"] - frozen, fault_free)
            continue
        assert got["done"], got                       # exactly one end: [DONE] after the last event
        if p in streamed_on_victim:                   # tokens had reached the client: an error now
            assert got["error"]["code"] == "peer_failed" and "is dead" in got["error"]["message"], got
            assert got["ended"] - frozen < bound, got["ended"] - frozen
        else:                                         # nothing had: retried, same tokens
            assert got["error"] is None and got["finish"] == "length", got
            assert got["text"] == ref[p]
            if got["id"] in on_victim:                # held there before its first token
                assert got["first"] - frozen < bound + fault_free, got["first"] - frozen
    assert any(phase == "dispatched" for phase in on_victim.values()), on_victim
    cluster.wait_router_sees_all()
    ok = [complete(cluster.url, f"after the freeze {i}") for i in range(6)]
    assert all(x.status_code == 200 for x in ok), [x.text for x in ok]
    cluster.assert_no_leak()
