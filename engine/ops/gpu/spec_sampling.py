"""Speculative sampling on the device: the CuPy backend's engine.runtime.spec_sampling, on the
sampling kernel (kernels/sampling.cu, its J_MODE words), so that p is the same transform a plain
draw takes (penalties, bias, temperature, top-k / top-p / min-p) and only tokens, verdicts and
logprobs leave the device.

- draw_drafts: one launch per block position, a row per sequence (SMP_KEEP: the draw, and q
  written as float32 for verify); the tokens stay on the device for the Markov head's next input.
- verify_rows: one launch for every sequence's k + 1 rows (SMP_VERIFY), each row tested as if its
  drafts before it were kept, one download; the host keeps each sequence's rows up to its first
  rejection (vLLM and FlashInfer resolve the chain the same way, after a parallel pass).

q is float32: half the memory of float64 for [batch, block, vocab], and the draws are made from
fixed-point masses anyway; a token or a verdict may differ from the float64 host rule only where
a uniform lies within rounding of a decision (docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import cupy as cp
import numpy as np

from engine.ops.gpu.sample_table import MODE_KEEP, MODE_VERIFY, SpecRow
from engine.ops.gpu.sampling import accepted, launch, results
from engine.runtime.sampling import SampleJob, SamplingParams
from engine.runtime.spec_sampling import Verdict, VerifyJob

F32 = 4  # bytes


def _row_ptr(a: cp.ndarray, i: int) -> int:
    if a.dtype != cp.float32 or a.strides[-1] != F32:
        raise ValueError("q rows must be float32 with contiguous rows")
    return int(a.data.ptr) + i * int(a.strides[0])


def _draft_rows(j: VerifyJob, vocab: int) -> cp.ndarray:
    """A sampled job's q rows [k, vocab] float32; without probs, its drafts as point masses (what
    speculative.verify weighs a draft by when it has no distribution)."""
    k = len(j.drafts)
    if j.probs is not None:
        return cp.ascontiguousarray(j.probs[:k], dtype=cp.float32)
    q = cp.zeros((k, vocab), dtype=cp.float32)
    q[cp.arange(k), cp.asarray(np.asarray(j.drafts, np.int64))] = 1.0
    return q


def draw_drafts(logits: cp.ndarray, rows: Sequence[int], temperatures: Sequence[float],
                uniforms: Sequence[float], upload=cp.asarray) -> tuple[cp.ndarray, cp.ndarray]:
    """spec_sampling.draw_drafts on the device: tokens [len(rows)] int64 and q [len(rows), vocab]
    float32 (undefined in argmax rows), both device arrays."""
    logits = cp.ascontiguousarray(logits, dtype=cp.float32)
    probs = cp.empty((len(rows), logits.shape[-1]), dtype=cp.float32)
    jobs = [SampleJob(int(r), SamplingParams(temperature=max(float(t), 0.0)), (), None)
            for r, t in zip(rows, temperatures, strict=True)]
    spec = [SpecRow(MODE_KEEP, -1, _row_ptr(probs, b), 0.0, float(u)) for b, u in enumerate(uniforms)]
    out = launch(logits, jobs, upload, spec)
    return out[:, 0].astype(cp.int64), probs  # (OUT_TOKEN)


def verify_rows(logits: cp.ndarray, jobs: Sequence[VerifyJob], upload=cp.asarray) -> list[Verdict]:
    """spec_sampling.verify_batch on the device: one launch over every job's rows, one download."""
    if not jobs:
        return []
    logits = cp.ascontiguousarray(logits, dtype=cp.float32)
    rows, spec, qs = [], [], []
    for j in jobs:
        k = len(j.drafts)
        u = np.zeros(k + 1) if j.params.greedy else j.rng.random((1, k + 1))[0]  # (speculative.verify's)
        q = None if j.params.greedy or not k else _draft_rows(j, logits.shape[-1])
        qs.append(q)  # (alive until the launch has run: the table holds its address)
        for i in range(k + 1):
            rows.append(SampleJob(j.row + i, j.params, [*j.generated, *j.drafts[:i]], None))
            tested = i < k
            spec.append(SpecRow(MODE_VERIFY, int(j.drafts[i]) if tested else -1,
                                _row_ptr(q, i) if tested and q is not None else 0,
                                float(u[i]) if tested else 0.0, float(u[k])))
    host = cp.asnumpy(launch(logits, rows, upload, spec))
    drawn, kept = results(host, rows, logits.shape[-1]), accepted(host)
    out, r0 = [], 0
    for j in jobs:
        k = len(j.drafts)
        n = next((i for i in range(k) if not kept[r0 + i]), k)
        got = drawn[r0 : r0 + n + 1]
        out.append(Verdict([int(g[0]) for g in got], n,
                           [(g[1], g[2]) for g in got] if j.params.logprobs else None))
        r0 += k + 1
    return out
