"""The host half of a V4.1 decode step: every layer's state bookkeeping, done before any kernel.

A decode step (one new token per sequence) appends rows to each sequence's state: a window row
in every layer, pending compressor rows, now and then a compressed entry and an indexer key.
Which buffer row each of them lands in, which rows the compressor pools, which keys the indexer
scores and which rows each query attends depend only on the sequences' positions and state
sizes, all known on the host. `plan_decode` works them out for every layer up front, reserving
and committing the grown state views (engine/state/rows.py), and records them as backend-neutral
lists of Spans. A backend's `stage` turns those into what its kernels read (on the GPU: one
upload of pointer tables), and the device half (engine/model/v41.py `V41Attention.decode`) only reads the tables.

So a whole decode step launches the same kernels with the same shapes for a given batch size
and set of capacity buckets, whatever the positions: the GPU replays it as one CUDA graph.
Widths that grow with the context (indexer scores, the published top-k mask, the attention's
key split) are sized to `capacity(n)`, a power of two: padding columns score -inf, so the
selections equal those over the exact widths, and a context crosses a bucket ~log2(n) times.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace

import numpy as np

from engine.state import rows
from engine.state.rows import Span
from engine.state.sequence import HeldRows, _own_of, grown_mark

# Span(...) without NamedTuple's Python-level __new__: the steady-state planner makes a few thousand
# a verify step at b32
_span = tuple.__new__
MIN_CAPACITY = 64


def capacity(n: int) -> int:
    """Width bucket for n columns: 0 for none, else the next power of two >= max(n, 64)."""
    return 0 if n <= 0 else max(MIN_CAPACITY, 1 << (int(n) - 1).bit_length())


# How a backend stages each field (CupyOps.stage): "rows": per sequence a destination row or
# None; "spans": per sequence a Span of rows (n may be 0) or None; "f32" / "i64": host arrays
# uploaded as they are; "host": read by the staging only; anything else (ints, strings) is static:
# it fixes the step's launches and keys its graph. A layer's window rows and attention sources
# (`win_dst`, `attend`) are staged from the step's WindowPlan and the layer's entries source.
ROWS, SPANS, F32, I64, HOST = "rows", "spans", "f32", "i64", "host"


@dataclass
class LayerPlan:
    """One V4.1 layer's decode step for B sequences (lists are per sequence, in batch order)."""

    # attention: the entries of KV source `ents_from` (its `entries`) under the top-k mask that
    # index source `mask_from` publishes (-1: none), mask_cap wide; attend_cap: capacity of the
    # longest key list (window + entries), which sizes the attention's split
    ents_from: int = -1
    mask_from: int = -1
    mask_cap: int = 0
    attend_cap: int = 0
    # ratio > 1 KV source: the new compressor rows' destinations, the closing groups' pending rows
    # (None where a sequence's group does not close) and RoPE at each group's first position
    pend_kv: list | None = field(default=None, metadata={"kind": ROWS})
    pend_gate: list | None = field(default=None, metadata={"kind": ROWS})
    pool_kv: list | None = field(default=None, metadata={"kind": SPANS})
    pool_gate: list | None = field(default=None, metadata={"kind": SPANS})
    pool_rope: np.ndarray | None = field(default=None, metadata={"kind": F32})  # [2, B, rope/2]
    # KV source: where each sequence's new compressed entry / indexer key goes (None: none), and
    # each sequence's entries after this step (what its group's layers attend)
    entry_dst: list | None = field(default=None, metadata={"kind": ROWS})
    key_dst: list | None = field(default=None, metadata={"kind": ROWS})
    entries: list | None = field(default=None, metadata={"kind": HOST})
    # index source: each sequence's group keys, the scores' width, its role at the candidate level
    keys: list | None = field(default=None, metadata={"kind": SPANS})
    keys_cap: int = 0
    cand: str = ""  # "source": this layer picks the candidate blocks; "filter": its scores are cut to them
    cand_last: np.ndarray | None = field(default=None, metadata={"kind": I64})  # [B] newest block (-1: none)
    pub_ns: np.ndarray | None = field(default=None, metadata={"kind": HOST})  # [B] key counts it scored
    # which sequences attend their group's entries (bool [B], see plan_attention; None: none)
    attended: np.ndarray | None = field(default=None, metadata={"kind": HOST})
    # staged (ops.stage): where each sequence's new K=V row goes, and what its query attends
    win_dst: object = None
    attend: object = None

    def static(self) -> dict:
        """The fields that are no tables (they fix the launches)."""
        return {name: getattr(self, name) for name in STATIC}

    def signature(self) -> tuple:
        """What fixes this layer's launches: its static fields and which tables it has."""
        return (*map(self.__getattribute__, STATIC), *(getattr(self, name) is None for name in _TABLES))


