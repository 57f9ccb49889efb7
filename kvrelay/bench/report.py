"""What a bench run shows and keeps: a table per run, medians and ratios across servers,
result.json, and PNG plots (latency CDFs; goodput against arrival rate)."""
from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvrelay.bench import engines
from kvrelay.bench.metrics import median_of

ISA_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx512f", "avx_vnni", "avx2")


def machine() -> dict:
    """The CPU every figure depends on (what `lscpu` calls its model name) and its ISA flags."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags], "cores": _cores()}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def rate_label(r: float) -> str:
    return "inf" if math.isinf(r) else f"{r:g}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def runs_table(runs: list[dict]) -> Table:
    t = Table(title="runs", title_justify="left")
    for col in ("server", "rate/s", "round", "ok", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
                "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms", "E2E p50 ms", "goodput/s", "in SLO"):
        t.add_column(col, justify="left" if col == "server" else "right")
    for r in runs:
        s = r["summary"]
        t.add_row(r["server"], rate_label(r["rate"]), str(r["round"] + 1), f"{s['completed']}/{s['requests']}",
                  f"{s['request_throughput']:.3f}", f"{s['output_throughput']:.1f}",
                  _ms(s["ttft_s"]["p50"]), _ms(s["ttft_s"]["p99"]), _ms(s["tpot_s"]["p50"]),
                  _ms(s["tpot_s"]["p99"]), _ms(s["itl_s"]["p99"]), _ms(s["e2e_s"]["p50"]),
                  f"{s['goodput']:.3f}", f"{s['slo_attained']:.0%}")
    return t


FIGURES = (("output_throughput", None, "out tok/s", True), ("goodput", None, "goodput/s", True),
           ("ttft_s", "p50", "TTFT p50", False), ("tpot_s", "p50", "TPOT p50", False),
           ("e2e_s", "p50", "E2E p50", False))


def compare_rows(runs: list[dict], servers: list[str]) -> list[dict]:
    """Per rate and server: the median over rounds of each figure, and its ratio to the
    first server's (for latencies, first / this: above 1 means this server is faster)."""
    rows = []
    for rate in dict.fromkeys(r["rate"] for r in runs):
        base = None
        for name in servers:
            mine = [r["summary"] for r in runs if r["server"] == name and r["rate"] == rate]
            med = {label: median_of(mine, key, sub) for key, sub, label, _ in FIGURES}
            base = base or med
            ratio = {}
            for _, _, label, higher_better in FIGURES:
                a, b = med[label], base[label]
                if a is None or b is None or (a == 0 if not higher_better else b == 0):
                    ratio[label] = None
                else:
                    ratio[label] = a / b if higher_better else b / a
            rows.append({"server": name, "rate": rate, "rounds": len(mine), "median": med, "ratio": ratio})
    return rows


def compare_table(rows: list[dict]) -> Table:
    t = Table(title="medians over rounds; x: ratio to the first server (latency: first / this, "
                    "so above 1 is better)", title_justify="left")
    t.add_column("server", justify="left")
    t.add_column("rate/s", justify="right")
    for _, _, label, _ in FIGURES:
        t.add_column(label, justify="right")
    for row in rows:
        cells = []
        for _, _, label, _ in FIGURES:
            v, x = row["median"][label], row["ratio"][label]
            shown = "-" if v is None else (f"{v * 1e3:.0f} ms" if label.endswith(("p50",)) else f"{v:.3f}")
            cells.append(shown if x is None else f"{shown} ({x:.2f}x)")
        t.add_row(row["server"], rate_label(row["rate"]), *cells)
    return t


def show(console: Console, runs: list[dict], servers: list[str]) -> list[dict]:
    console.print(runs_table(runs))
    used = engines.table(runs)
    if used is not None:
        console.print(used)
    for r in runs:
        s = r["summary"]
        if s["failed"]:
            console.print(f"[yellow]{r['server']} (rate {rate_label(r['rate'])}, round {r['round'] + 1}): "
                          f"{s['failed']} of {s['requests']} requests failed; first: {s['first_error']}")
        if s["short_outputs"]:
            console.print(f"[yellow]{r['server']}: {s['short_outputs']} requests returned fewer tokens than "
                          "asked (the server ignored ignore_eos or logit_bias)")
    rows = compare_rows(runs, servers)
    if len(servers) > 1 or len({r["rate"] for r in runs}) > 1 or any(r["round"] for r in runs):
        console.print(compare_table(rows))
    return rows


def write_result(out_dir: Path, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "result.json"
    path.write_text(json.dumps(_finite(result), separators=(",", ":"), allow_nan=False))
    return path


def _finite(v):
    """Strict JSON: an infinite rate is written "inf" (other tools reject Infinity)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def plot(out_dir: Path, runs: list[dict], rows: list[dict], servers: list[str], title: str) -> list[Path]:
    """latency_cdf.png (TTFT, TPOT, E2E: one curve per server and rate, rounds pooled) and
    goodput_vs_rate.png (median goodput per server against arrival rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in servers:
        for rate in dict.fromkeys(r["rate"] for r in runs):
            reqs = [q for r in runs if r["server"] == name and r["rate"] == rate for q in r["requests"] if q["ok"]]
            label = name if len({r["rate"] for r in runs}) == 1 else f"{name} @ {rate_label(rate)}/s"
            for ax, key in zip(axes, ("ttft", "tpot", "e2e")):
                vals = sorted(q[key] for q in reqs if q[key] is not None)
                if vals:
                    ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post", label=label)
    for ax, key in zip(axes, ("TTFT (s)", "TPOT (s)", "end to end (s)")):
        ax.set_xlabel(key)
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    cdf = out_dir / "latency_cdf.png"
    fig.savefig(cdf, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    finite = [row for row in rows if not math.isinf(row["rate"])]
    for name in servers:
        pts = sorted((row["rate"], row["median"]["goodput/s"]) for row in finite if row["server"] == name)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    lim = max((row["rate"] for row in finite), default=1.0)
    ax.plot([0, lim], [0, lim], linestyle=":", color="grey", label="every request in SLO")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("goodput (requests/s within SLO)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    good = out_dir / "goodput_vs_rate.png"
    fig.savefig(good, dpi=110)
    plt.close(fig)
    return [cdf, good]
