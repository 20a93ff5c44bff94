"""DeepSeek-V4.1: what each layer computes.

CSA2: layers sharing a compression ratio share one group's state: its KV source compresses the
group's K=V into entries (and MXFP4 indexer keys), its index source scores them and publishes
each query's top-k for the group (and, at the candidate source, a first level of candidate
blocks). Engram layers add an n-gram lookup into the streams. Single-pass mHC: a site collapses
the streams with the previous site's weights, so its own mixes are needed only at its expand.
The state is stored on DeepSeek's FP8 / FP4 grids (engine/state/sequence.py codecs).

Rows come in two shapes (engine/model/batch.py): prompt chunks, one sequence at a time against
its state (`chunks`), and V4.1's batched decode rows, whose state rows the host planned before
any kernel ran (engine/state/decode_plan.py), so every sequence is one launch per op
(`decode`). The two compute the same values; tests/unit/test_model_consistency.py checks them
bit for bit.
"""

from __future__ import annotations

import numpy as np

from engine.model.batch import Batch, Projected, Seq
from engine.model.layers import NEG_INF, Attention, Block, project
from engine.state.sequence import F32 as NO_CODEC
from engine.state.sequence import LayerState


class Compressor:
    """Pools `ratio` consecutive rows into one entry with a learned softmax gate (the KV source of
    a group). Its projections of x run with the layer's others (V41Attention.projections); here
    the pooling, the norm and RoPE at the group's first position, and the state's partial group."""

    def __init__(self, attn: V41Attention, w) -> None:
        self.attn, self.w, self.ops = attn, w, attn.ops

    def pool(self, p: Projected, st: LayerState, ratio: int):
        """Pooled rows (before the norm) of the groups that close in this chunk (None if none),
        and the position of the first."""
        ops = self.ops
        first = st.n_entries * ratio
        kv, gate = p.comp_kv, p.comp_gate
        if st.buf_kv is not None and st.buf_kv.shape[0]:
            kv, gate = ops.cat([st.buf_kv, kv]), ops.cat([st.buf_gate, gate])
        usable = (kv.shape[0] // ratio) * ratio
        # copies: kv / gate may be a captured step's outputs, which the next replay overwrites
        st.buf_kv, st.buf_gate = kv[usable:].copy(), gate[usable:].copy()
        if usable == 0:
            return None, first
        g, dd = usable // ratio, kv.shape[1]
        return ops.gated_pool(kv[:usable].reshape(g, ratio, dd), gate[:usable].reshape(g, ratio, dd)), first

    def entry_and_key(self, pooled, cos, sin, indexer: Indexer | None) -> tuple:
        """A closed group's compressed entry and indexer key (None without an indexer) from its
        pooled row (pre-norm), RoPE at the group's first position: the entry is the normed latent
        rotated (stored as FP4 e2m1 + e4m3 scale per 16), the key the latent through wk, normed and
        rotated (MXFP4)."""
        ops, attn, eps = self.ops, self.attn, self.attn.cfg.rms_norm_eps
        latent, entry = ops.norm_rope_quant(pooled, cos, sin, (self.w.norm, eps), attn.codec("entries"),
                                            keep_normed=True)
        if indexer is None:
            return entry, None
        iw = indexer.w
        key = ops.norm_rope_quant(ops.linear(latent, iw.wk), cos, sin, (iw.k_norm, eps), attn.codec("idx_keys"))
        return entry, key


class Indexer:
    """Keeps the index_topk best compressed entries per query: FP4 query heads against one shared
    key per entry, scores rectified and weighted by weights_proj (an index source of its group)."""

    def __init__(self, attn: V41Attention, w) -> None:
        self.attn, self.w, self.ops, self.cfg = attn, w, attn.ops, attn.cfg

    def queries(self, q_res, cos, sin):
        """The queries: RoPE, then MXFP4 (the grid of the keys they are scored against)."""
        cfg, ops = self.cfg, self.ops
        q = ops.linear(q_res, self.w.wq_b).reshape(-1, cfg.index_n_heads, cfg.index_head_dim)
        return ops.norm_rope_quant(q, cos, sin, None, self.attn.codec("idx_keys"))

    def candidate_blocks(self, scores, last):
        """Level one of the two-level top-k: the best blocks of `candidate_block_size` entries per
        query (block score = its best entry); the block holding the newest entry (last: each row's,
        a backend int64 array, -1 when nothing is visible yet) is always kept."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        bs = cfg.candidate_block_size
        s, n = scores.shape
        nb = -(-n // bs)
        padded = xp.full((s, nb * bs), NEG_INF, dtype=np.float32)
        padded[:, :n] = scores
        block = padded.reshape(s, nb, bs).max(axis=-1)
        block = xp.where(xp.arange(nb)[None, :] == last[:, None], np.float32(np.inf), block)
        keep = ops.topk_mask(block, min(cfg.candidate_topk_blocks, nb))
        return xp.repeat(keep, bs, axis=1)[:, :n]

    def select(self, p: Projected, s: Seq) -> None:
        """Publish this sequence's top-k mask (and candidate blocks) for the group (a chunk)."""
        attn, cfg, ops, xp = self.attn, self.cfg, self.ops, self.ops.xp
        li, ratio = attn.li, attn.ratio
        keys = s.state.layers[cfg.kv_group_source(li)].idx_keys
        if keys is None or keys.shape[0] == 0:
            return
        n = keys.shape[0]
        # (queries and keys rounded onto the same codec's grid are exact in bf16)
        scores = ops.indexer_scores(p.idx_q, keys, p.idx_w, cfg.index_n_heads, cfg.index_head_dim,
                                    exact=attn.codec("idx_keys") != NO_CODEC)
        lens = (s.pos + 1) // ratio
        if not (lens >= n).all():  # queries that see only part of the keys (prefill)
            scores = xp.where(attn.causal_cols(lens, n), scores, NEG_INF)
        cand = cfg.candidate_source_layer_id
        if li == cand:
            s.shared["cand"] = self.candidate_blocks(scores, ops.asarray((lens - 1) // cfg.candidate_block_size,
                                                                         dtype=np.int64))
        elif 0 <= cand < li and s.shared.get("cand") is not None and s.shared["cand"].shape[1] == n:
            scores = xp.where(s.shared["cand"], scores, NEG_INF)
        s.shared["topk"] = ops.topk_mask(scores, min(cfg.index_topk, n))


class V41Attention(Attention):
    def __init__(self, cfg, li, w, ops, plan, codecs, rope) -> None:
        super().__init__(cfg, li, w, ops, plan, codecs, rope)
        self.compressor = Compressor(self, w.compressor) if w.compressor is not None else None
        self.indexer = Indexer(self, w.indexer) if w.indexer is not None else None
        self.source = self.kind == "source"

    def projections(self, x, q_res, cos, sin) -> Projected:
        """The token-wise part of the compressor and indexer, done for every row before any
        attention (see Projected): the attention then only appends and selects."""
        p = [None] * len(Projected._fields)
        if not self.ratio:
            return Projected(*p)
        idx_q = self.indexer.queries(q_res, cos, sin) if self.indexer is not None else None
        xs = project(self.ops, x, self.w.x_proj)  # the compressor's kv / gate, the indexer's head weights
        if self.source:
            if self.ratio > 1:
                p[0], p[1] = xs["comp_kv"], xs["comp_gate"]
            else:  # every token closes its own group at its own position: the entry and key now
                p[2], p[3] = self.compressor.entry_and_key(xs["comp_kv"], cos, sin, self.indexer)
        if idx_q is not None:
            p[4], p[5] = idx_q, xs["idx_w"]
        return Projected(*p)

    def __call__(self, x, batch: Batch):
        """Every row's attention over its window and selected entries ([T, H, D]; None on a rank
        without heads); grows the state."""
        cos, sin = batch.rope[self.rope_name]
        q_res, q, kv = self.latents(x, cos, sin)
        proj = self.projections(x, q_res, cos, sin)
        if batch.plans is not None and not batch.chunks:
            return self.decode(q, kv, proj, batch.plans[self.li], batch.published)
        out = self.chunks(x, q_res, q, kv, batch.chunks, proj)
        if batch.plans is not None:  # the one-token sequences' rows, batched, beside the chunks
            d = batch.dec_rows
            o = self.decode(q[d], kv[d], proj.take(d), batch.plans[self.li], batch.published)
            if out is not None:
                out[d] = o
        return out

    # ---- prompt chunks -----------------------------------------------------------------
    def compressed(self, x, q_res, p: Projected, s: Seq):
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        st = s.state.layers[self.li]
        rotated = keys_new = None
        if self.source:
            if self.ratio == 1:
                rotated, keys_new = p.entry, p.idx_key
            else:
                pooled, first = self.compressor.pool(p, st, self.ratio)
                if pooled is not None:  # RoPE at each closing group's first position
                    cos, sin = self.comp_tables(first + self.ratio * np.arange(pooled.shape[0]))
                    rotated, keys_new = self.compressor.entry_and_key(pooled, cos, sin, self.indexer)
            if keys_new is not None:  # (a copy: a captured step's outputs are rewritten by its next replay)
                st.idx_keys = keys_new.copy() if st.idx_keys is None else ops.cat([st.idx_keys, keys_new])
        if self.indexer is not None:
            self.indexer.select(p, s)
        if rotated is not None:
            st.entries = rotated.copy() if st.entries is None else ops.cat([st.entries, rotated], axis=0)
        entries = s.state.layers[cfg.kv_group_source(self.li)].entries
        if entries is None or entries.shape[0] == 0:
            return None, None
        mask = s.shared.get("topk")
        if mask is None or mask.shape[1] != entries.shape[0]:
            # no index source has scored this group in this forward: nothing is selected
            return entries, xp.zeros((s.pos.size, entries.shape[0]), dtype=bool)
        return entries, mask


    # ---- decode rows ---------------------------------------------------------------------
    def decode(self, q, kv, p: Projected, lp, published: dict):
        """The device half of a decode step of this layer (lp: its staged LayerPlan): the new rows
        into the state, the closing groups pooled into entries and indexer keys, the index
        source's top-k published for later layers, then one attention launch over each window and
        its group's selected entries, read in place."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        entry, key = p.entry, p.idx_key
        # the new rows into the state: the window's, and where ratio > 1 each one into its group
        ops.scatter_rows(kv, lp.win_dst)
        if lp.pool_kv is not None:
            ops.scatter_rows(p.comp_kv, lp.pend_kv)
            ops.scatter_rows(p.comp_gate, lp.pend_gate)
            pooled = ops.gated_pool_rows(lp.pool_kv, lp.pool_gate, self.ratio, cfg.head_dim)  # closing groups
            entry, key = self.compressor.entry_and_key(pooled, lp.pool_rope[0], lp.pool_rope[1], self.indexer)
        for a, dst in ((entry, lp.entry_dst), (key, lp.key_dst)):
            if dst is not None:
                ops.scatter_rows(a, dst)
        if lp.keys is not None:  # index source: every sequence's top-k over its group's keys
            scores = ops.indexer_scores_spans(p.idx_q, lp.keys, p.idx_w, cfg.index_n_heads, cfg.index_head_dim,
                                              lp.keys_cap)
            if lp.cand == "source":
                published["cand"] = self.indexer.candidate_blocks(scores, lp.cand_last)
            elif lp.cand == "filter":
                scores = xp.where(published["cand"], scores, NEG_INF)
            published["topk"] = ops.topk_mask(scores, min(cfg.index_topk, lp.keys_cap))
        if not self.heads:
            return None
        mask = published.get("topk")  # (its width is the publishing layer's keys_cap: at most index_topk true a row)
        return ops.attend_decode(q, lp.attend, mask, self.w.sinks, cfg.head_dim**-0.5, lp.attend_cap,
                                 cfg.sliding_window, 0 if mask is None else min(cfg.index_topk, mask.shape[1]))


class V41Block(Block):
    def __call__(self, h, pre_mix, batch: Batch):
        w, attn = self.w, self.attn
        if self.engram is not None:
            h = self.engram(h, batch.hash_ids)
        if batch.targets is not None and self.li in batch.targets:  # the draft reads what enters a target layer
            batch.targets[self.li] = self.ops.act(h.mean(axis=1))
        mixes = self.hc_mixes(h, w.hc_attn)  # needed only at this site's expand
        out = attn(self.hc_pre(h, pre_mix, w.attn_norm), batch)
        h = self.hc_post(attn.output(out, *batch.rope[attn.rope_name], h.shape[0]), h, *mixes[1:])
        pre_a = mixes[0]
        mixes = self.hc_mixes(h, w.hc_ffn)
        y = self.ffn(self.hc_pre(h, pre_a, w.ffn_norm), batch.ids)
        return self.hc_post(y, h, *mixes[1:]), mixes[0]
