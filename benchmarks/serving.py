"""Serving benchmark client: output tokens/s, TTFT (mean, p99) and TPOT (mean).

Workloads:
  a: 1 request, 128 prompt tokens, 128 output tokens
  b: 32 concurrent requests, 256 prompt tokens, 128 output tokens each
Both use ignore_eos so every request produces exactly its output length.

  python benchmarks/serving.py --url http://127.0.0.1:8000          # a running server
  python benchmarks/serving.py --spawn -- --dtype bfloat16            # start `kvrelay serve` first
  python benchmarks/serving.py --url http://127.0.0.1:8202 --text-prompts   # llama-cpp-python

--text-prompts is for servers that take text prompts only, have no ignore_eos and send no
usage while streaming (llama-cpp-python's): the same random token prompts decoded to text
with the default model's tokenizer (re-tokenized, a prompt is within a few tokens of its
length), the end-of-sequence ids suppressed with logit_bias, and output tokens counted as
streamed chunks that carry text or no finish_reason (such a server streams one token a chunk).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

WORKLOADS = {"a": (1, 128, 128), "b": (32, 256, 128)}  # concurrency, prompt tokens, output tokens


@dataclass
class Result:
    ttft: float = 0.0
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class TextPrompts:
    """How to drive a text-only server: the tokenizer that turns the token prompts into
    text, and the ids whose logits are pushed to -100 instead of ignore_eos."""
    tokenizer: object
    eos_ids: tuple[int, ...]

    @classmethod
    def default_model(cls) -> "TextPrompts":
        from kvrelay.engine.loader import default_tokenizer
        tok = default_tokenizer()
        eos = {tok.eos_token_id, tok.bos_token_id, *(tok.convert_tokens_to_ids(t) for t in ("<|im_end|>",))}
        return cls(tok, tuple(sorted(i for i in eos if isinstance(i, int) and i >= 0)))


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int,
                      text: TextPrompts | None = None) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if text is not None:
        body = {"model": model, "prompt": text.tokenizer.decode(prompt), "max_tokens": out_len, "temperature": 0,
                "stream": True, "logit_bias": {str(i): -100 for i in text.eos_ids}}
    res, start = Result(), time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
            return res
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                res.error = chunk["error"].get("message")
            if chunk.get("usage"):
                res.tokens = chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            if choice.get("text") is not None and (text is None or choice["text"] or not choice.get("finish_reason")):
                now = time.perf_counter() - start
                if not res.token_times:
                    res.ttft = now
                res.token_times.append(now)
    if text is not None:
        res.tokens = len(res.token_times)
    return res


async def run_workload(url: str, name: str, seed: int = 0, text: TextPrompts | None = None) -> dict:
    concurrency, prompt_len, out_len = WORKLOADS[name]
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        prompts = [[rng.randrange(1000, 20000) for _ in range(prompt_len)] for _ in range(concurrency)]
        await one_request(client, url, model, prompts[0][:16], 4, text)  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, model, p, out_len, text) for p in prompts))
        elapsed = time.perf_counter() - start
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"workload {name}: {len(errors)} requests failed, first: {errors[0]}")
    ttfts = sorted(r.ttft for r in results)
    tpots = [(r.token_times[-1] - r.ttft) / max(1, r.tokens - 1) for r in results if r.tokens > 1]
    total = sum(r.tokens for r in results)
    return {"workload": name, "requests": concurrency, "prompt_tokens": prompt_len, "output_tokens": out_len,
            "elapsed_s": elapsed, "output_tok_s": total / elapsed,
            "ttft_mean_s": statistics.mean(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "tpot_mean_s": statistics.mean(tpots) if tpots else 0.0}


def print_table(rows: list[dict]) -> None:
    print(f"{'workload':<9}{'reqs':>5}{'in':>6}{'out':>6}{'tok/s':>10}{'TTFT mean':>12}{'TTFT p99':>11}{'TPOT mean':>12}")
    for r in rows:
        print(f"{r['workload']:<9}{r['requests']:>5}{r['prompt_tokens']:>6}{r['output_tokens']:>6}"
              f"{r['output_tok_s']:>10.1f}{r['ttft_mean_s'] * 1e3:>10.0f}ms{r['ttft_p99_s'] * 1e3:>9.0f}ms"
              f"{r['tpot_mean_s'] * 1e3:>10.1f}ms")


def spawn_server(port: int, serve_args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvrelay", "serve", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy in 300 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--workload", choices=("a", "b", "all"), default="all")
    ap.add_argument("--spawn", action="store_true", help="start `kvrelay serve` on --port first")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    ap.add_argument("--text-prompts", action="store_true",
                    help="text prompts, EOS suppressed by logit_bias, tokens counted per chunk "
                         "(for llama-cpp-python's server)")
    ap.add_argument("serve_args", nargs="*", help="extra flags for `kvrelay serve` (after --)")
    args = ap.parse_args()
    proc = spawn_server(args.port, args.serve_args) if args.spawn else None
    url = f"http://127.0.0.1:{args.port}" if args.spawn else args.url.rstrip("/")
    try:
        names = ["a", "b"] if args.workload == "all" else [args.workload]
        text = TextPrompts.default_model() if args.text_prompts else None
        rows = [asyncio.run(run_workload(url, n, text=text)) for n in names]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