STATIC = ("ents_from", "mask_from", "mask_cap", "attend_cap", "keys_cap", "cand")
_TABLES = [f.name for f in fields(LayerPlan) if "kind" in f.metadata]


@dataclass
class WindowPlan:
    """Every sequence's WindowBlock this step (engine/state/rows.py): in each layer l the new K=V row
    goes to row dst[b] of blocks[b][l], and the query attends rows start[b] .. dst[b]."""

    blocks: list  # [layers, rows, width] buffers, one per sequence
    start: np.ndarray  # int64 [B]
    dst: np.ndarray  # int64 [B]


@dataclass
class StepInputs:
    """A forward's per-step inputs: token ids [T], Engram hash ids [T, cols] (or None), RoPE cos /
    sin of both tables at each row's position [4, T, rope/2]; for V4.1 sequences fed one token
    their windows and each layer's plan of their decode step, and where prompt chunks share the
    step, the rows of those one-token sequences in the batch (dec_rows)."""

    ids: np.ndarray = field(metadata={"kind": I64})
    hash_ids: np.ndarray | None = field(metadata={"kind": I64})
    rope: np.ndarray = field(metadata={"kind": F32})
    layers: list | None = None
    window: WindowPlan | None = None
    dec_rows: np.ndarray | None = field(default=None, metadata={"kind": I64})

    def signature(self) -> tuple:
        shapes = tuple(None if a is None else a.shape for a in (self.ids, self.hash_ids, self.rope, self.dec_rows))
        if self.layers is None:
            return shapes + (None,)
        sigs: dict = {}  # id(plan) -> its signature (the layers that share a plan share it)
        for lp in self.layers:
            if id(lp) not in sigs:
                sigs[id(lp)] = lp.signature()
        return shapes + (tuple(sigs[id(lp)] for lp in self.layers),)


