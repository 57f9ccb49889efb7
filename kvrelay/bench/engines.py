"""What a kvrelay server's engines did during one run, from their own counters: a decode
step's cost at its batch, the prefill rate, the time decodes yielded to prompts. Read from
`/metrics` (a colocated server's engine) and `/metrics/workers` (a router's workers),
before and after the run; another server (vLLM, llama.cpp) exports none, and gets none.

Why: a run's tokens/s says how fast, not why. A decode step that takes 55 ms in `serve`
where `benchmarks/` measures 30 ms for the same batch in one process says the host's other
processes take the difference (docs/operations.md).
"""
from __future__ import annotations

import contextlib

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table

COUNTERS = ("decode_steps", "decode_sequences", "decode_seconds", "prefill_passes", "prefill_tokens",
            "prefill_seconds", "yielded_seconds")
PATHS = ("/metrics", "/metrics/workers")


def parse(text: str) -> dict[str, dict[str, float]]:
    """role -> counter -> value summed over that role's engines, from one exposition."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removeprefix("kvrelay_engine_").removesuffix("_total")
            if s.name.startswith("kvrelay_engine_") and s.name.endswith("_total") and name in COUNTERS:
                role = out.setdefault(s.labels.get("role", "?"), dict.fromkeys(COUNTERS, 0.0))
                role[name] += s.value
    return out


async def counters(client: httpx.AsyncClient, url: str) -> dict[str, dict[str, float]]:
    """Every engine behind `url`, by role; {} for a server that is not kvrelay (or does not
    answer: the run's own figures say that)."""
    out: dict[str, dict[str, float]] = {}
    for path in PATHS:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await client.get(url.rstrip("/") + path, timeout=10)
            if r.status_code == 200:
                for role, values in parse(r.text).items():
                    mine = out.setdefault(role, dict.fromkeys(COUNTERS, 0.0))
                    for k, v in values.items():
                        mine[k] += v
    return out


def figures(before: dict, after: dict) -> dict[str, dict[str, float | None]]:
    """role -> what its engines did between the two reads. A role whose counters went back
    (a worker restarted in between) is left out: its figures would mean nothing."""
    out = {}
    for role, now in after.items():
        d = {k: now[k] - before.get(role, {}).get(k, 0.0) for k in COUNTERS}
        if any(v < 0 for v in d.values()):
            continue
        steps, seconds = d["decode_steps"], d["prefill_seconds"]
        out[role] = {"decode_steps": steps, "decode_sequences": d["decode_sequences"],
                     "prefill_passes": d["prefill_passes"],
                     "prefill_tokens": d["prefill_tokens"], "yielded_s": d["yielded_seconds"],
                     "sequences_per_step": d["decode_sequences"] / steps if steps else None,
                     "decode_step_s": d["decode_seconds"] / steps if steps else None,
                     "prefill_tokens_per_s": d["prefill_tokens"] / seconds if seconds else None}
    return out


def table(runs: list[dict]) -> Table | None:
    """One row per run and engine role; None when no run has kvrelay engines."""
    rows = [(r, role, f) for r in runs for role, f in sorted((r.get("engines") or {}).items())]
    if not rows:
        return None
    t = Table(title="engines (kvrelay's counters over each run)", title_justify="left")
    for col in ("server", "round", "role", "decode steps", "seqs/step", "ms/step", "prefill passes",
                "prompt tokens", "prefill tok/s", "yielded s"):
        t.add_column(col, justify="left" if col in ("server", "role") else "right")

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r, role, f in rows:
        step = f["decode_step_s"]
        t.add_row(r["server"], str(r["round"] + 1), role, f"{f['decode_steps']:.0f}",
                  num(f["sequences_per_step"], ".1f"), num(None if step is None else step * 1e3, ".1f"),
                  f"{f['prefill_passes']:.0f}",
                  f"{f['prefill_tokens']:.0f}", num(f["prefill_tokens_per_s"], ".0f"), f"{f['yielded_s']:.2f}")
    return t
