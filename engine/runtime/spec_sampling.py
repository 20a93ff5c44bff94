"""Speculative sampling's two draws as backend ops, the host rule here: what the numpy backend runs
(NumpyOps.draw_drafts / verify_rows) and the reference the GPU's kernels are tested against
(engine/ops/gpu/spec_sampling.py). Each job draws its uniforms from its own generator in the order
engine/runtime/speculative.py documents, so a seeded request reproduces on either backend.

- draw_drafts: one position of a draft block. Each sequence draws its token from the draft's
  distribution q = softmax(logits / temperature) at one host uniform (inverse CDF, as
  sampling.sample draws), or takes the argmax (temperature <= 0); q is kept for verify.
- verify_batch: each sequence's k + 1 verify rows through the verify rule (speculative.verify:
  greedy longest agreeing prefix, or rejection sampling against q), and the logprobs of the
  tokens it emits, each from its own row (as plain decoding reports them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from engine.runtime.sampling import SamplingParams, token_logprobs
from engine.runtime.speculative import verify


@dataclass
class VerifyJob:
    """One free sequence's verify rows: rows row .. row + k of the step's logits hold the main
    model's logits at [last token, drafts 0 .. k-1]; probs: the draft's q rows [>= k, vocab] (a
    backend array, what draw_drafts kept) for a sampled sequence, None for a greedy one."""

    row: int
    drafts: Sequence[int]
    probs: Any
    params: SamplingParams
    generated: Sequence[int]  # the sequence's tokens so far (penalties)
    rng: np.random.Generator


class Verdict(NamedTuple):
    """What one sequence's verify emits: tokens (drafts 0 .. kept-1, then the main model's own),
    how many drafts it kept, and each token's (logprob, top_logprobs) where its params ask."""

    tokens: list[int]
    kept: int
    logprobs: list | None


def draw_drafts(logits: np.ndarray, rows: Sequence[int], temperatures: Sequence[float],
                uniforms: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Draft tokens from rows `rows` of logits [*, vocab] (the Markov bias added): tokens [len(rows)]
    int64, and q [len(rows), vocab] float64, the distribution each was drawn from (zeros for an
    argmax row). Row b draws at uniforms[b] from softmax(logits / temperatures[b]) in float64."""
    x = np.asarray(logits)[list(rows)]
    tokens = np.argmax(x, axis=1).astype(np.int64)
    probs = np.zeros(x.shape, np.float64)
    for b, (t, u) in enumerate(zip(temperatures, uniforms, strict=True)):
        if t <= 0.0:
            continue
        q = _softmax64(np.asarray(x[b], np.float64) / t)
        c = np.cumsum(q)
        tokens[b] = min(int(np.searchsorted(c, u * c[-1], side="right")), q.size - 1)
        probs[b] = q
    return tokens, probs


def verify_batch(logits: np.ndarray, jobs: Sequence[VerifyJob]) -> list[Verdict]:
    """Each job's verdict from host logits [rows, vocab] (speculative.verify; a sampled job takes
    k + 1 uniforms from its generator, a greedy one none)."""
    out = []
    for j in jobs:
        k = len(j.drafts)
        x = np.asarray(logits[j.row : j.row + k + 1], np.float32)
        q = None if j.probs is None else np.asarray(j.probs[:k], np.float64)
        tokens, n = verify(x, j.drafts, q, j.params, j.generated, j.rng)
        lps = [token_logprobs(x[r], t, j.params.top_logprobs) for r, t in enumerate(tokens)] \
            if j.params.logprobs else None
        out.append(Verdict(tokens, n, lps))
    return out


def _softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
