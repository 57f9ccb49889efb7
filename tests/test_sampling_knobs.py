"""The vLLM/OpenAI sampling knobs: logit_bias, min_p, min_tokens, repetition_penalty (and
presence/frequency penalties acting on a real model's output).

Engine level: the Sampler on hand-made logits, each knob checked against the formula
computed here. HTTP level: the same requests served colocated (in process) and by a
disaggregated cluster (router + one prefill + one decode process), where P samples the
first token and D the rest, so an output that needs the knob on both tokens proves that
both workers apply it. Invalid values are a 400 naming the field.
"""
from __future__ import annotations

import math
from collections import Counter
from contextlib import asynccontextmanager

import httpx
import pytest
import torch

from cluster_helpers import Cluster
from kvrelay.engine.sampling import Sampler, SamplingState, validate_params
from kvrelay.engine.types import RequestRejected, SamplingParams
from kvrelay.server.openai_api import build_openai_app
from kvrelay.server.worker_protocol import WireSampling

EOS = 7
PROMPT = (1, 3, 3)


def state(prompt=PROMPT, eos=(EOS,), **kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), prompt_ids=prompt, eos_ids=eos)


def adjusted(logits: torch.Tensor, st: SamplingState) -> torch.Tensor:
    """Step 1 as the sampler saw it: the log-softmax it reports through logprobs, which
    `st` asks for over the whole (at most 20-token) vocabulary."""
    assert st.params.logprobs == logits.shape[-1]
    lp = Sampler().sample(logits.unsqueeze(0), [st])[0].logprob
    out = torch.full((logits.shape[-1],), float("nan"))
    for tok, v in lp.top:
        out[tok] = v
    return out


def log_softmax(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).log_softmax(-1).float()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    both_inf = a.isinf() & b.isinf()
    return bool((both_inf | torch.isclose(a, b, atol=1e-5)).all())


def empirical(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """Token frequencies of n one-step draws with seeds 0..n-1."""
    states = [state(seed=i, **kw) for i in range(n)]
    tokens = [r.token_id for r in Sampler().sample(logits_row.expand(n, -1), states)]
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.shape[-1]).float() / n


# ---------------------------------------------------------------- logit_bias

def test_logit_bias_is_added_to_the_logits():
    logits = torch.tensor([1.0, -0.5, 2.0, 0.0, 0.3, -2.0, 1.5, 0.1])
    bias = ((0, -3.0), (3, 2.5), (5, 100.0))
    st = state(temperature=0.0, logit_bias=bias, logprobs=8)
    expected = logits.tolist()
    for tok, b in bias:
        expected[tok] += b
    assert close(adjusted(logits, st), log_softmax(expected))
    assert Sampler().sample(logits.unsqueeze(0), [st])[0].token_id == 5


def test_logit_bias_shifts_the_sampled_distribution():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    freq = empirical(logits, 4000, logit_bias=((3, math.log(10.0)), (0, -100.0)))
    # p ~ (0.5 e^-100, 0.3, 0.15, 0.5): token 0 vanishes, token 3 is as likely as 0 was
    expected = torch.tensor([0.0, 0.3, 0.15, 0.5]) / 0.95
    assert freq[0] == 0
    assert torch.allclose(freq, expected, atol=0.03)


def test_logit_bias_must_name_vocabulary_tokens_in_range():
    validate_params(SamplingParams(logit_bias=((63, 100.0), (0, -100.0))), vocab_size=64)
    for bias, vocab in [(((64, 1.0),), 64), (((-1, 1.0),), None), (((1, 100.5),), 64),
                        (((1, float("nan")),), 64), (((1, 1.0), (1, 2.0)), 64)]:
        with pytest.raises(RequestRejected) as err:
            validate_params(SamplingParams(logit_bias=bias), vocab_size=vocab)
        assert err.value.param == "logit_bias"


