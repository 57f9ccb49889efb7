"""The engine end to end on tiny random-weight models: parity with transformers'
generate, batching invisibility, aborts, rejections, and no leaks."""
from __future__ import annotations

import asyncio

import pytest
import torch

from kvrelay.core.config import KVCacheConfig, ModelOptions, SchedulerConfig
from kvrelay.engine.engine import build_engine
from kvrelay.engine.loader import load_model
from kvrelay.engine.types import FinishReason, GenerateRequest, RequestRejected, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
    "Translate to German: good morning",
]


def greedy(max_tokens=32, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def collect(engine, rid, prompt_ids, params):
    tokens, text, last = [], "", None
    async for out in engine.generate(GenerateRequest(rid, tuple(prompt_ids), params)):
        tokens += out.token_ids
        text += out.text
        last = out
    return tokens, text, last


def run_all(engine, jobs):
    async def main():
        return await asyncio.gather(*(collect(engine, *job) for job in jobs))
    return asyncio.run(main())


@pytest.fixture(scope="module", params=["llama", "qwen2", "default-model"])
def hf_and_engine(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from kvrelay.engine.models.testing import make_tiny_model_dir
    from test_models import hf_reference_from_gguf

    if request.param == "default-model":
        hf, loaded = hf_reference_from_gguf(), load_model(ModelOptions(dtype="float32"))
    else:
        path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), arch=request.param, seed=1)
        hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        loaded = load_model(ModelOptions(model=str(path), dtype="float32"))
    engine = build_engine(loaded, KVCacheConfig(page_size=4, max_kv_tokens=2048),
                          SchedulerConfig(max_running_requests=16, max_prefill_tokens=96))
    yield hf, engine
    engine.check_idle()
    engine.shutdown()


def test_greedy_matches_transformers_generate_alone_and_batched(hf_and_engine, request):
    """32 greedy tokens (16 on the default model, whose float32 reference is slow on a CPU
    without AVX-512), or fewer when EOS comes first on both sides, for 5 prompts."""
    hf, engine = hf_and_engine
    n = 16 if request.node.callspec.params["hf_and_engine"] == "default-model" else 32
    tok = engine.tokenizer()
    eos = sorted(engine.core.eos_ids)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    expected = []
    for p in ids:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0])
        expected.append(out[0, len(p):].tolist())
    params = SamplingParams(max_tokens=n, temperature=0.0)
    alone = [run_all(engine, [(f"alone-{i}", p, params)])[0][0] for i, p in enumerate(ids)]
    batched = [r[0] for r in run_all(engine, [(f"batch-{i}", p, params) for i, p in enumerate(ids)])]
    assert alone == expected
    assert batched == expected
    assert sum(len(e) for e in expected) > 5 * n // 4  # not a degenerate run of immediate EOS
    engine.check_idle()


def test_batching_is_invisible_for_16_mixed_requests(tiny_engine):
    tok = tiny_engine.tokenizer()
    base = tok("The quick brown fox jumps over the lazy dog. " * 12, add_special_tokens=False)["input_ids"]
    jobs = [(f"mix-{i}", base[i:i + 5 + 9 * i], greedy(max_tokens=8 + 3 * i)) for i in range(16)]
    one_by_one = [run_all(tiny_engine, [job])[0][0] for job in jobs]
    together = [r[0] for r in run_all(tiny_engine, jobs)]
    assert together == one_by_one
    assert [len(t) for t in together] == [8 + 3 * i for i in range(16)]
    tiny_engine.check_idle()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_mixed_steps_keep_greedy_outputs(tiny_loaded, kv_dtype):
    """Requests arriving while others decode: with --target-tpot each step decodes the
    running batch beside a chunk of the next prompt (16-token chunks here). Every request's
    greedy tokens equal its tokens alone, and mixed steps did happen."""
    from kvrelay.engine.core import EngineCore
    tok = tiny_loaded.tokenizer
    base = tok("Chunked prefill shares each forward pass with the running decodes. " * 8,
               add_special_tokens=False)["input_ids"]
    jobs = [(f"m-{i}", base[i:i + 20 + 17 * i], greedy(max_tokens=12)) for i in range(5)]

    def run(arrivals: dict[int, list]) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
        core = EngineCore(tiny_loaded, KVCacheConfig(page_size=4, max_kv_tokens=1024, kv_cache_dtype=kv_dtype),
                          SchedulerConfig(max_running_requests=8, max_prefill_tokens=16, target_tpot=0.1))
        outs: dict[str, list[int]] = {}
        steps, schedule = [], core.scheduler.schedule

        def spy():
            batch = schedule()
            steps.append((len(batch.decode), sum(i.length for i in batch.prefill)))
            return batch
        core.scheduler.schedule = spy
        n = 0
        while n <= max(arrivals) or core.has_work:
            for rid, prompt, params in arrivals.get(n, []):
                core.add(GenerateRequest(rid, tuple(prompt), params),
                         lambda o: outs.setdefault(o.rid, []).extend(o.token_ids))
            core.step()
            n += 1
        core.check_idle()
        return outs, steps
    alone = {rid: run({0: [(rid, p, params)]})[0][rid] for rid, p, params in jobs}
    together, steps = run({3 * i: [job] for i, job in enumerate(jobs)})
    assert together == alone
    assert all(len(t) == 12 for t in together.values())
    assert any(d and p for d, p in steps)                        # decodes and a prompt chunk in one pass
    assert max(p for _, p in steps) <= 16


