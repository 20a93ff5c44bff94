"""Attention on the GPU: MQA with K == V and per-head sinks, the indexer's scores, top-k masks,
the compressor's gated pooling and a decode step's state-row scatters.

A prompt chunk's attention reads each query's own keys only (its window as a range of the keys,
then the compressed entries its top-k mask selects): on tensor cores where heads and head_dim are
multiples of 64, else one decode-kernel query per row. A decode step's attention reads every
sequence's window and entries in place through a staged table (engine/state/decode_plan.py), split
over the keys so that a short batch still fills the GPU; under --numerics deepseek, steps of many
rows (a verify step's) read it on bf16 tensor cores instead, a block per (row, 64 heads).
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np

from engine.ops import kernels as K
from engine.ops.gpu.common import _ELT_BLOCK, _NULL, F32, _c32, _grid, _ptr, _smem_function, _span_ptr
from engine.state.rows import Span

# The indexer's scores on tensor cores (kernels/indexer.cu indexer_scores_tc* and indexer_scores_bf) for launches of at
# least ITC_MIN_QUERIES queries (fewer do not fill its tiles: the CUDA-core kernel).
ITC_ROWS, ITC_MIN_QUERIES = 128, 16  # (query, head) rows per block (ITC_ROWS in the kernel)
# A prompt chunk's sparse attention on tensor cores under exact numerics (attn_tc_*, three passes
# through an [n, H, L] score buffer, n <= ATC_QUERIES queries at a time).
ATC_QUERIES = K.ATTEND_TC_QUERIES
# attn_sparse_bf's instances (head dims padded up to one of them)
ASB_DIMS = (64, 128, 256, 512)
ASB_MAX_DIM = ASB_DIMS[-1]
# decode attention: split the keys until about this many blocks run, each split >= this many keys (a
# multiple of the kernel's 16-key tile: each tile's loads are a round trip)
ATT_BLOCKS_TARGET, ATT_MIN_SPLIT = 132 * 2, 64
# decode / verify attention under --numerics deepseek from this many query rows on (heads in 64s,
# head_dim <= ASB_MAX_DIM): attn_table_bf, a block per (row, 64 heads) on bf16 MMAs, which reads a
# row's keys once for 64 heads where attention_decode reads them once per 8; fewer rows leave the
# GPU idle without attention_decode's split over the keys
ATB_MIN_ROWS = 32


def _indexer_tc_shape(s: int, h: int, dh: int) -> bool:
    """Whether the tensor-core indexer kernel takes this launch (kernels/indexer.cu
    indexer_tc_body's limits; and enough queries to fill its tiles)."""
    return h % 32 == 0 and ITC_ROWS % h == 0 and dh % 16 == 0 and dh <= 128 and s >= ITC_MIN_QUERIES


def _indexer_tc_smem(dh: int, terms: int) -> int:
    """Dynamic shared memory of indexer_scores_tc<terms>: the block's 128 bf16 rows of dh + 8 and
    its key tiles of 64 (two slots for one term), per term, and the warps' sums."""
    return terms * (ITC_ROWS + 64 * (2 if terms == 1 else 1)) * (dh + 8) * 2 + 8 * 32 * 4


def _indexer_bf_smem(dh: int) -> int:
    """Dynamic shared memory of indexer_scores_bf (kernels/indexer.cu IXB_SMEM): 128 rows and two
    128-key tiles of dh + 8 bf16, and the warps' 64 sums."""
    return (ITC_ROWS + 2 * 128) * (dh + 8) * 2 + 8 * 64 * 4


def _asb_smem(dp: int) -> int:
    """Dynamic shared memory of attn_sparse_bf<dp> (kernels/attention.cu ASB_SMEM): q and two key
    tiles of 64 rows of dp + 8 bf16, P [64][72] bf16, the tiles' key flags, the maxima and sums."""
    return 3 * 64 * (dp + 8) * 2 + 64 * 72 * 2 + 2 * 64 + 4 * 64 * 4


def _bf16_keys(k: cp.ndarray) -> cp.ndarray:
    """The indexer's keys as bf16 [N, Dh] for the one-term tensor-core kernels: their f32 values'
    high halves, exact where the keys lie on a state codec's grid."""
    return cp.ascontiguousarray(_c32(k).view(cp.uint16)[:, 1::2])


def _indexer_smem(h: int, dh: int) -> int:
    """Dynamic shared memory bytes of an indexer scores launch (kernels/indexer.cu indexer_row)."""
    return 4 * (h * (dh + 1) + h + 8 * dh)


class AttentionOps:
    """CupyOps' attention, indexer, top-k, pooling and state-row ops."""


    def attention_ranges(self, q: cp.ndarray, keys: cp.ndarray, lo, hi,
                         entries: cp.ndarray | None, emask: cp.ndarray | None, sinks: cp.ndarray, scale: float,
                         selected: int = 0, exact: bool = False, span: int = 0) -> cp.ndarray:
        """NumpyOps.attention_ranges, each query over its own keys only: its window read as a range
        of `keys`, then its entries under its mask row (through the row's list of selected rows
        where `selected` bounds them far below the entries' count). On tensor cores where heads and
        head_dim are multiples of 64 (_attention_ranges_tc; exact: keys and entries on state codecs'
        grids), else one attention_decode query per row. lo / hi may be device arrays (a captured
        region's inputs: nothing is uploaded), with span = max(hi - lo) given."""
        s, h, d = q.shape
        dev = isinstance(lo, cp.ndarray)
        if dev and span <= 0:
            raise ValueError("attention_ranges: device lo / hi need their span")
        if s == 0:
            return cp.empty((0, h, d), F32)
        keys = _c32(keys)
        entries = None if entries is None else _c32(entries)
        n_e = 0 if entries is None else entries.shape[0]
        masks = None if entries is None else cp.ascontiguousarray(emask, dtype=cp.bool_)
        lists = self._mask_rows(masks, selected) if n_e and 0 < selected and 2 * selected <= n_e else None
        if h % 64 == 0 and d % 64 == 0:  # (attn_tc_* take heads and head_dim in 64-wide tiles)
            return self._attention_ranges_tc(q, keys, lo, hi, entries, masks, lists, sinks, scale, exact, span)
        if d % 32 or d > 512:
            raise ValueError(f"attention kernel needs head_dim % 32 == 0 and <= 512 (got {d})")
        out = cp.empty((s, h, d), F32)
        if dev:  # the table built on the device
            tab = cp.zeros((s, 6), cp.int64)
            tab[:, 0] = lo * (d * 4) + _ptr(keys)
            tab[:, 1] = hi - lo
            if entries is not None:
                tab[:, 3], tab[:, 4], tab[:, 5] = _ptr(entries), n_e, 1
            longest = span + (selected if lists is not None else n_e)
            return self._attention_decode(q, tab, masks, sinks, scale, longest, out, lists)
        tab = np.zeros((s, 6), np.int64)
        tab[:, 0] = _ptr(keys) + np.asarray(lo, np.int64) * d * 4
        tab[:, 1] = np.asarray(hi, np.int64) - np.asarray(lo, np.int64)
        if entries is not None:
            tab[:, 3], tab[:, 4], tab[:, 5] = _ptr(entries), n_e, 1
        longest = int(tab[:, 1].max()) + (selected if lists is not None else n_e)
        # (keys / entries stay referenced here until the launch below is enqueued)
        return self._attention_decode(q, self.asarray(tab, dtype=np.int64), masks, sinks, scale, longest, out, lists)

    def _attention_ranges_tc(self, q, keys: cp.ndarray, lo, hi, entries, masks, lists,
                             sinks, scale: float, exact: bool, span: int = 0) -> cp.ndarray:
        """attention_ranges on tensor cores (kernels/attention.cu attn_tc_*): per block of up to
        ATC_QUERIES queries, their [n, H, L] scores over each one's keys (window, then its listed
        entries, or without lists those its mask row allows), softmax with the sinks in place,
        then times V; with bf16 numerics, _attention_ranges_bf. keys / entries: contiguous f32;
        masks: contiguous bool [S, n_e]."""
        s, h, d = q.shape
        qc, sk = _c32(q), _c32(sinks)
        n_e = 0 if entries is None else entries.shape[0]
        masks = masks if lists is None else None  # (the lists stand for the mask)
        width = lists[0].shape[1] if lists is not None else n_e
        lo_d, hi_d = (a.astype(cp.int64, copy=False) if isinstance(a, cp.ndarray)
                      else self.asarray(np.asarray(a, np.int64), dtype=np.int64) for a in (lo, hi))
        if self.bf16:
            return self._attention_ranges_bf(qc, keys, lo_d, hi_d, entries, masks, lists, sk, scale, exact)
        ents = entries if entries is not None else _NULL
        span = (span or int((np.asarray(hi) - np.asarray(lo)).max())) + width
        L = max(64, -(-span // 64) * 64)
        name = "1" if exact else "3"
        out = cp.empty((s, h, d), F32)
        for s0 in range(0, s, ATC_QUERIES):
            s1 = min(s, s0 + ATC_QUERIES)
            n = s1 - s0
            sc = cp.empty((n, h, L), F32)
            args = (qc[s0:s1], keys, lo_d[s0:s1], hi_d[s0:s1], ents,
                    lists[0][s0:s1] if lists is not None else _NULL, lists[1][s0:s1] if lists is not None else _NULL,
                    np.int32(width if lists is not None else 0), masks[s0:s1] if masks is not None else _NULL,
                    np.int32(n_e), sc, np.int32(h), np.int32(d), np.int32(L))
            K.function("attention", f"attn_tc_scores{name}")((L // 64, n, h // 64), (128,), args)
            K.function("attention", "attn_tc_softmax")((-(-(n * h) // 8),), (256,), (
                sc, sk, np.int32(h), np.int32(L), np.int64(n * h), F32(scale)))
            K.function("attention", f"attn_tc_pv{name}")((d // 64, n, h // 64), (128,), (*args, out[s0:s1]))
        return out

    def _attention_ranges_bf(self, q: cp.ndarray, keys: cp.ndarray, lo: cp.ndarray, hi: cp.ndarray, entries,
                             masks, lists, sinks: cp.ndarray, scale: float, exact: bool) -> cp.ndarray:
        """_attention_ranges_tc under --numerics deepseek: one pass per (query, 64 heads) block
        (kernels/attention.cu attn_sparse_bf), keys and entries as bf16 rows (their f32 values' high
        halves: exact, they lie on bf16's grid)."""
        s, h, d = q.shape
        if not exact:
            raise ValueError("bf16 attention takes keys on bf16's grid (exact)")
        if d > ASB_MAX_DIM:
            raise ValueError(f"bf16 prefill attention takes head_dim <= {ASB_MAX_DIM} (got {d})")
        dp = next(p for p in ASB_DIMS if p >= d)
        smem = _asb_smem(dp)
        out = cp.empty((s, h, d), F32)
        n_e = 0 if entries is None else entries.shape[0]
        _smem_function("attention", f"attn_sparse_bf{dp}", smem)((s, h // 64), (256,), (
            q, _bf16_keys(keys), lo, hi, _bf16_keys(entries) if entries is not None else _NULL,
            lists[0] if lists is not None else _NULL, lists[1] if lists is not None else _NULL,
            np.int32(lists[0].shape[1] if lists is not None else 0), masks if masks is not None else _NULL,
            np.int32(n_e), sinks, out, np.int32(h), np.int32(d), F32(scale)), shared_mem=smem)
        return out

    def attention_decode(self, q: cp.ndarray, sources: list, sinks: cp.ndarray, scale: float) -> cp.ndarray:
        """Decode attention of B sequences, one query each, in one launch: q [B, H, D]; sources[b]
        lists up to two (kv [n, D], mask bool [n] or None = all visible) K=V sources of sequence b
        (its window, then its compressed entries), read in place. Split over the keys so that a
        short batch still fills the GPU; the splits are merged in a fixed order."""
        b, h, d = q.shape
        out = cp.empty((b, h, d), F32)
        if b == 0:
            return out
        if d % 32 or d > 512:
            raise ValueError(f"attention kernel needs head_dim % 32 == 0 and <= 512 (got {d})")
        tab = np.zeros((b, 6), np.int64)
        keep = []  # the contiguous arrays whose pointers the table holds, alive until the launch
        for i, srcs in enumerate(sources):
            if len(srcs) > 2:
                raise ValueError("attention_decode takes at most two K=V sources per sequence")
            for j, (kv, mask) in enumerate(srcs):
                if isinstance(kv, Span):  # rows of a state buffer, read in place
                    n, kp = kv.n, _span_ptr(kv, d)
                else:
                    if kv is None or kv.shape[0] == 0:
                        continue
                    kv = _c32(kv)
                    if kv.shape[1] != d:
                        raise ValueError("attention_decode: a source's rows do not match the queries")
                    keep.append(kv)
                    n, kp = kv.shape[0], _ptr(kv)
                if n == 0:
                    continue
                if isinstance(mask, Span):  # row `start` of a [B, N] bool mask
                    if mask.buf.dtype != cp.bool_ or not mask.buf.flags.c_contiguous or mask.n != n:
                        raise ValueError("attention_decode: a mask row must be C-contiguous bool of the source's n")
                    mp = _ptr(mask.buf) + mask.start * mask.buf.shape[1]
                else:
                    mk = None if mask is None else cp.ascontiguousarray(mask, dtype=cp.bool_).reshape(-1)
                    if mk is not None and mk.size != n:
                        raise ValueError("attention_decode: a source's mask does not match its rows")
                    keep.append(mk)
                    mp = _ptr(mk)
                tab[i, 3 * j:3 * j + 3] = (kp, n, mp)
        longest = int((tab[:, 1] + tab[:, 4]).max())
        return self._attention_decode(q, self.asarray(tab, dtype=np.int64), None, sinks, scale, longest, out)

    def attend_decode(self, q: cp.ndarray, attend: cp.ndarray, mask: cp.ndarray | None, sinks: cp.ndarray,
                      scale: float, longest: int, window: int = 0, selected: int = 0) -> cp.ndarray:
        """A V4.1 decode step's attention from its staged table (engine/state/decode_plan.py: each
        sequence's window, then its group's entries under row b of the published top-k `mask`);
        the split over the keys is sized for `longest` keys (the plan's capacity bucket), so the
        launch is the same whatever the exact counts. With at most `window` window rows and
        `selected` true values per mask row given, the entries are read through each row's list of
        selected rows where that is far shorter; the lists of one mask serve every layer that reads it."""
        b, h, d = q.shape
        out = cp.empty((b, h, d), F32)
        if b == 0:
            return out
        lists = None
        if mask is not None and selected > 0 and 2 * (window + selected) <= longest:
            lists = self._mask_rows(mask, selected)
            longest = window + selected
        return self._attention_decode(q, attend, mask, sinks, scale, longest, out, lists)

    def _mask_rows(self, mask: cp.ndarray, k: int) -> tuple:
        """(rows [B, k] int32, counts [B] int32): each mask row's true positions (kernels/attention.cu
        mask_rows), computed once per mask (kept with it: the layers of a group read one mask)."""
        hit = self._rows_of_mask
        if hit is not None and hit[0] is mask and hit[1] == k:
            return hit[2]
        b, n = mask.shape
        lists = (cp.empty((b, k), cp.int32), cp.empty((b,), cp.int32))
        K.function("attention", "mask_rows")((b,), (256,), (mask, np.int32(n), lists[0], lists[1], np.int32(k)))
        self._rows_of_mask = (mask, k, lists)
        return lists

    def _attention_decode(self, q, tab: cp.ndarray, masks, sinks, scale: float, longest: int, out,
                          lists: tuple | None = None) -> cp.ndarray:
        b, h, d = q.shape
        if d % 32 or d > 512:
            raise ValueError(f"attention kernel needs head_dim % 32 == 0 and <= 512 (got {d})")
        if masks is not None and (masks.dtype != cp.bool_ or not masks.flags.c_contiguous):
            raise ValueError("attend_decode: the mask must be a C-contiguous bool [B, N] array")
        if self.bf16 and b >= ATB_MIN_ROWS and h % 64 == 0 and d <= ASB_MAX_DIM:
            return self._attention_table_bf(q, tab, masks, sinks, scale, out, lists)
        longest = max(1, longest)
        blocks = -(-h // 8) * b
        nsplit = max(1, min(-(-ATT_BLOCKS_TARGET // blocks), -(-longest // ATT_MIN_SPLIT)))
        per_split = -(-longest // nsplit)
        chunk = -(-per_split // 16) * 16  # a multiple of the kernel's 16-row tile
        nsplit = -(-longest // chunk)  # (whole tiles per split may need fewer splits)
        # one split writes `out` directly and never touches the partials (`out` stands in for them)
        part_o = cp.empty((b, h, nsplit, d), F32) if nsplit > 1 else out
        part_ml = cp.empty((b, h, nsplit, 2), F32) if nsplit > 1 else out
        qc, sk = _c32(q), _c32(sinks)
        masks_ld = 0 if masks is None else masks.shape[1]
        K.function("attention", "attention_decode")((-(-h // 8), b, nsplit), (256,), (
            qc, tab, masks if masks is not None else _NULL, np.int32(masks_ld), sk, out, part_o, part_ml,
            np.int32(h), np.int32(d), np.int32(nsplit), np.int32(chunk), F32(scale),
            _NULL if lists is None else lists[0], _NULL if lists is None else lists[1],
            np.int32(0 if lists is None else lists[0].shape[1]), np.int32(self.bf16)),  # (bf: q rounded as loaded too)
            shared_mem=16 * d * 4)
        if nsplit > 1:
            K.function("attention", "attention_combine")((-(-(b * h) // 8),), (256,), (
                part_o, part_ml, sk, out, np.int32(b * h), np.int32(h), np.int32(d), np.int32(nsplit),
                np.int32(self.bf16)))
        return out

    def _attention_table_bf(self, q, tab: cp.ndarray, masks, sinks, scale: float, out,
                            lists: tuple | None) -> cp.ndarray:
        """_attention_decode's rows on attn_table_bf (kernels/attention.cu): one block per (row, 64 heads),
        the row's keys from its table entry rounded to bf16 as staged, out in bf16."""
        b, h, d = q.shape
        dp = next(p for p in ASB_DIMS if p >= d)
        smem = _asb_smem(dp)
        _smem_function("attention", f"attn_table_bf{dp}", smem)((b, h // 64), (256,), (
            _c32(q), tab, masks if masks is not None else _NULL, np.int32(0 if masks is None else masks.shape[1]),
            _NULL if lists is None else lists[0], _NULL if lists is None else lists[1],
            np.int32(0 if lists is None else lists[0].shape[1]), _c32(sinks), out, np.int32(h), np.int32(d),
            F32(scale)), shared_mem=smem)
        return out

    def indexer_scores(self, q: cp.ndarray, k: cp.ndarray, w: cp.ndarray, n_heads: int, head_dim: int,
                       exact: bool = False) -> cp.ndarray:
        """sum_h w[s,h] * relu(q[s,h] . k[n]) * head_dim^-0.5 * n_heads^-0.5 -> [S, N]. Many
        queries on tensor cores, q and k as one bf16 term each if `exact` (values on a state codec's
        grid; with bf16 numerics, indexer_scores_bf, which rounds as the reference does), else
        three; few queries, or a shape the tensor-core kernels do not take, on the CUDA-core
        kernel."""
        s, h, dh = q.shape
        n = k.shape[0]
        out = cp.empty((s, n), F32)
        if s == 0 or n == 0:
            return out
        w, dscale, hscale = self._indexer_weights(w, n_heads, head_dim)
        if _indexer_tc_shape(s, h, dh) and self.bf16 and exact:
            # (the reference's roundings: the heads' sum on a second MMA, kernels/indexer.cu)
            smem = _indexer_bf_smem(dh)
            _smem_function("indexer", "indexer_scores_bf", smem)((math.ceil(s / (ITC_ROWS // h)),), (256,), (
                _c32(q), _bf16_keys(k), w, out, np.int32(s), np.int32(h), np.int32(n), np.int32(dh), hscale),
                shared_mem=smem)
            return out
        if _indexer_tc_shape(s, h, dh):
            terms = 1 if exact else 3
            smem = _indexer_tc_smem(dh, terms)
            keys = _bf16_keys(k) if exact else _c32(k)
            _smem_function("indexer", f"indexer_scores_tc{terms}", smem)((math.ceil(s / (ITC_ROWS // h)),), (256,), (
                _c32(q), keys, w, out, np.int32(s), np.int32(h), np.int32(n), np.int32(dh),
                dscale, hscale, np.int32(self.bf16)), shared_mem=smem)
            return out
        if dh % 32 or dh > 256:
            raise ValueError(f"indexer kernel needs index_head_dim % 32 == 0 and <= 256 (got {dh})")
        smem = _indexer_smem(h, dh)
        _smem_function("indexer", "indexer_scores", smem)((math.ceil(n / 32), s), (256,), (
            _c32(q), _c32(k), w, out, np.int32(s), np.int32(h), np.int32(n), np.int32(dh),
            dscale, hscale, np.int32(self.bf16)), shared_mem=smem)
        return out

    def indexer_scores_spans(self, q: cp.ndarray, keys, w: cp.ndarray, n_heads: int, head_dim: int,
                             width: int | None = None) -> cp.ndarray:
        """Decode: query row b against its own keys (keys[b], a Span of rows, read in place; or a
        staged [B, 2] table of (address, count)) -> [B, width] (default: the largest count), -inf
        past each row's count. One launch."""
        b, h, dh = q.shape
        table = keys  # (the Spans stay referenced as `keys` until the launch below is enqueued)
        if not isinstance(keys, cp.ndarray):
            if width is None:
                width = max((k.n for k in keys), default=0)
            table = self.asarray(np.array([(_span_ptr(k, dh) if k.n else 0, k.n) for k in keys], np.int64),
                                 dtype=np.int64)
        out = cp.empty((b, width), F32)
        if b == 0 or width == 0:
            return out
        if dh % 32 or dh > 256:
            raise ValueError(f"indexer kernel needs index_head_dim % 32 == 0 and <= 256 (got {dh})")
        w, dscale, hscale = self._indexer_weights(w, n_heads, head_dim)
        smem = _indexer_smem(h, dh)
        _smem_function("indexer", "indexer_scores_spans", smem)((math.ceil(width / 32), b), (256,), (
            _c32(q), table, w, out, np.int32(h), np.int32(width), np.int32(dh),
            dscale, hscale, np.int32(self.bf16)), shared_mem=smem)
        return out

    def _indexer_weights(self, w: cp.ndarray, n_heads: int, head_dim: int) -> tuple:
        """The indexer kernels' head weights and scales (dscale, hscale): w as given, scaled in the
        kernel (DeepseekCupyOps: both scales in hscale, the kernels round as the reference does)."""
        return _c32(w), F32(head_dim**-0.5), F32(n_heads**-0.5)

    def topk_mask(self, scores: cp.ndarray, k: int) -> cp.ndarray:
        """Bool mask of each row's k best finite scores (ties: lower index first).
        kernels/topk.cu, one block per row: radix-select of the k-th key, then the mask; no host
        sync and nothing allocated but the mask (CUDA-graph capturable)."""
        n = scores.shape[-1]
        if k <= 0 or n == 0 or scores.size == 0:
            return cp.zeros(scores.shape, dtype=bool)
        sc = _c32(scores)
        mask = cp.empty(sc.shape, dtype=bool)  # every element is written
        K.function("topk", "topk_mask")((sc.size // n,), (512,), (  # 512 = TOPK_THREADS
            sc, mask, np.int32(n), np.int32(min(int(k), n))))
        return mask

    def gated_pool(self, kv: cp.ndarray, gate: cp.ndarray) -> cp.ndarray:
        """kv, gate [G, R, D] -> sum_r softmax_r(gate) * kv  [G, D]."""
        g, r, d = kv.shape
        out = cp.empty((g, d), F32)
        if out.size:
            K.function("elementwise", "gated_pool")(_grid(out.size), (_ELT_BLOCK,), (
                _c32(kv), _c32(gate), out, np.int64(out.size), np.int32(r), np.int32(d), np.int32(self.bf16)))
        return out

    def gated_pool_rows(self, kv: cp.ndarray, gate: cp.ndarray, ratio: int, width: int) -> cp.ndarray:
        """Decode: row b pools the `ratio` pending rows of sequence b's closing group (staged span
        tables [B, 2] of kv and gate rows; address 0: no group closes, a zero row) -> [B, width]."""
        out = cp.empty((kv.shape[0], width), F32)
        if out.size:
            K.function("elementwise", "gated_pool_rows")(_grid(out.size), (_ELT_BLOCK,), (
                kv, gate, out, np.int64(out.size), np.int32(ratio), np.int32(width), np.int32(self.bf16)))
        return out

    @staticmethod
    def _scatter_args(src: cp.ndarray) -> tuple[cp.ndarray, int, int, int]:
        """(src, W, ld, vec4) of scatter_rows' kernels: a column slice (a stacked projection's part)
        is read in place, rows ld floats apart."""
        if src.dtype != F32 or src.strides[1] != 4 or src.strides[0] % 4:
            src = _c32(src)
        w, ld = src.shape[1], src.strides[0] // 4
        return src, w, ld, int(w % 4 == 0 and ld % 4 == 0 and src.data.ptr % 16 == 0)

    def scatter_rows(self, src: cp.ndarray, dst: cp.ndarray) -> None:
        """Row b of src [B, W] into the state row at address dst[b] (a staged table; 0: none)."""
        if not src.shape[0]:
            return
        src, w, ld, vec4 = self._scatter_args(src)
        K.function("elementwise", "scatter_rows")((src.shape[0],), (128,), (
            src, dst, np.int32(w), np.int32(ld), np.int32(vec4)))
