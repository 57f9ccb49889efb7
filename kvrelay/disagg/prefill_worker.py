"""The prefill worker's core: the engine it holds plus the prefill side of the lifecycle,
stepped together on the engine thread.

A leg goes: `add` (bootstrap: waiting for D's destination) -> queued -> handed to the
engine as a prefill-only request (prefill) -> `request_finished` (the engine's hook): the
transfer starts (transfer), and the engine hands the request's pages to the room -> D's
ack, or any failure, ends the room and frees the pages (`_release_room`). The leg's sink
gets exactly one output, when the room ends: finish_reason LENGTH for done, else
ERROR/ABORT with the reason.

A request of n > 1 choices is prefilled once and its KV sent once: the engine forks it at
the first token, each choice samples its first token from the same logits with its own
sampling state, and `request_finished` (called once per choice, in index order, in one
step) collects the n tokens into one `Aux`; only choice 0's references move to the room,
the others' are dropped as those choices end there.

Invariants:
- Pages of a room in transfer are owned by `("room", room)` in the engine's allocator; a
  room that ends before its prefill finished is aborted in the engine, which frees them.
- Heartbeats leave from `step()` and, inside a prefill pass, between its layers
  (`between_layers`): both on the scheduler loop's thread, so a hung loop or pass stops beating.
- Layer-wise transfer (`--layerwise-transfer`, where the backend `writes_within_pages`):
  between layers, the layers computed since the last call go to D (`send_ahead`) for each
  room in the pass; `prefill_done` sends the rest (`LayerCursor.finish`), and aux only
  after every byte. A room's cursor ends with the room.
"""
from __future__ import annotations

from collections.abc import Hashable

from kvrelay.disagg import wire
from kvrelay.disagg.layerwise import LayerCursor
from kvrelay.disagg.lifecycle import PPhase, TerminalEvent, phase_name
from kvrelay.disagg.prefill_side import PrefillSide
from kvrelay.disagg.worker_core import Leg, WorkerCore, reason_of
from kvrelay.engine.hooks import PassProgress
from kvrelay.engine.request import Req
from kvrelay.engine.sampling import SampleResult
from kvrelay.engine.types import FinishReason, GenerateRequest, StepOutput


