"""N numpy ranks of one model in one process: the sharding math checked on CPUs.

Each rank loads only its slices and keeps its own (replicated) sequence state; the collectives
are plain sums and concatenations (engine/parallel/lockstep.py combine).
"""

from __future__ import annotations

import numpy as np

from engine.parallel.lockstep import RankComm, run_ranks
from engine.parallel.shard import ShardPlan


class SimulatedTP:
    def __init__(self, cfg, ckpt, make_ops, size: int, tokenizer_json=None, store_quantized: bool = True,
                 expert_split: str = "ep"):
        from engine.runtime.runner import ModelRunner

        self.size = size
        self.ranks = []
        for r in range(size):
            ops = make_ops()
            ops.comm = RankComm()
            self.ranks.append(ModelRunner(cfg, ckpt, ops, tokenizer_json, store_quantized,
                                          plan=ShardPlan.make(cfg, r, size, expert_split)))

    def new_state(self) -> list:
        return [m.new_state() for m in self.ranks]

    def forward(self, states: list[list], chunks: list, all_logits: bool = False) -> list[np.ndarray]:
        """states[i] is sequence i's per-rank state list."""
        per_rank = [[s[r] for s in states] for r in range(self.size)]
        outs = run_ranks([lambda r=r, m=m: m.forward(per_rank[r], chunks, all_logits)
                          for r, m in enumerate(self.ranks)])
        for o in outs[1:]:  # every rank ends with the full (gathered) logits
            for a, b in zip(o, outs[0], strict=True):
                if not np.array_equal(a, b):
                    raise RuntimeError("ranks disagree on the gathered logits")
        return outs[0]
