"""Speculative sampling's backend ops on the numpy backend (engine/runtime/spec_sampling.py), bit for
bit the host rule spec_decode and DSpark ran inline before the ops existed: the draft's draws
(softmax at the temperature in float64, inverse CDF at one uniform), and verify (greedy rows as
plain greedy sampling draws them, sampled rows through speculative.verify), logprobs included.

Also the scheme the GPU kernel runs (every verify row judged at once, as if the drafts before it
were kept, then cut at the first rejection) against the sequential rule, in float64, and the
device sampler's job table carrying the speculative words (host side, no GPU).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.ops.gpu.sample_table import (
    JOB_DRAFT,
    JOB_MODE,
    JOB_Q,
    JOB_U,
    JOB_UA,
    JOB_WORDS,
    MODE_VERIFY,
    SpecRow,
    job_table,
)
from engine.ops.numpy_ops import NumpyOps
from engine.runtime.sampling import SampleJob, SamplingParams, make_rngs, sample_batch, token_logprobs
from engine.runtime.spec_sampling import VerifyJob
from engine.runtime.speculative import target_probs, verify

VOCAB = 300
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3, frequency_penalty=0.8, logit_bias=((7, 2.0),)),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9, logprobs=True, top_logprobs=5),
    SamplingParams(temperature=1.3, top_k=20, presence_penalty=0.6, frequency_penalty=0.4),
    SamplingParams(temperature=1.0, min_p=0.05, logit_bias=((3, 5.0), (9, -100.0)), logprobs=True),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.8, min_p=0.01, presence_penalty=1.0,
                   logprobs=True, top_logprobs=0),
]


def _softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _inline_draws(logits: np.ndarray, temps: list[float], rngs: list) -> tuple[np.ndarray, list]:
    """What DSpark.draft_many did at one position before ops.draw_drafts: the argmax, overridden by
    each drawing row's draw from its float64 softmax at the next uniform of its generator."""
    picks = np.argmax(logits, axis=1).astype(np.int64)
    qs = [None] * len(temps)
    for b, (t, rng) in enumerate(zip(temps, rngs, strict=True)):
        if rng is None:
            continue
        q = _softmax64(np.asarray(logits[b], np.float64) / t)
        c = np.cumsum(q)
        picks[b] = min(np.searchsorted(c, rng.random() * c[-1], side="right"), q.size - 1)
        qs[b] = q
    return picks, qs


def test_draw_drafts_is_the_inline_rule() -> None:
    g = np.random.default_rng(0)
    for trial in range(20):
        bsz, n = 5, 3
        logits = (g.standard_normal((bsz * n, VOCAB)) * (1 + trial % 4)).astype(np.float32)
        temps = [0.0, 0.5, 1.0, 1.7, 0.0]
        rows = [b * n + trial % n for b in range(bsz)]
        mine, ref = make_rngs(trial, bsz), make_rngs(trial, bsz)
        us = [r.random() if t > 0 else 0.0 for r, t in zip(mine, temps, strict=True)]
        tokens, probs = NumpyOps().draw_drafts(logits, rows, temps, us)
        want, qs = _inline_draws(logits[rows], temps, [r if t > 0 else None for r, t in zip(ref, temps, strict=True)])
        np.testing.assert_array_equal(tokens, want)
        assert tokens.dtype == np.int64 and probs.dtype == np.float64
        for b, q in enumerate(qs):
            if q is not None:
                np.testing.assert_array_equal(probs[b], q)


