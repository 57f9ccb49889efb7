"""Every message between the router and a worker (HTTP + JSON). P<->D messages live in
`disagg.wire`; these are the only other bodies that cross a process boundary.

Worker endpoints (prefill and decode alike):
    POST /generate   LegRequest -> an NDJSON stream of `StepOutput` lines; the last line has
                     `finish_reason` set. A request that can never be served gets HTTP 400
                     with an OpenAI error body before any line. A decode leg of n choices
                     ends after n final lines (each line carries its choice's `index`), or
                     at its first error/abort line. The prefill leg sends exactly one line: finish_reason "length" once D acknowledged the KV, else
                     "error"/"abort" with `error` = "<reason code>: <detail>".
                     Closing the stream early aborts the leg.
    POST /abort      AbortRequest -> {"aborted": bool}
    GET  /health     -> WorkerHealth (load figures for pairing, and how old they are)
    GET  /metrics, GET /debug/requests
    POST /debug/faults FaultsRequest -> replaces the worker's fault-injection spec (served only
                     with --enable-fault-injection, on loopback)

Validation at the edge: every field of a leg is typed strictly and bounded here, so a body
the engine loop could choke on (an unparseable `prefill_address`, a token id past 2**31, a
thousand stop strings) is a 400 naming the field before any line streams. The NDJSON
lines are written so that they always encode (`output_to_json`) and read so that any
malformed line is a ValueError (`output_from_json`): the router fails that leg only.
"""
from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from kvrelay.disagg.wire import valid_endpoint
from kvrelay.engine.grammar_spec import MAX_GRAMMAR_CHARS
from kvrelay.engine.types import MAX_N, FinishReason, GrammarSpec, SamplingParams, StepOutput, TokenLogprob
from kvrelay.server.errors import json_text
from kvrelay.server.protocol import (LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, MAX_STOP_CHARS,
                                     MAX_STOP_TOKEN_IDS, MAX_STOPS, SEED_LIMIT, TOKEN_ID_LIMIT, TOP_K_LIMIT, Text)

MAX_ROOM = 2**63 - 1
MAX_RID_CHARS = 200
MAX_PROMPT_IDS = 1 << 20       # far above any context length; the engine checks max_model_len
RID_RE = re.compile(r"[A-Za-z0-9._:@+=-]+")
_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]
Stop = Annotated[Text, Field(max_length=MAX_STOP_CHARS)]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]


def check_endpoint(address: str) -> str:
    """`address` if it is a `tcp://host:port` the wire layer would accept (`wire.valid_endpoint`),
    else a validation error."""
    if not valid_endpoint(address, ("tcp",)):
        raise PydanticCustomError("invalid_address", "must be tcp://host:port (host a DNS name, an IPv4 "
                                  "address or a bracketed IPv6 address; port 1-65535)")
    return address


class WireGrammar(BaseModel):
    """`engine.types.GrammarSpec` on the wire; D rebuilds the matcher from it and replays P's token."""
    model_config = _STRICT

    kind: Literal["json_object", "json_schema", "regex", "choice", "lark"]
    value: Text = Field("", max_length=MAX_GRAMMAR_CHARS)


class WireBias(BaseModel):
    """One logit_bias entry (an object: FastAPI checks a leg's body in strict Python mode,
    where a JSON array is never a tuple)."""
    model_config = _STRICT

    token: TokenId                  # the engine checks it against the vocabulary
    bias: Bias


class WireSampling(BaseModel):
    model_config = _STRICT

    max_tokens: int = Field(ge=1, lt=TOKEN_ID_LIMIT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, lt=TOP_K_LIMIT)
    seed: int | None = Field(None, gt=-SEED_LIMIT, lt=SEED_LIMIT)
    stop: list[Stop] = Field([], max_length=MAX_STOPS)
    stop_token_ids: list[TokenId] = Field([], max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: list[WireBias] = Field([], max_length=MAX_LOGIT_BIAS_TOKENS)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0, lt=TOKEN_ID_LIMIT)   # counts P's first token
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    n: int = Field(1, ge=1, le=MAX_N)   # choices; a decode leg streams n of them, each line tagged `index`
    grammar: WireGrammar | None = None   # compiled (and refused if bad) by the worker's validate

    @classmethod
    def of(cls, p: SamplingParams) -> "WireSampling":
        return cls(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                   seed=p.seed, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                   ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty,
                   frequency_penalty=p.frequency_penalty, logprobs=p.logprobs,
                   logit_bias=[WireBias(token=t, bias=b) for t, b in p.logit_bias], min_p=p.min_p,
                   min_tokens=p.min_tokens, repetition_penalty=p.repetition_penalty, n=p.n,
                   grammar=WireGrammar(kind=p.grammar.kind, value=p.grammar.value) if p.grammar else None)

    def params(self) -> SamplingParams:
        d = self.model_dump()
        d["stop"], d["stop_token_ids"] = tuple(self.stop), tuple(self.stop_token_ids)
        d["logit_bias"] = tuple((e.token, e.bias) for e in self.logit_bias)
        d["grammar"] = GrammarSpec(self.grammar.kind, self.grammar.value) if self.grammar else None
        return SamplingParams(**d)


