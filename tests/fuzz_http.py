"""2,000 fuzzed HTTP requests against a serving cluster under load (issue #10, acceptance).

Run by hand:

    .venv/bin/python tests/fuzz_http.py                 # starts `kvrelay serve` (1P+1D, tiny random model)
    .venv/bin/python tests/fuzz_http.py --url URL       # against a running server

Normal greedy requests run the whole time, beside the fuzzed ones (bodies from
`test_http_fuzz.fuzzed_request`). It checks that every fuzzed answer is a valid 200 or an
OpenAI-style 4xx (never a 5xx, never a hang), that every normal request completes with the
same text as before the fuzz, and that no request or page is left behind; then prints the
figures. Exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_helpers import assert_no_leak, running_server  # noqa: E402
from test_http_fuzz import check_answer, fuzzed_request  # noqa: E402

PROMPTS = [list(range(3 + i, 20 + 5 * i)) for i in range(6)]


def fuzzed_requests(n: int, seed: int) -> list[tuple]:
    out: list[tuple] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzzed_request())
    def collect(req):
        out.append(req)

    collect()
    return out[:n]


async def normal(c: httpx.AsyncClient, prompt: list[int]) -> str:
    r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
                     timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def run(url: str, n: int, concurrency: int) -> int:
    reqs = fuzzed_requests(n, 0)
    while len(reqs) < n:   # hypothesis may stop early once it has exhausted small cases
        reqs += reqs[: n - len(reqs)]
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        reqs = [(m, p, b.replace(b'"tiny-llama"', f'"{model}"'.encode()), h) for m, p, b, h in reqs]
        baseline = [await normal(c, p) for p in PROMPTS]
        answers: Counter[str] = Counter()
        failures: list[str] = []
        normal_ok = normal_bad = 0
        done = asyncio.Event()

        async def load() -> None:
            nonlocal normal_ok, normal_bad
            i = 0
            while not done.is_set():
                text = await normal(c, PROMPTS[i % len(PROMPTS)])
                if text == baseline[i % len(PROMPTS)]:
                    normal_ok += 1
                else:
                    normal_bad += 1
                    failures.append(f"normal request {i} differs: {text!r} != {baseline[i % len(PROMPTS)]!r}")
                i += 1

        queue: asyncio.Queue = asyncio.Queue()
        for r in reqs:
            queue.put_nowait(r)

        async def fuzzer() -> None:
            while not queue.empty():
                method, path, body, headers = queue.get_nowait()
                try:
                    r = await asyncio.wait_for(c.request(method, path, content=body or None, headers=headers), 60)
                    answers[check_answer(r)] += 1
                except Exception as exc:  # noqa: BLE001 - every failure is reported, none stops the run
                    answers["FAIL"] += 1
                    failures.append(f"{method} {path} {body[:200]!r}: {type(exc).__name__}: {str(exc)[:300]}")

        started = time.monotonic()
        loaders = [asyncio.create_task(load()) for _ in range(2)]
        await asyncio.gather(*(fuzzer() for _ in range(concurrency)))
        done.set()
        await asyncio.gather(*loaders)
        took = time.monotonic() - started
    try:
        assert_no_leak(url)
        leak = "none"
    except AssertionError as exc:
        leak = str(exc)
        failures.append(leak)
    print(f"fuzzed requests: {sum(answers.values())} in {took:.1f} s, answers {dict(sorted(answers.items()))}")
    print(f"normal requests under fuzz: {normal_ok} same tokens, {normal_bad} different; leak: {leak}")
    for f in failures[:20]:
        print("FAILURE:", f)
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running kvrelay server (default: start `kvrelay serve` on a tiny model)")
    ap.add_argument("-n", type=int, default=2000, help="fuzzed requests")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--serve-args", default="", help="extra flags for the started `kvrelay serve`")
    args = ap.parse_args()
    if args.url:
        return asyncio.run(run(args.url, args.n, args.concurrency))
    from kvrelay.engine.models.testing import make_tiny_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model_dir(Path(tmp) / "model", arch="llama", seed=0)
        with running_server("--model", f"random:{model}", "--dtype", "float32", "--served-model-name", "tiny-llama",
                            "--max-kv-tokens", "8192", "--log-level", "warning", *args.serve_args.split()) as url:
            return asyncio.run(run(url, args.n, args.concurrency))

if __name__ == "__main__":
    sys.exit(main())
