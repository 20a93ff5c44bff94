"""Today's weight loader (flat per-layer fields), kept until the schema-driven loader replaces it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from engine.model.config import ModelConfig
from engine.parallel.shard import ShardPlan, rows_stackable, slice_weight

# ---------------------------------------------------------------------------------------------
# Weights


class _Names:
    """Looks a tensor up under its canonical name or a known alternative spelling."""

    ALIASES = {"attn.kv_norm.weight": ("attn.norm.weight",)}

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def resolve(self, name: str) -> str:
        if self.ckpt.has(name):
            return name
        for suffix, alts in self.ALIASES.items():
            if name.endswith(suffix):
                for alt in alts:
                    cand = name[: -len(suffix)] + alt
                    if self.ckpt.has(cand):
                        return cand
        return name  # let the checkpoint raise its "missing tensor" error

    def has(self, name: str) -> bool:
        return self.ckpt.has(self.resolve(name))


def load_weights(cfg: ModelConfig, ckpt, ops, plan: ShardPlan) -> SimpleNamespace:
    """Read every tensor the forward needs (this rank's slices of the split ones, see engine/parallel/tp.py),
    in the backend's compute form."""
    names = _Names(ckpt)

    def lin(name: str, rows=None, cols=None):
        w = ckpt.weight(names.resolve(name))
        return ops.prepare(w if rows is None and cols is None else slice_weight(w, rows, cols))

    def vec(name: str):
        return ops.asarray(ckpt.f32(names.resolve(name)))

    def opt_vec(name: str):
        return vec(name) if names.has(name) else None

    w = SimpleNamespace(embed=lin("embed.weight", rows=plan.vocab), head=lin("head.weight", rows=plan.vocab),
                        norm=vec("norm.weight"), layers=[])
    d, ol = cfg.head_dim, cfg.o_lora_rank
    h0, h1 = plan.heads
    if cfg.arch == "v4":
        w.hc_head = (vec("hc_head_fn"), vec("hc_head_scale"), vec("hc_head_base"))
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = p + "attn."
        L = SimpleNamespace(
            attn_norm=vec(p + "attn_norm.weight"), ffn_norm=vec(p + "ffn_norm.weight"),
            hc_attn=(vec(p + "hc_attn_fn"), vec(p + "hc_attn_scale"), vec(p + "hc_attn_base")),
            hc_ffn=(vec(p + "hc_ffn_fn"), vec(p + "hc_ffn_scale"), vec(p + "hc_ffn_base")),
            q_norm=vec(a + "q_norm.weight"), wq_b=lin(a + "wq_b.weight", rows=(h0 * d, h1 * d)),
            kv_norm=vec(a + "kv_norm.weight"),
            sinks=vec(a + "attn_sink")[h0:h1], comp=None, idx=None, engram=None, wo_a=None, wo_b=None,
        )
        # the q and K=V latents both project x: one stacked weight (one GEMV) where the formats allow
        L.qkv = _stacked_projections(ckpt, names, ops, {"q_lat": a + "wq_a.weight", "kv_lat": a + "wkv.weight"})
        groups = plan.head_groups(cfg)
        if groups:  # the wo_a blocks of this rank's heads, and the wo_b columns of their groups
            (g0, lo, hi), gl = groups[0], groups[-1][0]
            if any((x[1], x[2]) != (lo, hi) for x in groups):
                raise ValueError("a rank's heads must cover whole output groups or lie inside one")
            L.wo_a = lin(a + "wo_a.weight", rows=(g0 * ol, (gl + 1) * ol), cols=(lo * d, hi * d))
            L.wo_b = lin(a + "wo_b.weight", cols=(g0 * ol, (gl + 1) * ol))
            L.wo_groups = len(groups)
        kind = cfg.layer_kinds[i]
        # V4.1: the compressor's kv and gate and the indexer's head weights also all project x (BF16,
        # no scales): L.x_proj, stacked likewise
        xw = {}
        if kind in ("source", "csa", "hca"):
            c = a + "compressor."
            ratio = cfg.compress_ratios[i]
            if cfg.arch == "v41":
                xw.update({"comp_kv": c + "wkv.weight", **({"comp_gate": c + "wgate.weight"} if ratio > 1 else {})})
            L.comp = SimpleNamespace(
                wkv=lin(c + "wkv.weight") if cfg.arch == "v4" else None, norm=vec(c + "norm.weight"),
                wgate=lin(c + "wgate.weight") if cfg.arch == "v4" else None,
                ape=vec(c + "ape") if cfg.arch == "v4" else None,
            )
        if (cfg.arch == "v41" and i in cfg.index_source_layer_ids) or kind == "csa":
            x = a + "indexer."
            if cfg.arch == "v41":
                xw["idx_w"] = x + "weights_proj.weight"
            L.idx = SimpleNamespace(wq_b=lin(x + "wq_b.weight"),
                                    weights_proj=lin(x + "weights_proj.weight") if cfg.arch == "v4" else None)
            if cfg.arch == "v41" and kind == "source":
                L.idx.wk, L.idx.k_norm = lin(x + "wk.weight"), vec(x + "k_norm.weight")
            if kind == "csa":
                ic = x + "compressor."
                L.idx.comp = SimpleNamespace(wkv=lin(ic + "wkv.weight"), wgate=lin(ic + "wgate.weight"),
                                             ape=vec(ic + "ape"), norm=vec(ic + "norm.weight"))
        L.x_proj = _stacked_projections(ckpt, names, ops, xw)
        f = p + "ffn."
        L.gate_w = lin(f + "gate.weight")
        L.gate_bias = opt_vec(f + "gate.bias")
        L.tid2eid = ops.asarray(ckpt.raw(f + "gate.tid2eid").array, dtype=np.int64) if cfg.hash_layers[i] else None
        ec = plan.expert_cols if plan.expert_split == "width" else None  # this rank's slice of each expert
        L.experts = [(lin(f"{f}experts.{e}.w1.weight", rows=ec), lin(f"{f}experts.{e}.w2.weight", cols=ec),
                      lin(f"{f}experts.{e}.w3.weight", rows=ec)) if plan.owns_expert(e) else None
                     for e in range(cfg.n_routed_experts)]
        sc = plan.shared_cols
        L.shared = (lin(f + "shared_experts.w1.weight", rows=sc), lin(f + "shared_experts.w2.weight", cols=sc),
                    lin(f + "shared_experts.w3.weight", rows=sc)) if cfg.n_shared_experts and sc[1] > sc[0] else None
        if i in cfg.engram_layer_ids:
            e = p + "engram."
            scale = ckpt.raw(e + "embed.scale") if names.has(e + "embed.scale") else None
            table_arr = ops.prepare_table(ckpt.weight(e + "embed.weight"), scale)
            L.engram = SimpleNamespace(table=table_arr, wkv=lin(e + "wkv.weight"),
                                       qk=ops.asarray(ckpt.f32(e + "q_weight") * ckpt.f32(e + "k_weight")))
        w.layers.append(L)
    return w


def _stacked_projections(ckpt, names, ops, parts: dict) -> list:
    """[(weight, ((part, first row, end row), ...)), ...]: the named projections of one input, as one
    stacked weight where rows_stackable allows, else one weight each."""
    ws = {part: ckpt.weight(names.resolve(n)) for part, n in parts.items()}
    if len(ws) > 1 and rows_stackable(list(ws.values())):
        ends = np.cumsum([w.shape[0] for w in ws.values()])
        return [(ops.prepare_rows(list(ws.values())), tuple((part, int(e - w.shape[0]), int(e))
                                                            for (part, w), e in zip(ws.items(), ends, strict=True)))]
    return [(ops.prepare(w), ((part, 0, w.shape[0]),)) for part, w in ws.items()]
