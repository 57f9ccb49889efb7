"""Constrained decoding: a `GrammarSpec` compiled by llguidance against the model's
tokenizer, one matcher per request, and the batched token mask the sampler applies.

Why llguidance: a Rust core with CPU wheels and no torch or triton dependency; JSON
schema, regex, Lark (and GBNF) and choice grammars in one engine; token masks computed
lazily from a token trie in tens of microseconds; used by vLLM and SGLang as a backend.

Contract:
- `grammar_spec.check_spec(spec)` validates a spec without a tokenizer (cached; any
  thread): the HTTP layer calls it to refuse a bad grammar with a 400 naming its parameter.
- `GrammarCompiler` builds the llguidance tokenizer when the engine is built, and compiles
  specs in its own threads, never on the engine thread or an event loop: `await
  prepare(spec)` (what `EngineCore.prepare` runs before a request is queued) waits at most
  COMPILE_BUDGET_S and raises RequestRejected for a grammar that does not compile or does
  not fit the limits (`grammar_spec.LIMITS`), so `matcher(spec)` on the engine thread only
  copies a compiled matcher.
- A `GrammarMatcher` lives in the request's `SamplingState` and advances in `append`,
  so every token the request emits -- sampled here, or sampled by P and appended by D --
  moves it on. Once `stopped` the request is finished (`EngineCore._append_token`); in
  error, it fails with `failure()`.
- The mask allows EOS only where the grammar accepts: llguidance sets the EOS bit only in
  an accepting state, for the EOS ids the compiler was given (the model's).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections import OrderedDict

import llguidance
import numpy as np
import torch

from kvrelay.engine.grammar_spec import CACHE_SIZE, grammar_text, parser_limits, terse
from kvrelay.engine.types import GrammarSpec, RequestRejected

SPARSE = 4096                   # a mask row this close to empty or full is applied by index
COMPILE_THREADS = 2             # compilations at once per engine
# Wall-clock seconds a request waits for its grammar's compilation before it is refused
# (400). The limits bound the work itself (the costliest grammar measured, a 128 KiB schema
# of formats, compiled in 0.5-0.9 s; the lexer-limit regex `(a{1000}){1000}b` is refused
# after 1-2.3 s); this bounds the wait, queueing behind other compilations included.
COMPILE_BUDGET_S = 10.0
# llguidance's words for a token outside the grammar; any other error of a matcher is a
# limit the grammar ran into (lexer fuel or states, parser items), i.e. the request's fault.
REFUSED = "doesn't satisfy the grammar"

# byte value -> the additive bias of its 8 tokens (bit i of the byte is token 8k+i): 0 allowed, -inf not
_BIAS_LUT = torch.where(
    torch.from_numpy(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")).bool(),
    0.0, float("-inf")).float()
# hf tokenizer -> {(vocab size, eos ids): its llguidance tokenizer}: engines built on one
# loaded model (tests, the simulation) build it once
_LLTOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LLTOKENIZERS_LOCK = threading.Lock()


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: the engine thread owns it
    (and every other matcher of its compilation: llguidance's copies share one lexer)."""

    __slots__ = ("m", "words", "scratch", "source")

    def __init__(self, matcher, words: int, scratch: "MaskScratch", source: "Compiled") -> None:
        self.m, self.words = matcher, words   # words: int32 words in one bitmask row
        self.scratch = scratch                # shared by the engine's matchers
        self.source = source                  # the compilation it was copied from

    def accept(self, token_id: int) -> None:
        if not self.m.is_stopped():
            self.m.consume_token(token_id)   # a refused token (or a limit reached) leaves the matcher in error

    @property
    def stopped(self) -> bool:
        """No token but EOS can follow (also true in error)."""
        return self.m.is_stopped()

    @property
    def error(self) -> str:
        return terse(self.m.get_error())

    def failure(self, token_id: int) -> str:
        """The error text of a request whose matcher is in error after `token_id`. A token
        outside the grammar was sampled outside its mask, or P and D disagree: a bug.
        Anything else is a limit the request's grammar reached: invalid_request, which the
        router never retries; the lexer its compilation shares is in error for good, so the
        compilation is spent (the next request for the spec compiles it afresh)."""
        if REFUSED in self.error:
            return f"internal_error: the grammar refused token {token_id}: {self.error}"
        self.source.spent = True
        return f"invalid_request: the grammar exceeded the structured-output limits: {self.error}"

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        v = bitmask[row]
        self.m.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)


