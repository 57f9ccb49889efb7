"""Shared fixtures: tiny random-weight models (no download), and engines built on them."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from kvrelay.engine.models.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir):
    from kvrelay.core.config import ModelOptions
    from kvrelay.engine.loader import load_model

    return load_model(ModelOptions(model=f"random:{tiny_llama_dir}", dtype="float32", seed=0,
                                   served_model_name="tiny-llama"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_loaded):
    """An AsyncEngine on a tiny random Llama (float32, 4096 KV tokens, pages of 16)."""
    from kvrelay.core.config import KVCacheConfig, SchedulerConfig
    from kvrelay.engine.engine import build_engine

    engine = build_engine(tiny_loaded, KVCacheConfig(page_size=16, max_kv_tokens=4096),
                          SchedulerConfig(max_running_requests=32, max_prefill_tokens=1024))
    yield engine
    engine.shutdown()


@pytest.fixture
def anyio_backend():
    """The anyio-marked tests run on asyncio (the server's loop)."""
    return "asyncio"


@pytest.fixture(scope="module")
def app(tiny_engine):
    """The OpenAI API over the tiny engine, one per test module (a module may define its own)."""
    from kvrelay.server.openai_api import build_openai_app
    return build_openai_app(tiny_engine)