class PrefillCore(WorkerCore):
    role = "prefill"
    PHASES = tuple(phase_name(p) for p in (PPhase.BOOTSTRAP, PPhase.QUEUED, PPhase.PREFILL, PPhase.TRANSFER))
    QUEUED_PHASES = ("bootstrap", "queued")
    RUNNING_PHASES = ("prefill",)
    LONG_STEPS = True   # it heartbeats between layers, and no decode here waits on a step

    def _make_side(self) -> PrefillSide:
        # Layer-wise transfer: a room's KV goes to D layer by layer while its prompt computes.
        self._layerwise = self.transfer_cfg.layerwise_transfer and self.manager.writes_within_pages
        self._cursors: dict[int, LayerCursor] = {}   # room -> what of it went ahead
        return PrefillSide(self.lifecycle_cfg, self.manager, self.clock, self._release_room,
                           on_terminal=self._on_terminal)

    def between_layers(self, progress: PassProgress) -> None:   # EngineHooks
        if self._layerwise and progress.layers:
            self._write_ahead(progress)
        super().between_layers(progress)

    def _write_ahead(self, progress: PassProgress) -> None:
        """Send D the layers this pass has computed since the last call, for each room
        in it (only reads the pool: the pass goes on writing the next layers)."""
        fenced = False
        for item in progress.items:
            room = self.room_of.get(item.req.rid)
            r = self.side.lc.rooms.get(room) if room is not None else None
            if r is None or r.phase is not PPhase.PREFILL or item.req.index:
                continue
            cursor = self._cursors.setdefault(room, LayerCursor(self.engine.layout))
            parts = cursor.advance(item.start, item.start + item.length, progress.layers)
            if parts:
                if not fenced:
                    self.engine.kv.fence()
                    fenced = True
                self.side.send_ahead(room, list(item.req.pages), parts)

    # ---- legs ----------------------------------------------------------------------------
    def add(self, greq: GenerateRequest, sink, room: int) -> None:
        self.validate_leg(greq)
        self._add_leg(Leg(greq, sink, room))
        self.side.add(room, greq.rid)

    def _feed_engine(self) -> None:
        sched = self.engine.scheduler
        if not sched.waiting:  # rooms wait in `queued` (with its deadline), not in the engine
            free = sched.config.max_running_requests - len(sched.running)
            for room in self.side.take_queued(max(free, 0)):
                leg = self.legs[room]
                self.engine.add(leg.greq, self._engine_sink(room), prefill_only=True)
                leg.in_engine = True
                if self.metrics is not None:   # queued since the leg arrived: bootstrap + queued
                    self.metrics.observe_queue(self.clock.now() - self.side.lc.rooms[room].created)

    def queued_prompt_tokens(self) -> int:
        """Of every room not yet handed off (bootstrap, queued, prefill): its prompt tokens
        not yet computed."""
        total = 0
        for room, leg in self.legs.items():
            r = self.side.lc.rooms.get(room)
            if r is None or r.phase not in (PPhase.BOOTSTRAP, PPhase.QUEUED, PPhase.PREFILL):
                continue
            req = self.engine.request(leg.greq.rid) if leg.in_engine else None
            total += len(leg.greq.prompt_ids) - (req.num_computed if req is not None else 0)
        return total

    def _engine_sink(self, room: int):
        def sink(out: StepOutput) -> None:
            # Normal ends went through request_finished; an engine abort or error fails the room.
            if out.finished and out.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                self.side.abort(room, *reason_of(out))
        return sink

    def final_outputs(self, greq: GenerateRequest) -> int:
        return 1   # the leg's one answer, whatever n is

    def request_finished(self, req: Req, last: SampleResult) -> Hashable | None:   # EngineHooks
        """A prefill-only choice has its first token (`last`): choice 0's pages go to the
        room, and once every choice has its token the transfer starts. None (the engine
        frees the pages) once the room has ended."""
        room = self.room_of.get(req.rid)
        r = self.side.lc.rooms.get(room) if room is not None else None
        if not req.prefill_only or r is None or r.phase is not PPhase.PREFILL:
            return None
        leg = self.legs[room]
        if req.index == 0:
            leg.firsts = []
        leg.firsts.append(last)
        if len(leg.firsts) == req.params.n:
            # Every choice's pages are the prompt's: shared, never written by a prefill-only choice.
            self._start_transfer(room, leg, req.prompt_len, list(req.pages), r.created)
        return ("room", room) if req.index == 0 else None

    def _start_transfer(self, room: int, leg: Leg, prompt_len: int, pages: list[int], created: float) -> None:
        """The prompt's KV is in `pages` (the room's, once the engine has handed them over
        as the hook returns) and each choice has its first token: send both to D."""
        tokens = [wire.FirstToken(f.token_id, f.logprob.logprob if f.logprob else None,
                                  tuple(f.logprob.top) if f.logprob else ()) for f in leg.firsts]
        head = tokens[0]
        crc = self.engine.kv.checksum(pages) if self.transfer_cfg.verify_kv else None
        aux = wire.Aux(room, 0, first_token=head.token, logprob=head.logprob, top_logprobs=head.top_logprobs,
                       prompt_tokens=prompt_len, more_choices=tuple(tokens[1:]), kv_crc=crc)
        leg.in_engine = False
        if self.metrics is not None:
            self.metrics.observe_leg_first_token(self.clock.now() - created)
        cursor = self._cursors.pop(room, None)
        self.side.prefill_done(room, pages, aux, cursor.finish(prompt_len, len(pages)) if cursor else None)

    def _release_room(self, room: int) -> None:
        self.engine.allocator.free(("room", room))

    def _on_terminal(self, ev: TerminalEvent) -> None:
        self._record_terminal(ev)
        self._cursors.pop(ev.room, None)
        leg = self._pop_leg(ev.room)
        if leg is None:
            return
        if leg.in_engine:  # ended during its forward pass: the engine drops it and its pages
            self.engine.abort(leg.greq.rid, FinishReason.ABORT)
        if ev.phase == "done":
            self._answer(leg, StepOutput(leg.greq.rid, finish_reason=FinishReason.LENGTH,
                                         prompt_tokens=len(leg.greq.prompt_ids)))
        else:
            self._answer_failed(leg, ev)

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        room = self.room_of.get(rid)
        if room is not None:
            self.side.abort(room, *reason_of(StepOutput(rid, finish_reason=reason, error=error)))