def _check_rid(rid: str) -> str:
    if not RID_RE.fullmatch(rid):
        raise PydanticCustomError("invalid_rid", "may hold only letters, digits and . _ : @ + = -")
    return rid


Rid = Annotated[str, Field(min_length=1, max_length=MAX_RID_CHARS), AfterValidator(_check_rid)]


class LegRequest(BaseModel):
    """One leg of a disaggregated request. A decode leg has exactly one of
    `prefill_address` (P's control address, from P's WorkerHealth.transfer_address:
    `tcp://host:port`) and `prefill_here` (the decode worker prefills the prompt itself:
    the router's adaptive split); a prefill leg has neither (the worker checks, with a 400)."""
    model_config = _STRICT

    rid: Rid
    room: int = Field(ge=1, le=MAX_ROOM)
    prompt_ids: list[TokenId] = Field(min_length=1, max_length=MAX_PROMPT_IDS)
    sampling: WireSampling
    prefill_address: str | None = None
    prefill_here: bool = False

    @property
    def is_decode(self) -> bool:
        return self.prefill_address is not None or self.prefill_here

    @field_validator("prefill_address")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return None if v is None else check_endpoint(v)


class AbortRequest(BaseModel):
    model_config = _STRICT

    rid: Rid


class FaultsRequest(BaseModel):
    model_config = _STRICT

    spec: str = Field("", max_length=4096)   # disagg.faults syntax; "" switches faults off


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
    # A worker's prefill queue in time (the router's TTFT prediction: --shed-ttft,
    # --decode-prefill-ttft): prompt tokens it has yet to compute (P: of its rooms before
    # transfer; D: of the legs it prefills itself and of preempted requests), and its
    # measured seconds per prompt token (null until it prefilled once).
    queued_prompt_tokens: int = Field(0, ge=0)
    prefill_s_per_token: float | None = Field(None, ge=0, allow_inf_nan=False)
    # What computes (`EngineCore.compute_info`): the device, kernel variant, dtype, weight
    # storage, KV cache dtype, attention backend.
    device: str = ""
    kernels: str = ""
    dtype: str = ""
    weights: str = ""
    kv_cache: str = ""
    attention: str = ""
    # Whether the caller's credential was right (`security.AUTH_SCOPE`): "off" (the worker
    # has no cluster key), "ok", or "refused" (the worker expects another cluster key).
    auth: Literal["off", "ok", "refused"] = "off"
    # Every field but `auth` is what the worker's engine thread last published (after each
    # loop iteration, and between the layers of a long prefill pass); /health answers from
    # it without waiting on the loop. `loop_age`: seconds since then, on the worker's own
    # monotonic clock: near 0 on a live loop, growing on a hung one, so a view older than
    # --health-timeout means what an unanswered check did. `iterations`: loop iterations
    # the engine had completed then (from 0 in each incarnation). An older worker, which
    # answered on its engine thread, sends neither: 0 and 0.
    loop_age: float = Field(0.0, ge=0, allow_inf_nan=False)
    iterations: int = Field(0, ge=0)


def _finite(x: float) -> float | None:
    # JSON has no -inf/nan: a -inf logprob travels as null and comes back as -inf.
    return x if math.isfinite(x) else None


def output_to_json(out: StepOutput) -> str:
    """One NDJSON line. Never raises on odd text: a lone surrogate becomes U+FFFD."""
    return json_text({
        "rid": out.rid, "index": out.index, "token_ids": out.token_ids, "text": out.text,
        "logprobs": [[lp.token_id, _finite(lp.logprob), [[t, _finite(v)] for t, v in lp.top]] for lp in out.logprobs],
        "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
        "finish_reason": out.finish_reason.value if out.finish_reason is not None else None,
        "error": out.error}) + "\n"


class _Line(BaseModel):
    """The shape of one NDJSON line (strict: a wrong type is a malformed line)."""
    model_config = ConfigDict(strict=True, extra="ignore")

    rid: str = Field(max_length=MAX_RID_CHARS + 16)
    index: int = Field(0, ge=0, lt=MAX_N)   # the choice (an older worker sends none: 0)
    token_ids: list[TokenId]
    text: str
    logprobs: list[tuple[TokenId, float | None, list[tuple[TokenId, float | None]]]]
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    finish_reason: FinishReason | None
    error: str | None


def _logprob(x: float | None) -> float:
    return -math.inf if x is None else x


def output_from_json(line: str | bytes) -> StepOutput:
    """The StepOutput of one NDJSON line. Raises ValueError for anything else (not JSON,
    not an object, a field missing or of the wrong type)."""
    try:
        d: Any = _Line.model_validate_json(line)
    except ValueError as exc:   # pydantic.ValidationError is a ValueError
        raise ValueError(f"malformed output line: {str(exc).splitlines()[0]}") from None
    return StepOutput(
        rid=d.rid, index=d.index, token_ids=list(d.token_ids), text=d.text,
        logprobs=[TokenLogprob(t, _logprob(lp), tuple((a, _logprob(b)) for a, b in top)) for t, lp, top in d.logprobs],
        prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens,
        finish_reason=d.finish_reason, error=d.error)
