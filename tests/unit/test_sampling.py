import numpy as np
import pytest

from engine.runtime.sampling import SamplingParams, allowed_mask, apply_penalties, make_rngs, nucleus, sample

VOCAB = 64


@pytest.fixture
def logits() -> np.ndarray:
    # random, non-zero, no ties: a peaked but not degenerate distribution
    g = np.random.default_rng(1234)
    return (g.standard_normal(VOCAB) * 2.0).astype(np.float32)


def _probs(x: np.ndarray, t: float = 1.0) -> np.ndarray:
    p = np.exp((x - x.max()) / t)
    return p / p.sum()


def _draws(logits, params, n, seed=0):
    rng = make_rngs(seed)[0]
    return np.array([sample(logits, params, [], rng)[0] for _ in range(n)])


def test_greedy_is_argmax(logits):
    for _ in range(5):
        tok, lp, top = sample(logits, SamplingParams(temperature=0.0), [], make_rngs(None)[0])
        assert tok == int(np.argmax(logits))
        assert lp is None and top is None


def test_top_k_never_leaves_allowed_set(logits):
    k = 5
    allowed = set(np.argsort(-logits)[:k].tolist())
    draws = _draws(logits, SamplingParams(temperature=1.5, top_k=k), 2000)
    assert set(draws.tolist()) <= allowed
    assert len(set(draws.tolist())) == k  # and every allowed token does show up


def test_top_p_never_leaves_nucleus(logits):
    t, top_p = 1.3, 0.6
    p = _probs(logits.astype(np.float64), t)
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    nucleus = set(order[: int(np.searchsorted(cum, top_p)) + 1].tolist())
    assert 1 < len(nucleus) < VOCAB
    draws = _draws(logits, SamplingParams(temperature=t, top_p=top_p), 2000)
    assert set(draws.tolist()) <= nucleus


def test_min_p_never_returns_improbable_tokens(logits):
    t, min_p = 1.0, 0.1
    p = _probs(logits.astype(np.float64), t)
    allowed = set(np.flatnonzero(p >= min_p * p.max()).tolist())
    assert 1 < len(allowed) < VOCAB
    draws = _draws(logits, SamplingParams(temperature=t, min_p=min_p), 2000)
    assert set(draws.tolist()) <= allowed


def test_combined_truncation_is_intersection(logits):
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05)
    mask = allowed_mask(logits.astype(np.float64), params)
    draws = _draws(logits, params, 1000)
    assert all(mask[d] for d in draws)
    assert mask.sum() <= 10


def test_seed_determinism(logits):
    params = SamplingParams(temperature=1.0, top_p=0.95)
    a = _draws(logits, params, 200, seed=42)
    b = _draws(logits, params, 200, seed=42)
    c = _draws(logits, params, 200, seed=43)
    assert (a == b).all()
    assert (a != c).any()


def test_choice_streams_do_not_depend_on_n(logits):
    params = SamplingParams(temperature=1.0)
    one = make_rngs(7, 1)[0]
    three = make_rngs(7, 3)
    a = [sample(logits, params, [], one)[0] for _ in range(50)]
    b = [sample(logits, params, [], three[0])[0] for _ in range(50)]
    c = [sample(logits, params, [], three[1])[0] for _ in range(50)]
    assert a == b and a != c


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_temperature_distribution(logits, temperature):
    n = 20000
    draws = _draws(logits, SamplingParams(temperature=temperature), n, seed=5)
    expected = _probs(logits.astype(np.float64), temperature) * n
    observed = np.bincount(draws, minlength=VOCAB)
    # pool the rare tokens so the chi-square approximation holds (expected >= 5 per cell)
    big = expected >= 5
    exp_cells = np.append(expected[big], expected[~big].sum())
    obs_cells = np.append(observed[big], observed[~big].sum())
    chi2 = float(((obs_cells - exp_cells) ** 2 / np.maximum(exp_cells, 1e-9)).sum())
    dof = len(exp_cells) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10  # generous: ~6 sigma


def test_penalties_shift_the_right_logits(logits):
    generated = [3, 3, 3, 10, 20, 20]
    out = apply_penalties(logits, generated, presence=0.5, frequency=0.25)
    diff = logits.astype(np.float64) - out
    assert diff[3] == pytest.approx(0.5 + 3 * 0.25)
    assert diff[10] == pytest.approx(0.5 + 1 * 0.25)
    assert diff[20] == pytest.approx(0.5 + 2 * 0.25)
    others = np.setdiff1d(np.arange(VOCAB), [3, 10, 20])
    assert np.all(diff[others] == 0)
    # negative penalties encourage repetition
    out = apply_penalties(logits, [7], presence=-1.0, frequency=0.0)
    assert out[7] - logits[7] == pytest.approx(1.0)


def test_penalty_changes_greedy_choice(logits):
    best = int(np.argmax(logits))
    gap = float(np.sort(logits)[-1] - np.sort(logits)[-2])
    repeats = int(np.ceil(gap / 2.0)) + 1  # frequency 2.0 per occurrence outweighs the gap
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    tok, _, _ = sample(logits, params, [best] * repeats, make_rngs(0)[0])
    assert tok == int(np.argsort(-logits)[1])


