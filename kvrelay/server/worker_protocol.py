"""Every message between the router and a worker (HTTP + JSON). P<->D messages live in
`disagg.wire`; these are the only other bodies that cross a process boundary.

Worker endpoints (prefill and decode alike):
    POST /generate   LegRequest -> an NDJSON stream of `StepOutput` lines; the last line has
                     `finish_reason` set. A request that can never be served gets HTTP 400
                     with an OpenAI error body before any line. The prefill leg sends exactly
                     one line: finish_reason "length" once D acknowledged the KV, else
                     "error"/"abort" with `error` = "<reason code>: <detail>".
                     Closing the stream early aborts the leg.
    POST /abort      AbortRequest -> {"aborted": bool}
    GET  /health     -> WorkerHealth (load figures for pairing)
    GET  /metrics, GET /debug/requests
    POST /debug/faults FaultsRequest -> replaces the worker's fault-injection spec
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, Field

from kvrelay.engine.types import FinishReason, SamplingParams, StepOutput, TokenLogprob

MAX_ROOM = 2**63 - 1


class WireSampling(BaseModel):
    max_tokens: int = Field(ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    @classmethod
    def of(cls, p: SamplingParams) -> "WireSampling":
        return cls(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                   seed=p.seed, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                   ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty,
                   frequency_penalty=p.frequency_penalty, logprobs=p.logprobs)

    def params(self) -> SamplingParams:
        d = self.model_dump()
        d["stop"], d["stop_token_ids"] = tuple(self.stop), tuple(self.stop_token_ids)
        return SamplingParams(**d)


class LegRequest(BaseModel):
    """One leg of a disaggregated request. `prefill_address` (decode legs only) is P's
    control address, from P's WorkerHealth.transfer_address."""
    rid: str = Field(min_length=1, max_length=200)
    room: int = Field(ge=1, le=MAX_ROOM)
    prompt_ids: list[int] = Field(min_length=1)
    sampling: WireSampling
    prefill_address: str | None = None


class AbortRequest(BaseModel):
    rid: str


class FaultsRequest(BaseModel):
    spec: str = ""   # disagg.faults syntax; "" switches faults off


class WorkerHealth(BaseModel):
    status: Literal["ok"] = "ok"
    role: Literal["prefill", "decode"]
    worker_id: str
    incarnation: str
    model: str
    max_model_len: int
    transfer_backend: str
    transfer_address: str      # P: what a decode leg's prefill_address must be
    live_requests: int         # rooms the lifecycle holds (every phase)
    queued_requests: int       # rooms not yet computing (P: bootstrap+queued; D: bootstrap+waiting)
    free_pages: int
    total_pages: int


def output_to_json(out: StepOutput) -> str:
    return json.dumps({
        "rid": out.rid, "token_ids": out.token_ids, "text": out.text,
        "logprobs": [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in out.logprobs],
        "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
        "finish_reason": out.finish_reason.value if out.finish_reason is not None else None,
        "error": out.error}, ensure_ascii=False, separators=(",", ":")) + "\n"


def output_from_json(line: str | bytes) -> StepOutput:
    d = json.loads(line)
    return StepOutput(
        rid=d["rid"], token_ids=list(d["token_ids"]), text=d["text"],
        logprobs=[TokenLogprob(t, lp, tuple((int(a), float(b)) for a, b in top)) for t, lp, top in d["logprobs"]],
        prompt_tokens=d["prompt_tokens"], completion_tokens=d["completion_tokens"],
        finish_reason=FinishReason(d["finish_reason"]) if d["finish_reason"] else None, error=d["error"])
