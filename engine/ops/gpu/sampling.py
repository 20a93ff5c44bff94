"""Sampling on the device (kernels/sampling.cu): the CuPy backend's engine.runtime.sampling.sample_batch.

The host builds one table for the whole batch: per job its row, top-k, logprobs request,
temperature, top-p, min-p and the uniform its own generator draws (exactly where sample() draws
it, so seeded streams stay those of the numpy backend; passed as float64), followed by the penalty / logit_bias
deltas (engine.runtime.sampling.logit_deltas) and the packed token masks of constrained rows (applied
as the row is copied to scratch: cleared ids become -inf). One upload, one launch (a block per job), one download of
[jobs, 42] words: the token, its logprob and the top logprobs. The [batch, vocab] logits stay on
the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import cupy as cp
import numpy as np

from engine.ops import kernels as K
from engine.ops.gpu.sample_table import (  # (the table's layout, shared with the kernel)
    JOB_WORDS,
    OUT_IDS,
    OUT_LP,
    OUT_LPS,
    OUT_TOKEN,
    OUT_WORDS,
    SMEM,
    THREADS,
    job_table,
)
from engine.runtime.sampling import SampleJob


def sample_rows(logits: cp.ndarray, jobs: Sequence[SampleJob], upload=cp.asarray, ahead=None) -> list:
    """sample() for each job, drawn on the device from logits [rows, vocab] (float32).
    upload(int32 numpy array) -> the same int32 array on the device. ahead(): host work to do
    while the device finishes the step, before the draw's results are read back."""
    if not jobs:
        return []
    logits = cp.ascontiguousarray(logits, dtype=cp.float32)
    vocab = logits.shape[-1]
    table, ndelta, nwork = job_table(jobs, vocab)
    dev = upload(table)
    if dev.dtype != cp.int32:
        raise TypeError(f"the job table must reach the device as int32, not {dev.dtype}")
    nh = len(jobs) * JOB_WORDS
    work = cp.empty((nwork, vocab), dtype=cp.float32) if nwork else logits  # (unread without deltas)
    out = cp.empty((len(jobs), OUT_WORDS), dtype=cp.int32)
    K.function_with_smem("sampling", "sample_rows", SMEM)((len(jobs),), (THREADS,), (
        logits, np.int32(vocab), dev, dev[nh:nh + ndelta], dev[nh + ndelta:], dev[nh + 2 * ndelta:], work, out),
        shared_mem=SMEM)
    if ahead is not None:
        ahead()
    host = cp.asnumpy(out)
    hf = host.view(np.float32)
    results = []
    for j, job in enumerate(jobs):
        tok = int(host[j, OUT_TOKEN])
        if not job.params.logprobs:
            results.append((tok, None, None))
            continue
        k = min(job.params.top_logprobs, vocab)
        top = [(int(host[j, OUT_IDS + a]), float(hf[j, OUT_LPS + a])) for a in range(k)]
        results.append((tok, float(hf[j, OUT_LP]), top))
    return results
