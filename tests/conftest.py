"""Shared fixtures: tiny random-weight models (no download), and engines built on them."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One core per xdist worker: torch's second OpenMP thread only spins against the other
    # worker (20% more CPU for the same in-process tests, measured on 2 cores).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# `make test TEST_WORKERS=2` runs the suite on two pytest-xdist workers. A module is one
# unit of work, so that its module-scoped cluster starts once; modules that share an
# expensive session fixture are one unit, so that it is built once. Units go out longest
# first (the order below, measured with --durations on two workers on 2 cores; then every other
# module in file order), so that no long module starts last while the other worker idles.
SHARED_UNITS = {"tests/test_models.py": "default-model", "tests/test_engine.py": "default-model",
                "tests/test_e2e_disagg.py": "default-serve", "tests/test_e2e_default_model.py": "default-serve"}
LONGEST_FIRST = ("test_chaos.py", "test_e2e_disagg.py", "test_netns.py", "test_sim.py", "test_engine.py",
                 "test_cli.py", "test_cluster.py", "test_router.py", "test_sim_mutants.py", "test_slow_worker.py",
                 "test_kv_int8.py", "test_structured.py", "test_prometheus.py", "test_conformance.py",
                 "test_clients.py", "test_worker_cores.py")


def pytest_collection_modifyitems(items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return   # one process: file order
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: file order otherwise


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SHARED_UNITS.get(module, module)

    config.option.loadscopereorder = False   # keep LONGEST_FIRST
    return ByUnit(config, log)


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


@pytest.fixture(scope="session")
def default_colocated():
    """`kvrelay serve --mode colocated` on the default model (one process), shared by the
    end-to-end modules; each checks that it leaked nothing."""
    from serving_helpers import running_server

    with running_server("--mode", "colocated", "--max-kv-tokens", "16384") as url:
        yield url


@pytest.fixture
def anyio_backend():
    """The anyio-marked tests run on asyncio (the server's loop)."""
    return "asyncio"


@pytest.fixture(scope="module")
def app(tiny_engine):
    """The OpenAI API over the tiny engine, one per test module (a module may define its own)."""
    from kvrelay.server.openai_api import build_openai_app
    return build_openai_app(tiny_engine)
