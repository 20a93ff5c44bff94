"""Load a checkpoint's weights for one tensor-parallel rank, through the schema.

`load_weights` reads every tensor engine.checkpoint.schema lists for the config, checks it
against the schema (present, an accepted format, its logical shape), cuts this rank's slice
(Shard.window + engine.parallel.shard.slice_weight) and puts it, in the backend's compute form,
where the schema's `place` says. The structure is named after DeepSeek's inference/model.py:

    w.embed, w.head            linear weights (rows: this rank's vocab slice)
    w.norm                     vec
    w.hc_head                  (fn, scale, base), V4 only (else None)
    w.layers[i]: attn_norm, ffn_norm, hc_attn, hc_ffn (mHC (fn, scale, base)),
        attn: q_norm, kv_norm, wq_b (this rank's heads), sinks, wo_a, wo_b, wo_groups (None, None,
              0 on a rank without heads), qkv (q / K=V latents stacked), x_proj (V4.1's BF16
              projections of x stacked: comp_kv, comp_gate, idx_w; [] where none),
              compressor: None or (norm, wkv, wgate, ape)  (V4.1: norm only),
              indexer: None or (wq_b, weights_proj (V4), wk, k_norm (V4.1 KV sources),
                                compressor (V4 CSA))
        ffn: gate, gate_bias, tid2eid (hash layers), experts ((w1, w2, w3) or None where another
             rank owns it), shared_experts ((w1, w2, w3) or None)
        engram: None or (table, wkv, qk)
    w.dspark                   None without DSpark draft layers, else (engine/checkpoint/dspark_schema.py)
        main_proj, main_norm, norm, markov_head.embed, markov_head.head (vocab rows),
        confidence_head.proj, layers[j]: as w.layers[i] (sliding-window attention, no
        compressor / indexer / engram / tid2eid; experts over the draft pool)

A checkpoint object carrying a `progress` attribute (an engine.checkpoint.progress.LoadProgress,
set by engine.runtime.engine.Engine.load) is told of this rank's bytes and of every tensor read.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from engine.checkpoint.dspark_schema import check_draft
from engine.checkpoint.reader import scale_name
from engine.checkpoint.schema import (
    IDS,
    LINEAR,
    PRODUCTS,
    STACK_PARTS,
    TABLE,
    Entry,
    check_stored,
    resolve,
    tensor_schema,
)
from engine.model.config import ModelConfig
from engine.model.numerics import linear_use
from engine.parallel.shard import ShardPlan, rows_stackable, slice_weight

__all__ = ["load_weights"]

# Namespaces a layer has only where its tensors are (made on the first one), with their fields.
_OPTIONAL = {
    "compressor": ("norm", "wkv", "wgate", "ape"),
    "indexer": ("wq_b", "weights_proj", "wk", "k_norm", "compressor"),
    "engram": ("table", "wkv", "qk"),
}
# Fixed-arity slots: mHC (fn, scale, base), an expert's (w1, w2, w3)
_TUPLE_ARITY = 3


def load_weights(cfg: ModelConfig, ckpt, ops, plan: ShardPlan) -> SimpleNamespace:
    """Every tensor the forward reads (this rank's slices of the split ones, see
    engine/parallel/shard.py), in the backend's compute form (ops.prepare / prepare_rows /
    prepare_table / asarray)."""
    check_draft(cfg, ckpt, warn=True)
    w = _skeleton(cfg, plan)
    parts: dict[str, dict[str, object]] = {}  # combined values' parts, by place
    progress = getattr(ckpt, "progress", None)
    if progress is not None:
        mine = [_stored_bytes(ckpt, e) for e in _entries(cfg, ckpt) if e.shard.window(cfg, plan) is not None]
        progress.add_total(sum(mine), len(mine))
    for e in _entries(cfg, ckpt):
        name = resolve(ckpt, e.name)
        got = check_stored(e, ckpt, name)  # (every rank checks the whole checkpoint: headers only)
        if e.kind == LINEAR:
            got = replace(got, use=linear_use(cfg, e.name, got.fmt))
        window = e.shard.window(cfg, plan)
        if window is None:  # another rank's
            continue
        if progress is not None:
            progress.advance(_stored_bytes(ckpt, e))
        if e.part is not None:  # stacked weights whole; Engram's q and k as float32
            if window != (None, None):
                raise ValueError(f"{e.name}: parts of a combined value must be replicated")
            parts.setdefault(e.place, {})[e.part] = got if e.kind == LINEAR else ckpt.f32(name)
            continue
        _put(w, e.place, _read(e, ckpt, ops, name, got, window))
    for place, got in parts.items():
        leaf = place.rsplit(".", 1)[1]
        if leaf in PRODUCTS:  # Engram's q * k
            value = ops.asarray(got["q"] * got["k"])
        else:
            value = _stacked_projections(ops, [(p, got[p]) for p in STACK_PARTS[leaf] if p in got])
        _put(w, place, value)
    return _finish(w)


def _entries(cfg: ModelConfig, ckpt) -> list[Entry]:
    """The schema's entries this checkpoint provides a value for."""
    return [e for e in tensor_schema(cfg)
            if e.place is not None and not (e.optional and not ckpt.has(resolve(ckpt, e.name)))]


