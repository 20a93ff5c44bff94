"""The host half of a V4.1 decode step: every layer's state bookkeeping, done before any kernel.

A decode step (one new token per sequence) appends rows to each sequence's state: a window row
in every layer, pending compressor rows, now and then a compressed entry and an indexer key.
Which buffer row each of them lands in, which rows the compressor pools, which keys the indexer
scores and which rows each query attends depend only on the sequences' positions and state
sizes, all known on the host. `plan_decode` works them out for every layer up front, reserving
and committing the grown state views (engine/rows.py), and records them as backend-neutral
lists of Spans. A backend's `stage` turns those into what its kernels read (on the GPU: one
upload of pointer tables), and the device half (`Model._decode_attend`) only reads the tables.

So a whole decode step launches the same kernels with the same shapes for a given batch size
and set of capacity buckets, whatever the positions: the GPU replays it as one CUDA graph.
Widths that grow with the context (indexer scores, the published top-k mask, the attention's
key split) are sized to `capacity(n)`, a power of two: padding columns score -inf, so the
selections equal those over the exact widths, and a context crosses a bucket ~log2(n) times.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from engine import rows
from engine.rows import Span

MIN_CAPACITY = 64


def capacity(n: int) -> int:
    """Width bucket for n columns: 0 for none, else the next power of two >= max(n, 64)."""
    return 0 if n <= 0 else max(MIN_CAPACITY, 1 << (int(n) - 1).bit_length())


# How a backend stages each field (CupyOps.stage): "rows": per sequence a destination row or
# None; "spans": per sequence a Span of rows (n may be 0) or None; "attend": per sequence (window
# Span, entries Span or None); "f32" / "i64": host arrays uploaded as they are; anything else
# (ints, strings) is static: it fixes the step's launches and keys its graph.
ROWS, SPANS, ATTEND, F32, I64 = "rows", "spans", "attend", "f32", "i64"


@dataclass
class LayerPlan:
    """One V4.1 layer's decode step for B sequences (lists are per sequence, in batch order)."""

    win_dst: list = field(metadata={"kind": ROWS})  # where each new K=V row goes
    attend: list = field(metadata={"kind": ATTEND})  # (window incl. the new row, group entries or None)
    attend_cap: int = 0  # capacity of the longest key list (window + entries): the attention's split
    mask_cap: int = 0  # width of the published top-k mask that masks the entries
    # ratio > 1 KV source: the new compressor rows' destinations, the closing groups' pending rows
    # (None where a sequence's group does not close) and RoPE at each group's first position
    pend_kv: list | None = field(default=None, metadata={"kind": ROWS})
    pend_gate: list | None = field(default=None, metadata={"kind": ROWS})
    pool_kv: list | None = field(default=None, metadata={"kind": SPANS})
    pool_gate: list | None = field(default=None, metadata={"kind": SPANS})
    pool_rope: np.ndarray | None = field(default=None, metadata={"kind": F32})  # [2, B, rope/2]
    # KV source: where each sequence's new compressed entry / indexer key goes (None: none)
    entry_dst: list | None = field(default=None, metadata={"kind": ROWS})
    key_dst: list | None = field(default=None, metadata={"kind": ROWS})
    # index source: each sequence's group keys, the scores' width, its role at the candidate level
    keys: list | None = field(default=None, metadata={"kind": SPANS})
    keys_cap: int = 0
    cand: str = ""  # "source": this layer picks the candidate blocks; "filter": its scores are cut to them
    cand_last: np.ndarray | None = field(default=None, metadata={"kind": I64})  # [B] newest block (-1: none)

    def signature(self) -> tuple:
        """What fixes this layer's launches: which parts it has and its static widths."""
        return tuple(v if not isinstance(v, (list, np.ndarray)) else True for v in map(self.__getattribute__, _NAMES))


_NAMES = [f.name for f in fields(LayerPlan)]


@dataclass
class StepInputs:
    """A forward's per-step inputs: token ids [T], Engram hash ids [T, cols] (or None), RoPE cos /
    sin of both tables at each row's position [4, T, rope/2]; for V4.1 sequences fed one token
    each layer's plan of their decode step, and where prompt chunks share the step, the rows of
    those one-token sequences in the batch (dec_rows)."""

    ids: np.ndarray = field(metadata={"kind": I64})
    hash_ids: np.ndarray | None = field(metadata={"kind": I64})
    rope: np.ndarray = field(metadata={"kind": F32})
    layers: list | None = None
    dec_rows: np.ndarray | None = field(default=None, metadata={"kind": I64})

    def signature(self) -> tuple:
        shapes = tuple(None if a is None else a.shape for a in (self.ids, self.hash_ids, self.rope, self.dec_rows))
        return shapes + (None if self.layers is None else tuple(lp.signature() for lp in self.layers),)


