"""Token sampling: penalties, temperature, top-k / top-p / min-p truncation, logprobs.

One call samples one token for one sequence from its last-position logits. Every request (and
every choice of an n>1 request) owns its own numpy Generator, so a seeded request draws the
same tokens whatever else shares the batch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax after penalties)
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0 (or negative) = disabled
    min_p: float = 0.0  # drop tokens with p < min_p * p_max, [0, 1]
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted once per earlier occurrence
    logprobs: bool = False
    top_logprobs: int = 0  # how many alternatives to report per position (needs logprobs)
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI logit_bias: (token_id, bias) added first

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def make_rngs(seed: int | None, n: int = 1) -> list[np.random.Generator]:
    """Independent generators for the n choices of a request.

    Child i of a seed's SeedSequence does not depend on n, so choice 0 of a seeded n=3 request
    draws exactly what the same seeded n=1 request draws.
    """
    children = np.random.SeedSequence(seed).spawn(n)
    return [np.random.Generator(np.random.PCG64(c)) for c in children]


def logit_deltas(generated_ids: Sequence[int], presence: float, frequency: float,
                 logit_bias: Sequence[tuple[int, float]], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """What penalties and logit_bias add to the logits: (unique ids, float64 deltas), so that
    logits[ids] += deltas. Penalties follow OpenAI: c[j] * frequency + (c[j] > 0) * presence is
    subtracted for the c[j] earlier occurrences of j; bias ids outside the vocabulary are ignored."""
    ids = np.zeros(0, dtype=np.int64)
    vals = np.zeros(0, dtype=np.float64)
    if (presence != 0.0 or frequency != 0.0) and len(generated_ids):
        ids, counts = np.unique(np.asarray(generated_ids, dtype=np.int64), return_counts=True)
        keep = (ids >= 0) & (ids < vocab)
        ids, vals = ids[keep], -(counts[keep] * frequency + presence)
    if logit_bias:
        b_ids = np.array([t for t, _ in logit_bias], dtype=np.int64)
        b_vals = np.array([b for _, b in logit_bias], dtype=np.float64)
        keep = (b_ids >= 0) & (b_ids < vocab)
        ids, inv = np.unique(np.concatenate([ids, b_ids[keep]]), return_inverse=True)
        vals = np.bincount(inv, weights=np.concatenate([vals, b_vals[keep]]), minlength=ids.size)
    return ids, vals


def apply_penalties(
    logits: np.ndarray, generated_ids: Sequence[int], presence: float, frequency: float
) -> np.ndarray:
    """OpenAI's definition: logit[j] -= c[j] * frequency + (c[j] > 0) * presence (returns a copy)."""
    out = np.array(logits, dtype=np.float64)
    ids, vals = logit_deltas(generated_ids, presence, frequency, (), out.shape[-1])
    out[ids] += vals
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted)))


