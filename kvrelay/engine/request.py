"""The engine's per-request record (pure Python): one `Req` per choice.

A request of n > 1 choices starts as one record, choice 0, which alone is prefilled. When
its prompt's KV is computed the engine forks it: choices 1..n-1 get records of their own
(their own sampling state, detokenizer, stop handling and finish) that share choice 0's
pages (`Scheduler.fork`), and `group` lists all n records in index order.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
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
    index: int = 0                 # which of the request's params.n choices this is
    group: list["Req"] | None = None   # the n choices once forked (shared by all of them); None before

    @property
    def owner(self) -> tuple[str, int] | str:
        """Who holds this choice's pages in the allocator: choice 0 holds them under the
        request id (the disaggregated workers hand pages between a room and the rid)."""
        return self.rid if self.index == 0 else (self.rid, self.index)

    @property
    def choices(self) -> list["Req"]:
        """Every choice record of the request: all n once forked, else this one."""
        return self.group if self.group is not None else [self]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def finished(self) -> bool:
        return self.status == ReqStatus.FINISHED


_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a seeded request: choice 0 keeps the request's seed
    (n=1 samples as before); the others get unrelated, reproducible ones (splitmix64 of
    (seed, index)), so seeded choices differ from each other and repeat run after run."""
    if index == 0:
        return seed
    z = (seed * 0xD1B54A32D192ED03 + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """What choice `index` samples with: the request's parameters, with its own seed."""
    if index == 0 or params.seed is None:
        return params
    return replace(params, seed=choice_seed(params.seed, index))
