"""Tensor parallelism: which rank holds which slice of the weights.

Attention heads are split across ranks (wq_b rows, sinks, the wo_a blocks of the rank's heads,
the wo_b columns of its groups; the one shared K=V head, the compressors and the indexer are
replicated, since every head reads the same KV); routed experts are split by expert id (EP; or
by width, `expert_split="width"`) and the shared expert by width; embedding and head are
vocab-parallel. Everything else (mHC, norms, router, Engram) is replicated. Per layer that is two
all-reduces of [tokens, hidden] (attention output, MoE output), plus one for the embedding and an
all-gather of the logits (docs/tensor-parallel.md).
"""

from __future__ import annotations

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
