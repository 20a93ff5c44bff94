"""Tensor parallelism: which rank holds which slice, and a driver that runs N ranks in lockstep.

The plan (README "Tensor parallelism"): attention heads are split across ranks (wq_b rows,
sinks, the wo_a blocks of the rank's heads, the wo_b columns of its groups; the one shared K=V
head, the compressors and the indexer are replicated, since every head reads the same KV);
routed experts are split by expert id (EP; or by width, `expert_split="width"`) and the shared
expert by width; embedding and head
are vocab-parallel. Everything else (mHC, norms, router, Engram) is replicated. Per layer that
is two all-reduces of [tokens, hidden] (attention output, MoE output), plus one for the
embedding and an all-gather of the logits.

`Model.forward_steps` is a generator that yields at each collective; `run_ranks` advances every
rank's generator to its next collective, combines their contributions and sends the result back.
One Python thread thus drives all ranks: numpy ranks here (the collective is a plain sum, which
tests the sharding math on CPUs), GPU ranks with NCCL later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, replace

import numpy as np


class ShardingError(ValueError):
    """A model that cannot be split over the requested number of ranks."""


EXPERT_SPLITS = ("ep", "width")


def even_range(n: int, rank: int, size: int, unit: int = 1) -> tuple[int, int]:
    """Contiguous near-equal split of n items (in multiples of `unit`) over `size` ranks."""
    units = -(-n // unit)
    base, extra = divmod(units, size)
    lo = rank * base + min(rank, extra)
    hi = lo + base + (1 if rank < extra else 0)
    return min(lo * unit, n), min(hi * unit, n)


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    heads: tuple[int, int]  # local query heads [lo, hi)
    vocab: tuple[int, int]  # local embedding / head rows
    experts: tuple[int, int]  # local routed experts [lo, hi)
    shared_cols: tuple[int, int]  # local slice of the shared expert's width
    expert_cols: tuple[int, int] = (0, 0)  # local slice of every routed expert's width ("width" split)
    expert_split: str = "ep"

    @classmethod
    def make(cls, cfg, rank: int = 0, size: int = 1, expert_split: str = "ep") -> ShardPlan:
        """expert_split: routed experts by expert id ("ep": a rank holds whole experts) or by width
        ("width": every rank holds a slice of every expert, like the shared expert)."""
        if not 0 <= rank < size:
            raise ShardingError(f"rank {rank} outside [0, {size})")
        if expert_split not in EXPERT_SPLITS:
            raise ShardingError(f"expert split {expert_split!r}: one of {', '.join(EXPERT_SPLITS)}")
        h, g = cfg.num_heads, cfg.o_groups
        hpg = h // g
        if size <= h:
            if h % size:
                raise ShardingError(f"{h} attention heads do not split over {size} ranks")
            per = h // size
            if not (per % hpg == 0 or hpg % per == 0):
                raise ShardingError(f"{per} heads per rank straddle the {hpg}-head output groups")
            heads = (rank * per, (rank + 1) * per)
        else:  # more ranks than heads: one head each, the rest hold none (their attention part is 0)
            heads = (rank, rank + 1) if rank < h else (h, h)
        block = (cfg.weight_block_size or (1, 1))[0]
        inter = cfg.moe_intermediate_size
        if expert_split == "width":  # whole scale blocks of FP8 / FP4 rows (w1, w3) and columns (w2)
            cols = even_range(inter, rank, size, unit=max(block, 32))
            experts = (0, cfg.n_routed_experts) if cols[1] > cols[0] else (0, 0)
        else:
            cols, experts = (0, inter), even_range(cfg.n_routed_experts, rank, size)
        return cls(rank=rank, size=size, heads=heads,
                   vocab=even_range(cfg.vocab_size, rank, size, unit=block),
                   experts=experts,
                   shared_cols=even_range(inter * max(cfg.n_shared_experts, 1), rank, size, unit=max(block, 32)),
                   expert_cols=cols, expert_split=expert_split)

    @property
    def single(self) -> bool:
        return self.size == 1

    def owns_expert(self, e: int) -> bool:
        return self.experts[0] <= e < self.experts[1]

    def head_groups(self, cfg) -> list[tuple[int, int, int]]:
        """(group, first local column, last local column) of the wo_a input per touched group,
        in units of heads relative to the group's first head."""
        h0, h1 = self.heads
        hpg = cfg.num_heads // cfg.o_groups
        out = []
        for grp in range(h0 // hpg, (h1 - 1) // hpg + 1) if h1 > h0 else ():
            lo, hi = max(h0, grp * hpg), min(h1, (grp + 1) * hpg)
            out.append((grp, lo - grp * hpg, hi - grp * hpg))
        return out


def slice_bounds(name: str, fmt: str, block: tuple[int, int] | None, shape: tuple[int, ...],
                 rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> tuple:
    """((r0, r1), (c0, c1), scale rows, scale cols) of a slice of a weight stored as `fmt` with
    logical `shape`; the scale ranges are None for dense formats. Block-scaled slices must fall on
    block boundaries (ShardingError otherwise). slice_weight and the memory planner both use it."""
    r0, r1 = rows if rows is not None else (0, shape[0])
    c0, c1 = cols if cols is not None else (0, shape[1])
    if fmt in ("bf16", "f32"):
        return (r0, r1), (c0, c1), None, None
    if fmt not in ("fp8", "fp4"):
        raise ShardingError(f"{name}: cannot slice format {fmt}")
    bn, bk = block
    n, k = shape

    def aligned(a: int, b: int, unit: int, end: int) -> bool:
        return a % unit == 0 and (b % unit == 0 or b == end)

    if not (aligned(r0, r1, bn, n) and aligned(c0, c1, bk, k)):
        raise ShardingError(f"{name}: slice rows {r0}:{r1} cols {c0}:{c1} is not aligned to its {bn}x{bk} blocks")
    scale_cols = (c0 // bk, -(-c1 // bk))
    if fmt == "fp8":
        return (r0, r1), (c0, c1), (r0 // bn, -(-r1 // bn)), scale_cols
    return (r0, r1), (c0, c1), (r0, r1), scale_cols  # fp4: one scale per row per bk columns


def slice_weight(w, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
    """A checkpoint Weight restricted to rows / logical columns, reading only that slice (the
    data stays a memmap view). Block-scaled FP8 slices must fall on block boundaries."""
    (r0, r1), (c0, c1), srows, scols = slice_bounds(w.name, w.fmt, w.block, w.shape, rows, cols)
    if srows is None:
        return replace(w, data=w.data[r0:r1, c0:c1], shape=(r1 - r0, c1 - c0))
    scale = w.scale[srows[0]:srows[1], scols[0]:scols[1]]
    # (fp4: two values per byte)
    data = w.data[r0:r1, c0:c1] if w.fmt == "fp8" else w.data[r0:r1, c0 // 2: c1 // 2]
    return replace(w, data=data, scale=scale, shape=(r1 - r0, c1 - c0))


def rows_stackable(ws: list) -> bool:
    """Whether weights of one input can be stacked along their output rows (stack_rows): the same
    format, blocks and width, and FP8 scale blocks that do not straddle two of them."""
    w0 = ws[0]
    if any((w.fmt, w.block, w.scale_fmt, w.shape[1]) != (w0.fmt, w0.block, w0.scale_fmt, w0.shape[1]) for w in ws):
        return False
    return w0.fmt != "fp8" or all(w.shape[0] % w0.block[0] == 0 for w in ws[:-1])


def stack_rows(ws: list):
    """Weights of one input stacked along their output rows as one Weight, so that projections of
    one input run as one GEMV (rows_stackable must hold)."""
    w0 = ws[0]
    scale = None if w0.scale is None else np.concatenate([np.asarray(w.scale) for w in ws])
    return replace(w0, name="+".join(w.name for w in ws), data=np.concatenate([np.asarray(w.data) for w in ws]),
                   scale=scale, shape=(sum(w.shape[0] for w in ws), w0.shape[1]))


# ---------------------------------------------------------------------------------------------
# Collectives and the lockstep driver


@dataclass
class Collective:
    op: str  # 'sum' (all-reduce) | 'gather' (all-gather along the last axis)
    value: object


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
        return np.concatenate([np.asarray(v) for v in vals], axis=-1)
    raise RuntimeError(f"unknown collective {op!r}")


@dataclass
class StepRegion:
    """A rank's whole decode step offered to the driver as one region (a Collective "step"):
    run(staged inputs) is the rank's generator over it (Model._run), with its own collectives.
    The driver runs every rank's step eagerly (run_steps) or, on GPUs, as one CUDA graph per rank
    with the all-reduces inside (engine/parallel/gpu.py)."""

    key: tuple
    inputs: object  # engine.state.decode_plan.StepInputs
    run: Callable
    ops: object
    rows: int


def run_steps(msgs: list[Collective], reduce=None, contexts=None) -> list:
    """Every rank's StepRegion run eagerly: inputs staged by the rank's backend, its generator
    driven like the forward's; one result per rank."""
    ctx = contexts or [contextlib.nullcontext] * len(msgs)
    gens = []
    for r, m in enumerate(msgs):
        with ctx[r]():
            gens.append(m.value.run(m.value.ops.stage(m.value.inputs)))
    return run_ranks(gens, reduce, contexts)


def run_ranks(gens: Iterable[Generator], reduce=None, contexts=None) -> list:
    """Drive the ranks' forward generators to completion; returns each rank's return value.
    reduce(msgs) -> one reply per rank (default: everyone gets `combine(msgs)`, and each rank
    its own result of a "step", see run_steps); contexts[r] is entered around every resumption
    of rank r (e.g. its CUDA device)."""
    gens = list(gens)
    ctx = contexts or [contextlib.nullcontext] * len(gens)
    if reduce is None:
        def reduce(msgs: list) -> list:
            return run_steps(msgs, None, contexts) if msgs[0].op == "step" else [combine(msgs)] * len(msgs)

    def resume(r: int, g: Generator, value=None, first: bool = False):
        with ctx[r]():
            try:
                return next(g) if first else g.send(value)
            except StopIteration as stop:
                return stop

    msgs = [resume(r, g, first=True) for r, g in enumerate(gens)]
    while True:
        done = [isinstance(m, StopIteration) for m in msgs]
        if all(done):
            return [m.value for m in msgs]
        if any(done):
            raise RuntimeError("ranks finished at different collectives")
        if any(m.op != msgs[0].op for m in msgs):
            raise RuntimeError(f"ranks disagree on the next collective: {[m.op for m in msgs]}")
        replies = reduce(msgs)
        msgs = [resume(r, g, replies[r]) for r, g in enumerate(gens)]


def run_single(gen: Generator):
    """One rank: every collective is the identity."""
    try:
        msg = next(gen)
        while True:
            msg = gen.send(msg.value)
    except StopIteration as stop:
        return stop.value


class SimulatedTP:
    """N numpy ranks of one model in one process: each rank loads only its slices and keeps its
    own (replicated) sequence state; collectives are sums. Used to test the sharding math."""

    def __init__(self, cfg, ckpt, make_ops, size: int, tokenizer_json=None, store_quantized: bool = True,
                 expert_split: str = "ep"):
        from engine.model.transformer import Model

        self.size = size
        self.ranks = [Model(cfg, ckpt, make_ops(), tokenizer_json, store_quantized,
                            plan=ShardPlan.make(cfg, r, size, expert_split)) for r in range(size)]

    def new_state(self) -> list:
        return [m.new_state() for m in self.ranks]

    def forward(self, states: list[list], chunks: list, all_logits: bool = False) -> list[np.ndarray]:
        """states[i] is sequence i's per-rank state list."""
        per_rank = [[s[r] for s in states] for r in range(self.size)]
        outs = run_ranks(m.forward_steps(per_rank[r], chunks, all_logits) for r, m in enumerate(self.ranks))
        for o in outs[1:]:  # every rank ends with the full (gathered) logits
            for a, b in zip(o, outs[0], strict=True):
                if not np.array_equal(a, b):
                    raise RuntimeError("ranks disagree on the gathered logits")
        return outs[0]