def test_logprobs_are_model_distribution(logits):
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3, presence_penalty=1.0)
    tok, lp, top = sample(logits, params, [5], make_rngs(0)[0])
    ref = np.log(_probs(logits.astype(np.float64)))
    assert lp == pytest.approx(ref[tok])
    assert [t for t, _ in top] == np.argsort(-ref)[:3].tolist()
    assert [v for _, v in top] == pytest.approx(np.sort(ref)[::-1][:3].tolist())
    assert sum(np.exp(v) for _, v in top) < 1.0


def test_logit_bias_bans_and_forces(logits):
    best = int(np.argmax(logits))
    tok, _, _ = sample(logits, SamplingParams(temperature=0.0, logit_bias=((best, -100.0),)), [], make_rngs(0)[0])
    assert tok != best
    draws = _draws(logits, SamplingParams(temperature=1.0, logit_bias=((9, 100.0),)), 50)
    assert (draws == 9).all()


# ---- the partial nucleus sort and the allowed-ids CDF give what the full-vocabulary ones give ----


def _full_cdf_token(x: np.ndarray, mask: np.ndarray, t: float, u: float) -> int:
    """The draw by definition: inverse CDF over the whole vocabulary, zeros where not allowed."""
    scaled = np.where(mask, x / t, -np.inf)
    cum = np.cumsum(np.exp(scaled - np.max(scaled)))
    tok = min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(cum) - 1)
    return tok if mask[tok] else int(np.flatnonzero(mask)[-1])


@pytest.mark.parametrize("vocab", [50, 5000, 129280])
def test_nucleus_equals_a_full_sort(vocab):
    g = np.random.default_rng(vocab)
    for trial in range(12):
        x = g.standard_normal(vocab) * g.uniform(0.5, 6.0)
        if trial % 3 == 0:
            x = np.round(x * 2) / 2  # many exact ties, the nucleus boundary among them
        p = np.exp(x - x.max())
        p /= p.sum()
        for top_p in (0.05, 0.5, 0.9, 0.999, 0.9999999):
            full = nucleus(p, top_p, first=vocab)
            for first in (1, 4, 1024):  # from a tiny first guess the widening is exercised too
                assert np.array_equal(nucleus(p, top_p, first=first), full), (trial, top_p, first)


def test_sample_equals_the_full_vocabulary_draw():
    g = np.random.default_rng(7)
    vocab = 3000
    cases = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_p=0.9),
             SamplingParams(temperature=0.7, top_k=40), SamplingParams(temperature=1.0, min_p=0.05),
             SamplingParams(temperature=0.9, top_k=200, top_p=0.8, min_p=0.01)]
    for i in range(40):
        x = (g.standard_normal(vocab) * 3).astype(np.float32)
        x[g.integers(0, vocab, 20)] = -np.inf  # banned ids (e.g. a -100 logit_bias pushed to -inf)
        if i % 4 == 0:
            x = np.round(x)
        for params in cases:
            rng_a, rng_b = make_rngs(i)[0], make_rngs(i)[0]
            tok = sample(x, params, [], rng_a)[0]
            x64 = np.asarray(x, dtype=np.float64)
            want = _full_cdf_token(x64, allowed_mask(x64, params), params.temperature, rng_b.random())
            assert tok == want, (i, params)


def test_rows_sampled_on_threads_draw_what_one_thread_draws():
    """engine.runtime.sampling.sample_batch samples a large-vocabulary batch on several threads; every
    job's own generator keeps its tokens what sequential sampling gives."""
    from engine.runtime.sampling import PARALLEL_SAMPLE_VOCAB, SampleJob, sample_batch

    g = np.random.default_rng(3)
    logits = (g.standard_normal((12, PARALLEL_SAMPLE_VOCAB * 2)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_k=30, logprobs=True, top_logprobs=3)]

    def jobs():
        return [SampleJob(11 - i, params[i % 3], [1, 2, i], make_rngs(100 + i)[0]) for i in range(12)]

    for _ in range(3):
        seq = [sample(logits[j.row], j.params, j.generated, j.rng) for j in jobs()]
        assert sample_batch(logits, jobs()) == seq


def test_logit_deltas_merge_penalties_and_bias_per_id():
    """One delta per id: the penalties of an id that also has a bias add up with it; bias ids
    outside the vocabulary are dropped; no penalties without earlier tokens."""
    from engine.runtime.sampling import logit_deltas

    ids, vals = logit_deltas([4, 4, 9], 0.5, 0.25, ((4, 2.0), (7, -1.0), (50, 3.0), (-1, 1.0)), 10)
    assert ids.tolist() == [4, 7, 9]
    assert np.allclose(vals, [-(2 * 0.25 + 0.5) + 2.0, -1.0, -(0.25 + 0.5)])
    ids, vals = logit_deltas([], 0.5, 0.25, (), 10)
    assert ids.size == 0 and vals.size == 0
    want = np.arange(10, dtype=np.float64)
    want[4] -= 2 * 0.25 + 0.5
    want[9] -= 0.25 + 0.5
    assert np.allclose(apply_penalties(np.arange(10, dtype=np.float32), [4, 4, 9], 0.5, 0.25), want)
