"""Speculative sampling on the device (engine/ops/gpu/spec_sampling.py on kernels/sampling.cu)
against the numpy backend's host rule (engine/runtime/spec_sampling.py), the float64 reference.

Both sides take the same uniforms (each job's generator seeded alike). Tokens and verdicts must be
equal, except where a float32 sum may round across a decision (MARGIN, relative): a uniform's
u * W within it of a CDF step (of p, of the residual, or of the draft's q), u_a * q(d) within it of
p(d), or a truncation boundary (test_gpu_sampling._close_call). Those rows are counted and must
stay rare. q: float32, within Q_RTOL of the float64 softmax. Logprobs: LP_TOL absolute.

Distribution: the GPU's emitted tokens over many independent verify trials pass Pearson's test
against the exact distribution plain sampling draws from (the first token; the second given the
first, penalties counting it). End to end: seeded sampled speculation on models/demo-v41 repeats
exactly, through the device ops. Skipped where CuPy or a GPU is absent (CI).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_required import require_gpu

cp = require_gpu()

from test_gpu_sampling import _close_call  # noqa: E402

from engine.ops.gpu import spec_sampling as gpu_spec  # noqa: E402
from engine.runtime.sampling import SamplingParams, make_rngs  # noqa: E402
from engine.runtime.spec_sampling import VerifyJob, draw_drafts, verify_batch  # noqa: E402
from engine.runtime.speculative import target_probs  # noqa: E402
from tests.unit.test_spec_sampling_ops import _jobs  # noqa: E402
from tests.unit.test_speculative_sampling import ALPHA, _gof  # noqa: E402

MARGIN = 2e-5
Q_RTOL = 1e-4
LP_TOL = 2e-4
DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-v41"


def _near_step(w: np.ndarray, u: float) -> bool:
    """Whether u lies within MARGIN of a step of the CDF of weights w."""
    c = np.cumsum(w) / w.sum()
    return bool(np.min(np.abs(c - u)) < MARGIN)


@pytest.mark.parametrize("vocab", [1000, 129280])
def test_draw_drafts_match_numpy(vocab):
    g = np.random.default_rng(vocab)
    bsz, n = 8, 5
    logits = (g.standard_normal((bsz * n, vocab)) * 3).astype(np.float32)
    temps = [0.0, 0.3, 0.7, 1.0, 1.0, 1.5, 2.0, 0.0]
    close = 0
    for i in range(n):
        rows = [b * n + i for b in range(bsz)]
        us = [float(u) if t > 0 else 0.0 for u, t in zip(g.random(bsz), temps, strict=True)]
        want, wq = draw_drafts(logits, rows, temps, us)
        got, gq = gpu_spec.draw_drafts(cp.asarray(logits), rows, temps, us)
        assert got.dtype == cp.int64
        got, gq = cp.asnumpy(got), cp.asnumpy(gq)
        for b, t in enumerate(temps):
            if t <= 0:
                assert got[b] == want[b]
                continue
            np.testing.assert_allclose(gq[b], wq[b], rtol=Q_RTOL, atol=1e-12)
            if got[b] != want[b]:
                assert _near_step(wq[b], us[b]), f"row {rows[b]}: {got[b]} != {want[b]}"
                close += 1
    assert close <= 2


def _near_verdict(logits: np.ndarray, job: VerifyJob, u: np.ndarray) -> bool:
    """Whether float32 may legitimately decide this job differently: any decision on the host's
    path (every row it reached) within MARGIN."""
    d, p, k = job.drafts, job.params, len(job.drafts)
    for i in range(k + 1):
        x, prefix = logits[job.row + i], [*job.generated, *d[:i]]
        if _close_call(x, p, prefix, float(u[k])):
            return True
        if p.greedy:
            if i == k or int(np.argmax(target_probs(x, p, prefix))) != d[i]:
                return False
            continue
        pt = target_probs(x, p, prefix)
        if i == k:
            return False
        q = np.asarray(job.probs[i], np.float64)
        q = q / q.sum()
        a, b = u[i] * q[d[i]], pt[d[i]]
        if abs(a - b) <= MARGIN * max(a, b):
            return True
        if a >= b:  # rejected: the residual draw
            r = np.maximum(pt - q, 0.0)
            return r.sum() > 0 and _near_step(r, float(u[k]))
    return False


def _verify_jobs(jobs: list[tuple], rngs: list, probs) -> list[VerifyJob]:
    """test_spec_sampling_ops._jobs as VerifyJobs, q rows through probs (the same float32 values on
    both sides)."""
    return [VerifyJob(r, d, None if q is None else probs(q), p, gen, rngs[b]) for r, d, q, p, gen, b in jobs]


@pytest.mark.parametrize("vocab", [1000, 129280])
def test_verify_rows_match_numpy(vocab):
    g = np.random.default_rng(vocab + 1)
    logits = (g.standard_normal((80, vocab)) * 2.5).astype(np.float32)
    logits[:, 5] += 4.0
    close, kept = 0, 0
    for trial in range(4):
        jobs = _jobs(g, logits)
        host = _verify_jobs(jobs, make_rngs(trial, len(jobs)), lambda q: q.astype(np.float32).astype(np.float64))
        dev = _verify_jobs(jobs, make_rngs(trial, len(jobs)), lambda q: cp.asarray(q, dtype=cp.float32))
        want = verify_batch(logits, host)
        got = gpu_spec.verify_rows(cp.asarray(logits), dev)
        for j, h, w, v in zip(jobs, host, want, got, strict=True):
            kept += w.kept
            if (v.tokens, v.kept) != (w.tokens, w.kept):
                u = make_rngs(trial, len(jobs))[j[5]].random((1, len(j[1]) + 1))[0]
                assert _near_verdict(logits, h, u), f"{j[3]}: {v.tokens} / {v.kept} != {w.tokens} / {w.kept}"
                close += 1
                continue
            assert (v.logprobs is None) == (w.logprobs is None)
            for (glp, gtop), (wlp, wtop) in zip(v.logprobs or (), w.logprobs or (), strict=True):
                assert abs(glp - wlp) < LP_TOL
                assert [t for t, _ in gtop] == [t for t, _ in wtop]
                np.testing.assert_allclose([x for _, x in gtop], [x for _, x in wtop], atol=LP_TOL)
    print(f"verify rows, vocab {vocab}: {close} near-boundary verdicts differ, {kept} drafts kept")
    assert kept > 10
    assert close <= 3


def test_verify_distribution_is_plain_sampling():
    """N independent trials of one step (k = 2) on the device: the first emitted token is
    distributed as p_0, and the second (where the first draft was kept) as p_1 given it, its
    presence penalty counting the first; Pearson's test at ALPHA. The kept counts agree with the
    numpy reference's run on the same uniforms but for near-boundary trials."""
    vocab, trials = 24, 20000
    g = np.random.default_rng(3)
    logits = (g.standard_normal((3, vocab)) * 1.5).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=16, presence_penalty=0.7)
    gen = [2, 3]
    q = g.dirichlet(np.full(vocab, 0.6), size=2)
    q[0, int(np.argmax(target_probs(logits[0], params, gen)))] *= 0.2  # a draft unlike the target
    q /= q.sum(axis=1, keepdims=True)
    q32 = q.astype(np.float32)
    draws = np.stack([g.choice(vocab, size=trials, p=q[i] / q[i].sum()) for i in range(2)], axis=1)
    qd = cp.asarray(q32)
    dev = [VerifyJob(0, [int(a), int(b)], qd, params, gen, r)
           for (a, b), r in zip(draws, make_rngs(9, trials), strict=True)]
    got = gpu_spec.verify_rows(cp.asarray(logits), dev)
    first = np.bincount([v.tokens[0] for v in got], minlength=vocab)
    pval, _ = _gof(first, target_probs(logits[0], params, gen))
    assert pval > ALPHA, f"first token: p-value {pval:.2e}"
    second = np.zeros(vocab)
    expect = np.zeros(vocab)
    for v in got:
        if len(v.tokens) > 1:
            second[v.tokens[1]] += 1
            expect += target_probs(logits[1], params, [*gen, v.tokens[0]])
    pval, _ = _gof(second, expect / expect.sum())
    assert pval > ALPHA, f"second token: p-value {pval:.2e}"
    host = [VerifyJob(0, j.drafts, q32.astype(np.float64), params, gen, r)
            for j, r in zip(dev, make_rngs(9, trials), strict=True)]
    want = verify_batch(logits, host)
    differ = sum((v.tokens, v.kept) != (w.tokens, w.kept) for v, w in zip(got, want, strict=True))
    assert differ <= trials // 1000, differ


def test_seeded_sampled_speculation_on_demo_runs_on_the_device(monkeypatch):
    from engine.runtime.engine import Engine

    eng = Engine.load(DEMO, gpus=[0])
    ops = eng.model.ops
    calls = {"draw_drafts": 0, "verify_rows": 0}
    for name in calls:
        real = getattr(ops, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(ops, name, counted)
    ids = eng.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, presence_penalty=0.3,
                            frequency_penalty=0.2, seed=11)
    first = eng.generate(ids, 96, params, speculative=True)
    stats = eng.last_acceptance
    assert eng.generate(ids, 96, params, speculative=True) == first
    assert calls["draw_drafts"] and calls["verify_rows"], calls
    assert stats.steps and stats.tokens_per_step > 1.0
    print(f"GPU sampled speculation on the device: acceptance {stats.tokens_per_step:.2f} tokens/step")
