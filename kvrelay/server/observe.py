"""`/metrics` (Prometheus), `/metrics/workers` (the router's re-export of its workers'
series) and `/debug/requests` routes, shared by every serving mode.

Both metrics routes are cheap under a flood of scrapes: `/metrics` renders at most once
per RENDER_CACHE_S (`ServingMetrics.render`), and `/metrics/workers` fetches every
worker at most once per RENDER_CACHE_S, one fan-out at a time (`SharedFetch`)."""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import httpx
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client.core import GaugeMetricFamily

from kvrelay.obs.metrics import CONTENT_TYPE, RENDER_CACHE_S, ServingMetrics, parse_families, render_families

WORKERS_PATH = "/metrics/workers"


class SharedFetch:
    """An async fetch shared by its callers: at most one in flight, however many wait, and
    its result kept for `ttl` seconds from the fetch's start. A caller that leaves does
    not cancel it for the others; a fetch that raises is not kept (each waiter gets it)."""

    def __init__(self, fetch: Callable[[], Awaitable[bytes]], ttl: float = RENDER_CACHE_S) -> None:
        self.fetch, self.ttl = fetch, ttl
        self._kept: tuple[float, bytes] | None = None   # (monotonic time its fetch began, result)
        self._running: asyncio.Future | None = None

    async def get(self) -> bytes:
        kept = self._kept
        if kept is not None and time.monotonic() - kept[0] < self.ttl:
            return kept[1]
        if self._running is None:
            self._running = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self._running)

    async def _refresh(self) -> bytes:
        began = time.monotonic()
        try:
            result = await self.fetch()
            self._kept = (began, result)
            return result
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

    @router.get("/metrics")
    async def prometheus() -> Response:
        # A kept exposition answers on the event loop; a render (pure Python over a
        # snapshot that never blocks, a few ms) runs off it.
        text = metrics.cached() or await asyncio.to_thread(metrics.render)
        return Response(text, media_type=CONTENT_TYPE)

    if worker_metrics is not None:
        shared = SharedFetch(worker_metrics)

        @router.get(WORKERS_PATH)
        async def workers() -> Response:
            return Response(await shared.get(), media_type=CONTENT_TYPE)

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