class Compiled:
    """One spec compiled: its pristine matcher, whose first mask is computed (llguidance
    builds lexer states lazily, so that is where a grammar's cost first shows), or why it
    was refused. The pristine matcher and every copy of it share one lexer: the states one
    request builds serve the others, and a limit one reaches fails them all (`spent`)."""

    __slots__ = ("matcher", "error", "spent", "__weakref__")

    def __init__(self, matcher, error: str = "") -> None:
        self.matcher, self.error = matcher, error
        self.spent = False   # a matcher of it reached a limit: the shared lexer is in error


class GrammarCompiler:
    """Compiles specs against one model's tokenizer in COMPILE_THREADS threads of its own
    (llguidance's Rust releases the GIL). The llguidance tokenizer is built with the engine,
    as the first job of those threads (~0.5 s for a 49k vocabulary, mostly holding the
    GIL), so an engine is ready without waiting for it and no request ever builds it; a
    tokenizer it cannot wrap leaves `unavailable` set and every spec refused.

    Invariants: a spec compiles once per stay in the cache (concurrent requests for it wait
    on one compilation) unless a request spends it; a compilation someone holds (a request
    between `prepare` and its end) stays reachable through `_live` whatever the cache
    evicts, so `matcher` compiles on the calling thread only for a spec nobody prepared."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids) -> None:
        self.vocab_size, self.eos_ids = vocab_size, list(eos_ids)
        self.scratch = MaskScratch()
        self._cache: OrderedDict[GrammarSpec, concurrent.futures.Future] = OrderedDict()   # LRU, done or running
        self._live: weakref.WeakValueDictionary[GrammarSpec, Compiled] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()   # _cache and _live
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="kvrelay-grammar")
        self._built = self._pool.submit(_llg_tokenizer, hf_tokenizer, vocab_size, tuple(self.eos_ids))

    @property
    def tokenizer(self):
        """The llguidance tokenizer (None: unavailable); waits for its build."""
        return self._built.result()[0]

    @property
    def unavailable(self) -> str:
        """Why structured output is not available for this model ("" if it is); waits for the build."""
        return self._built.result()[1]

    def refused_now(self) -> str:
        """`unavailable`, without waiting: "" while the tokenizer is still being built
        (`prepare` refuses then, in the pool)."""
        return self._built.result()[1] if self._built.done() else ""

    @property
    def words(self) -> int:
        """int32 words in one bitmask row."""
        tok = self.tokenizer
        return (tok.vocab_size + 31) // 32 if tok is not None else 0

    async def prepare(self, spec: GrammarSpec, budget: float = COMPILE_BUDGET_S) -> Compiled:
        """`spec` compiled, waited for without blocking the caller's loop; hold the result
        until the request ends. RequestRejected if it does not compile, or not within
        `budget` seconds: the compilation itself runs on, and its result is cached like any
        other, so a spec costs one compilation however often it is sent."""
        fut = self._future(spec)
        if not fut.done():
            # asyncio.wait never cancels what it waits for: other requests may wait on `fut` too
            await asyncio.wait([asyncio.wrap_future(fut)], timeout=budget)
            if not fut.done():
                raise RequestRejected(f"the {spec.kind} grammar did not compile within {budget:g} s; simplify it",
                                      param="grammar")
        return _accepted(fut.result())

    def compile(self, spec: GrammarSpec) -> Compiled:
        """`prepare` for a caller that may block (no event loop, not the engine thread)."""
        return _accepted(self._future(spec).result())

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A copy of `spec`'s latest compilation (a spent one if its successor is not ready:
        that request then fails at its first step, as the grammar did on another's path)."""
        with self._lock:
            held = self._live.get(spec)
        compiled = _accepted(held) if held is not None else self.compile(spec)
        return GrammarMatcher(compiled.matcher.deep_copy(), self.words, self.scratch, compiled)

    def _future(self, spec: GrammarSpec) -> concurrent.futures.Future:
        if self.refused_now():
            raise RequestRejected(self.refused_now(), param="grammar")
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None and not _spent(fut):
                self._cache.move_to_end(spec)
                return fut
            held = self._live.get(spec)
            if held is not None and not held.spent:
                fut = concurrent.futures.Future()
                fut.set_result(held)
            else:
                fut = self._pool.submit(self._compile, spec)
            self._cache.pop(spec, None)   # a spent one
            self._cache[spec] = fut
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return fut

    def _compile(self, spec: GrammarSpec) -> Compiled:
        """In the pool: the latest compilation of `spec`, published to `_live`."""
        if self.unavailable:
            raise RequestRejected(self.unavailable, param="grammar")
        compiled = self._build(spec)
        with self._lock:
            self._live[spec] = compiled
        return compiled

    def _build(self, spec: GrammarSpec) -> Compiled:
        """The matcher under the limits, then its first mask and one token of it (`_warm`)."""
        try:
            m = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0, limits=parser_limits())
        except ValueError as exc:   # grammar_text: not even well-formed
            return Compiled(None, f"invalid {spec.kind} grammar: {exc}")
        if m.get_error():
            return Compiled(None, f"invalid {spec.kind} grammar: {terse(m.get_error())}")
        error = self._warm(m)
        if error:
            return Compiled(None, f"the {spec.kind} grammar exceeds the structured-output limits: {error}")
        return Compiled(m)

    def _warm(self, m) -> str:
        """Compute `m`'s first mask, and consume a token it allows in a copy: a token the
        mask allows must be accepted, so an error there is a limit the grammar reached
        while the mask was computed (llguidance then returns a partial mask and reports
        nothing until a token is consumed)."""
        mask = np.zeros(self.words, dtype=np.int32)
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if m.is_error():
            return terse(m.get_error())
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        probe = next((int(t) for t in allowed if t not in self.eos_ids), None)
        if probe is None:
            return ""
        copy = m.deep_copy()
        copy.consume_token(probe)
        return terse(copy.get_error())