def _jobs(g: np.random.Generator, logits: np.ndarray, k_max: int = 4) -> list[tuple]:
    """Random verify jobs over logits: (row, drafts, q or None, params, generated). Each draft is
    drawn from a q near the target (so that runs of drafts are kept and penalties count them)."""
    out, row, vocab = [], 0, logits.shape[-1]
    for b, p in enumerate(PARAMS * 2):
        k = int(g.integers(0, k_max + 1))
        generated = [int(t) for t in g.integers(0, 12, size=int(g.integers(0, 6)))]
        drafts, qs = [], []
        for i in range(k):
            if p.greedy:  # mostly the argmax, so greedy rows agree for a while
                x = target_probs(logits[row + i], p, [*generated, *drafts])
                d = int(np.argmax(x)) if g.random() < 0.8 else int(g.integers(vocab))
            else:
                t = target_probs(logits[row + i], p, [*generated, *drafts])
                q = 0.7 * t + 0.3 * g.dirichlet(np.full(vocab, 0.5))
                d = int(g.choice(vocab, p=q / q.sum()))
                qs.append(q)
            drafts.append(d)
        out.append((row, drafts, np.stack(qs) if qs else None, p, generated, b))
        row += k + 1
    return out


def _inline_verify(logits: np.ndarray, job: tuple, rng) -> tuple[list[int], int, list | None]:
    """What spec_decode did before ops.verify_rows: a greedy sequence's rows drawn by sample_batch
    (row i counting drafts 0 .. i-1), kept up to the first disagreement; a sampled one's rows on the
    host through speculative.verify; logprobs from each emitted token's row."""
    row, d, q, p, generated, _ = job
    k = len(d)
    if p.greedy:
        got = sample_batch(logits, [SampleJob(row + i, p, [*generated, *d[:i]], rng) for i in range(k + 1)])
        n = next((i for i, x in enumerate(got[:-1]) if x[0] != d[i]), k)
        return [int(x[0]) for x in got[: n + 1]], n, [(x[1], x[2]) for x in got[: n + 1]] if p.logprobs else None
    x = np.asarray(logits[row : row + k + 1], np.float32)
    tokens, n = verify(x, d, q, p, generated, rng)
    lps = [token_logprobs(x[r], t, p.top_logprobs) for r, t in enumerate(tokens)] if p.logprobs else None
    return tokens, n, lps


@pytest.mark.parametrize("seed", range(6))
def test_verify_rows_is_the_inline_rule(seed: int) -> None:
    g = np.random.default_rng(seed)
    logits = (g.standard_normal((80, VOCAB)) * 2.5).astype(np.float32)
    logits[:, 5] += 4.0  # a favourite token: draws repeat it, so penalties bite
    jobs = _jobs(g, logits)
    mine, ref = make_rngs(seed, len(jobs)), make_rngs(seed, len(jobs))
    verdicts = NumpyOps().verify_rows(logits, [VerifyJob(r, d, q, p, gen, mine[b]) for r, d, q, p, gen, b in jobs])
    kept = 0
    for job, v in zip(jobs, verdicts, strict=True):
        tokens, n, lps = _inline_verify(logits, job, ref[job[5]])
        assert (v.tokens, v.kept) == (tokens, n)
        assert v.logprobs == lps
        kept += n
    assert kept >= 4  # drafts were kept (the penalties of kept drafts were exercised)
    for a, b in zip(mine, ref, strict=True):  # the same uniforms taken
        assert a.random() == b.random()


def _judge_row(x: np.ndarray, p: SamplingParams, prefix: list[int], d: int | None, q: np.ndarray | None,
               u_a: float, u: float) -> tuple[bool, int]:
    """One verify row alone, as kernels/sampling.cu's SMP_VERIFY judges it: kept, or the token it
    emits (its residual draw at u, or the bonus draw where d is None)."""
    pt = target_probs(x, p, prefix)

    def draw(w: np.ndarray) -> int:
        c = np.cumsum(w)
        return min(int(np.searchsorted(c, u * c[-1], side="right")), int(np.flatnonzero(w)[-1]))

    if d is None:
        return False, draw(pt)
    qn = q / q.sum()
    if qn[d] <= 0.0:
        return False, draw(pt)
    if u_a * qn[d] < pt[d]:
        return True, d
    r = np.maximum(pt - qn, 0.0)
    return False, draw(r / r.sum() if r.sum() > 0.0 else pt)


