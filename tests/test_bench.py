"""`kvrelay bench` (docs/benchmarking.md): seeded workloads, the metrics' definitions on
hand-made outcomes, and whole runs against the tiny engine's API on a real socket."""
from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import subprocess
import sys

import pytest

from api_helpers import serving
from kvrelay.bench.client import Outcome, Target, body
from kvrelay.bench.config import BenchConfig
from kvrelay.bench.metrics import distribution, summarise
from kvrelay.bench.report import compare_rows
from kvrelay.bench.settle import busy_cores, cpu_times, settle
from kvrelay.bench.workload import TOKEN_IDS, Turn, arrivals, build, load_dataset
from kvrelay.cli import main as cli_main
from kvrelay.server.colocated import colocated_app


# ---- workloads ---------------------------------------------------------------------------
def test_the_same_seed_sends_the_same_requests_and_a_faster_rate_only_moves_arrivals():
    cfg = BenchConfig(workload="mixed", num_requests=30)
    one, two = build(cfg, 0.5), build(cfg, 0.5)
    assert [(i.arrival, i.turns[0].prompt, i.turns[0].output_len) for i in one] == \
           [(i.arrival, i.turns[0].prompt, i.turns[0].output_len) for i in two]
    other = build(BenchConfig(workload="mixed", num_requests=30, seed=1), 0.5)
    assert [i.turns[0].prompt for i in other] != [i.turns[0].prompt for i in one]
    faster = build(cfg, 2.0)
    assert [i.turns[0].prompt for i in faster] == [i.turns[0].prompt for i in one]
    assert [i.arrival for i in faster] == pytest.approx([i.arrival / 4 for i in one])
    assert all(i.arrival == 0.0 for i in build(cfg, math.inf))


@pytest.mark.parametrize("workload", ["mixed", "shared-prefix", "multi-turn"])
def test_each_round_and_the_warmup_send_fresh_prompts_of_the_same_shape(workload):
    """A server's prefix cache must not serve one round from another's (vLLM's second
    round of the same prompts once read as a 0.68 s TTFT p50 against 12.5 s in its first)."""
    from kvrelay.bench.workload import WARMUP_ROUND
    cfg = BenchConfig(workload=workload, num_requests=12, prefix_len=40, prompt_len="4-30", turns=3)
    rounds = [build(cfg, 0.5, r) for r in (WARMUP_ROUND, 0, 1, 2)]

    def shape(items):
        return [(i.arrival, [(len(t.prompt), t.prompt_len, t.output_len) for t in i.turns]) for i in items]
    assert all(shape(r) == shape(rounds[0]) for r in rounds)
    firsts = [[tuple(t.prompt) for i in r for t in i.turns] for r in rounds]
    for a in range(len(rounds)):
        for b in range(a + 1, len(rounds)):
            assert not set(firsts[a]) & set(firsts[b]), (a, b)   # no prompt of one round in another
    assert [tuple(t.prompt) for i in build(cfg, 0.5, 1) for t in i.turns] == firsts[2]   # and still seeded


def test_lengths_stay_in_their_ranges_and_prompts_are_ordinary_ids():
    items = build(BenchConfig(workload="mixed", num_requests=200, prompt_len="5-9", output_len="3"), 1.0)
    lens = [len(i.turns[0].prompt) for i in items]
    assert min(lens) == 5 and max(lens) == 9 and all(i.turns[0].prompt_len == len(i.turns[0].prompt) for i in items)
    assert {i.turns[0].output_len for i in items} == {3}
    assert all(t in TOKEN_IDS for i in items for t in i.turns[0].prompt)


def test_shared_prefix_requests_share_exactly_the_prefix():
    items = build(BenchConfig(workload="shared-prefix", num_requests=10, prefix_len=40, prompt_len="4-8"), 1.0)
    prefixes = {tuple(i.turns[0].prompt[:40]) for i in items}
    assert len(prefixes) == 1
    assert len({tuple(i.turns[0].prompt[40:]) for i in items}) == 10
    assert all(44 <= i.turns[0].prompt_len <= 48 for i in items)


