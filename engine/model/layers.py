"""The parts DeepSeek-V4.1 and V4 share, named as DeepSeek's reference inference/model.py names them.

Each part holds its weights (engine/checkpoint/loader.py, this rank's slices) and the backend's
ops (engine/ops/protocol.py), and computes over the rows of a Batch (engine/model/batch.py).
Under tensor parallelism a part that ends in a partial sum says so with ops.all_reduce, as the
reference says dist.all_reduce; on one rank that is the identity.
"""

from __future__ import annotations

import numpy as np

from engine.model.batch import Batch, Projected, Seq
from engine.model.config import ModelConfig
from engine.model.rope import Rope
from engine.parallel.shard import ShardPlan
from engine.state.sequence import F32 as NO_CODEC

NEG_INF = np.float32(-np.inf)


def project(ops, x, stacked: list) -> dict:
    """Projections of x by name, from the loader's stacked weights (a stacked weight's parts are
    column slices of its one product)."""
    out = {}
    for w, parts in stacked:
        y = ops.linear(x, w)
        out.update({part: y[:, r0:r1] if len(parts) > 1 else y for part, r0, r1 in parts})
    return out


class Embedding:
    """ParallelEmbedding: token ids -> rows of this rank's vocabulary slice, summed over ranks."""

    def __init__(self, weight, plan: ShardPlan, ops) -> None:
        self.weight, self.ops, self.vocab, self.whole = weight, ops, plan.vocab, plan.size == 1

    def __call__(self, ids):
        ops = self.ops
        if self.whole:
            return ops.embed(self.weight, ids)
        v0, v1 = self.vocab
        local = (ids >= v0) & (ids < v1)  # ids of other ranks read row 0, zeroed before the sum
        return ops.all_reduce(ops.embed(self.weight, ops.xp.where(local, ids - v0, 0)) * local[:, None])


class Engram:
    """Writes an n-gram lookup into the streams, gated by how well it matches each stream."""

    def __init__(self, cfg: ModelConfig, li: int, w, ops) -> None:
        self.cfg, self.w, self.ops = cfg, w, ops
        self.column = cfg.engram_layer_ids.index(li)  # this layer's hash ids in a row's hash ids

    def __call__(self, h, hash_ids):
        ops, cfg = self.ops, self.cfg
        ids = ops.xp.ascontiguousarray(hash_ids[:, self.column])
        rows = ops.embed(self.w.table, ops.asarray(ids, dtype=np.int64))  # [T, cols, dim]
        kv = ops.linear(rows.reshape(rows.shape[0], -1), self.w.wkv)
        d, hc = cfg.hidden_size, cfg.hc_mult
        key, value = kv[:, : hc * d].reshape(-1, hc, d), kv[:, hc * d :]
        return ops.engram_mix(h, key, value, self.w.qk, cfg.rms_norm_eps)


class MoE:
    """Top-k routed experts (this rank's) plus the shared expert every token goes through."""

    def __init__(self, cfg: ModelConfig, w, ops) -> None:
        self.cfg, self.w, self.ops = cfg, w, ops

    def shared_expert(self, x):
        return self.ops.swiglu_mlp(x, *self.w.shared_experts, self.cfg.swiglu_limit)

    def __call__(self, x, ids):
        """x [T, hidden]; ids: the rows' token ids (hash-routed layers pick experts by them)."""
        cfg, ops, w = self.cfg, self.ops, self.w
        shared = self.shared_expert(x) if w.shared_experts is not None else None
        hashed = w.tid2eid[ids] if w.tid2eid is not None else None
        weights, experts = ops.route(x, w.gate, w.gate_bias, cfg.num_experts_per_tok, cfg.scoring_func,
                                     cfg.gate_temp, cfg.routed_scaling_factor, cfg.norm_topk_prob, hashed)
        return ops.all_reduce(ops.moe(x, w.experts, weights, experts, cfg.swiglu_limit, shared))


