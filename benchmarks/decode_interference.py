"""One decode step of the default model, in process, alone and beside an interferer that
takes short bursts of a core the way a server's other threads do (the router, the client,
the event loops: each streamed token costs them a few hundred microseconds, landing
mid-step). On two cores such a burst preempts one thread of the engine's OpenMP team; a
kernel with a static schedule then waits at its end for that thread's share, a kernel that
steals work (`kernels/worksteal.h`) does not. The two conditions alternate step by step,
so the machine's drift falls on both alike.

    .venv/bin/python benchmarks/decode_interference.py                  # 32 x 320 keys
    .venv/bin/python benchmarks/decode_interference.py --burst-us 400 --bursts 32 --steps 60

It prints the median and quartiles of the step, in milliseconds, alone and with the
interferer, and the interferer's share of a core. `--part matmuls` times only the step's
matmuls: every Linear of the model, then the output head, at the step's row count.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvrelay.bench.report import machine  # noqa: E402
from kvrelay.core.config import ModelOptions  # noqa: E402
from kvrelay.core.kvlayout import KVLayout  # noqa: E402
from kvrelay.engine.attention import make_attention_backend  # noqa: E402
from kvrelay.engine.kv_pool import TORCH_DTYPES, KVPool  # noqa: E402
from kvrelay.engine.loader import load_model  # noqa: E402
from kvrelay.engine.models.linear import Linear  # noqa: E402
from kvrelay.engine.runner import SeqChunk, build_forward_batch  # noqa: E402

PAGE = 16


def interfere(on, stop, bursts: int, burst_us: float, period_ms: float) -> None:
    """While `on` is set: `bursts` spins of `burst_us` spread evenly over each period."""
    gap = period_ms / 1000 / bursts
    while not stop.is_set():
        if not on.wait(0.05):
            continue
        t = time.perf_counter()
        while time.perf_counter() - t < burst_us / 1e6:
            pass
        time.sleep(max(0.0, gap - burst_us / 1e6))


def whole_step(loaded, seqs: int, keys: int):
    """A decode step of `seqs` sequences at `keys` keys each, over a pool of random K/V
    (any keys: the step's cost is the same)."""
    a = loaded.arch
    per_seq = -(-(keys + 1) // PAGE)
    kv = KVPool(KVLayout("bench", loaded.dtype, PAGE, a.num_layers, a.num_kv_heads, a.head_dim), seqs * per_seq + 1)
    torch.manual_seed(0)
    kv.data.copy_((torch.randn(kv.data.shape) * 0.5).to(kv.data.dtype))
    attn = make_attention_backend("cpu_native", kv, a.num_heads)
    batch = build_forward_batch(
        [SeqChunk([100 + s], keys, list(range(1 + s * per_seq, 1 + (s + 1) * per_seq))) for s in range(seqs)], PAGE)
    return lambda: loaded.model(batch, attn)


def matmuls(loaded, seqs: int):
    """The step's matmuls alone: every Linear of the model, then the output head, at `seqs` rows."""
    model = loaded.model
    linears = [mod for mod in model.modules() if isinstance(mod, Linear) and mod is not model.lm_head]
    dtype = TORCH_DTYPES[loaded.dtype]
    xs = {n: torch.randn(seqs, n).to(dtype) for n in {mod.in_features for mod in linears}}
    h = torch.randn(seqs, loaded.arch.hidden_size).to(dtype)

    def run():
        for mod in linears:
            mod(xs[mod.in_features])
        model.head_logits(h)
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--keys", type=int, default=320, help="keys per sequence")
    p.add_argument("--steps", type=int, default=40, help="steps per condition")
    p.add_argument("--bursts", type=int, default=32, help="interferer bursts per period (one per streamed token)")
    p.add_argument("--burst-us", type=float, default=250.0, help="microseconds of CPU per burst")
    p.add_argument("--period-ms", type=float, default=50.0)
    p.add_argument("--part", choices=("step", "matmuls"), default="step")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ModelOptions())
    step = matmuls(loaded, args.seqs) if args.part == "matmuls" else whole_step(loaded, args.seqs, args.keys)
    m = machine()
    print(f"cpu: {m['cpu']} ({m['cores']} cores; {' '.join(m['isa'])}), {loaded.dtype}, {args.threads} threads; "
          f"{args.part}, {args.seqs} x {args.keys} keys; interferer {args.bursts} x {args.burst_us:g} us every {args.period_ms:g} ms "
          f"({args.bursts * args.burst_us / 1e3 / args.period_ms:.0%} of a core)")
    ctx = mp.get_context("spawn")
    on, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=interfere, args=(on, stop, args.bursts, args.burst_us, args.period_ms), daemon=True)
    proc.start()
    times: dict[str, list[float]] = {"alone": [], "interfered": []}
    try:
        with torch.inference_mode():
            for _ in range(5):
                step()
            for _ in range(args.steps):
                for name in times:
                    if name == "interfered":
                        on.set()
                        time.sleep(0.01)
                    t = time.perf_counter()
                    step()
                    times[name].append((time.perf_counter() - t) * 1e3)
                    on.clear()
    finally:
        stop.set()
        on.set()
        proc.join(5)
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        print(f"{name:>11}: median {statistics.median(ts):6.1f} ms  (quartiles {q[0]:.1f}-{q[2]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
