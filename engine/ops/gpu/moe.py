"""Mixture of experts on the GPU: routing, the shared expert's MLP, and the routed experts.

moe() groups the (token, expert) pairs by expert, then runs each projection as one launch over
per-expert segments (engine/ops/gpu/linear.py): gate and up together where the experts pair w1 and
w3, the SwiGLU, the down projection, then the weighted combine. The grouping is a kernel (no host
round trip, so a decode step is capturable): moe_group for up to a thousand pairs, moe_group_large
(a counting sort) for a prompt chunk's.
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np

from engine.ops import kernels as K
from engine.ops.gpu.common import _ELT_BLOCK, _NULL, F32, _c32, _grid, _ptr
from engine.ops.gpu.fork import joins_late
from engine.ops.gpu.linear import GEMM_TILE
from engine.ops.gpu.weights import GEMV_MAX_ROWS, GpuWeight

MOE_DEVICE_MAX_PAIRS = 1024  # moe(): up to this many (token, expert) pairs are grouped in GEMV-sized segments
# ... or while the experts average at most this many pairs: a verify step's rows spread thinly over
# many experts (192 rows x 6 over 384) fill GEMV segments, not GEMM tiles
MOE_GEMV_PAIRS_PER_EXPERT = 8


def gemv_grouping(pairs: int, experts: int) -> bool:
    """Whether moe()'s pairs go in GEMV-sized segments (else GEMM tiles)."""
    return pairs <= MOE_DEVICE_MAX_PAIRS or pairs <= MOE_GEMV_PAIRS_PER_EXPERT * experts


_MOE_GROUP_MAXP = 1024  # kernels/moe.cu MOE_GROUP_MAXP: moe_group runs one block, one thread a pair
# Above that (prompt chunks) moe_group_large groups them (a counting sort in one block, up to
# MOE_GROUP_LARGE_MAXE experts), so a chunk's MoE never waits for the host.
MOE_GROUP_LARGE_MAXE = 1024  # (kernels/moe.cu MOE_GROUP_LARGE_MAXE)


