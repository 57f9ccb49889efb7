"""Time to first token of one long prompt through `kvrelay serve`, for several server
variants in alternating rounds (this machine's speed drifts: compare within a round).

Each round starts each variant's server in turn (one up at a time), sends a short warm-up
request, then one prompt of --tokens random token ids with max_tokens 1, and reads the
prefill worker's transfer counters. Prints one line per (round, variant) and a summary.

    python benchmarks/long_prompt_ttft.py --rounds 3 \
        --variant "layerwise=--layerwise-transfer" --variant "whole=--no-layerwise-transfer"

A variant is NAME=FLAGS (extra `kvrelay serve` flags); NAME@PATH=FLAGS runs the server
from the source tree at PATH (e.g. a git worktree of an older commit).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request

COUNTERS = ("kvrelay_transfer_bytes_total", "kvrelay_transfer_ahead_bytes_total", "kvrelay_transfer_seconds_total")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except (OSError, subprocess.CalledProcessError, AttributeError):
        return platform.processor() or "unknown"


def post(port: int, body: dict, timeout: float) -> float:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
    return time.perf_counter() - started


def counters(port: int) -> dict[str, float]:
    """The prefill worker's transfer counters, and the seconds its rooms spent in each
    phase (`p_<phase>_s`: `transfer` runs from the prompt's end to D's ack)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        phase = re.search(r'phase="(\w+)"', line)
        if name == "kvrelay_phase_duration_seconds_sum" and phase:
            name = f"p_{phase.group(1)}_s"
        elif name not in COUNTERS:
            continue
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server was not ready within {timeout:.0f} s")


def run_one(args, name: str, tree: str | None, flags: str, round_no: int) -> dict:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree
    extra = shlex.split(flags)
    colocated = any(a == "--mode=colocated" or a == "colocated" and b == "--mode" for b, a in zip([""] + extra, extra))
    workers = [] if colocated else ["--worker-base-port", str(args.port + 1)]   # P on port + 1
    argv = [sys.executable, "-m", "kvrelay", "serve", "--port", str(args.port), *workers,
            "--max-model-len", str(args.max_model_len), *extra]
    log = open(os.path.join(args.out, f"server-{name}-{round_no}.log"), "w") if args.out else subprocess.DEVNULL
    # from the tree's directory: `python -m` puts the working directory first on sys.path
    proc = subprocess.Popen(argv, env=env, cwd=tree or None, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_ready(args.port, proc, 300)
        rng = random.Random(args.seed + round_no)
        post(args.port, {"prompt": [rng.randrange(100, 40000) for _ in range(64)], "max_tokens": 2}, 120)
        prompt = [rng.randrange(100, 40000) for _ in range(args.tokens)]
        before = counters(args.port + 1)
        ttft = post(args.port, {"prompt": prompt, "max_tokens": 1}, 1200)
        after = counters(args.port + 1)   # of the long prompt alone
        return {"round": round_no, "variant": name, "ttft_s": round(ttft, 3),
                **{k: round(v - before.get(k, 0.0), 4) for k, v in after.items()}}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        time.sleep(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME=FLAGS or NAME@PATH=FLAGS")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8000, help="prompt tokens")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--port", type=int, default=8330, help="the router's; workers take the next ports")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", help="directory for server logs and result.json")
    args = ap.parse_args()
    variants = []
    for spec in args.variant:
        head, sep, flags = spec.partition("=")
        if not sep or not head:
            ap.error(f"--variant {spec!r}: write NAME=FLAGS or NAME@PATH=FLAGS")
        name, _, tree = head.partition("@")
        variants.append((name, tree or None, flags))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    print(f"cpu: {cpu_model()}; prompt {args.tokens} tokens, max_tokens 1", flush=True)
    rows = []
    for round_no in range(1, args.rounds + 1):
        order = variants if round_no % 2 else variants[::-1]   # alternate who goes first
        for name, tree, flags in order:
            row = run_one(args, name, tree, flags, round_no)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for name, _, _ in variants:
        mine = [r for r in rows if r["variant"] == name]
        ttfts, tails = [r["ttft_s"] for r in mine], [r.get("p_transfer_s", float("nan")) for r in mine]
        print(f"{name}: TTFT {', '.join(f'{t:.2f}' for t in ttfts)} s (median {statistics.median(ttfts):.2f}); "
              f"prompt's end to D's ack {', '.join(f'{t:.3f}' for t in tails)} s")
    if args.out:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"cpu": cpu_model(), "tokens": args.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
