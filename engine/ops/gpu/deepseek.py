"""`--numerics deepseek` on the GPU: CupyOps computing as DeepSeek's reference inference does, with
the quantization points of the numpy backend's DeepseekOps (engine/ops/deepseek_ops.py), which the
GPU tests hold it to.

- bf16 activations (kept in float32 arrays) wherever the reference stores bf16: the kernels of the
  norms, RoPE, mHC, Engram, pooling, attention, the indexer and the MoE's combine round what they
  store, decode attention its q and the indexer its head weights as they load them (CupyOps.bf16);
  act() rounds the rest (a linear's input and output, the experts'), except where the FP8 GEMMs round
  their inputs (act_quant_fp8) and outputs (as stored) in their own passes.
- linear(), by the weight's use (engine/model/numerics.py): an FP8 / FP4 weight takes the bf16
  activation quantized to e4m3 per 32 along K (UE8M0 scales) and returns bf16. Prompt chunks (from
  FD_FP8_MIN_ROWS rows, power-of-two block scales) run bf16 wgmma on the exactly decoded codes and
  act_quant's values as bf16 (fp4_experts.fd_fp8_linear), other rows past TC_MAX_ROWS the e4m3
  tensor-core GEMM (fp8_linear.py); up to TC_MAX_ROWS rows the GEMVs fake-quantize the
  activation as they stage it (_linear_xq; kernels/dsuf_common.cuh linear_in4) and sum its products
  exactly in float32 (the same numbers up to summation order). A bf16 weight takes and returns
  bf16 (past TC_MAX_ROWS rows on sm_90a: bf16 wgmma, fp4_experts.py, on the bf16-stored weight or
  on the decoded codes of an FP8-stored one); an fp32 one computes in fp32 (a bf16-stored one past
  TC_MAX_ROWS rows on the same bf16 wgmma: bf16 x, exact products, f32 sums).
- the experts: the routing weight scales the hidden state before w2 (the reference's Expert.forward).
  A prompt chunk's FP8 / FP4 experts (past moe.gemv_grouping: tiles, not GEMV segments) run one
  grouped GEMM per projection on activations quantized once per token row (then gathered into pair
  order) and once per hidden row: FP4 experts on sm_90a bf16 wgmma on the exactly decoded weights
  (fp4_experts.py, act_quant's values as bf16), others the e4m3 GEMM (fp8_linear.fp8_grouped_linear
  on act_quant's codes); decode's GEMV segments fake-quantize the rows as they stage them, as
  linear() does.
- attention and the indexer: the kernels' bf16 rounding points (CupyOps.bf16).
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from engine.model.numerics import BF16, QUANT
from engine.model.numerics import F32 as USE_F32
from engine.ops import kernels as K
from engine.ops.gpu.common import _ELT_BLOCK, F32, _c32, _grid, round_bf16
from engine.ops.gpu.fork import joins_inputs, joins_late
from engine.ops.gpu.fp4_experts import (
    FD_FP8_MIN_ROWS,
    FE_ROWS,
    act_quant_bf16w,
    bf16w_linear,
    bf16w_takes,
    fd_fp8_linear,
    fd_fp8_segments,
    fd_fp8_takes,
    fp4_experts_linear,
    fp4_experts_take,
    fp8w_bf16_linear,
    fp8w_bf16_segments,
    fp8w_takes,
)
from engine.ops.gpu.fp8_linear import (
    ACT_BLOCK,
    GROUPED_ROWS,
    TILE,
    act_quant_fp8,
    fp8_grouped_linear,
    fp8_linear,
    gather_codes,
    gather_rows,
)
from engine.ops.gpu.linear import TC_MAX_ROWS, XQ_BF16, XQ_FP8, XQ_NONE
from engine.ops.gpu.moe import gemv_grouping
from engine.ops.gpu.ops import CupyOps
from engine.ops.gpu.weights import GpuWeight
from engine.ops.kernels import FMT_FP4, FMT_FP8
from engine.parallel.shard import stack_rows


def _fp8_gemm_takes(w: GpuWeight) -> bool:
    """Whether gemm_e4m3 reads w: FP8 with scale blocks of whole 32-wide K steps, or FP4; K in tiles."""
    if w.shape[1] % TILE:
        return False
    return w.fmt == FMT_FP4 or (w.fmt == FMT_FP8 and w.block[1] % ACT_BLOCK == 0)


def _fp8_experts(tabs) -> bool:
    """Whether the grouped e4m3 GEMM reads a layer's w1, w2 and w3 (expert tables' first weights)."""
    return all(w.use == QUANT and _fp8_gemm_takes(w) for w, _, _ in tabs[:3])


@joins_inputs  # (its own methods too must join a pending fork's output before reading it)
class DeepseekCupyOps(CupyOps):
    """CupyOps in DeepSeek's reference numerics (bf16 activations, FP8 block-32 activation quantization)."""

    numerics = "deepseek"
    bf16 = True

    # ---- bf16 activations ------------------------------------------------------------
    def act(self, x: cp.ndarray) -> cp.ndarray:
        """x rounded to bf16 (ties to even), as float32: a new array."""
        return round_bf16(x)

    def _round_cols(self, y: cp.ndarray, c0: int, c1: int) -> None:
        """Columns [c0, c1) of the C-contiguous 2-D y rounded to bf16 in place."""
        part = y[:, c0:c1]
        if part.size:
            K.function("elementwise", "round_bf16_rows")(_grid(part.size), (_ELT_BLOCK,), (
                part, part, np.int64(part.size), np.int32(c1 - c0), np.int64(y.shape[1]), np.int64(y.shape[1])))

    # ---- weights: tagged with their use ----------------------------------------------
    def prepare(self, weight) -> GpuWeight:
        w = super().prepare(weight)
        w.use = getattr(weight, "use", None)
        return w

    def prepare_rows(self, ws: list) -> GpuWeight:
        uses = [w.use for w in ws]
        if len(set(uses)) == 1:
            return self.prepare(stack_rows(ws))
        if QUANT in uses:
            raise ValueError(f"cannot stack FP8 and unquantized linears: {[w.name for w in ws]}")
        w = CupyOps.prepare(self, stack_rows(ws))
        cols, c0 = [], 0
        for wi, u in zip(ws, uses, strict=True):
            if u == BF16:
                cols.append((c0, c0 + wi.shape[0]))
            c0 += wi.shape[0]
        w.use, w.bf16_cols = BF16, tuple(cols)
        return w

    # ---- linears ---------------------------------------------------------------------
    def linear(self, x: cp.ndarray, w) -> cp.ndarray:
        """The reference's linear(), by the weight's use (an untagged weight: fp32, x as given)."""
        if not isinstance(w, GpuWeight):
            w = self.prepare(w)
        if w.use is None:
            return super().linear(x, w)
        n, k = w.shape
        a = x.reshape(-1, k)
        if w.use == QUANT and a.shape[0] >= FD_FP8_MIN_ROWS and fd_fp8_takes(w):
            # act_quant's values as bf16 (x rounded to bf16 first) times the decoded codes, bf16 out
            y = fd_fp8_linear(act_quant_bf16w(a, True), self._segs_device(fd_fp8_segments(a.shape[0])), w, True)
        elif w.use == QUANT and a.shape[0] > TC_MAX_ROWS and _fp8_gemm_takes(w):
            y = fp8_linear(a, w, bf16=True)  # (bf16 in and out, in its own passes)
        elif w.use == BF16 and w.bf16_cols is None and a.shape[0] > TC_MAX_ROWS and fp8w_takes(w):
            # FP8-stored weights the reference runs in bf16: bf16 wgmma on the decoded codes
            y = self._fp8w_bf16(a, w, 1, self._rounds_out(w))
        elif w.use in (BF16, USE_F32) and a.shape[0] > TC_MAX_ROWS and bf16w_takes(w):
            # bf16-stored ones, bf16 or fp32 in use (the gate, the heads, the compressor of ratio > 1,
            # rows stacked from both: bf16 x times bf16 values, the products exact either way,
            # summed in f32): the same wgmma kernel on the weights as they are
            segs = self._segs_device(fp8w_bf16_segments(a.shape[0], 1, n, k))
            y = bf16w_linear(a, segs, w.ptr_tables()[0], w, 1, self._rounds_out(w))
        else:
            # (x prepared as _linear_xq says, by the GEMVs as they stage it; bf16 out where
            # _rounds_out says so)
            y = super().linear(a, w, xq=self._linear_xq(w))
        if w.bf16_cols is not None:
            for c0, c1 in w.bf16_cols:
                self._round_cols(y, c0, c1)
        return y.reshape(*x.shape[:-1], n)

    def grouped_linear(self, x: cp.ndarray, w, groups: int) -> cp.ndarray:
        """wo_a's block-diagonal projection; a prompt chunk's rows on bf16 wgmma where its FP8 weight
        allows (fp8w_takes), else CupyOps'."""
        if not isinstance(w, GpuWeight):
            w = self.prepare(w)
        t, g, kin = x.shape
        if w.use == BF16 and t > TC_MAX_ROWS and fp8w_takes(w, groups):
            return self._fp8w_bf16(x.reshape(t, g * kin), w, groups, True).reshape(t, g, -1)
        return super().grouped_linear(x, w, groups)

    def _fp8w_bf16(self, a: cp.ndarray, w: GpuWeight, groups: int, bf16: bool) -> cp.ndarray:
        """fp8w_bf16_linear with its tables from the caches (no host-to-device copy once warm: verify and
        draft steps of more than TC_MAX_ROWS rows run inside graph captures)."""
        segs = self._segs_device(fp8w_bf16_segments(a.shape[0], groups, w.shape[0] // groups, w.shape[1]))
        return fp8w_bf16_linear(a, segs, *self._group_tables(w, groups), w, groups, bf16)

    def _rounds_out(self, w: GpuWeight) -> bool:
        """FP8 / FP4 and bf16 weights return bf16 (the kernels round as they store); fp32 ones do not,
        nor do rows stacked from weights of both uses (their bf16 columns are rounded after)."""
        return w.use in (QUANT, BF16) and w.bf16_cols is None

    # ---- MoE: the routing weight before w2 -------------------------------------------------
    def _expert_mlp(self, x: cp.ndarray, w1, w2, w3, limit: float, wts: cp.ndarray | None) -> cp.ndarray:
        h = self._swiglu(self.linear(x, w1), self.linear(x, w3), limit)
        return self.linear(h if wts is None else h * wts[:, None], w2)

    def swiglu_mlp(self, x: cp.ndarray, w1, w2, w3, limit: float) -> cp.ndarray:
        """The shared expert: decode and verify rows take CupyOps' gate / up in one GEMV launch (x
        quantized and the outputs rounded as linear() does); a prompt chunk's rows the e4m3 GEMMs."""
        w1, w2, w3 = (w if isinstance(w, GpuWeight) else self.prepare(w) for w in (w1, w2, w3))
        a = _c32(x).reshape(-1, w1.shape[1])
        if a.shape[0] <= TC_MAX_ROWS:
            return super().swiglu_mlp(x, w1, w2, w3, limit)
        return self._expert_mlp(a, w1, w2, w3, limit, None).reshape(*x.shape[:-1], w2.shape[0])

    @joins_late("shared")
    def moe(self, x: cp.ndarray, experts: list, weights: cp.ndarray, ids: cp.ndarray, limit: float,
            shared: cp.ndarray | None = None) -> cp.ndarray:
        if x.shape[0] == 0 or self._expert_tables(experts) is not None:
            return super().moe(x, experts, weights, ids, limit, shared)
        # (mixed expert formats, or a rank's share of the experts: expert by expert)
        x, wts = _c32(x), _c32(weights)
        ids_h = self.to_host(ids).astype(np.int64)
        y = cp.zeros_like(x)
        for e in np.unique(ids_h):
            if experts[int(e)] is None:  # held by another rank: arrives through the all-reduce
                continue
            rows, slot = np.nonzero(ids_h == e)
            r = cp.asarray(rows)
            w1, w2, w3 = experts[int(e)]
            y[r] += self._expert_mlp(x[r], w1, w2, w3, limit, wts[r, cp.asarray(slot)])
        return self.act(self._plus_shared(y, shared))

    def _moe_device(self, x: cp.ndarray, tabs, n_experts: int, weights, ids, limit: float,
                    shared=None) -> cp.ndarray:
        """A prompt chunk's FP8 / FP4 experts: the pairs in segments (FE_ROWS or GROUPED_ROWS), each
        projection one grouped GEMM; otherwise (decode, other weights) CupyOps' grouping and kernels."""
        if gemv_grouping(ids.size, n_experts) or not _fp8_experts(tabs):
            return super()._moe_device(x, tabs, n_experts, weights, ids, limit, shared)
        dup = tabs[0][0].shape[0] if len(tabs) > 3 else 0
        (w1, p1, s1), (w2, p2, s2), (w3, p3, s3) = tabs[:3]
        # FP4 experts on sm_90a: bf16 wgmma on the exactly decoded weights (fp4_experts.py); FP8
        # experts, or FP4 ones elsewhere: the e4m3 GEMM on act_quant's codes
        fp4 = all(fp4_experts_take(w) for w in (w1, w2, w3))
        segs, gather, inv, order = self._moe_group(ids, n_experts, FE_ROWS if fp4 else GROUPED_ROWS, dup)
        p, inter, d = gather.size, w1.shape[0], x.shape[1]
        quant, gather_pairs, gemm = ((act_quant_bf16w, gather_rows, fp4_experts_linear) if fp4 else
                                     (act_quant_fp8, gather_codes, fp8_grouped_linear))
        xq = gather_pairs(quant(x, bf16=True), gather)  # per token row, then the pairs' rows
        if dup:  # gate and up in one launch: w3's segments (second half) write columns inter..
            gu = cp.empty((p, 2 * inter), F32)
            gemm(xq, segs, tabs[3][1], tabs[3][2], w1, gu, bf16=True)
            segs = segs[: segs.size // 2]
            hidden = self._swiglu_pairs(gu, inter, limit)
        else:
            gate, up = cp.empty((p, inter), F32), cp.empty((p, inter), F32)
            gemm(xq, segs, p1, s1, w1, gate, bf16=True)
            gemm(xq, segs, p3, s3, w3, up, bf16=True)
            hidden = self._swiglu(gate, up, limit)
        if hidden.size:  # bf16(hidden * routing weight), in place
            K.function("elementwise", "moe_weight_rows")(_grid(hidden.size), (_ELT_BLOCK,), (
                hidden, _c32(weights), order, np.int64(hidden.size), np.int32(inter)))
        out = cp.empty((p, d), F32)
        gemm(quant(hidden), segs, p2, s2, w2, out, bf16=True)
        return self._combine(out, cp.ones(ids.shape, F32), inv, int(ids.shape[1]), d, shared)

    def _linear_xq(self, w: GpuWeight) -> int:
        """x as the reference's linear() hands it to w's GEMM, for the GEMVs to prepare as they stage
        it (or _linear_input in a pass of its own): FP8 / FP4 weights take bf16 rows on the e4m3 grid
        per 32 (where K is whole blocks), the others bf16 rows; untagged weights x as given."""
        if w.use is None:
            return XQ_NONE
        return XQ_FP8 if w.use == QUANT and w.shape[1] % ACT_BLOCK == 0 else XQ_BF16

    def _experts_hidden(self, hidden: cp.ndarray, weights: cp.ndarray, order,
                        w2: GpuWeight) -> tuple[cp.ndarray, cp.ndarray]:
        """bf16(hidden * routing weight) (w2's GEMV quantizes it as it stages it); the combine then
        adds the experts' outputs with weight 1."""
        if hidden.size:
            K.function("elementwise", "moe_weight_rows")(_grid(hidden.size), (_ELT_BLOCK,), (
                hidden, weights, order, np.int64(hidden.size), np.int32(hidden.shape[1])))
        return hidden, cp.ones(weights.shape, F32)

    # ---- attention and the indexer: bf16 q, K=V and probabilities ---------------------------
    def attention_ranges(self, q: cp.ndarray, keys: cp.ndarray, lo, hi, entries: cp.ndarray | None,
                         emask: cp.ndarray | None, sinks: cp.ndarray, scale: float, selected: int = 0,
                         exact: bool = False, span: int = 0) -> cp.ndarray:
        if not exact:  # (rounded here: the tensor-core kernels then take them as one bf16 term)
            keys = self.act(keys)
            entries = None if entries is None else self.act(entries)
        # (q as it is: both attention kernels round it to bf16 as they load it)
        return super().attention_ranges(q, keys, lo, hi, entries, emask, sinks, scale, selected, True, span)

    # (attention_decode / attend_decode need no override: the decode kernel rounds q as it loads it
    # where bf16 is set, so a decode step launches no rounding pass for it)

    def _indexer_weights(self, w: cp.ndarray, n_heads: int, head_dim: int) -> tuple:
        """The reference's head weights bf16(bf16(w) * head_dim^-0.5 * n_heads^-0.5), formed by the
        scores kernels as they load w (bf16 = True; kernels/indexer.cu index_head_weight): w as
        given, dscale 1 and both scales folded into hscale, their product taken in float64 and
        rounded to float32 once, as the reference does."""
        return _c32(w), F32(1.0), F32(head_dim**-0.5 * n_heads**-0.5)
