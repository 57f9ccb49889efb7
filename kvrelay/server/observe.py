"""`/metrics` (Prometheus) and `/debug/requests` routes, shared by every serving mode."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from kvrelay.obs.metrics import CONTENT_TYPE, ServingMetrics


def observability_router(metrics: ServingMetrics, debug_rows: Callable[[], Awaitable[list[dict]]]) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    async def prometheus() -> Response:
        # Rendering reads live state (possibly waiting for a scheduler step): off the event loop.
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @router.get("/debug/requests")
    async def requests() -> JSONResponse:
        rows = await debug_rows()
        return JSONResponse({"role": metrics.role, "count": len(rows), "requests": rows})

    return router