def test_an_id_past_the_logits_never_lands_in_another_row():
    """The engine refuses such a logit_bias (`validate_params` with the vocabulary); the
    sampler itself raises rather than biasing the next row's token. A stop token id past
    the vocabulary, never sampled anyway, is simply not held back by min_tokens."""
    logits = torch.zeros(2, 10)
    with pytest.raises(IndexError):
        Sampler().sample(logits, [state(temperature=0.0, logit_bias=((10, 5.0),)), state(temperature=0.0)])
    st = state(temperature=0.0, min_tokens=2, stop_token_ids=(10, 10**6), logprobs=10)
    assert close(adjusted(logits[0], st), log_softmax([0.0] * EOS + [-math.inf] + [0.0] * (9 - EOS)))


# ---------------------------------------------------------------- min_p

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("min_p, temperature", [(0.2, 1.0), (0.5, 1.0), (0.35, 0.5), (0.2, 2.0), (1.0, 1.0)])
def test_min_p_drops_tokens_below_min_p_times_the_best(min_p, temperature):
    freq = empirical(PROBS.log(), 4000, min_p=min_p, temperature=temperature)
    p = (PROBS.log() / temperature).softmax(-1)           # after temperature, as vLLM does
    kept = p >= min_p * p.max()
    expected = torch.where(kept, p, 0.0) / p[kept].sum()
    assert ((freq > 0) == kept).all(), (freq, kept)
    assert torch.allclose(freq, expected, atol=0.03)


def test_min_p_comes_before_top_p():
    # min_p=0.2 drops token 3 (0.05 < 0.1); top_p then works on (0.5, 0.3, 0.15)/0.95, where
    # token 2 starts at 0.842 > 0.82 and goes too. top_p first would have kept it (0.8 < 0.82).
    freq = empirical(PROBS.log(), 4000, min_p=0.2, top_p=0.82)
    assert (freq[2:] == 0).all()
    assert torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.03)


def test_min_p_leaves_greedy_and_logprobs_alone():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    plain = Sampler().sample(logits, [state(temperature=0.0, logprobs=5) for _ in range(3)])
    cut = Sampler().sample(logits, [state(temperature=0.0, logprobs=5, min_p=0.9) for _ in range(3)])
    assert plain == cut


# ---------------------------------------------------------------- min_tokens

def test_min_tokens_holds_back_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(10)
    logits[EOS], logits[5], logits[2] = 3.0, 2.0, 1.0   # EOS best, then stop token 5, then 2
    st = state(temperature=0.0, min_tokens=3, stop_token_ids=(5,), max_tokens=8, logprobs=10)
    got, eos_logprobs = [], []
    for _ in range(4):
        r = Sampler().sample(logits.unsqueeze(0), [st])[0]
        eos_logprobs.append(dict(r.logprob.top)[EOS])
        st.append(r.token_id)
        got.append(r.token_id)
    assert got == [2, 2, 2, EOS]
    expected = [-math.inf] * 3 + [log_softmax(logits.tolist())[EOS].item()]
    assert eos_logprobs[:3] == expected[:3] and math.isclose(eos_logprobs[3], expected[3], abs_tol=1e-5)
    # sampled rows too: 200 draws at step 0, none of them EOS or 5
    rows = [state(seed=i, min_tokens=1, stop_token_ids=(5,)) for i in range(200)]
    drawn = {r.token_id for r in Sampler().sample(logits.expand(200, -1), rows)}
    assert not drawn & {EOS, 5} and len(drawn) > 3


def test_min_tokens_with_ignore_eos_holds_back_only_stop_token_ids():
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, 5] = 3.0, 2.0
    st = state(temperature=0.0, min_tokens=2, stop_token_ids=(5,), ignore_eos=True)
    assert Sampler().sample(logits, [st])[0].token_id == EOS
    st = state(temperature=0.0, min_tokens=2, stop_token_ids=(EOS,), ignore_eos=True)
    assert Sampler().sample(logits, [st])[0].token_id == 5