def plan_decode(cfg, states: list, xp, growth: list, rope_comp, heads: bool) -> list[LayerPlan]:
    """Every layer's LayerPlan for one new token per state, committing the grown state views.
    Copies of rows into a grown buffer are appended to `growth` (ops.copy_rows jobs, to run
    before the step); rope_comp(positions) -> (cos, sin) of the compressed RoPE; heads: whether
    this rank attends (a tensor-parallel rank may hold no query heads)."""
    published: dict = {}  # index sources' (per-sequence key counts, width) for the later layers
    return [_plan_layer(cfg, li, states, xp, growth, rope_comp, heads, published) for li in range(cfg.num_layers)]


def _plan_layer(cfg, li: int, states: list, xp, growth: list, rope_comp, heads: bool, published: dict) -> LayerPlan:
    ratio, kind, win, d = cfg.compress_ratios[li], cfg.layer_kinds[li], cfg.sliding_window, cfg.head_dim
    lss = [s.layers[li] for s in states]
    p = LayerPlan(win_dst=[], attend=[])
    windows = []
    for ls in lss:
        buf, start, end = rows.reserve(xp, ls, "window", d, 1, growth)
        p.win_dst.append(Span(buf, end, 1))
        windows.append(Span(buf, start, end + 1 - start))
        rows.commit(ls, "window", buf, max(start, end + 2 - win), end + 1)
    indexed = li in cfg.index_source_layer_ids
    if kind == "source":
        appends = [False] * len(lss)
        if ratio > 1:  # the new row joins its group's pending rows; full groups are pooled
            p.pend_kv, p.pend_gate, p.pool_kv, p.pool_gate = [], [], [], []
            first = np.zeros(len(lss), np.int64)
            for b, ls in enumerate(lss):
                pend = []
                for name, dst in (("buf_kv", p.pend_kv), ("buf_gate", p.pend_gate)):
                    # (a group's rows are pooled, then the buffer is reused from its start)
                    buf, start, end = rows.reserve(xp, ls, name, d, 1, growth, room=ratio)
                    dst.append(Span(buf, end, 1))
                    pend.append(Span(buf, start, end + 1 - start))
                    rows.commit(ls, name, *((buf, 0, 0) if end + 1 - start == ratio else (buf, start, end + 1)))
                appends[b] = pend[0].n == ratio
                p.pool_kv.append(pend[0] if appends[b] else None)
                p.pool_gate.append(pend[1] if appends[b] else None)
                first[b] = ls.n_entries * ratio
            p.pool_rope = np.stack(rope_comp(first))
        else:  # ratio 1: each token is its own group, projected already
            appends = [True] * len(lss)
        p.entry_dst = _append(xp, lss, "entries", d, appends, growth)
        if indexed:
            p.key_dst = _append(xp, lss, "idx_keys", cfg.index_head_dim, appends, growth)
    grp = cfg.kv_group_source(li)
    if indexed:
        p.keys = [rows.span(s.layers[grp], "idx_keys") for s in states]
        ns = tuple(k.n for k in p.keys)
        if max(ns) == 0:  # nothing to score yet: earlier publications stand
            p.keys = None
        else:
            p.keys_cap = capacity(max(ns))
            cand = cfg.candidate_source_layer_id
            if li == cand:
                p.cand = "source"
                p.cand_last = (np.array(ns, np.int64) - 1) // cfg.candidate_block_size
                published["cand"] = ns
            elif 0 <= cand < li and published.get("cand") == ns:  # (same keys: same ratio)
                p.cand = "filter"
            published["topk"] = (ns, p.keys_cap)
    if not heads:
        return p
    pub = published.get("topk")
    longest = 0
    for s, w in zip(states, windows, strict=True):
        ents = None
        if ratio and grp >= 0:  # the group's entries under this sequence's published top-k
            es = rows.span(s.layers[grp], "entries")
            if es.n and pub is not None and pub[0][len(p.attend)] == es.n:
                ents, p.mask_cap = es, pub[1]
        p.attend.append((w, ents))
        longest = max(longest, w.n + (ents.n if ents is not None else 0))
    p.attend_cap = capacity(longest)
    return p


def _append(xp, lss: list, name: str, width: int, which: list, growth: list) -> list:
    """A new row of ls.<name> for each state where `which` says so (committed); its destinations."""
    out = []
    for ls, yes in zip(lss, which, strict=True):
        if not yes:
            out.append(None)
            continue
        buf, start, end = rows.reserve(xp, ls, name, width, 1, growth)
        out.append(Span(buf, end, 1))
        rows.commit(ls, name, buf, start, end + 1)
    return out
