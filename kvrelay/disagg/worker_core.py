"""What the prefill and decode worker cores share: the `EngineCore` they hold (`engine`),
whose KV pool is the transfer manager's buffer, one lifecycle coordinator (`side`)
stepped with it on the engine thread, and the legs (one per room) that the HTTP layer
waits on.

A worker core composes its engine and never overrides it: it calls the engine's public
methods (add, add_prefilled, abort, step, the allocator for room-held pages) and hears
from its loop through `EngineHooks` only: `request_finished` (a prefill-only request
hands its pages to its room) and `between_layers` (the side's heartbeats inside a long
prefill pass). `AsyncEngine` drives the worker core (`LoopCore`), not the engine.

Invariants:
- Every used page is held by engine requests (freed when they finish) or by one room,
  `("room", room)` (freed by the side's release callback, exactly once per room: when it
  ends, or when its quarantine does); nothing else holds pages in the engine's allocator.
- Every leg ends with exactly one final output per choice it answers for (`Leg.finals`:
  a prefill leg 1, a decode leg n) to its sink, when its room ends (terminal event) or,
  once decoding, when the engine finishes each choice.
- `snapshot()` and `debug_view()` read the same rooms on the engine thread, so the phase
  gauges in /metrics and the rows of /debug/requests cannot disagree.
- `check_idle()` holds when nothing is live: no leg, no room, no quarantined page, no
  transfer endpoint, every page free.
"""
from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import dataclass, field, replace
from typing import Callable

from kvrelay.core import mutation
from kvrelay.core.clock import Clock
from kvrelay.core.config import KVCacheConfig, LifecycleConfig, SchedulerConfig, TransferConfig
from kvrelay.core.keys import ClusterKey
from kvrelay.disagg.auth import ChannelAuth
from kvrelay.disagg.channel import Channel
from kvrelay.disagg.lease import Coordinator
from kvrelay.disagg.lifecycle import Reason, TerminalEvent, phase_name
from kvrelay.disagg.transfer import create_manager
from kvrelay.engine.core import EngineCore, kv_layout_for, num_pages_for
from kvrelay.engine.hooks import EngineHooks, PassProgress
from kvrelay.engine.sampling import validate_params
from kvrelay.engine.types import ErrorCode, FinishReason, GenerateRequest, RequestRejected, StepOutput
from kvrelay.obs.metrics import Snapshot

log = logging.getLogger("kvrelay.worker")

BUSY_WAIT = 0.005   # loop wait while rooms are live: peers' messages are polled this often
IDLE_WAIT = 0.02    # nothing live: still stepped, so heartbeats and leases keep running
STEP_SHARE = 0.5    # a prefill step may take at most this share of the heartbeat interval
# ... or this share, where the worker heartbeats between the layers of its prefill passes
# and no decode waits on them (a prefill worker): fewer, longer chunks re-read their
# prefix less (a 2,000-token prompt: 1.7-2.1 s in one pass, 2.7-2.8 s in chunks of 384)
LONG_STEP_SHARE = 3.0
# ... and there a step takes the whole rest of a prompt within this many budgets: a short
# last chunk costs more per token than the pass before it (176 tokens after 1,024: 0.55 s
# against 2.3 s, avx2 Zen 2); what waits for a step's end (adds, aborts, peers' statuses)
# waits at most this many times longer
LONG_STEP_STRETCH = 2.0
FIRST_BUDGET = 256  # prompt tokens of the first prefill step, before any has been timed
# (`calibrate` times a pass of this many at start-up, and sizes the first step from it)
STEP_GRANULE = 128  # prompt tokens: a step budget above it is a multiple of it (see step_budget)