def test_shed_ttft_refuses_a_request_predicted_to_miss_it_and_serves_the_rest(tiny_loaded):
    """--shed-ttft 1: at a measured 10 ms per prompt token, a request with more than 100
    prompt tokens before and with it ends at once as "overloaded" (a 503 with Retry-After);
    the ones that fit are served in full, and nothing is left behind."""
    from kvrelay.engine.core import EngineCore
    from kvrelay.server.errors import from_failed_output
    core = EngineCore(tiny_loaded, KVCacheConfig(page_size=4, max_kv_tokens=1024),
                      SchedulerConfig(max_prefill_tokens=512, shed_ttft=1.0))
    core.scheduler.costs.per_token = 0.01
    outs: dict[str, list] = {}
    for rid, n in (("a", 50), ("b", 60), ("c", 30)):   # b: 110 tokens by its turn (1.1 s); c: 80 (0.8 s)
        core.add(GenerateRequest(rid, tuple(range(5, 5 + n)), greedy(max_tokens=4)), lambda o: outs.setdefault(o.rid, []).append(o))
    shed = outs.pop("b")
    assert len(shed) == 1 and shed[0].finish_reason == FinishReason.ERROR and shed[0].error.startswith("overloaded:")
    err = from_failed_output(shed[0])
    assert (err.status, err.code, err.headers) == (503, "overloaded", {"Retry-After": "1"})
    while core.has_work:
        core.step()
    assert {rid: sum(len(o.token_ids) for o in got) for rid, got in outs.items()} == {"a": 4, "c": 4}
    core.check_idle()


def test_request_finished_hook_keeps_pages_under_one_holder(tiny_loaded):
    """EngineHooks: a finished choice's pages go to the holder `request_finished` names
    (prefill-only here, as on a prefill worker; n=2 choices, so choice 0 alone holds them
    and choice 1's shared references are dropped) and stay used until that holder is
    freed, its one release path; a hook returning None leaves the pages to the engine."""
    from kvrelay.engine.core import EngineCore
    from kvrelay.engine.hooks import EngineHooks

    class Keep(EngineHooks):
        def __init__(self) -> None:
            self.seen = []

        def request_finished(self, req, last):
            self.seen.append((req.rid, req.index, last.token_id, list(req.pages)))
            return ("held", req.rid) if req.rid == "keep" and req.index == 0 else None

    hooks = Keep()
    core = EngineCore(tiny_loaded, KVCacheConfig(page_size=4, max_kv_tokens=256), SchedulerConfig(), hooks=hooks)
    outs = []
    core.add(GenerateRequest("keep", tuple(range(5, 15)), greedy(max_tokens=4, n=2)), outs.append, prefill_only=True)
    core.add(GenerateRequest("free", tuple(range(5, 12)), greedy(max_tokens=3)), outs.append)
    while core.has_work:
        core.step()
    assert [(rid, i) for rid, i, _, _ in hooks.seen] == [("keep", 0), ("keep", 1), ("free", 0)]
    kept = hooks.seen[0][3]
    assert kept and hooks.seen[1][3] == kept   # choice 1 shared choice 0's prompt pages
    assert core.allocator.pages_of(("held", "keep")) == kept
    assert core.allocator.num_used == len(kept)
    core.allocator.check_integrity()
    assert sum(o.finished for o in outs if o.rid == "keep") == 2 and sum(o.finished for o in outs) == 3
    core.allocator.free(("held", "keep"))
    core.check_idle()


def test_preemption_keeps_greedy_outputs(tiny_loaded):
    """A pool too small for every request at once forces preemption and recompute."""
    small = build_engine(tiny_loaded, KVCacheConfig(page_size=4, max_kv_tokens=96),
                         SchedulerConfig(max_running_requests=8, max_prefill_tokens=256))
    try:
        tok = small.tokenizer()
        prompt = tok("Paged attention keeps memory in fixed-size pages.", add_special_tokens=False)["input_ids"]
        jobs = [(f"p-{i}", prompt[: 6 + i], greedy(max_tokens=20)) for i in range(4)]
        alone = [run_all(small, [job])[0][0] for job in jobs]
        together = [r[0] for r in run_all(small, jobs)]
        assert together == alone
        assert small.call(lambda core: core.scheduler.num_preemptions) > 0
        small.check_idle()
    finally:
        small.shutdown()


