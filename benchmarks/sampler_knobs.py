"""Sampler cost with every sampling knob on against the same batch with them off.

    .venv/bin/python benchmarks/sampler_knobs.py [--batch 32] [--vocab 49152] [--steps 60] [--threads N]

One `Sampler.sample` call per decode step over a [batch, vocab] float32 logits tensor (the
default model's vocabulary is 49152). "off": temperature 0.8 / top_p 0.95 sampling, or
greedy, with no penalty. "on": the same plus logit_bias (64 tokens), min_p 0.05,
min_tokens still holding back EOS and 2 stop token ids, repetition_penalty 1.1 over a
512-token prompt and the output so far (128 tokens to begin with), presence and frequency
penalties 0.5. Each step appends the sampled token, as the engine does. The cases run in
interleaved rounds (the machine may be shared) and each figure is a median. On a busy
machine, `--threads 1` shows the work itself: torch's threads otherwise wait for each other.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvrelay.engine.sampling import Sampler, SamplingState  # noqa: E402
from kvrelay.engine.types import SamplingParams  # noqa: E402

EOS = 2
PROMPT_LEN, OUTPUT_LEN = 512, 128


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def make_states(batch: int, vocab: int, greedy: bool, knobs: bool) -> list[SamplingState]:
    gen = torch.Generator().manual_seed(0)
    states = []
    for b in range(batch):
        kw = dict(max_tokens=4096, temperature=0.0 if greedy else 0.8, top_p=1.0 if greedy else 0.95, seed=b)
        if knobs:
            bias_ids = torch.randperm(vocab, generator=gen)[:64].tolist()
            kw.update(logit_bias=tuple((t, 5.0 if i % 2 else -5.0) for i, t in enumerate(bias_ids)), min_p=0.05,
                      min_tokens=2048, stop_token_ids=(3, 4), repetition_penalty=1.1,
                      presence_penalty=0.5, frequency_penalty=0.5)
        prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()
        st = SamplingState(SamplingParams(**kw), prompt, eos_ids=(EOS,))
        for t in torch.randint(0, vocab, (OUTPUT_LEN,), generator=gen).tolist():
            st.append(t)
        states.append(st)
    return states


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sampler = Sampler()
    cases = {(g, k): make_states(args.batch, args.vocab, g, k) for g in (False, True) for k in (False, True)}
    times: dict[tuple[bool, bool], list[float]] = {c: [] for c in cases}
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps + 5):
        logits = torch.randn(args.batch, args.vocab, generator=gen) * 4
        for case, states in cases.items():
            t0 = time.perf_counter()
            results = sampler.sample(logits, states)
            dt = time.perf_counter() - t0
            for st, r in zip(states, results):
                st.append(r.token_id)
            if step >= 5:   # warm-up: kernels built, caches filled
                times[case].append(dt)
    print(f"cpu: {cpu_model()} ({os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()})")
    print(f"batch {args.batch} x vocab {args.vocab}, {args.steps} steps, median ms per Sampler.sample call")
    for greedy in (False, True):
        off = statistics.median(times[(greedy, False)]) * 1e3
        on = statistics.median(times[(greedy, True)]) * 1e3
        kind = "greedy" if greedy else "temperature 0.8, top_p 0.95"
        print(f"  {kind:28s} knobs off {off:7.2f} ms   all knobs on {on:7.2f} ms   (+{on - off:.2f} ms, x{on / off:.2f})")


if __name__ == "__main__":
    main()
