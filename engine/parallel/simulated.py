"""N numpy ranks of one model in one process: the sharding math checked on CPUs.

Each rank loads only its slices and keeps its own (replicated) sequence state; the collectives
are plain sums and concatenations (engine/parallel/lockstep.py combine). As on the GPUs
(engine/parallel/gpu.py), the caller sees one SequenceState per sequence, the first rank's, the
others' copies in its `replicas`; a checkpoint with DSpark draft layers speculates through
`draft` (engine/parallel/draft.py).
"""

from __future__ import annotations

import numpy as np

from engine.parallel.draft import ShardedDraft, rank_targets, replica
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
        self.draft = ShardedDraft(self) if self.ranks[0].model.dspark is not None else None

    @property
    def ops(self):
        return self.ranks[0].ops

    def lockstep(self, fns: list) -> list:
        """One function per rank run to its end, their collectives combined; each one's result."""
        return run_ranks(fns)

    def new_state(self):
        states = [m.new_state() for m in self.ranks]
        states[0].replicas = states[1:]
        return states[0]

    def forward(self, states: list, chunks: list, all_logits: bool = False, on_device: bool = False,
                targets: dict | None = None, verify: bool = False):
        """ModelRunner.forward over every rank (targets: a RankTargets from `draft.targets`, each
        rank filling its own)."""
        tg = rank_targets(targets, self.size)
        outs = self.lockstep([lambda r=r, m=m: m.forward([replica(s, r) for s in states], chunks, all_logits,
                                                         on_device, tg[r], verify)
                              for r, m in enumerate(self.ranks)])
        host = [self._host_rows(o) for o in outs]
        for o in host[1:]:  # every rank ends with the full (gathered) logits
            if not all(np.array_equal(a, b) for a, b in zip(o, host[0], strict=True)):
                raise RuntimeError("ranks disagree on the gathered logits")
        return outs[0]

    def _host_rows(self, logits) -> list:
        """A forward's logits as host arrays (on_device gives one backend array)."""
        return [np.asarray(self.ops.to_host(a)) for a in (logits if isinstance(logits, list) else [logits])]
