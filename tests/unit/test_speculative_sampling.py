"""The verify rule of speculative decoding (engine/runtime/speculative.py) against plain decoding.

Greedy: verify emits exactly the tokens plain greedy decoding emits. Sampled: a chi-square
goodness-of-fit test that the first emitted token, and the first two emitted tokens jointly, have
exactly plain decoding's distribution (test statistic and power: see _gof and test_power), and that
deliberately wrong rules fail that same test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.runtime import speculative
from engine.runtime.sampling import SamplingParams, make_rngs, sample
from engine.runtime.speculative import target_probs, verify, verify_trials

ALPHA = 1e-3  # significance of every goodness-of-fit test
N_DRAWS = 1_000_000  # draws per parameter set (vectorised: ~0.3 s each)
MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled into one


# --- chi-square tail (no scipy): regularized upper incomplete gamma Q(a, x) -----------------------

def _chi2_sf(stat: float, df: int) -> float:
    a, x = df / 2.0, stat / 2.0
    if x <= 0.0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:  # series for P(a, x)
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1.0
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    b, c, d = x + 1.0 - a, 1e300, 1.0 / (x + 1.0 - a)  # Lentz's continued fraction for Q(a, x)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h


def _chi2_crit(df: int, alpha: float = ALPHA) -> float:
    lo, hi = 0.0, df + 100.0 * math.sqrt(df) + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if _chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def _gof(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's chi-square test of counts against exact cell probabilities: (p-value, df). Cells of
    probability 0 must be empty (a token plain decoding never emits must never come out); cells
    expected fewer than MIN_EXPECTED times are pooled."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel()
    assert counts[probs <= 0.0].sum() == 0, "emitted a token plain decoding gives probability 0"
    n = counts.sum()
    exp = n * probs
    big = exp >= MIN_EXPECTED
    obs_c, exp_c = list(counts[big]), list(exp[big])
    small = (~big) & (probs > 0.0)
    if small.any():
        obs_c.append(counts[small].sum())
        exp_c.append(exp[small].sum())
    obs_a, exp_a = np.array(obs_c), np.array(exp_c)
    stat = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    df = len(exp_a) - 1
    return (_chi2_sf(stat, df) if df > 0 else 1.0), df


# --- a tiny "model": position-dependent logits and draft distributions ---------------------------

class Toy:
    """Main logits and draft distributions for vocab V over two positions: the main model's row at
    position 1 depends on the token at position 0 (L1[t0]), as does the draft's (Q1[t0])."""

    def __init__(self, vocab: int, seed: int, history: list[int]):
        g = np.random.default_rng(seed)
        self.v = vocab
        self.history = history
        self.l0 = (g.standard_normal(vocab) * 1.5).astype(np.float32)
        self.l1 = (g.standard_normal((vocab, vocab)) * 1.5).astype(np.float32)
        self.l2 = (g.standard_normal((vocab, vocab, vocab)) * 1.5).astype(np.float32)
        # draft distributions unlike the target, some with zeros (ids the draft never proposes)
        self.q0 = g.dirichlet(np.full(vocab, 0.7))
        self.q0[g.integers(vocab)] = 0.0
        self.q0 /= self.q0.sum()
        self.q1 = g.dirichlet(np.full(vocab, 0.7), size=vocab)


