"""End to end on the real default model (SmolLM2-135M-Instruct from the GGUF package):
`kvrelay serve` as a process, the official openai client, bad input, disconnect, no leak."""
from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from serving_helpers import assert_no_leak, gauge, metric_samples

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def server(default_colocated):
    return default_colocated


def test_openai_client_chat_mentions_paris(server):
    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = client.models.list().data[0].id
    assert model == "smollm2-135m-instruct"
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text and text == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert_no_leak(server)


def test_bad_input_gets_openai_errors_and_server_keeps_serving(server):
    bad = [(b"{not json", 400), (b'{"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": -1}', 400),
           (b'{"model": "smollm2-135m-instruct", "prompt": "hi", "temperature": "hot"}', 400),
           (b'{"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 100000000}', 400),
           (b'{"model": "no-such-model", "prompt": "hi"}', 404)]
    for body, status in bad:
        r = httpx.post(f"{server}/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, body
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    ok = httpx.post(f"{server}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                      "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert_no_leak(server)


def test_disconnect_mid_stream_frees_the_request(server):
    body = {"prompt": "Count from one to one thousand:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break  # leave with the request still generating
    assert_no_leak(server, timeout=5)
    aborted = gauge(metric_samples(server), "kvrelay_requests_finished_total", outcome="aborted")
    assert sum(aborted) >= 1
