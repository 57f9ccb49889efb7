"""The engine loop: schedule() -> run() -> postprocess(). Single-threaded; the async
wrapper in engine.engine runs it on its own thread.

Every request leaves through `Scheduler.finish`, which frees its pages; `check_idle`
proves that nothing is left behind.
"""
from __future__ import annotations

import copy
import logging
from typing import Callable

import torch

from kvrelay.core.clock import Clock, MonotonicClock
from kvrelay.core.config import KVCacheConfig, SchedulerConfig
from kvrelay.core.kvlayout import KVLayout
from kvrelay.engine.allocator import PageAllocator
from kvrelay.engine.detokenizer import IncrementalDetokenizer
from kvrelay.engine.kv_pool import KVPool
from kvrelay.engine.request import Req, ReqStatus
from kvrelay.engine.runner import ModelRunner, SeqChunk
from kvrelay.engine.sampling import SampleResult, Sampler, SamplingState
from kvrelay.engine.scheduler import PrefillItem, Scheduler, pages_for
from kvrelay.engine.types import FinishReason, GenerateRequest, RequestRejected, StepOutput
from kvrelay.obs.metrics import Snapshot, ServingMetrics

log = logging.getLogger("kvrelay.engine")
Sink = Callable[[StepOutput], None]


def kv_layout_for(loaded, page_size: int) -> KVLayout:
    arch = loaded.arch
    return KVLayout(model_id=loaded.name, dtype=loaded.dtype, page_size=page_size,
                    num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim)


