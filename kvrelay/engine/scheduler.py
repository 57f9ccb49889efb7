"""Continuous batching: a waiting queue and a running batch, pure Python over page ids.

Each `schedule()` returns the prompt chunks and decodes of one forward pass. Prompt chunks
come from the waiting queue in `queue_order`, bounded by `max_prefill_tokens` and
`max_running_requests` (a prompt longer than the budget is chunked; where the owner sets
`prefill_stretch`, a step's first prompt is taken whole when its rest is within the budget
times it). fcfs takes arrival order. shortest-first takes, in this order: requests already
started (partly prefilled, or preempted), in queue order; requests that have waited
`max_queue_wait`, in arrival order; then the rest by prompt tokens left, fewest first. A
request that does not fit blocks the ones after it, so a long prompt waits at most
`max_queue_wait` plus what is ahead of it then.

With `target_tpot` (mixed batches, as vLLM's chunked prefill): every running request
decodes in every step, and the prompt tokens beside them are what `StepCosts` says fits in
target_tpot (at least MIN_MIXED_CHUNK, so prompts always advance); a step with no running
request prefills up to the whole budget. Without it, a prefill step runs alone and the decodes wait for it.

Pages: a request is admitted only when the pages for its next chunk are free. Decode
grows a request one page at a time; when the pool is full, a partly prefilled waiting
request gives its pages back first, then the most recently admitted running request is
preempted (its pages freed, its tokens recomputed later): the oldest requests keep
making progress and nothing crashes.

Choices (a request of n > 1): choice 0 alone is prefilled; `fork` then gives each other
choice a reference to every page of choice 0, and each choice is a running request of its
own from there on (grows, is preempted and finishes alone). Copy-on-write: before a
decode step writes into a page, the writer's reference must be its only one; a choice
whose write page is shared trades its reference for a private copy (`allocator.unshare`)
and the batch carries the (source, copy) pairs, which the engine copies before the
forward pass. So only the last partial page of the prompt is ever copied, and at most
n - 1 times; full prompt pages stay shared until the last choice finishes. A preempted
choice drops only its own references and is recomputed into pages of its own.

Invariant: a choice's pages are exactly `allocator.pages_of(req.owner)`, in order, and a
finished choice holds none.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvrelay.core import mutation
from kvrelay.core.clock import Clock, MonotonicClock
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
    copies: list[tuple[int, int]] = field(default_factory=list)   # (shared page, private copy) before decode

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


MIN_MIXED_CHUNK = 32   # prompt tokens a mixed step carries however slow its decodes are


class StepCosts:
    """What a forward pass costs here, measured: `decode`, the seconds of the latest passes
    that only decoded (the running batch), and `per_token`, the seconds each prompt token
    adds to a pass (a mixed pass's time beyond `decode`). A pass that only prefills also
    has a fixed cost (reading every weight once, sampling), so its seconds / tokens
    overstates `per_token` for a short prompt: such passes are fitted to a line, seconds =
    fixed + per_token x tokens, whose slope is taken once their sizes differ by enough to
    fix one. Moving averages; pure: the engine feeds each pass's counts and seconds (a
    simulated clock feeds none, and nothing changes)."""
    WEIGHT = 0.3       # of the newest pass
    FIT_WEIGHT = 0.1   # of the newest prefill-only pass in the line's sums (about 10 passes)
    FIT_SPREAD = 0.2   # the line needs pass sizes whose deviation is this share of their mean

    def __init__(self) -> None:
        self.decode: float | None = None
        self.per_token: float | None = None
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)   # weighted count, tokens, seconds, tokens^2, tokens x seconds

    def observe(self, decodes: int, tokens: int, seconds: float) -> None:
        if seconds <= 0 or (decodes == 0 and tokens == 0):
            return
        if tokens == 0:
            self.decode = self._mix(self.decode, seconds)
            return
        if decodes == 0:
            slope = self._fit(tokens, seconds)
            self.per_token = self._mix(self.per_token, slope if slope is not None else seconds / tokens)
            return
        rest = seconds - (self.decode or 0.0)
        if rest > 0:
            self.per_token = self._mix(self.per_token, rest / tokens)

    def _fit(self, tokens: int, seconds: float) -> float | None:
        """Adds a prefill-only pass to the line; its slope, or None while undetermined."""
        keep, w = 1 - self.FIT_WEIGHT, self.FIT_WEIGHT
        n, t, s, tt, ts = (keep * old + w * new for old, new in
                           zip(self._sums, (1.0, tokens, seconds, tokens * tokens, tokens * seconds)))
        self._sums = (n, t, s, tt, ts)
        mean_t = t / n
        var_t = tt / n - mean_t * mean_t
        if var_t < (self.FIT_SPREAD * mean_t) ** 2:
            return None
        slope = (ts / n - mean_t * s / n) / var_t
        return slope if slope > 0 else None

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.WEIGHT) * old + self.WEIGHT * new

    def tokens_within(self, seconds: float) -> int | None:
        """Prompt tokens that fit beside the running decodes in `seconds`; None until measured."""
        if self.per_token is None:
            return None
        return int(max(0.0, seconds - (self.decode or 0.0)) / self.per_token)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def pages_for_choices(prompt_len: int, max_tokens: int, n: int, page_size: int) -> int:
    """Pages a request of n choices holds at most: the prompt's full pages once (shared),
    and every choice's pages from there on (its copy of a partial last page included)."""
    shared = prompt_len // page_size
    return shared + n * (pages_for(prompt_len + max_tokens, page_size) - shared)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int,
                 clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()   # ages waiting requests (shortest-first)
        self.allocator = allocator
        self.page_size = page_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_preemptions = 0
        # Prompt tokens per prefill step; the owner may lower it below the configured cap
        # (a disaggregated worker keeps each step shorter than its heartbeat interval).
        self.prefill_budget = config.max_prefill_tokens
        # A step's first prompt is taken whole where its rest is at most prefill_budget *
        # prefill_stretch, so no short last chunk pays a pass of its own (the owner raises
        # it; 1: no stretch). A later prompt of the step only gets what the budget leaves.
        self.prefill_stretch = 1.0
        self._copies: list[tuple[Req, int, int]] = []   # copy-on-write of the decode pass being scheduled
        self.costs = StepCosts()

    # -- queue membership -------------------------------------------------------------
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def add_running(self, req: Req) -> None:
        """A request whose KV is already in its pages (received from a prefill worker)."""
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def fork(self, req: Req, choices: list[Req]) -> None:
        """`choices` (new records of req's other choices) join the running batch with a
        reference to every page of `req`, whose prompt KV is computed (the fork point)."""
        for c in choices:
            c.pages = self.allocator.share(req.owner, c.owner)
            c.num_computed = req.num_computed
            self.add_running(c)

    def finish(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        """The single exit path: leave every queue and drop every page reference."""
        if req.status == ReqStatus.FINISHED:
            return
        if req.status == ReqStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.allocator.free(req.owner)
        req.pages = []
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        req.error = error

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- scheduling ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        if self.config.target_tpot > 0 and self.running:
            # mixed: the decodes take their pages first, then a prompt chunk that fits beside them
            batch = self._decode_batch()
            batch.prefill = self._schedule_prefill(self.mixed_budget() if batch.decode else self.prefill_budget)
            return batch
        batch = ScheduledBatch(prefill=self._schedule_prefill(self.prefill_budget))
        return batch if batch.prefill else self._decode_batch()

    def mixed_budget(self) -> int:
        """Prompt tokens for a step that also decodes the running batch."""
        fit = self.costs.tokens_within(self.config.target_tpot)
        return self.prefill_budget if fit is None else min(self.prefill_budget, max(MIN_MIXED_CHUNK, fit))

    def _decode_batch(self) -> ScheduledBatch:
        self._copies = []
        decode = self._schedule_decode()
        # a copy whose writer was preempted later in this pass is not needed (its page may be another's now)
        return ScheduledBatch(decode=decode, copies=[(src, dst) for req, src, dst in self._copies
                                                     if req.status == ReqStatus.RUNNING])

    def _schedule_prefill(self, budget: int) -> list[PrefillItem]:
        items: list[PrefillItem] = []
        slots = self.config.max_running_requests - len(self.running)
        for req in self.prefill_order():
            if budget <= 0 or len(items) >= slots:
                break
            if req.num_preemptions and mutation.on("oom_after_kv_stranded"):
                continue  # SGLang #6857: a request that lost its pages after its KV arrived is stranded
            length = self.chunk_of(req, budget, first=not items)
            if not self._grow(req, req.num_computed + length):
                break  # a head that does not fit blocks later ones (no starvation)
            items.append(PrefillItem(req, req.num_computed, length))
            budget -= length
        return items

    def chunk_of(self, req: Req, budget: int, first: bool = True) -> int:
        """The prompt tokens of `req` a step with `budget` left takes: the step's `first`
        prompt's whole rest where that is within the budget times prefill_stretch, else at
        most the budget."""
        rest = req.seq_len - req.num_computed
        return rest if first and rest <= budget * self.prefill_stretch else min(rest, budget)

    def prefill_order(self) -> list[Req]:
        """The waiting requests in the order their prompts are taken (the module docstring)."""
        if self.config.queue_order == "fcfs":
            return list(self.waiting)
        aged = self.clock.now() - self.config.max_queue_wait

        def rank(req: Req) -> tuple:
            if req.num_computed or req.num_preemptions:
                return (0,)
            if req.arrival <= aged:
                return (1, req.arrival)
            return (2, req.seq_len - req.num_computed, req.arrival)
        return sorted(self.waiting, key=rank)   # stable: ties keep queue order

    def predicted_wait(self, req: Req) -> float | None:
        """Seconds until waiting `req`'s prompt is computed: the prompt tokens taken before it
        and its own, at the measured seconds per prompt token. None until a prefill was
        measured. A lower bound under shortest-first (shorter arrivals may still pass it)."""
        if self.costs.per_token is None:
            return None
        tokens = 0
        for r in self.prefill_order():
            tokens += r.seq_len - r.num_computed
            if r is req:
                return tokens * self.costs.per_token
        return None

    def _schedule_decode(self) -> list[Req]:
        for req in list(self.running):
            if req.status != ReqStatus.RUNNING:
                continue  # preempted while making room for an earlier request
            while not (self._grow(req, req.seq_len) and self._own_write_page(req)):
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
        got = self.allocator.allocate(extra, req.owner)
        if got is None:
            return False
        req.pages.extend(got)
        return True

    def _own_write_page(self, req: Req) -> bool:
        """Copy-on-write: the page that this decode step writes (position seq_len - 1) must
        be `req`'s alone. False if it is shared and no page is free for the copy."""
        i = (req.seq_len - 1) // self.page_size
        page = req.pages[i]
        if self.allocator.refcount(page) == 1:
            return True
        new = self.allocator.unshare(req.owner, page)
        if new is None:
            return False
        req.pages[i] = new
        self._copies.append((req, page, new))
        return True

    def _preempt(self, req: Req) -> None:
        """Drop `req`'s page references: it is recomputed from its first token (into pages
        of its own). A running request goes back to the head of the waiting queue; a
        waiting one keeps its place."""
        self.allocator.free(req.owner)
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
