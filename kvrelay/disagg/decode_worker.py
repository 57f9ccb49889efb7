"""The decode worker's core: the engine it holds plus the decode side of the lifecycle,
stepped together on the engine thread.

A leg goes: `add` (bootstrap: learn P's endpoint, reserve pages, waiting while the pool
is full) -> waiting (destination sent; KV and aux arriving) -> `take_ready`: the pages
change owner from the room to the request, which joins the running batch with the first
token from aux (decode) -> the engine finishes it -> `side.finish`. Continuous batching,
sampling and stop handling are the engine's. A leg with no prefill address (the router's
adaptive split: P's queue would miss TTFT) is prefilled by this engine: its room enters
decode at once and the request is queued like a colocated one.

Invariants:
- A room prefilled here never owns pages: the engine allocates them under its rid.
- Reserved pages are owned by `("room", room)` until the request enters the engine; after
  that the engine owns them (under its rid) and frees them when it finishes the request,
  so `_release_room` then finds nothing to free.
- A room whose aux carries a CRC (`--verify-kv` on P) enters the engine only if its
  pages, as landed, have that CRC; otherwise it fails (transfer_error) with them unread.
- The sink sees the engine's outputs while decoding; before that, only the final error or
  abort outputs (one per choice) of a room that ended early.
- A request of n > 1 choices reserves and receives the prompt's pages once; `Aux` brings
  the n first tokens P sampled, and the engine forks the pages into n choices
  (`EngineCore.add_prefilled`). The room ends when the last choice ends: done if every
  choice stopped or reached its length, else with the first failure.
"""
from __future__ import annotations

import logging

from kvrelay.core import ids
from kvrelay.disagg import wire
from kvrelay.disagg.decode_side import DecodeSide
from kvrelay.disagg.lifecycle import DPhase, Reason, TerminalEvent, phase_name
from kvrelay.disagg.worker_core import Leg, WorkerCore, reason_of
from kvrelay.engine.sampling import SampleResult
from kvrelay.engine.scheduler import pages_for
from kvrelay.engine.types import FinishReason, GenerateRequest, RequestRejected, StepOutput, TokenLogprob

log = logging.getLogger("kvrelay.worker")


class DecodeCore(WorkerCore):
    role = "decode"
    PHASES = tuple(phase_name(p) for p in (DPhase.BOOTSTRAP, DPhase.WAITING, DPhase.DECODE))
    QUEUED_PHASES = ("bootstrap", "waiting")
    RUNNING_PHASES = ("decode",)

    def _make_side(self) -> DecodeSide:
        return DecodeSide(self.lifecycle_cfg, self.manager, self.clock, self._reserve, self._release_room,
                          on_terminal=self._on_terminal, capacity=self.engine.kv.num_pages)

    # ---- legs ----------------------------------------------------------------------------
    def add(self, greq: GenerateRequest, sink, room: int, prefill_address: str | None) -> None:
        """`prefill_address`: the P that computes the prompt; None: this engine does."""
        self.validate_leg(greq)
        if prefill_address is None and self.engine.request(greq.rid) is not None:   # engine.add would refuse it
            raise RequestRejected(f"request id {greq.rid} is already live on this worker", param="rid")
        leg = Leg(greq, sink, room, finals=greq.params.n)
        self._add_leg(leg)
        if prefill_address is None:
            self.side.add_local(room, greq.rid)
            leg.in_engine = True
            self.engine.add(greq, self._engine_sink(leg))
            return
        self.side.add(room, greq.rid, prefill_address, pages_for(len(greq.prompt_ids), self.engine.layout.page_size))

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens this engine has yet to compute: of the legs it prefills itself and
        of preempted requests it recomputes."""
        return sum(r.seq_len - r.num_computed for r in self.engine.scheduler.waiting)

    def _reserve(self, room: int, n: int) -> tuple[list[int], int] | None:
        pages = self.engine.allocator.allocate(n, ("room", room))
        if pages is None:
            return None
        # A new epoch per reservation, random: a late write for an old one is recognisable,
        # and no one can guess the current one from the previous.
        return pages, 1 + ids.randbelow(wire.I63)

    def _release_room(self, room: int, pages: list[int]) -> None:
        self.engine.allocator.free(("room", room))

    def _feed_engine(self) -> None:
        for room, aux in self.side.take_ready():
            self._start_decode(room, aux)

    def _start_decode(self, room: int, aux) -> None:
        leg = self.legs[room]
        rid, params = leg.greq.rid, leg.greq.params
        tokens = aux.first_tokens()
        if len(tokens) != params.n:
            self.side.abort(room, Reason.TRANSFER_ERROR.value,
                            f"the prefill side sent {len(tokens)} first tokens for n={params.n} choices")
            return
        firsts = []
        for t in tokens:
            lp = None
            if params.logprobs is not None and t.logprob is not None:
                lp = TokenLogprob(t.token, t.logprob, tuple(t.top_logprobs)[:params.logprobs])
            firsts.append(SampleResult(t.token, lp))
        pages = self.side.lc.rooms[room].data.pages
        if aux.kv_crc is not None and (crc := self.engine.kv.checksum(pages)) != aux.kv_crc:
            log.warning("KV checksum mismatch", extra={"rid": rid, "room": room, "pages": len(pages),
                                                       "prefill_crc": aux.kv_crc, "decode_crc": crc})
            self.side.abort(room, Reason.TRANSFER_ERROR.value,
                            f"the KV of {len(pages)} pages landed with CRC-32 {crc:08x}; the prefill side "
                            f"sent {aux.kv_crc:08x} (--verify-kv)")
            return
        self.engine.allocator.transfer(("room", room), rid)
        leg.in_engine = True
        if self.metrics is not None:   # since the leg arrived: bootstrap + waiting for the KV
            self.metrics.observe_leg_first_token(self.clock.now() - self.side.lc.rooms[room].created)
        self.engine.add_prefilled(leg.greq, self._engine_sink(leg), pages, firsts)

    def _engine_sink(self, leg: Leg):
        def sink(out: StepOutput) -> None:
            self._answer(leg, out)
            if not (out.finished and leg.answered):
                return   # a choice is still decoding
            leg.in_engine = False
            if leg.failure is None:
                self.side.finish(leg.room)
            else:
                self.side.abort(leg.room, *reason_of(leg.failure))
        return sink

    def _on_terminal(self, ev: TerminalEvent) -> None:
        self._record_terminal(ev)
        leg = self._pop_leg(ev.room)
        if leg is None or leg.answered:
            return
        if leg.in_engine:  # ended while decoding (abort, --max-request-time): the engine answers
            aborted = ev.phase == "aborted"
            self.engine.abort(leg.greq.rid, FinishReason.ABORT if aborted else FinishReason.ERROR,
                              None if aborted else f"{ev.reason}: {ev.detail}")
        else:
            self._answer_failed(leg, ev)

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        room = self.room_of.get(rid)
        if room is None:
            self.engine.abort(rid, reason, error)
        elif self.legs[room].in_engine:
            self.engine.abort(rid, reason, error)  # the engine sink ends the room
        else:
            self.side.abort(room, *reason_of(StepOutput(rid, finish_reason=reason, error=error)))
