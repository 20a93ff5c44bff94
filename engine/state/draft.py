"""A sequence's DSpark draft state: each draft layer's window of K=V rows projected from the main
model's positions.

Every draft layer keeps the K=V of main_x (main_norm(main_proj(the target layers' inputs)), see
engine/model/dspark.py) at the sequence's last `sliding_window` positions, on the window's FP8
grid like the main layers' windows. A draft block's queries see all of them plus the block itself.
It is small (draft layers x window x head_dim) and belongs to one sequence, beside its
SequenceState: it grows with every main forward of that sequence (DSpark.absorb) and the draft
itself (DSpark.draft) only reads it, so a rejected draft leaves no trace in it.

The windows one absorb grows, of all its sequences, are views of one buffer (append_rows): nothing
writes into a window, the next absorb replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class DraftState:
    """position: how many main positions the windows have absorbed (the next block starts there);
    windows[i]: draft layer i's K=V rows of the last min(position, sliding_window) positions, oldest
    first (a backend array [rows, head_dim], float32). Under tensor parallelism every rank keeps
    an identical copy (the draft's K=V head is replicated): the first rank's state carries the
    others' in `replicas`, as SequenceState does."""

    position: int = 0
    windows: list[Any] = field(default_factory=list)
    replicas: list = field(default_factory=list, compare=False, repr=False)

    def clone(self) -> DraftState:
        """An independent copy (the n choices of one prompt fork it with their SequenceState)."""
        return DraftState(self.position, [w.copy() for w in self.windows], [r.clone() for r in self.replicas])


def append_rows(ops, states: list[DraftState], rows: list, counts: list[int], window: int) -> None:
    """states[b].windows[i] becomes the last `window` rows of [its window; rows[i] of state b]:
    rows[i] holds draft layer i's new rows of every state, counts[b] of them for state b, state
    after state. The new windows are views of one buffer, filled with one batch of row copies
    (ops.copy_rows); a state with no new rows keeps its windows."""
    ends = np.cumsum(counts)
    grown = [b for b, c in enumerate(counts) if c]
    # (draft layer, state, rows kept of its window, rows taken of its new ones)
    parts = [(i, b, max(0, min(int(states[b].windows[i].shape[0]), window - counts[b])), min(counts[b], window))
             for i in range(len(rows)) for b in grown]
    if not parts:
        return
    buf = ops.xp.empty((sum(old + new for _, _, old, new in parts), rows[0].shape[1]), dtype=rows[0].dtype)
    jobs, views, at = [], [], 0
    for i, b, old, new in parts:
        w = states[b].windows[i]
        if old:
            jobs.append((w, w.shape[0] - old, buf, at, old))
        jobs.append((rows[i], int(ends[b]) - new, buf, at + old, new))
        views.append(buf[at : at + old + new])
        at += old + new
    ops.copy_rows(jobs)
    for (i, b, _, _), v in zip(parts, views, strict=True):
        states[b].windows[i] = v