class MoeOps:
    """CupyOps' routing, SwiGLU MLP and routed experts."""

    def route(self, x: cp.ndarray, gate_w, bias: cp.ndarray | None, top_k: int, scoring: str,
              temp: float, scale: float, normalise: bool, hash_ids=None) -> tuple[cp.ndarray, cp.ndarray]:
        """Returns (weights [T, k] f32, expert ids [T, k] int64)."""
        logits = self.linear(x, gate_w)
        t, e = logits.shape
        if e > 512 or top_k > 16:
            raise ValueError(f"route kernel supports <= 512 experts and top-k <= 16 (got {e}, {top_k})")
        w = cp.empty((t, top_k), F32)
        ids = cp.empty((t, top_k), cp.int64)
        hid = None if hash_ids is None else cp.ascontiguousarray(cp.asarray(hash_ids, dtype=cp.int64))
        sc = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}[scoring]
        if t:
            K.function("moe", "route_topk")((math.ceil(t / 8),), (256,), (  # a warp per token, 8 a block
                _c32(logits), _c32(bias) if bias is not None else _NULL, hid if hid is not None else _NULL, w, ids,
                np.int32(t), np.int32(e), np.int32(top_k), np.int32(sc), F32(temp), F32(scale),
                np.int32(bool(normalise))))
        return w, ids

    def _swiglu(self, gate: cp.ndarray, up: cp.ndarray, limit: float) -> cp.ndarray:
        y = cp.empty_like(gate)
        if y.size:
            K.function("elementwise", "swiglu")(_grid(y.size), (_ELT_BLOCK,), (
                gate, up, y, np.int64(y.size), F32(limit)))
        return y

    def _swiglu_pairs(self, gu: cp.ndarray, inter: int, limit: float) -> cp.ndarray:
        """swiglu of fused gate / up rows gu [rows, 2 * inter] -> [rows, inter]."""
        act = cp.empty((gu.shape[0], inter), F32)
        if act.size:
            K.function("elementwise", "swiglu_pairs")(_grid(act.size), (_ELT_BLOCK,), (
                _c32(gu), act, np.int64(act.size), np.int32(inter), F32(limit)))
        return act

    def swiglu_mlp(self, x: cp.ndarray, w1, w2, w3, limit: float) -> cp.ndarray:
        """w2(swiglu(w1 x, w3 x)); gate and up as one launch over a two-weight pointer table where
        w1 and w3 match (the shared expert: one GEMV's fixed cost instead of two)."""
        w1, w2, w3 = (w if isinstance(w, GpuWeight) else self.prepare(w) for w in (w1, w2, w3))
        a = _c32(x).reshape(-1, w1.shape[1])
        m, inter = a.shape[0], w1.shape[0]
        if (w1.fmt, w1.shape, w1.block) != (w3.fmt, w3.shape, w3.block) or not w1.kernel_ok(m) or m == 0:
            # (gate and up share a launch only where their weights match)
            return self.linear(self._swiglu(self.linear(x, w1), self.linear(x, w3), limit), w2)
        hit = self._pair_ptrs.get((id(w1), id(w3)))
        if hit is None or hit[0] is not w1 or hit[1] is not w3:
            hit = (w1, w3, cp.asarray(np.array([_ptr(w1.data), _ptr(w3.data)], np.uint64)),
                   cp.asarray(np.array([_ptr(w1.scale), _ptr(w3.scale)], np.uint64)))
            self._pair_ptrs[(id(w1), id(w3))] = hit
        s1, mr = self._row_segments(m, 0, fmt=w1.fmt)
        s3, _ = self._row_segments(m, 1, 0, 0, inter, fmt=w1.fmt)
        gu = cp.empty((m, 2 * inter), F32)
        self._run_linear(a, gu, inter, w1.shape[1], s1 + s3, hit[2], hit[3], w1, mr, bf=self._rounds_out(w1),
                         xq=self._linear_xq(w1))
        return self.linear(self._swiglu_pairs(gu, inter, limit), w2).reshape(*x.shape[:-1], w2.shape[0])

    def _expert_tables(self, experts: list):
        """Device pointer tables (data, scale) of w1, w2, w3 over a layer's experts, built once."""
        hit = self._tables.get(id(experts))
        if hit is not None and hit[0] is experts:
            return hit[1]
        tabs = []
        if any(ex is None for ex in experts):  # a tensor-parallel rank holds only its experts
            tabs = None
        for j in range(3 if tabs is not None else 0):
            ws = [ex[j] for ex in experts]
            w0 = ws[0]
            if not all(isinstance(w, GpuWeight) and w.fmt == w0.fmt and w.shape == w0.shape
                       and w.block == w0.block and w.kernel_ok(GEMM_TILE) for w in ws):
                tabs = None
                break
            tabs.append((w0, cp.asarray(np.array([_ptr(w.data) for w in ws], np.uint64)),
                         cp.asarray(np.array([_ptr(w.scale) for w in ws], np.uint64))))
        if tabs is not None:  # w1 then w3 in one table: gate and up run as one launch
            (w1, p1, s1), _, (w3, p3, s3) = tabs
            if (w1.fmt, w1.shape, w1.block) == (w3.fmt, w3.shape, w3.block):
                tabs.append((w1, cp.concatenate([p1, p3]), cp.concatenate([s1, s3])))
        self._tables[id(experts)] = (experts, tabs)
        return tabs

    @staticmethod
    def _moe_max_segments(p: int, n_experts: int, step: int) -> int:
        """Segment slots that p pairs over n_experts, cut every `step` rows, can need: an expert with c
        pairs gives ceil(c / step) <= (c + step - 1) / step, and at most min(E, p) experts have pairs."""
        return min(p, (p + min(n_experts, p) * (step - 1) + step - 1) // step)

    @staticmethod
    def _group_shape(tabs, p: int, t: int) -> tuple[int, int]:
        """(rows per segment, w3's y column or 0) of moe()'s device grouping of p pairs of t tokens:
        segments of min(8, T) rows (GEMV) where gemv_grouping says so, else GEMM_TILE; gate and up in
        one doubled table where the expert tables pair w1 and w3."""
        step = min(GEMV_MAX_ROWS, t) if gemv_grouping(p, tabs[0][1].size) else GEMM_TILE
        return step, tabs[0][0].shape[0] if len(tabs) > 3 else 0

    @staticmethod
    def _group_buffers(p: int, ms: int, dup_col: int) -> tuple[cp.ndarray, ...]:
        """segs, gather, inv, order of a grouping, int32, in one allocation (its size fixed by p, ms)."""
        o = 5 * ms * (2 if dup_col else 1)
        buf = cp.empty(o + 3 * p, cp.int32)
        return buf[:o], buf[o:o + p], buf[o + p:o + 2 * p], buf[o + 2 * p:]

    def _moe_group(self, ids, n_experts: int, step: int, dup_col: int = 0) -> tuple[cp.ndarray, ...]:
        """Pairs of ids [T, k] grouped by expert on the device (kernels/moe.cu moe_group), int32:
        segs [maxseg * 5] (runs cut every `step` rows; unused slots rows = 0), gather [P] (token of
        each sorted pair), inv [P] (sorted position of each pair), order [P] (stable argsort).
        dup_col > 0: segs is [2 * maxseg * 5], its second half for w3 (experts E.., y column dup_col)."""
        ids = cp.ascontiguousarray(cp.asarray(ids), dtype=cp.int64)
        t, k = ids.shape
        p = t * k
        large = p > _MOE_GROUP_MAXP  # (moe_group_large: any count, up to MOE_GROUP_LARGE_MAXE experts)
        if n_experts > (MOE_GROUP_LARGE_MAXE if large else 1 << 21):
            raise ValueError(f"moe_group: {p} pairs over {n_experts} experts (above {_MOE_GROUP_MAXP} pairs: "
                             f"<= {MOE_GROUP_LARGE_MAXE} experts)")
        ms = self._moe_max_segments(p, n_experts, step)
        segs, gather, inv, order = self._group_buffers(p, ms, dup_col)
        args = (ids, np.int32(p), np.int32(k), np.int32(n_experts), np.int32(step), np.int32(ms), np.int32(dup_col),
                order, inv, gather, segs)
        if large:
            smem = 32 * n_experts * 4  # (the warps' per-expert counts)
            K.function_with_smem("moe", "moe_group_large", smem)((1,), (1024,), args, shared_mem=smem)
        else:
            K.function("moe", "moe_group")((1,), (_MOE_GROUP_MAXP,), args)
        return segs, gather, inv, order

    def _moe_device(self, x: cp.ndarray, tabs, n_experts: int, weights, ids, limit: float,
                    shared=None) -> cp.ndarray:
        """moe() with the pairs grouped by a kernel: no host round trip, shapes fixed by (T, k, E).
        An expert gets at most one pair per token, so segments of min(8, T) rows (GEMV) split no run
        that the host path would keep whole; they bound the rows per segment even if ids repeat.
        Past gemv_grouping (more than MOE_DEVICE_MAX_PAIRS pairs and more than
        MOE_GEMV_PAIRS_PER_EXPERT an expert on average), segments of GEMM_TILE rows, as the host path
        cuts an expert with more than 8 pairs (the tensor-core GEMM)."""
        step, dup = self._group_shape(tabs, ids.size, x.shape[0])
        segs, gather, inv, order = self._moe_group(ids, n_experts, step, dup)
        return self._moe_project(x, gather, tabs, segs, step, weights, inv, int(ids.shape[1]), limit,
                                 doubled=bool(dup), shared=shared, order=order)

    def _moe_project(self, x: cp.ndarray, gather: cp.ndarray, tabs, segs: cp.ndarray, max_rows: int, weights,
                     inv: cp.ndarray, k: int, limit: float, doubled: bool = False,
                     shared=None, order: cp.ndarray | None = None) -> cp.ndarray:
        """The experts over pairs sorted by expert (x rows gather [P]): w1, w3, swiglu, w2, each one
        launch over the segment table; then y[t] = sum_j weights[t, j] * out[inv[t * k + j]] (+ the
        shared expert's output). doubled: segs already holds w3's half after w1's (moe_group dup_col).
        order [P] (the pairs' stable argsort) is for DeepseekCupyOps, which weights the rows before w2."""
        d = x.shape[1]
        p = gather.size
        # one token (decode at batch 1): every pair reads row 0, so x itself with a zero row stride
        # stands in for the gathered rows (one-row segments only: the GEMV kernels)
        shared_row = x.shape[0] == 1 and max_rows == 1
        (w1, p1, s1), (w2, p2, s2), (w3, p3, s3) = tabs[:3]
        # (the rows as given: w1 / w3's kernels prepare them as linear() would, _linear_xq)
        xp_rows, lda = (x, 0) if shared_row else (x[gather], None)
        xq1, xq2 = self._linear_xq(w1), self._linear_xq(w2)
        inter = w1.shape[0]
        if doubled:
            segs_gu, segs = segs, segs[: segs.size // 2]
        elif len(tabs) > 3:
            n_exp = p1.size
            off = self._seg_offsets.get((segs.size, n_exp, inter))
            if off is None:
                off = cp.asarray(np.tile(np.array([n_exp, 0, 0, 0, inter], np.int32), segs.size // 5))
                self._seg_offsets[(segs.size, n_exp, inter)] = off
            segs_gu = cp.concatenate([segs, segs + off])
        out = cp.empty((p, d), F32)
        if len(tabs) > 3:  # gate and up in one launch: w3's segments index the second half of the
            # table and write columns inter.. of one [P, 2 * inter] output (x split once, twice the blocks)
            gu = cp.empty((p, 2 * inter), F32)
            self._run_linear(xp_rows, gu, inter, d, segs_gu, tabs[3][1], tabs[3][2], w1, max_rows, lda, bf=self.bf16,
                             xq=xq1)
            hidden = self._swiglu_pairs(gu, inter, limit)
        else:
            gate = cp.empty((p, inter), F32)
            up = cp.empty((p, inter), F32)
            self._run_linear(xp_rows, gate, inter, d, segs, p1, s1, w1, max_rows, lda, bf=self.bf16, xq=xq1)
            self._run_linear(xp_rows, up, inter, d, segs, p3, s3, w3, max_rows, lda, bf=self.bf16, xq=xq1)
            hidden = self._swiglu(gate, up, limit)
        hidden, weights = self._experts_hidden(hidden, _c32(weights), order, w2)
        self._run_linear(hidden, out, d, inter, segs, p2, s2, w2, max_rows, bf=self.bf16, xq=xq2)  # (bf16 out)
        return self._combine(out, weights, inv, k, d, shared)

    def _combine(self, out: cp.ndarray, weights: cp.ndarray, inv: cp.ndarray, k: int, d: int,
                 shared=None) -> cp.ndarray:
        """The routed experts' tail in one launch (kernels/elementwise.cu moe_combine): y[t] = sum_j
        weights[t, j] * out[inv[t * k + j]], then + shared[t] (a fork's: joined here, after the
        experts' launches), as an activation is stored (bf16 under DeepseekCupyOps): act(y + shared)
        bit for bit, without the add's and the rounding's passes of their own."""
        y = cp.empty((inv.size // k, d), F32)
        sh = _NULL
        if shared is not None:
            sh = _c32(self._join_late(shared))
            if sh.shape != y.shape:  # (what `y += shared` broadcast)
                sh = _c32(cp.broadcast_to(sh, y.shape))
        K.function("elementwise", "moe_combine")(_grid(y.size), (_ELT_BLOCK,), (
            out, _c32(weights), inv, sh, y, np.int64(y.size), np.int32(k), np.int32(d), np.int32(self.bf16)))
        return y

    def _experts_hidden(self, hidden: cp.ndarray, weights: cp.ndarray, order,
                        w2: GpuWeight) -> tuple[cp.ndarray, cp.ndarray]:
        """(w2's input rows, the combine's weights [T, k]): here the swiglu rows and the routing
        weights; DeepseekCupyOps weights the rows before w2 and combines with ones."""
        return hidden, weights

    @joins_late("shared")
    def moe(self, x: cp.ndarray, experts: list, weights: cp.ndarray, ids: cp.ndarray, limit: float,
            shared: cp.ndarray | None = None) -> cp.ndarray:
        """Routed experts: sum_k weights[t,k] * expert_{ids[t,k]}(x_t), plus `shared` (the shared
        expert's output; where it is a fork's, joined only after the routed experts' launches, before
        the sum). experts[e] = (w1, w2, w3).
        Pairs (t, k) are grouped by expert, then each projection is one launch over per-expert
        segments. Up to MOE_DEVICE_MAX_PAIRS pairs (decode, small chunks) the grouping is moe_group
        (no host sync: CUDA-graph capturable); above, moe_group_large (the same table in segments of
        up to 64 rows for the tensor-core GEMM)."""
        x = _c32(x)
        t, d = x.shape
        if t == 0:
            return self._plus_shared(cp.zeros_like(x), shared)
        tabs = self._expert_tables(experts)
        if tabs is not None and (ids.size <= min(MOE_DEVICE_MAX_PAIRS, _MOE_GROUP_MAXP)
                                 or len(experts) <= MOE_GROUP_LARGE_MAXE):
            return self._moe_device(x, tabs, len(experts), weights, ids, limit, shared)
        # (on the host: mixed expert formats or another rank's experts, or too many experts for
        # moe_group_large's shared memory)
        ids_h = self.to_host(ids).astype(np.int64)
        k = ids_h.shape[1]
        if tabs is None:  # mixed formats: per-expert fallback through the dense kernels
            y = cp.zeros_like(x)
            wts = _c32(weights)
            for e in np.unique(ids_h):
                if experts[int(e)] is None:  # held by another rank: arrives through the all-reduce
                    continue
                rows, slot = np.nonzero(ids_h == e)
                w1, w2, w3 = experts[int(e)]
                out = self.swiglu_mlp(x[cp.asarray(rows)], w1, w2, w3, limit)
                y[cp.asarray(rows)] += out * wts[cp.asarray(rows), cp.asarray(slot)][:, None]
            return self._plus_shared(y, shared)
        flat = ids_h.reshape(-1)
        order = np.argsort(flat, kind="stable")
        inv = np.empty_like(order)
        inv[order] = np.arange(order.size)
        experts_sorted = flat[order]
        starts = np.flatnonzero(np.r_[True, experts_sorted[1:] != experts_sorted[:-1]])
        counts = np.diff(np.r_[starts, order.size])
        max_rows = int(counts.max())
        step = GEMV_MAX_ROWS if max_rows <= GEMV_MAX_ROWS else GEMM_TILE
        segs = []
        for s0, c in zip(starts, counts, strict=True):
            e = int(experts_sorted[s0])
            segs += [(e, int(s0) + r, int(min(step, c - r)), 0, 0) for r in range(0, int(c), step)]
        mr = min(max_rows, step)
        # one host->device copy for the segment table, the gather rows and the combine index
        packed = cp.asarray(np.concatenate([np.asarray(segs, np.int32).reshape(-1), (order // k).astype(np.int32),
                                            inv.astype(np.int32), order.astype(np.int32)]))
        nsg, p = 5 * len(segs), order.size
        return self._moe_project(x, packed[nsg:nsg + p], tabs, packed[:nsg], mr, weights,
                                 packed[nsg + p:nsg + 2 * p], k, limit, shared=shared, order=packed[nsg + 2 * p:])

    def _plus_shared(self, y: cp.ndarray, shared: cp.ndarray | None) -> cp.ndarray:
        """y plus the shared expert's output (a fork's: joined here), where no combine launch adds it
        (no tokens; the experts one by one)."""
        if shared is None:
            return y
        y += _c32(self._join_late(shared))
        return y
