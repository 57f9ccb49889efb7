"""One prompt's prefill, in process, with its attention on each path this CPU offers: the
native kernel (`kernels/prefill_attention_*.h`) and, on a CPU with AMX, torch's flash
kernel on the tiles (`engine/attention/cpu_native.py`, `prefill_on_tiles`). The paths alternate within
each round, so the machine's drift falls on both alike; every figure is one pass.

    .venv/bin/python benchmarks/prefill_passes.py                       # 512, 2048, 4096 tokens
    .venv/bin/python benchmarks/prefill_passes.py --lengths 8000 --chunk 2048 --rounds 1

It prints, per prompt length and path, the seconds of the whole prefill (every chunk of
--chunk tokens, each over the KV of the chunks before it) and the part spent in attention.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvrelay.bench.report import machine  # noqa: E402
from kvrelay.core.config import ModelOptions  # noqa: E402
from kvrelay.core.kvlayout import KVLayout  # noqa: E402
from kvrelay.engine.kernels import amx_bf16  # noqa: E402
from kvrelay.engine.kv_pool import KVPool  # noqa: E402
from kvrelay.engine.loader import load_model  # noqa: E402
from kvrelay.engine.attention import cpu_native as layers  # noqa: E402
from kvrelay.engine.attention import make_attention_backend  # noqa: E402
from kvrelay.engine.runner import SeqChunk, build_forward_batch  # noqa: E402

PAGE = 16


class AttentionClock:
    """Seconds spent inside CpuNativeBackend.attend while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._real = layers.CpuNativeBackend.attend

    def __enter__(self) -> "AttentionClock":
        real, clock = self._real, self

        def timed(module, *args, **kwargs):
            t = time.perf_counter()
            try:
                return real(module, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t

        layers.CpuNativeBackend.attend = timed
        return self

    def __exit__(self, *exc) -> None:
        layers.CpuNativeBackend.attend = self._real


def prefill_once(loaded, n: int, chunk: int) -> tuple[float, float]:
    """(whole seconds, attention seconds) of one n-token prompt, chunk tokens a pass."""
    a = loaded.arch
    pages = list(range(1, 1 + -(-n // PAGE)))
    kv = KVPool(KVLayout("bench", loaded.dtype, PAGE, a.num_layers, a.num_kv_heads, a.head_dim), len(pages) + 1)
    attn = make_attention_backend("cpu_native", kv, a.num_heads)
    ids = [100 + (i * 7919) % (a.vocab_size - 200) for i in range(n)]   # fixed, not repetitive
    with AttentionClock() as clock, torch.inference_mode():
        t = time.perf_counter()
        for start in range(0, n, chunk):
            loaded.model(build_forward_batch([SeqChunk(ids[start:start + chunk], start, pages)], PAGE), attn)
        return time.perf_counter() - t, clock.seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,2048,4096", help="prompt lengths, comma-separated")
    p.add_argument("--chunk", type=int, default=4096, help="prompt tokens per forward pass")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ModelOptions())
    m = machine()
    print(f"cpu: {m['cpu']} ({m['cores']} cores; {' '.join(m['isa'])}), {loaded.dtype}, {args.threads} threads")
    paths = {"native": lambda: False}
    if amx_bf16() and loaded.dtype == "bfloat16":
        paths["tiles"] = lambda: True
    real = layers.amx_bf16
    lengths = [int(x) for x in args.lengths.split(",")]
    prefill_once(loaded, 64, 64)   # warm: the kernels' first call, torch's first pass
    print(f"{'tokens':>7} {'chunk':>6} {'path':>7} {'prefill s':>10} {'attention s':>12} {'tokens/s':>9}")
    try:
        for n in lengths:
            for _ in range(args.rounds):
                for name, routing in paths.items():
                    layers.amx_bf16 = routing
                    whole, attn = prefill_once(loaded, n, min(args.chunk, n))
                    print(f"{n:>7} {min(args.chunk, n):>6} {name:>7} {whole:>10.2f} {attn:>12.2f} {n / whole:>9.0f}",
                          flush=True)
    finally:
        layers.amx_bf16 = real
    return 0


if __name__ == "__main__":
    sys.exit(main())
