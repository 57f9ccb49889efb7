"""`BenchConfig`: every `kvrelay bench` flag, with its default, in one frozen dataclass
(the CLI builds the flags from it, as it does for `serve`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvrelay.core.config import _f, _require

WORKLOADS = ("a", "b", "c", "mixed", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class Shape:
    """A workload's defaults: requests (multi-turn: conversations), arrival rates, prompt
    and output lengths (N or LO-HI)."""
    requests: int
    rates: tuple[float, ...]
    prompt_len: str
    output_len: str


INF = math.inf
DEFAULT_URL = "http://127.0.0.1:8000"
SHAPES = {
    "a": Shape(1, (INF,), "128", "128"),
    "b": Shape(32, (INF,), "256", "128"),
    "c": Shape(8, (INF,), "1024", "256"),
    "mixed": Shape(24, (0.125,), "64-2048", "16-256"),
    "shared-prefix": Shape(32, (1.0,), "32-128", "64"),   # prompt_len: the part after the shared prefix
    "multi-turn": Shape(8, (0.5,), "32-256", "16-128"),   # prompt_len: each user message
}


def parse_length(text: str, flag: str) -> tuple[int, int]:
    """'N' or 'LO-HI' (inclusive, LO >= 1) -> (lo, hi); ValueError naming `flag`."""
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give a token count (256) or a range (64-2048)") from None
    _require(1 <= a <= b, f"{flag} {text!r}: need 1 <= LO <= HI")
    return a, b


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"--rate {text!r}: give requests per second (0.5) or inf") from None
    _require(rate > 0, f"--rate {text!r}: must be positive (inf: every request at once)")
    return rate


@dataclass(frozen=True)
class BenchConfig:
    url: str | None = _f(None, "base URL of the OpenAI-compatible server to benchmark "
                         "(default: http://127.0.0.1:8000)")
    compare: tuple[str, ...] = _f((), "benchmark these servers instead of --url, each URL or NAME=URL, with the "
                                  "same seeded workload in alternating rounds; ratios are against the first",
                                  nargs="+")
    spawn: str | None = _f(None, "start `kvrelay serve` with these flags (one quoted string, '' for the "
                           "defaults) on a free port, benchmark it, stop it")
    workload: str = _f("b", "a: 1 x 128->128; b: 32 x 256->128; c: 8 x 1024->256 (all at once); mixed: "
                       "24 requests, prompts 64-2048, outputs 16-256, Poisson at 0.125/s; shared-prefix: one "
                       "--prefix-len system prompt before each prompt; multi-turn: chat conversations of --turns",
                       choices=WORKLOADS)
    num_requests: int | None = _f(None, "requests (multi-turn: conversations) (default: the workload's)")
    rate: tuple[str, ...] = _f((), "arrivals per second; several values sweep them; inf: all at once "
                               "(default: the workload's)", nargs="+")
    burstiness: float = _f(1.0, "shape of the gamma-distributed gaps between arrivals: 1 is Poisson, "
                           "below 1 burstier, above 1 more regular")
    prompt_len: str | None = _f(None, "prompt tokens, N or LO-HI drawn uniformly (default: the workload's)")
    output_len: str | None = _f(None, "output tokens, N or LO-HI drawn uniformly (default: the workload's)")
    prefix_len: int = _f(1024, "shared-prefix: tokens of the system prompt every request shares")
    turns: int = _f(4, "multi-turn: user turns per conversation")
    dataset: str | None = _f(None, "JSONL file of requests instead of drawn lengths, one object a line: "
                             '{"prompt": "text" or [token ids], "output_len": N} or {"prompt_len": N, '
                             '"output_len": N}; arrivals still follow --rate')
    max_concurrency: int | None = _f(None, "at most this many requests in flight (default: no limit)")
    slo_ttft: float = _f(2.0, "goodput counts requests whose time to first token is at most this (seconds)")
    slo_tpot: float = _f(0.1, "... and whose time per output token after the first is at most this (seconds)")
    rounds: int | None = _f(None, "rounds; with --compare each round runs every server once, in turn "
                            "(default: 3 with --compare, else 1)")
    seed: int = _f(0, "seed of the workload: the same seed sends the same requests at the same times")
    model: str | None = _f(None, "model name to request (default: the server's first in /v1/models)")
    tokenizer: str | None = _f(None, "tokenizer (a Hugging Face directory) that turns drawn tokens into text for "
                               "chat and --text-prompts (default: the default model's)")
    text_prompts: bool = _f(False, "send prompts as text and keep outputs long with logit_bias against the "
                            "end-of-sequence ids instead of ignore_eos (servers without token prompts)")
    result_dir: str | None = _f(None, "write result.json and PNG plots (latency CDFs, goodput against rate) here")
    request_timeout: float = _f(600.0, "seconds one request may take before it counts as failed")
    warmup: int = _f(1, "requests sent to each server before measuring: the first turns of the workload's first "
                     "N requests, all at once, at most 16 output tokens each (0: none); a server that compiles "
                     "per shape (vLLM) wants several")
    settle: float = _f(5.0, "before each measured run, wait until the host's CPUs are quiet (under a quarter "
                       "of a core busy), at most this many seconds: a server that keeps a core busy after "
                       "its last answer (vLLM-CPU spins ~1 s) must not slow the next one (0: never wait)")
    progress: bool = _f(True, "show a progress bar")

    def __post_init__(self) -> None:
        _require(self.num_requests is None or self.num_requests >= 1, "--num-requests must be at least 1")
        _require(self.burstiness > 0, "--burstiness must be positive")
        _require(self.prefix_len >= 1, "--prefix-len must be at least 1")
        _require(self.turns >= 1, "--turns must be at least 1")
        _require(self.max_concurrency is None or self.max_concurrency >= 1, "--max-concurrency must be at least 1")
        _require(self.slo_ttft > 0 and self.slo_tpot > 0, "--slo-ttft and --slo-tpot must be positive")
        _require(self.rounds is None or self.rounds >= 1, "--rounds must be at least 1")
        _require(self.request_timeout > 0, "--request-timeout must be positive")
        _require(self.warmup >= 0, "--warmup must be 0 or more")
        _require(self.settle >= 0, "--settle must be 0 or more")
        _require(not (self.compare and self.spawn is not None), "--compare and --spawn cannot be combined")
        _require(not (self.url and (self.compare or self.spawn is not None)),
                 "--url names the one server to benchmark: leave it out with --compare or --spawn")
        _require(not self.compare or len(self.compare) >= 2, "--compare needs at least two servers")
        _require(not (self.dataset and self.workload == "multi-turn"), "--dataset cannot drive --workload multi-turn")
        self.rates, self.lengths   # noqa: B018 - validated now, not halfway through a run

    @property
    def shape(self) -> Shape:
        return SHAPES[self.workload]

    @property
    def requests(self) -> int:
        return self.num_requests or self.shape.requests

    @property
    def rates(self) -> tuple[float, ...]:
        return tuple(parse_rate(r) for r in self.rate) or self.shape.rates

    @property
    def lengths(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (parse_length(self.prompt_len or self.shape.prompt_len, "--prompt-len"),
                parse_length(self.output_len or self.shape.output_len, "--output-len"))

    @property
    def num_rounds(self) -> int:
        return self.rounds or (3 if self.compare else 1)

    @property
    def chat(self) -> bool:
        """Requests go to /v1/chat/completions (multi-turn needs a conversation)."""
        return self.workload == "multi-turn"

    def servers(self) -> list[tuple[str, str]]:
        """(name, base URL) of each server to benchmark."""
        if not self.compare:
            return [("server", (self.url or DEFAULT_URL).rstrip("/"))]
        out = []
        for item in self.compare:
            name, eq, url = item.partition("=")
            if not eq:
                name, url = item, item
            _require(url.startswith(("http://", "https://")), f"--compare {item!r}: give URL or NAME=URL "
                                                                   "(http:// or https://)")
            out.append((name, url.rstrip("/")))
        _require(len({n for n, _ in out}) == len(out), "--compare: two servers have the same name")
        return out
