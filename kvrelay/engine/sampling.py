"""Token sampling: penalties, logprobs, greedy / temperature / top-k / top-p, per-request seeds.

Order of operations for each row (one request):
  1. suppressed tokens -> -inf; presence/frequency penalties over the *generated* tokens
     (OpenAI: logit[t] -= presence * (count[t] > 0) + frequency * count[t]).
  2. logprobs are taken here: log_softmax of the penalised logits, before temperature,
     top-k and top-p (vLLM's default "raw" logprobs). They describe the model's
     distribution, not the truncated one the token was drawn from, so a token drawn
     with temperature 0.7 reports the same logprob as under temperature 1.
  3. temperature == 0: argmax, ties to the lowest token id. Otherwise divide by the
     temperature, keep the top_k best (0 = all), then the smallest best-first set whose
     probability reaches top_p (always at least one token), and draw. Equal logits rank
     in id order everywhere, so top_k=1 and a tiny top_p both reduce to greedy.

Reproducibility: a draw uses only the request's own generator, and the row's
probabilities are computed row-wise, so a request's tokens do not depend on what else is
in the batch. The generator is re-seeded before every draw from (seed, number of tokens
generated so far); step n therefore draws the same number whichever worker samples it,
which keeps seeded sampling identical between colocated and disaggregated serving (P
samples step 0, D resumes at step 1 after `append`ing P's token).

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
from kvrelay.engine.kernels import elementwise
from kvrelay.engine.types import RequestRejected, SamplingParams, TokenLogprob

MAX_LOGPROBS = 20
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


def validate_params(params: SamplingParams) -> None:
    """Raise RequestRejected (-> HTTP 400) for parameters no sampler can honour."""
    checks = (
        (params.temperature >= 0.0, "temperature", "temperature must be >= 0"),
        (0.0 < params.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
        (params.top_k >= 0, "top_k", "top_k must be >= 0 (0 disables it)"),
        (-2.0 <= params.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        (-2.0 <= params.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
        (params.logprobs is None or 0 <= params.logprobs <= MAX_LOGPROBS, "logprobs",
         f"logprobs must be in [0, {MAX_LOGPROBS}]"),
    )
    for ok, param, message in checks:
        if not ok:
            raise RequestRejected(message, param=param)


class SamplingState:
    """Per-request sampling state. The caller `append`s every token the request emits
    (the sampler never does), so `counts` always covers exactly the generated tokens."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int],
                 suppress_tokens: Iterable[int] = ()) -> None:
        validate_params(params)
        self.params = params
        self.prompt_ids = tuple(prompt_ids)
        self.seed = params.seed & _SEED_MASK if params.seed is not None else ids.randbits(63)
        self.output_ids: list[int] = []
        self.counts: Counter[int] = Counter()
        self.suppress_tokens: set[int] = set(suppress_tokens)   # logits forced to -inf
        self._generators: dict[torch.device, torch.Generator] = {}

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.counts[token_id] += 1

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return bool(self.counts) and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)

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
        tie_at_edge = (sub == edge).sum(dim=-1) > (cand == edge).sum(dim=-1)
        # the first token past the candidates has mass_before == their total mass
        covered = (has_k | (probs.sum(dim=-1) > p)) & ~tie_at_edge
    kept = torch.full_like(sub, float("-inf")).scatter(-1, ids, vals)
    out[idx[covered]] = kept[covered]
    return [rows[i] for i in (~covered).nonzero().flatten().tolist()]


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
        logits = self._adjust(logits.float(), states)
        tokens = self._choose(logits, states)
        token_ids = tokens.tolist()
        logprobs = self._logprobs(logits, tokens, token_ids, states)
        return [SampleResult(t, lp) for t, lp in zip(token_ids, logprobs)]

    # -- step 1: suppression and penalties --------------------------------------------

    def _adjust(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        rows: list[int] = []
        toks: list[int] = []
        amount: list[float] = []
        masked_rows: list[int] = []
        masked_toks: list[int] = []
        for b, st in enumerate(states):
            if st.has_penalties:
                p = st.params
                for tok, n in st.counts.items():
                    rows.append(b)
                    toks.append(tok)
                    amount.append(p.presence_penalty + p.frequency_penalty * n)
            for tok in st.suppress_tokens:
                masked_rows.append(b)
                masked_toks.append(tok)
        if not rows and not masked_rows:
            return logits
        logits = logits.clone()   # never write into the caller's (model's) tensor
        dev = logits.device
        if rows:
            # (row, token) pairs are unique: counts is a dict per row
            idx = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev))
            logits.index_put_(idx, -torch.tensor(amount, device=dev), accumulate=True)
        if masked_rows:
            idx = (torch.tensor(masked_rows, device=dev), torch.tensor(masked_toks, device=dev))
            logits.index_put_(idx, torch.tensor(float("-inf"), device=dev))
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
        top_k = [st.params.top_k for st in states]
        top_p = [st.params.top_p for st in states]
        probs = truncate(scaled, top_k, top_p).softmax(dim=-1)
        race = torch.empty_like(probs)
        for b, st in enumerate(states):
            race[b].exponential_(generator=st.generator(dev))
        # Exp(1) can return 0; clamping keeps 0 / 0 (a cut token) from becoming NaN
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        return first_argmax(probs / race)

    # -- step 2: logprobs (of the penalised logits) -------------------------------------

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
