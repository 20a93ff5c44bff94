"""Constrained decoding under speculation: a draft the grammar allows, and the grammar's mask at
every verify position (engine/runtime/speculative.py's Masks).

A sequence's matcher holds every emitted token (the scheduler feeds each one as it is emitted), so
its mask is the one for the token after them: verify position 0. The draft is walked on a copy of
the matcher (TokenConstraint.fork: a deep copy, cheap beside a mask), which leaves the sequence's
own matcher as it was: position i's mask is the copy's after drafts 0 .. i-1, and verify only
reaches position i when it kept them, so each mask is the one plain decoding would apply there.

The draft proposes greedily from its own logits with each position's mask applied (a token the
grammar refuses would be rejected anyway). DSpark's Markov head biases position i by the token
drafted before it, so where a mask changes the draft's pick, the next position's bias is the one
of the token actually drafted. The draft's choice never affects exactness (verify weighs greedy
drafts as point masses), only how many tokens a step keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from engine.runtime.constraint import Constrainer, TokenConstraint
from engine.runtime.sampling import token_mask

# (dsp, draft state, last token, k) -> (drafts, masks [len(drafts) + 1]): spec_decode's SpecJob.guide
Drafter = Callable[..., tuple[list[int], list[np.ndarray | None]]]


def guided_drafter(tc: TokenConstraint, constrainer: Constrainer, eos: Iterable[int]) -> Drafter:
    """The drafter of a sequence whose matcher is tc (spec_decode.SpecJob.guide)."""
    stops = {int(t) for t in eos}

    def draft(dsp, ds, last: int, k: int) -> tuple[list[int], list[np.ndarray | None]]:
        return guided_draft(dsp, ds, last, k, tc, constrainer, stops)

    return draft


def guided_draft(dsp, ds, last: int, k: int, tc: TokenConstraint, constrainer: Constrainer,
                 stops: set[int]) -> tuple[list[int], list[np.ndarray | None]]:
    """Up to k drafted tokens after `last` that the grammar allows in order, and the masks of verify
    positions 0 .. len(drafts) (None: unconstrained there). Drafting ends at a stop id (nothing
    after it is emitted) or where the grammar refuses the token (its mask allowed nothing else)."""
    masks = constrainer.masks([tc])
    if k <= 0:
        return [], masks
    d = dsp.draft(ds, last)
    ops = dsp.ops
    logits, proposed = ops.to_host(d.logits), [int(t) for t in ops.to_host(d.tokens)]
    walk, drafts, prev = tc.fork(), [], int(last)
    for i in range(k):
        row = np.array(logits[i], dtype=np.float64)
        biased_by = int(last) if i == 0 else proposed[i - 1]
        if prev != biased_by:  # the Markov bias of the token drafted before it, not of the unmasked pick
            row += _markov_bias(dsp, prev) - _markov_bias(dsp, biased_by)
        if masks[-1] is not None:
            row[~token_mask(masks[-1], row.shape[-1])] = -np.inf
        tok = int(np.argmax(row))
        if not walk.advance(tok):
            break
        drafts.append(tok)
        if tok in stops:
            masks.append(None)  # (verify may weigh the row after a stop; nothing there is emitted)
            break
        masks.append(constrainer.masks([walk])[0])
        prev = tok
    return drafts, masks


def _markov_bias(dsp, prev: int) -> np.ndarray:
    """The Markov head's bias [vocab] after token prev."""
    ops = dsp.ops
    bias, _ = dsp.markov_head(ops.asarray(np.array([prev], np.int64), dtype=np.int64))
    return np.asarray(ops.to_host(bias)[0], dtype=np.float64)
