"""Seeded requests: what each sends and when it arrives.

A workload is a list of `Item`s. A single request has one turn; a multi-turn
conversation has several, sent one after another, each once the answer to the one before
has arrived (its prompt is the whole conversation so far). Prompts are drawn token ids
(`TOKEN_IDS`), sent as ids to /v1/completions, or as text (the ids decoded by a
tokenizer) for chat and `--text-prompts`. The same seed gives the same items, arrival
times included, whatever the server. Each round draws its prompts' ids afresh (same
lengths, outputs and arrivals): a server that caches prompt prefixes (vLLM, SGLang,
llama.cpp do by default) must not answer round 2 from round 1's cache, nor a round from
the warm-up's. Only a dataset's own prompts repeat.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.bench.config import BenchConfig

TOKEN_IDS = range(1000, 20000)   # drawn prompt ids: ordinary tokens of any 32k+ vocabulary


@dataclass
class Turn:
    prompt: list[int] | str       # token ids, or text (a dataset's, or a chat message)
    prompt_len: int               # tokens drawn (text: as the tokenizer counts them, roughly)
    output_len: int


@dataclass
class Item:
    index: int
    arrival: float                # seconds after the start
    turns: list[Turn] = field(default_factory=list)


def arrivals(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """n arrival times from 0: gaps drawn from a gamma distribution with mean 1/rate and
    shape `burstiness` (1: a Poisson process); rate inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_IDS.start, TOKEN_IDS.stop) for _ in range(n)]


def _draw(rng: random.Random, span: tuple[int, int]) -> int:
    return rng.randint(*span)


def load_dataset(path: str) -> list[Turn]:
    """A JSONL file's requests; ValueError naming the line that is wrong."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--dataset {path}: no such file")
    turns = []
    for no, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out = row["output_len"]
            prompt = row.get("prompt")
            if prompt is None:
                n = row["prompt_len"]
                ok = isinstance(n, int) and n >= 1
            else:
                ok = isinstance(prompt, str) and prompt != "" or (
                    isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt))
                n = len(prompt) if isinstance(prompt, list) else 0
            if not (ok and isinstance(out, int) and out >= 1):
                raise ValueError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"--dataset {path}:{no}: want {{\"prompt\": text or [ids], \"output_len\": N}} or "
                             "{\"prompt_len\": N, \"output_len\": N}") from None
        turns.append(Turn(prompt if prompt is not None else [], n, out))
    if not turns:
        raise ValueError(f"--dataset {path}: no requests in it")
    return turns


WARMUP_ROUND = -1   # the warm-up's prompts: ids no measured round sends


def build(cfg: BenchConfig, rate: float, round_: int = 0) -> list[Item]:
    """The workload's items for one rate and round. Lengths and outputs depend on the seed
    only, arrival times on the seed and the rate (a rate sweep sends the same requests
    faster), the prompts' token ids on the seed and `round_`."""
    rng = random.Random(cfg.seed)                            # lengths and outputs
    ids = random.Random(f"{cfg.seed}:prompts:{round_}")     # what the prompts say
    (p_span, o_span), n = cfg.lengths, cfg.requests
    if cfg.dataset:
        rows = load_dataset(cfg.dataset)
        turns = [rows[i % len(rows)] for i in range(n)]
        for t in turns:
            if t.prompt == []:
                t.prompt = _ids(ids, t.prompt_len)
        items = [Item(i, 0.0, [Turn(t.prompt, t.prompt_len, t.output_len)]) for i, t in enumerate(turns)]
    elif cfg.workload == "shared-prefix":
        prefix = _ids(ids, cfg.prefix_len)
        items = []
        for i in range(n):
            suffix = _ids(ids, _draw(rng, p_span))
            items.append(Item(i, 0.0, [Turn(prefix + suffix, cfg.prefix_len + len(suffix), _draw(rng, o_span))]))
    elif cfg.workload == "multi-turn":
        items = [Item(i, 0.0, [Turn(_ids(ids, k), k, _draw(rng, o_span))
                               for k in (_draw(rng, p_span) for _ in range(cfg.turns))]) for i in range(n)]
    else:
        items = []
        for i in range(n):
            k = _draw(rng, p_span)
            items.append(Item(i, 0.0, [Turn(_ids(ids, k), k, _draw(rng, o_span))]))
    times = arrivals(n, rate, cfg.burstiness, random.Random(f"{cfg.seed}:arrivals"))
    for item, t in zip(items, times):
        item.arrival = t
    return items


def as_text(items: list[Item], tokenizer) -> None:
    """Turn every id prompt into text with `tokenizer` (in place)."""
    for item in items:
        for turn in item.turns:
            if isinstance(turn.prompt, list):
                turn.prompt = tokenizer.decode(turn.prompt)


def load_tokenizer(name: str | None):
    """A Hugging Face tokenizer directory, or the default model's tokenizer."""
    if name is None:
        from kvrelay.engine.sources import default_tokenizer
        return default_tokenizer()
    from transformers import AutoTokenizer
    if not Path(name).is_dir():
        raise ValueError(f"--tokenizer {name}: not a directory (give a Hugging Face tokenizer directory)")
    return AutoTokenizer.from_pretrained(name, local_files_only=True)
