"""Sampling on the device (kernels/sampling.cu): the CuPy backend's engine.runtime.sampling.sample_batch.

The host builds one table for the whole batch: per job its row, top-k, logprobs request,
temperature, top-p, min-p and the uniform its own generator draws (exactly where sample() draws
it, so seeded streams stay those of the numpy backend; passed as float64), followed by the penalty / logit_bias
deltas (engine.runtime.sampling.logit_deltas) and the packed token masks of constrained rows (applied
as the row is copied to scratch: cleared ids become -inf). One upload, one launch (a block per job), one download of
[jobs, 43] words: the token, its logprob, the top logprobs (and a verify row's verdict). The
[batch, vocab] logits stay on the device. Speculative sampling's draws run on the same kernel
(engine/ops/gpu/spec_sampling.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import cupy as cp
import numpy as np

from engine.ops import kernels as K
from engine.ops.gpu.common import _NULL
from engine.ops.gpu.sample_table import (  # (the table's layout, shared with the kernel)
    JOB_WORDS,
    OUT_ACCEPT,
    OUT_IDS,
    OUT_LP,
    OUT_LPS,
    OUT_TOKEN,
    OUT_WORDS,
    SMEM,
    THREADS,
    SpecRow,
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
    out = launch(logits, jobs, upload)
    if ahead is not None:
        ahead()
    return results(cp.asnumpy(out), jobs, logits.shape[-1])


def launch(logits: cp.ndarray, jobs: Sequence[SampleJob], upload=cp.asarray,
           spec: Sequence[SpecRow] | None = None) -> cp.ndarray:
    """The kernel over C-contiguous float32 logits [rows, vocab] for these jobs (and their
    speculative words, sample_table.SpecRow); its output [jobs, OUT_WORDS] int32 on the device, not
    read back."""
    vocab = logits.shape[-1]
    table, ndelta, nwork = job_table(jobs, vocab, spec)
    dev = upload(table)
    if dev.dtype != cp.int32:
        raise TypeError(f"the job table must reach the device as int32, not {dev.dtype}")
    nh = len(jobs) * JOB_WORDS
    work = cp.empty((nwork, vocab), dtype=cp.float32) if nwork else logits  # (unread without deltas)
    out = cp.empty((len(jobs), OUT_WORDS), dtype=cp.int32)
    K.function_with_smem("sampling", "sample_rows", SMEM)((len(jobs),), (THREADS,), (
        logits, np.int32(vocab), dev, dev[nh:nh + ndelta], dev[nh + ndelta:], dev[nh + 2 * ndelta:], work, out),
        shared_mem=SMEM)
    return out


def results(host: np.ndarray, jobs: Sequence[SampleJob], vocab: int) -> list:
    """Each job's (token, logprob, top_logprobs) from the kernel's output read back [jobs, OUT_WORDS]
    (logprob and top_logprobs None unless its params ask for logprobs)."""
    hf = host.view(np.float32)
    out = []
    for j, job in enumerate(jobs):
        tok = int(host[j, OUT_TOKEN])
        if not job.params.logprobs:
            out.append((tok, None, None))
            continue
        k = min(job.params.top_logprobs, vocab)
        top = [(int(host[j, OUT_IDS + a]), float(hf[j, OUT_LPS + a])) for a in range(k)]
        out.append((tok, float(hf[j, OUT_LP]), top))
    return out


def accepted(host: np.ndarray) -> np.ndarray:
    """Which verify rows kept their draft, from the kernel's output read back [jobs, OUT_WORDS]."""
    return host[:, OUT_ACCEPT] != 0


ARGMAX_SLICE = 2048  # kernels/sampling.cu AA_SLICE: columns per block of add_argmax
ARGMAX_ROWS = 1 << 12  # rows one add_argmax launch takes (one int32 block counter each)


def add_argmax(x: cp.ndarray, bias: cp.ndarray | None, out: cp.ndarray, counters: cp.ndarray) -> cp.ndarray:
    """x [rows, vocab] float32 (rows may be strided, columns contiguous) += bias [rows, vocab] in
    place; out [rows] int64 (may be strided) = each row's argmax as numpy's (the first on ties, NaN
    above all). One launch per ARGMAX_ROWS rows; counters: ARGMAX_ROWS int32 zeros that the kernel
    leaves zeroed, never used by two launches at once. Returns out."""
    rows, vocab = x.shape
    if x.dtype != cp.float32 or x.strides[1] != 4 or out.dtype != cp.int64 or out.shape != (rows,):
        raise TypeError(f"add_argmax: x {x.dtype} {x.strides}, out {out.dtype} {out.shape}")
    if bias is not None:
        bias = cp.ascontiguousarray(bias, dtype=cp.float32)
        if bias.shape != x.shape:
            raise ValueError(f"add_argmax: bias {bias.shape} for x {x.shape}")
    s = -(-vocab // ARGMAX_SLICE)
    fn = K.function("sampling", "add_argmax")
    for r0 in range(0, rows, ARGMAX_ROWS):
        n = min(ARGMAX_ROWS, rows - r0)
        part = cp.empty((n, s), dtype=cp.uint64)
        b = bias[r0:] if bias is not None else None
        fn((s, n), (256,), (x[r0:], np.int64(x.strides[0] // 4), b if b is not None else _NULL,
                            np.int64(vocab), np.int32(vocab), part, counters, out[r0:],
                            np.int64(out.strides[0] // 8)))
    return out
