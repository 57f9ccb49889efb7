"""The engine loop: schedule() -> run() -> postprocess(). Single-threaded; the async
wrapper in engine.engine runs it on its own thread.

Every request leaves through `Scheduler.finish`, which frees its pages, unless the
engine's holder keeps them (`EngineHooks.request_finished`); `check_idle` proves that
nothing is left behind.
"""
from __future__ import annotations

import copy
import logging
import os
import time
from typing import Callable

import torch

from kvrelay.core.clock import Clock, MonotonicClock
from kvrelay.core.config import KVCacheConfig, SchedulerConfig
from kvrelay.core.kvlayout import KVLayout
from kvrelay.engine.allocator import PageAllocator
from kvrelay.engine.core_share import IDLE_REFRESH, YIELD_POLL, CoreShare
from kvrelay.engine.detokenizer import IncrementalDetokenizer
from kvrelay.engine.grammar import Compiled, GrammarCompiler
from kvrelay.engine.hooks import EngineHooks, PassProgress
from kvrelay.engine.host_load import OtherLoad
from kvrelay.engine.kv_pool import kv_pool_for
from kvrelay.engine.request import Req, ReqStatus, choice_params
from kvrelay.engine.runner import ModelRunner, SeqChunk
from kvrelay.engine.sampling import SampleResult, Sampler, SamplingState, validate_params
from kvrelay.engine.scheduler import PrefillItem, Scheduler, pages_for, pages_for_choices
from kvrelay.engine.types import MAX_N, FinishReason, GenerateRequest, RequestRejected, StepOutput
from kvrelay.obs.metrics import EngineStats, PassStats, ServingMetrics, Snapshot

log = logging.getLogger("kvrelay.engine")
Sink = Callable[[StepOutput], None]
# seconds: inside a prefill pass, the loop's between-layer work (`_between_layers`) runs
# at most this often (a layer of a long chunk takes tens to hundreds of milliseconds)
MID_STEP_PERIOD = 0.05


def _last_token(req: Req) -> int:
    """The token a decode step feeds: the newest output, or the prompt's last (a recompute)."""
    return req.output_ids[-1] if req.output_ids else req.prompt_ids[-1]


def kv_layout_for(loaded, page_size: int, kv_dtype: str = "auto") -> KVLayout:
    """The pool's layout for --kv-cache-dtype `kv_dtype`; ValueError (one line) for a
    pairing the kernels do not read: a float32 cache under bfloat16 compute, or a
    bfloat16 cache under float32 compute off the CPU."""
    arch = loaded.arch
    stored = (loaded.kv_cache or loaded.dtype) if kv_dtype == "auto" else kv_dtype
    if stored == "float32" and loaded.dtype != "float32":
        raise ValueError(f"--kv-cache-dtype float32 needs float32 compute (the model computes {loaded.dtype}); "
                         "add --dtype float32 or use --kv-cache-dtype auto")
    if stored == "bfloat16" and loaded.dtype == "float32" and loaded.device != "cpu":
        raise ValueError("--kv-cache-dtype bfloat16 under float32 compute runs on the CPU only; "
                         "use --kv-cache-dtype auto or --dtype bfloat16")
    return KVLayout(model_id=loaded.name, dtype=loaded.dtype, page_size=page_size,
                    num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                    kv_dtype=stored)


