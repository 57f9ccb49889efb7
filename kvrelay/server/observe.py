"""`/metrics` (Prometheus), `/metrics/workers` (the router's re-export of its workers'
series) and `/debug/requests` routes, shared by every serving mode.

Both metrics routes are cheap under a flood of scrapes and never stale: `/metrics` renders
at most once per RENDER_SPACING_S, `/metrics/workers` fetches every worker at most once
per RENDER_SPACING_S, one fan-out at a time, and every scrape gets a render (fetch) begun
after it arrived (`Coalesced`)."""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import httpx
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client.core import GaugeMetricFamily

from kvrelay.obs.metrics import CONTENT_TYPE, RENDER_SPACING_S, ServingMetrics, parse_families, render_families

WORKERS_PATH = "/metrics/workers"


class Coalesced:
    """An async producer shared by its callers. Invariants: a caller gets a result whose
    production began after it called (never state older than its own arrival);
    productions begin at least `spacing` seconds apart and run one at a time, so callers
    that arrive meanwhile share the next one; a caller that leaves cancels nothing for
    the others; an exception reaches the callers of that production only."""

    def __init__(self, produce: Callable[[], Awaitable[bytes]], spacing: float = RENDER_SPACING_S) -> None:
        self.produce, self.spacing = produce, spacing
        self._kept: tuple[float, bytes] | None = None   # (monotonic time its production began, result)
        self._running: asyncio.Future | None = None

    async def get(self) -> bytes:
        asked = time.monotonic()
        while True:
            kept = self._kept
            if kept is not None and kept[0] >= asked:
                return kept[1]
            if self._running is None:
                self._running = asyncio.ensure_future(self._next())
            began, result = await asyncio.shield(self._running)
            if began >= asked:
                return result

    async def _next(self) -> tuple[float, bytes]:
        try:
            if self._kept is not None:
                await asyncio.sleep(self._kept[0] + self.spacing - time.monotonic())
            began = time.monotonic()
            self._kept = (began, await self.produce())
            return self._kept
        finally:
            self._running = None


def observability_router(metrics: ServingMetrics,
                         debug_view: Callable[[], Awaitable[list[dict] | dict]],
                         worker_metrics: Callable[[], Awaitable[bytes]] | None = None) -> APIRouter:
    """`/debug/requests` answers {"role", "count", "requests": rows, ...}. `debug_view`
    returns the rows of the live requests, or a dict holding them under "requests" beside
    further keys (a worker's "phases", the router's "workers"), which are passed on.
    `worker_metrics` (the router): serve its exposition at WORKERS_PATH."""
    router = APIRouter()

    # A render (pure Python over a snapshot that never blocks, a few ms) runs off the loop.
    rendered = Coalesced(lambda: asyncio.to_thread(metrics.render))

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(await rendered.get(), media_type=CONTENT_TYPE)

    if worker_metrics is not None:
        fetched = Coalesced(worker_metrics)

        @router.get(WORKERS_PATH)
        async def workers() -> Response:
            return Response(await fetched.get(), media_type=CONTENT_TYPE)

    @router.get("/debug/requests")
    async def requests() -> JSONResponse:
        view = await debug_view()
        body = dict(view) if isinstance(view, dict) else {"requests": view}
        return JSONResponse({"role": metrics.role, "count": len(body["requests"]), **body})

    return router


async def scrape_workers(client: httpx.AsyncClient, targets: list[tuple[str, str]], timeout: float) -> bytes:
    """Every worker's /metrics, fetched now and at once (each within `timeout`), as one
    exposition whose samples carry `worker` (its URL) and `role`; plus
    `kvrelay_worker_scrape_ok{worker,role}`, 0 for a worker that did not answer in time
    or answered something that is not the text format. Workers listen where the router
    was told, so this is how one static scrape config reaches them all."""
    async def fetch(url: str) -> str | None:
        try:
            resp = await client.get(f"{url}/metrics", timeout=timeout)
            resp.raise_for_status()
            return resp.text
        except httpx.HTTPError:
            return None

    texts = await asyncio.gather(*(fetch(url) for url, _ in targets))
    return await asyncio.to_thread(_exposition, targets, texts)


def _exposition(targets: list[tuple[str, str]], texts: list[str | None]) -> bytes:
    families = []
    ok = GaugeMetricFamily("kvrelay_worker_scrape_ok", "1 if the worker's /metrics answered the router's last "
                           "re-export scrape", labels=["worker", "role"])
    for (url, role), text in zip(targets, texts):
        try:
            got = parse_families(text, {"worker": url, "role": role}) if text is not None else None
        except ValueError:
            got = None
        ok.add_metric([url, role], float(got is not None))
        families.extend(got or ())
    return render_families([ok, *families])
