"""`kvrelay prefill` and `kvrelay decode`: one worker process, its engine thread (which also
steps the lifecycle and heartbeats its peers), and the HTTP endpoints the router calls
(protocol in `server.worker_protocol`).

/health and /metrics read what the engine thread last published (`AsyncEngine.published`)
and never wait on, or wake, the loop: a worker whose loop hangs answers /health with a
`loop_age` that keeps growing, and the router drops it once that passes --health-timeout;
past LOOP_STALLED_S the answer is a 503, for probes that read only the status (a
Kubernetes liveness probe). Every other route reads and
changes worker state through `AsyncEngine.call`, on the engine thread between steps.

Who may call it (`server.security`): with a cluster key, every route but /health and
/metrics needs the router's token; without one, the worker listens on loopback only.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvrelay.core.config import KVRelayConfig
from kvrelay.disagg.decode_worker import DecodeCore
from kvrelay.disagg.faults import FaultSpec
from kvrelay.disagg.prefill_worker import PrefillCore
from kvrelay.disagg.worker_core import WorkerCore
from kvrelay.engine import kernels
from kvrelay.engine.engine import AsyncEngine
from kvrelay.engine.loader import load_model
from kvrelay.engine.types import FinishReason, GenerateRequest, RequestRejected, StepOutput
from kvrelay.obs.logs import setup_logging
from kvrelay.obs.metrics import ServingMetrics
from kvrelay.server.errors import StartupError, install_handlers, invalid
from kvrelay.server.observe import observability_router
from kvrelay.server.security import AUTH_SCOPE, Gate, check_tls, check_worker, guard, load_cluster_key, worker_gate
from kvrelay.server.startup import load_with_progress, run_uvicorn, serving_url, startup_line
from kvrelay.server.worker_protocol import AbortRequest, FaultsRequest, LegRequest, WorkerHealth, output_to_json

log = logging.getLogger("kvrelay.worker")

LOOP_STALLED_S = 30.0   # /health is a 503 once the engine loop has not run for this long

CORES: dict[str, type[WorkerCore]] = {"prefill": PrefillCore, "decode": DecodeCore}


def worker_app(engine: AsyncEngine, metrics: ServingMetrics, faults: bool = False, gate: Gate | None = None) -> FastAPI:
    """`faults`: serve POST /debug/faults (--enable-fault-injection). `gate`: the router's
    cluster token, which every route but /health and /metrics needs (`security.worker_gate`)."""
    core: WorkerCore = engine.core  # read only through engine.call (the engine thread)
    app = FastAPI(title=f"kvrelay {core.role} worker")
    install_handlers(app)
    guard(app, gate)
    routes = APIRouter()

    async def on_engine(fn, timeout: float = 30.0, readonly: bool = False):
        return await engine.acall(fn, timeout, readonly)

    @routes.post("/generate")
    async def generate(body: LegRequest) -> StreamingResponse:
        greq, kwargs = prepare_leg(core, body)
        await engine.prepare(greq)   # its grammar, compiled off this loop: a refused one is this 400
        # the leg's rid (validated by LegRequest) names it in this worker's access line
        return StreamingResponse(_lines(engine, greq, kwargs), media_type="application/x-ndjson",
                                 headers={"X-Request-Id": body.rid})

    @routes.post("/abort")
    async def abort(body: AbortRequest) -> dict:
        return {"aborted": await on_engine(lambda c: c.abort_leg(body.rid))}

    @routes.get("/health")
    async def health(request: Request) -> JSONResponse:
        body = health_body(engine, request.scope.get(AUTH_SCOPE, "off"))
        if body.loop_age > LOOP_STALLED_S:
            return JSONResponse({**body.model_dump(), "status": "stalled"}, status_code=503)
        return JSONResponse(body.model_dump())

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
        return await on_engine(lambda c: c.debug_view(), readonly=True)

    if faults:
        routes.add_api_route("/debug/faults", set_faults, methods=["POST"])

    app.include_router(routes)
    app.include_router(observability_router(metrics, debug_view))
    return app


def health_body(engine: AsyncEngine, auth: str = "off") -> WorkerHealth:
    """/health's answer: the health view the engine thread last published, with its age
    (`loop_age`, engine clock) and iteration count. Never waits on the loop; the router
    judges the age (`WorkerMonitor.check`)."""
    view = engine.published
    age = engine.loop_age(view)
    return WorkerHealth(**view.health, loop_age=age, iterations=view.iterations, auth=auth)


def prepare_leg(core: WorkerCore, body: LegRequest) -> tuple[GenerateRequest, dict]:
    """(request, `core.add` arguments) of a leg. Raises RequestRejected (a 400) for a leg
    that can never run here; reads fixed state only (safe off the engine thread)."""
    greq = GenerateRequest(body.rid, tuple(body.prompt_ids), body.sampling.params())
    core.validate_leg(greq)
    kwargs: dict = {"room": body.room}
    if core.role == "decode":
        if body.prefill_here == bool(body.prefill_address):
            raise RequestRejected("a decode leg needs exactly one of prefill_address and prefill_here",
                                  param="prefill_address")
        kwargs["prefill_address"] = body.prefill_address
    elif body.prefill_here or body.prefill_address:
        field = "prefill_here" if body.prefill_here else "prefill_address"
        raise RequestRejected(f"{field} is for a decode leg; this is a prefill worker", param=field)
    return greq, kwargs


async def leg_outputs(engine: AsyncEngine, greq: GenerateRequest, kwargs: dict) -> AsyncIterator[StepOutput]:
    """A leg's outputs, the last one final. Leaving early (the router closed the stream)
    aborts the leg: `AsyncEngine.generate` sends the abort when it is closed unfinished."""
    gen = engine.generate(greq, **kwargs)
    try:
        async for out in gen:
            yield out
    except RequestRejected as exc:  # lost a race (same room or rid added twice)
        yield StepOutput(greq.rid, finish_reason=FinishReason.ERROR, error=f"invalid_request: {exc}")
    finally:
        await gen.aclose()


async def _lines(engine: AsyncEngine, greq: GenerateRequest, kwargs: dict) -> AsyncIterator[str]:
    """The leg's outputs as NDJSON."""
    outs = leg_outputs(engine, greq, kwargs)
    try:
        async for out in outs:
            yield output_to_json(out)
    finally:
        await outs.aclose()


