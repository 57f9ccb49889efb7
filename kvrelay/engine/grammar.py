"""Constrained decoding: a `GrammarSpec` compiled by llguidance against the model's
tokenizer, one matcher per request, and the batched token mask the sampler applies.

Why llguidance: a Rust core with CPU wheels and no torch or triton dependency; JSON
schema, regex, Lark (and GBNF) and choice grammars in one engine; token masks computed
lazily from a token trie in tens of microseconds; used by vLLM and SGLang as a backend.

Contract:
- `grammar_spec.check_spec(spec)` validates a spec without a tokenizer (cached; any
  thread): the HTTP layer calls it to refuse a bad grammar with a 400 naming its parameter.
- `GrammarCompiler.compile(spec)` compiles against the tokenizer (cached pristine matcher,
  raises RequestRejected); `EngineCore.validate` calls it before a request is queued, so
  `matcher(spec)` on the engine thread only copies a compiled matcher.
- A `GrammarMatcher` lives in the request's `SamplingState` and advances in `append`,
  so every token the request emits -- sampled here, or sampled by P and appended by D --
  moves it on. Once `stopped` the request is finished (`EngineCore._append_token`).
- The mask allows EOS only where the grammar accepts: llguidance sets the EOS bit only in
  an accepting state, for the EOS ids the compiler was given (the model's).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import numpy as np
import torch

from kvrelay.engine.grammar_spec import CACHE_SIZE, check_spec, grammar_text
from kvrelay.engine.types import GrammarSpec, RequestRejected

SPARSE = 4096                   # a mask row this close to empty or full is applied by index

# byte value -> the additive bias of its 8 tokens (bit i of the byte is token 8k+i): 0 allowed, -inf not
_BIAS_LUT = torch.where(
    torch.from_numpy(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")).bool(),
    0.0, float("-inf")).float()


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: the engine thread owns it."""

    __slots__ = ("m", "words", "scratch")

    def __init__(self, matcher, words: int, scratch: "MaskScratch") -> None:
        self.m, self.words = matcher, words   # words: int32 words in one bitmask row
        self.scratch = scratch                # shared by the engine's matchers

    def accept(self, token_id: int) -> None:
        if not self.m.is_stopped():
            self.m.consume_token(token_id)   # a refused token leaves the matcher in error

    @property
    def stopped(self) -> bool:
        """No token but EOS can follow (also true in error)."""
        return self.m.is_stopped()

    @property
    def error(self) -> str:
        return self.m.get_error()

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        v = bitmask[row]
        self.m.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)


class GrammarCompiler:
    """Compiles specs against one model's tokenizer. The llguidance tokenizer is built on
    first use (~0.4 s for a 49k vocabulary), so an engine that never sees a grammar pays
    nothing. Thread-safe: `compile` runs where requests are validated, `matcher` on the
    engine thread."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids) -> None:
        self._hf, self.vocab_size, self.eos_ids = hf_tokenizer, vocab_size, list(eos_ids)
        self._lltok = None
        self.words = 0                       # int32 words in one bitmask row, once the tokenizer exists
        self.scratch = MaskScratch()
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._lock = threading.Lock()        # the cache
        self._tok_lock = threading.Lock()    # building the llguidance tokenizer, once

    def _tokenizer(self):
        with self._tok_lock:
            return self._lltok or self._build_tokenizer()

    def _build_tokenizer(self):
        import llguidance.hf   # imports transformers: only where a tokenizer is wrapped

        try:
            self._lltok = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=max(self.vocab_size, len(self._hf)), eos_token=self.eos_ids or None)
        except ValueError as exc:   # a slow (Python) tokenizer
            raise RequestRejected(f"structured output is not available for this model: {exc}",
                                  param="grammar") from None
        self.words = (self._lltok.vocab_size + 31) // 32
        return self._lltok

    def compile(self, spec: GrammarSpec):
        """The pristine compiled matcher of `spec`; RequestRejected if it does not compile.
        The lock guards the cache only: a long compilation never holds up the engine
        thread's cache hits (two threads may both compile a new spec; one result stays)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        error = check_spec(spec)
        if not error:
            m = llguidance.LLMatcher(self._tokenizer(), grammar_text(spec), log_level=0)
            error = m.get_error()
        if error:
            raise RequestRejected(f"invalid {spec.kind} grammar: {error}", param="grammar")
        with self._lock:
            self._cache[spec] = m
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return m

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        m = self.compile(spec).deep_copy()   # compile built the tokenizer, and with it `words`
        return GrammarMatcher(m, self.words, self.scratch)


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
