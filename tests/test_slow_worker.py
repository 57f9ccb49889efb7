"""No false positives: a prefill worker busy for longer than every lease with one long
prompt, while other requests keep arriving, is never declared dead by its decode peer or
by the router. Its health is answered from the scheduler loop between steps, and each
prefill step is sized to about half a heartbeat interval, so a busy worker keeps its
leases however long the prompt.

A prefill worker heartbeats between the layers of a pass, so a host slower than when the
worker timed its steps eats into the lease one layer at a time: the model's layer count is
the slowdown it tolerates. The wide model below has 12 layers. With 6 (and 6,000 prompt
tokens), two busy-looping processes beside the cluster on 2 cores made a layer outlast
the 1.5 s lease; with 12 layers, three of them did not (time to first token 6.5 s alone,
13 s beside them)."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster_helpers import LEASE, ROUTER_LEASE, Cluster, finished

PROMPT_TOKENS = 4000


@pytest.fixture(scope="module")
def slow_cluster(tmp_path_factory):
    from kvrelay.engine.models.testing import make_tiny_model_dir

    # Wide enough that one long prompt takes several seconds of prefill on one core.
    model = make_tiny_model_dir(tmp_path_factory.mktemp("wide-llama"), arch="llama", seed=1, hidden_size=512,
                                intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)
    c = Cluster(["--model", f"random:{model}"], ["--dtype", "float32", "--max-kv-tokens", "32768"], num_decode=1)
    try:
        yield c.start()
    finally:
        c.stop()


def first_token_and_end(url: str, prompt_ids: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0, got = time.monotonic(), {"ttft": None, "error": None, "tokens": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                got["error"] = chunk["error"]
            elif chunk["choices"][0]["text"] or chunk["choices"][0]["finish_reason"]:
                got["ttft"] = got["ttft"] or time.monotonic() - t0
                got["tokens"] += 1
    return got


def test_a_prefill_longer_than_every_lease_under_load_fails_nothing(slow_cluster):
    c = slow_cluster
    long_prompt = [100 + (i * 7919) % 40000 for i in range(PROMPT_TOKENS)]
    with ThreadPoolExecutor(8) as pool:
        long = pool.submit(first_token_and_end, c.url, long_prompt, 4)
        short = [pool.submit(first_token_and_end, c.url, [200 + i, 300 + i, 400 + i] * 20, 16) for i in range(12)]
        results = [f.result(timeout=300) for f in short]
        got = long.result(timeout=300)
    assert got["error"] is None and got["tokens"] >= 1, got
    # The prefill really outlasted both leases, so a busy loop that stopped heartbeating or
    # answering health checks would have been declared dead.
    assert got["ttft"] > max(LEASE, ROUTER_LEASE) + 1.0, got
    assert all(r["error"] is None and r["tokens"] >= 1 for r in results), results
    for p in [c.router, *c.workers]:
        assert finished(p.url, reason="peer_failed") == 0, p.name
        assert finished(p.url, outcome="failed") == 0, p.name
    workers = httpx.get(f"{c.url}/workers", timeout=5).json()["workers"]
    assert all(w["up"] and not w["dead"] and w["failures"] == 0 for w in workers), workers
    c.assert_no_leak()