def test_multi_turn_conversations_have_their_turns():
    items = build(BenchConfig(workload="multi-turn", num_requests=3, turns=5, prompt_len="2-4"), 1.0)
    assert [len(i.turns) for i in items] == [5, 5, 5]
    assert all(2 <= len(t.prompt) <= 4 for i in items for t in i.turns)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_gaps_have_the_rate_and_the_burstiness_asked(burstiness):
    times = arrivals(8001, 2.0, burstiness, random.Random(7))
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.5, rel=0.06)
    # a gamma distribution of shape k has a coefficient of variation of 1 / sqrt(k)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_a_dataset_line_that_is_not_a_request_is_named(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hi there", "output_len": 5}\n\n{"prompt": [11, 12, 13], "output_len": 2}\n'
                    '{"prompt_len": 7, "output_len": 1}\n')
    turns = load_dataset(str(good))
    assert [(t.prompt, t.prompt_len, t.output_len) for t in turns] == \
           [("hi there", 0, 5), ([11, 12, 13], 3, 2), ([], 7, 1)]
    items = build(BenchConfig(dataset=str(good), num_requests=4), math.inf)
    assert [len(i.turns[0].prompt) if isinstance(i.turns[0].prompt, list) else i.turns[0].prompt for i in items] \
        == ["hi there", 3, 7, "hi there"]
    for n, line in enumerate(['{"prompt": "x"}', '{"prompt_len": 0, "output_len": 3}', "not json",
                              '{"prompt": [1, -2], "output_len": 3}', '{"prompt": "", "output_len": 3}'], 1):
        bad = tmp_path / f"bad{n}.jsonl"
        bad.write_text('{"prompt": "fine", "output_len": 1}\n' + line + "\n")
        with pytest.raises(ValueError, match=f"bad{n}.jsonl:2: want"):
            load_dataset(str(bad))
    with pytest.raises(ValueError, match="no such file"):
        load_dataset(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt_len="9-3"), "--prompt-len '9-3': need 1 <= LO <= HI"),
    (dict(output_len="many"), "--output-len 'many': give a token count"),
    (dict(rate=("0",)), "--rate '0': must be positive"),
    (dict(rate=("fast",)), "--rate 'fast': give requests per second"),
    (dict(compare=("http://a",)), "--compare needs at least two servers"),
    (dict(url="http://a", compare=("http://a", "http://b")), "--url names the one server"),
    (dict(num_requests=0), "--num-requests must be at least 1"),
    (dict(settle=-1.0), "--settle must be 0 or more"),
    (dict(burstiness=0.0), "--burstiness must be positive"),
    (dict(workload="multi-turn", dataset="x.jsonl"), "--dataset cannot drive --workload multi-turn"),
])
def test_bad_flags_are_refused_before_anything_is_sent(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        BenchConfig(**kwargs)


# ---- a quiet host before each run ---------------------------------------------------------
STAT = "cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 12345\n"


def _stat(user: int, idle: int) -> str:
    return STAT.format(user=user, system=user // 2, idle=idle, iowait=idle // 10)


def test_cpu_times_read_the_aggregate_line_and_busy_cores_follow_the_deltas():
    assert cpu_times(_stat(100, 400)) == (100 + 50 + 400 + 40, 440)
    # 2 cores; between the samples 150 jiffies busy of 300: one core's worth
    before, after = cpu_times(_stat(100, 400)), cpu_times(_stat(200, 532))
    assert busy_cores(before, after, 2) == pytest.approx(2 * 150 / 300, abs=0.02)
    assert busy_cores((10, 5), (10, 5), 2) == 0.0   # no time passed: nothing to judge
    with pytest.raises(ValueError, match="no aggregate cpu line"):
        cpu_times("cpu0 1 2 3 4\n")
    with open("/proc/stat") as f:   # the real file parses, its idle time within its total
        total, idle = cpu_times(f.read())
    assert 0 <= idle <= total


def test_settle_waits_while_the_host_is_busy_and_stops_once_it_is_quiet(tmp_path):
    path = tmp_path / "stat"
    # A fake /proc/stat that a task rewrites every 20 ms: all busy, or busy until `quiet_after`.
    ticks = {"user": 0, "idle": 0}

    async def busy_host(seconds: float, quiet_after: float | None) -> float:
        async def tick():
            start = asyncio.get_running_loop().time()
            while True:
                quiet = quiet_after is not None and asyncio.get_running_loop().time() - start >= quiet_after
                ticks["user"] += 0 if quiet else 100
                ticks["idle"] += 100 if quiet else 0
                path.write_text(_stat(ticks["user"], ticks["idle"]))
                await asyncio.sleep(0.02)
        path.write_text(_stat(ticks["user"], ticks["idle"]))
        writer = asyncio.ensure_future(tick())
        try:
            return await settle(seconds, path=str(path), window=0.05)
        finally:
            writer.cancel()

    assert asyncio.run(busy_host(0.5, None)) >= 0.5
    quiet_after = asyncio.run(busy_host(30.0, 0.3))
    assert 0.3 <= quiet_after < 30.0
    assert asyncio.run(settle(0.0, path=str(path))) == 0.0                         # --settle 0: never waits
    assert asyncio.run(settle(30.0, path=str(tmp_path / "missing"))) < 30.0   # no /proc/stat: no wait


def test_compare_names_and_urls():
    cfg = BenchConfig(compare=("kv=http://h:1/", "http://h:2"))
    assert cfg.servers() == [("kv", "http://h:1"), ("http://h:2", "http://h:2")]
    with pytest.raises(ValueError, match="same name"):
        BenchConfig(compare=("a=http://h:1", "a=http://h:2")).servers()
    with pytest.raises(ValueError, match="give URL or NAME=URL"):
        BenchConfig(compare=("a=h:1", "b=http://h:2")).servers()
    assert BenchConfig().servers() == [("server", "http://127.0.0.1:8000")]
    assert (BenchConfig().num_rounds, BenchConfig(compare=("http://a", "http://b")).num_rounds) == (1, 3)


def test_text_prompts_ask_for_length_with_logit_bias_not_ignore_eos():
    turn = Turn("hello", 1, 7)
    plain = body(Target("u", "m"), turn, [])
    assert plain["ignore_eos"] is True and "logit_bias" not in plain and plain["max_tokens"] == 7
    text = body(Target("u", "m", eos_ids=(2, 5)), turn, [])
    assert "ignore_eos" not in text and text["logit_bias"] == {"2": -100, "5": -100}
    chat = body(Target("u", "m", chat=True), turn, [{"role": "user", "content": "a"}])
    assert chat["messages"] == [{"role": "user", "content": "a"}, {"role": "user", "content": "hello"}]


# ---- metrics -----------------------------------------------------------------------------
def _outcome(ttft, e2e, tokens, error=None, chunks=()):
    return Outcome(0, 0, ttft=ttft, e2e=e2e, output_tokens=tokens, expected_tokens=tokens, error=error,
                   chunk_times=list(chunks), prompt_tokens=10)


def test_goodput_counts_requests_within_both_targets():
    outcomes = [_outcome(1.0, 2.0, 11),     # TPOT 0.1: within both (the bounds are inclusive)
                _outcome(3.0, 3.5, 6),      # TTFT 3 s: too late
                _outcome(0.5, 4.5, 21),     # TPOT 0.2: too slow
                _outcome(0.1, 0.1, 1),      # one token: no TPOT, judged on TTFT
                _outcome(0.0, 0.0, 0, error="HTTP 500: boom")]
    s = summarise(outcomes, duration=10.0, slo_ttft=2.0, slo_tpot=0.1)
    assert (s["requests"], s["completed"], s["failed"], s["first_error"]) == (5, 4, 1, "HTTP 500: boom")
    assert s["goodput"] == pytest.approx(2 / 10.0)
    assert (s["slo_attained"], s["ttft_attained"], s["tpot_attained"]) == (2 / 5, 3 / 5, 3 / 5)
    assert s["output_throughput"] == pytest.approx((11 + 6 + 21 + 1) / 10.0)
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["tpot_s"]["mean"] == pytest.approx((0.1 + 0.1 + 0.2) / 3)


def test_percentiles_interpolate_and_itl_is_the_gaps_between_chunks():
    d = distribution([4.0, 1.0, 3.0, 2.0])
    assert (d["mean"], d["p50"], d["p90"]) == (2.5, 2.5, pytest.approx(3.7))
    assert distribution([])["p99"] is None
    o = _outcome(0.2, 1.0, 4, chunks=(0.2, 0.3, 0.6, 1.0))
    assert o.itl == pytest.approx([0.1, 0.3, 0.4])
    assert summarise([o], 1.0, 2.0, 0.1)["itl_s"]["p50"] == pytest.approx(0.3)


def test_compare_ratios_are_medians_over_rounds_against_the_first_server():
    def run(server, rnd, tok_s, ttft):
        s = summarise([_outcome(ttft, ttft + 1.0, 11)], 1.0, 2.0, 0.1)
        s["output_throughput"] = tok_s
        return {"server": server, "rate": 1.0, "round": rnd, "summary": s}
    runs = [run("a", 0, 10.0, 1.0), run("b", 0, 30.0, 0.5), run("a", 1, 14.0, 1.0), run("b", 1, 20.0, 0.5),
            run("a", 2, 12.0, 1.0), run("b", 2, 24.0, 0.5)]
    rows = compare_rows(runs, ["a", "b"])
    assert [r["server"] for r in rows] == ["a", "b"]
    assert rows[0]["median"]["out tok/s"] == 12.0 and rows[1]["median"]["out tok/s"] == 24.0
    assert rows[1]["ratio"]["out tok/s"] == pytest.approx(2.0)
    assert rows[1]["ratio"]["TTFT p50"] == pytest.approx(2.0)   # half the latency: twice as good
    assert rows[0]["ratio"]["out tok/s"] == 1.0


# ---- whole runs against a live server -------------------------------------------------------
@pytest.fixture(scope="module")
def url(tiny_engine):
    with serving(colocated_app(tiny_engine)) as u:   # the colocated server: API, /metrics
        yield u
    tiny_engine.check_idle()


def _bench(tmp_path, *flags, timeout=300):
    """`kvrelay bench` as a process of its own (the command a user types)."""
    return subprocess.run([sys.executable, "-m", "kvrelay", "bench", "--no-progress", "--settle", "0", *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def _bench_here(capsys, *flags) -> subprocess.CompletedProcess:
    """The same command in this process (no second interpreter to start and import)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "--no-progress", "--settle", "0", *flags])
    out = capsys.readouterr()
    return subprocess.CompletedProcess([], exit_.value.code, out.out, out.err)


def test_a_mixed_stream_against_a_live_server(url, tmp_path, tiny_engine):
    out = tmp_path / "res"
    done = _bench(tmp_path, "--url", url, "--workload", "mixed", "--num-requests", "6", "--rate", "20",
                  "--prompt-len", "8-64", "--output-len", "4-12", "--result-dir", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    [run] = result["runs"]
    s = run["summary"]
    assert (s["requests"], s["completed"], s["failed"], s["short_outputs"]) == (6, 6, 0, 0)
    expected = [(t.prompt_len, t.output_len) for i in build(BenchConfig(workload="mixed", num_requests=6,
                prompt_len="8-64", output_len="4-12"), 20.0) for t in i.turns]
    assert [(q["prompt_tokens"], q["output_tokens"]) for q in run["requests"]] == expected
    assert all(0 < q["ttft"] <= q["e2e"] for q in run["requests"])
    assert s["output_tokens"] == sum(o for _, o in expected)
    # The engine's own counters over the run: every prompt computed once, each request's
    # first token from its prompt's pass, the rest from decode steps or beside a prompt.
    used = run["engines"]["colocated"]
    assert used["prefill_tokens"] == sum(p for p, _ in expected) and used["prefill_passes"] >= 1
    assert 0 < used["decode_steps"] <= used["decode_sequences"] <= sum(o - 1 for _, o in expected)
    assert used["decode_step_s"] > 0 and used["prefill_tokens_per_s"] > 0
    assert result["machine"]["cpu"] and run["model"] == tiny_engine.model_name
    for png in ("latency_cdf.png", "goodput_vs_rate.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "runs" in done.stdout and "CPU:" in done.stdout and "engines (kvrelay's counters" in done.stdout
    tiny_engine.check_idle()


def test_compare_runs_each_server_once_a_round_in_alternating_order(url, tmp_path, tiny_engine, capsys):
    out = tmp_path / "cmp"
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "--compare", f"one={url}", f"two={url}/", "--workload", "a", "--prompt-len", "8",
                  "--output-len", "3", "--rounds", "3", "--rate", "inf", "50", "--no-progress", "--warmup", "0",
                  "--settle", "0",
                  "--result-dir", str(out)])
    assert exit_.value.code == 0
    result = json.loads((out / "result.json").read_text())
    order = [(r["round"], r["rate"], r["server"]) for r in result["runs"]]
    assert order == [(0, "inf", "one"), (0, "inf", "two"), (0, 50.0, "one"), (0, 50.0, "two"),
                     (1, "inf", "two"), (1, "inf", "one"), (1, 50.0, "two"), (1, 50.0, "one"),
                     (2, "inf", "one"), (2, "inf", "two"), (2, 50.0, "one"), (2, 50.0, "two")]
    assert all(r["summary"]["completed"] == 1 and r["settled_s"] == 0 for r in result["runs"])
    rows = result["compare"]
    assert [(r["server"], r["rounds"]) for r in rows] == [("one", 3), ("two", 3), ("one", 3), ("two", 3)]
    assert "ratio to the first server" in capsys.readouterr().out
    tiny_engine.check_idle()


def test_multi_turn_sends_the_conversation_so_far(url, tmp_path, tiny_engine, tiny_llama_dir, capsys):
    out = tmp_path / "mt"
    done = _bench_here(capsys, "--url", url, "--workload", "multi-turn", "--num-requests", "2", "--turns", "3",
                  "--prompt-len", "4-8", "--output-len", "3", "--rate", "inf", "--tokenizer", str(tiny_llama_dir),
                  "--result-dir", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reqs = json.loads((out / "result.json").read_text())["runs"][0]["requests"]
    assert [(q["item"], q["turn"]) for q in reqs] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    for a, b in zip(reqs, reqs[1:]):
        if a["item"] == b["item"]:
            # the next turn carries this one's prompt and answer, and starts after it ended
            assert b["prompt_tokens"] > a["prompt_tokens"] + a["output_tokens"]
            assert b["start"] >= a["start"] + a["e2e"]
    tiny_engine.check_idle()


def test_text_prompts_against_a_live_server(url, tmp_path, tiny_engine, tiny_llama_dir, capsys):
    done = _bench_here(capsys, "--url", url, "--workload", "b", "--num-requests", "3", "--prompt-len", "16",
                  "--output-len", "5", "--text-prompts", "--tokenizer", str(tiny_llama_dir))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "3/3" in done.stdout
    tiny_engine.check_idle()


def test_refused_requests_are_counted_and_a_run_with_none_served_fails(url, tmp_path, tiny_engine, capsys):
    done = _bench_here(capsys, "--url", url, "--workload", "a", "--prompt-len", "5000", "--output-len", "4",
                       "--warmup", "0")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvrelay bench: error: every request to server failed: HTTP 400")
    assert "0/1" in done.stdout
    # with the default warm-up (the workload's first request), the same refusal stops the run before it measures
    warm = _bench_here(capsys, "--url", url, "--workload", "a", "--prompt-len", "5000", "--output-len", "4")
    assert warm.returncode == 1 and warm.stdout == ""
    assert warm.stderr.strip().startswith("kvrelay bench: error: server: 1 of 1 warm-up requests failed: HTTP 400")
    tiny_engine.check_idle()


def test_an_unreachable_server_is_one_line(tmp_path):
    from serving_helpers import free_port
    done = _bench(tmp_path, "--url", f"http://127.0.0.1:{free_port()}", timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "cannot reach the server" in done.stderr and "is it running?" in done.stderr
    bad = _bench(tmp_path, "--rate", "-1")
    assert bad.returncode == 1 and bad.stderr.strip() == "kvrelay: error: --rate '-1': must be positive " \
                                                         "(inf: every request at once)"


def test_engine_counters_sum_per_role_and_a_server_without_them_has_none():
    from kvrelay.bench import engines

    rows = [("decode", "d1", "decode_steps", 10), ("decode", "d2", "decode_steps", 30),
            ("decode", "d1", "decode_sequences", 320), ("decode", "d1", "decode_seconds", 2),
            ("prefill", "p1", "prefill_tokens", 4096), ("prefill", "p1", "prefill_seconds", 2),
            ("prefill", "p1", "prefill_passes", 2)]
    text = "".join(f'kvrelay_engine_{n}_total{{role="{role}",worker="{w}"}} {v}\n' for role, w, n, v in rows)
    text += 'vllm:num_requests_running{model_name="m"} 3\n'
    before = {"decode": dict.fromkeys(engines.COUNTERS, 0.0) | {"decode_steps": 8}}
    got = engines.figures(before, engines.parse(text))
    assert got["decode"]["decode_steps"] == 32 and got["decode"]["sequences_per_step"] == 10
    assert got["decode"]["decode_step_s"] == 2 / 32 and got["decode"]["prefill_tokens_per_s"] is None
    assert got["prefill"]["prefill_tokens_per_s"] == 2048 and got["prefill"]["decode_step_s"] is None
    assert engines.parse('vllm:num_requests_running{model_name="m"} 3\n') == {}
    assert engines.table([{"server": "vllm", "round": 0, "engines": {}}]) is None
    restarted = {"prefill": dict.fromkeys(engines.COUNTERS, 0.0) | {"prefill_tokens": 10 ** 6}}
    assert set(engines.figures(restarted, engines.parse(text))) == {"decode"}   # counters went back
