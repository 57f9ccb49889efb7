"""What one run measured: throughput, latency percentiles and goodput.

Goodput is the requests per second that met both SLOs: time to first token at most
`slo_ttft` and time per output token (after the first) at most `slo_tpot`. A failed
request meets neither; a request with one output token has no TPOT and is judged on
TTFT alone.
"""
from __future__ import annotations

import numpy as np

from kvrelay.bench.client import Outcome

PERCENTILES = (50, 90, 99)


def distribution(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles (linear interpolation, as numpy's default); None when empty."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def meets(o: Outcome, slo_ttft: float, slo_tpot: float) -> tuple[bool, bool]:
    """(within the TTFT target, within the TPOT target) for one request."""
    if not o.ok:
        return False, False
    tpot = o.tpot
    return o.ttft <= slo_ttft, tpot is None or tpot <= slo_tpot


def summarise(outcomes: list[Outcome], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    judged = [meets(o, slo_ttft, slo_tpot) for o in outcomes]
    good = sum(1 for a, b in judged if a and b)
    n = len(outcomes)
    out_tokens = sum(o.output_tokens for o in ok)
    in_tokens = sum(o.prompt_tokens for o in ok)
    failed = [o for o in outcomes if not o.ok]
    return {
        "requests": n,
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "short_outputs": sum(1 for o in ok if o.output_tokens < o.expected_tokens),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft_s": distribution([o.ttft for o in ok]),
        "tpot_s": distribution([o.tpot for o in ok if o.tpot is not None]),
        "itl_s": distribution([g for o in ok for g in o.itl]),
        "e2e_s": distribution([o.e2e for o in ok]),
        "slo_ttft_s": slo_ttft,
        "slo_tpot_s": slo_tpot,
        "goodput": good / duration if duration > 0 else 0.0,
        "slo_attained": good / n if n else 0.0,
        "ttft_attained": sum(1 for a, _ in judged if a) / n if n else 0.0,
        "tpot_attained": sum(1 for _, b in judged if b) / n if n else 0.0,
    }


def median_of(runs: list[dict], key: str, sub: str | None = None) -> float | None:
    """The median over rounds of one figure (`sub`: a distribution's statistic)."""
    vals = [r[key][sub] if sub else r[key] for r in runs]
    vals = [v for v in vals if v is not None]
    return float(np.median(vals)) if vals else None