class Attention:
    """Shared-K=V MQA with sinks over a sliding window, plus the compressed entries a query may
    see (the compressor and indexer differ by architecture: V41Attention, V4Attention). The
    query and output projections are low rank, the output one grouped; RoPE sits on the trailing
    channels and is undone on the output."""

    def __init__(self, cfg: ModelConfig, li: int, w, ops, plan: ShardPlan, codecs: dict, rope: Rope) -> None:
        self.cfg, self.li, self.w, self.ops, self.codecs, self.rope = cfg, li, w, ops, codecs, rope
        self.heads = plan.heads[1] - plan.heads[0]  # this rank's query heads (0: none)
        self.ratio = cfg.compress_ratios[li]
        self.kind = cfg.layer_kinds[li]
        self.rope_name = "compress" if self.ratio else "main"

    def codec(self, field: str) -> int:
        """The state codec (engine/state/sequence.py) a state field's rows are rounded onto."""
        return self.codecs.get(field, NO_CODEC)

    def query_heads(self, q_res, cos, sin):
        """q_res -> this rank's query heads [T, H, D], RoPE applied (V4: each head RMS-normed)."""
        cfg, ops = self.cfg, self.ops
        q = ops.linear(q_res, self.w.wq_b).reshape(q_res.shape[0], self.heads, cfg.head_dim)
        return ops.norm_rope_quant(q, cos, sin, (None, cfg.rms_norm_eps) if cfg.arch == "v4" else None)

    def latents(self, x, cos, sin):
        """(q_res, query heads, the new K=V rows on the window's grid) of every row."""
        cfg, ops = self.cfg, self.ops
        lat = project(ops, x, self.w.qkv)
        q_res = ops.rmsnorm(lat["q_lat"], self.w.q_norm, cfg.rms_norm_eps)
        q = self.query_heads(q_res, cos, sin)
        kv = ops.norm_rope_quant(lat["kv_lat"], cos, sin, (self.w.kv_norm, cfg.rms_norm_eps), self.codec("window"))
        return q_res, q, kv

    def output(self, out, cos, sin, rows: int):
        """The attention output [T, H, D] with its RoPE undone, grouped wo_a, then wo_b: this
        rank's part of the layer's output, summed over ranks (a rank without heads adds 0)."""
        ops = self.ops
        if out is None:
            return ops.all_reduce(ops.xp.zeros((rows, self.cfg.hidden_size), dtype=np.float32))
        t, g = out.shape[0], self.w.wo_groups
        out = ops.rope(out, cos, sin, inverse=True, in_place=True)  # (wo_a rounds its input as it reads it)
        grouped = ops.grouped_linear(out.reshape(t, g, -1), self.w.wo_a, g)
        return ops.all_reduce(ops.linear(grouped.reshape(t, -1), self.w.wo_b))

    # ---- prompt chunks: one sequence at a time against its state ------------------------
    def compressed(self, x, q_res, p: Projected, s: Seq):
        """(the compressed entries the sequence's queries may see, which of them each query
        sees: bool [S, n]), or (None, None); grows the compressor's state."""
        raise NotImplementedError

    @property
    def selects(self) -> int:
        """An upper bound on the entries a query's mask selects (0: the causal limit only)."""
        return self.cfg.index_topk

    def chunks(self, x, q_res, q, kv, seqs: list[Seq], proj: Projected):
        """Each sequence's queries over its window, the new K=V rows and its compressed entries;
        grows the state. Returns the per-head output [T, H, D] (None on a rank without heads)."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        li, win, d = self.li, cfg.sliding_window, cfg.head_dim
        # one query per sequence: every sequence in one launch over its sources in place
        decode = bool(self.heads) and all(s.pos.size == 1 for s in seqs)
        # (a lone sequence's output is the whole output unless other rows share the step)
        whole = len(seqs) == 1 and seqs[0].rows == slice(0, q.shape[0])
        out = xp.empty_like(q) if not whole and not decode else None
        sources = []
        for s in seqs:
            st = s.state.layers[li]
            r = s.rows
            keys = ops.cat([st.window, kv[r]], axis=0)
            st.window = keys[max(keys.shape[0] - (win - 1), 0):] if win > 1 else keys[:0]
            srcs = [(keys, None)]  # a decode query sees its whole window
            comp = cvis = None
            if self.ratio:
                comp, cvis = self.compressed(x[r], q_res[r], proj.rows(r), s)
                if comp is None or not comp.shape[0]:
                    comp = cvis = None
                elif decode:
                    srcs.append((comp, cvis[0]))
            if decode:
                sources.append(srcs)
            elif self.heads:  # query i sees window keys lo[i] .. hi[i] (the state's rows, then the chunk's)
                i = np.arange(s.pos.size) + (keys.shape[0] - s.pos.size)
                lo, hi = np.maximum(i - (win - 1), 0), i + 1
                o = ops.attention_ranges(q[r], keys, lo, hi, comp, cvis, self.w.sinks, d**-0.5, self.selects,
                                         exact=self.codec("window") != NO_CODEC)
                if out is None:
                    out = o
                else:
                    out[r] = o
        if decode:
            out = ops.attention_decode(q, sources, self.w.sinks, d**-0.5)
        return out if self.heads else None

    def comp_tables(self, positions: np.ndarray) -> tuple:
        """Compressed-RoPE cos / sin at these positions, on the device in one upload."""
        t = self.ops.asarray(np.stack(self.rope.compressed(positions)))
        return t[0], t[1]

    def causal_cols(self, lens: np.ndarray, n: int):
        """Bool [S, n] on the backend: column j < lens[s] (the compressed entries or keys query s
        may see), built there rather than on the host and uploaded ([4096, 16384] at a 64k
        context)."""
        xp = self.ops.xp
        return xp.arange(n)[None, :] < self.ops.asarray(lens, dtype=np.int64)[:, None]


class Block:
    """A layer whose residual stream is hc_mult parallel copies (mHC): Attention and the MoE each
    sit between hc_pre (collapse the copies into one sub-layer input) and hc_post (expand back,
    mixing the residual in through comb); hc_mixes derives the pre / post / comb coefficients
    from the streams, comb made doubly stochastic by Sinkhorn."""

    def __init__(self, cfg: ModelConfig, li: int, w, ops, attn: Attention) -> None:
        self.cfg, self.li, self.w, self.ops, self.attn = cfg, li, w, ops, attn
        self.ffn = MoE(cfg, w.ffn, ops)
        self.engram = Engram(cfg, li, w.engram, ops) if w.engram is not None else None

    def hc_mixes(self, h, site: tuple):
        cfg = self.cfg
        return self.ops.hc_mixes(h, *site, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    def hc_pre(self, h, pre, norm):
        """The sub-layer's input: the streams collapsed by `pre`, RMS-normalised."""
        return self.ops.hc_collapse_norm(h, pre, norm, self.cfg.rms_norm_eps)

    def hc_post(self, out, h, post, comb):
        return self.ops.hc_expand(out, h, post, comb)

    def __call__(self, h, pre_mix, batch: Batch):
        """The streams h [T, hc, D] through this layer; pre_mix: V4.1's collapse weights of the
        first site (the previous site's, single-pass mHC; V4: None, each site collapses with its
        own). Returns the new streams and the next site's collapse weights."""
        raise NotImplementedError


class Head:
    """The streams' final collapse and norm, then this rank's vocabulary slice of the logits."""

    def __init__(self, cfg: ModelConfig, w, ops) -> None:
        self.cfg, self.w, self.ops = cfg, w, ops

    def __call__(self, h, pre_mix):
        cfg, ops, w = self.cfg, self.ops, self.w
        if pre_mix is None:  # V4: the head's own mix
            pre_mix = ops.hc_head_pre(h, *w.hc_head, cfg.rms_norm_eps, cfg.hc_eps)
        return ops.linear(ops.hc_collapse_norm(h, pre_mix, w.norm, cfg.rms_norm_eps), w.head)
