"""Continuous batching: a waiting queue and a running batch, pure Python over page ids.

Each `schedule()` returns either a prefill batch (new or partly prefilled requests,
bounded by `max_prefill_tokens` and `max_running_requests`, chunked when a prompt is
longer than the budget) or a decode batch (every running request, one token each).
Prefill goes first so new requests join the batch at the next step.

Pages: a request is admitted only when the pages for its next chunk are free. Decode
grows a request one page at a time; when the pool is full, a partly prefilled waiting
request gives its pages back first, then the most recently admitted running request is
preempted (its pages freed, its tokens recomputed later): the oldest requests keep
making progress and nothing crashes.

Invariant: a request's pages are exactly `allocator.pages_of(rid)`, in order, and a
finished request owns none.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvrelay.core import mutation
from kvrelay.core.config import SchedulerConfig
from kvrelay.engine.allocator import PageAllocator
from kvrelay.engine.request import Req, ReqStatus
from kvrelay.engine.types import FinishReason


@dataclass
class PrefillItem:
    req: Req
    start: int      # first position computed this step (== req.num_computed)
    length: int     # tokens computed this step

    @property
    def completes(self) -> bool:
        return self.start + self.length == self.req.seq_len


@dataclass
class ScheduledBatch:
    prefill: list[PrefillItem] = field(default_factory=list)
    decode: list[Req] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int) -> None:
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_preemptions = 0
        # Prompt tokens per prefill step; the owner may lower it below the configured cap
        # (a disaggregated worker keeps each step shorter than its heartbeat interval).
        self.prefill_budget = config.max_prefill_tokens

    # -- queue membership -------------------------------------------------------------
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def add_running(self, req: Req) -> None:
        """A request whose KV is already in its pages (received from a prefill worker)."""
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def finish(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        """The single exit path: leave every queue and free every page."""
        if req.status == ReqStatus.FINISHED:
            return
        if req.status == ReqStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.allocator.free(req.rid)
        req.pages = []
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        req.error = error

    def find(self, rid: str) -> Req | None:
        for req in self.running:
            if req.rid == rid:
                return req
        for req in self.waiting:
            if req.rid == rid:
                return req
        return None

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- scheduling ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(prefill=self._schedule_prefill())
        if batch.prefill:
            return batch
        batch.decode = self._schedule_decode()
        return batch

    def _schedule_prefill(self) -> list[PrefillItem]:
        items: list[PrefillItem] = []
        budget = self.prefill_budget
        slots = self.config.max_running_requests - len(self.running)
        for req in list(self.waiting):
            if budget <= 0 or len(items) >= slots:
                break
            if req.num_preemptions and mutation.on("oom_after_kv_stranded"):
                continue  # SGLang #6857: a request that lost its pages after its KV arrived is stranded
            length = min(req.seq_len - req.num_computed, budget)
            if not self._grow(req, req.num_computed + length):
                break  # FIFO: a head that does not fit blocks later ones (no starvation)
            items.append(PrefillItem(req, req.num_computed, length))
            budget -= length
        return items

    def _schedule_decode(self) -> list[Req]:
        for req in list(self.running):
            if req.status != ReqStatus.RUNNING:
                continue  # preempted while making room for an earlier request
            while not self._grow(req, req.seq_len):
                victim = self._victim()
                self._preempt(victim)
                if victim is req:
                    break
        return list(self.running)

    def _victim(self) -> Req:
        """Whose pages go when a running request cannot grow: a partly prefilled waiting
        request (the newest) before any running one. A waiting request must never keep
        pages a running one needs: once that one is preempted too, the waiting head can
        wait for them forever while nothing runs."""
        for req in reversed(self.waiting):
            if req.pages:
                return req
        return self.running[-1]

    def _grow(self, req: Req, tokens: int) -> bool:
        extra = pages_for(tokens, self.page_size) - len(req.pages)
        if extra <= 0:
            return True
        got = self.allocator.allocate(extra, req.rid)
        if got is None:
            return False
        req.pages.extend(got)
        return True

    def _preempt(self, req: Req) -> None:
        """Free `req`'s pages: it is recomputed from its first token. A running request
        goes back to the head of the waiting queue; a waiting one keeps its place."""
        self.allocator.free(req.rid)
        req.pages = []
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.status == ReqStatus.RUNNING:
            self.running.remove(req)
            req.status = ReqStatus.WAITING
            self.waiting.appendleft(req)

    def on_prefill_done(self, items: list[PrefillItem]) -> None:
        """Advance computed counts; a request whose prompt is fully computed joins the batch."""
        for item in items:
            req = item.req
            req.num_computed = item.start + item.length
            if item.completes and req.status == ReqStatus.WAITING:
                self.waiting.remove(req)
                req.status = ReqStatus.RUNNING
                self.running.append(req)

    def on_decode_done(self, reqs: list[Req]) -> None:
        for req in reqs:
            req.num_computed = req.seq_len
