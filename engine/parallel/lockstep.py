"""Running N tensor-parallel ranks in lockstep in one Python thread.

Each rank's forward runs in a greenlet of its own (the `greenlet` package): the model calls
ops.all_reduce / ops.all_gather as DeepSeek's reference calls dist.all_reduce, and a rank's ops
carry a RankComm that switches to the driver there. `run_ranks` resumes every rank until its next
collective, combines their parts (`reduce`: a sum on CPUs; NCCL on GPUs, engine/parallel/gpu.py)
and resumes each with its reply. One thread, so every rank's CUDA work can be captured as that
rank's graph with the collectives inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class Collective:
    op: str  # 'sum' (all-reduce) | 'gather' (all-gather along the last axis) | 'step' (a StepRegion)
    value: object


@dataclass
class StepRegion:
    """A rank's whole decode step offered to the driver (Collective "step"): run(staged inputs)
    is the rank's device work, with its own collectives. The driver runs every rank's step eagerly
    (run_steps) or, on GPUs, as one CUDA graph per rank with the all-reduces inside."""

    key: tuple
    inputs: object  # engine.state.decode_plan.StepInputs
    run: Callable
    ops: object
    rows: int


class RankComm:
    """A rank's `ops.comm` under the driver: every collective waits for the other ranks."""

    def all_reduce(self, x):
        return _to_driver(Collective("sum", x))

    def all_gather(self, x):
        return _to_driver(Collective("gather", x))

    def step(self, region: StepRegion):
        return _to_driver(Collective("step", region))


def _to_driver(msg: Collective):
    from greenlet import getcurrent

    here = getcurrent()
    if here.parent is None:
        raise RuntimeError("a collective outside the lockstep driver (engine/parallel/lockstep.py run_ranks)")
    return here.parent.switch(msg)


def combine(msgs: list[Collective]) -> object:
    """What every rank receives back: the sum of their parts, or their concatenation."""
    op = msgs[0].op  # (run_ranks has checked that every rank asks for it)
    vals = [m.value for m in msgs]
    if op == "sum":
        total = vals[0]
        for v in vals[1:]:
            total = total + v
        return total
    if op == "gather":
        if type(vals[0]).__module__.partition(".")[0] == "cupy":  # (simulated ranks on one GPU)
            import cupy

            return cupy.concatenate(vals, axis=-1)
        return np.concatenate([np.asarray(v) for v in vals], axis=-1)
    raise RuntimeError(f"unknown collective {op!r}")


def run_steps(msgs: list[Collective], reduce=None, contexts=None) -> list:
    """Every rank's StepRegion run eagerly: inputs staged by the rank's backend, its collectives
    driven like the forward's; one result per rank."""
    regions = [m.value for m in msgs]
    return run_ranks([lambda s=s: s.run(s.ops.stage(s.inputs)) for s in regions], reduce, contexts)


class _Done:
    def __init__(self, value) -> None:
        self.value = value


def run_ranks(fns: list[Callable], reduce=None, contexts=None) -> list:
    """Run every rank's fn() to completion in lockstep; returns each rank's return value.
    reduce(msgs) -> one reply per rank (default: everyone gets `combine(msgs)`, and each rank its
    own result of a "step", see run_steps); contexts[r] is entered around every resumption of
    rank r (e.g. its CUDA device)."""
    from greenlet import greenlet  # (only tensor parallelism needs it: one rank runs without)

    lets = [greenlet(fn) for fn in fns]
    ctx = contexts or [contextlib.nullcontext] * len(lets)
    if reduce is None:
        def reduce(msgs: list) -> list:
            if msgs[0].op == "step":
                return run_steps(msgs, None, contexts)
            out = combine(msgs)  # (each rank its own copy, as each GPU has its own buffer)
            return [out] + [out.copy() for _ in msgs[1:]]

    def resume(r: int, value=None, first: bool = False):
        with ctx[r]():
            out = lets[r].switch() if first else lets[r].switch(value)
        return _Done(out) if lets[r].dead else out

    msgs = [resume(r, first=True) for r in range(len(lets))]
    while True:
        done = [isinstance(m, _Done) for m in msgs]
        if all(done):
            return [m.value for m in msgs]
        if any(done):
            raise RuntimeError("ranks finished at different collectives")
        if any(m.op != msgs[0].op for m in msgs):
            raise RuntimeError(f"ranks disagree on the next collective: {[m.op for m in msgs]}")
        replies = reduce(msgs)
        msgs = [resume(r, replies[r]) for r in range(len(lets))]
