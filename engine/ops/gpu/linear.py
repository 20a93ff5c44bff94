"""Linear layers on the GPU: the dispatch between the GEMV / GEMM kernels and their launches.

A launch multiplies x by one weight, or by several weights of one shape (a pointer table: the
experts of a MoE layer, a block-diagonal projection's groups, gate and up together), over a table of
segments (weight index, first row of x, rows, x column, y column). By rows per segment:
- one row: gemvr (kernels/gemv_reg.cu, tensor cores fed from registers) for FP4 and large FP8
  weights, else gemvx (kernels/linear.cu, x staged in shared memory);
- 2 to 32 rows of FP8 / FP4: the tensor-core GEMV; under --numerics deepseek (x quantized as the
  reference's act_quant) tcgemv8_* (kernels/gemv_q8.cu: f16 MMAs on act_quant's codes, laid out
  for the lanes in a pass of their own; FP4 decoded into e4m3 on the way), else tcgemv_* (exact f16
  weights, x split into hi + lo f16 terms); 2 to 32 rows of BF16 under deepseek numerics (bf16 x):
  tcgemv8_bf16_* (bf16 MMAs); else up to 8 rows of BF16 / f32: the CUDA-core GEMV;
- more: the tensor-core GEMM (gemm_tc_*, the GEMV's arithmetic) for FP8 / FP4, the GEMM with x in
  three bf16 terms (gemm) for BF16 / f32 and what gemm_tc cannot read.
Every path is float32-accurate up to summation order, except gemm on weights bf16 cannot hold
exactly (f32, fp8 with f32 scales), which it rounds.
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np

from engine.ops import kernels as K
from engine.ops.gpu.common import _NULL, F32, _c32, _ptr, _sm_count, round_bf16
from engine.ops.gpu.weights import _EPC, _FMT_TAG, GEMV_MAX_ROWS, GpuWeight
from engine.ops.kernels import FMT_BF16, FMT_F32, FMT_FP4, FMT_FP8

GEMM_TILE = 64
# one row of x, any format: gemvx (kernels/linear.cu: x staged in shared memory in chunk order,
# RPW weight rows per warp, PC 32-chunk slices in flight per row, blocks striding over the rows)
GEMVX_RPW = {FMT_F32: 4, FMT_BF16: 4, FMT_FP8: 2, FMT_FP4: 2}  # (kernels/linear.cu DEF_GEMVX)
GEMVX_PC = {FMT_F32: 2, FMT_BF16: 2, FMT_FP8: 2, FMT_FP4: 2}
GEMVX_MAX_SMEM, GEMVX_WARPS_TARGET = 200 << 10, 2048
GEMVX_PREFETCH_BYTES = 32 << 20  # a captured gemvx prefetches up to this much weight into L2
GEMV_WARPS_TARGET = 132 * 32  # enough independent loads in flight to saturate an H200's HBM
TC_MAX_ROWS = 32  # FP8 / FP4 segments of up to this many rows: tensor-core GEMV (gemv_tc.cu)
# its configuration (kernels/gemv_tc.cu TC_W, TC_S, TC_R): blocks of 8 warps, each streaming its
# tile through a 4-stage ring of 16 rows x 128 bytes, each stage followed by its scales (128 bytes)
TC_WARPS, TC_SMEM, TC_STAGE_BYTES = 8, 8 * 4 * (2048 + 128), 128
TC_WARPS_TARGET = 132 * 24  # what the H200 holds resident (3 blocks of 8 warps per SM)
# Fewest rows per segment for which the tensor-core GEMV beats the one-row GEMVs (gemvx, gemvr)
TC_MIN_ROWS = {FMT_FP8: 2, FMT_FP4: 2}
# One row of FP8 / FP4: the register-fed tensor-core GEMV (kernels/gemv_reg.cu gemvr_*), GEMVR_U units of
# 128 k in flight per lane. It issues about a fifth of gemvx's instructions per weight byte but, like
# any launch, has a fixed cost however small the weight: it runs every FP4 launch, and FP8 launches of
# >= GEMVR_MIN_BYTES of weight with K <= GEMVR_MAX_K (smaller or wider FP8 weights stream faster
# through gemvx).
GEMVR_MIN_BYTES, GEMVR_MAX_K = 16 << 20, 5120
GEMVR_U = {FMT_FP8: 2, FMT_FP4: 8}
GEMVR_BLOCKS_PER_SM = {FMT_FP8: 3, FMT_FP4: 2}  # what each kernel's registers allow (DEF_GR's MINB)
GEMM_TC_SMEM, GEMM_TC_TILE_N = 96000, 128  # (kernels/gemv_tc.cu GT_SMEM, GT_BN)


def _gemv_split(n: int, nchunks: int, rpw: int, nseg: int) -> int:
    """Warps sharing one GEMV row group (1, 2, 4 or 8): split K while the launch has too few warps
    to keep HBM busy (~32 per SM on 132 SMs) and every lane still gets >= 2 chunks to load."""
    kw, warps = 1, -(-n // rpw) * nseg
    while kw < 8 and warps * kw < GEMV_WARPS_TARGET and nchunks >= 32 * kw * 2:
        kw *= 2
    return kw


def _gemvx_smem(fmt: int, k: int) -> int:
    """gemvx's shared memory: x padded to whole 32-chunk slices, as float32."""
    epc = _EPC[fmt]
    return -(-(k // epc) // 32) * 32 * epc * 4


def _gemvx_ok(a: cp.ndarray, w: GpuWeight, segs) -> bool:
    """gemvx stages x[row0, acol:acol + k] with 16-byte loads: every segment's start on 4 floats
    (a device-built MoE table starts its rows at column 0)."""
    if _gemvx_smem(w.fmt, w.shape[1]) > GEMVX_MAX_SMEM:
        return False
    return _x_rows_aligned(a, segs)


# A linear's input under --numerics deepseek (_run_linear's xq; kernels/dsuf_common.cuh linear_in4):
# as given, rounded to bf16, or rounded to bf16 and put on the e4m3 grid per 32 along K (act_quant)
XQ_NONE, XQ_BF16, XQ_FP8 = 0, 1, 2
PERM_FP8, PERM_FP4, PERM_ONE = 0, 1, 2  # tc_split_x's layouts of x (kernels/gemv_tc.cu)


def _xq_staged(a: cp.ndarray, segs) -> bool:
    """Whether the kernels that stage x can quantize it there: each segment's columns start on a
    block of 32 (a device-built MoE table starts at column 0)."""
    return isinstance(segs, cp.ndarray) or all(s[3] % 32 == 0 for s in segs)


def _x_rows_aligned(a: cp.ndarray, segs) -> bool:
    """Every segment's row of x starts on 4 floats, for the one-row GEMVs' float4 staging (a
    device-built MoE table starts its rows at column 0)."""
    if a.shape[1] % 4:
        return False
    return isinstance(segs, cp.ndarray) or all((s[1] * a.shape[1] + s[3]) % 4 == 0 for s in segs)


def _blocks_per_sm(fn, smem: int) -> int:
    """Blocks of 256 threads of `fn` with `smem` bytes of dynamic shared memory one SM holds."""
    return max(1, min(65536 // (256 * max(fn.num_regs, 32)), (228 << 10) // (smem + 1024)))


def _gemvx_split(groups: int, slices: int, pc: int) -> int:
    """Warps sharing one gemvx row group (1, 2, 4 or 8): split K while the launch has fewer than
    GEMVX_WARPS_TARGET warps and each warp keeps a whole pass of pc slices (a small GEMV is a chain
    of load round trips, one per pass)."""
    kw = 1
    while kw < 8 and groups * kw < GEMVX_WARPS_TARGET and slices >= kw * pc:
        kw *= 2
    return kw


def _x_cols_bytes(k: int) -> int:
    """A row of x staged for gemvr (kernels/gemv_reg.cu stage_x_cols): its hi and lo f16
    columns, 16 bytes of padding per 64 halves, each column 32 mod 128 bytes."""
    return 2 * ((288 * -(-k // 128) + 127) // 128 * 128 + 32)


def _gemvr_smem(k: int) -> int:
    """gemvr's shared memory: x's staged columns, its group scales, the tile reduction."""
    return _x_cols_bytes(k) + 4 * -(-k // 128) + 512


def _gemvr_ok(a: cp.ndarray, w: GpuWeight, segs, nseg: int, rows: int) -> bool:
    """gemvr: one row, a weight it can read (_gemvr_shape_ok), chosen by the rule at GEMVR_MIN_BYTES,
    x read as float4 from each segment's start."""
    if rows != 1:
        return False
    n, k = w.shape
    if w.fmt == FMT_FP8 and (n * k * nseg < GEMVR_MIN_BYTES or k > GEMVR_MAX_K):
        return False
    return _gemvr_shape_ok(w) and _gemvr_smem(k) <= GEMVX_MAX_SMEM and _x_rows_aligned(a, segs)


def _gemvr_config(fmt: int, n: int, k: int, nseg: int) -> tuple[str, int]:
    """gemvr's kernel and warps per 16-row tile (kw), for GEMVR_U units in flight per lane. FP8: warps
    split K while the launch is short of TC_WARPS_TARGET and each keeps a whole pass of U units. FP4:
    only while every warp of the launch stays resident at once (one round: a second, partial round
    costs the experts more than fewer warps do)."""
    name, u = f"gemvr_{_FMT_TAG[fmt]}", GEMVR_U[fmt]
    tiles, units = -(-n // 16), -(-k // 128)
    kw = 1
    if fmt == FMT_FP8:
        while kw < 8 and tiles * nseg * kw < TC_WARPS_TARGET and units >= 2 * kw * u:
            kw *= 2
    else:
        resident = _sm_count() * 8 * GEMVR_BLOCKS_PER_SM[fmt]
        while kw < 8 and tiles * nseg * 2 * kw <= resident and units >= 4 * kw * u:
            kw *= 2
    return name, kw


def _gemvr_shape_ok(w: GpuWeight) -> bool:
    """The register-scheme GEMV (gemvr): FP8 in K blocks of a power of two >= 32 and row
    blocks of 16-row multiples, K in 16-byte chunks; FP4 rows of whole 128-element units."""
    k = w.shape[1]
    bn, bk = w.block
    if w.fmt == FMT_FP8:
        return k % 16 == 0 and bk >= 32 and bk & (bk - 1) == 0 and bn % 16 == 0
    return w.fmt == FMT_FP4 and k % 128 == 0


def _tc_ok(w: GpuWeight, lda: int) -> bool:
    """The tensor-core GEMV reads FP8 rows in 16-element chunks with scale blocks that align with
    its 128-element stages, FP4 rows in 32-element groups, and x rows split in groups of 4 / 8."""
    k = w.shape[1]
    if w.fmt == FMT_FP8:
        bk = w.block[1]
        return k % 16 == 0 and lda % 4 == 0 and bk % 16 == 0 and (bk % 128 == 0 or 128 % bk == 0)
    return w.fmt == FMT_FP4 and k % 32 == 0 and lda % 8 == 0


def _tc8_ok(w: GpuWeight, lda: int) -> bool:
    """The e4m3 tensor-core GEMV (x on DeepSeek's activation grid): x rows in whole blocks of 32, FP4
    rows in 32-element groups, FP8 rows in 32-element halves of its MMAs with scale blocks that are
    whole MMAs within one 128-element stage, or whole stages (segment columns start on a block of
    32: _xq_staged)."""
    k = w.shape[1]
    if lda % 32 or k % 32:
        return False
    if w.fmt == FMT_FP8:
        bk = w.block[1]
        return bk % 32 == 0 and (bk % 128 == 0 or 128 % bk == 0)
    return w.fmt == FMT_FP4


# x's row padding for tcgemv8: a stage past any segment's end (FP4: 256 k), zeros the loads may read
_Q8_PAD = 256


def _q8_x(a: cp.ndarray, fp4: bool) -> tuple[cp.ndarray, cp.ndarray]:
    """x [m, lda] f32 -> (e4m3 codes [m, L] u8, f32 scales [m, L / 32]) as tcgemv8's lanes read them
    (kernels/gemv_q8.cu gemv_q8_x: act_quant's values, bf16 first; each block of 32 reordered for the
    format's MMAs; L = lda + _Q8_PAD, zeros past lda)."""
    a = _c32(a)
    m, lda = a.shape
    width = lda + _Q8_PAD
    codes = cp.empty((m, width), cp.uint8)
    scales = cp.empty((m, width // 32), F32)
    quads = m * (width // 4)
    K.function("gemv_q8", "gemv_q8_x")((-(-quads // 256),), (256,), (
        a, np.int32(lda), np.int32(m), np.int32(lda), codes, scales, np.int32(width), np.int32(fp4), np.int32(1)))
    return codes, scales


def _tcbf_ok(w: GpuWeight, a: cp.ndarray, segs) -> bool:
    """The bf16 tensor-core GEMV: a bf16 weight in 16-byte chunks, x rows of float pairs, segments'
    x columns on its 16-element blocks (a device-built MoE table starts at column 0)."""
    if w.fmt != FMT_BF16 or w.shape[1] % 8 or a.shape[1] % 2:
        return False
    return isinstance(segs, cp.ndarray) or all(s[3] % 16 == 0 for s in segs)


# x's row padding for tcgemv8_bf16: a stage (64 k) past any segment's end
_BF_PAD = 64


def _bf_x(a: cp.ndarray) -> cp.ndarray:
    """x [m, lda] f32 -> bf16 pairs [m, L / 2] u32 as tcgemv8_bf16's lanes read them (kernels/gemv_q8.cu
    gemv_bf_x: each block of 16 reordered for the MMA; L = lda rounded up to 16 + _BF_PAD, zeros past
    lda)."""
    a = _c32(a)
    m, lda = a.shape
    width = -(-lda // 16) * 16 + _BF_PAD
    xb = cp.empty((m, width // 2), cp.uint32)
    pairs = m * (width // 2)
    K.function("gemv_q8", "gemv_bf_x")((-(-pairs // 256),), (256,), (
        a, np.int32(lda), np.int32(m), np.int32(lda), xb, np.int32(width)))
    return xb


def _gemm_tc_ok(w: GpuWeight, lda: int) -> bool:
    """gemm_tc: what the tensor-core GEMV reads (_tc_ok), with one FP8 scale per 32 k."""
    return _tc_ok(w, lda) and (w.fmt == FMT_FP4 or w.block[1] % 32 == 0)


def _tc_split(warps: int, stages: int) -> int:
    """Warps sharing one 16-row tile of the tensor-core GEMV (a power of two <= TC_WARPS): split K while the
    launch has too few warps to fill HBM's pipe and each warp still streams >= 2 stages."""
    kw = 1
    while kw < TC_WARPS and warps * kw < TC_WARPS_TARGET and stages >= 4 * kw:
        kw *= 2
    return kw


class LinearOps:
    """CupyOps' linear layers: linear, grouped_linear, embed and the launches behind them."""

    def _run_linear(self, a: cp.ndarray, y: cp.ndarray, n: int, k: int, segs,
                    wptrs: cp.ndarray, sptrs: cp.ndarray, w: GpuWeight, max_rows: int, lda: int | None = None,
                    bf: bool = False, xq: int = XQ_NONE) -> None:
        """Launch the tensor-core GEMV (FP8 / FP4, 2 <= max_rows <= 32), the GEMV (max_rows <= 8) or
        a GEMM kernel (FP8 / FP4 on tensor cores: gemm_tc; else gemm) over a segment table (a list
        of (weight, row0, rows, a_col, y_col), or that table already on the device). lda = 0 (with
        max_rows 1): every segment reads a's row 0. bf: the outputs rounded to bf16 as stored. xq: a's
        rows as a linear's input under --numerics deepseek (XQ_BF16, XQ_FP8; kernels/dsuf_common.cuh
        linear_in4): the one-row GEMVs and tc_split_x apply it as they stage x, the others read a
        prepared copy."""
        tag = _FMT_TAG[w.fmt]
        seg = segs if isinstance(segs, cp.ndarray) else self._segs_device(segs)
        nseg = seg.size // 5
        if lda is not None and max_rows != 1:
            raise ValueError("_run_linear: a row stride override needs one-row segments")
        args = (a, np.int32(a.shape[1] if lda is None else lda), y, np.int32(y.shape[1]), np.int32(n), np.int32(k),
                seg, wptrs, sptrs, np.int32(w.block[0]), np.int32(w.block[1]), np.int32(w.gk), np.int32(bf))
        if xq == XQ_FP8 and not _xq_staged(a, segs):  # (blocks of 32 the staging warps cannot hold)
            a, xq = self._linear_input(a, xq), XQ_NONE
            args = (a, *args[1:])
        # (the tensor-core GEMV reads x in 128-column groups: segments must start on one)
        if _gemvr_ok(a, w, segs, nseg, max_rows):
            self._run_reg(args, n, k, seg, nseg, w, constant=not isinstance(segs, cp.ndarray), xq=xq)
        elif xq == XQ_FP8 and TC_MIN_ROWS.get(w.fmt, 99) <= max_rows <= TC_MAX_ROWS and _tc8_ok(w, a.shape[1]):
            self._run_tc8(a, y, n, k, seg, wptrs, sptrs, w, max_rows, bf)
        elif xq == XQ_BF16 and 2 <= max_rows <= TC_MAX_ROWS and _tcbf_ok(w, a, segs):
            self._run_tcbf(a, y, n, k, seg, wptrs, sptrs, w, max_rows, bf)
        elif (TC_MIN_ROWS.get(w.fmt, 99) <= max_rows <= TC_MAX_ROWS and _tc_ok(w, a.shape[1])
                and (isinstance(segs, cp.ndarray) or all(s[3] % 128 == 0 for s in segs))):
            self._run_tc(a, y, n, k, seg, wptrs, sptrs, w, max_rows, bf, xq)
        elif max_rows == 1 and _gemvx_ok(a, w, segs):
            smem = _gemvx_smem(w.fmt, k)
            fn = K.function_with_smem("linear", f"gemvx_{tag}", GEMVX_MAX_SMEM)
            groups = -(-n // GEMVX_RPW[w.fmt])
            kw = _gemvx_split(groups * nseg, -(-(k // _EPC[w.fmt]) // 32), GEMVX_PC[w.fmt])
            per_sm = _blocks_per_sm(fn, smem)
            nbi = -(-groups // (8 // kw))
            blocks = max(1, min(nbi, _sm_count() * per_sm // nseg))
            # within a captured step: launched early (PDL), each block prefetching its first row groups
            # of the weight into L2 while the previous kernel runs. Only where the segment table is a
            # constant of ours; a table the step builds (MoE routing) is read after the wait.
            pf = 0
            if not isinstance(segs, cp.ndarray):
                chunk = (8 // kw) * GEMVX_RPW[w.fmt] * w.row_bytes()  # one block's row groups per pass
                pf = min(-(-nbi // blocks), max(1, GEMVX_PREFETCH_BYTES // (blocks * nseg * chunk)))
            K.launch(fn, (blocks, nseg), (256,), (*args, np.int32(kw), np.int32(pf), np.int32(xq)), shared_mem=smem,
                     pdl=True)
        elif max_rows <= GEMV_MAX_ROWS:
            if xq:
                args = (self._linear_input(a, xq), *args[1:])
            mt = 1 if max_rows <= 1 else 2 if max_rows <= 2 else 4 if max_rows <= 4 else 8
            rpw = 4
            kw = _gemv_split(n, k // _EPC[w.fmt], rpw, nseg)
            fn = K.function("linear", f"gemv_{tag}_m{mt}")
            fn((math.ceil(n / (rpw * 8 // kw)), nseg), (256,), (*args, np.int32(kw)))
        elif _gemm_tc_ok(w, a.shape[1]) and (isinstance(segs, cp.ndarray) or all(s[3] % 128 == 0 for s in segs)):
            # bf16 x on FP8 weights: one f16 term is float32-grade (kernels/gemv_tc.cu gemm_tc1)
            one = xq == XQ_BF16 and w.fmt == FMT_FP8 and a.shape[1] % 32 == 0 and k % 32 == 0
            perm = PERM_ONE if one else PERM_FP4 if w.fmt == FMT_FP4 else PERM_FP8
            xs, xinv = self._tc_split_x(a, perm, xq)  # (in place of x; gemm's other arguments)
            K.function_with_smem("gemv_tc", f"gemm_tc{'1' if one else ''}_{tag}", GEMM_TC_SMEM)(
                (math.ceil(n / GEMM_TC_TILE_N), nseg), (256,), (xs, xinv, *args[1:]), shared_mem=GEMM_TC_SMEM)
        else:  # (BF16 / f32 weights, and block shapes or x columns gemm_tc cannot read)
            if xq:
                args = (self._linear_input(a, xq), *args[1:])
            fn = K.function("linear", f"gemm_{tag}")
            fn((math.ceil(n / GEMM_TILE), nseg), (128,), args)

    def _linear_xq(self, w: GpuWeight) -> int:
        """How w's linear takes its input (_run_linear's xq): as given here; DeepseekCupyOps by use."""
        return XQ_NONE

    def _linear_input(self, a: cp.ndarray, xq: int) -> cp.ndarray:
        """a's rows as a linear's input (xq), in a pass of their own: for the kernels that read x
        as it is stored."""
        return self._fake_quant_fp8(a, 32, bf16_first=True) if xq == XQ_FP8 else round_bf16(a)

    @staticmethod
    def _run_reg(args: tuple, n: int, k: int, seg: cp.ndarray, nseg: int, w: GpuWeight, constant: bool,
                 xq: int = XQ_NONE) -> None:
        """Register-fed tensor-core GEMV over one-row segments (configuration: _gemvr_config); blocks
        stride over the 16-row tiles. constant: the segment table is ours, so blocks may load weights
        early (PDL)."""
        name, kw = _gemvr_config(w.fmt, n, k, nseg)
        smem = _gemvr_smem(k)
        fn = K.function_with_smem("gemv_reg", name, GEMVX_MAX_SMEM)
        tiles = -(-n // 16)
        per_sm = _blocks_per_sm(fn, smem)
        nbi = -(-tiles // (8 // kw))
        blocks = max(1, min(nbi, _sm_count() * per_sm // nseg))
        K.launch(fn, (blocks, nseg), (256,), (*args, np.int32(kw), np.int32(1 if constant else 0), np.int32(xq)),
                 shared_mem=smem, pdl=True)

    def _run_tc(self, a: cp.ndarray, y: cp.ndarray, n: int, k: int, seg: cp.ndarray,
                wptrs: cp.ndarray, sptrs: cp.ndarray, w: GpuWeight, max_rows: int, bf: bool = False,
                xq: int = XQ_NONE) -> None:
        """Tensor-core GEMV: split x into scaled hi / lo f16 terms, then one launch over the segments."""
        xs, xinv = self._tc_split_x(a, PERM_FP4 if w.fmt == FMT_FP4 else PERM_FP8, xq)
        self._launch_tc("gemv_tc", "tcgemv", xs, xinv, a.shape[1], y, n, k, seg, wptrs, sptrs, w, max_rows, bf)

    def _run_tcbf(self, a: cp.ndarray, y: cp.ndarray, n: int, k: int, seg: cp.ndarray, wptrs: cp.ndarray,
                  sptrs: cp.ndarray, w: GpuWeight, max_rows: int, bf: bool) -> None:
        """The bf16 tensor-core GEMV (kernels/gemv_q8.cu tcgemv8_bf16_*): x rounded to bf16 and laid
        out for the lanes (gemv_bf_x), then one launch over the segments."""
        xb = _bf_x(a)
        self._launch_tc("gemv_q8", "tcgemv8", xb, _NULL, 2 * xb.shape[1], y, n, k, seg, wptrs, sptrs, w, max_rows,
                        bf)

    def _run_tc8(self, a: cp.ndarray, y: cp.ndarray, n: int, k: int, seg: cp.ndarray, wptrs: cp.ndarray,
                 sptrs: cp.ndarray, w: GpuWeight, max_rows: int, bf: bool) -> None:
        """The e4m3 tensor-core GEMV (kernels/gemv_q8.cu): x rounded to bf16 and quantized as the
        reference's act_quant does, its codes laid out for the kernel's lanes (gemv_q8_x), then one
        launch over the segments."""
        codes, scales = _q8_x(a, w.fmt == FMT_FP4)
        self._launch_tc("gemv_q8", "tcgemv8", codes, scales, codes.shape[1], y, n, k, seg, wptrs, sptrs, w, max_rows,
                        bf)

    @staticmethod
    def _launch_tc(module: str, prefix: str, xs: cp.ndarray, xscales: cp.ndarray, lda: int, y: cp.ndarray, n: int,
                   k: int, seg: cp.ndarray, wptrs: cp.ndarray, sptrs: cp.ndarray, w: GpuWeight, max_rows: int,
                   bf: bool) -> None:
        """One launch of a tensor-core GEMV (<prefix>_<fmt>_n<NT> of kernels/<module>.cu; both share the
        weight ring's configuration, kernels/tc_ring.cuh) over the segments, x prepared for it."""
        nt = 1 if max_rows <= 8 else 2 if max_rows <= 16 else 4
        fn = K.function_with_smem(module, f"{prefix}_{_FMT_TAG[w.fmt]}_n{nt}", TC_SMEM)
        tiles, nseg = -(-n // 16), seg.size // 5
        kw = _tc_split(tiles * nseg, -(-w.row_bytes() // TC_STAGE_BYTES))
        fn((-(-tiles // (TC_WARPS // kw)), nseg), (32 * TC_WARPS,), (
            xs, xscales, np.int32(lda), y, np.int32(y.shape[1]), np.int32(n), np.int32(k), seg, wptrs, sptrs,
            np.int32(w.block[0]), np.int32(w.block[1]), np.int32(w.gk), np.int32(bf), np.int32(kw)),
           shared_mem=TC_SMEM)

    @staticmethod
    def _tc_split_x(a: cp.ndarray, perm: int, xq: int = XQ_NONE) -> tuple[cp.ndarray, cp.ndarray]:
        """x [m, lda] -> its hi / lo f16 terms in the tensor-core kernels' order (perm: PERM_FP8,
        PERM_FP4; PERM_ONE the hi terms alone, for gemm_tc1), and the inverse power-of-two scale of
        each 128-element group (kernels/gemv_tc.cu tc_split_x); xq: x as a linear's input
        (_run_linear)."""
        m, lda = a.shape
        ngx = -(-lda // 128)
        xs = cp.empty(m * lda // (2 if perm == PERM_ONE else 1), dtype=cp.uint32)
        xinv = cp.empty((m, ngx), dtype=F32)
        K.function("gemv_tc", "tc_split_x")((-(-ngx // 8), m), (256,), (
            a, np.int32(lda), xs, xinv, np.int32(perm), np.int32(xq)))
        return xs, xinv

    def _segs_device(self, segs) -> cp.ndarray:
        """Segment table on the device; dense / grouped tables repeat, so they are cached."""
        key = tuple(segs)
        hit = self._seg_cache.get(key)
        if hit is None:
            hit = cp.asarray(np.asarray(segs, dtype=np.int32).reshape(-1))
            if len(self._seg_cache) < 4096:
                self._seg_cache[key] = hit
        return hit

    @staticmethod
    def _row_segments(rows: int, w_index: int = 0, row0: int = 0, a_col: int = 0, y_col: int = 0, fmt: int = -1
                      ) -> tuple[list[tuple[int, int, int, int, int]], int]:
        # BF16 / f32 weights (no tensor-core GEMV) up to TC_MAX_ROWS rows: 8-row GEMV segments in one
        # launch, which stream the weight once per 8 rows yet beat the GEMM's tiles there
        small = rows <= GEMV_MAX_ROWS or (fmt in (FMT_BF16, FMT_F32) and rows <= TC_MAX_ROWS)
        step = GEMV_MAX_ROWS if small else GEMM_TILE
        if fmt == FMT_FP8 and GEMV_MAX_ROWS < rows <= TC_MAX_ROWS:
            # 17-32 FP8 rows as two 16-row tensor-core GEMV segments: reading each weight twice beats
            # one 32-row pass, which re-reads x from L2 per 16-row tile
            step = 16
        segs = [(w_index, row0 + r, min(step, rows - r), a_col, y_col) for r in range(0, rows, step)]
        return segs, min(rows, step)

    def linear(self, x: cp.ndarray, w, xq: int = XQ_NONE) -> cp.ndarray:
        """y = x @ w.T with w [out, in] (a GpuWeight in any stored format); xq: x taken as a linear's
        input under --numerics deepseek (_run_linear)."""
        if not isinstance(w, GpuWeight):
            w = self.prepare(w)
        n, k = w.shape
        lead = x.shape[:-1]
        a = _c32(x).reshape(-1, k)
        m = a.shape[0]
        y = cp.empty((m, n), dtype=F32)
        if m == 0:
            return y.reshape(*lead, n)
        bf = self._rounds_out(w)
        if not w.kernel_ok(m):  # (rows our kernels cannot read in 16-byte chunks: GpuWeight.kernel_ok)
            y = (self._linear_input(a, xq) if xq else a) @ w.dequant().T
            return (self.act(y) if bf else y).reshape(*lead, n)
        segs, mr = self._row_segments(m, fmt=w.fmt)
        wp, sp = w.ptr_tables()
        self._run_linear(a, y, n, k, segs, wp, sp, w, mr, bf=bf, xq=xq)
        return y.reshape(*lead, n)

    def _rounds_out(self, w: GpuWeight) -> bool:
        """Whether linear() returns w's outputs rounded to bf16 (DeepseekCupyOps: by w's use)."""
        return False

    def grouped_linear(self, x: cp.ndarray, w, groups: int) -> cp.ndarray:
        """Block-diagonal projection: x [T, G, in_g], w [G*out_g, in_g] -> [T, G, out_g]."""
        if not isinstance(w, GpuWeight):
            w = self.prepare(w)
        t, g, kin = x.shape
        nout = w.shape[0] // groups
        a = _c32(x).reshape(t, g * kin)
        y = cp.empty((t, g * nout), dtype=F32)
        if w.fmt == FMT_FP8 and nout % w.block[0]:
            ok = False
        else:
            ok = w.kernel_ok(t) and kin % (8 if w.fmt == FMT_FP4 else 4) == 0
        if not ok or t == 0:  # (groups not on scale blocks, or rows our kernels cannot read)
            wg = w.dequant().reshape(groups, nout, kin)
            return self.act(cp.einsum("tgi,goi->tgo", _c32(x), wg))
        wptrs, sptrs = self._group_tables(w, groups)
        segs = []
        for gi in range(groups):
            s, mr = self._row_segments(t, gi, 0, gi * kin, gi * nout, w.fmt)
            segs += s
        self._run_linear(a, y, nout, kin, segs, wptrs, sptrs, w, mr, bf=self.bf16,  # (bf16 out, as act())
                         xq=self._linear_xq(w))
        return y.reshape(t, g, nout)

    def _group_tables(self, w: GpuWeight, groups: int) -> tuple[cp.ndarray, cp.ndarray]:
        """Device tables of the data and scale pointers of w's `groups` row groups, made once per weight
        (before any graph capture: the first call runs eagerly)."""
        nout = w.shape[0] // groups
        key = (id(w), groups)
        hit = self._group_ptrs.get(key)
        if hit is None or hit[0] is not w:
            wptrs, sptrs = [], []
            for gi in range(groups):
                wptrs.append(_ptr(w.data) + gi * nout * w.row_bytes())
                if w.fmt == FMT_FP8:
                    sptrs.append(_ptr(w.scale) + (gi * nout // w.block[0]) * w.gk * 4)
                elif w.fmt == FMT_FP4:
                    sptrs.append(_ptr(w.scale) + gi * nout * w.gk)
                else:
                    sptrs.append(0)
            hit = (w, cp.asarray(np.array(wptrs, np.uint64)), cp.asarray(np.array(sptrs, np.uint64)))
            self._group_ptrs[key] = hit
        return hit[1], hit[2]

    def embed(self, table, ids) -> cp.ndarray:
        ids_d = self.asarray(ids, dtype=np.int64)
        if not isinstance(table, GpuWeight):
            return cp.asarray(table)[ids_d]
        n, k = table.shape
        flat = ids_d.reshape(-1)
        out = cp.empty((flat.size, k), dtype=F32)
        if not table.kernel_ok():  # gather reads whole 16-byte chunks
            return table.dequant()[ids_d]
        if flat.size:
            fn = K.function("linear", f"gather_{_FMT_TAG[table.fmt]}")
            fn((flat.size,), (128,), (table.data, table.scale if table.scale is not None else self._no_scale,
                                      flat, out, np.int32(k), np.int32(table.block[0]), np.int32(table.block[1]),
                                      np.int32(table.gk)))
        return out.reshape(*ids_d.shape, k)
