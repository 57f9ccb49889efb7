"""Sampler: greedy, seeds, top-k/top-p, penalties, suppression, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from kvrelay.engine.sampling import Sampler, SamplingState, _truncate_rows, truncate
from kvrelay.engine.types import RequestRejected, SamplingParams

V = 64


def state(**kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), prompt_ids=[1, 2, 3])


def random_logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def run(sampler, logits_per_step, states):
    """Sample len(logits_per_step) steps, appending each token; return tokens per state."""
    out = [[] for _ in states]
    for logits in logits_per_step:
        for b, r in enumerate(sampler.sample(logits, states)):
            states[b].append(r.token_id)
            out[b].append(r.token_id)
    return out


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = random_logits(4)
    logits[3] = 0.0
    logits[3, [7, 9, 40]] = 5.0
    results = Sampler().sample(logits, [state(temperature=0.0) for _ in range(4)])
    expected = logits.argmax(dim=-1).tolist()
    expected[3] = 7
    assert [r.token_id for r in results] == expected
    assert all(r.logprob is None for r in results)


def test_sample_does_not_modify_logits():
    logits = random_logits(2)
    before = logits.clone()
    st = state(temperature=0.8, top_k=5, frequency_penalty=1.0, seed=1)
    st.append(3)
    st.suppress_tokens.add(4)
    Sampler().sample(logits, [st, state(temperature=0.0)])
    assert torch.equal(logits, before)


def test_same_seed_same_tokens_regardless_of_batch():
    steps = [random_logits(1, seed=s) for s in range(12)]
    params = dict(temperature=1.3, top_p=0.9, top_k=20, seed=1234)
    alone = run(Sampler(), steps, [state(**params)])[0]
    # the same request in row 2 of a batch with rows of other kinds
    batched_steps = [torch.cat([random_logits(2, seed=100 + i), x, random_logits(2, seed=200 + i)])
                     for i, x in enumerate(steps)]
    others = [state(temperature=0.0), state(temperature=0.7, seed=9),
              state(temperature=1.0, seed=5, presence_penalty=1.0), state(temperature=2.0, top_p=0.5)]
    states = others[:2] + [state(**params)] + others[2:]
    batched = run(Sampler(), batched_steps, states)[2]
    assert batched == alone
    assert len(set(alone)) > 1          # really random, not collapsed to greedy


def test_different_seeds_differ():
    steps = [torch.zeros(2, V) for _ in range(16)]
    a, b = run(Sampler(), steps, [state(seed=1), state(seed=2)])
    assert a != b


def test_seeded_sampling_resumes_on_another_worker():
    """Prefill samples step 0; decode builds a fresh state, appends that token, and
    continues with exactly the tokens a colocated run produces."""
    steps = [random_logits(1, seed=s) for s in range(8)]
    params = dict(temperature=1.0, seed=77, frequency_penalty=0.5)
    colocated = run(Sampler(), steps, [state(**params)])[0]
    first = run(Sampler(), steps[:1], [state(**params)])[0]
    decode_state = state(**params)
    decode_state.append(first[0])
    rest = run(Sampler(), steps[1:], [decode_state])[0]
    assert first + rest == colocated


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_are_greedy(kw):
    logits = random_logits(6, seed=3)
    logits[5] = 0.0
    logits[5, [11, 30]] = 2.0   # a tie: greedy takes the lower id
    states = [state(temperature=1.5, seed=i, **kw) for i in range(6)]
    got = [r.token_id for r in Sampler().sample(logits, states)]
    assert got == [r.token_id for r in Sampler().sample(logits, [state(temperature=0.0)] * 6)]


def empirical(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """Token frequencies of n one-step draws with seeds 0..n-1 (deterministic)."""
    states = [state(seed=i, **kw) for i in range(n)]
    tokens = [r.token_id for r in Sampler().sample(logits_row.expand(n, -1), states)]
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.shape[-1]).float() / n


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def test_distribution_matches_softmax():
    freq = empirical(PROBS.log(), 4000)
    assert torch.allclose(freq, PROBS, atol=0.03)


def test_temperature_sharpens_distribution():
    freq = empirical(PROBS.log(), 4000, temperature=0.5)
    expected = (PROBS.log() / 0.5).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.03)


@pytest.mark.parametrize("kw, support", [
    (dict(top_k=2), 2),
    (dict(top_p=0.75), 2),
    (dict(top_p=0.85), 3),
    (dict(top_k=2, top_p=0.5), 1),
])
def test_truncation_support_and_renormalisation(kw, support):
    freq = empirical(PROBS.log(), 4000, **kw)
    assert (freq[support:] == 0).all()
    kept = PROBS[:support] / PROBS[:support].sum()
    assert torch.allclose(freq[:support], kept, atol=0.03)


def test_penalties_follow_openai_formula():
    logits = torch.zeros(1, 5)
    st = state(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, logprobs=5)
    for tok in (0, 0, 0, 1):
        st.append(tok)
    assert st.counts == {0: 3, 1: 1}
    lp = Sampler().sample(logits, [st])[0].logprob
    adjusted = torch.tensor([-(0.5 + 0.25 * 3), -(0.5 + 0.25 * 1), 0.0, 0.0, 0.0])
    expected = adjusted.log_softmax(-1)
    got = dict(lp.top)
    assert all(math.isclose(got[t], expected[t].item(), abs_tol=1e-5) for t in range(5))
    assert lp.token_id == 2      # penalised tokens lose the tie


def test_penalties_ignore_prompt_and_steer_away_from_repeats():
    logits = torch.zeros(1, 4)
    logits[0, 0] = 1.0
    st = SamplingState(SamplingParams(temperature=0.0, frequency_penalty=0.6), prompt_ids=[1, 1, 2])
    tokens = run(Sampler(), [logits] * 6, [st])[0]
    # token 0 (logit 1) repeats until 1 - 0.6 * count drops below 0; the prompt's 1s and
    # 2 do not count; after one use each, 1..3 sit at -0.6 and token 0 at -0.2 wins again
    assert tokens == [0, 0, 1, 2, 3, 0]
    assert st.counts == {0: 3, 1: 1, 2: 1, 3: 1}
    assert st.output_ids == tokens


def test_negative_penalty_encourages_repeats():
    logits = torch.zeros(1, 4)
    logits[0, 3] = 0.5
    st = state(temperature=0.0, presence_penalty=-1.0)
    st.append(1)
    assert Sampler().sample(logits, [st])[0].token_id == 1


def test_suppressed_tokens_are_never_chosen():
    logits = random_logits(1, seed=4)
    best = logits.argmax().item()
    greedy = SamplingState(SamplingParams(temperature=0.0), [], suppress_tokens=[best])
    assert Sampler().sample(logits, [greedy])[0].token_id != best
    top3 = logits.topk(3).indices[0].tolist()
    sampled = [state(seed=i, top_k=2) for i in range(50)]
    for st in sampled:
        st.suppress_tokens.add(best)
    # suppression comes first: top_k=2 then keeps the 2nd and 3rd best
    assert {r.token_id for r in Sampler().sample(logits.expand(50, -1), sampled)} == set(top3[1:])


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_sorted_counted_and_normalised(k):
    logits = random_logits(3, seed=5, vocab=1000)
    states = [state(temperature=0.0, logprobs=k), state(seed=3, logprobs=k), state(seed=4)]
    results = Sampler().sample(logits, states)
    reference = logits.log_softmax(-1)
    assert math.isclose(torch.logsumexp(reference, -1)[0].item(), 0.0, abs_tol=1e-5)
    for b in range(2):
        lp = results[b].logprob
        assert lp.token_id == results[b].token_id
        assert math.isclose(lp.logprob, reference[b, lp.token_id].item(), abs_tol=1e-5)
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        if k:
            assert [t for t, _ in lp.top] == reference[b].topk(k).indices.tolist()
    if k:   # the greedy row's token is its own best alternative
        assert results[0].logprob.top[0] == (results[0].token_id, results[0].logprob.logprob)
    assert results[2].logprob is None


def test_full_vocab_logprobs_sum_to_one():
    logits = random_logits(1, seed=6, vocab=20)
    lp = Sampler().sample(logits, [state(seed=0, logprobs=20)])[0].logprob
    assert len(lp.top) == 20 and {t for t, _ in lp.top} == set(range(20))
    assert math.isclose(torch.logsumexp(torch.tensor([v for _, v in lp.top]), 0).item(), 0.0, abs_tol=1e-5)
    assert all(v <= 0.0 for _, v in lp.top)


def test_logprobs_are_taken_before_temperature_and_truncation():
    logits = random_logits(1, seed=7)
    plain = Sampler().sample(logits, [state(temperature=0.0, logprobs=3)])[0].logprob
    hot = Sampler().sample(logits, [state(temperature=0.3, top_k=1, top_p=0.1, logprobs=3)])[0].logprob
    assert hot == plain


def test_bfloat16_logits_are_accepted():
    logits = random_logits(2, seed=8).bfloat16()
    results = Sampler().sample(logits, [state(temperature=0.0), state(seed=1, logprobs=2)])
    assert results[0].token_id == logits.float().argmax(-1)[0].item()
    assert len(results[1].logprob.top) == 2


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(logprobs=21), "logprobs"),
])
def test_invalid_params_are_rejected(kw, param):
    with pytest.raises(RequestRejected) as err:
        state(**kw)
    assert err.value.param == param


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, V), [state()])


def test_truncation_candidate_search_matches_full_sort():
    """Rows settled from the best `width` logits keep exactly the set a full sort keeps,
    including rows that must fall back (wide nucleus, large top_k, ties at the edge)."""
    vocab, width = 3000, 256
    logits = random_logits(8, seed=9, vocab=vocab)
    logits[5] *= 0.01                       # flat: top_p=0.9 needs far more than `width`
    logits[6] = 0.0                         # all tied
    logits[7, 100:400] = 50.0               # a tie group straddling the edge
    top_k = [0, 5, 300, 0, 1, 0, 1, 0]
    top_p = [0.5, 1.0, 1.0, 0.99, 0.3, 0.9, 1.0, 0.001]
    fast = truncate(logits, top_k, top_p, width=width)
    slow = truncate(logits, top_k, top_p, width=vocab)
    assert torch.equal(fast.isfinite(), slow.isfinite())
    kept = fast.isfinite().sum(-1).tolist()
    assert kept[1] == 5 and kept[2] == 300 and kept[4] == 1
    assert kept[5] > width
    assert fast[6].isfinite().nonzero().flatten().tolist() == [0]
    assert fast[7].isfinite().nonzero().flatten().tolist() == [100]
    assert torch.equal(fast[fast.isfinite()], logits[fast.isfinite()])


def test_no_truncation_returns_input():
    logits = random_logits(2)
    assert truncate(logits, [0, 0], [1.0, 1.0]) is logits


def test_rows_cut_to_few_finite_logits_settle_from_the_candidates():
    """After min_p or suppression most of a row is -inf: a tie at -inf on the candidate
    edge must not send the row to the full sort, and the kept set is still exact."""
    vocab, width = 3000, 256
    logits = random_logits(3, seed=10, vocab=vocab)
    logits[:, 20:] = float("-inf")
    logits[2, :] = float("-inf")
    logits[2, 7] = 1.0
    top_k, top_p = [0, 5, 0], [0.9, 1.0, 0.5]
    out = logits.clone()
    assert _truncate_rows(out, [0, 1, 2], top_k, top_p, width) == []
    slow = truncate(logits, top_k, top_p, width=vocab)
    assert torch.equal(out.isfinite(), slow.isfinite())
    assert out[2].isfinite().nonzero().flatten().tolist() == [7]