def test_min_tokens_counts_the_token_prefill_sampled():
    """D builds a fresh state and appends P's first token: min_tokens=2 then leaves only
    one more step without EOS, as in one process."""
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 3.0
    p_side = state(temperature=0.0, min_tokens=2)
    first = Sampler().sample(logits, [p_side])[0].token_id
    d_side = state(temperature=0.0, min_tokens=2)
    d_side.append(first)
    second = Sampler().sample(logits, [d_side])[0].token_id
    d_side.append(second)
    assert first != EOS and second != EOS
    assert Sampler().sample(logits, [d_side])[0].token_id == EOS


# ---------------------------------------------------------------- repetition_penalty

def repetition(values: list[float], seen: set[int], penalty: float) -> list[float]:
    return [(v / penalty if v > 0 else v * penalty) if t in seen else v for t, v in enumerate(values)]


@pytest.mark.parametrize("penalty", [1.3, 2.0, 0.5])
def test_repetition_penalty_over_prompt_and_output(penalty):
    logits = torch.tensor([1.0, -1.0, 2.0, -0.5, 0.7, 0.0, 3.0, -2.0, 0.4, 1.2])
    st = state(prompt=(1, 2, 2), temperature=0.0, repetition_penalty=penalty, logprobs=10)
    for tok in (4, 7, 4):
        st.append(tok)
    expected = repetition(logits.tolist(), {1, 2, 4, 7}, penalty)
    assert close(adjusted(logits, st), log_softmax(expected))


def test_bias_then_suppression_then_repetition_then_presence_and_frequency():
    """vLLM's order: logit_bias, min_tokens, then repetition, frequency, presence."""
    logits = torch.tensor([1.0, -1.0, 2.0, -0.5, 0.7, 0.0, 3.0, -2.0, 0.4, 1.2])
    st = state(prompt=(1, 3), temperature=0.0, repetition_penalty=1.5, presence_penalty=0.4,
               frequency_penalty=0.3, logit_bias=((1, 2.0), (3, 1.0), (6, -5.0), (8, 1.0)),
               min_tokens=5, max_tokens=9, stop_token_ids=(9,), logprobs=10)
    for tok in (6, 8, 6):
        st.append(tok)
    values = logits.tolist()
    for tok, b in st.params.logit_bias:
        values[tok] += b
    values[EOS] = values[9] = -math.inf
    values = repetition(values, {1, 3, 6, 8}, 1.5)
    for tok, n in Counter([6, 8, 6]).items():
        values[tok] -= 0.4 + 0.3 * n
    assert close(adjusted(logits, st), log_softmax(values))


def test_repetition_penalty_breaks_a_greedy_loop_and_resumes_across_workers():
    logits = torch.zeros(1, 8)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, 1.5, 1.2
    params = dict(temperature=0.0, repetition_penalty=2.0)
    # a seen token's logit is halved once: 3 (-> 1.0), 4 (1.5 > 1.0; -> 0.75), 5 (1.2 > 1.0; -> 0.6), 3
    st = state(prompt=(0,), **params)
    whole = []
    for _ in range(4):
        tok = Sampler().sample(logits, [st])[0].token_id
        st.append(tok)
        whole.append(tok)
    assert whole == [3, 4, 5, 3]
    d = state(prompt=(0,), **params)
    d.append(whole[0])
    rest = []
    for _ in range(3):
        tok = Sampler().sample(logits, [d])[0].token_id
        d.append(tok)
        rest.append(tok)
    assert [whole[0]] + rest == whole


# ---------------------------------------------------------------- all knobs together

KNOBS = dict(logit_bias=((3, 1.0), (9, -2.0)), min_p=0.05, min_tokens=3, repetition_penalty=1.4,
             presence_penalty=0.2, frequency_penalty=0.1, stop_token_ids=(11,), max_tokens=12)


