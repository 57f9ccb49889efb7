"""Token sampling: logit bias, suppression, penalties, logprobs, greedy / temperature /
min-p / top-k / top-p, per-request seeds.

Order of operations for each row (one request), as vLLM's sampler does it:
  0. a grammar (structured output, `engine/grammar.py`) sets every token it forbids to -inf.
  1. logit_bias is added (OpenAI: logit[t] += bias[t]); suppressed tokens -> -inf, and
     before `min_tokens` tokens were generated also the request's stop_token_ids and EOS
     (EOS only without ignore_eos); the repetition penalty over every token of the prompt
     *and* the output (vLLM/HF: a positive logit is divided by it, a negative one
     multiplied); then presence/frequency penalties over the *generated* tokens only
     (OpenAI: logit[t] -= presence * (count[t] > 0) + frequency * count[t]).
  2. logprobs are taken here: log_softmax of the adjusted logits, before temperature,
     min-p, top-k and top-p (vLLM's default "raw" logprobs). They describe the model's
     distribution, not the truncated one the token was drawn from, so a token drawn
     with temperature 0.7 reports the same logprob as under temperature 1.
  3. temperature == 0: argmax, ties to the lowest token id. Otherwise divide by the
     temperature, drop every token whose probability is below min_p x the best token's
     (compared as logits: scaled[t] < max + log(min_p)), keep the top_k best (0 = all),
     then the smallest best-first set whose probability reaches top_p (always at least one
     token), and draw. Equal logits rank in id order everywhere, so top_k=1 and a tiny
     top_p both reduce to greedy; min-p never drops the best token, so it cannot change a
     greedy row.

Reproducibility: a draw uses only the request's own generator, and the row's
probabilities are computed row-wise, so a request's tokens do not depend on what else is
in the batch. The generator is re-seeded before every draw from (seed, number of tokens
generated so far); step n therefore draws the same number whichever worker samples it,
which keeps seeded sampling identical between colocated and disaggregated serving (P
samples step 0, D resumes at step 1 after `append`ing P's token). Everything step 1 reads
(prompt, output so far, params) is the same on both workers, so P's token counts towards
`min_tokens` and the repetition penalty on D exactly as it would in one process.

The draw is an exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with
probability p_i, and it lets one vectorised argmax serve the whole batch; only filling E
loops over rows (each with its own generator).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from kvrelay.core import ids
from kvrelay.engine.grammar import GrammarMatcher, apply_masks
from kvrelay.engine.kernels import elementwise
from kvrelay.engine.types import RequestRejected, SamplingParams, TokenLogprob

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0          # |bias| allowed in logit_bias (OpenAI's range)
MAX_REPETITION_PENALTY = 2.0
TRUNCATION_WIDTH = 1024   # best logits searched for top-k/top-p before a full sort
_SEED_MASK = (1 << 63) - 1


def _mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): nearby steps get unrelated generator states."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _SEED_MASK


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """The first maximal index of each row (ties go to the lowest id), natively for CPU
    float32 rows, which never hold NaN here."""
    ew = elementwise()
    if ew is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        return ew.argmax(x)
    return x.argmax(dim=-1)


def validate_params(params: SamplingParams, vocab_size: int | None = None) -> None:
    """Raise RequestRejected (-> HTTP 400) for parameters no sampler can honour.
    `vocab_size`: the width of the model's logits; logit_bias ids must fall inside it."""
    checks = (
        (params.temperature >= 0.0, "temperature", "temperature must be >= 0"),
        (0.0 < params.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
        (params.top_k >= 0, "top_k", "top_k must be >= 0 (0 disables it)"),
        (0.0 <= params.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
        (-2.0 <= params.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        (-2.0 <= params.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
        (0.0 < params.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
         f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]"),
        (0 <= params.min_tokens <= params.max_tokens, "min_tokens",
         f"min_tokens must be in [0, max_tokens] = [0, {params.max_tokens}]; got {params.min_tokens}"),
        (params.n >= 1, "n", "n must be >= 1"),
        (params.logprobs is None or 0 <= params.logprobs <= MAX_LOGPROBS, "logprobs",
         f"logprobs must be in [0, {MAX_LOGPROBS}]"),
    )
    for ok, param, message in checks:
        if not ok:
            raise RequestRejected(message, param=param)
    _validate_logit_bias(params.logit_bias, vocab_size)


def _validate_logit_bias(bias: tuple[tuple[int, float], ...], vocab_size: int | None) -> None:
    limit = vocab_size if vocab_size is not None else math.inf
    seen: set[int] = set()
    for tok, value in bias:
        if not 0 <= tok < limit:
            raise RequestRejected(f"logit_bias: token id {tok} is outside the vocabulary [0, {vocab_size})",
                                  param="logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise RequestRejected(f"logit_bias: the bias of token {tok} must be in "
                                  f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; got {value}", param="logit_bias")
        if tok in seen:
            raise RequestRejected(f"logit_bias: token id {tok} is given twice", param="logit_bias")
        seen.add(tok)


class SamplingState:
    """Per-request sampling state. The caller `append`s every token the request emits
    (the sampler never does), so `counts` always covers exactly the generated tokens.
    `eos_ids`: the model's EOS tokens, held back (with stop_token_ids) until `min_tokens`
    tokens were generated unless the request ignores EOS."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int],
                 suppress_tokens: Iterable[int] = (), eos_ids: Iterable[int] = ()) -> None:
        validate_params(params)
        self.params = params
        self.prompt_ids = tuple(prompt_ids)
        self.seed = params.seed & _SEED_MASK if params.seed is not None else ids.randbits(63)
        self.output_ids: list[int] = []
        self.counts: Counter[int] = Counter()
        self.suppress_tokens: set[int] = set(suppress_tokens)   # logits forced to -inf
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.early_stops: frozenset[int] = frozenset(stops) if params.min_tokens > 0 else frozenset()
        # repetition penalty: every distinct prompt/output token, as a tensor grown by
        # `append` (the ids not yet in the tensor wait in `_seen_new`)
        self._seen: set[int] | None = set(self.prompt_ids) if params.repetition_penalty != 1.0 else None
        self._seen_new: list[int] = []
        self._seen_tensor: torch.Tensor | None = None
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self._generators: dict[torch.device, torch.Generator] = {}
        self.grammar: GrammarMatcher | None = None   # set by the engine for a constrained request

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.counts[token_id] += 1
        if self._seen is not None and token_id not in self._seen:
            self._seen.add(token_id)
            self._seen_new.append(token_id)
        if self.grammar is not None:   # every emitted token, P's first one on D included
            self.grammar.accept(token_id)

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return bool(self.counts) and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)

    def suppressed(self) -> set[int] | frozenset[int]:
        """The tokens that cannot be sampled at this step."""
        if self.early_stops and len(self.output_ids) < self.params.min_tokens:
            return self.suppress_tokens | self.early_stops
        return self.suppress_tokens

    def seen_ids(self, device: torch.device) -> torch.Tensor:
        """Every distinct token of the prompt and the output so far (repetition penalty)."""
        assert self._seen is not None, "no repetition penalty"
        t = self._seen_tensor
        if t is None or t.device != device:
            t = torch.tensor(sorted(self._seen), dtype=torch.long, device=device)
        elif self._seen_new:
            t = torch.cat([t, torch.tensor(self._seen_new, dtype=torch.long, device=device)])
        self._seen_new.clear()
        self._seen_tensor = t
        return t

    def bias(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, biases) of logit_bias, ids distinct (`validate_params`)."""
        if self._bias is None or self._bias[0].device != device:
            toks, values = zip(*self.params.logit_bias)
            self._bias = (torch.tensor(toks, dtype=torch.long, device=device),
                          torch.tensor(values, dtype=torch.float32, device=device))
        return self._bias

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator for the next draw, seeded from (seed, tokens generated so far)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        gen.manual_seed(_mix_seed(self.seed, len(self.output_ids)))
        return gen


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None = None   # set when the request asked for logprobs


def truncate(scaled: torch.Tensor, top_k: list[int], top_p: list[float],
             width: int = TRUNCATION_WIDTH) -> torch.Tensor:
    """`scaled` with -inf outside each row's top_k best (0 = all), then outside the smallest
    best-first set whose probability (within the top_k) reaches top_p. Equal logits rank
    in id order, so top_k=1 keeps the argmax token, and rank 0 always survives.

    A full sort of the vocabulary is slow on CPU, so rows first search their `width`
    best logits and fall back to the full sort only when that cannot prove the kept set
    (a larger top_k, a nucleus wider than `width`, a tie at the edge). Each row's
    arithmetic depends only on that row, never on the rest of the batch."""
    vocab = scaled.shape[-1]
    rows = [b for b, (k, p) in enumerate(zip(top_k, top_p)) if k or p < 1.0]
    if not rows:
        return scaled
    out = scaled.clone()
    full = [b for b in rows if width < top_k[b] < vocab or width >= vocab]
    narrow = sorted(set(rows) - set(full))
    if narrow:
        full += _truncate_rows(out, narrow, top_k, top_p, width)
    if full:
        _truncate_rows(out, sorted(full), top_k, top_p, vocab)
    return out


def _truncate_rows(out: torch.Tensor, rows: list[int], top_k: list[int], top_p: list[float],
                   width: int) -> list[int]:
    """Truncate `rows` of `out` in place from their `width` best logits; returns the rows
    whose kept set may reach past those (left untouched)."""
    dev, vocab = out.device, out.shape[-1]
    idx = torch.tensor(rows, device=dev)
    sub = out[idx]
    cand, ids = _best_first(sub, width)
    k = torch.tensor([top_k[b] if 0 < top_k[b] < vocab else vocab for b in rows], device=dev)
    # p >= 1 keeps everything: never let cumsum rounding past 1.0 cut the tail
    p = torch.tensor([top_p[b] if top_p[b] < 1.0 else math.inf for b in rows], device=dev)
    vals = cand.masked_fill(torch.arange(width, device=dev) >= k.unsqueeze(1), float("-inf"))
    has_k = k < vocab
    # probabilities over the top-k set, or over the whole row when there is no top_k
    norm = torch.where(has_k, vals.logsumexp(dim=-1), sub.logsumexp(dim=-1))
    probs = (vals - norm.unsqueeze(1)).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    vals = vals.masked_fill(mass_before > p.unsqueeze(1), float("-inf"))
    covered = torch.ones_like(has_k)
    if width < vocab:
        edge = cand[:, -1:]
        # a tie at -inf is harmless: every finite logit is then among the candidates
        tie_at_edge = ((sub == edge).sum(dim=-1) > (cand == edge).sum(dim=-1)) & (edge.squeeze(1) != float("-inf"))
        # the first token past the candidates has mass_before == their total mass
        covered = (has_k | (probs.sum(dim=-1) > p)) & ~tie_at_edge
    kept = torch.full_like(sub, float("-inf")).scatter(-1, ids, vals)
    out[idx[covered]] = kept[covered]
    return [rows[i] for i in (~covered).nonzero().flatten().tolist()]


def _owner(toks: list[torch.Tensor]) -> torch.Tensor:
    """For the entries of torch.cat(toks): the i of the toks[i] each came from (a gather
    index for per-row values; not repeat_interleave, which is slow on CPU)."""
    return torch.cat([torch.full((t.shape[0],), i, dtype=torch.long, device=t.device) for i, t in enumerate(toks)])


def _best_first(sub: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest values per row and their ids, equal values in id order."""
    if width >= sub.shape[-1]:
        return sub.sort(dim=-1, descending=True, stable=True)
    vals, ids = sub.topk(width, dim=-1)
    # topk leaves equal values unordered: order by id, then stably by value
    ids, perm = ids.sort(dim=-1)
    vals, perm2 = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(-1, perm2)


class Sampler:
    """Stateless: everything a request needs lives in its SamplingState."""

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> list[SampleResult]:
        """logits: [B, V] float, row b for states[b]. Does not modify `logits`."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} for {len(states)} states")
        logits = apply_masks(logits.float(), [st.grammar for st in states])   # step 0: grammar
        logits = self._adjust(logits, states)
        tokens = self._choose(logits, states)
        token_ids = tokens.tolist()
        logprobs = self._logprobs(logits, tokens, token_ids, states)
        return [SampleResult(t, lp) for t, lp in zip(token_ids, logprobs)]

    # -- step 1: bias, suppression and penalties ------------------------------------------

    def _adjust(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Each stage touches only the (row, token) entries it changes, never a [B, V] mask.
        Writes go through `index_put_` with (rows, tokens), which raises on a token past
        the vocabulary; reads use the flattened logits (`take`): on CPU, `logits[rows, toks]`
        is many times slower than either."""
        biased = [b for b, st in enumerate(states) if st.params.logit_bias]
        masked = [(b, toks) for b, st in enumerate(states) if (toks := st.suppressed())]
        repeated = [b for b, st in enumerate(states) if st.params.repetition_penalty != 1.0]
        penalised = [b for b, st in enumerate(states) if st.has_penalties]
        if not (biased or masked or repeated or penalised):
            return logits
        logits = logits.clone()   # never write into the caller's (model's) tensor
        vocab, dev = logits.shape[-1], logits.device
        if biased:
            pairs = [states[b].bias(dev) for b in biased]
            local = _owner([toks for toks, _ in pairs])
            idx = (torch.tensor(biased, device=dev)[local], torch.cat([toks for toks, _ in pairs]))
            logits.index_put_(idx, torch.cat([v for _, v in pairs]), accumulate=True)
        if masked:
            # a stop token id past the vocabulary can never be sampled: nothing to hold back
            pairs = [(b, t) for b, toks in masked for t in toks if t < vocab]
            idx = (torch.tensor([b for b, _ in pairs], dtype=torch.long, device=dev),
                   torch.tensor([t for _, t in pairs], dtype=torch.long, device=dev))
            logits.index_put_(idx, torch.tensor(float("-inf"), device=dev))
        if repeated:
            seen = [states[b].seen_ids(dev) for b in repeated]
            local = _owner(seen)
            rows, toks = torch.tensor(repeated, device=dev)[local], torch.cat(seen)
            penalty = torch.tensor([states[b].params.repetition_penalty for b in repeated], device=dev)[local]
            vals = logits.view(-1).take(rows * vocab + toks)
            logits.index_put_((rows, toks), torch.where(vals > 0, vals / penalty, vals * penalty))
        if penalised:
            # counts is a dict per row: (row, token) pairs are unique
            toks = [torch.tensor(list(states[b].counts), dtype=torch.long, device=dev) for b in penalised]
            counts = torch.cat([torch.tensor(list(states[b].counts.values()), dtype=logits.dtype, device=dev)
                                for b in penalised])
            params = [states[b].params for b in penalised]
            local = _owner(toks)
            presence = torch.tensor([p.presence_penalty for p in params], device=dev)[local]
            frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)[local]
            idx = (torch.tensor(penalised, device=dev)[local], torch.cat(toks))
            logits.index_put_(idx, -(presence + frequency * counts), accumulate=True)
        return logits

    # -- step 3: choosing the token -----------------------------------------------------

    def _choose(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        tokens = first_argmax(logits)
        random_rows = [b for b, st in enumerate(states) if not st.params.greedy]
        if random_rows:
            sub = [states[b] for b in random_rows]
            idx = torch.tensor(random_rows, device=logits.device)
            tokens[idx] = self._draw(logits[idx], sub)
        return tokens

    def _draw(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([st.params.temperature for st in states], device=dev)
        scaled = logits / temps.unsqueeze(1)
        min_p = [st.params.min_p for st in states]
        if any(min_p):
            # p[t] < min_p * p_max  <=>  scaled[t] < max + log(min_p); log(0) = -inf drops nothing
            floor = scaled.amax(dim=-1) + torch.tensor(min_p, device=dev).log()
            scaled = scaled.masked_fill(scaled < floor.unsqueeze(1), float("-inf"))
        top_k = [st.params.top_k for st in states]
        top_p = [st.params.top_p for st in states]
        probs = truncate(scaled, top_k, top_p).softmax(dim=-1)
        race = torch.empty_like(probs)
        for b, st in enumerate(states):
            race[b].exponential_(generator=st.generator(dev))
        # Exp(1) can return 0; clamping keeps 0 / 0 (a cut token) from becoming NaN
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        return first_argmax(probs / race)

    # -- step 2: logprobs (of the adjusted logits) -------------------------------------

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, token_ids: list[int],
                  states: list[SamplingState]) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(states)
        rows = [b for b, st in enumerate(states) if st.params.logprobs is not None]
        if not rows:
            return out
        idx = torch.tensor(rows, device=logits.device)
        lp = logits[idx].log_softmax(dim=-1)
        chosen = lp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
        k = max(states[b].params.logprobs for b in rows)
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, b in enumerate(rows):
            n = states[b].params.logprobs
            # best first, equal logprobs in id order (topk leaves ties unordered)
            pairs = sorted(zip(top_i[j], top_v[j]), key=lambda iv: (-iv[1], iv[0]))[:n]
            out[b] = TokenLogprob(token_ids[b], chosen[j], tuple(pairs))
        return out