def num_pages_for(cfg: KVCacheConfig, layout: KVLayout) -> int:
    if cfg.max_kv_tokens is not None:
        return max(1, pages_for(cfg.max_kv_tokens, cfg.page_size))
    return max(1, int(cfg.kv_cache_gb * 2**30) // layout.page_bytes)


class EngineCore:
    def __init__(self, loaded, kv_cfg: KVCacheConfig, sched_cfg: SchedulerConfig,
                 clock: Clock | None = None, kv_buffer: memoryview | None = None,
                 metrics: ServingMetrics | None = None) -> None:
        self.metrics = metrics
        self.loaded = loaded
        self.clock = clock or MonotonicClock()
        self.layout = kv_layout_for(loaded, kv_cfg.page_size)
        self.kv = KVPool(self.layout, num_pages_for(kv_cfg, self.layout), kv_buffer)
        self.allocator = PageAllocator(self.kv.num_pages)
        self.scheduler = Scheduler(sched_cfg, self.allocator, kv_cfg.page_size)
        self.runner = (loaded.make_runner or ModelRunner)(loaded.model, self.kv)
        self.sampler = Sampler()
        self.max_model_len = min(sched_cfg.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.eos_ids = frozenset(loaded.eos_token_ids)
        # The engine thread detokenizes with its own copy: a Rust tokenizer must not be
        # used from two threads at once, and the server encodes on its event loop.
        self._tokenizer = copy.deepcopy(loaded.tokenizer)
        self._sinks: dict[str, Sink] = {}
        self._reqs: dict[str, Req] = {}
        self.last_prefill: tuple[int, float] | None = None  # (prompt tokens, seconds) of the latest prefill step

    @property
    def capacity_tokens(self) -> int:
        return self.kv.num_pages * self.layout.page_size

    # -- admission -----------------------------------------------------------------------
    def validate(self, greq: GenerateRequest) -> None:
        """Raise RequestRejected if the request can never be served. Reads only fixed state."""
        n, params = len(greq.prompt_ids), greq.params
        if n == 0:
            raise RequestRejected("the prompt is empty", param="prompt")
        vocab = self.loaded.arch.vocab_size
        bad = next((t for t in greq.prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        if n + params.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} "
                f"and max_tokens is {params.max_tokens}", param="max_tokens", code="context_length_exceeded")
        if n + params.max_tokens > self.capacity_tokens:
            raise RequestRejected(
                f"prompt ({n}) + max_tokens ({params.max_tokens}) needs more KV than the whole pool holds "
                f"({self.capacity_tokens} tokens); lower max_tokens or raise --max-kv-tokens", param="max_tokens")

    def add(self, greq: GenerateRequest, sink: Sink, prefill_only: bool = False) -> None:
        """Queue a request. `prefill_only`: it ends right after its first token, and
        `_handoff` sees it before its pages are freed (the prefill worker)."""
        self.scheduler.add(self._new_req(greq, sink, prefill_only))

    def add_prefilled(self, greq: GenerateRequest, sink: Sink, pages: list[int], first: SampleResult) -> None:
        """A request whose prompt KV is already in `pages` (owned by `greq.rid` in the
        allocator) and whose first token was sampled elsewhere: it joins the running batch,
        and `first` is emitted as its first output (the decode worker)."""
        req = self._new_req(greq, sink)
        req.pages, req.num_computed = list(pages), req.prompt_len
        self.scheduler.add_running(req)
        self._emit(req, self._append_token(req, first))

    def _new_req(self, greq: GenerateRequest, sink: Sink, prefill_only: bool = False) -> Req:
        self.validate(greq)
        if greq.rid in self._reqs:
            raise RequestRejected(f"request id {greq.rid} is already live", param="rid")
        req = Req(greq.rid, list(greq.prompt_ids), greq.params, arrival=self.clock.now(), prefill_only=prefill_only)
        req.sampling = SamplingState(greq.params, req.prompt_ids)
        req.detok = IncrementalDetokenizer(self._tokenizer, req.prompt_ids, greq.params.stop)
        self._reqs[req.rid] = req
        self._sinks[req.rid] = sink
        return req

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        req = self._reqs.get(rid)
        if req is not None:
            self._finish(req, reason, error)
            self._emit(req, StepOutput(rid))

    def live_rids(self) -> list[str]:
        """Every request this core still owes a final output (a worker core adds its legs)."""
        return list(self._reqs)

    def fail_all(self, error: str) -> None:
        """After an iteration raised outside a forward pass: every live request ends now
        with `error` (and frees its pages) rather than waiting on a loop that may raise again."""
        for rid in self.live_rids():
            try:
                self.abort(rid, FinishReason.ERROR, error)
            except Exception:  # one broken request must not keep the others pinned
                log.exception("failing request %s after an engine error failed too", rid)

    @property
    def has_work(self) -> bool:
        """A forward pass is due: the loop runs `step()` without waiting."""
        return self.scheduler.num_requests > 0

    @property
    def busy(self) -> bool:
        """Anything is live (what `AsyncEngine.check_idle` waits out)."""
        return self.has_work

    @property
    def idle_wait(self) -> float:
        """With no forward due, the loop waits at most this long for a command before the
        next `step()` (a worker core shortens it while peers owe it messages)."""
        return 0.05

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> None:
        batch = self.scheduler.schedule()
        if batch.empty:
            return
        try:
            if batch.prefill:
                started = self.clock.now()
                self._run_prefill(batch.prefill)
                self.last_prefill = (sum(i.length for i in batch.prefill), self.clock.now() - started)
            else:
                self._run_decode(batch.decode)
        except Exception as exc:  # a failed forward ends its batch, never the loop
            log.exception("forward pass failed")
            reqs = [i.req for i in batch.prefill] or batch.decode
            for req in reqs:
                self.abort(req.rid, FinishReason.ERROR, f"internal_error: {exc}")

    def _run_prefill(self, items: list[PrefillItem]) -> None:
        chunks = [SeqChunk(i.req.tokens(i.start, i.start + i.length), i.start, i.req.pages) for i in items]
        logits = self.runner.prefill(chunks)
        self.scheduler.on_prefill_done(items)
        done = [(row, i.req) for row, i in enumerate(items) if i.completes]
        if done:
            rows = torch.tensor([r for r, _ in done])
            self._sample_and_emit([req for _, req in done], logits.index_select(0, rows))

    def _run_decode(self, reqs: list[Req]) -> None:
        logits = self.runner.decode([r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs],
                                    [r.seq_len - 1 for r in reqs], [r.pages for r in reqs])
        self.scheduler.on_decode_done(reqs)
        self._sample_and_emit(reqs, logits)

    def _sample_and_emit(self, reqs: list[Req], logits: torch.Tensor) -> None:
        results = self.sampler.sample(logits, [r.sampling for r in reqs])
        for req, res in zip(reqs, results):
            self._emit(req, self._append_token(req, res))

    def _append_token(self, req: Req, res) -> StepOutput:
        tok = res.token_id
        req.output_ids.append(tok)
        req.sampling.append(tok)
        out = StepOutput(req.rid, token_ids=[tok], logprobs=[res.logprob] if res.logprob else [])
        text, stopped = req.detok.add([tok])
        out.text = text
        p = req.params
        reason = None
        if stopped or (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = FinishReason.STOP
        elif len(req.output_ids) >= p.max_tokens or req.seq_len >= self.max_model_len or req.prefill_only:
            reason = FinishReason.LENGTH
        if reason is not None:
            if not stopped:
                out.text += req.detok.flush()
            if req.prefill_only:
                self._handoff(req, res)
            self._finish(req, reason)
        return out

    def _handoff(self, req: Req, first: SampleResult) -> None:
        """A prefill-only request has its first token; its pages are freed right after this
        returns unless an override takes them over (`allocator.transfer`)."""

    def _finish(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        self.scheduler.finish(req, reason, error)

    def _emit(self, req: Req, out: StepOutput) -> None:
        if out.token_ids and req.first_token_at is None:
            req.first_token_at = self.clock.now()
            if self.metrics:
                self.metrics.ttft.labels(self.metrics.role).observe(req.first_token_at - req.arrival)
        if req.status == ReqStatus.FINISHED and self.metrics:
            self._record_finish(req)
        out.prompt_tokens = req.prompt_len
        out.completion_tokens = len(req.output_ids)
        if req.status == ReqStatus.FINISHED:
            out.finish_reason, out.error = req.finish_reason, req.error
            self._reqs.pop(req.rid, None)
            sink = self._sinks.pop(req.rid, None)
        else:
            sink = self._sinks.get(req.rid)
        if sink is not None:
            sink(out)

    def _record_finish(self, req: Req) -> None:
        m = self.metrics
        if req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and req.first_token_at is not None \
                and len(req.output_ids) > 1:
            m.tpot.labels(m.role).observe((self.clock.now() - req.first_token_at) / (len(req.output_ids) - 1))
        self._record_outcome(req)

    def _record_outcome(self, req: Req) -> None:
        m, reason = self.metrics, req.finish_reason
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            m.record_finish("success", reason.value)
        elif reason == FinishReason.ABORT:
            m.record_finish("aborted", "aborted")
        else:
            m.record_finish("failed", (req.error or "error").split(":", 1)[0])

    # -- observability ---------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        now = self.clock.now()
        return Snapshot(phases={"waiting": [now - r.arrival for r in self.scheduler.waiting],
                                "running": [now - r.arrival for r in self.scheduler.running]},
                        kv_pages_free=self.allocator.num_free, kv_pages_total=self.allocator.num_total)

    def debug_rows(self) -> list[dict]:
        now = self.clock.now()
        rows = []
        for phase, reqs in (("waiting", self.scheduler.waiting), ("running", self.scheduler.running)):
            for r in reqs:
                rows.append({"id": r.rid, "phase": phase, "age_s": round(now - r.arrival, 3),
                             "prompt_tokens": r.prompt_len, "output_tokens": len(r.output_ids),
                             "pages": len(r.pages), "preemptions": r.num_preemptions})
        return rows

    # -- integrity -----------------------------------------------------------------------
    def check_idle(self) -> None:
        """Raise AssertionError unless the engine holds no request and no page."""
        self.allocator.check_integrity()
        assert self.scheduler.num_requests == 0, f"{self.scheduler.num_requests} requests still queued"
        assert not self._reqs and not self._sinks, f"live request records: {list(self._reqs)}"
        assert self.allocator.num_free == self.allocator.num_total, (
            f"free pages {self.allocator.num_free} != total {self.allocator.num_total}")
