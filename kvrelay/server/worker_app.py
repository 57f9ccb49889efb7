"""`kvrelay prefill` and `kvrelay decode`: one worker process, its engine thread (which also
steps the lifecycle and heartbeats its peers), and the HTTP endpoints the router calls
(protocol in `server.worker_protocol`).

Every route reads worker state through `AsyncEngine.call`, i.e. on the engine thread
between steps: a worker whose loop hangs stops answering /health, and the router drops it.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from typing import AsyncIterator

from fastapi import APIRouter, FastAPI
from fastapi.responses import StreamingResponse

from kvrelay.core.config import KVRelayConfig
from kvrelay.disagg.decode_worker import DecodeCore
from kvrelay.disagg.faults import FaultSpec
from kvrelay.disagg.prefill_worker import PrefillCore
from kvrelay.disagg.worker_core import WorkerCore
from kvrelay.engine.engine import AsyncEngine
from kvrelay.engine.loader import load_model
from kvrelay.engine.types import FinishReason, GenerateRequest, RequestRejected, StepOutput
from kvrelay.obs.logs import setup_logging
from kvrelay.obs.metrics import ServingMetrics
from kvrelay.server.errors import StartupError, install_handlers, invalid
from kvrelay.server.observe import observability_router
from kvrelay.server.startup import load_with_progress, run_uvicorn, startup_line
from kvrelay.server.worker_protocol import AbortRequest, FaultsRequest, LegRequest, WorkerHealth, output_to_json

log = logging.getLogger("kvrelay.worker")

CORES: dict[str, type[WorkerCore]] = {"prefill": PrefillCore, "decode": DecodeCore}


def check_fault_injection(config: KVRelayConfig) -> None:
    """Fault injection exists only on purpose, and only on one host: nothing without a
    key may switch faults on over the network. Raises StartupError."""
    transfer, srv = config.transfer, config.server
    asked = transfer.fault_spec or os.environ.get("KVRELAY_FAULTS")
    if asked and not transfer.enable_fault_injection:
        raise StartupError("a fault spec (--fault-spec or KVRELAY_FAULTS) needs --enable-fault-injection")
    if transfer.enable_fault_injection and not (_loopback(srv.host) and _loopback(transfer.transfer_host)):
        raise StartupError("--enable-fault-injection needs --host and --transfer-host on loopback (127.0.0.1): "
                           "anyone who reaches the port could switch faults on")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def worker_app(engine: AsyncEngine, metrics: ServingMetrics, faults: bool = False) -> FastAPI:
    """`faults`: serve POST /debug/faults (--enable-fault-injection)."""
    core: WorkerCore = engine.core  # read only through engine.call (the engine thread)
    app = FastAPI(title=f"kvrelay {core.role} worker")
    install_handlers(app)
    routes = APIRouter()

    async def on_engine(fn, timeout: float = 30.0):
        return await asyncio.to_thread(engine.call, fn, timeout)

    @routes.post("/generate")
    async def generate(body: LegRequest) -> StreamingResponse:
        greq = GenerateRequest(body.rid, tuple(body.prompt_ids), body.sampling.params())
        core.validate_leg(greq)  # fixed state only: a leg that can never run is a 400 now
        kwargs = {"room": body.room}
        if core.role == "decode":
            if not body.prefill_address:
                raise RequestRejected("a decode leg needs prefill_address", param="prefill_address")
            kwargs["prefill_address"] = body.prefill_address
        return StreamingResponse(_lines(engine, greq, kwargs), media_type="application/x-ndjson")

    @routes.post("/abort")
    async def abort(body: AbortRequest) -> dict:
        return {"aborted": await on_engine(lambda c: c.abort_leg(body.rid))}

    @routes.get("/health")
    async def health() -> dict:
        return WorkerHealth(**await on_engine(lambda c: c.health(), timeout=10.0)).model_dump()

    async def set_faults(body: FaultsRequest) -> dict:
        """Replace this worker's fault-injection spec at run time (chaos tests, drills);
        an empty spec switches every fault off."""
        try:
            spec = FaultSpec.parse(body.spec)
        except ValueError as exc:
            raise invalid(str(exc), "spec") from None
        await on_engine(lambda c: setattr(c.manager.faults, "spec", spec))
        return {"spec": body.spec}

    async def debug_view() -> dict:
        return await on_engine(lambda c: c.debug_view())

    if faults:
        routes.add_api_route("/debug/faults", set_faults, methods=["POST"])

    app.include_router(routes)
    app.include_router(observability_router(metrics, debug_view))
    return app


async def _lines(engine: AsyncEngine, greq: GenerateRequest, kwargs: dict) -> AsyncIterator[str]:
    """The leg's outputs as NDJSON. Leaving early (the router closed the stream) aborts
    the leg: `AsyncEngine.generate` sends the abort when it is closed unfinished."""
    gen = engine.generate(greq, **kwargs)
    try:
        async for out in gen:
            yield output_to_json(out)
    except RequestRejected as exc:  # lost a race (same room or rid added twice)
        yield output_to_json(StepOutput(greq.rid, finish_reason=FinishReason.ERROR,
                                        error=f"invalid_request: {exc}"))
    finally:
        await gen.aclose()


def serve_worker(config: KVRelayConfig, role: str) -> None:
    check_fault_injection(config)
    setup_logging(config.server.log_level)
    cls = CORES[role]
    metrics = ServingMetrics(role, cls.PHASES, lambda: engine.call(lambda c: c.snapshot(), timeout=10))

    def build_core() -> WorkerCore:  # on the engine thread: it alone touches torch
        loaded = load_with_progress(load_model, config.model)
        return cls(loaded, config.kv, config.scheduler, config.lifecycle, config.transfer, metrics=metrics)

    try:
        engine = AsyncEngine(build_core)
    except Exception as exc:  # the pool, the transfer endpoint, ...: one line, not a traceback
        log.debug("worker start-up failed", exc_info=True)
        raise StartupError(f"the {role} worker could not start: {type(exc).__name__}: {exc}") from None
    core = engine.core
    srv = config.server
    print(startup_line(role, core.loaded, core.capacity_tokens, f"http://{srv.host}:{srv.port}")
          + f", transfer {core.manager.name} at {core.manager.address}", flush=True)
    try:
        run_uvicorn(worker_app(engine, metrics, config.transfer.enable_fault_injection), srv)
    finally:
        engine.shutdown()
        core.close()
