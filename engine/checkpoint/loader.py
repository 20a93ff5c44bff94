"""Temporary: today's load_weights, regrouped into the nested structure the model reads (until
the schema-driven loader lands)."""

from __future__ import annotations

from types import SimpleNamespace


def load_weights(cfg, ckpt, ops, plan) -> SimpleNamespace:
    from engine.model.transformer import load_weights as flat

    w = flat(cfg, ckpt, ops, plan)
    layers = []
    for L in w.layers:
        attn = SimpleNamespace(q_norm=L.q_norm, kv_norm=L.kv_norm, wq_b=L.wq_b, sinks=L.sinks, wo_a=L.wo_a,
                               wo_b=L.wo_b, wo_groups=getattr(L, "wo_groups", 0), qkv=L.qkv, x_proj=L.x_proj,
                               compressor=L.comp, indexer=L.idx)
        if L.idx is not None and not hasattr(L.idx, "comp"):
            L.idx.comp = None
        if L.idx is not None:
            L.idx.compressor = L.idx.comp
        ffn = SimpleNamespace(gate=L.gate_w, gate_bias=L.gate_bias, tid2eid=L.tid2eid, experts=L.experts,
                              shared_experts=L.shared)
        layers.append(SimpleNamespace(attn_norm=L.attn_norm, ffn_norm=L.ffn_norm, hc_attn=L.hc_attn,
                                      hc_ffn=L.hc_ffn, attn=attn, ffn=ffn, engram=L.engram))
    return SimpleNamespace(embed=w.embed, head=w.head, norm=w.norm, hc_head=getattr(w, "hc_head", None),
                           layers=layers)
