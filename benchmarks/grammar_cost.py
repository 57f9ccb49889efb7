"""What structured output costs: workload (b) of `kvrelay bench` (32 concurrent
requests, 256 prompt tokens, 128 output tokens each, greedy, ignore_eos) against a
colocated server, unconstrained and with every request constrained by a JSON schema, in
alternating rounds. The schema (an array of at least 64 records) is never complete
within 128 tokens, so both kinds of round produce exactly the same number of tokens.

  python benchmarks/grammar_cost.py --spawn                  # start `kvrelay serve --mode colocated`
  python benchmarks/grammar_cost.py --url http://127.0.0.1:8000 --rounds 3
  python benchmarks/grammar_cost.py --spawn --passive-omp     # on cores other jobs share

With --spawn it also reports the server's CPU time per output token, which is the steadier
figure when the cores are shared (OpenMP's spinning counts as CPU time unless passive).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import time

import httpx

from rich.console import Console

from kvrelay.bench.config import SHAPES
from kvrelay.bench.run import spawn_server

SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 64, "maxItems": 64, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                       "name": {"type": "string", "maxLength": 24},
                       "level": {"enum": ["low", "mid", "high"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                       "ok": {"type": "boolean"}},
        "required": ["id", "name", "level", "tags", "ok"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}
CONSTRAINED = {"response_format": {"type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA}}}


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], out_len: int, extra: dict) -> int:
    body = {"prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True, **extra}
    r = await client.post(f"{url}/v1/completions", json=body)
    if r.status_code != 200:
        raise SystemExit(f"HTTP {r.status_code}: {r.text[:300]}")
    tokens = r.json()["usage"]["completion_tokens"]
    if tokens != out_len:
        raise SystemExit(f"a request produced {tokens} tokens, not {out_len}: the rounds would not compare")
    return tokens


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of process `pid` (all its threads) from /proc; 0 without one."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def round_(url: str, extra: dict, seed: int, pid: int | None = None) -> tuple[float, float]:
    """(output tokens/s, server CPU ms per output token) of one run of workload (b); the
    CPU figure (0 without `pid`) holds up better than wall time when others share the cores."""
    b = SHAPES["b"]
    concurrency, prompt_len, out_len = b.requests, int(b.prompt_len), int(b.output_len)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 20000) for _ in range(prompt_len)] for _ in range(concurrency)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        await one(client, url, prompts[0][:16], 4, extra)   # warm-up (and the grammar's compilation)
        cpu, start = cpu_seconds(pid), time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(client, url, p, out_len, extra) for p in prompts)))
        return tokens / (time.perf_counter() - start), 1e3 * (cpu_seconds(pid) - cpu) / tokens


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--spawn", action="store_true", help="start `kvrelay serve --mode colocated` on --port first")
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--rounds", type=int, default=2, help="pairs of (unconstrained, constrained) runs")
    ap.add_argument("--pid", type=int, help="the server's process id, for its CPU time (known with --spawn)")
    ap.add_argument("--passive-omp", action="store_true",
                    help="spawn with OMP_WAIT_POLICY=PASSIVE: on cores shared with other jobs, OpenMP threads "
                         "spinning through the serial parts of a step make wall times swing by 2-5x")
    ap.add_argument("serve_args", nargs="*", help="extra flags for `kvrelay serve` (after --)")
    args = ap.parse_args()
    if args.passive_omp:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"   # inherited by the spawned server
    proc, url = None, args.url.rstrip("/")
    if args.spawn:
        proc, url = spawn_server(shlex.join(["--mode", "colocated", *args.serve_args]), Console(), args.port)
    pid = proc.pid if proc is not None else args.pid
    plain, constrained = [], []
    try:
        for r in range(args.rounds):
            plain.append(asyncio.run(round_(url, {}, r, pid)))
            constrained.append(asyncio.run(round_(url, CONSTRAINED, r, pid)))
            print(f"round {r + 1}: unconstrained {plain[-1][0]:.1f} tok/s ({plain[-1][1]:.2f} CPU ms/token), "
                  f"json_schema {constrained[-1][0]:.1f} tok/s ({constrained[-1][1]:.2f} CPU ms/token)", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    (a, ca), (b, cb) = ([statistics.mean(x) for x in zip(*runs)] for runs in (plain, constrained))
    row = {"cpu": cpu_model(), "workload": "b", "rounds": args.rounds, "omp_wait_policy": os.environ.get(
               "OMP_WAIT_POLICY", "default"),
           "unconstrained_tok_s": round(a, 1), "json_schema_tok_s": round(b, 1),
           "ratio": round(b / a, 3), "cost_pct": round(100 * (1 - b / a), 1)}
    if pid is not None:
        row.update(unconstrained_cpu_ms_per_token=round(ca, 3), json_schema_cpu_ms_per_token=round(cb, 3),
                   cpu_cost_pct=round(100 * (cb / ca - 1), 1))
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