def plan_decode(cfg, states: list, xp, growth: list, rope_comp, heads: bool, counts: list | None = None,
                marks: list | None = None) -> tuple[WindowPlan, list[LayerPlan]]:
    """The windows and every layer's LayerPlan for new tokens of the states, committing the grown
    state. Copies of rows into a grown buffer are appended to `growth` (ops.copy_rows jobs, to run
    before the step); rope_comp(positions) -> (cos, sin) of the compressed RoPE; heads: whether
    this rank attends (a tensor-parallel rank may hold no query heads).

    counts: the rows each state takes (default one: a decode step). A speculative verify feeds a
    sequence [last token, drafts] as several decode rows, consecutive in the batch: row j is planned
    as the j-th of as many one-row steps (its window ends at its own row, it pools the groups it
    closes, it scores the keys and attends the entries that exist after it), and every buffer a
    sequence appends to has room for all of its rows before the step, so no row is moved while a
    later one reads it. marks: if given, filled with each state's bookkeeping after each of its
    rows (state.plan_marks' form), which puts it back to its first m rows (engine/state/trial.py)."""
    counts = [1] * len(states) if counts is None else [int(c) for c in counts]
    keep, n_rows = cfg.sliding_window - 1, sum(counts)
    blocks, start, dst = [], np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int64)
    row_marks = [[([], []) for _ in range(c)] for c in counts] if marks is not None else None
    r = 0
    for b, s in enumerate(states):  # every layer's window grows by a row, in one block per sequence
        blk = rows.window_block(xp, s.layers, cfg.head_dim, keep, growth, counts[b])
        for j in range(counts[b]):
            blocks.append(blk.buf)
            start[r], dst[r] = blk.start, blk.end
            blk.end += 1
            blk.start = max(blk.start, blk.end - keep)
            if row_marks is not None:
                row_marks[b][j][1].append((s.layers[0].__dict__, blk, blk.start, blk.end, blk.attached, None))
            r += 1
    win = WindowPlan(blocks, start, dst)
    layers: list[LayerPlan] = []
    published: dict = {}  # index sources' key counts and keys, for the later layers
    reads: dict = {}  # (ents_from, mask_from) -> the plan of layers that only read (shared: no tables)
    for li, (grp, busy) in enumerate(_schedule(cfg)):
        if busy:
            layers.append(_plan_layer(cfg, li, grp, states, counts, xp, growth, rope_comp, published, row_marks))
            continue
        key = (grp, published["topk"]) if grp >= 0 and "topk" in published else (-1, -1)
        lp = reads.get(key)
        if lp is None:
            lp = reads[key] = LayerPlan(ents_from=key[0], mask_from=key[1])
        layers.append(lp)
    if heads:
        plan_attention(layers, win)
    if marks is not None:
        marks.extend(row_marks)
    return win, layers


@functools.lru_cache(maxsize=16)
def _schedule(cfg) -> tuple:
    """Per layer: (its KV group's source layer, whether the layer has state of its own to plan: a
    KV source or an index source). The other layers only read their group's entries under the
    latest published mask, and layers reading the same ones share one LayerPlan."""
    return tuple((cfg.kv_group_source(li), cfg.layer_kinds[li] == "source" or li in cfg.index_source_layer_ids)
                 for li in range(cfg.num_layers))


def _plan_layer(cfg, li: int, grp: int, states: list, counts: list, xp, growth: list, rope_comp, published: dict,
                row_marks: list | None) -> LayerPlan:
    kind, indexed = cfg.layer_kinds[li], li in cfg.index_source_layer_ids
    p = LayerPlan()
    if grp >= 0 and "topk" in published:  # (grp >= 0: a compressed layer with a KV source)
        p.ents_from, p.mask_from = grp, published["topk"]
    if kind != "source" and not indexed:
        return p
    if kind == "source":
        _plan_source(cfg, li, p, states, counts, xp, growth, rope_comp, published, row_marks)
    if indexed:
        # (the index layers after a group's source read the keys it left: the same Spans)
        if ("keys", grp) not in published:
            keys = [rows.span(s.layers[grp], "idx_keys") for s, c in zip(states, counts, strict=True)
                    for _ in range(c)]
            published["keys", grp] = keys, [k.n for k in keys]
        p.keys, n_keys = published["keys", grp]
        most = max(n_keys)
        if most == 0:  # nothing to score yet: earlier publications stand
            p.keys = None
        else:
            ns = np.array(n_keys, np.int64)
            p.keys_cap, p.pub_ns = capacity(most), ns
            cand = cfg.candidate_source_layer_id
            if li == cand:
                p.cand = "source"
                p.cand_last = (ns - 1) // cfg.candidate_block_size
                published["cand"] = ns
            elif 0 <= cand < li and np.array_equal(published.get("cand"), ns):  # (same keys: same ratio)
                p.cand = "filter"
            published["topk"] = li
    if grp >= 0 and "topk" in published:  # (this layer's own publication, if it made one)
        p.ents_from, p.mask_from = grp, published["topk"]
    return p