def test_all_knobs_leave_the_input_alone_and_keep_batch_independence():
    steps = [torch.randn(1, 40, generator=torch.Generator().manual_seed(s)) * 2 for s in range(8)]
    params = dict(temperature=0.9, top_p=0.95, top_k=30, seed=5, **KNOBS)
    alone_state = state(**params)
    alone = []
    for x in steps:
        before = x.clone()
        tok = Sampler().sample(x, [alone_state])[0].token_id
        assert torch.equal(x, before)
        alone_state.append(tok)
        alone.append(tok)
    others = [state(temperature=0.0, logit_bias=((1, 5.0),)), state(seed=1, min_p=0.3, repetition_penalty=0.7)]
    batch = [others[0], state(**params), others[1]]
    got = []
    for i, x in enumerate(steps):
        noise = torch.randn(2, 40, generator=torch.Generator().manual_seed(100 + i))
        results = Sampler().sample(torch.cat([noise[:1], x, noise[1:]]), batch)
        for st, r in zip(batch, results):
            st.append(r.token_id)
        got.append(results[1].token_id)
    assert got == alone
    assert not {EOS, 11} & set(alone[:3])


@pytest.mark.parametrize("kw, param", [
    (dict(min_p=5.0), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p=float("nan")), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=2.5), "repetition_penalty"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(logit_bias=((1, -101.0),)), "logit_bias"), (dict(n=0), "n"), (dict(logprobs=21), "logprobs"),
])
def test_invalid_knobs_are_rejected(kw, param):
    with pytest.raises(RequestRejected) as err:
        state(**kw)
    assert err.value.param == param


def test_wire_sampling_carries_every_knob():
    p = SamplingParams(**{**KNOBS, "max_tokens": 9, "temperature": 0.5, "logprobs": 20, "seed": 4})
    back = WireSampling.model_validate_json(WireSampling.of(p).model_dump_json()).params()
    assert back == p


# ---------------------------------------------------------------- over HTTP

A, B, C = 2000, 3000, 1000            # ordinary tokens of the default tokenizer
EOS_ID = 2                           # the tiny model's <|im_end|>
ID_PROMPT = [A, 4000, 5000, 6000]    # holds A, not B or C


def cases(piece) -> list[tuple[dict, object]]:
    """(request body, check of the JSON answer) for /v1/completions, every check passing
    only if the prefill worker (token 0) and the decode worker (tokens 1+) honour the knob."""
    greedy = {"prompt": ID_PROMPT, "temperature": 0, "logprobs": 0}

    def tokens(*ids):
        return lambda r: r["choices"][0]["logprobs"]["tokens"] == [piece(i) for i in ids]

    def usage(n, finish):
        return lambda r: (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (n, finish)

    # bias A:80 B:60 C:50 and A already in the prompt; repetition_penalty 2 halves each
    # positive logit once its token was seen: B (60 vs A's 40), C (50 vs 40, B 30), then A.
    chain = {**greedy, "max_tokens": 5, "logit_bias": {str(A): 80, str(B): 60, str(C): 50}}
    return [
        ({**greedy, "max_tokens": 4, "logit_bias": {str(B): 100}}, tokens(B, B, B, B)),
        (chain, tokens(A, A, A, A, A)),
        ({**chain, "repetition_penalty": 2.0}, tokens(B, C, A, A, A)),
        ({**greedy, "max_tokens": 10, "logit_bias": {str(EOS_ID): 100}}, usage(1, "stop")),
        ({**greedy, "max_tokens": 10, "logit_bias": {str(EOS_ID): 100}, "min_tokens": 4}, usage(5, "stop")),
        ({**greedy, "max_tokens": 10, "logit_bias": {str(A): 100}, "stop_token_ids": [A], "min_tokens": 3},
         usage(4, "stop")),
    ]


_MIN_P_BASE = {"prompt": "The quick brown fox", "max_tokens": 6, "logprobs": 0, "ignore_eos": True}
# temperature 1 with min_p=1 keeps only the best token: the greedy answer, on both workers
# (a free draw from the tiny model's nearly flat distribution is another answer)
MIN_P = {"greedy": {**_MIN_P_BASE, "temperature": 0}, "cut": {**_MIN_P_BASE, "temperature": 1.0, "seed": 3, "min_p": 1.0},
         "free": {**_MIN_P_BASE, "temperature": 1.0, "seed": 3}}


def check_min_p(answers: dict) -> None:
    got = {name: a["choices"][0]["logprobs"]["tokens"] for name, a in answers.items()}
    assert got["cut"] == got["greedy"] != got["free"], got


INVALID = [  # (path, body, param)
    ("/v1/completions", {"min_p": 5.0}, "min_p"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"49152": 1}}, "logit_bias"),      # past the vocabulary
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": "x"}}, "logit_bias"),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/chat/completions", {"min_p": 5.0}, "min_p"),
    ("/v1/chat/completions", {"logit_bias": {"1": -100.5}}, "logit_bias"),
    ("/v1/chat/completions", {"min_tokens": 3, "max_completion_tokens": 2}, "min_tokens"),
]


