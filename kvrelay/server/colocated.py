"""`kvrelay serve --mode colocated`: one process loads the model and serves the API."""
from __future__ import annotations

import logging

from kvrelay.core.config import KVRelayConfig
from kvrelay.engine.engine import AsyncEngine, build_engine
from kvrelay.engine.loader import load_model
from kvrelay.server.openai_api import build_openai_app
from kvrelay.server.startup import load_with_progress, run_uvicorn, startup_line


def serve_colocated(config: KVRelayConfig) -> None:
    loaded = load_with_progress(load_model, config.model)
    engine: AsyncEngine = build_engine(loaded, config.kv, config.scheduler)
    app = build_openai_app(engine)
    srv = config.server
    print(startup_line("colocated", loaded, engine.core.capacity_tokens, f"http://{srv.host}:{srv.port}"), flush=True)
    try:
        run_uvicorn(app, srv)
    finally:
        engine.shutdown()
        logging.getLogger("kvrelay").info("engine stopped")