def _plan_source(cfg, li: int, p: LayerPlan, states: list, counts: list, xp, growth: list, rope_comp,
                 published: dict, row_marks: list | None) -> None:
    """A KV source's rows: each joins its group's pending rows, a full group is pooled into an
    entry (and an indexer key), in each sequence's order: in one pass where the sequence's buffers
    have room for all its rows (_source_rows_held), else row by row, reserving as it goes."""
    ratio, d, indexed = cfg.compress_ratios[li], cfg.head_dim, li in cfg.index_source_layer_ids
    first = None
    if ratio > 1:
        p.pend_kv, p.pend_gate, p.pool_kv, p.pool_gate = [], [], [], []
        first = np.zeros(sum(counts), np.int64)
    p.entry_dst, p.entries = [], []
    keys: list = []
    if indexed:
        p.key_dst = []
    r = 0
    for b, s in enumerate(states):
        ls, c = s.layers[li], counts[b]
        if _source_rows_held(p, ls, c, ratio, indexed, keys, first, r, row_marks[b] if row_marks is not None else None):
            r += c
            continue
        for j in range(c):
            rest, closes = c - j, True  # (ratio 1: each token is its own group, projected already)
            if ratio > 1:
                pend = []
                for name, dst in (("buf_kv", p.pend_kv), ("buf_gate", p.pend_gate)):
                    buf, start, end = rows.reserve(xp, ls, name, d, rest, growth, room=ratio)
                    dst.append(Span(buf, end, 1))
                    pend.append(Span(buf, start, end + 1 - start))
                    # a pooled group's rows free the buffer from its start, but not before the
                    # step's last row: a later row would overwrite the rows the pool reads
                    full = end + 1 - start == ratio
                    rows.commit(ls, name, *((buf, start, end + 1) if not full else (buf, 0, 0) if j == c - 1
                                            else (buf, end + 1, end + 1)))
                closes = pend[0].n == ratio
                p.pool_kv.append(pend[0] if closes else None)
                p.pool_gate.append(pend[1] if closes else None)
                first[r] = ls.n_entries * ratio
            p.entry_dst.append(_append(xp, ls, "entries", d, closes, rest, growth))
            if indexed:
                p.key_dst.append(_append(xp, ls, "idx_keys", cfg.index_head_dim, closes, rest, growth))
                keys.append(rows.span(ls, "idx_keys"))
            p.entries.append(rows.span(ls, "entries"))
            if row_marks is not None:
                row_marks[b][j][0].append(grown_mark(ls))
            r += 1
    if ratio > 1:
        p.pool_rope = np.stack(rope_comp(first))
    if indexed:
        published["keys", li] = keys, [k.n for k in keys]


