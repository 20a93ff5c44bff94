"""Speculative decoding's verify rule on the host: which of a draft's k tokens a sequence keeps,
given the main model's logits at the k + 1 positions [last token, draft 0 .. draft k-1]. It is the
numpy backend's ops.verify_rows and the reference of the GPU's (engine/runtime/spec_sampling.py).

Greedy requests keep the longest prefix of drafts that equal the main model's argmax (after the
mask, penalties and logit_bias, exactly as plain greedy decoding picks), then the main model's own
token at the first disagreement, or the bonus token after all k: the same tokens plain greedy
decoding emits, one to k + 1 per step.

Sampled requests use speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft i,
drawn from the draft's distribution q_i, is kept with probability min(1, p_i(x) / q_i(x)), where
p_i is the distribution plain decoding would draw from at that position (target_probs: temperature,
top-k / top-p / min-p, penalties counting the tokens kept before it, bias, mask); on the first
rejection one token is drawn from norm(max(p_i - q_i, 0)) and the step ends; after all k the bonus
token is drawn from p_k. Each emitted token then has exactly plain decoding's distribution.

Randomness: one verify call of a sampled request takes k + 1 uniforms from the sequence's own
generator (u_0 .. u_{k-1} test the drafts, u_k makes the one final draw), whatever is accepted,
so a seeded request reproduces its tokens; the uniforms differ from plain decoding's one per token,
so a seeded speculative stream is not the seeded plain stream (it has the same distribution).
Greedy requests take no uniforms.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from engine.runtime.sampling import SamplingParams, adjusted_logits, allowed_weights

# Per-position packed token masks (sampling.token_mask) of constrained decoding: a sequence of
# k + 1 (entries may be None), or a callable i -> mask that is called only for positions reached,
# with drafts 0 .. i-1 kept (so a grammar can be advanced lazily). Position i is only reached when
# drafts 0 .. i-1 were kept, so mask i is the grammar's state after them.
Masks = Sequence[np.ndarray | None] | Callable[[int], np.ndarray | None] | None


def target_probs(logits_row: np.ndarray, params: SamplingParams, generated: Sequence[int],
                 mask: np.ndarray | None = None) -> np.ndarray:
    """The distribution [vocab] (float64, sums to 1) that plain sampling.sample draws the next token
    from, for these logits, parameters, tokens generated so far and packed mask. Greedy: a point
    mass on the argmax."""
    x = adjusted_logits(logits_row, params, generated, mask)
    p = np.zeros(x.shape[-1], dtype=np.float64)
    if params.greedy:
        p[int(np.argmax(x))] = 1.0
    else:
        ids, weights = allowed_weights(x, params)
        p[ids] = weights / weights.sum()
    return p


def verify(main_logits: np.ndarray, draft_tokens: Sequence[int], draft_probs: np.ndarray | None,
           params: SamplingParams, generated: Sequence[int], rng: np.random.Generator,
           masks: Masks = None) -> tuple[list[int], int]:
    """The tokens one verify step emits for one sequence, and how many of them are drafts.

    main_logits [k + 1, vocab]: the main model's logits at [last token, drafts 0 .. k-1];
    draft_tokens [k]; draft_probs [k, vocab]: the distribution each draft token was drawn from,
    or None for a greedy draft (a point mass on each draft token); generated: the sequence's
    tokens so far (penalties); masks: see Masks. Returns (tokens, n): tokens are draft_tokens[:n]
    followed by one token of the main model's, 1 <= len(tokens) = n + 1 <= k + 1; tokens[j] is
    emitted at row j of main_logits (its logprobs are that row's).
    """
    k = _check(main_logits, draft_tokens, draft_probs)
    if params.greedy:
        out: list[int] = []
        for i in range(k + 1):
            x = adjusted_logits(main_logits[i], params, [*generated, *out], _mask_at(masks, i))
            out.append(int(np.argmax(x)))
            if i == k or out[-1] != int(draft_tokens[i]):
                return out, i
    uniforms = rng.random((1, k + 1))
    tokens, kept = verify_trials(main_logits, draft_tokens, draft_probs, params, generated,
                                 uniforms, masks)
    n = int(kept[0])
    return [int(t) for t in tokens[0, : n + 1]], n


def verify_trials(main_logits: np.ndarray, draft_tokens: Sequence[int],
                  draft_probs: np.ndarray | None, params: SamplingParams, generated: Sequence[int],
                  uniforms: np.ndarray, masks: Masks = None) -> tuple[np.ndarray, np.ndarray]:
    """verify's sampled rule for N independent trials of one step (same inputs, uniforms [N, k + 1]
    each): trial r tests draft i with uniforms[r, i] and makes its final draw with uniforms[r, k].
    Trials still going at position i have all kept drafts 0 .. i-1, so p_i is computed once (and
    only if some trial reaches it). Returns tokens [N, k + 1] (-1 past each trial's last token)
    and the number of drafts each kept [N]."""
    k = _check(main_logits, draft_tokens, draft_probs)
    if params.greedy:
        raise ValueError("verify_trials is the sampled rule; greedy requests use verify")
    vocab = main_logits.shape[-1]
    uniforms = np.asarray(uniforms, dtype=np.float64).reshape(-1, k + 1)
    tokens = np.full(uniforms.shape, -1, dtype=np.int64)
    kept = np.zeros(uniforms.shape[0], dtype=np.int64)
    live = np.arange(uniforms.shape[0])
    prefix = list(generated)
    for i in range(k + 1):
        if live.size == 0:
            break
        p = target_probs(main_logits[i], params, prefix, _mask_at(masks, i))
        if i == k:  # every draft kept: the bonus token
            tokens[live, k] = _draw(p, uniforms[live, k])
            break
        x = int(draft_tokens[i])
        q = _draft_row(draft_probs, i, x, vocab)
        if q is None:  # the draft's own distribution gives x no mass: reject, draw from p itself
            keep, residual = np.zeros(live.size, dtype=bool), p
        else:
            keep, residual = _keep(uniforms[live, i], p[x], q[x]), _residual(p, q)
        out = live[~keep]
        tokens[out, i] = _draw(residual, uniforms[out, k])
        kept[out] = i
        live = live[keep]
        tokens[live, i] = x
        kept[live] = i + 1
        prefix.append(x)
    return tokens, kept


def _check(main_logits: np.ndarray, draft_tokens: Sequence[int],
           draft_probs: np.ndarray | None) -> int:
    k = len(draft_tokens)
    if main_logits.ndim != 2 or main_logits.shape[0] != k + 1:
        raise ValueError(f"main_logits must be [k + 1 = {k + 1}, vocab], got {main_logits.shape}")
    vocab = main_logits.shape[1]
    if draft_probs is not None and draft_probs.shape != (k, vocab):
        raise ValueError(f"draft_probs must be [{k}, {vocab}], got {draft_probs.shape}")
    if any(not 0 <= int(t) < vocab for t in draft_tokens):
        raise ValueError("draft token outside the vocabulary")
    return k


def _mask_at(masks: Masks, i: int) -> np.ndarray | None:
    if masks is None:
        return None
    return masks(i) if callable(masks) else masks[i]


def _draft_row(draft_probs: np.ndarray | None, i: int, x: int, vocab: int) -> np.ndarray | None:
    """q_i as float64 summing to 1, or None when it gives the drafted token no mass (or is not a
    distribution): then the draft was not drawn from it, and the position falls back to p_i."""
    if draft_probs is None:
        q = np.zeros(vocab, dtype=np.float64)
        q[x] = 1.0
        return q
    q = np.asarray(draft_probs[i], dtype=np.float64)
    total = q.sum()
    if not (np.isfinite(total) and total > 0.0) or np.any(q < 0.0) or q[x] <= 0.0:
        return None
    return q / total


def _keep(u: np.ndarray, px: float, qx: float) -> np.ndarray:
    """Which trials keep the draft: P(u * q(x) < p(x)) = min(1, p(x) / q(x)) for u in [0, 1)."""
    return u * qx < px


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(p - q, 0)): what a rejection draws from. It has no mass only when p == q, where
    rejection cannot happen save by rounding; then p itself."""
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0.0 else p


def _draw(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws from p [vocab] for uniforms u [n] in [0, 1): ids, never one of mass 0."""
    cum = np.cumsum(p)
    j = np.searchsorted(cum, u * cum[-1], side="right")
    return np.minimum(j, int(np.flatnonzero(p)[-1]))  # (float edge at the top: the last id with mass)
