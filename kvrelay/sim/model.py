"""The simulation's stand-in model: deterministic, cheap, and honest about its KV.

Every token position has a KV slot in the pool (the first 8 bytes of layer 0's K row for
that token), holding a chained hash: slot(pos) = H(slot(pos - 1), token(pos)). A forward
pass reads the slot before each new token from the pool, writes the new slots, and the
next token is derived from the last slot. So the tokens of a request depend on the bytes
its pages really hold: a page that another request's write reached, a transfer that
landed late or not at all, or a page freed too early changes what comes out, and
`expected_tokens` (a pure function of the prompt) is what a fault-free run produces.

The logits put 0 on that token and -0.5 on a runner-up, -30 elsewhere: greedy decoding
never sees the runner-up, seeded sampling takes it about a third of the time, so the
choices of a sampled request of n > 1 diverge (and must not write into each other's
pages); `expected_sampled` replays the production sampler on the same logits.

Nothing else is simulated: the engine, scheduler, allocator, sampler (greedy, on one-hot
logits) and detokenizer that run it are the production ones.
"""
from __future__ import annotations

import hashlib

import torch

from kvrelay.engine.loader import LoadedModel
from kvrelay.engine.models.base import ArchConfig
from kvrelay.engine.request import choice_params
from kvrelay.engine.runner import Runner
from kvrelay.engine.sampling import Sampler, SamplingState
from kvrelay.engine.types import SamplingParams

VOCAB = 64
EOS = 0
SLOT = 8          # bytes of a slot's hash
ZERO = bytes(SLOT)


def chain(prev: bytes, token: int) -> bytes:
    return hashlib.blake2b(prev + token.to_bytes(4, "little"), digest_size=SLOT).digest()


def next_token(slot: bytes, eos_ok: bool) -> int:
    """The token after a sequence whose last slot is `slot` (never EOS unless allowed)."""
    n = int.from_bytes(slot, "little")
    return n % VOCAB if eos_ok else 1 + n % (VOCAB - 1)


def runner_up(slot: bytes, eos_ok: bool) -> int:
    """The second-best token after `slot`: never the best one, never EOS."""
    best = next_token(slot, eos_ok)
    tok = 1 + (int.from_bytes(slot, "little") >> 16) % (VOCAB - 1)
    return tok if tok != best else 1 + tok % (VOCAB - 1)


def logits_for(slots: list[bytes], eos_ok: bool) -> torch.Tensor:
    logits = torch.full((len(slots), VOCAB), -30.0)
    for row, h in enumerate(slots):
        logits[row, runner_up(h, eos_ok)] = -0.5
        logits[row, next_token(h, eos_ok)] = 0.0
    return logits


def expected_sampled(prompt: list[int], params: SamplingParams, index: int, eos_ok: bool) -> list[int]:
    """What a fault-free run generates for choice `index` of a seeded request (the
    production sampler, with that choice's own sampling state; stops after EOS)."""
    h = ZERO
    for t in prompt:
        h = chain(h, t)
    state = SamplingState(choice_params(params, index), prompt)
    out: list[int] = []
    while len(out) < params.max_tokens:
        tok = Sampler().sample(logits_for([h], eos_ok), [state])[0].token_id
        out.append(tok)
        state.append(tok)
        if tok == EOS:
            break
        h = chain(h, tok)
    return out


def expected_tokens(prompt: list[int], max_tokens: int, eos_ok: bool) -> list[int]:
    """What a fault-free run generates for `prompt` (greedy; stops after EOS)."""
    h = ZERO
    for t in prompt:
        h = chain(h, t)
    out: list[int] = []
    while len(out) < max_tokens:
        tok = next_token(h, eos_ok)
        out.append(tok)
        if tok == EOS:
            break
        h = chain(h, tok)
    return out


class SimTokenizer:
    """Each token id decodes to a short word; enough for the detokenizer and stop strings."""
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens: bool = True, **_) -> str:
        return "".join(f" t{i}" for i in ids if not (skip_special_tokens and i == EOS))

    def __deepcopy__(self, memo) -> "SimTokenizer":
        return self


class HashModel:
    """Stands where a CausalLM would; all it carries is whether EOS may be sampled."""

    def __init__(self, eos_ok: bool) -> None:
        self.eos_ok = eos_ok


class HashRunner(Runner):
    """The engine's `Runner` over the chained-hash slots. `work` counts
    the token positions computed since the simulation last reset it (its cost model).
    A step costs simulated time only after it returns, so what runs inside one runs at its
    start: a prefill pass calls `between_layers` once, after layer 0 (the layer-wise
    transfer of what it computed), but no time passes in it, so no heartbeat leaves a long
    pass on time: `CALLS_BETWEEN_LAYERS` stays False and workers keep short steps."""
    CALLS_BETWEEN_LAYERS = False

    def __init__(self, model: HashModel, kv) -> None:
        layout = kv.layout
        self.eos_ok = model.eos_ok
        self.buf = kv.buffer()
        self.page_bytes, self.page_size = layout.page_bytes, layout.page_size
        self.row = layout.page_size * layout.head_dim * 4    # one head's K row for a page (float32)
        self.work = 0

    def _at(self, pages: list[int], pos: int) -> int:
        page, off = divmod(pos, self.page_size)
        return pages[page] * self.page_bytes + off * (self.row // self.page_size)

    def read(self, pages: list[int], pos: int) -> bytes:
        at = self._at(pages, pos)
        return bytes(self.buf[at:at + SLOT])

    def _extend(self, tokens: list[int], start: int, pages: list[int]) -> bytes:
        h = self.read(pages, start - 1) if start > 0 else ZERO
        for i, t in enumerate(tokens):
            h = chain(h, t)
            at = self._at(pages, start + i)
            self.buf[at:at + SLOT] = h
        self.work += len(tokens)
        return h

    def _logits(self, last: list[bytes]) -> torch.Tensor:
        return logits_for(last, self.eos_ok)

    def prefill(self, chunks) -> torch.Tensor:
        last = [self._extend(c.tokens, c.start, c.pages) for c in chunks]
        if self.between_layers is not None:
            self.between_layers(1)
        return self._logits(last)

    def decode(self, last_tokens: list[int], positions: list[int], pages: list[list[int]]) -> torch.Tensor:
        return self._logits([self._extend([t], p, pg) for t, p, pg in zip(last_tokens, positions, pages)])


def sim_loaded(eos_ok: bool = True, max_model_len: int = 512) -> LoadedModel:
    """A LoadedModel whose engine runs `HashRunner`. One KV head of 2 floats: a slot is
    exactly one token's layer-0 K (8 bytes). Two layers, so that a layer-wise transfer
    moves each page in two spans (layer 0 ahead, layer 1 at the prompt's end), as a real
    model's does; layer 1 holds no slot, only bytes that travel."""
    arch = ArchConfig("SimHashLM", vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_layers=2,
                      num_heads=1, num_kv_heads=1, head_dim=2, max_position_embeddings=max_model_len)
    return LoadedModel(model=HashModel(eos_ok), arch=arch, tokenizer=SimTokenizer(), eos_token_ids=(EOS,),
                       chat_template=None, name="sim-hash", dtype="float32", max_model_len=max_model_len,
                       make_runner=HashRunner)
