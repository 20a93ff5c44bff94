"""A sequence's DSpark draft state: each draft layer's window of K=V rows projected from the main
model's positions.

Every draft layer keeps the K=V of main_x (main_norm(main_proj(the target layers' inputs)), see
engine/model/dspark.py) at the sequence's last `sliding_window` positions, on the window's FP8
grid like the main layers' windows. A draft block's queries see all of them plus the block itself.
It is small (draft layers x window x head_dim) and belongs to one sequence, beside its
SequenceState: it grows with every main forward of that sequence (DSpark.absorb) and the draft
itself (DSpark.draft) only reads it, so a rejected draft leaves no trace in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