def _spent(fut: concurrent.futures.Future) -> bool:
    return fut.done() and fut.exception() is None and fut.result().spent


def _accepted(compiled: Compiled) -> Compiled:
    if compiled.error:
        raise RequestRejected(compiled.error, param="grammar")
    return compiled


def _llg_tokenizer(hf_tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """(llguidance tokenizer, "") or (None, why structured output is not available)."""
    if not hasattr(hf_tokenizer, "backend_tokenizer"):   # a slow (Python) tokenizer, or none
        return None, "structured output is not available for this model: only fast tokenizers are supported"
    key = (vocab_size, eos_ids)
    with _LLTOKENIZERS_LOCK:
        built = _LLTOKENIZERS.setdefault(hf_tokenizer, {})
        if key not in built:
            import llguidance.hf   # imports transformers: only where a tokenizer is wrapped

            try:
                built[key] = (llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=max(vocab_size, len(hf_tokenizer)),
                                                           eos_token=list(eos_ids) or None), "")
            except ValueError as exc:
                built[key] = (None, f"structured output is not available for this model: {exc}")
        return built[key]


class MaskScratch:
    """The masked logits' buffer, reused step after step by one engine thread: a fresh
    [B, V] tensor per step costs its page faults (~0.5 ms for 32 x 49k floats), more than
    the masking. `known[b]`: the ids of row b that may hold a finite value, the rest of
    the row being -inf (None: anything), so a row that keeps a few tokens is reset and
    refilled in O(those tokens)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.known: list[np.ndarray | None] = []

    def take(self, like: torch.Tensor) -> torch.Tensor:
        b = self.buf
        if b is None or b.shape[0] < like.shape[0] or b.shape[1:] != like.shape[1:] or b.dtype != like.dtype \
                or b.device != like.device:
            self.buf = torch.full((max(like.shape[0], 64), *like.shape[1:]), float("-inf"), dtype=like.dtype,
                                  device=like.device)
            self.known = [np.empty(0, dtype=np.int64)] * self.buf.shape[0]
        return self.buf[:like.shape[0]]


def apply_masks(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """`logits` [B, V] with every token the row's grammar forbids at -inf: `logits` itself
    when no row forbids anything, else the engine's scratch buffer, valid until its next
    call (the sampler reads it within one `sample`).

    One bitmask fill per constrained row, then each row by the size of its sets: most JSON
    positions allow a handful of tokens (a key, a digit, a separator) and most string
    positions forbid a few thousand, so a row that allows at most SPARSE tokens is -inf
    but for those, one that forbids at most SPARSE gets -inf at just those, and only the
    rest take an additive bias over the whole row."""
    rows = np.array([b for b, g in enumerate(matchers) if g is not None], dtype=np.int64)
    if not len(rows):
        return logits
    vocab, dev = logits.shape[-1], logits.device
    first = matchers[rows[0]]
    bitmask = np.empty((len(rows), first.words), dtype=np.int32)   # one compiler per engine: one width
    for j, b in enumerate(rows):
        matchers[b].fill(bitmask, j)
    allowed = np.bitwise_count(bitmask.view(np.uint32)).sum(axis=1)
    pick = allowed <= SPARSE
    drop = ~pick & (first.words * 32 - allowed <= SPARSE)
    dense = ~pick & ~drop
    d_rows, d_ids = _set_bits(~bitmask[drop], vocab)
    if not (pick.any() or dense.any() or len(d_ids)):
        return logits
    scratch = first.scratch
    out = scratch.take(logits)
    picked = set(rows[pick].tolist())
    copied = [b for b in range(logits.shape[0]) if b not in picked]
    if copied:
        idx = torch.tensor(copied, device=dev)
        out[idx] = logits[idx]
        for b in copied:
            scratch.known[b] = None
    if len(picked):
        p_rows, p_ids = _set_bits(bitmask[pick], vocab)
        p_rows = rows[pick][p_rows]
        for b in picked:   # back to all -inf
            known = scratch.known[b]
            if known is None:
                out[b] = float("-inf")
            elif len(known):
                out[b, torch.from_numpy(known).to(dev)] = float("-inf")
        idx = (torch.from_numpy(p_rows).to(dev), torch.from_numpy(p_ids).to(dev))
        out[idx] = logits[idx]
        cuts = np.searchsorted(p_rows, sorted(picked), side="right")   # p_rows ascend
        for b, ids in zip(sorted(picked), np.split(p_ids, cuts[:-1])):
            scratch.known[b] = ids
    if len(d_ids):
        out[torch.from_numpy(rows[drop][d_rows]).to(dev), torch.from_numpy(d_ids).to(dev)] = float("-inf")
    if dense.any():
        bias = torch.nn.functional.embedding(torch.from_numpy(bitmask[dense].view(np.uint8)).long(), _BIAS_LUT)
        bias = bias.view(int(dense.sum()), -1)[:, :vocab].to(dev, logits.dtype)
        out.index_add_(0, torch.from_numpy(rows[dense]).to(dev), bias)
    return out


def _set_bits(bitmask: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, token id) of every set bit of `bitmask` [R, W] below `vocab`, row-major."""
    r, w = np.nonzero(bitmask)
    bits = np.unpackbits(bitmask[r, w].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    k, bit = np.nonzero(bits)
    ids = w[k] * 32 + bit
    ok = ids < vocab
    return r[k][ok], ids[ok]