def serve_worker(config: KVRelayConfig, role: str) -> None:
    """Raises StartupError (a bind the cluster key does not allow, a bad key or TLS file,
    a core that cannot start)."""
    key = load_cluster_key(config.security)
    check_worker(config, role, key)
    check_tls(config.security)
    setup_logging(config.server.log_level)
    cls = CORES[role]
    metrics = ServingMetrics(role, cls.PHASES, lambda: engine.published.snapshot)

    def build_core() -> WorkerCore:  # on the engine thread: it alone touches torch
        loaded = load_with_progress(load_model, config.model)
        core = cls(loaded, config.kv, config.scheduler, config.lifecycle, config.transfer, metrics=metrics,
                   cluster_key=key, replay_window=config.security.replay_window)
        try:
            core.calibrate()   # the first prefill step's size, from a timed pass
        except BaseException:
            core.close()
            raise
        return core

    try:
        engine = AsyncEngine(build_core)
    except Exception as exc:  # the pool, the transfer endpoint, ...: one line, not a traceback
        log.debug("worker start-up failed", exc_info=True)
        raise StartupError(f"the {role} worker could not start: {type(exc).__name__}: {exc}") from None
    core = engine.core
    srv = config.server
    print(startup_line(role, core.engine.compute_info(), core.loaded.name,
                       core.engine.capacity_tokens, serving_url(srv, config.security), kernels.fallback_reason())
          + f", transfer {core.manager.name} at {core.manager.address}", flush=True)
    app = worker_app(engine, metrics, config.transfer.enable_fault_injection, worker_gate(key, config.security))
    try:
        run_uvicorn(app, srv, config.security)
    finally:
        engine.shutdown()
        core.close()