def allowed_mask(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Tokens that survive top-k, top-p and min-p for these (already penalised) logits.

    Truncation acts on the temperature-scaled distribution (top-k is unaffected by it; top-p and
    min-p are not). The most likely token always survives.
    """
    vocab = logits.shape[-1]
    scaled = logits / params.temperature if params.temperature > 0 else logits
    mask = np.isfinite(scaled)
    if params.top_k and 0 < params.top_k < vocab:
        kth = np.partition(scaled, vocab - params.top_k)[vocab - params.top_k]
        mask &= scaled >= kth
    if params.top_p < 1.0 or params.min_p > 0.0:
        masked = np.where(mask, scaled, -np.inf)
        probs = np.exp(masked - np.max(masked))
        probs /= probs.sum()
        if params.min_p > 0.0:
            mask &= probs >= params.min_p * probs.max()
        if params.top_p < 1.0:
            top = np.zeros(vocab, dtype=bool)
            top[nucleus(probs, params.top_p)] = True
            mask &= top
    mask[int(np.argmax(scaled))] = True
    return mask


def nucleus(probs: np.ndarray, top_p: float, first: int = 1024) -> np.ndarray:
    """The smallest prefix of the tokens in descending probability (ties by id) whose mass reaches
    top_p, the token crossing it included. Sorts only the `first` most likely tokens (and their
    ties), widening while their mass falls short: a full sort of a 129k vocabulary costs ~20 ms
    per token, and the nucleus is almost always a few hundred tokens. Same ids, same sums."""
    vocab = probs.shape[-1]
    m = min(first, vocab)
    while True:
        if m >= vocab:
            order = np.argsort(-probs, kind="stable")
        else:  # every token at least as likely as the m-th, in id order, then stably by probability
            cand = np.flatnonzero(probs >= np.partition(probs, vocab - m)[vocab - m])
            order = cand[np.argsort(-probs[cand], kind="stable")]
        cum = np.cumsum(probs[order])  # the same prefix sums a full sort would give
        if order.size == vocab or cum[-1] >= top_p:
            return order[: int(np.searchsorted(cum, top_p, side="left")) + 1]
        m *= 4


def token_mask(mask: np.ndarray, vocab: int) -> np.ndarray:
    """A packed token mask (int32 words, bit i of word w allowing id 32 * w + i, llguidance's
    layout) as booleans [vocab]; ids past its words are disallowed."""
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype=np.int32).view(np.uint8), bitorder="little")
    out = np.zeros(vocab, dtype=bool)
    n = min(vocab, bits.size)
    out[:n] = bits[:n].astype(bool)
    return out


def adjusted_logits(logits: np.ndarray, params: SamplingParams, generated_ids: Sequence[int],
                    mask: np.ndarray | None = None) -> np.ndarray:
    """float64 logits [vocab] after the packed token mask (-inf), penalties and logit_bias: greedy
    takes their argmax, truncation and temperature act on them (sample, speculative.target_probs)."""
    x = np.array(logits, dtype=np.float64)
    if mask is not None:
        x[~token_mask(mask, x.shape[-1])] = -np.inf
    ids, vals = logit_deltas(generated_ids, params.presence_penalty, params.frequency_penalty,
                             params.logit_bias, x.shape[-1])
    x[ids] += vals
    return x


def allowed_weights(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The distribution a non-greedy draw takes from adjusted logits x: (allowed ids in id order,
    their unnormalised probabilities exp((x - max) / temperature))."""
    ids = np.flatnonzero(allowed_mask(x, params))
    scaled = x[ids] / params.temperature
    return ids, np.exp(scaled - np.max(scaled))


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    generated_ids: Sequence[int],
    rng: np.random.Generator,
    mask: np.ndarray | None = None,
) -> tuple[int, float | None, list[tuple[int, float]] | None]:
    """Pick the next token from logits [vocab].

    mask: a packed token mask (token_mask) of constrained decoding: disallowed ids get -inf before
    penalties, temperature and truncation, greedy included (it must allow at least one id).

    Returns (token_id, logprob, top_logprobs). logprob / top_logprobs are None unless
    params.logprobs; they are the model's own distribution (log-softmax of the raw logits,
    before penalties, temperature and truncation), as vLLM reports by default.
    top_logprobs is [(token_id, logprob)] in descending order (ties by id), length
    params.top_logprobs.
    """
    x = adjusted_logits(logits, params, generated_ids, mask)
    if params.greedy:
        token = int(np.argmax(x))
    else:
        # inverse-CDF draw over the allowed ids in id order: one uniform per token keeps seeded
        # streams reproducible. (The CDF over the whole vocabulary only adds exact zeros between
        # allowed ids, so these prefix sums, and the id drawn, are the same.)
        ids, weights = allowed_weights(x, params)
        cum = np.cumsum(weights)
        j = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
        token = int(ids[min(j, ids.size - 1)])  # (float edge at the top: the last allowed id)
    if not params.logprobs:
        return token, None, None
    return (token, *token_logprobs(logits, token, params.top_logprobs))


def token_logprobs(logits: np.ndarray, token: int, top_logprobs: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of token, top_logprobs [(id, logprob)] in descending order, ties by id) under the
    model's own distribution at these logits [vocab] (sample's logprobs; speculative decoding
    reports each emitted token's from its own verify row)."""
    lp = _log_softmax(np.asarray(logits, dtype=np.float64))
    top: list[tuple[int, float]] = []
    k = min(int(top_logprobs), lp.shape[-1])
    if k > 0:
        vocab = lp.shape[-1]
        idx = np.flatnonzero(lp >= np.partition(lp, vocab - k)[vocab - k])  # the k largest and ties
        idx = idx[np.argsort(-lp[idx], kind="stable")][:k]
        top = [(int(i), float(lp[i])) for i in idx]
    return float(lp[token]), top


@dataclass
class SampleJob:
    """One token to draw from row `row` of a step's logits."""

    row: int
    params: SamplingParams
    generated: Sequence[int]  # this sequence's tokens so far (penalties)
    rng: np.random.Generator
    mask: np.ndarray | None = None  # packed token mask of constrained decoding (token_mask), or None


# Rows of a batch are sampled on several threads when the vocabulary is large (numpy releases the
# GIL in its full-vocabulary passes: at 129k ids one draw costs 1-6 ms); each job owns its own
# generator, so the tokens do not depend on the threads.
PARALLEL_SAMPLE_VOCAB = 16384


@functools.cache
def _sample_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="sample")


def sample_batch(logits: np.ndarray, jobs: Sequence[SampleJob]) -> list:
    """sample() for each job on host logits [rows, vocab], in order (the numpy backend's way;
    the CuPy backend draws on the device: engine/ops/gpu/sampling.py)."""
    def one(j: SampleJob):
        return sample(logits[j.row], j.params, j.generated, j.rng, j.mask)

    if len(jobs) < 2 or logits.shape[-1] < PARALLEL_SAMPLE_VOCAB:
        return [one(j) for j in jobs]
    return list(_sample_pool().map(one, jobs))
