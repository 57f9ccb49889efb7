"""On a CUDA device (`pytest -m gpu`; deselected where torch sees none): a model served with
`--device cuda`, colocated and disaggregated over `cuda_ipc` (two processes, one GPU: P
writes into D's pool through its IPC handle), answering the openai client with the same
greedy tokens (the cuda_ipc data path on its own: tests/test_cuda_ipc.py). The model is a
tiny random checkpoint: the default model's package cannot travel to a GPU machine that
downloads nothing (benchmarks/gpu/prepare.sh)."""
from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from serving_helpers import assert_no_leak, running_server, transfer_bytes
from test_e2e_disagg import PROMPTS, greedy_outputs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_args(tiny_llama_dir):
    return ("--device", "cuda", "--dtype", "bfloat16", "--model", str(tiny_llama_dir), "--max-kv-tokens", "16384")


@pytest.fixture(scope="module")
def colocated_cuda(gpu_args):
    with running_server("--mode", "colocated", *gpu_args) as url:
        yield url


def test_colocated_on_cuda_answers_the_openai_client(colocated_cuda):
    client = OpenAI(base_url=f"{colocated_cuda}/v1", api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=16, temperature=0)
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content
    health = httpx.get(f"{colocated_cuda}/health", timeout=30).json()
    assert health["device"].startswith("cuda") and health["kernels"] == "torch", health
    assert_no_leak(colocated_cuda)


def test_disaggregated_over_cuda_ipc_returns_colocated_tokens(colocated_cuda, gpu_args):
    expected = greedy_outputs(colocated_cuda, PROMPTS[:5])
    with running_server("--transfer-backend", "cuda_ipc", *gpu_args) as url:
        assert greedy_outputs(url, PROMPTS[:5]) == expected
        ahead, total = transfer_bytes(url)
        assert 0 < ahead <= total   # layer-wise transfer, on by default: a fenced read mid-pass
        assert_no_leak(url)
    assert_no_leak(colocated_cuda)


def test_disaggregated_over_tcp_stages_device_pages(colocated_cuda, gpu_args):
    """tcp moves a GPU pool's pages through pinned host buffers: same tokens."""
    expected = greedy_outputs(colocated_cuda, PROMPTS[5:8])
    with running_server("--transfer-backend", "tcp", *gpu_args) as url:
        assert greedy_outputs(url, PROMPTS[5:8]) == expected
        assert_no_leak(url)
