"""The on-device sampler: filters, penalties, bias, banned ids, seeds, logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiln.engine import sampling
from kiln.engine.params import SamplingParams
from kiln.engine.sampling import RowSampling, sample
from kiln.errors import InvalidRequest

V = 12


def rows(S, **over):
    base = dict(
        temperature=np.ones(S, np.float32), top_k=np.zeros(S, np.int32), top_p=np.ones(S, np.float32),
        min_p=np.zeros(S, np.float32), presence=np.zeros(S, np.float32), frequency=np.zeros(S, np.float32),
        repetition=np.ones(S, np.float32), seed=np.zeros((S, 2), np.uint32), step=np.zeros(S, np.int32),
        top_logprobs=np.ones(S, bool), adjust_ids=np.full((S, 1), V, np.int32),
        adjust_values=np.zeros((S, 1), np.float32), history=np.full((S, 4), V, np.int32),
        prompt_len=np.zeros(S, np.int32), constrained=np.zeros(S, bool), allowed=np.full((S, 1), -1, np.int32),
    )
    base.update({k: np.asarray(v) for k, v in over.items()})
    return RowSampling(**base)


LOGITS = jnp.asarray(np.log(np.array([[0.4, 0.25, 0.15, 0.1, 0.05, 0.05] + [1e-9] * 6], np.float32)))


def draw(rs, n=400, logits=LOGITS):
    fn = jax.jit(lambda rs: sample(jnp.repeat(logits, n, 0), rs).tokens)
    return np.asarray(fn(rs))


def test_grammar_mask_comes_before_every_sampling_parameter():
    # row 0 may only produce tokens 3 and 5; a strong bias towards 0 cannot bring 0 back, and
    # the reported logprob is the raw model's. Row 1 is unconstrained (all bits set).
    allowed = np.zeros((2, 1), np.int32)
    allowed[0, 0] = (1 << 3) | (1 << 5)
    allowed[1, 0] = -1
    rs = rows(2, temperature=[0.0, 0.0], adjust_ids=[[0], [0]], adjust_values=[[50.0], [0.0]], allowed=allowed,
              constrained=[True, False])
    out = sample(LOGITS.repeat(2, 0), rs)
    assert out.tokens.tolist() == [3, 0]
    np.testing.assert_allclose(float(out.logprobs[0]), np.log(0.1), rtol=1e-5)
    seeds = np.stack([np.arange(400), np.zeros(400)], 1).astype(np.uint32)
    sampled = draw(rows(400, top_k=[3] * 400, seed=seeds, allowed=np.tile(allowed[:1], (400, 1)),
                        constrained=np.ones(400, bool)))
    assert set(sampled.tolist()) <= {3, 5} and len(set(sampled.tolist())) == 2


def test_greedy_and_logprobs():
    out = sample(LOGITS, rows(1, temperature=[0.0]))
    assert int(out.tokens[0]) == 0
    np.testing.assert_allclose(float(out.logprobs[0]), np.log(0.4), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out.top_logprobs[0, :3]), np.log([0.4, 0.25, 0.15]), rtol=1e-5)
    assert out.top_ids[0, :3].tolist() == [0, 1, 2]


def test_filters_restrict_support():
    n = 400
    seeds = np.stack([np.arange(n), np.zeros(n)], 1).astype(np.uint32)
    base = dict(seed=seeds, step=np.zeros(n, np.int32))
    full = draw(rows(n, **base))
    assert set(full.tolist()) >= {0, 1, 2, 3}
    assert set(draw(rows(n, top_k=np.full(n, 2), **base)).tolist()) == {0, 1}
    assert set(draw(rows(n, top_p=np.full(n, 0.6), **base)).tolist()) == {0, 1}  # 0.4 + 0.25 reaches 0.6
    assert set(draw(rows(n, min_p=np.full(n, 0.5), **base)).tolist()) == {0, 1}  # p >= 0.2
    freq = np.bincount(full, minlength=V) / n
    assert abs(freq[0] - 0.4) < 0.08 and abs(freq[1] - 0.25) < 0.08


def reference_keep(x, top_k, top_p, min_p):
    """The filters by their definition: a full sort of each row, masses in float64."""
    keep = np.ones(x.shape, bool)
    for i, row in enumerate(x.astype(np.float64)):
        desc = np.sort(row)[::-1]
        if 0 < top_k[i] < len(row):
            keep[i] &= row >= desc[top_k[i] - 1]
        if top_p[i] < 1.0:
            p = np.exp(desc - np.logaddexp.reduce(desc))
            keep[i] &= row >= desc[np.sum(np.cumsum(p) - p < top_p[i]) - 1]  # the token that reaches top_p stays
        if min_p[i] > 0:
            keep[i] &= row >= desc[0] + np.log(min_p[i])
    return keep


@pytest.mark.parametrize("searched", [False, True])
def test_filters_without_a_sort_keep_what_a_sort_keeps(searched):
    # 300 tokens, ties among the largest, a row with banned (-inf) tokens. Peaked rows with small
    # top-k read their cuts off the largest CANDIDATES logits; a larger top-k or a flat row's top-p
    # makes the batch search that filter's cuts.
    rng = np.random.default_rng(7)
    S, n = 16, 300
    x = rng.standard_normal((S, n)).astype(np.float32) * (0.3 if searched else 1.0)
    x[:, :30] += 0 if searched else rng.uniform(6, 9, (S, 30)).astype(np.float32)
    x[:, 5:10] = x[:, :5]
    x[3, 100:200] = -np.inf
    top_k = rng.choice([0, 1, 3, 40, 64] + ([65, 250, n, n + 9] if searched else []), S)
    top_p = rng.choice([0.05, 0.5, 0.9, 0.99, 1.0], S).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.02], S).astype(np.float32)
    top = -np.sort(-x, axis=1)[:, :sampling.CANDIDATES]
    mass = np.exp(top - np.logaddexp.reduce(x.astype(np.float64), axis=1, keepdims=True)).sum(1)
    within = (top_k <= sampling.CANDIDATES) & ((top_p >= 1.0) | (mass >= top_p))
    assert within.all() != searched
    rs = rows(S, top_k=top_k, top_p=top_p, min_p=min_p)
    kept = np.asarray(jax.jit(sampling._filter)(jnp.asarray(x), rs)) > -np.inf
    np.testing.assert_array_equal(kept, reference_keep(x, top_k, top_p, min_p))


def test_the_compiled_sampler_sorts_nothing():
    # XLA lowers lax.top_k through a sort that a later pass matches back to a top-k call; a slice of
    # its values merged into that sort's slice undoes the match, and the vocabulary is sorted at
    # every step (300 ms for 32 rows of the default model)
    n = 300
    rs = rows(4, top_k=[0, 5, 0, 0], top_p=[0.9, 1.0, 1.0, 0.5], min_p=[0.0, 0.0, 0.1, 0.0],
              adjust_ids=np.full((4, 1), n, np.int32))
    ops = jax.jit(sample).lower(jnp.zeros((4, n)), rs).compile().as_text()
    assert " sort(" not in ops and ops.count('custom_call_target="TopK"') == 2  # the cuts' and top logprobs'


def test_seed_and_step_make_draws_reproducible():
    n = 64
    seeds = np.stack([np.arange(n), np.zeros(n)], 1).astype(np.uint32)
    a = draw(rows(n, seed=seeds), n=n)
    b = draw(rows(n, seed=seeds), n=n)
    c = draw(rows(n, seed=seeds, step=np.ones(n, np.int32)), n=n)
    assert (a == b).all() and (a != c).any()


def test_bias_banned_and_penalties():
    g = dict(temperature=[0.0])
    assert int(sample(LOGITS, rows(1, adjust_ids=[[7]], adjust_values=[[100.0]], **g)).tokens[0]) == 7
    assert int(sample(LOGITS, rows(1, adjust_ids=[[0]], adjust_values=[[-np.inf]], **g)).tokens[0]) == 1
    # token 0 already generated twice: a frequency penalty of 1 lowers its logit by 2
    out_ids = [[0, 0, V, V]]
    assert int(sample(LOGITS, rows(1, history=out_ids, frequency=[1.0], **g)).tokens[0]) == 1
    assert int(sample(LOGITS, rows(1, history=out_ids, presence=[0.2], **g)).tokens[0]) == 0
    # prompt tokens are no output: frequency and presence penalties leave them alone
    assert int(sample(LOGITS, rows(1, history=out_ids, prompt_len=[2], frequency=[1.0], **g)).tokens[0]) == 0
    # repetition penalty divides positive / multiplies negative logits of seen tokens (prompt too)
    logits = jnp.asarray([[2.0, 1.5] + [-5.0] * (V - 2)])
    rs = rows(1, history=[[0, V, V, V]], prompt_len=[1], repetition=[2.0], **g)
    assert int(sample(logits, rs).tokens[0]) == 1


@pytest.mark.parametrize(
    "kwargs,param",
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"logprobs": 21}, "logprobs"), ({"logit_bias": {999: 1.0}}, "logit_bias"), ({"n": 0}, "n"),
     ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"stop": [""]}, "stop"),
     ({"repetition_penalty": 0}, "repetition_penalty"),
     ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
     ({"stop_token_ids": list(range(129))}, "stop_token_ids")],
)
def test_parameter_validation(kwargs, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs).validate(vocab_size=100)
    assert e.value.param == param
