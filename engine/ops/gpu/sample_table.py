"""The device sampler's job table (kernels/sampling.cu), built on the host; importable without cupy
(the host profiler times it on any machine)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from engine.runtime.sampling import SampleJob, logit_deltas

# kernels/sampling.cu J_* / O_* / SMP_*
JOB_ROW, JOB_TOPK, JOB_NTOP, JOB_PEN0, JOB_PEN1, JOB_WORK = 0, 1, 2, 3, 4, 5
JOB_TEMP, JOB_TOPP, JOB_MINP, JOB_MASK, JOB_U = 6, 7, 8, 9, 10  # JOB_U: a float64 in words 10-11
JOB_MODE, JOB_DRAFT, JOB_Q, JOB_UA = 12, 13, 14, 16  # JOB_Q: a u64 address; JOB_UA: a float64
JOB_WORDS = 18
MODE_DRAW, MODE_VERIFY, MODE_KEEP = 0, 1, 2  # SMP_DRAW, SMP_VERIFY, SMP_KEEP
TOP_N = 20
OUT_TOKEN, OUT_LP, OUT_IDS, OUT_LPS, OUT_ACCEPT, OUT_WORDS = 0, 1, 2, 2 + TOP_N, 2 + 2 * TOP_N, 3 + 2 * TOP_N
THREADS = 1024
SMEM = 256 * (THREADS // 32) * 8  # SMP_SMEM: one 256-bin u64 radix histogram per warp


class SpecRow(NamedTuple):
    """A job's speculative-sampling words (kernels/sampling.cu J_MODE ..): its mode, the draft token a
    verify row tests (-1: the bonus row), the device address of the float32 q row it reads (verify)
    or writes (keep), 0 for none, and its uniforms, already drawn by the caller in the order
    engine/runtime/speculative.py takes them: u_accept tests the draft, u makes the row's draw."""

    mode: int
    draft: int
    q: int
    u_accept: float
    u: float


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


def job_table(jobs: Sequence[SampleJob], vocab: int,
              spec: Sequence[SpecRow] | None = None) -> tuple[np.ndarray, int, int]:
    """The kernel's int32 input [header | delta ids | delta values | token masks] (floats by bit
    pattern); returns it with the number of deltas and of rows that need a scratch copy of their
    logits (rows with deltas or a mask). A constrained job's mask (SampleJob.mask, packed words) is
    cut or zero-padded to mask_words(vocab); JOB_MASK is its offset in the masks, -1 without one.
    Draws each non-greedy job's uniform from its generator, unless `spec` gives every job's words and
    uniforms (speculative sampling). (Built column by column, for the host's time.)"""
    ps = [j.params for j in jobs]
    if any(p.logprobs and p.top_logprobs > TOP_N for p in ps):
        raise ValueError(f"top_logprobs is at most {TOP_N}")
    head = np.zeros((len(jobs), JOB_WORDS), dtype=np.int32)
    hf = head.view(np.float32)
    head[:, JOB_ROW] = [j.row for j in jobs]
    head[:, JOB_TOPK] = [p.top_k if 0 < p.top_k < vocab else 0 for p in ps]
    head[:, JOB_NTOP] = [p.top_logprobs if p.logprobs else -1 for p in ps]
    head[:, JOB_WORK] = -1
    head[:, JOB_MASK] = -1
    hf[:, JOB_TEMP] = [0.0 if p.greedy else p.temperature for p in ps]
    hf[:, JOB_TOPP] = [p.top_p for p in ps]
    hf[:, JOB_MINP] = [p.min_p for p in ps]
    if spec is None:
        us = [0.0 if p.greedy else j.rng.random() for j, p in zip(jobs, ps, strict=True)]
    else:
        us = [r.u for r in spec]
        head[:, JOB_MODE] = [r.mode for r in spec]
        head[:, JOB_DRAFT] = [r.draft for r in spec]
        head[:, JOB_Q:JOB_Q + 2] = np.array([r.q for r in spec], np.uint64).view(np.int32).reshape(-1, 2)
        head[:, JOB_UA:JOB_UA + 2] = np.array([r.u_accept for r in spec], np.float64).view(np.int32).reshape(-1, 2)
    head[:, JOB_U:JOB_U + 2] = np.array(us, np.float64).view(np.int32).reshape(-1, 2)
    ids, vals, masks, off, nwork = [], [], [], 0, 0
    words = mask_words(vocab)
    for j, (job, p) in enumerate(zip(jobs, ps, strict=True)):
        deltas = p.logit_bias or ((p.presence_penalty or p.frequency_penalty) and len(job.generated))
        if not deltas and job.mask is None:
            continue
        head[j, JOB_WORK] = nwork
        nwork += 1
        if job.mask is not None:
            m = np.zeros(words, dtype=np.int32)
            src = np.asarray(job.mask, dtype=np.int32).reshape(-1)[:words]
            m[:src.size] = src
            if vocab % 32:  # (ids past the vocabulary stay cleared)
                m[-1] &= np.uint32((1 << (vocab % 32)) - 1).view(np.int32)
            head[j, JOB_MASK] = len(masks) * words
            masks.append(m)
        if not deltas:
            continue
        d_ids, d_vals = logit_deltas(job.generated, p.presence_penalty, p.frequency_penalty, p.logit_bias, vocab)
        head[j, JOB_PEN0], head[j, JOB_PEN1] = off, off + d_ids.size
        ids.append(d_ids.astype(np.int32))
        vals.append(d_vals.astype(np.float32).view(np.int32))
        off += d_ids.size
    return np.concatenate([head.reshape(-1), *ids, *vals, *masks]), off, nwork