def _source_rows_held(p: LayerPlan, ls, c: int, ratio: int, indexed: bool, keys: list, first, r: int,
                      marks: list | None) -> bool:
    """_plan_source's rows of one sequence where every buffer they append to is a growth buffer with
    room for all c of them (the steady state: no copy, no new buffer): the same Spans and
    bookkeeping as the row-by-row path, with the records committed once, and each row's trial mark
    as counters (sequence.HeldRows: the same records once restored). False (nothing done) where any
    buffer would be reserved anew; the caller then plans the rows one by one."""
    spare = ls.spare
    names = (("buf_kv", "buf_gate") if ratio > 1 else ()) + ("entries",) + (("idx_keys",) if indexed else ())
    held = [spare.get(name) for name in names]
    if any(h is None or h[2] + c > h[0].shape[0] for h in held):
        return False
    bkv = bgt = None
    s = e = 0
    if ratio > 1:
        (bkv, s, e, _), (bgt, s2, e2, _) = held[0], held[1]
        if (s2, e2) != (s, e):
            return False
        held = held[2:]
    be, es, ee = held[0][0], held[0][1], held[0][2]
    bk, ks, ke = (held[1][0], held[1][1], held[1][2]) if indexed else (None, 0, 0)
    entries, entry_dst, key_dst = p.entries, p.entry_dst, p.key_dst
    if marks is not None:  # (each row's mark: these counters after it; grown_mark's form on restore)
        d = ls.__dict__
        rows_held, own = HeldRows(dict(spare), bkv, bgt, be, bk, es, ks), _own_of(d)
    for j in range(c):
        closes = True
        if ratio > 1:
            p.pend_kv.append(_span(Span, (bkv, e, 1)))
            p.pend_gate.append(_span(Span, (bgt, e, 1)))
            closes = e + 1 - s == ratio
            if closes:
                p.pool_kv.append(_span(Span, (bkv, s, ratio)))
                p.pool_gate.append(_span(Span, (bgt, s, ratio)))
                # (the pool frees its rows, but not before the step's last row: see _plan_source)
                s = e = 0 if j == c - 1 else e + 1
            else:
                p.pool_kv.append(None)
                p.pool_gate.append(None)
                e += 1
            first[r + j] = (ee - es) * ratio
        if closes:
            entry_dst.append(_span(Span, (be, ee, 1)))
            ee += 1
            if indexed:
                key_dst.append(_span(Span, (bk, ke, 1)))
                ke += 1
        else:
            entry_dst.append(None)
            if indexed:
                key_dst.append(None)
        if indexed:
            keys.append(_span(Span, (bk, ks, ke - ks)))
        entries.append(_span(Span, (be, es, ee - es)))
        if marks is not None:
            marks[j][0].append((d, (rows_held, s, e, ee, ke), own))
    if ratio > 1:
        ls.hold("buf_kv", bkv, s, e)
        ls.hold("buf_gate", bgt, s, e)
    ls.hold("entries", be, es, ee)
    if indexed:
        ls.hold("idx_keys", bk, ks, ke)
    return True


def with_spans(inputs: StepInputs) -> StepInputs:
    """The step with every layer's window destinations and attention sources as Spans: (window
    rows, attended entries or None) per sequence (the numpy backend's staging)."""
    if inputs.window is None:
        return inputs
    w, out = inputs.window, []
    for li, lp in enumerate(inputs.layers):
        ok = lp.attended
        ents = inputs.layers[lp.ents_from].entries if ok is not None else None
        out.append(replace(lp, win_dst=[Span(blk[li], int(e), 1) for blk, e in zip(w.blocks, w.dst, strict=True)],
                           attend=[(Span(blk[li], int(s0), int(e + 1 - s0)), ents[b] if ok is not None and ok[b]
                                    else None) for b, (blk, s0, e) in enumerate(zip(w.blocks, w.start, w.dst,
                                                                                   strict=True))]))
    return replace(inputs, layers=out)


def plan_attention(layers: list[LayerPlan], win: WindowPlan) -> None:
    """Each layer's attended sequences, mask width and attention capacity. A sequence attends its
    group's entries where it has some and the published top-k mask scored that many; layers
    reading one group under one mask share the result."""
    n_win = win.dst + 1 - win.start
    done: dict = {}
    for lp in layers:  # (a plan several reading layers share is visited once per layer: a lookup)
        key = (lp.ents_from, lp.mask_from)
        if key not in done:
            ok, longest, mask_cap = None, n_win, 0
            if lp.ents_from >= 0:
                n = np.array([sp.n for sp in layers[lp.ents_from].entries], np.int64)
                ok = (n > 0) & (layers[lp.mask_from].pub_ns == n)
                longest, mask_cap = n_win + np.where(ok, n, 0), layers[lp.mask_from].keys_cap
            done[key] = (ok, mask_cap, capacity(int(longest.max())))
        lp.attended, lp.mask_cap, lp.attend_cap = done[key]


def _append(xp, ls, name: str, width: int, yes: bool, rest: int, growth: list):
    """A new row of ls.<name> if `yes` (committed, with room for the rest of the step's rows of the
    sequence); its destination (None: none)."""
    if not yes:
        return None
    buf, start, end = rows.reserve(xp, ls, name, width, rest, growth)
    rows.commit(ls, name, buf, start, end + 1)
    return Span(buf, end, 1)
