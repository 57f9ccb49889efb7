"""`kvrelay serve --mode colocated`: one process loads the model and serves the API."""
from __future__ import annotations

from kvrelay.core.config import KVRelayConfig
from kvrelay.engine import kernels
from kvrelay.engine.core import EngineCore
from kvrelay.engine.engine import AsyncEngine
from kvrelay.engine.loader import load_model
from kvrelay.obs.metrics import ServingMetrics
from kvrelay.server.observe import observability_router
from kvrelay.server.openai_api import build_openai_app
from kvrelay.server.security import Gate, api_gate, check_tls
from kvrelay.server.startup import load_with_progress, run_uvicorn, serving_url, startup_line

PHASES = ("waiting", "running")


def colocated_app(engine: AsyncEngine, gate: Gate | None = None, allowed_origins: tuple[str, ...] = ()):
    """The API of one engine, with /metrics and /debug/requests, behind `gate`; CORS for `allowed_origins`."""
    metrics = ServingMetrics("colocated", PHASES, lambda: engine.published.snapshot)
    engine.core.metrics = metrics  # set before the first request is served

    async def debug_rows() -> list[dict]:
        return await engine.acall(lambda core: core.debug_rows(), readonly=True)

    return build_openai_app(engine, extra_routes=[observability_router(metrics, debug_rows)], gate=gate,
                            allowed_origins=allowed_origins, health_info=engine.core.compute_info())


def serve_colocated(config: KVRelayConfig) -> None:
    """Raises StartupError."""
    gate = api_gate(config.security)   # bad keys or TLS files fail before the model loads
    check_tls(config.security)

    def build_core() -> EngineCore:  # runs on the engine thread: it alone touches torch
        return EngineCore(load_with_progress(load_model, config.model), config.kv, config.scheduler)

    engine = AsyncEngine(build_core)
    app = colocated_app(engine, gate, config.server.allowed_origins)
    srv = config.server
    print(startup_line("colocated", engine.core.compute_info(), engine.core.loaded.name,
                       engine.core.capacity_tokens, serving_url(srv, config.security), kernels.fallback_reason()),
          flush=True)
    try:
        run_uvicorn(app, srv, config.security)
    finally:
        engine.shutdown()