def invalid_body(path: str, extra: dict) -> dict:
    if path == "/v1/completions":
        return {"prompt": "hi", "max_tokens": 2, **extra}
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def check_invalid(status: int, body: dict, param: str) -> None:
    assert status == 400, body
    assert body["error"]["param"] == param, body


@asynccontextmanager
async def api(engine):
    transport = httpx.ASGITransport(build_openai_app(engine), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvrelay", timeout=60) as c:
        yield c


@pytest.mark.anyio
async def test_colocated_http_honours_every_knob(tiny_engine, tiny_loaded):
    piece = lambda i: tiny_loaded.tokenizer.decode([i])   # noqa: E731
    async with api(tiny_engine) as c:
        async def post(body, path="/v1/completions"):
            r = await c.post(path, json=body)
            assert r.status_code == 200, r.text
            return r.json()

        for body, check in cases(piece):
            answer = await post(body)
            assert check(answer), (body, answer["choices"][0], answer["usage"])
        check_min_p({name: await post(body) for name, body in MIN_P.items()})
        chat = await post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
                           "top_logprobs": 20}, "/v1/chat/completions")
        assert all(len(e["top_logprobs"]) == 20 for e in chat["choices"][0]["logprobs"]["content"])
        for path, extra, param in INVALID:
            r = await c.post(path, json=invalid_body(path, extra))
            check_invalid(r.status_code, r.json(), param)
    tiny_engine.check_idle()


@pytest.mark.anyio
async def test_presence_and_frequency_penalties_break_a_models_repetition(tiny_engine):
    """The tiny random model repeats itself greedily; each penalty changes that answer."""
    base = {"prompt": "Hello, my name is", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    async with api(tiny_engine) as c:
        async def tokens(**extra):
            r = await c.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["tokens"]

        plain = await tokens()
        assert max(Counter(plain).values()) >= 4          # the loop the penalties must break
        for knob in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = 1.5 if knob == "repetition_penalty" else 2.0
            got = await tokens(**{knob: value})
            assert got != plain and max(Counter(got).values()) < max(Counter(plain).values()), knob
            if knob != "repetition_penalty":   # it also counts the prompt; these two only the output
                assert got[0] == plain[0]
    tiny_engine.check_idle()


def test_disaggregated_cluster_applies_the_knobs_on_prefill_and_decode(tiny_llama_dir, tiny_loaded):
    piece = lambda i: tiny_loaded.tokenizer.decode([i])   # noqa: E731
    cluster = Cluster(["--model", f"random:{tiny_llama_dir}"], ["--dtype", "float32", "--max-kv-tokens", "4096"],
                      num_prefill=1, num_decode=1)
    try:
        cluster.start()
        with httpx.Client(base_url=cluster.url, timeout=120) as client:
            def post(body, path="/v1/completions"):
                r = client.post(path, json=body)
                assert r.status_code == 200, r.text
                return r.json()

            for body, check in cases(piece):
                answer = post(body)
                assert check(answer), (body, answer["choices"][0], answer["usage"])
            check_min_p({name: post(body) for name, body in MIN_P.items()})
            for path, extra, param in INVALID:
                r = client.post(path, json=invalid_body(path, extra))
                check_invalid(r.status_code, r.json(), param)
        cluster.assert_no_leak()
    finally:
        cluster.stop()