def test_stop_string_and_stop_token_and_max_tokens(tiny_engine):
    tok = tiny_engine.tokenizer()
    prompt = tok("Hello there, how are you today?", add_special_tokens=False)["input_ids"]
    tokens, text, last = run_all(tiny_engine, [("free", prompt, greedy(max_tokens=24))])[0]
    assert last.finish_reason == FinishReason.LENGTH and len(tokens) == 24
    assert text == tok.decode(tokens, skip_special_tokens=True)
    # Stop on the 5th generated token id: generation ends there with reason "stop".
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    t2, _, last2 = run_all(tiny_engine, [("stoptok", prompt, greedy(max_tokens=24, stop_token_ids=(stop_id,)))])[0]
    assert last2.finish_reason == FinishReason.STOP and t2 == tokens[: first + 1]
    # A stop string taken from the middle of the text: the returned text ends right before it.
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if stop.strip():
        _, t3, last3 = run_all(tiny_engine, [("stopstr", prompt, greedy(max_tokens=24, stop=(stop,)))])[0]
        assert last3.finish_reason == FinishReason.STOP
        assert stop not in t3 and text.startswith(t3)
    tiny_engine.check_idle()


def test_abort_frees_pages_within_a_step(tiny_engine):
    async def main():
        gen = tiny_engine.generate(GenerateRequest("to-abort", tuple(range(100, 140)), greedy(max_tokens=500)))
        first = await gen.__anext__()
        assert first.token_ids
        await gen.aclose()  # the client went away
    asyncio.run(main())
    tiny_engine.check_idle(timeout=5)
    assert tiny_engine.call(lambda core: core.allocator.num_free) == tiny_engine.call(lambda core: core.allocator.num_total)


def test_rejections_are_clear_and_leak_nothing(tiny_engine):
    async def attempt(prompt, params):
        async for _ in tiny_engine.generate(GenerateRequest("bad", tuple(prompt), params)):
            pass
    cases = [([], greedy(), "empty"),
             ([10**9], greedy(), "vocabulary"),
             ([1, 2, 3], greedy(max_tokens=10**6), "context length")]
    for prompt, params, words in cases:
        with pytest.raises(RequestRejected) as err:
            asyncio.run(attempt(prompt, params))
        assert words in str(err.value)
    tiny_engine.check_idle()


def test_same_seed_same_sampled_output(tiny_engine):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = list(range(200, 230))
    a = run_all(tiny_engine, [("s1", prompt, params)])[0][0]
    b = run_all(tiny_engine, [("s2", prompt, params), ("s3", prompt[:10], params)])[0][0]
    assert a == b
    tiny_engine.check_idle()


def test_a_caller_that_leaves_while_its_add_is_queued_never_stops_the_engine(tiny_engine):
    """The client disconnects while its request waits in the engine's inbox (the add's
    future is cancelled): the add is skipped, the engine thread keeps serving."""
    import asyncio
    import concurrent.futures

    from kvrelay.engine.types import GenerateRequest, SamplingParams

    greq = GenerateRequest("gone", (1, 2, 3), SamplingParams(max_tokens=4, temperature=0.0))
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.cancel()
    tiny_engine._inbox.put(("add", greq, lambda out: None, {}, fut))
    call: concurrent.futures.Future = concurrent.futures.Future()
    call.cancel()
    tiny_engine._inbox.put(("call", lambda core: 1, call, False))

    async def after():
        ok = GenerateRequest("after", (1, 2, 3), SamplingParams(max_tokens=3, temperature=0.0))
        return [o async for o in tiny_engine.generate(ok)]

    outs = asyncio.run(after())
    assert outs[-1].completion_tokens == 3
    assert tiny_engine._thread.is_alive()
    tiny_engine.check_idle()


def test_an_iteration_that_raises_fails_its_requests_and_the_engine_goes_on(tiny_engine, monkeypatch):
    """A fault outside the forward pass (here: the scheduler) ends the live request with
    internal_error instead of killing the engine thread and pinning it forever."""
    import asyncio

    from kvrelay.engine.types import FinishReason, GenerateRequest, SamplingParams

    scheduler = tiny_engine.core.scheduler
    real = scheduler.schedule
    calls = {"n": 0}

    def flaky():  # raises once, on the first step that holds "hit"
        if not calls["n"] and any(r.rid == "hit" for r in [*scheduler.waiting, *scheduler.running]):
            calls["n"] += 1
            raise RuntimeError("scheduler bug")
        return real()
    monkeypatch.setattr(scheduler, "schedule", flaky)

    async def run(rid, n):
        greq = GenerateRequest(rid, (1, 2, 3), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return [o async for o in tiny_engine.generate(greq)]

    hit = asyncio.run(run("hit", 8))
    assert calls["n"] == 1
    assert hit[-1].finish_reason is FinishReason.ERROR and "scheduler bug" in hit[-1].error
    after = asyncio.run(run("after", 3))
    assert after[-1].finish_reason is FinishReason.LENGTH and after[-1].completion_tokens == 3
    assert tiny_engine._thread.is_alive()
    tiny_engine.check_idle()