def step_budget(tokens: float, page_size: int, cap: int) -> int:
    """The prompt tokens of the next prefill step, at most `tokens`: a multiple of
    STEP_GRANULE (of a page below it), at least a page, at most `cap`. Every new row count
    costs the matmul and attention libraries a kernel built for that shape (~100 ms a
    step of the default model at 300 tokens on a 2-core Xeon), so the chunks of a long
    prompt keep to a few sizes that later prompts reuse."""
    unit = STEP_GRANULE if tokens >= STEP_GRANULE else page_size
    return int(min(cap, max(page_size, tokens // unit * unit)))


@dataclass(eq=False)
class Leg:
    greq: GenerateRequest
    sink: Callable[[StepOutput], None]
    room: int
    finals: int = 1           # final outputs it owes: one per choice it answers for
    in_engine: bool = False   # the engine holds it (P: computing; D: decoding)
    answered: bool = False    # every final output went out
    ended: set[int] = field(default_factory=set)    # choices whose final output went out
    failure: StepOutput | None = None               # the first final that was an error or an abort
    firsts: list = field(default_factory=list)      # P: the choices' first tokens so far (SampleResult)


def reason_of(out: StepOutput) -> tuple[str, str]:
    """(reason code, detail) of an output that ended a request early."""
    if out.finish_reason is FinishReason.ABORT:
        return Reason.ABORTED.value, out.error or "aborted"
    if out.error is None:
        return ErrorCode.INTERNAL_ERROR.value, "the request failed"
    return (out.error_code or ErrorCode.INTERNAL_ERROR).value, out.error_detail


class WorkerCore(EngineHooks):
    role = ""
    PHASES: tuple[str, ...] = ()
    QUEUED_PHASES: tuple[str, ...] = ()   # phases that count as "queued" for the router's load view
    RUNNING_PHASES: tuple[str, ...] = ()  # phases whose requests the engine computes (vLLM's "running")
    LONG_STEPS = False                    # a prefill step may take LONG_STEP_SHARE (see step_share)

    def __init__(self, loaded, kv_cfg: KVCacheConfig, sched_cfg: SchedulerConfig, lifecycle_cfg: LifecycleConfig,
                 transfer_cfg: TransferConfig, clock: Clock | None = None, metrics=None,
                 cluster_key: ClusterKey | None = None, replay_window: float = 60.0,
                 channel: Channel | None = None) -> None:
        """`cluster_key`: sign and verify every control frame with it (disagg.auth).
        `channel`: the control channel to use instead of a zmq one (the simulation's)."""
        layout = kv_layout_for(loaded, kv_cfg.page_size, kv_cfg.kv_cache_dtype)
        self.lifecycle_cfg, self.transfer_cfg = lifecycle_cfg, transfer_cfg
        auth = ChannelAuth(cluster_key.control_key, replay_window) if cluster_key is not None else None
        extra = {k: v for k, v in (("clock", clock), ("channel", channel)) if v is not None}
        self.manager = create_manager(transfer_cfg.transfer_backend, layout, transfer_cfg, auth=auth,
                                      lifecycle=lifecycle_cfg, **extra)
        self.clock = self.manager.clock
        # The engine owns the pool (on its device; on the CPU where the backend places it)
        # and the backend registers it: one pool, allocated once, moved by the backend.
        try:
            placed = (self.manager.place_pool(num_pages_for(kv_cfg, layout) * layout.page_bytes)
                      if loaded.device == "cpu" else None)
            # The router reports its requests' client-side timings; the lifecycle counts outcomes.
            self.engine = EngineCore(loaded, kv_cfg, sched_cfg, clock=self.clock, kv_buffer=placed, metrics=metrics,
                                     hooks=self, serves_clients=False)
            self.manager.register_kv([self.engine.kv.region()])
        except BaseException:
            self.manager.close()
            raise
        self.legs: dict[int, Leg] = {}
        self.room_of: dict[str, int] = {}
        self.side: Coordinator = self._make_side()
        self.side.lc.on_leave = self._observe_phase
        self._cap = sched_cfg.max_prefill_tokens
        self.engine.scheduler.prefill_budget = min(self._cap, FIRST_BUDGET)
        if self.step_share == LONG_STEP_SHARE:
            self.engine.scheduler.prefill_stretch = LONG_STEP_STRETCH
        self._budget = float(self.engine.scheduler.prefill_budget)   # the smoothed target, before step_budget

    @abstractmethod
    def _make_side(self) -> Coordinator: ...

    @abstractmethod
    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        """End request `rid`'s leg (its room, and its engine request if it has one)."""

    @abstractmethod
    def _feed_engine(self) -> None:
        """Between the side's step and the engine's: hand the engine the rooms ready for it."""

    # ---- what the loop reads (LoopCore) --------------------------------------------------
    @property
    def loaded(self):
        return self.engine.loaded

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def metrics(self):
        return self.engine.metrics

    @property
    def serve_reads(self) -> Callable[[], None] | None:
        """The loop's read-only calls: the engine answers them between layers."""
        return self.engine.serve_reads

    @serve_reads.setter
    def serve_reads(self, fn: Callable[[], None] | None) -> None:
        self.engine.serve_reads = fn

    def validate(self, greq: GenerateRequest) -> None:
        self.engine.validate(greq)

    async def prepare(self, greq: GenerateRequest) -> object:
        return await self.engine.prepare(greq)

    def final_outputs(self, greq: GenerateRequest) -> int:
        return self.engine.final_outputs(greq)

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    # ---- legs ----------------------------------------------------------------------------
    def validate_leg(self, greq: GenerateRequest) -> None:
        """Raise RequestRejected unless this worker can serve the leg (fixed state only)."""
        self.engine.validate(greq)
        validate_params(greq.params)

    def _add_leg(self, leg: Leg) -> None:
        rid = leg.greq.rid
        if leg.room in self.legs or leg.room in self.side.lc.rooms:
            raise RequestRejected(f"room {leg.room} is already live on this worker", param="room")
        if rid in self.room_of:
            raise RequestRejected(f"request id {rid} is already live on this worker", param="rid")
        self.legs[leg.room] = leg
        self.room_of[rid] = leg.room

    def _pop_leg(self, room: int) -> Leg | None:
        leg = self.legs.pop(room, None)
        if leg is not None:
            self.room_of.pop(leg.greq.rid, None)
        return leg

    @staticmethod
    def _answer(leg: Leg, out: StepOutput) -> None:
        """Pass `out` on unless its choice already ended; the leg is answered once each of
        its `finals` choices has."""
        if leg.answered or out.index in leg.ended:
            return
        if out.finished:
            leg.ended.add(out.index)
            leg.answered = len(leg.ended) >= leg.finals
            if out.finish_reason in (FinishReason.ABORT, FinishReason.ERROR) and leg.failure is None:
                leg.failure = out
        leg.sink(out)

    def _answer_failed(self, leg: Leg, ev: TerminalEvent) -> None:
        """The room ended early: every choice still open gets the failure as its final output."""
        aborted = ev.phase == "aborted"
        out = StepOutput(leg.greq.rid, finish_reason=FinishReason.ABORT if aborted else FinishReason.ERROR,
                         error=f"{ev.reason}: {ev.detail}" if ev.detail else ev.reason,
                         prompt_tokens=len(leg.greq.prompt_ids))
        for i in range(leg.finals):
            self._answer(leg, replace(out, index=i))

    def _record_terminal(self, ev: TerminalEvent) -> None:
        outcome = {"done": "success", "aborted": "aborted"}.get(ev.phase, "failed")
        level = logging.INFO if ev.phase != "failed" else logging.WARNING
        log.log(level, "request ended", extra={"rid": ev.rid, "room": ev.room, "phase": ev.phase,
                                                 "from_phase": ev.from_phase, "reason": ev.reason or "",
                                                 "detail": ev.detail, "age_s": round(ev.age, 3)})
        if self.metrics is not None:
            self.metrics.record_finish(outcome, ev.reason or "done")

    def _observe_phase(self, phase: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_phase(phase, seconds)

    # ---- the loop ------------------------------------------------------------------------
    def between_layers(self, progress: PassProgress) -> None:   # EngineHooks
        self.side.mid_step()

    @property
    def step_share(self) -> float:
        """The share of a heartbeat interval one prefill step may take: LONG_STEP_SHARE
        where the runner heartbeats between layers and nothing waits on the step's end
        (LONG_STEPS), else STEP_SHARE."""
        if self.LONG_STEPS and self.engine.runner.CALLS_BETWEEN_LAYERS:
            return LONG_STEP_SHARE
        return STEP_SHARE

    def step(self) -> None:
        """One iteration: the side's (peers' messages, heartbeats, watchdog), the rooms the
        engine takes now, then the engine's step."""
        self.side.step()
        self._feed_engine()
        if mutation.on("timeouts_only_after_batch") and self.has_work:  # TensorRT-LLM #17124: only with a batch
            self.side._watchdog()
        self.engine.step()
        self._fit_prefill_budget()

    def calibrate(self) -> None:
        """At start-up, before any request: time two prefill passes of FIRST_BUDGET tokens
        (the faster counts: the first also warms the kernels) and size the first prefill
        step from them, so a long first prompt is not cut at FIRST_BUDGET (a 925-token one
        took two passes, 0.47 + 1.44 s against 1.83 s in one, avx2 Zen 2). Never below
        FIRST_BUDGET: a pass timed while another process computes runs slow (`serve`'s two
        workers timing theirs at once: 1.5-2.0 s for 256 tokens against 0.45-0.47 s). It
        keeps FIRST_BUDGET where the pool has no room for the pass, and on a decode worker
        (not LONG_STEPS), which starts beside the prefill worker: its steps are short."""
        if not self.LONG_STEPS:
            return
        tokens = self.engine.scheduler.prefill_budget
        times = [t for t in (self.engine.time_prefill(tokens) for _ in range(2)) if t]
        seconds = min(times, default=None)
        if seconds:
            target = tokens / seconds * self.lifecycle_cfg.heartbeat_interval * self.step_share
            self._budget = max(self._budget, target)
            self.engine.scheduler.prefill_budget = step_budget(self._budget, self.engine.layout.page_size, self._cap)
        log.info("prefill step calibrated", extra={"tokens": tokens, "seconds": round(seconds or 0.0, 4),
                                                  "next_budget": self.engine.scheduler.prefill_budget})

    def _fit_prefill_budget(self) -> None:
        """The prompt tokens of a prefill step follow the measured rate, to take about
        `step_share` of a heartbeat interval (at most --max-prefill-tokens): heartbeats
        leave between steps, or between layers where the runner calls back there. Only a
        step the budget cut, or one that ran over that time, measures the rate."""
        engine = self.engine
        if engine.last_prefill is None:
            return
        tokens, seconds = engine.last_prefill
        engine.last_prefill = None
        if seconds <= 0 or tokens <= 0:
            return
        step_s = self.lifecycle_cfg.heartbeat_interval * self.step_share
        if tokens < engine.scheduler.prefill_budget and seconds <= step_s:
            # a short prompt's whole rest, in time: its pass's fixed cost (every weight read
            # once) swamps its few tokens, so its rate says nothing of a full step's (a
            # 4-token prompt cut the next 1,700-token one's first chunk to 512)
            return
        target = tokens / seconds * step_s
        self._budget = 0.5 * self._budget + 0.5 * target   # smooth: one noisy step moves it half way
        engine.scheduler.prefill_budget = step_budget(self._budget, engine.layout.page_size, self._cap)
        log.debug("prefill step", extra={"tokens": tokens, "seconds": round(seconds, 4),
                                         "next_budget": engine.scheduler.prefill_budget})

    @property
    def busy(self) -> bool:
        return self.has_work or bool(self.legs) or not self.side.idle()

    @property
    def idle_wait(self) -> float:
        return BUSY_WAIT if not self.side.idle() else IDLE_WAIT

    def live_rids(self) -> list[str]:
        return list(dict.fromkeys([*self.room_of, *self.engine.live_rids()]))

    def abort_leg(self, rid: str) -> bool:
        """Abort by request id (the router's /abort). False if it is not live here."""
        if rid not in self.room_of:
            return False
        self.abort(rid)
        return True

    def close(self) -> None:
        self.manager.close()

    # ---- views ---------------------------------------------------------------------------
    def queued_requests(self) -> int:
        # from the rooms' phases, not `side.live()`'s rows: the engine publishes it every iteration
        return sum(1 for r in self.side.lc.rooms.values() if phase_name(r.phase) in self.QUEUED_PHASES)

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens this worker has still to compute for its rooms (the router's TTFT
        prediction); a decode worker computes none."""
        return 0

    def snapshot(self) -> Snapshot:
        now = self.clock.now()
        phases: dict[str, list[float]] = {p: [] for p in self.PHASES}
        overdue: dict[str, int] = {}
        for r in self.side.lc.rooms.values():
            name = phase_name(r.phase)
            phases.setdefault(name, []).append(now - r.created)
            if r.deadline is not None and now >= r.deadline:   # the watchdog ends it within an iteration
                overdue[name] = overdue.get(name, 0) + 1
        m = self.manager
        running, waiting = (sum(len(phases.get(p, ())) for p in names)
                            for names in (self.RUNNING_PHASES, self.QUEUED_PHASES))
        return Snapshot(phases=phases, overdue=overdue, engine=self.engine.engine_stats(running, waiting),
                        counters={"kvrelay_transfer_bytes": m.bytes_written,
                                  "kvrelay_transfer_ahead_bytes": m.bytes_ahead,
                                  "kvrelay_transfer_seconds": m.write_seconds,
                                  "kvrelay_worker_loop_stalls": self.side.stalls.count,
                                  "kvrelay_worker_loop_stall_seconds": self.side.stalls.seconds},
                        gauges={"kvrelay_kv_pages_quarantined": self.side.quarantined_pages()})

    def debug_view(self) -> dict:
        rows = self.side.live()
        for row in rows:
            leg = self.legs.get(row["room"])
            if leg is not None:
                row["prompt_tokens"] = len(leg.greq.prompt_ids)
        phases = {p: 0 for p in self.PHASES}
        for row in rows:
            phases[row["phase"]] = phases.get(row["phase"], 0) + 1
        return {"requests": rows, "phases": phases}

    def health(self) -> dict:
        e = self.engine
        return {"role": self.role, "worker_id": self.manager.worker_id, "incarnation": self.manager.incarnation,
                "model": e.loaded.name, "max_model_len": e.max_model_len,
                "transfer_backend": self.manager.name, "transfer_address": self.manager.address,
                "live_requests": len(self.side.lc.rooms), "queued_requests": self.queued_requests(),
                "free_pages": e.allocator.num_free, "total_pages": e.allocator.num_total,
                "queued_prompt_tokens": self.queued_prompt_tokens(),
                "prefill_s_per_token": e.scheduler.costs.per_token, **e.compute_info()}

    def check_idle(self) -> None:
        self.engine.check_idle()
        assert not self.legs and not self.room_of, f"live legs: {sorted(self.legs)}"
        assert self.side.idle(), f"live rooms: {self.side.live()}"
        counts = self.manager.counts()
        assert counts["senders"] == counts["receivers"] == counts["owned_pages"] == 0, counts