def _stored_bytes(ckpt, e: Entry) -> int:
    """Bytes of an entry as stored, with its scale (headers only)."""
    n = ckpt.raw(resolve(ckpt, e.name)).array.nbytes
    sname = resolve(ckpt, scale_name(e.name))
    return n + (ckpt.raw(sname).array.nbytes if ckpt.has(sname) else 0)


def _read(e: Entry, ckpt, ops, name: str, got, window: tuple):
    rows, cols = window
    if e.kind == LINEAR:
        return ops.prepare(got if rows is None and cols is None else slice_weight(got, rows, cols))
    if e.kind == TABLE:  # (a float table's stored scales are passed along and unused)
        sname = resolve(ckpt, scale_name(e.name))
        return ops.prepare_table(got, ckpt.raw(sname) if ckpt.has(sname) else None)
    if e.kind == IDS:
        return ops.asarray(got.array, dtype=np.int64)
    x = ckpt.f32(name)  # (vectors split by rows only: sinks by head)
    return ops.asarray(x if rows is None else x[rows[0]:rows[1]])


def _stacked_projections(ops, ws: list) -> list:
    """[(weight, ((part, first row, end row), ...)), ...]: the projections of one input, as one
    stacked weight (one GEMV) where rows_stackable allows, else one weight each."""
    if len(ws) > 1 and rows_stackable([x for _, x in ws]):
        ends = np.cumsum([x.shape[0] for _, x in ws])
        return [(ops.prepare_rows([x for _, x in ws]),
                 tuple((part, int(end - x.shape[0]), int(end)) for (part, x), end in zip(ws, ends, strict=True)))]
    return [(ops.prepare(x), ((part, 0, x.shape[0]),)) for part, x in ws]


def _skeleton(cfg: ModelConfig, plan: ShardPlan) -> SimpleNamespace:
    """The structure with every field the schema may fill at its default (None / empty);
    wo_groups: the output groups this rank's heads touch (0 without heads)."""
    groups = len(plan.head_groups(cfg))

    def layer(n_experts: int) -> SimpleNamespace:
        return SimpleNamespace(
            attn_norm=None, ffn_norm=None, hc_attn=None, hc_ffn=None,
            attn=SimpleNamespace(q_norm=None, kv_norm=None, wq_b=None, sinks=None, wo_a=None, wo_b=None,
                                 wo_groups=groups, qkv=[], x_proj=[], compressor=None, indexer=None),
            ffn=SimpleNamespace(gate=None, gate_bias=None, tid2eid=None, experts=[None] * n_experts,
                                shared_experts=None),
            engram=None,
        )

    dspark = None
    if cfg.has_draft:
        dspark = SimpleNamespace(
            main_proj=None, main_norm=None, norm=None,
            markov_head=SimpleNamespace(embed=None, head=None), confidence_head=SimpleNamespace(proj=None),
            layers=[layer(cfg.dspark_n_routed_experts) for _ in range(cfg.dspark_layers)])
    return SimpleNamespace(embed=None, head=None, norm=None, hc_head=None,
                           layers=[layer(cfg.n_routed_experts) for _ in range(cfg.num_layers)], dspark=dspark)


def _put(root: SimpleNamespace, place: str, value) -> None:
    """Set the value at a dotted place ('layers.3.attn.wq_b', 'layers.3.hc_attn.0'), making the
    optional namespaces and fixed-arity slots on the way."""
    *path, leaf = place.split(".")
    obj = root
    if not path:
        setattr(root, leaf, value)
        return
    for seg, nxt in zip(path, [*path[1:], leaf], strict=True):
        child = obj[int(seg)] if seg.isdigit() else getattr(obj, seg)
        if child is None:
            if nxt.isdigit():
                child = [None] * _TUPLE_ARITY
            elif seg in _OPTIONAL:
                child = SimpleNamespace(**dict.fromkeys(_OPTIONAL[seg]))
            else:
                raise KeyError(f"{place}: no place {seg!r} in the loaded weights")
            if seg.isdigit():
                obj[int(seg)] = child
            else:
                setattr(obj, seg, child)
        obj = child
    if leaf.isdigit():
        obj[int(leaf)] = value
    elif not hasattr(obj, leaf):
        raise KeyError(f"{place}: no field {leaf!r} in the loaded weights")
    else:
        setattr(obj, leaf, value)


def _finish(w: SimpleNamespace) -> SimpleNamespace:
    """Fixed-arity slots as tuples."""
    w.hc_head = _tuple(w.hc_head)
    for L in w.layers + (w.dspark.layers if w.dspark is not None else []):
        L.hc_attn, L.hc_ffn = _tuple(L.hc_attn), _tuple(L.hc_ffn)
        L.ffn.experts = [_tuple(x) for x in L.ffn.experts]
        L.ffn.shared_experts = _tuple(L.ffn.shared_experts)
    return w


def _tuple(slots: list | None) -> tuple | None:
    return None if slots is None else tuple(slots)
