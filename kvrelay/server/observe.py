"""`/metrics` (Prometheus) and `/debug/requests` routes, shared by every serving mode."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from kvrelay.obs.metrics import CONTENT_TYPE, ServingMetrics


def observability_router(metrics: ServingMetrics,
                         debug_view: Callable[[], Awaitable[list[dict] | dict]]) -> APIRouter:
    """`/debug/requests` answers {"role", "count", "requests": rows, ...}. `debug_view`
    returns the rows of the live requests, or a dict holding them under "requests" beside
    further keys (a worker's "phases", the router's "workers"), which are passed on."""
    router = APIRouter()

    @router.get("/metrics")
    async def prometheus() -> Response:
        # Rendering reads live state (possibly waiting for a scheduler step): off the event loop.
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @router.get("/debug/requests")
    async def requests() -> JSONResponse:
        view = await debug_view()
        body = dict(view) if isinstance(view, dict) else {"requests": view}
        return JSONResponse({"role": metrics.role, "count": len(body["requests"]), **body})

    return router