def _no_repeat_mask(vocab: int, last: int) -> np.ndarray:
    """A packed token mask (llguidance layout) allowing every id but `last` (a grammar whose state
    is the previous token)."""
    allowed = np.ones(((vocab + 31) // 32) * 32, dtype=bool)
    allowed[last] = False
    allowed[vocab:] = False
    return np.packbits(allowed, bitorder="little").view(np.int32)


def _masks_for(toy: Toy, use_mask: bool, prefix: list[int]):
    """Position i's mask given the tokens before it (history + drafts): a callable, as the runner
    may give it."""
    if not use_mask:
        return None
    return lambda i: _no_repeat_mask(toy.v, ([*toy.history, *prefix])[len(toy.history) + i - 1])


def _exact(toy: Toy, params: SamplingParams, use_mask: bool) -> np.ndarray:
    """Plain decoding's joint distribution of the first two tokens [V, V]."""
    m0 = _masks_for(toy, use_mask, [])
    p0 = target_probs(toy.l0, params, toy.history, m0(0) if m0 else None)
    joint = np.zeros((toy.v, toy.v))
    for t0 in range(toy.v):
        if p0[t0] > 0.0:
            m1 = _masks_for(toy, use_mask, [t0])
            joint[t0] = p0[t0] * target_probs(toy.l1[t0], params, [*toy.history, t0],
                                              m1(1) if m1 else None)
    return joint


def _inverse_cdf(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    return np.minimum(np.searchsorted(np.cumsum(p), u, side="right"), p.size - 1)


def _speculative_pairs(toy: Toy, params: SamplingParams, k: int, use_mask: bool, n: int,
                       seed: int, greedy_draft: bool = False) -> np.ndarray:
    """n draws of the first two emitted tokens [n, 2]: drafts drawn from the toy draft, one
    verify step of k drafts, then (when it emitted one token) a plain step for the second."""
    g = np.random.default_rng(seed)
    d0 = _inverse_cdf(toy.q0, g.random(n))
    d1 = np.zeros(n, dtype=np.int64)
    for t in range(toy.v):
        sel = d0 == t
        d1[sel] = _inverse_cdf(toy.q1[t], g.random(int(sel.sum())))
    if greedy_draft:  # a greedy draft proposes its argmax: a point mass
        d0[:] = int(np.argmax(toy.q0))
        d1 = np.argmax(toy.q1, axis=1)[d0]
    out = np.full((n, 2), -1, dtype=np.int64)
    for a in range(toy.v):
        for b in range(toy.v):
            rows = np.flatnonzero((d0 == a) & (d1 == b))
            if rows.size == 0:
                continue
            drafts = [a, b][:k]
            logits = np.stack([toy.l0, toy.l1[a], toy.l2[a, b]][: k + 1])
            q = None if greedy_draft else np.stack([toy.q0, toy.q1[a]][:k])
            tokens, _ = verify_trials(logits, drafts, q, params, toy.history,
                                      g.random((rows.size, k + 1)), _masks_for(toy, use_mask, drafts))
            out[rows] = tokens[:, :2]
    for t0 in range(toy.v):  # one token emitted: the next step is a plain one, drawn from p
        rows = np.flatnonzero((out[:, 1] < 0) & (out[:, 0] == t0))
        if rows.size:
            m1 = _masks_for(toy, use_mask, [t0])
            p1 = target_probs(toy.l1[t0], params, [*toy.history, t0], m1(1) if m1 else None)
            out[rows, 1] = _inverse_cdf(p1, g.random(rows.size))
    return out


def _fit(toy: Toy, params: SamplingParams, k: int, use_mask: bool, seed: int = 7,
         n: int = N_DRAWS, greedy_draft: bool = False) -> tuple[float, float]:
    """p-values of the first token's and the first two tokens' distributions against plain's."""
    pairs = _speculative_pairs(toy, params, k, use_mask, n, seed, greedy_draft)
    exact = _exact(toy, params, use_mask)
    joint = np.zeros((toy.v, toy.v))
    np.add.at(joint, (pairs[:, 0], pairs[:, 1]), 1.0)
    return _gof(joint.sum(1), exact.sum(1))[0], _gof(joint, exact)[0]


HISTORY = [1, 1, 3, 0, 5]
CASES = {  # name: (params, k, mask)
    "t1.0": (SamplingParams(temperature=1.0), 2, False),
    "t0.7-topk4": (SamplingParams(temperature=0.7, top_k=4), 2, False),
    "t1.3-topp0.8": (SamplingParams(temperature=1.3, top_p=0.8), 2, False),
    "t1.0-minp0.15": (SamplingParams(temperature=1.0, min_p=0.15), 1, False),
    "penalties": (SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6), 2,
                  False),
    "penalties-bias-topk-topp": (SamplingParams(temperature=0.9, top_k=5, top_p=0.9, presence_penalty=
                                                1.2, frequency_penalty=-0.4, logit_bias=((2, 1.5),)),
                                 2, False),
    "mask-penalties": (SamplingParams(temperature=1.1, frequency_penalty=0.9), 2, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_speculative_draws_plain_distribution(name):
    """Pearson chi-square goodness of fit at alpha = 1e-3 of N_DRAWS = 1M speculative draws (random
    draft distributions, drafts drawn from them, k = 1 or 2, vocabulary 8) against plain decoding's
    exact distribution: of the first emitted token (up to 7 df) and of the first two jointly (up to
    63 df; the second token follows a kept draft, a rejection's residual, or a plain step, under
    penalties counting the first). Power (test_power), in the least detectable direction: a
    deviation of total variation 0.01 is detected with probability > 0.9999 (both tests); of total
    variation 0.005 with probability >= 0.995 (joint, 63 df) and > 0.9999 (first token, 7 df).
    Fixed seeds keep the test deterministic; alpha is the chance a correct rule fails under a fresh
    seed."""
    params, k, use_mask = CASES[name]
    toy = Toy(8, seed=sorted(CASES).index(name), history=HISTORY)
    p_first, p_joint = _fit(toy, params, k, use_mask)
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_greedy_draft_with_sampled_params():
    """A greedy draft (draft_probs None, a point mass) under sampled params: the same distribution."""
    toy = Toy(6, seed=11, history=HISTORY)
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5)
    p_first, p_joint = _fit(toy, params, 2, False, greedy_draft=True)
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_power():
    """The power the docstrings state, for N_DRAWS and ALPHA. A deviation d of the cell probabilities
    p with total variation sum|d|/2 = delta gives Pearson's statistic a noncentral chi-square with
    noncentrality lambda = N sum d^2 / p >= N (sum|d|)^2 = 4 N delta^2 (Cauchy-Schwarz, sum p = 1):
    the least detectable direction. Power = P(chi2'(df, lambda) > chi2 critical value), by
    simulation of the noncentral chi-square."""
    g = np.random.default_rng(0)
    for df, tv, claimed in ((63, 0.01, 0.9999), (7, 0.01, 0.9999), (63, 0.005, 0.995),
                            (7, 0.005, 0.9999)):
        lam = 4 * N_DRAWS * tv**2
        power = float((g.noncentral_chisquare(df, lam, 400_000) > _chi2_crit(df)).mean())
        assert power >= claimed, (df, tv, power)
    # and the tail function itself: chi2(1) at 3.841 is 0.05, chi2(63) at its 1e-3 critical value
    assert abs(_chi2_sf(3.841458820694124, 1) - 0.05) < 1e-9
    assert abs(_chi2_sf(_chi2_crit(63), 63) - ALPHA) < 1e-9


WRONG = {
    # keep every draft: the draft's distribution leaks through
    "keep-always": ("_keep", lambda u, px, qx: np.ones(u.shape, dtype=bool)),
    # keep with probability p(x), ignoring q
    "keep-with-p": ("_keep", lambda u, px, qx: u < px),
    # on rejection redraw from p rather than from the residual max(p - q, 0)
    "resample-from-p": ("_residual", lambda p, q: p),
    # the residual without the clip at zero (its negative mass shifts the draw)
    "unclipped-residual": ("_residual", lambda p, q: np.abs(p - q) / np.abs(p - q).sum()),
    # a subtle one: keep 5% too rarely (min(1, 0.95 p / q))
    "keep-5pct-too-rarely": ("_keep", lambda u, px, qx: u * qx < 0.95 * px),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_rules_fail_the_test(monkeypatch, name):
    """The goodness-of-fit test can fail: each deliberately wrong rule is rejected at ALPHA."""
    attr, wrong = WRONG[name]
    monkeypatch.setattr(speculative, attr, wrong)
    params, k, use_mask = CASES["t1.0"]
    p_first, p_joint = _fit(Toy(8, seed=sorted(CASES).index("t1.0"), history=HISTORY), params, k,
                            use_mask)
    assert min(p_first, p_joint) < ALPHA, (p_first, p_joint)


def test_stale_penalties_fail_the_test(monkeypatch):
    """p_i computed without counting the drafts kept before position i (penalties only from the
    history) is a wrong rule the joint test catches."""
    real = speculative.target_probs
    monkeypatch.setattr(speculative, "target_probs",
                        lambda row, params, gen, mask=None: real(row, params, list(gen)[: len(HISTORY)],
                                                                 mask))
    params, k, use_mask = CASES["penalties"]
    p_first, p_joint = _fit(Toy(8, seed=sorted(CASES).index("penalties"), history=HISTORY), params, k,
                            use_mask)
    assert p_joint < ALPHA, (p_first, p_joint)


# --- greedy, plain equivalences, reproducibility, edge cases --------------------------------------

def _random_mask(g: np.random.Generator, vocab: int) -> np.ndarray:
    allowed = np.zeros(((vocab + 31) // 32) * 32, dtype=bool)
    allowed[:vocab] = g.random(vocab) < 0.6
    allowed[int(g.integers(vocab))] = True
    return np.packbits(allowed, bitorder="little").view(np.int32)


def _random_params(g: np.random.Generator, vocab: int, temperature: float) -> SamplingParams:
    bias = ((int(g.integers(vocab)), float(g.normal() * 3.0)),) if g.random() < 0.5 else ()
    return SamplingParams(temperature=temperature, presence_penalty=float(g.choice([0.0, 0.7, 2.0])),
                          frequency_penalty=float(g.choice([0.0, 0.5, -0.3])), logit_bias=bias,
                          top_k=int(g.choice([0, 0, 3])), top_p=float(g.choice([1.0, 0.9])),
                          min_p=float(g.choice([0.0, 0.05])))


def test_greedy_verify_emits_plain_greedy_tokens():
    """Drafts that agree with plain greedy decoding for a random prefix: verify keeps exactly that
    prefix and adds plain greedy's next token (the bonus after all k), penalties, bias and masks
    included; it takes no uniforms."""
    g = np.random.default_rng(3)
    for _ in range(400):
        vocab, k = int(g.integers(4, 60)), int(g.integers(0, 6))
        params = _random_params(g, vocab, 0.0)
        logits = (g.standard_normal((k + 1, vocab)) * 2.0).astype(np.float32)
        history = [int(t) for t in g.integers(0, vocab, size=int(g.integers(0, 8)))]
        masks = [_random_mask(g, vocab) for _ in range(k + 1)] if g.random() < 0.3 else None
        plain: list[int] = []
        for i in range(k + 1):
            plain.append(sample(logits[i], params, [*history, *plain], make_rngs(0)[0],
                                masks[i] if masks else None)[0])
        agree = int(g.integers(0, k + 1))
        drafts = [*plain[:agree], *(int(t) for t in g.integers(0, vocab, size=k - agree))]
        if agree < k and drafts[agree] == plain[agree]:
            drafts[agree] = (plain[agree] + 1) % vocab
        q = g.dirichlet(np.ones(vocab), size=k) if g.random() < 0.5 else None  # ignored when greedy
        rng = make_rngs(1)[0]
        tokens, n = verify(logits, drafts, q, params, history, rng, masks)
        assert (tokens, n) == (plain[: agree + 1], agree)
        assert rng.random() == make_rngs(1)[0].random()


def test_no_drafts_is_plain_sampling_seed_for_seed():
    """k = 0: verify draws the bonus token from target_probs with the sequence's first uniform,
    the same token plain sample() draws for the same seed (so target_probs is sample()'s
    distribution), masks and greedy included."""
    g = np.random.default_rng(4)
    for trial in range(1500):
        vocab = int(g.integers(2, 300))
        params = _random_params(g, vocab, float(g.choice([0.0, 0.6, 1.0, 1.4])))
        row = (g.standard_normal(vocab) * 2.5).astype(np.float32)
        history = [int(t) for t in g.integers(0, vocab, size=4)]
        mask = _random_mask(g, vocab) if trial % 3 == 0 else None
        p = target_probs(row, params, history, mask)
        assert abs(p.sum() - 1.0) < 1e-12 and p.min() >= 0.0
        plain = sample(row, params, history, make_rngs(trial)[0], mask)[0]
        tokens, n = verify(row[None], [], None, params, history, make_rngs(trial)[0],
                           None if mask is None else [mask])
        assert (tokens, n) == ([plain], 0)


@pytest.mark.parametrize("truncation", [{"top_k": 1}, {"min_p": 1.0}])
def test_point_mass_targets_verify_as_greedy(truncation):
    """top_k = 1 (or min_p = 1) makes every p_i a point mass on the argmax: sampled verify then
    emits greedy verify's tokens whatever the draft and the seed."""
    g = np.random.default_rng(5)
    for seed in range(300):
        vocab, k = int(g.integers(3, 40)), int(g.integers(1, 6))
        greedy = _random_params(g, vocab, 0.0)
        sampled = SamplingParams(**{**greedy.__dict__, "temperature": 1.2, "top_k": 0, "top_p": 1.0,
                                    "min_p": 0.0, **truncation})
        logits = (g.standard_normal((k + 1, vocab)) * 2.0).astype(np.float32)
        q = g.dirichlet(np.full(vocab, 0.5), size=k)
        drafts = [int(np.argmax(logits[i])) if g.random() < 0.6 else _inverse_cdf(q[i], g.random(1))[0]
                  for i in range(k)]
        q[np.arange(k), drafts] += 0.1  # every draft has mass under q
        q /= q.sum(1, keepdims=True)
        want = verify(logits, drafts, None, greedy, [3, 3], make_rngs(seed)[0])
        assert verify(logits, drafts, q, sampled, [3, 3], make_rngs(seed)[0]) == want


def test_seeded_verify_reproduces_and_takes_k_plus_1_uniforms():
    g = np.random.default_rng(6)
    vocab, k = 30, 4
    logits = (g.standard_normal((k + 1, vocab))).astype(np.float32)
    q = g.dirichlet(np.ones(vocab), size=k)
    drafts = [int(_inverse_cdf(q[i], g.random(1))[0]) for i in range(k)]
    params = SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.4)
    outs = set()
    for seed in range(60):
        rng = make_rngs(seed)[0]
        first = verify(logits, drafts, q, params, [1, 2], rng)
        assert verify(logits, drafts, q, params, [1, 2], make_rngs(seed)[0]) == first
        assert rng.random() == make_rngs(seed)[0].random(k + 2)[-1]  # whatever was kept
        outs.add(tuple(first[0]))
    assert len(outs) > 5  # and the seed matters


def test_draft_token_without_draft_mass_falls_back_to_p():
    """q_i(x_i) = 0 (the draft was not drawn from q_i): the position is a rejection that draws
    from p_i itself, which keeps the emitted token's distribution plain."""
    g = np.random.default_rng(8)
    vocab = 8
    logits = (g.standard_normal((2, vocab)) * 1.5).astype(np.float32)
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5)
    q = g.dirichlet(np.ones(vocab))[None]
    x = int(np.argmax(target_probs(logits[0], params, [0])))
    q[0, x] = 0.0
    tokens, kept = verify_trials(logits, [x], q, params, [0], g.random((200_000, 2)))
    assert (kept == 0).all() and (tokens[:, 1] == -1).all()
    counts = np.bincount(tokens[:, 0], minlength=vocab)
    assert _gof(counts, target_probs(logits[0], params, [0]))[0] > ALPHA


def test_truncated_or_masked_draft_is_never_kept():
    """A draft that truncation (top-k) or the mask gives p_i(x) = 0 is always rejected, and the
    residual never emits a token outside the allowed set."""
    g = np.random.default_rng(9)
    vocab = 16
    logits = (g.standard_normal((2, vocab)) * 2.0).astype(np.float32)
    q = g.dirichlet(np.ones(vocab))[None]
    top2 = set(np.argsort(-logits[0])[:2].tolist())
    x = int(np.argsort(-logits[0])[5])
    tokens, kept = verify_trials(logits, [x], q, SamplingParams(top_k=2), [], g.random((50_000, 2)))
    assert (kept == 0).all() and set(np.unique(tokens[:, 0]).tolist()) == top2
    mask = _random_mask(g, vocab)
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
    x = int(np.flatnonzero(~allowed)[0])
    tokens, kept = verify_trials(logits, [x], q, SamplingParams(), [], g.random((50_000, 2)),
                                 [mask, None])
    assert (kept == 0).all() and allowed[tokens[:, 0]].all()


def test_draft_agreeing_with_a_point_mass_is_always_kept():
    logits = np.zeros((3, 10), dtype=np.float32)
    logits[0, 4] = logits[1, 7] = 200.0  # p_0, p_1: all mass on one token
    q = np.full((2, 10), 0.1)
    tokens, kept = verify_trials(logits, [4, 7], q, SamplingParams(temperature=1.3), [],
                                 np.random.default_rng(0).random((1000, 3)))
    assert (kept == 2).all() and (tokens[:, :2] == [4, 7]).all()
    tokens, kept = verify_trials(logits, [4, 2], q, SamplingParams(temperature=1.3), [],
                                 np.random.default_rng(0).random((1000, 3)))
    assert (kept == 1).all() and (tokens[:, :2] == [4, 7]).all()


def test_bad_shapes_are_errors():
    rng = make_rngs(0)[0]
    logits = np.zeros((3, 10), dtype=np.float32)
    with pytest.raises(ValueError):
        verify(logits, [1], None, SamplingParams(), [], rng)  # k + 1 rows
    with pytest.raises(ValueError):
        verify(logits, [1, 2], np.full((2, 9), 0.1), SamplingParams(), [], rng)
    with pytest.raises(ValueError):
        verify(logits, [1, 10], None, SamplingParams(), [], rng)
    with pytest.raises(ValueError):
        verify_trials(logits, [1, 2], None, SamplingParams(temperature=0.0), [], np.zeros((1, 3)))
