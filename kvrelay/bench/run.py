"""A bench run: the workload built once per rate from the seed, sent to each server in
turn, round after round; then the tables, result.json and the plots.

Rounds alternate the servers' order (A B C, then C B A, ...) so that a machine whose
speed drifts during the run favours none of them, and each run waits for a quiet host
first (`settle`), so that no server is billed for the one before it.
"""
from __future__ import annotations

import asyncio
import contextlib
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvrelay.bench import engines, report
from kvrelay.bench.client import Outcome, Target, send, served_model
from kvrelay.bench.config import BenchConfig
from kvrelay.bench.metrics import summarise
from kvrelay.bench.settle import WINDOW, settle
from kvrelay.bench.workload import WARMUP_ROUND, Item, Turn, as_text, build, load_tokenizer
from kvrelay.core import aio


class BenchError(Exception):
    """What stops a run before it measures anything, in one line."""


async def run_items(client: httpx.AsyncClient, target: Target, items: list[Item], cfg: BenchConfig,
                    advance=lambda: None) -> tuple[list[Outcome], float]:
    """Send every item at its arrival time (a conversation's turns one after another);
    returns each turn's outcome and the seconds from the start to the last answer."""
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []

    async def one(item: Item) -> None:
        await asyncio.sleep(max(0.0, t0 + item.arrival - time.perf_counter()))
        history: list[dict] = []
        for k, turn in enumerate(item.turns):
            async with gate:
                o = await send(client, target, turn, history, item.index, k, t0)
            outcomes.append(o)
            advance()
            if not o.ok:
                return                      # the rest of a conversation cannot follow a failed turn
            history += [{"role": "user", "content": turn.prompt}, {"role": "assistant", "content": o.text}]

    await asyncio.gather(*(one(i) for i in items))
    return sorted(outcomes, key=lambda o: (o.item, o.turn)), time.perf_counter() - t0


def _record(o: Outcome) -> dict:
    return {"item": o.item, "turn": o.turn, "ok": o.ok, "error": o.error, "start": o.start, "ttft": o.ttft,
            "tpot": o.tpot, "e2e": o.e2e, "prompt_tokens": o.prompt_tokens, "output_tokens": o.output_tokens,
            "expected_tokens": o.expected_tokens, "chunk_times": [round(t, 5) for t in o.chunk_times]}


def _progress(cfg: BenchConfig, console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=not cfg.progress, transient=True)


async def _targets(client: httpx.AsyncClient, cfg: BenchConfig, servers, eos_ids) -> list[Target]:
    out = []
    for _, url in servers:
        try:
            model = cfg.model or await served_model(client, url)
        except ValueError as exc:
            raise BenchError(str(exc)) from None
        out.append(Target(url, model, cfg.chat, eos_ids))
    return out


async def _warm(client: httpx.AsyncClient, targets: list[Target], servers, items: list[Item], n: int) -> None:
    """The first turns of the first `n` items, at once, capped at 16 output tokens; a
    failure here is the server's, reported before anything is measured."""
    turns = [Turn(i.turns[0].prompt, i.turns[0].prompt_len, min(16, i.turns[0].output_len)) for i in items[:n]]
    for (name, _), target in zip(servers, targets):
        t0 = time.perf_counter()
        done = await asyncio.gather(*(send(client, target, t, [], -1, 0, t0) for t in turns))
        failed = [o for o in done if not o.ok]
        if failed:
            raise BenchError(f"{name}: {len(failed)} of {len(done)} warm-up requests failed: {failed[0].error}")


