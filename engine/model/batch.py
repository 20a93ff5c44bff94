"""What one forward step hands the model: its rows, its sequences and their positions.

The runner (engine/runtime/runner.py) builds a Batch for every step and may shrink it between
layers (bounded replay); the model reads it and never decides how the step runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from engine.state.sequence import SequenceState


@dataclass
class Seq:
    """One sequence's slice of the flattened batch."""

    state: SequenceState
    rows: slice
    pos: np.ndarray  # absolute positions of its new tokens
    shared: dict = field(default_factory=dict)  # this step's V4.1 group publications: top-k mask, candidates


@dataclass
class Batch:
    """A step's rows as the model sees them.

    ids, hash_ids and rope are per row (backend arrays). `chunks` are the sequences whose rows
    take the prompt-chunk attention (one sequence at a time, against its state); `plans` (one
    staged engine/state/decode_plan.py LayerPlan per layer) covers the sequences fed one token
    on V4.1's batched decode path, at rows `dec_rows` (None: they are every row)."""

    ids: Any
    hash_ids: Any
    rope: dict  # "main" / "compress" -> (cos, sin), per row
    chunks: list[Seq]
    plans: list | None = None
    dec_rows: Any = None
    published: dict = field(default_factory=dict)  # what decode rows' index sources publish to later layers
    # The DSpark draft's inputs (engine/model/dspark.py), collected only when asked: layer index ->
    # the mean of the streams entering that layer (after its Engram), per row of the step. None:
    # nothing is collected and the forward is unchanged.
    targets: dict | None = None

    def take(self, idx) -> None:
        """Keep only rows idx (a backend int64 array)."""
        self.ids = self.ids[idx]
        self.rope = {k: (c[idx], s[idx]) for k, (c, s) in self.rope.items()}
        if self.hash_ids is not None:
            self.hash_ids = self.hash_ids[idx]


class Projected(NamedTuple):
    """Token-wise outputs of a V4.1 layer's compressor / indexer projections (None where the
    layer has no such part): compressor kv / gate of every row (ratio > 1 sources), the RoPE'd
    quantized entry and indexer key of every row (ratio-1 sources: each token is a group), the
    indexer's query and head weights (index sources)."""

    comp_kv: Any = None
    comp_gate: Any = None
    entry: Any = None
    idx_key: Any = None
    idx_q: Any = None
    idx_w: Any = None

    def rows(self, r: slice) -> Projected:
        return Projected(*(None if a is None else a[r] for a in self))

    def take(self, idx) -> Projected:
        """The rows at indices idx (a backend int64 array), gathered."""
        return Projected(*(None if a is None else a[idx] for a in self))
