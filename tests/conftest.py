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

# `make test` runs the suite on two pytest-xdist workers (TEST_WORKERS). A module is one
# unit of work, so that its module-scoped cluster starts once; modules that share an
# expensive session fixture are one unit, so that it is built once.
SHARED_UNITS = {"tests/test_models.py": "default-model", "tests/test_engine.py": "default-model",
                "tests/test_e2e_disagg.py": "default-serve", "tests/test_e2e_default_model.py": "default-serve"}
# Modules that hold real processes to short leases or answer-time bounds: on a machine
# loaded twice over they missed them (router retries, 0.6 s worker leases, chaos answer
# bounds), so they run alone. Invariant: while one of them runs, no other module runs (the
# scheduler below sends them last, all to one worker, and `_unit_lock` holds the other
# worker's last modules off).
ALONE = ("test_chaos.py", "test_netns.py", "test_hostile.py", "test_cluster.py", "test_router.py", "test_slow_worker.py",
         "test_worker_cores.py", "test_disagg_invariants.py", "test_transfer_progress.py", "test_late_write.py",
         "test_backends.py")
# The other units go out longest first (measured with a per-module clock on 2 cores; then
# every other module in file order), so that no long one starts last while a worker idles.
LONGEST_FIRST = ("test_e2e_disagg.py", "test_sim.py", "test_cli.py", "test_engine.py", "test_sim_mutants.py",
                 "test_kv_int8.py", "test_structured.py", "test_loader.py", "test_conformance.py",
                 "test_clients.py", "test_prometheus.py", "test_n_choices.py", "test_models.py", "test_api.py",
                 "test_sampling_knobs.py")


def _alone(path) -> bool:
    return os.path.basename(str(path).split("::", 1)[0]) in ALONE


def pytest_collection_modifyitems(config, items):
    # gpu-marked tests need a CUDA device: deselected (not skipped) unless `-m` names gpu.
    if "gpu" not in (config.getoption("markexpr") or ""):
        gpu = [item for item in items if item.get_closest_marker("gpu")]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if not item.get_closest_marker("gpu")]
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return   # one process: file order
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # stable: file order otherwise; the modules that run alone come last, in file order
    items.sort(key=lambda item: (_alone(item.path), rank.get(item.path.name, len(rank))))


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        """Units in collection order; once the next one must run alone, every other worker
        is told to stop after what it holds, and this worker takes the rest in turn."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SHARED_UNITS.get(module, module)

        def _assign_work_unit(self, node) -> None:
            if node.shutting_down:
                return   # told to stop (another worker runs the modules that run alone)
            if _alone(next(iter(self.workqueue))):
                for other in self.nodes:
                    if other is not node and not other.shutting_down:
                        other.shutdown()
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False   # keep the order above
    return ByUnit(config, log)


@pytest.fixture(scope="module", autouse=True)
def _unit_lock(request, tmp_path_factory):
    """Under xdist, a module that must run alone holds an exclusive lock for its whole
    module (fixtures included), every other module a shared one: a worker still finishing
    its last modules when the other starts the lone ones holds them off until it is done."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import fcntl

    path = tmp_path_factory.getbasetemp().parent / "unit.lock"   # the run's directory, shared by the workers
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if _alone(request.node.path) else fcntl.LOCK_SH)
        yield


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