@pytest.mark.parametrize("seed", range(4))
def test_rows_judged_at_once_resolve_to_the_sequential_rule(seed: int) -> None:
    """The kernel judges every row of a sequence in parallel, each as if the drafts before it were
    kept; cut at the first rejection, that is verify's sequential rule, uniform for uniform."""
    g = np.random.default_rng(100 + seed)
    logits = (g.standard_normal((80, VOCAB)) * 2.0).astype(np.float32)
    for row, d, q, p, gen, _ in _jobs(g, logits):
        if p.greedy:
            continue
        for _ in range(5):
            k = len(d)
            u = g.random(k + 1)
            judged = [_judge_row(logits[row + i], p, [*gen, *d[:i]], d[i] if i < k else None,
                                 q[i] if i < k else None, u[i] if i < k else 0.0, u[k]) for i in range(k + 1)]
            n = next((i for i in range(k) if not judged[i][0]), k)
            tokens = [t for _, t in judged[: n + 1]]
            want, m = verify(logits[row : row + k + 1], d, q, p, gen, _Fixed(u))
            assert (tokens, n) == (want, m)


class _Fixed:
    """A generator stand-in handing out given uniforms (what verify draws: one [1, k + 1] array)."""

    def __init__(self, u: np.ndarray) -> None:
        self.u = u

    def random(self, shape):
        return self.u.reshape(shape)


def test_job_table_carries_speculative_words() -> None:
    jobs = [SampleJob(3, SamplingParams(temperature=0.9, frequency_penalty=0.5), [1, 2, 2], None),
            SampleJob(4, SamplingParams(temperature=0.9, frequency_penalty=0.5), [1, 2, 2, 8], None)]
    spec = [SpecRow(MODE_VERIFY, 8, 0x7F00_0000_1234, 0.25, 0.75), SpecRow(MODE_VERIFY, -1, 0, 0.0, 0.75)]
    table, ndelta, nwork = job_table(jobs, VOCAB, spec)
    head = table[: 2 * JOB_WORDS].reshape(2, JOB_WORDS)
    assert list(head[:, JOB_MODE]) == [MODE_VERIFY, MODE_VERIFY]
    assert list(head[:, JOB_DRAFT]) == [8, -1]
    assert head[0, JOB_Q:JOB_Q + 2].copy().view(np.uint64)[0] == 0x7F00_0000_1234
    assert head[:, JOB_UA:JOB_UA + 2].copy().view(np.float64).ravel().tolist() == [0.25, 0.0]
    assert head[:, JOB_U:JOB_U + 2].copy().view(np.float64).ravel().tolist() == [0.75, 0.75]
    assert (ndelta, nwork) == (2 + 3, 2)  # each row's own penalty deltas (row 2 counts the draft 8)


def test_add_argmax_adds_in_place_and_takes_numpys_argmax() -> None:
    """A greedy draft position (DSpark._greedy_block): the bias lands in the logits' rows (a strided
    view of the block's logits) and each token in its column of the [positions, sequences] array,
    the first index on ties and a NaN above every number, as numpy's argmax."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((3, 5, 40)).astype(np.float32)
    logits[0, 2, [4, 9]] = 50.0  # a tie: the first wins
    logits[1, 2, 30] = np.nan
    bias = rng.standard_normal((3, 40)).astype(np.float32)
    bias[0, [4, 9]] = 1.0  # (the tie survives the bias)
    want_x = logits[:, 2] + bias
    tokens = np.full((5, 3), -1, np.int64)
    got = NumpyOps().add_argmax(logits[:, 2], bias, tokens[2])
    assert got is not None and np.shares_memory(got, tokens)
    np.testing.assert_array_equal(logits[:, 2], want_x)
    np.testing.assert_array_equal(tokens[2], [4, 30, int(np.argmax(want_x[2]))])
    assert (tokens[[0, 1, 3, 4]] == -1).all()  # (only position 2's row written)
    NumpyOps().add_argmax(logits[:, 3], None, tokens[3])  # no bias: the logits as they are
    np.testing.assert_array_equal(tokens[3], np.argmax(logits[:, 3], axis=1))
