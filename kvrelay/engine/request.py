"""The engine's per-request record (pure Python)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvrelay.engine.types import FinishReason, SamplingParams


class ReqStatus(enum.IntEnum):
    WAITING = 0    # in the waiting queue (new, partly prefilled, or preempted)
    RUNNING = 1    # in the running batch, decoding
    FINISHED = 2   # terminal: holds no page and sits in no queue


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    first_token_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0          # tokens whose KV is in the pool
    pages: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    sampling: Any = None           # engine.sampling.SamplingState
    detok: Any = None              # engine.detokenizer.IncrementalDetokenizer
    prefill_only: bool = False     # finish right after the first token (the prefill worker)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def token_at(self, pos: int) -> int:
        p = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < p else self.output_ids[pos - p]

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def finished(self) -> bool:
        return self.status == ReqStatus.FINISHED
