"""DeepSeek-V4: what each layer computes.

Every compressing layer keeps its own compressed entries: CSA layers pool two overlapping series
of `ratio` rows and pick each query's top-k entries with their own indexer (its own compressor of
indexer keys); HCA layers pool plain groups and let every query see every closed group. Hash
layers route tokens to experts by a table; queries are RMS-normed per head; each mHC site
collapses the streams with its own mixes, and the head with a mix of its own (hc_head). The state
stays float32, the reference's precision. V4 has no batched decode path: every row takes the
prompt-chunk attention.
"""

from __future__ import annotations

import numpy as np

from engine.model.batch import Batch, Projected, Seq
from engine.model.layers import NEG_INF, Attention, Block
from engine.state.sequence import LayerState


class V4Attention(Attention):
    @property
    def selects(self) -> int:  # (HCA: every closed group, up to the causal limit)
        return self.cfg.index_topk if self.kind == "csa" else 0

    def __call__(self, x, batch: Batch):
        cos, sin = batch.rope[self.rope_name]
        q_res, q, kv = self.latents(x, cos, sin)
        return self.chunks(x, q_res, q, kv, batch.chunks, Projected())

    def pool(self, kv, gate, c, st: LayerState, prefix: str, overlap: bool):
        """The compressor c (CSA with two overlapping series, or HCA): entries closing in this
        chunk, RoPE'd, or None. Its state fields are `<prefix>buf_kv` etc."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        ratio = self.ratio
        keys = "entries" if prefix == "" else "idx_keys"
        n_before = 0 if getattr(st, keys) is None else getattr(st, keys).shape[0]
        bkv, bgate = getattr(st, prefix + "buf_kv"), getattr(st, prefix + "buf_gate")
        if bkv is not None and bkv.shape[0]:
            kv, gate = ops.cat([bkv, kv]), ops.cat([bgate, gate])
        usable = (kv.shape[0] // ratio) * ratio
        setattr(st, prefix + "buf_kv", kv[usable:])
        setattr(st, prefix + "buf_gate", gate[usable:])
        if usable == 0:
            return None
        g = usable // ratio
        ck = kv[:usable].reshape(g, ratio, -1)
        cg = gate[:usable].reshape(g, ratio, -1) + c.ape
        if overlap:
            d = ck.shape[-1] // 2
            nkv = xp.zeros((g, 2 * ratio, d), dtype=xp.float32)
            ngate = xp.full((g, 2 * ratio, d), NEG_INF, dtype=xp.float32)
            nkv[:, ratio:], ngate[:, ratio:] = ck[..., d:], cg[..., d:]
            if g > 1:
                nkv[1:, :ratio], ngate[1:, :ratio] = ck[:-1, :, :d], cg[:-1, :, :d]
            okv = getattr(st, prefix + "ovl_kv")
            if okv is not None:
                nkv[0, :ratio], ngate[0, :ratio] = okv, getattr(st, prefix + "ovl_gate")
            setattr(st, prefix + "ovl_kv", ck[-1, :, :d].copy())
            setattr(st, prefix + "ovl_gate", cg[-1, :, :d].copy())
            ck, cg = nkv, ngate
        pooled = ops.rmsnorm(ops.gated_pool(ck, cg), c.norm, cfg.rms_norm_eps)
        first = n_before * ratio
        return ops.rope(pooled, *self.comp_tables(first + ratio * np.arange(pooled.shape[0])))

    def compressed(self, x, q_res, p: Projected, s: Seq):
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        st = s.state.layers[self.li]
        c = self.w.compressor
        csa = self.kind == "csa"
        new = self.pool(ops.linear(x, c.wkv), ops.linear(x, c.wgate), c, st, "", csa)
        if new is not None:
            st.entries = new if st.entries is None else ops.cat([st.entries, new], axis=0)
        lens = (s.pos + 1) // self.ratio
        n = st.n_entries
        visible = self.causal_cols(lens, n)
        if csa:
            idx = self.w.indexer
            ic = idx.compressor
            newk = self.pool(ops.linear(x, ic.wkv), ops.linear(x, ic.wgate), ic, st, "idx_", True)
            if newk is not None:
                st.idx_keys = newk if st.idx_keys is None else ops.cat([st.idx_keys, newk], axis=0)
            if n:
                hi, di = cfg.index_n_heads, cfg.index_head_dim
                q = ops.linear(q_res, idx.wq_b).reshape(-1, hi, di)
                q = ops.rope(q, *self.comp_tables(s.pos))
                scores = ops.indexer_scores(q, st.idx_keys, ops.linear(x, idx.weights_proj), hi, di)
                scores = xp.where(visible, scores, NEG_INF)
                visible = ops.topk_mask(scores, min(cfg.index_topk, n))
        if n == 0:
            return None, None
        return st.entries, visible


class V4Block(Block):
    def __call__(self, h, pre_mix, batch: Batch):
        w, attn = self.w, self.attn
        if self.engram is not None:
            h = self.engram(h, batch.hash_ids)
        pre, post, comb = self.hc_mixes(h, w.hc_attn)
        out = attn(self.hc_pre(h, pre, w.attn_norm), batch)
        h = self.hc_post(attn.output(out, *batch.rope[attn.rope_name], h.shape[0]), h, post, comb)
        pre, post, comb = self.hc_mixes(h, w.hc_ffn)
        y = self.ffn(self.hc_pre(h, pre, w.ffn_norm), batch.ids)
        return self.hc_post(y, h, post, comb), None
