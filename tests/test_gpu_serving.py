"""On a CUDA device (`pytest -m gpu`; deselected where torch sees none): the default model
served with `--device cuda`, colocated and disaggregated over `cuda_ipc` (two processes,
one GPU: P writes into D's pool through its IPC handle), answering the openai client with
the same greedy tokens (the cuda_ipc data path on its own: tests/test_cuda_ipc.py)."""
from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from serving_helpers import assert_no_leak, running_server
from test_e2e_disagg import PROMPTS, greedy_outputs

pytestmark = pytest.mark.gpu

GPU_ARGS = ("--device", "cuda", "--max-kv-tokens", "16384")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def colocated_cuda():
    with running_server("--mode", "colocated", *GPU_ARGS) as url:
        yield url


def test_colocated_on_cuda_answers_the_openai_client(colocated_cuda):
    client = OpenAI(base_url=f"{colocated_cuda}/v1", api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    health = httpx.get(f"{colocated_cuda}/health", timeout=30).json()
    assert "cuda" in str(health), health    # /health reports the device it computes on
    assert_no_leak(colocated_cuda)


def test_disaggregated_over_cuda_ipc_returns_colocated_tokens(colocated_cuda):
    expected = greedy_outputs(colocated_cuda, PROMPTS[:5])
    with running_server("--transfer-backend", "cuda_ipc", *GPU_ARGS) as url:
        assert greedy_outputs(url, PROMPTS[:5]) == expected
        assert_no_leak(url)
    assert_no_leak(colocated_cuda)
