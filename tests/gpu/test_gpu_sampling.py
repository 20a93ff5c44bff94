"""Device sampling (kernels/sampling.cu) against engine.runtime.sampling.sample, the float64 reference.

Every job's generator is seeded, so the device and the reference draw the same uniform. Tokens
must be equal, except in rows where a float32 sum may round across a decision: u * W within
MARGIN (relative) of a CDF step, a top-p prefix sum within MARGIN of top_p, a p / p_max within
MARGIN of min_p, or (greedy) the two best penalised logits within MARGIN. Those rows are counted
and must stay rare. Logprobs: 2e-4 absolute (float32 log-sum-exp over the vocabulary); the top
ids are exact (ties by id, as the reference). Skipped where CuPy or a GPU is absent (CI).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_required import require_gpu

cp = require_gpu()

from engine.ops.gpu import sampling as cupy_sampling  # noqa: E402
from engine.runtime.sampling import (  # noqa: E402
    SampleJob,
    SamplingParams,
    allowed_mask,
    logit_deltas,
    make_rngs,
    sample,
)

MARGIN = 2e-5
LP_TOL = 2e-4

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=50),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.8, top_k=200, top_p=0.8, min_p=0.01),
    SamplingParams(temperature=1.0, top_p=0.3, presence_penalty=0.5, frequency_penalty=0.3,
                   logit_bias=((5, 3.0), (7, -100.0))),
    SamplingParams(temperature=0.0, logprobs=True, top_logprobs=20, frequency_penalty=1.0),
    SamplingParams(temperature=1.1, top_p=0.5, logprobs=True, top_logprobs=5),
    SamplingParams(temperature=0.5, top_k=1, logprobs=True, top_logprobs=0),
]


def _close_call(logits: np.ndarray, p: SamplingParams, generated: list[int], u: float) -> bool:
    """Whether a float32 computation may legitimately decide this row differently."""
    x = np.array(logits, dtype=np.float64)
    ids, vals = logit_deltas(generated, p.presence_penalty, p.frequency_penalty, p.logit_bias, x.size)
    x[ids] += vals
    if p.greedy:
        top2 = np.sort(x)[-2:]
        return top2[1] - top2[0] < MARGIN * max(1.0, abs(top2[1]))
    scaled = x / p.temperature
    if p.top_k:
        scaled = np.where(scaled >= np.sort(scaled)[-p.top_k], scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if p.min_p > 0 and np.min(np.abs(probs / probs.max() - p.min_p)) < MARGIN:
        return True
    if p.top_p < 1:
        cum = np.cumsum(np.sort(probs)[::-1])
        if np.min(np.abs(cum - p.top_p)) < MARGIN:
            return True
    allowed = np.flatnonzero(allowed_mask(x, p))
    w = np.exp(x[allowed] / p.temperature - (x[allowed] / p.temperature).max())
    cum = np.cumsum(w) / w.sum()
    return bool(np.min(np.abs(cum - u)) < MARGIN)


@pytest.mark.parametrize("vocab", [1000, 129280])
def test_sample_rows_match_the_reference(vocab):
    g = np.random.default_rng(vocab)
    rows = 40
    logits = (g.standard_normal((rows, vocab)) * 3).astype(np.float32)
    logits[rows // 2:] = np.round(logits[rows // 2:] * 2) / 2  # exact ties everywhere
    gens = [list(g.integers(0, vocab, int(g.integers(0, 60)))) for _ in range(rows)]
    # every params set on every kind of row, rows out of order, one row drawn twice (n > 1 forks)
    order = [int(r) for r in g.permutation(rows)] + [3]
    jobs = [SampleJob(r, PARAMS[i % len(PARAMS)], gens[r], make_rngs(1000 + i)[0]) for i, r in enumerate(order)]
    got = cupy_sampling.sample_rows(cp.asarray(logits), jobs)
    close, checked = 0, 0
    for i, (job, (tok, lp, top)) in enumerate(zip(jobs, got, strict=True)):
        p = job.params
        want_tok, want_lp, want_top = sample(logits[job.row], p, job.generated, make_rngs(1000 + i)[0])
        u = make_rngs(1000 + i)[0].random()
        if tok != want_tok:
            assert _close_call(logits[job.row], p, job.generated, u), (i, job.row, p, tok, want_tok)
            close += 1
        checked += 1
        assert (lp is None) == (want_lp is None)
        if want_lp is not None:
            if tok == want_tok:
                assert abs(lp - want_lp) < LP_TOL, (i, lp, want_lp)
            assert [t for t, _ in top] == [t for t, _ in want_top], (i, p)
            assert np.allclose([v for _, v in top], [v for _, v in want_top], atol=LP_TOL, rtol=0)
    assert close <= max(1, checked // 20), f"{close} of {checked} rows decided differently"


def test_sample_rows_distribution_is_the_reference_one():
    """Many draws of one row: the device's token frequencies follow the truncated distribution
    (a chi-square-like bound on the counts of the allowed tokens, none outside them)."""
    g = np.random.default_rng(5)
    vocab = 4096
    row = (g.standard_normal(vocab) * 2).astype(np.float32)
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.9)
    n = 4000
    jobs = [SampleJob(0, p, [], rng) for rng in make_rngs(7, n)]
    toks = np.array([t for t, _, _ in cupy_sampling.sample_rows(cp.asarray(row[None]), jobs)])
    allowed = allowed_mask(row.astype(np.float64), p)
    assert allowed[toks].all()
    ids = np.flatnonzero(allowed)
    w = np.exp(row[ids] / p.temperature - (row[ids] / p.temperature).max())
    expect = w / w.sum() * n
    counts = np.array([(toks == t).sum() for t in ids])
    big = expect > 20
    z = (counts[big] - expect[big]) / np.sqrt(expect[big])
    assert np.abs(z).max() < 5, z


def test_top_logprobs_over_20_is_refused():
    jobs = [SampleJob(0, SamplingParams(logprobs=True, top_logprobs=21), [], make_rngs(0)[0])]
    with pytest.raises(ValueError):
        cupy_sampling.sample_rows(cp.ones((1, 100), dtype=cp.float32), jobs)


def _pack(allowed: np.ndarray) -> np.ndarray:
    """Booleans -> a packed token mask (int32 words, bit i of word w = id 32 * w + i)."""
    padded = np.zeros((allowed.size + 31) // 32 * 32, dtype=bool)
    padded[:allowed.size] = allowed
    return np.packbits(padded, bitorder="little").view(np.int32)


@pytest.mark.parametrize("vocab", [1000, 129280])
def test_masked_rows_match_the_reference(vocab):
    """Constrained decoding's token masks: every masked row draws inside its mask and what the
    float64 reference draws with the same mask (same margins as unmasked rows); unmasked rows
    of the same launch are untouched; logprobs stay those of the raw logits."""
    g = np.random.default_rng(vocab + 1)
    rows = 36
    logits = (g.standard_normal((rows, vocab)) * 3).astype(np.float32)
    logits[rows // 2:] = np.round(logits[rows // 2:] * 2) / 2  # exact ties
    densities = [1.0 / vocab, 0.001, 0.01, 0.1, 0.5, 0.97]
    jobs, allowed = [], []
    for r in range(rows):
        if r % 4 == 3:  # unmasked beside masked ones
            jobs.append(SampleJob(r, PARAMS[r % len(PARAMS)], [], make_rngs(2000 + r)[0]))
            allowed.append(None)
            continue
        a = g.random(vocab) < densities[r % len(densities)]
        a[g.integers(vocab)] = True
        gen = list(g.integers(0, vocab, int(g.integers(0, 30))))
        jobs.append(SampleJob(r, PARAMS[r % len(PARAMS)], gen, make_rngs(2000 + r)[0], _pack(a)))
        allowed.append(a)
    got = cupy_sampling.sample_rows(cp.asarray(logits), jobs)
    close = 0
    for r, (job, (tok, lp, top)) in enumerate(zip(jobs, got, strict=True)):
        want_tok, want_lp, want_top = sample(logits[job.row], job.params, job.generated, make_rngs(2000 + r)[0],
                                             job.mask)
        if allowed[r] is not None:
            assert allowed[r][tok], (r, tok)
        if tok != want_tok:
            masked = logits[job.row] if allowed[r] is None else np.where(allowed[r], logits[job.row], -np.inf)
            u = make_rngs(2000 + r)[0].random()
            assert _close_call(masked.astype(np.float32), job.params, job.generated, u), (r, tok, want_tok)
            close += 1
        if want_lp is not None and tok == want_tok:
            assert abs(lp - want_lp) < LP_TOL
            assert [t for t, _ in top] == [t for t, _ in want_top]
    assert close <= max(1, rows // 20), f"{close} of {rows} rows decided differently"


def test_masked_greedy_and_sampled_draws_many_seeds():
    """One row, many seeds and parameter sets, masks of one to all tokens: never outside the mask,
    and the reference's token (bar close calls)."""
    g = np.random.default_rng(17)
    vocab = 5000
    row = (g.standard_normal(vocab) * 2).astype(np.float32)
    jobs, allowed = [], []
    for i in range(300):
        a = g.random(vocab) < [0.0, 0.002, 0.05, 0.3, 1.0][i % 5]
        a[g.integers(vocab)] = True
        jobs.append(SampleJob(0, PARAMS[i % len(PARAMS)], [], make_rngs(i)[0], _pack(a)))
        allowed.append(a)
    got = cupy_sampling.sample_rows(cp.asarray(row[None]), jobs)
    differ = 0
    for i, (tok, _, _) in enumerate(got):
        assert allowed[i][tok]
        want = sample(row, jobs[i].params, [], make_rngs(i)[0], jobs[i].mask)[0]
        if tok != want:
            masked = np.where(allowed[i], row, -np.inf).astype(np.float32)
            assert _close_call(masked, jobs[i].params, [], make_rngs(i)[0].random()), (i, tok, want)
            differ += 1
    assert differ <= 15
