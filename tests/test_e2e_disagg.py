"""End to end on the real default model: `kvrelay serve` (the local cluster, as `make run`
starts it) answers the official openai client, and its greedy output is token for token
what `kvrelay serve --mode colocated` produces, on every transfer backend (10 prompts on
shm, 5 each on tcp and nixl, those two with --verify-kv), with the KV written layer by
layer while prompts compute."""
from __future__ import annotations

import re

import httpx
import pytest
from openai import OpenAI

from serving_helpers import SERVER_LOGS, assert_no_leak, metric_samples, running_server, transfer_bytes, worker_urls

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    "The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):", "1, 2, 3, 4,",
    "Q: What is 7 times 8?\nA:", "Translate to French: good morning", "import numpy as np\n",
    "Once upon a time", "Why is the sky blue?", "In 1969, humans",
]
MAX_TOKENS = 24
SERVER_ARGS = ("--max-kv-tokens", "16384")


def greedy_outputs(url: str, prompts: list[str] = PROMPTS) -> list[list[int]]:
    """One prompt at a time, so both modes run the very same batch shapes."""
    out = []
    with httpx.Client(timeout=120) as client:
        for prompt in prompts:
            r = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                           "temperature": 0, "logprobs": 0})
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            out.append(lp["tokens"])
    return out


# What a cluster did besides the plain path: any of these explains a token that differs.
TELLING = ("kvrelay_requests_finished", "kvrelay_preemptions", "kvrelay_rejected_input",
           "kvrelay_router_prefilled_on_decode")
TELLING_LOG = re.compile(r" (WARNING|ERROR) |attempts=[2-9]")


def divergence(url: str, prompts: list[str], got: list[list[str]], want: dict[str, list[str]]) -> str:
    """'' when each prompt got the colocated tokens; else where each one diverged, with the
    cluster's counters and log lines that tell of retries, preemptions, refused input or
    failures (read while it runs: a flake explains itself)."""
    lines = []
    for prompt, have in zip(prompts, got):
        ref = want[prompt]
        if have != ref:
            i = next((i for i, (a, b) in enumerate(zip(have, ref)) if a != b), min(len(have), len(ref)))
            lines.append(f"{prompt!r}: token {i} is {have[i:i + 1]} where colocated has {ref[i:i + 1]}")
    if not lines:
        return ""
    for u in [url, *worker_urls(url)]:
        for (name, labels), value in sorted(metric_samples(u).items()):
            if name.startswith(TELLING) and not name.endswith("_created") and value:
                lines.append(f"{u} {name}{dict(labels)} = {value:g}")
    log = SERVER_LOGS.get(url)
    text = log.read_text(errors="replace") if log is not None else ""
    lines += [line for line in text.splitlines() if TELLING_LOG.search(line)][-40:]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def colocated_tokens(default_colocated):
    """The colocated server (conftest) runs with SERVER_ARGS too."""
    tokens = greedy_outputs(default_colocated)
    assert_no_leak(default_colocated)
    return tokens


@pytest.fixture(scope="module")
def local_cluster():
    """`kvrelay serve` as `make run` starts it (shm), shared by the tests below."""
    with running_server(*SERVER_ARGS) as url:
        yield url


def test_local_cluster_answers_the_openai_client(local_cluster):
    url = local_cluster
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    assert model == "smollm2-135m-instruct"
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert_no_leak(url)


# shm, the default, on every prompt; the other backends carry the same pages on half of them.
@pytest.mark.parametrize("backend,prompts", [("shm", PROMPTS), ("tcp", PROMPTS[::2]), ("nixl", PROMPTS[1::2])])
def test_same_tokens_as_colocated(backend, prompts, colocated_tokens, request):
    want = dict(zip(PROMPTS, colocated_tokens))

    def check(url: str) -> tuple[list, float, float, str]:
        got = greedy_outputs(url, prompts)
        ahead, total = transfer_bytes(url)
        assert_no_leak(url)
        failed = [(u, labels) for u in [url, *worker_urls(url)] for (name, labels), v in metric_samples(u).items()
                  if name == "kvrelay_requests_finished_total" and v and dict(labels)["outcome"] != "success"]
        assert not failed, failed   # no try failed and was retried out of sight
        return got, ahead, total, divergence(url, prompts, got, want)

    if backend == "shm":
        got, ahead, total, diverged = check(request.getfixturevalue("local_cluster"))
    else:   # the pages D decodes from are checked against P's (a mismatch fails the try)
        with running_server("--transfer-backend", backend, "--verify-kv", *SERVER_ARGS) as url:
            got, ahead, total, diverged = check(url)
    assert 0 < ahead <= total, (backend, ahead, total)   # layer-wise transfer, the default
    assert len(got) == len(prompts)
    assert not diverged, diverged