async def bench(cfg: BenchConfig, servers: list[tuple[str, str]], console: Console) -> dict:
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.chat or cfg.text_prompts else None
    eos_ids = None
    if cfg.text_prompts:
        ids = {tokenizer.eos_token_id, tokenizer.bos_token_id,
               *(tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))}
        eos_ids = tuple(sorted(i for i in ids if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id))
    def items_for(rate: float, rnd: int) -> list[Item]:
        items = build(cfg, rate, rnd)
        if tokenizer is not None:
            as_text(items, tokenizer)
        return items
    workloads = {(rnd, rate): items_for(rate, rnd) for rnd in range(cfg.num_rounds) for rate in cfg.rates}
    runs = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout), limits=limits) as client:
        targets = await _targets(client, cfg, servers, eos_ids)
        if cfg.warmup:
            await _warm(client, targets, servers, items_for(cfg.rates[0], WARMUP_ROUND), cfg.warmup)
        order = list(zip(servers, targets))
        for rnd in range(cfg.num_rounds):
            for rate in cfg.rates:
                items = workloads[rnd, rate]
                for (name, url), target in (order if rnd % 2 == 0 else order[::-1]):
                    waited = await settle(cfg.settle)
                    before = await engines.counters(client, url)
                    with _progress(cfg, console) as bar:
                        task = bar.add_task(f"{name} rate {report.rate_label(rate)} round {rnd + 1}",
                                            total=sum(len(i.turns) for i in items))
                        outcomes, duration = await run_items(client, target, items, cfg,
                                                             lambda: bar.advance(task))
                    summary = summarise(outcomes, duration, cfg.slo_ttft, cfg.slo_tpot)
                    used = engines.figures(before, await engines.counters(client, url))
                    runs.append({"server": name, "url": url, "model": target.model, "rate": rate, "round": rnd,
                                 "settled_s": round(waited, 3), "summary": summary, "engines": used,
                                 "requests": [_record(o) for o in outcomes]})
    return {"config": asdict(cfg), "machine": report.machine(), "servers": [n for n, _ in servers],
            "started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": runs}


def spawn_server(flags: str, console: Console, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """`kvrelay serve FLAGS` on `port` (default: a free one), once /health answers;
    BenchError if it exits or is not ready in 300 s."""
    import socket

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvrelay", "serve", "--port", str(port), *shlex.split(flags)]
    console.print(f"starting: {shlex.join(cmd)}")
    proc = subprocess.Popen(cmd)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"`kvrelay serve {flags}` exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        time.sleep(0.5)
    proc.kill()
    raise BenchError("the spawned server was not ready in 300 s")


def main(cfg: BenchConfig) -> int:
    console = Console(width=None if sys.stdout.isatty() else 170)
    servers = cfg.servers()
    proc = None
    try:
        if cfg.spawn is not None:
            proc, url = spawn_server(cfg.spawn, console)
            servers = [("kvrelay", url)]
        result = aio.run(bench(cfg, servers, console))
    except (BenchError, ValueError) as exc:
        print(f"kvrelay bench: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
    m = result["machine"]
    console.print(f"workload {cfg.workload}, {cfg.requests} {'conversations' if cfg.chat else 'requests'}, "
                  f"seed {cfg.seed}; SLO: TTFT <= {cfg.slo_ttft:g} s, TPOT <= {cfg.slo_tpot * 1e3:g} ms; "
                  f"CPU: {m['cpu']} ({', '.join(m['isa']) or 'no AVX2'}), {m['cores']} cores")
    names = [n for n, _ in servers]
    waits = [r["settled_s"] for r in result["runs"]]
    if cfg.settle and max(waits) >= 2 * WINDOW:
        console.print(f"waited for a quiet host before {sum(w >= 2 * WINDOW for w in waits)} of {len(waits)} runs, "
                      f"{max(waits):.1f} s at most (--settle {cfg.settle:g})")
    result["compare"] = report.show(console, result["runs"], names)
    if cfg.result_dir:
        out = Path(cfg.result_dir)
        title = f"{cfg.workload}, seed {cfg.seed}, {m['cpu']}"
        paths = [report.write_result(out, result), *report.plot(out, result["runs"], result["compare"], names, title)]
        console.print("wrote " + ", ".join(str(p) for p in paths))
    broken = [r for r in result["runs"] if r["summary"]["completed"] == 0]
    if broken:
        print(f"kvrelay bench: error: every request to {broken[0]['server']} failed: "
              f"{broken[0]['summary']['first_error']}", file=sys.stderr)
        return 1
    return 0


