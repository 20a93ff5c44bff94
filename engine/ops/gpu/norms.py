"""Row-wise ops on the GPU: norms, RoPE, the state codecs' fake quantization, Engram's gate and mHC.

mHC (manifold-constrained hyper-connections): a token's residual is hc streams; each sub-layer
site mixes them (hc_mixes: pre / post / comb from the streams' dot products with the site's fn
rows, Sinkhorn-normalised), reads their collapse (hc_collapse_norm) and writes its output back
(hc_expand).
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from engine.ops import kernels as K
from engine.ops.gpu.common import _ELT_BLOCK, _NULL, F32, _c32, _grid
from engine.state import sequence as codecs

# From this many tokens (prompt chunks) the mixes' partial dots take hc_mix_partial_rows, which reads
# each slice of fn once per HCR_T tokens, then hc_mixes (two launches); below, hc_mix (one launch,
# fn re-read per token: the decode step's latency)
HC_ROWS_MIN = 64
HCR_T, HCR_SL = 32, 128  # (kernels/elementwise.cu)
HC_COUNTERS = 1 << 16  # rows the fused mHC mix handles per launch (one int32 block counter each)


class NormOps:
    """CupyOps' norms, RoPE, fake quantization, Engram gate and mHC."""

    def engram_mix(self, h: cp.ndarray, key: cp.ndarray, value: cp.ndarray, qk: cp.ndarray, eps: float) -> cp.ndarray:
        """Gate the Engram value into each stream by the normalised stream-key match."""
        t, hc, d = h.shape
        h, key, value, qk = _c32(h), _c32(key), _c32(value), _c32(qk)
        y = cp.empty_like(h)
        if t:
            K.function("elementwise", "engram_mix")((t * hc,), (256,), (h, key, value, qk, y, np.int32(hc),
                                                                       np.int32(d), F32(eps), np.int32(self.bf16)))
        return y

    def rmsnorm(self, x: cp.ndarray, weight: cp.ndarray | None, eps: float) -> cp.ndarray:
        d = x.shape[-1]
        x = _c32(x)
        y = cp.empty_like(x)
        rows = x.size // d if d else 0
        if rows:
            wt = None if weight is None else _c32(weight)
            args = (x, wt if wt is not None else _NULL, y, np.int32(d), F32(eps), np.int32(self.bf16))
            if d % 4 == 0 and 1024 <= d <= 4 * 256 * 8:
                K.function("elementwise", "rmsnorm_v4")((rows,), (256,), args)
            else:
                K.function("elementwise", "rmsnorm")((rows,), (256 if d >= 256 else 64,), args)
        return y

    def rope(self, x: cp.ndarray, cos: cp.ndarray, sin: cp.ndarray, inverse: bool = False,
             in_place: bool = False) -> cp.ndarray:
        """Interleaved-pair RoPE on the trailing 2*cos.shape[-1] channels of x [T, ..., D]; in_place:
        those channels rotated in x, the others untouched (NumpyOps.rope)."""
        if in_place and x.dtype == F32 and x.flags.c_contiguous and x.shape[-1] % 2 == 0:
            t, d, p = x.shape[0], x.shape[-1], cos.shape[-1]
            pairs = x.size // d * p
            if pairs:
                K.function("elementwise", "rope_tail")(_grid(pairs), (_ELT_BLOCK,), (
                    x, _c32(cos), _c32(sin), np.int64(pairs), np.int32(x.size // (t * d)), np.int32(d), np.int32(p),
                    F32(-1.0 if inverse else 1.0), np.int32(self.bf16)))
            return x
        x = _c32(x)
        y = cp.empty_like(x)
        if x.size == 0:
            return y
        t, d, p = x.shape[0], x.shape[-1], cos.shape[-1]
        m = x.size // (t * d)
        K.function("elementwise", "rope")(_grid(x.size), (_ELT_BLOCK,), (
            x, _c32(cos), _c32(sin), y, np.int64(x.size), np.int32(m), np.int32(d), np.int32(p),
            F32(-1.0 if inverse else 1.0), np.int32(self.bf16)))
        return y

    def norm_rope_quant(self, x: cp.ndarray, cos: cp.ndarray, sin: cp.ndarray, norm: tuple | None = None,
                        quant: int = codecs.F32, keep_normed: bool = False):
        """NumpyOps.norm_rope_quant in one launch (kernels/quant.cu norm_rope_quant) where a row
        is 32..512 wide (a power of two) and RoPE starts on a float4 boundary; a 2-D x with a row
        stride (a column slice of a stacked projection) is read in place."""
        if quant not in (codecs.F32, codecs.FP8_UE8M0_32, codecs.FP4_E4M3_16, codecs.FP4_UE8M0_32):
            raise ValueError(f"unknown state codec {quant}")
        d, p = x.shape[-1], cos.shape[-1]
        tpr = d // 4
        # (the kernel: rows of 32..512 floats, a power of two, RoPE from a float4 boundary)
        if x.size == 0 or d % 4 or not 8 <= tpr <= 128 or tpr & (tpr - 1) or d < 2 * p or (d - 2 * p) % 4:
            return self._norm_rope_quant_chain(x, cos, sin, norm, quant, keep_normed)
        if not (x.ndim == 2 and x.dtype == F32 and x.strides[1] == 4 and x.strides[0] % 16 == 0
                and x.data.ptr % 16 == 0):
            x = _c32(x)
        rows = x.size // d if x.flags.c_contiguous else x.shape[0]
        ld = d if x.flags.c_contiguous else x.strides[0] // 4
        y = cp.empty(x.shape, F32)
        yn = cp.empty(x.shape, F32) if keep_normed else None
        w = _c32(norm[0]) if norm is not None and norm[0] is not None else None
        K.function("quant", "norm_rope_quant")((-(-rows // (128 // tpr)),), (128,), (
            x, np.int64(ld), np.int32(rows), np.int32(d), np.int32(norm is not None), _NULL if w is None else w,
            F32(norm[1] if norm is not None else 0.0), _c32(cos), _c32(sin), np.int32(rows // x.shape[0]),
            np.int32(p), F32(1.0), np.int32(quant), y, _NULL if yn is None else yn, np.int32(self.bf16)))
        return (yn, y) if keep_normed else y

    def _norm_rope_quant_chain(self, x, cos, sin, norm, quant: int, keep_normed: bool):
        """norm_rope_quant as its chain of launches: rmsnorm (norm = (weight or None, eps); None: no
        norm), RoPE, fake-quant onto the state codec."""
        n = x if norm is None else self.rmsnorm(x, norm[0], norm[1])
        r = self.rope(n, cos, sin)
        if quant == codecs.FP8_UE8M0_32:
            y = self._fake_quant_fp8(r, 32)
        elif quant == codecs.FP4_E4M3_16:
            y = self._fake_quant_fp4(r, 16, e4m3_scales=True)
        elif quant == codecs.FP4_UE8M0_32:
            y = self._fake_quant_fp4(r, 32)
        else:
            y = r
        return (n, y) if keep_normed else y

    def _fake_quant_fp8(self, x: cp.ndarray, block: int = 32, bf16_first: bool = False) -> cp.ndarray:
        """x onto the FP8 grid per `block`; bf16_first: rounded to bf16 first, in the same pass."""
        return self._fake_quant(x, block, "fake_quant_fp8", np.int32(bf16_first))

    def _fake_quant_fp4(self, x: cp.ndarray, block: int, e4m3_scales: bool = False) -> cp.ndarray:
        return self._fake_quant(x, block, "fake_quant_fp4", np.int32(bool(e4m3_scales)))

    def _fake_quant(self, x: cp.ndarray, block: int, kernel: str, *extra) -> cp.ndarray:
        """x onto a quantization grid in blocks of `block` channels (x unchanged if they do not divide)."""
        if x.shape[-1] % block:
            return x
        x = _c32(x)
        y = cp.empty_like(x)
        nb = x.size // block
        if nb:
            K.function("quant", kernel)(_grid(nb, 128), (128,), (x, y, np.int64(nb), np.int32(block), *extra))
        return y

    # ---- mHC -------------------------------------------------------------------------
    def _hc_partials(self, streams: cp.ndarray, fn: cp.ndarray) -> tuple[cp.ndarray, int]:
        t, hc, d = streams.shape
        f, nm = hc * d, fn.shape[0]
        if nm > 80:
            raise ValueError(f"mHC kernel supports <= 80 mixes (got {nm})")
        if nm < 32 and f % 4 == 0 and t >= HC_ROWS_MIN:  # (a prompt chunk: fn's slices shared by 32 tokens)
            s = -(-f // HCR_SL)
            part = cp.empty((t, s, nm + 1), F32)
            K.function("elementwise", "hc_mix_partial_rows")((-(-t // HCR_T), s), (256,), (
                _c32(streams), _c32(fn), np.int32(t), np.int32(f), np.int32(nm), part))
            return part, s
        s = -(-f // 1024)
        part = cp.empty((t, s, nm + 1), F32)
        K.function("elementwise", "hc_mix_partial")((t, s), (256,), (_c32(streams), _c32(fn), np.int32(f),
                                                                     np.int32(nm), part))
        return part, s

    def _hc_finish(self, streams: cp.ndarray, fn: cp.ndarray, scale: cp.ndarray, base: cp.ndarray,
                   norm_eps: float, hc_eps: float, iters: int, mode: int, pre, post, comb) -> None:
        """Partial dots, then the fixed-order finish: mode 0 -> pre, post, comb; 1 -> pre only."""
        t, hc, d = streams.shape
        nm, f = fn.shape[0], hc * d
        if (nm <= 32 and f % 4 == 0 and t <= HC_COUNTERS and t < HC_ROWS_MIN
                and (mode == 1 or (hc * hc <= 32 and hc & (hc - 1) == 0))):
            self._claim_mix_counters()
            s = -(-f // 512)
            part = cp.empty((t, s, nm + 1), F32)
            K.function("elementwise", "hc_mix")((t, s), (256,), (
                _c32(streams), _c32(fn), np.int32(f), np.int32(nm), part, self._hc_count, _c32(scale), _c32(base),
                np.int32(hc), F32(norm_eps), F32(hc_eps), np.int32(iters), np.int32(mode), pre, post, comb))
            return
        part, s = self._hc_partials(streams, fn)
        K.function("elementwise", "hc_mixes")((t,), (128,), (
            part, np.int32(s), _c32(scale), _c32(base), np.int32(hc), np.int32(hc * d), np.int32(fn.shape[0]),
            F32(norm_eps), F32(hc_eps), np.int32(iters), np.int32(mode), pre, post, comb))

    def hc_mixes(self, streams: cp.ndarray, fn: cp.ndarray, scale: cp.ndarray, base: cp.ndarray,
                 norm_eps: float, hc_eps: float, iters: int) -> tuple[cp.ndarray, cp.ndarray, cp.ndarray]:
        """(pre, post, comb) of an mHC site. The one-launch kernel keeps per-row block counters in
        one buffer of this backend, so two of its launches must never overlap: one on the current
        stream first joins a pending fork that launched one (engine/ops/gpu/fork.py)."""
        t, hc, d = streams.shape
        pre = cp.empty((t, hc), F32)
        post = cp.empty((t, hc), F32)
        comb = cp.empty((t, hc, hc), F32)
        if t:
            self._hc_finish(streams, fn, scale, base, norm_eps, hc_eps, iters, 0, pre, post, comb)
        return pre, post, comb

    def hc_head_pre(self, streams: cp.ndarray, fn: cp.ndarray, scale: cp.ndarray, base: cp.ndarray,
                    norm_eps: float, hc_eps: float) -> cp.ndarray:
        t, hc, d = streams.shape
        pre = cp.empty((t, hc), F32)
        if t:
            self._hc_finish(streams, fn, scale, base, norm_eps, hc_eps, 0, 1, pre, pre, pre)
        return pre

    def hc_collapse_norm(self, streams: cp.ndarray, pre: cp.ndarray, weight: cp.ndarray | None,
                         eps: float) -> cp.ndarray:
        """rmsnorm(hc_collapse(streams, pre), weight, eps) in one launch."""
        t, hc, d = streams.shape
        if d % 4 or d > 8192:  # (the kernel: D % 4, <= 8192; act: the collapse as the reference stores it)
            return self.rmsnorm(self.act(self._hc_collapse(streams, pre)), weight, eps)
        out = cp.empty((t, d), F32)
        if t:
            K.function("elementwise", "hc_collapse_norm")((t,), (256,), (
                _c32(streams), _c32(pre), _c32(weight) if weight is not None else _NULL, out, np.int32(hc),
                np.int32(d), F32(eps), np.int32(self.bf16)))
        return out

    def _hc_collapse(self, streams: cp.ndarray, pre: cp.ndarray) -> cp.ndarray:
        t, hc, d = streams.shape
        out = cp.empty((t, d), F32)
        if out.size:
            K.function("elementwise", "hc_collapse")(_grid(out.size), (_ELT_BLOCK,), (
                _c32(streams), _c32(pre), out, np.int64(out.size), np.int32(hc), np.int32(d)))
        return out

    def hc_expand(self, out: cp.ndarray, residual: cp.ndarray, post: cp.ndarray, comb: cp.ndarray) -> cp.ndarray:
        t, hc, d = residual.shape
        if d % 4 or hc > 8:
            raise ValueError(f"hc_expand takes widths in multiples of 4 and up to 8 streams (got {hc} x {d})")
        y = cp.empty((t, hc, d), F32)
        if y.size:
            K.function("elementwise", "hc_expand")((t, -(-(d // 4) // _ELT_BLOCK)), (_ELT_BLOCK,), (
                _c32(out), _c32(residual), _c32(post), _c32(comb), y, np.int32(hc), np.int32(d), np.int32(self.bf16)))
        return y