def num_pages_for(cfg: KVCacheConfig, layout: KVLayout) -> int:
    if cfg.max_kv_tokens is not None:
        return max(1, pages_for(cfg.max_kv_tokens, cfg.page_size))
    return max(1, int(cfg.kv_cache_gb * 2**30) // layout.page_bytes)


class EngineCore:
    def __init__(self, loaded, kv_cfg: KVCacheConfig, sched_cfg: SchedulerConfig,
                 clock: Clock | None = None, kv_buffer: memoryview | None = None,
                 metrics: ServingMetrics | None = None, *, hooks: EngineHooks | None = None,
                 serves_clients: bool = True) -> None:
        """`hooks`: what the component holding this engine hears from its loop (a worker
        core); none: a colocated engine. `serves_clients`: its requests come straight from
        clients, so it reports their TTFT, inter-token latency, queue time and end-to-end
        latency and counts their outcomes. False for a worker core's engine: its client is
        the router, and its lifecycle counts outcomes, one per room."""
        self.loaded = loaded
        self.hooks = hooks if hooks is not None else EngineHooks()
        self.serves_clients = serves_clients
        self.metrics = metrics
        self.clock = clock or MonotonicClock()
        self.layout = kv_layout_for(loaded, kv_cfg.page_size, kv_cfg.kv_cache_dtype)
        self.kv = kv_pool_for(self.layout, num_pages_for(kv_cfg, self.layout), kv_buffer, loaded.device)
        self.allocator = PageAllocator(self.kv.num_pages)
        self.scheduler = Scheduler(sched_cfg, self.allocator, kv_cfg.page_size, self.clock)
        self.runner = (loaded.make_runner(loaded.model, self.kv) if loaded.make_runner is not None
                       else ModelRunner(loaded.model, self.kv, loaded.attention_backend))
        self.sampler = Sampler()
        self.max_model_len = min(sched_cfg.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.eos_ids = frozenset(loaded.eos_token_ids)
        # The engine thread detokenizes with its own copy: a Rust tokenizer must not be
        # used from two threads at once, and the server encodes in threads of its own.
        self._tokenizer = copy.deepcopy(loaded.tokenizer)
        # Builds the llguidance tokenizer now, compiles in threads of its own (`prepare`) and
        # hands the engine thread copies of the compiled matchers.
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.arch.vocab_size, loaded.eos_token_ids)
        self._sinks: dict[str, Sink] = {}
        self._reqs: dict[str, Req] = {}
        self.last_prefill: tuple[int, float] | None = None  # (prompt tokens, seconds) of the latest prefill step
        self.prompt_tokens_done = 0    # prompts prefilled here, once per request (metrics)
        self.tokens_sampled = 0        # tokens sampled here (metrics)
        # Forward passes (metrics): a pass that computes prompt tokens is a prefill pass,
        # whatever decodes ride in it; one of decodes only is a decode step. Seconds span
        # the pass, its sampling and the hand-off of its outputs.
        self.passes = PassStats()
        self._last_token_at: dict[str, float] = {}   # rid -> when its latest token went out (serves_clients)
        # --core-share: this engine's part of the host's cores, set before each step (built
        # on the engine thread, the one whose OpenMP thread count torch.set_num_threads sets)
        self.core_share = (CoreShare.from_spec(sched_cfg.core_share, sched_cfg.leave_busy_cores)
                           if sched_cfg.core_share else None)
        # Without a share, a fixed count (the threads it started with), at most the cores other
        # processes leave free (leave_busy_cores): a team beside a busy core waits at every barrier.
        self._threads = torch.get_num_threads()
        self._other_load = (OtherLoad(lambda: (os.getpid(),))
                            if sched_cfg.leave_busy_cores and not sched_cfg.core_share and self._threads > 1 else None)
        self._posted_work = True   # the last post may say busy: the first step posts
        self._idle_read = 0.0      # when an idle step last re-read the share (_refresh_idle_threads)
        self.yielded_steps = 0   # steps of decodes skipped for another engine's prompt (core_share)
        self.yielded_s = 0.0     # and the seconds they waited
        # Installed by AsyncEngine: answers the read-only calls queued for the loop. Called
        # from `_between_layers`, on the engine thread, inside a prefill pass.
        self.serve_reads: Callable[[], None] | None = None
        self._mid_step_at = float("-inf")
        self._pass: tuple[PrefillItem, ...] = ()   # the chunks of the prefill pass under way
        self.runner.between_layers = self._between_layers

    @property
    def metrics(self) -> ServingMetrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: ServingMetrics | None) -> None:
        """Every series reported through `metrics` carries this model's served name."""
        if metrics is not None and not metrics.model_name:
            metrics.model_name = self.loaded.name
        self._metrics = metrics

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
        validate_params(params, vocab)   # logit_bias ids must index the logits
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
        self._validate_n(n, params)
        if params.grammar is not None and self.grammars.refused_now():
            raise RequestRejected(self.grammars.refused_now(), param="grammar")

    async def prepare(self, greq: GenerateRequest) -> Compiled | None:
        """Compile `greq`'s grammar off the engine thread and off the caller's loop (any
        loop; no suspension without a grammar). RequestRejected if the grammar is refused or
        not compiled in time. The caller holds the result until the request ends, so the
        engine thread finds it compiled (`GrammarCompiler.matcher`)."""
        spec = greq.params.grammar
        return None if spec is None else await self.grammars.prepare(spec)

    def _validate_n(self, prompt_len: int, params) -> None:
        if not 1 <= params.n <= min(MAX_N, self.scheduler.config.max_running_requests):
            raise RequestRejected(f"n must be in [1, {MAX_N}] and at most --max-running-requests "
                                  f"({self.scheduler.config.max_running_requests}); got {params.n}", param="n")
        need = pages_for_choices(prompt_len, params.max_tokens, params.n, self.layout.page_size)
        if need > self.kv.num_pages:
            raise RequestRejected(
                f"n={params.n} choices of prompt ({prompt_len}) + max_tokens ({params.max_tokens}) need {need} KV "
                f"pages, more than the whole pool holds ({self.kv.num_pages}); lower n or max_tokens", param="n")

    def final_outputs(self, greq: GenerateRequest) -> int:
        """How many final outputs `greq`'s sink gets: one per choice."""
        return greq.params.n

    def add(self, greq: GenerateRequest, sink: Sink, prefill_only: bool = False) -> None:
        """Queue a request. `prefill_only`: it ends right after its first token, which
        `hooks.request_finished` sees before its pages are freed (the prefill worker)."""
        req = self._new_req(greq, sink, prefill_only)
        self.scheduler.add(req)
        self._shed_if_late(req)

    def _shed_if_late(self, req: Req) -> None:
        """--shed-ttft: a request predicted to miss it ends now, "overloaded" (a 503 with
        Retry-After), through the same exit as an abort: nothing of it stays behind."""
        limit = self.scheduler.config.shed_ttft
        wait = self.scheduler.predicted_wait(req) if limit > 0 else None
        if wait is not None and wait > limit:
            self.abort(req.rid, FinishReason.ERROR,
                       f"overloaded: the prompt tokens queued here predict {wait:.1f} s to this request's "
                       f"first token, over --shed-ttft {limit:g} s; retry later")

    def add_prefilled(self, greq: GenerateRequest, sink: Sink, pages: list[int], firsts: list[SampleResult]) -> None:
        """A request whose prompt KV is already in `pages` (owned by `greq.rid` in the
        allocator) and whose first tokens were sampled elsewhere, one per choice: it joins
        the running batch (forked into its n choices), and `firsts[i]` is emitted as choice
        i's first output (the decode worker)."""
        req = self._new_req(greq, sink)
        req.pages, req.num_computed = list(pages), req.prompt_len
        self.scheduler.add_running(req)
        for choice, first in zip(self._fork(req), firsts, strict=True):
            self._emit(choice, self._append_token(choice, first))

    def _new_req(self, greq: GenerateRequest, sink: Sink, prefill_only: bool = False) -> Req:
        self.validate(greq)
        if greq.rid in self._reqs:
            raise RequestRejected(f"request id {greq.rid} is already live", param="rid")
        req = self._make_req(greq.rid, greq.prompt_ids, greq.params, 0, prefill_only)
        self._reqs[req.rid] = req
        self._sinks[req.rid] = sink
        return req

    def _make_req(self, rid: str, prompt_ids, request_params, index: int, prefill_only: bool) -> Req:
        """The record of choice `index`: everything a choice samples, stops and detokenizes
        with is built here, once per choice (`_fork` builds choices 1..n-1)."""
        params = choice_params(request_params, index)
        req = Req(rid, list(prompt_ids), params, arrival=self.clock.now(), prefill_only=prefill_only, index=index)
        req.sampling = SamplingState(params, req.prompt_ids, eos_ids=self.eos_ids)   # min_tokens holds EOS back
        req.detok = IncrementalDetokenizer(self._tokenizer, req.prompt_ids, params.stop)
        if params.grammar is not None:
            req.sampling.grammar = self.grammars.matcher(params.grammar)
        return req

    def _fork(self, req: Req) -> list[Req]:
        """The choices that sample from the logits of `req`'s completed prefill: `req`
        alone, or, the first time the prompt of a request of n > 1 choices is computed,
        all n (choices 1..n-1 share choice 0's pages: `Scheduler.fork`)."""
        if req.group is not None or req.index or req.params.n == 1:
            return [req]
        others = [self._make_req(req.rid, req.prompt_ids, req.params, i, req.prefill_only)
                  for i in range(1, req.params.n)]
        for c in others:
            c.arrival = req.arrival
        self.scheduler.fork(req, others)
        req.group = [req, *others]
        for c in others:
            c.group = req.group
        return req.group

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        req = self._reqs.get(rid)
        if req is not None:
            for choice in req.choices:   # every choice; the request is done once all are
                if not choice.finished:
                    self._finish(choice, reason, error)
                    self._emit(choice, StepOutput(rid))

    def live_rids(self) -> list[str]:
        """Every request this core still owes a final output (a worker core adds its legs)."""
        return list(self._reqs)

    def request(self, rid: str) -> Req | None:
        """The live record of request `rid` (choice 0), or None."""
        return self._reqs.get(rid)

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
        if self.core_share is not None and self._yields():
            return
        batch = self.scheduler.schedule()
        if self.core_share is not None:
            self._take_cores(not batch.empty)
        elif self._other_load is not None:   # idle steps too: the first step with work finds the estimate current
            self._leave_busy_cores()
        if batch.empty:
            return
        started = self.clock.now()
        try:
            self.kv.copy_pages(batch.copies)   # copy-on-write of shared pages, before anything writes
            if batch.prefill:
                self._run_prefill(batch.prefill, batch.decode)
            else:
                self._run_decode(batch.decode)
        except Exception as exc:  # a failed forward ends its batch, never the loop
            log.exception("forward pass failed")
            for req in [i.req for i in batch.prefill] + batch.decode:
                self.abort(req.rid, FinishReason.ERROR, f"internal_error: {exc}")
            return
        seconds, tokens = self.clock.now() - started, sum(i.length for i in batch.prefill)
        self.passes.add(len(batch.decode), tokens, seconds)
        if tokens:
            self.last_prefill = (tokens, seconds)
        self.scheduler.costs.observe(len(batch.decode), tokens, seconds)

    def compute_info(self) -> dict[str, str]:
        """What computes (`LoadedModel.compute_info`), with the KV cache this engine built."""
        return {**self.loaded.compute_info(), "kv_cache": self.layout.kv_dtype}

    def time_prefill(self, tokens: int) -> float | None:
        """Seconds of one prefill pass of `tokens` prompt tokens, computed into scratch pages
        outside any request (no output, no counter, no cost sample); the pages are free
        again after. None if the pool has no room for them."""
        owner = ("calibration",)
        pages = self.allocator.allocate(pages_for(tokens, self.layout.page_size), owner)
        if pages is None:
            return None
        vocab = self.loaded.arch.vocab_size
        try:
            started = self.clock.now()
            self.runner.prefill([SeqChunk([i * 7919 % vocab for i in range(tokens)], 0, pages)])
            seconds = self.clock.now() - started
        finally:
            self.allocator.free(owner)
        return seconds

    def _between_layers(self, layers: int) -> None:
        """Inside a prefill pass, after a layer, at most every MID_STEP_PERIOD: the
        loop's work that cannot wait for a long step's end. Invariant: nothing here
        touches the running batch, its pages or the scheduler's queues (adds, aborts and
        every command that may free pages wait for the step's end, in their order); it
        runs on the engine thread, so a pass that hangs stops it too."""
        now = self.clock.now()
        if now - self._mid_step_at < MID_STEP_PERIOD:
            return
        self._mid_step_at = now
        # A pass begun on fewer threads beside another process's burst (a client, the other
        # server of an alternated benchmark) takes the core back within a sample of the
        # burst's end, not at the next step: a 2,000-token prompt's one pass ran 3.3-3.5 s on
        # one thread against 1.8-1.9 s on two, Zen 4. A burst that lasts takes a core
        # mid-pass as it would at a step's start; with a core share, so does another
        # engine's step that began meanwhile.
        if self.core_share is not None:
            n = self.core_share.current_threads()
            if n != torch.get_num_threads():
                torch.set_num_threads(n)
        elif self._other_load is not None:
            self._leave_busy_cores()
        try:
            self.hooks.between_layers(PassProgress(self._pass, layers))
            if self.serve_reads is not None:
                self.serve_reads()
        except Exception:  # the pass goes on; the step's end meets the fault in the loop
            log.exception("work between layers failed")

    def _queued_prompt(self) -> int:
        """Prompt tokens this engine has yet to compute."""
        sched = self.scheduler
        return sum(max(0, r.prompt_len - r.num_computed) for r in (*sched.waiting, *sched.running))

    def _yields(self) -> bool:
        """Prefill first across the host (`core_share`): a step of decodes only waits, at
        most YIELD_POLL at a time (less when another engine posts) and a bounded while, for
        another engine's prompt."""
        if not self.core_share.should_yield(self.has_work and self._queued_prompt() == 0):
            return False
        started = time.monotonic()
        self.core_share.wait(YIELD_POLL)   # less once the prompt's step ends
        self.yielded_steps += 1
        self.yielded_s += time.monotonic() - started
        return True

    def _take_cores(self, busy: bool) -> None:
        """Post whether this step has work (and its prompt tokens still to compute), then
        run it on this engine's part of the host's cores. An engine with nothing to run
        posts that once: every further idle step (a decode worker polls every few
        milliseconds while a prompt computes elsewhere) leaves the file alone."""
        if not busy and not self._posted_work:
            self.core_share.sample_load()   # current when work comes (at most every SAMPLE_PERIOD)
            self._refresh_idle_threads()
            return
        self._posted_work = busy
        n = self.core_share.threads(busy, self._queued_prompt() if busy else 0)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def _leave_busy_cores(self) -> None:
        """Without a core share: run this step (and, re-read between a prefill pass's layers,
        the rest of the pass) on the threads the engine started with, at most the cores other
        processes leave free (`host_load`), one at least."""
        n = min(self._threads, max(1, len(self._other_load.cpus) - self._other_load.cores_taken()))
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def _refresh_idle_threads(self) -> None:
        """An idle engine's count, read when it posted, goes stale once the others finish
        (it posted while another decoded): below every core, it re-reads the file (posts
        nothing), at most every IDLE_REFRESH seconds."""
        if torch.get_num_threads() >= self.core_share.cores:
            return
        now = time.monotonic()
        if now - self._idle_read < IDLE_REFRESH:
            return
        self._idle_read = now
        n = self.core_share.current_threads()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def _run_prefill(self, items: list[PrefillItem], decodes: list[Req]) -> None:
        """Prompt chunks, and in a mixed step the running batch's decodes (rows first)."""
        self._count_prefill(items)
        chunks = [SeqChunk([_last_token(r)], r.seq_len - 1, r.pages) for r in decodes]
        chunks += [SeqChunk(i.req.tokens(i.start, i.start + i.length), i.start, i.req.pages) for i in items]
        self._pass = tuple(items)
        try:
            logits = self.runner.prefill(chunks)
        finally:
            self._pass = ()
        self.scheduler.on_decode_done(decodes)
        self.scheduler.on_prefill_done(items)
        done = [(len(decodes) + row, c) for row, i in enumerate(items) if i.completes for c in self._fork(i.req)]
        rows = list(range(len(decodes))) + [r for r, _ in done]
        if rows:
            picked = logits.index_select(0, torch.tensor(rows, device=logits.device))
            self._sample_and_emit(decodes + [req for _, req in done], picked)

    def _run_decode(self, reqs: list[Req]) -> None:
        logits = self.runner.decode([_last_token(r) for r in reqs], [r.seq_len - 1 for r in reqs],
                                    [r.pages for r in reqs])
        self.scheduler.on_decode_done(reqs)
        self._sample_and_emit(reqs, logits)

    def _sample_and_emit(self, reqs: list[Req], logits: torch.Tensor) -> None:
        results = self.sampler.sample(logits, [r.sampling for r in reqs])
        self.tokens_sampled += len(reqs)
        for req, res in zip(reqs, results):
            if not req.finished:   # a choice that its sibling's end aborted (a worker's sink) takes no token
                self._emit(req, self._append_token(req, res))

    def _append_token(self, req: Req, res) -> StepOutput:
        tok = res.token_id
        req.output_ids.append(tok)
        req.sampling.append(tok)
        out = StepOutput(req.rid, token_ids=[tok], logprobs=[res.logprob] if res.logprob else [])
        text, stopped = req.detok.add([tok], armed=len(req.output_ids) >= req.params.min_tokens)
        out.text = text
        p = req.params
        grammar = req.sampling.grammar
        if grammar is not None and grammar.error:   # a limit its grammar reached, or a token it refused
            self._finish(req, FinishReason.ERROR, grammar.failure(tok))
            return out
        reason = None
        if stopped or (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids \
                or (grammar is not None and grammar.stopped):   # the grammar is complete
            reason = FinishReason.STOP
        elif len(req.output_ids) >= p.max_tokens or req.seq_len >= self.max_model_len or req.prefill_only:
            reason = FinishReason.LENGTH
        if reason is not None:
            if not stopped:
                out.text += req.detok.flush()
            holder = self.hooks.request_finished(req, res)
            if holder is not None:   # the pages stay used, under the holder's one release path
                self.allocator.transfer(req.owner, holder)
            self._finish(req, reason)
        return out

    def _finish(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        self.scheduler.finish(req, reason, error)

    def _emit(self, req: Req, out: StepOutput) -> None:
        if out.token_ids and self.metrics and self.serves_clients and req.index == 0:   # choices advance together
            self._observe_token(req)
        if out.token_ids and req.first_token_at is None:
            req.first_token_at = self.clock.now()
        if req.status == ReqStatus.FINISHED and self.metrics:
            self._record_finish(req)
        out.index = req.index
        out.prompt_tokens = req.prompt_len
        out.completion_tokens = len(req.output_ids)
        if req.status == ReqStatus.FINISHED:
            out.finish_reason, out.error = req.finish_reason, req.error
        if req.status == ReqStatus.FINISHED and all(c.finished for c in req.choices):
            self._reqs.pop(req.rid, None)
            self._last_token_at.pop(req.rid, None)
            sink = self._sinks.pop(req.rid, None)
        else:
            sink = self._sinks.get(req.rid)
        if sink is not None:
            sink(out)
            if out.finished and req.group is None:   # ended before the fork: its other choices end with it
                for i in range(1, req.params.n):
                    sink(StepOutput(req.rid, index=i, prompt_tokens=out.prompt_tokens,
                                    finish_reason=out.finish_reason, error=out.error))

    def _count_prefill(self, items: list[PrefillItem]) -> None:
        """A prompt counts once, when its prefill completes (not again when a preempted request
        recomputes); a client's request has queued until its first chunk runs."""
        now = self.clock.now()
        for i in items:
            if i.completes and not i.req.output_ids:
                self.prompt_tokens_done += i.req.prompt_len
            if i.start == 0 and not i.req.num_preemptions and self.metrics and self.serves_clients:
                self.metrics.observe_queue(now - i.req.arrival)

    def _observe_token(self, req: Req) -> None:
        now, last = self.clock.now(), self._last_token_at.get(req.rid)
        if req.first_token_at is None:
            self.metrics.observe_ttft(now - req.arrival)
        elif last is not None:
            self.metrics.observe_itl(now - last)
        self._last_token_at[req.rid] = now

    def _record_finish(self, req: Req) -> None:
        m = self.metrics
        if req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and req.first_token_at is not None \
                and len(req.output_ids) > 1:
            m.observe_tpot((self.clock.now() - req.first_token_at) / (len(req.output_ids) - 1))
        if self.serves_clients and all(c.finished for c in req.choices):   # once per request, at its end
            self._record_outcome(req)

    def _record_outcome(self, req: Req) -> None:
        m, reason = self.metrics, req.finish_reason
        m.observe_e2e(self.clock.now() - req.arrival)
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            m.record_finish("success", reason.value)
        elif reason == FinishReason.ABORT:
            m.record_finish("aborted", "aborted")
        else:
            m.record_finish("failed", (req.error or "error").split(":", 1)[0])

    # -- observability ---------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        now = self.clock.now()
        waiting, running = self.scheduler.waiting, self.scheduler.running
        return Snapshot(phases={"waiting": [now - r.arrival for r in waiting],
                                "running": [now - r.arrival for r in running]},
                        engine=self.engine_stats(len(running), len(waiting)))

    def engine_stats(self, running: int, waiting: int) -> EngineStats:
        load = self.core_share.other_load if self.core_share is not None else self._other_load
        return EngineStats(running, waiting, self.allocator.num_free, self.allocator.num_total,
                           self.scheduler.num_preemptions, self.prompt_tokens_done, self.tokens_sampled,
                           torch.get_num_threads(), self.yielded_s, copy.copy(self.passes),
                           load.load if load is not None else 0.0)

    def debug_rows(self) -> list[dict]:
        now = self.clock.now()
        rows = []
        for phase, reqs in (("waiting", self.scheduler.waiting), ("running", self.scheduler.running)):
            for r in reqs:
                rows.append({"id": r.rid, "index": r.index, "phase": phase, "age_s": round(now - r.arrival, 3),
                             "prompt_tokens": r.prompt_len, "output_tokens": len(r.output_ids),
                             "pages": len(r.pages), "preemptions": r.num_preemptions})
        return rows

    # -- integrity -----------------------------------------------------------------------
    def check_idle(self) -> None:
        """Raise AssertionError unless the engine holds no request and no page."""
        self.allocator.check_integrity()
        assert self.scheduler.num_requests == 0, f"{self.scheduler.num_requests} requests still queued"
        assert not self._reqs and not self._sinks, f"live request records: {list(self._reqs)}"
        assert not self._last_token_at, f"token times kept for {list(self._last_token_at)}"
        assert self.allocator.num_free == self.allocator.num_total, (
            f"free pages {self.allocator.num_free} != total {self.allocator.num_total}")
