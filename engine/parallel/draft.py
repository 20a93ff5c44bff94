"""The DSpark draft of a model split over tensor-parallel ranks.

Each rank's ModelRunner holds its slice of the draft layers (engine/checkpoint/dspark_schema.py:
heads, experts, the shared expert's width and the Markov head's vocabulary rows, as the main
layers split) and its own DSpark over them, whose collectives the lockstep driver combines
(engine/parallel/lockstep.py). ShardedDraft offers the one-rank DSpark's interface to
engine/runtime/spec_decode.py: every call runs each rank's draft in lockstep on that rank's copy of
the draft states (DraftState.replicas), and answers with the first rank's result.

A drawn draft must be the same on every rank, or the ranks' windows and the verify chunks part:
every rank sees the same gathered logits, and draws with its own copy of each sequence's
generator taken in the same state before the step; the first rank's copies are the sequences'
own, so they advance as on one rank. The tokens are compared after each draft.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np

from engine.state.draft import DraftState


class RankTargets(dict):
    """What a verify step or a prompt chunk asks the main forward for (DSpark.targets), on every
    rank: the first rank's fills this dict, rank r > 0 its own in `others[r - 1]`."""

    def __init__(self, layer_ids, size: int) -> None:
        super().__init__(dict.fromkeys(layer_ids))
        self.others = [dict.fromkeys(layer_ids) for _ in range(size - 1)]

    def rank(self, r: int) -> dict:
        return self if r == 0 else self.others[r - 1]


def rank_targets(targets: dict | None, size: int) -> list:
    """Each rank's targets dict for one forward (None: none asked for)."""
    if targets is None:
        return [None] * size
    if isinstance(targets, RankTargets):
        return [targets.rank(r) for r in range(size)]
    return [targets] + [dict.fromkeys(targets) for _ in range(size - 1)]  # (only the first rank's kept)


def replica(state, r: int):
    """Rank r's copy of a state (a SequenceState or a DraftState): the state itself on rank 0."""
    return state if r == 0 else state.replicas[r - 1]


class ShardedDraft:
    """DSpark's interface (engine/model/dspark.py) over a lockstep driver's ranks (`driver.ranks`,
    ModelRunners each with its draft, and `driver.lockstep(fns)`, which runs one function per rank
    to its end, combining their collectives)."""

    def __init__(self, driver) -> None:
        self.driver = driver
        self.drafts = [m.model.dspark for m in driver.ranks]
        first = self.drafts[0]
        self.cfg, self.block_size, self.noise_token_id = first.cfg, first.block_size, first.noise_token_id
        self.target_layer_ids = first.target_layer_ids

    @property
    def ops(self):
        return self.drafts[0].ops

    @property
    def targets(self) -> RankTargets:
        return RankTargets(self.target_layer_ids, len(self.drafts))

    def _each(self, fn: Callable) -> list:
        """fn(rank, its DSpark) on every rank, in lockstep; each rank's result."""
        return self.driver.lockstep([lambda r=r, d=d: fn(r, d) for r, d in enumerate(self.drafts)])

    def new_state(self, position: int = 0) -> DraftState:
        states = self._each(lambda r, d: d.new_state(position))
        states[0].replicas = states[1:]
        return states[0]

    def draft_many(self, states: list[DraftState], last_tokens: list[int], rngs: list | None = None,
                   temperatures: list[float] | None = None, ahead: Callable[[], None] | None = None,
                   tokens_only: bool = False) -> list:
        rngs = list(rngs or [None] * len(states))
        per_rank = [rngs] + [[copy.deepcopy(g) for g in rngs] for _ in self.drafts[1:]]
        outs = self._each(lambda r, d: d.draft_many([replica(s, r) for s in states], last_tokens, per_rank[r],
                                                    temperatures, tokens_only=tokens_only))
        for other in outs[1:]:
            if any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(outs[0], other, strict=True)):
                raise RuntimeError("tensor-parallel ranks drafted different tokens")
        if ahead is not None:  # (the ranks ran synchronously: the host work follows them)
            ahead()
        return outs[0]

    def draft(self, state: DraftState, last_token: int, rng=None, temperature: float = 1.0):
        return self.draft_many([state], [last_token], [rng], [temperature])[0]

    def markov_head(self, ids):
        return self._each(lambda r, d: d.markov_head(ids))[0]

    def absorb(self, state: DraftState, targets: RankTargets, n: int) -> None:
        self._each(lambda r, d: d.absorb(replica(state, r), targets.rank(r), n))

    def absorb_many(self, states: list[DraftState], targets: RankTargets, ns: list[int]) -> None:
        self._each(lambda r, d: d.absorb_many([replica(s, r) for s in states], targets.rank(r), ns))

    def absorb_kept(self, states: list[DraftState], targets: RankTargets, lengths: list[int],
                    keeps: list[int]) -> None:
        self._each(lambda r, d: d.absorb_kept([replica(s, r) for s in states], targets.rank(r), lengths, keeps))
