"""CuPy backend: the NumpyOps interface on our own CUDA kernels (kernels/*.cu via NVRTC).

Weights stay in their stored format on the GPU (`GpuWeight`: fp8 bytes + block scales, packed
fp4 + UE8M0 bytes, bf16 bits, or f32) and are dequantized inside the linear kernels. Activations
are float32 CuPy arrays throughout and every kernel is float32-accurate, so results match the
numpy reference up to summation order: FP8 / FP4 projections of 2 to 32 rows (decode) run on
the tensor-core GEMV (kernels/gemv_tc.cu: exact f16 weights, activations split into hi + lo
f16 terms); the tensor-core GEMM (more rows) splits activations into three bf16 terms; only
weights that bf16 cannot hold exactly (fp8 with fp32 scales, f32) are rounded there. That
matters because V4.1's FP8/FP4 state rounding amplifies small errors.

The top-k mask is a radix-select kernel (kernels/topk.cu, no sort, no host sync); a few
reshapes / gathers are CuPy glue.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import cupy as cp
import numpy as np

from engine.checkpoint import formats
from engine.ops import kernels as K
from engine.ops.gpu import sampling as cupy_sampling
from engine.ops.gpu import staging as cupy_staging
from engine.ops.gpu.graphs import RegionGraphs
from engine.ops.gpu.pinned import PinnedUploader
from engine.ops.kernels import FMT_BF16, FMT_F32, FMT_FP4, FMT_FP8
from engine.ops.numpy_ops import norm_rope_quant_chain
from engine.parallel.tp import stack_rows
from engine.state import sequence as codecs
from engine.state.rows import Span

F32 = np.float32
# DSUF_DIRECT_ALLOC=1: every array its own cudaMalloc instead of a slice of CuPy's pool, so that
# compute-sanitizer knows each array's exact bounds (inside a pool chunk an overrun lands in pooled
# memory and memcheck cannot see it). For `make gpu-memcheck`; slower, never for serving.
if os.environ.get("DSUF_DIRECT_ALLOC") == "1":
    cp.cuda.set_allocator(None)

_FMT_TAG = {FMT_F32: "f32", FMT_BF16: "bf16", FMT_FP8: "fp8", FMT_FP4: "fp4"}
_EPC = {FMT_F32: 4, FMT_BF16: 8, FMT_FP8: 16, FMT_FP4: 32}  # elements per 16-byte chunk
GEMV_MAX_ROWS = 8  # up to this many rows per segment: CUDA-core GEMV, else tensor-core GEMM
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
# One row of FP8 / FP4: the register-fed tensor-core GEMV (kernels/gemv_tc.cu gemvr_*), GEMVR_U units of
# 128 k in flight per lane. It issues about a fifth of gemvx's instructions per weight byte but, like
# any launch, has a fixed cost however small the weight: it runs every FP4 launch, and FP8 launches of
# >= GEMVR_MIN_BYTES of weight with K <= GEMVR_MAX_K (smaller or wider FP8 weights stream faster
# through gemvx).
GEMVR_MIN_BYTES, GEMVR_MAX_K = 16 << 20, 5120
GEMVR_U = {FMT_FP8: 2, FMT_FP4: 8}
GEMVR_BLOCKS_PER_SM = {FMT_FP8: 3, FMT_FP4: 2}  # what each kernel's registers allow (DEF_GR's MINB)
# The indexer's scores on tensor cores (kernels/attention.cu indexer_scores_tc*) for launches of at
# least ITC_MIN_QUERIES queries (fewer do not fill its tiles: the CUDA-core kernel).
ITC_ROWS, ITC_MIN_QUERIES = 128, 16  # (query, head) rows per block (ITC_ROWS in the kernel)
# A prompt chunk's sparse attention on tensor cores (attn_tc_*, three passes through an [n, H, L]
# score buffer, n <= ATC_QUERIES queries at a time).
ATC_QUERIES = K.ATTEND_TC_QUERIES
GEMM_TC_SMEM, GEMM_TC_TILE_N = 96000, 128  # (kernels/gemv_tc.cu GT_SMEM, GT_BN)
_ELT_BLOCK = 256
# decode attention: split the keys until about this many blocks run, each split >= this many keys (a
# multiple of the kernel's 16-key tile: each tile's loads are a round trip)
ATT_BLOCKS_TARGET, ATT_MIN_SPLIT = 132 * 2, 64
_NULL = np.uint64(0)  # a null pointer kernel argument
COPY_ROWS_MAX = 64 << 10  # copy_rows: larger copies (a state buffer's growth) go through cudaMemcpyAsync
HC_COUNTERS = 1 << 16  # rows the fused mHC mix handles per launch (one int32 block counter each)
MOE_DEVICE_MAX_PAIRS = 1024  # moe(): up to this many (token, expert) pairs are grouped in GEMV-sized segments
_MOE_GROUP_MAXP = 1024  # kernels/moe.cu MOE_GROUP_MAXP: moe_group runs one block, one thread a pair
# Above that (prompt chunks) moe_group_large groups them (a counting sort in one block, up to
# MOE_GROUP_LARGE_MAXE experts), so a chunk's MoE never waits for the host.
MOE_GROUP_LARGE_MAXE = 1024  # (kernels/moe.cu MOE_GROUP_LARGE_MAXE)


class SideBranch:
    """The result of CupyOps.side: joined into the current stream by result(). Until then it holds
    the branch's inputs, so that memory the caller frees meanwhile is not handed to a kernel of
    the main stream while the branch may still read it."""

    def __init__(self, out, done: cp.cuda.Event | None, keep: tuple) -> None:
        self._out, self._done, self._keep = out, done, keep

    def result(self):
        if self._done is not None:  # (None: computed inline)
            cp.cuda.get_current_stream().wait_event(self._done)
        self._keep = None
        return self._out


@dataclass
class GpuWeight:
    """A [N, K] weight on the GPU in its stored format. `scale` is f32 [ceil(N/bn), gk] for fp8
    (UE8M0 scales are widened at load), UE8M0 bytes [N, K/32] for fp4, None otherwise."""

    fmt: int
    data: cp.ndarray
    scale: cp.ndarray | None
    shape: tuple[int, int]
    block: tuple[int, int] = (1, 1)

    @property
    def gk(self) -> int:
        return int(self.scale.shape[1]) if self.scale is not None else 1

    def ptr_tables(self) -> tuple[cp.ndarray, cp.ndarray]:
        """Device [1] tables of the data / scale pointers, made once (a host->device copy per
        call would cost more than a decode GEMV)."""
        t = self.__dict__.get("_ptrs")
        if t is None:
            ptrs = cp.asarray(np.array([_ptr(self.data), _ptr(self.scale)], np.uint64))
            t = (ptrs[:1], ptrs[1:])
            self.__dict__["_ptrs"] = t
        return t

    def row_bytes(self) -> int:
        n, k = self.shape
        return {FMT_F32: 4 * k, FMT_BF16: 2 * k, FMT_FP8: k, FMT_FP4: k // 2}[self.fmt]

    def kernel_ok(self, rows: int = 1) -> bool:
        """Our kernels read 16-byte chunks of a row: K must be a multiple of a chunk (of the
        32-wide K step for the GEMM, used above GEMV_MAX_ROWS rows)."""
        k = self.shape[1]
        if k % _EPC[self.fmt] or (rows > GEMV_MAX_ROWS and k % 32):
            return False
        return self.fmt != FMT_FP8 or self.block[1] % 16 == 0

    def dequant(self) -> cp.ndarray:
        """float32 copy (fallback paths and tests)."""
        return cp.asarray(_host_dequant(self))


def _host_dequant(w: GpuWeight) -> np.ndarray:
    data = cp.asnumpy(w.data)
    if w.fmt == FMT_F32:
        return data
    if w.fmt == FMT_BF16:
        return formats.bf16_to_f32(data)
    if w.fmt == FMT_FP8:
        return formats.dequant_fp8_blocks(data, cp.asnumpy(w.scale), w.block)
    return formats.dequant_fp4_experts(data, cp.asnumpy(w.scale), 32)


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
    """A row of x staged for gemvr (kernels/gemv_tc.cu stage_x_cols): its hi and lo f16
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


@functools.cache
def _sm_count() -> int:
    return int(cp.cuda.Device().attributes["MultiProcessorCount"])


def _tc_ok(w: GpuWeight, lda: int) -> bool:
    """The tensor-core GEMV reads FP8 rows in 16-element chunks with scale blocks that align with
    its 128-element stages, FP4 rows in 32-element groups, and x rows split in groups of 4 / 8."""
    k = w.shape[1]
    if w.fmt == FMT_FP8:
        bk = w.block[1]
        return k % 16 == 0 and lda % 4 == 0 and bk % 16 == 0 and (bk % 128 == 0 or 128 % bk == 0)
    return w.fmt == FMT_FP4 and k % 32 == 0 and lda % 8 == 0


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


def _ptr(a: cp.ndarray | None) -> int:
    return 0 if a is None else int(a.data.ptr)


def _span_ptr(sp: Span, width: int) -> int:
    """Device address of a Span's first row (its buffer: C-contiguous float32 rows of `width`)."""
    buf = sp.buf
    if buf.dtype != F32 or not buf.flags.c_contiguous or buf.ndim != 2 or buf.shape[1] != width \
            or sp.start + sp.n > buf.shape[0]:
        raise ValueError(f"a Span must cover C-contiguous float32 rows of width {width}")
    return int(buf.data.ptr) + sp.start * width * 4


def _indexer_tc_shape(s: int, h: int, dh: int) -> bool:
    """Whether the tensor-core indexer kernel takes this launch (kernels/attention.cu
    indexer_tc_body's limits; and enough queries to fill its tiles)."""
    return h % 32 == 0 and ITC_ROWS % h == 0 and dh % 16 == 0 and dh <= 128 and s >= ITC_MIN_QUERIES


def _indexer_tc_smem(dh: int, terms: int) -> int:
    """Dynamic shared memory of indexer_scores_tc<terms>: 192 bf16 rows of dh + 8, per term, and
    the warps' sums."""
    return terms * (ITC_ROWS + 64) * (dh + 8) * 2 + 8 * 32 * 4


def _indexer_smem(h: int, dh: int) -> int:
    """Dynamic shared memory bytes of an indexer scores launch (kernels/attention.cu indexer_row)."""
    return 4 * (h * (dh + 1) + h + 8 * dh)


def _smem_function(mod: str, name: str, smem: int):
    """A kernel launched with smem bytes of dynamic shared memory (opted in above the default 48 KB)."""
    return K.function_with_smem(mod, name, smem) if smem > 48 << 10 else K.function(mod, name)


def _c32(x) -> cp.ndarray:
    return cp.ascontiguousarray(x, dtype=F32)


def _grid(n: int, block: int = _ELT_BLOCK) -> tuple[int]:
    return (max(1, math.ceil(n / block)),)


class CupyOps:
    """Same methods and semantics as NumpyOps; arrays are CuPy float32 on the current device."""

    name = "cupy"
    xp = cp

    def __init__(self, graphs: bool | None = None) -> None:
        """graphs: replay the forward's fixed-shape regions as CUDA graphs (default on; the
        environment variable DSUF_GRAPHS=0 turns them off)."""
        self.graphs = RegionGraphs(graphs)
        self.device = cp.cuda.Device().id  # the device this backend's arrays live on
        self.placement = f"cupy:{self.device}"
        self._tables: dict[int, tuple] = {}  # id(expert list) -> (list, pointer tables)
        self._seg_cache: dict[tuple, cp.ndarray] = {}
        self._group_ptrs: dict[tuple[int, int], tuple] = {}
        self._pair_ptrs: dict[tuple[int, int], tuple] = {}  # (w1, w3) -> one pointer table (swiglu_mlp)
        self._seg_offsets: dict[tuple, cp.ndarray] = {}  # fused gate / up: w3 segment offsets
        self._uploader = PinnedUploader()
        self._no_scale = cp.zeros(1, F32)  # the scale argument of unscaled tables
        self._hc_count = cp.zeros(HC_COUNTERS, dtype=cp.int32)  # hc_mix's block counters (each resets its own)
        self._side_stream: cp.cuda.Stream | None = None  # side(): made on first use, on this device
        self._rows_of_mask: tuple | None = None  # (mask, k, its row lists): attend_decode's last

    # ---- weights ---------------------------------------------------------------------
    def prepare_rows(self, ws: list) -> GpuWeight:
        """Weights of one input as one, stacked along their output rows (engine/parallel/tp.py stack_rows)."""
        return self.prepare(stack_rows(ws))

    def prepare_table(self, table, scale=None) -> cp.ndarray:
        """An Engram table, dequantized on the host and placed on the device (host-resident
        pinned tables, which the memory plan assumes, are still to come)."""
        from engine.ops.numpy_ops import dequantize_table

        return cp.asarray(np.ascontiguousarray(dequantize_table(table, scale), dtype=F32))

    def prepare(self, weight) -> GpuWeight:
        """Stored-format Weight (or plain array) -> GpuWeight, kept in its stored format."""
        if isinstance(weight, (np.ndarray, cp.ndarray)):
            a = _c32(weight)
            return GpuWeight(FMT_F32, a.reshape(a.shape[0], -1) if a.ndim != 2 else a, None,
                             (a.shape[0], int(np.prod(a.shape[1:]))))
        if weight.fmt == "f32":
            a = cp.asarray(np.ascontiguousarray(weight.data, dtype=F32))
            return GpuWeight(FMT_F32, a, None, tuple(a.shape))
        if weight.fmt == "bf16":
            a = cp.asarray(np.ascontiguousarray(np.asarray(weight.data).view(np.uint16)))
            return GpuWeight(FMT_BF16, a, None, tuple(a.shape))
        if weight.fmt == "fp8":
            data = cp.asarray(np.ascontiguousarray(np.asarray(weight.data).view(np.uint8)))
            n, k = data.shape
            if weight.scale is None:  # unscaled fp8 table: unit scales, one block
                block, scale = (n, k), np.ones((1, 1), F32)
            else:
                block = (int(weight.block[0]), int(weight.block[1]))
                s = np.asarray(weight.scale)
                scale = formats.e8m0_to_f32(s) if s.dtype == np.uint8 else s.astype(F32)
            return GpuWeight(FMT_FP8, data, cp.asarray(np.ascontiguousarray(scale, dtype=F32)), (n, k), block)
        if weight.fmt == "fp4":
            data = cp.asarray(np.ascontiguousarray(np.asarray(weight.data).view(np.uint8)))
            scale = np.ascontiguousarray(np.asarray(weight.scale).view(np.uint8))
            n = data.shape[0]
            return GpuWeight(FMT_FP4, data, cp.asarray(scale), (n, 2 * data.shape[1]), (1, 32))
        raise ValueError(f"{weight.name}: unknown weight format {weight.fmt!r}")

    def asarray(self, x, dtype=F32) -> cp.ndarray:
        """A device array; host data goes up through pinned memory, asynchronously (pinned.py)."""
        if isinstance(x, cp.ndarray):
            return x.astype(dtype, copy=False)
        a = np.asarray(x, dtype=dtype)
        if cp.cuda.get_current_stream().is_capturing():  # a graph must not read a reused pinned slot
            return cp.asarray(a)
        return self._uploader.upload(a)

    def cat(self, arrays: list, axis: int = 0) -> cp.ndarray:
        """Concatenate. Along the leading axis (or of single-row arrays along axis 1, a decode
        step's masks) contiguous pieces are joined with device-to-device copies: cupy.concatenate
        costs ~40 us of host time per call, more than the copies themselves."""
        flat = axis == 0 or (axis == 1 and all(a.ndim == 2 and a.shape[0] == 1 for a in arrays))
        a0 = arrays[0]
        if not flat or any(a.dtype != a0.dtype or not a.flags.c_contiguous or a.ndim != a0.ndim
                           or (axis == 0 and a.shape[1:] != a0.shape[1:]) for a in arrays):
            return cp.concatenate(arrays, axis=axis)
        shape = list(a0.shape)
        shape[axis] = sum(a.shape[axis] for a in arrays)
        out = cp.empty(shape, dtype=a0.dtype)
        stream = cp.cuda.get_current_stream().ptr
        off = 0
        for a in arrays:
            if a.nbytes:
                cp.cuda.runtime.memcpyAsync(out.data.ptr + off, a.data.ptr, a.nbytes,
                                            cp.cuda.runtime.memcpyDeviceToDevice, stream)
            off += a.nbytes
        return out

    def to_host(self, x) -> np.ndarray:
        return cp.asnumpy(x) if isinstance(x, cp.ndarray) else np.asarray(x)

    def sample_rows(self, logits: cp.ndarray, jobs: list, ahead=None) -> list:
        """One token per engine.runtime.sampling.SampleJob, drawn on the device (cupy_sampling.py); ahead():
        host work done while the device finishes, before the tokens are read back."""
        return cupy_sampling.sample_rows(self.asarray(logits), jobs,
                                         upload=lambda table: self.asarray(table, dtype=np.int32), ahead=ahead)

    def copy_rows(self, jobs: list) -> None:
        """Row copies (src, src_row, dst, dst_row, rows) between C-contiguous 2-D arrays of one width,
        in order: a decode step's state appends. Small aligned copies go in one launch (a table of
        pointers), the rest (and a lone copy) through cudaMemcpyAsync."""
        if not jobs:
            return
        stream = cp.cuda.get_current_stream().ptr
        tab = []
        for src, sr, dst, dr, n in jobs:
            if not (src.flags.c_contiguous and dst.flags.c_contiguous) or src.shape[1:] != dst.shape[1:] \
                    or src.dtype != dst.dtype or sr + n > src.shape[0] or dr + n > dst.shape[0]:
                raise ValueError("copy_rows: arrays must be C-contiguous rows of one width, copies in bounds")
            row = src.strides[0]
            a, b, nb = _ptr(src) + sr * row, _ptr(dst) + dr * row, n * row
            if len(jobs) > 1 and nb <= COPY_ROWS_MAX and (a | b | nb) % 16 == 0:
                tab.append((a, b, nb))
            elif nb:
                cp.cuda.runtime.memcpyAsync(b, a, nb, cp.cuda.runtime.memcpyDeviceToDevice, stream)
        if tab:
            most = max(t[2] for t in tab) // 16
            K.function("elementwise", "copy_rows")((len(tab), min(8, -(-most // 256))), (256,), (
                self.asarray(np.asarray(tab, np.int64).reshape(-1), dtype=np.int64),))

    def graphed(self, key, fn, *arrays):
        """Run a fixed-shape region of the forward, as a CUDA graph once its shapes repeat."""
        return self.graphs(key, fn, *arrays)

    def regions_inline(self) -> bool:
        """Whether graphed regions called now run inline: graphs off, or inside an enclosing
        graph or step (so a region may return open side branches, joined later in that capture)."""
        return self.graphs.inline_now

    def side(self, fn, *args) -> SideBranch:
        """fn(*args) enqueued on a second stream, forked from the current one here: it runs
        concurrently with what the caller enqueues next, until .result() joins it back. Inside a
        graph capture the fork and join become the graph's edges, so a decode step's independent
        chains (the shared expert beside the routed ones) overlap their launch latencies and fill
        each other's idle memory time. fn must not use device scratch that the main stream's ops
        use before the join (hc_mixes' block counters: one mix at a time).
        Only while capturing: eagerly fn runs inline, because an eager branch may fill a cache
        (segment tables, pointer tables) or the pinned upload ring on its own stream, and the main
        stream could read that entry before the join. A capture runs after the region's eager
        warm-up, with its caches full and uploads not staged through the ring."""
        main = cp.cuda.get_current_stream()
        if not main.is_capturing():
            return SideBranch(fn(*args), None, ())
        if self._side_stream is None:
            self._side_stream = cp.cuda.Stream(non_blocking=True)
        side = self._side_stream
        fork = cp.cuda.Event(disable_timing=True)
        fork.record(main)
        side.wait_event(fork)
        with side:
            out = fn(*args)
        done = cp.cuda.Event(disable_timing=True)
        done.record(side)
        return SideBranch(out, done, args)

    # ---- linear kernels ----------------------------------------------------------------
    def _run_linear(self, a: cp.ndarray, y: cp.ndarray, n: int, k: int, segs,
                    wptrs: cp.ndarray, sptrs: cp.ndarray, w: GpuWeight, max_rows: int, lda: int | None = None) -> None:
        """Launch the tensor-core GEMV (FP8 / FP4, 2 <= max_rows <= 32), the GEMV (max_rows <= 8) or
        a GEMM kernel (FP8 / FP4 on tensor cores: gemm_tc; else gemm) over a segment table (a list
        of (weight, row0, rows, a_col, y_col), or that table already on the device). lda = 0 (with
        max_rows 1): every segment reads a's row 0."""
        tag = _FMT_TAG[w.fmt]
        seg = segs if isinstance(segs, cp.ndarray) else self._segs_device(segs)
        nseg = seg.size // 5
        if lda is not None and max_rows != 1:
            raise ValueError("_run_linear: a row stride override needs one-row segments")
        args = (a, np.int32(a.shape[1] if lda is None else lda), y, np.int32(y.shape[1]), np.int32(n), np.int32(k),
                seg, wptrs, sptrs, np.int32(w.block[0]), np.int32(w.block[1]), np.int32(w.gk))
        # (the tensor-core GEMV reads x in 128-column groups: segments must start on one)
        if _gemvr_ok(a, w, segs, nseg, max_rows):
            self._run_reg(args, n, k, seg, nseg, w, constant=not isinstance(segs, cp.ndarray))
        elif (TC_MIN_ROWS.get(w.fmt, 99) <= max_rows <= TC_MAX_ROWS and _tc_ok(w, a.shape[1])
                and (isinstance(segs, cp.ndarray) or all(s[3] % 128 == 0 for s in segs))):
            self._run_tc(a, y, n, k, seg, wptrs, sptrs, w, max_rows)
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
            K.launch(fn, (blocks, nseg), (256,), (*args, np.int32(kw), np.int32(pf)), shared_mem=smem, pdl=True)
        elif max_rows <= GEMV_MAX_ROWS:
            mt = 1 if max_rows <= 1 else 2 if max_rows <= 2 else 4 if max_rows <= 4 else 8
            rpw = 4
            kw = _gemv_split(n, k // _EPC[w.fmt], rpw, nseg)
            fn = K.function("linear", f"gemv_{tag}_m{mt}")
            fn((math.ceil(n / (rpw * 8 // kw)), nseg), (256,), (*args, np.int32(kw)))
        elif _gemm_tc_ok(w, a.shape[1]) and (isinstance(segs, cp.ndarray) or all(s[3] % 128 == 0 for s in segs)):
            xs, xinv = self._tc_split_x(a, w.fmt == FMT_FP4)  # (in place of x; gemm's other arguments)
            K.function_with_smem("gemv_tc", f"gemm_tc_{tag}", GEMM_TC_SMEM)(
                (math.ceil(n / GEMM_TC_TILE_N), nseg), (256,), (xs, xinv, *args[1:]), shared_mem=GEMM_TC_SMEM)
        else:  # (BF16 / f32 weights, and block shapes or x columns gemm_tc cannot read)
            fn = K.function("linear", f"gemm_{tag}")
            fn((math.ceil(n / GEMM_TILE), nseg), (128,), args)

    @staticmethod
    def _run_reg(args: tuple, n: int, k: int, seg: cp.ndarray, nseg: int, w: GpuWeight, constant: bool) -> None:
        """Register-fed tensor-core GEMV over one-row segments (configuration: _gemvr_config); blocks
        stride over the 16-row tiles. constant: the segment table is ours, so blocks may load weights
        early (PDL)."""
        name, kw = _gemvr_config(w.fmt, n, k, nseg)
        smem = _gemvr_smem(k)
        fn = K.function_with_smem("gemv_tc", name, GEMVX_MAX_SMEM)
        tiles = -(-n // 16)
        per_sm = _blocks_per_sm(fn, smem)
        nbi = -(-tiles // (8 // kw))
        blocks = max(1, min(nbi, _sm_count() * per_sm // nseg))
        K.launch(fn, (blocks, nseg), (256,), (*args, np.int32(kw), np.int32(1 if constant else 0)),
                 shared_mem=smem, pdl=True)

    def _run_tc(self, a: cp.ndarray, y: cp.ndarray, n: int, k: int, seg: cp.ndarray,
                wptrs: cp.ndarray, sptrs: cp.ndarray, w: GpuWeight, max_rows: int) -> None:
        """Tensor-core GEMV: split x into scaled hi / lo f16 terms, then one launch over the segments."""
        xs, xinv = self._tc_split_x(a, w.fmt == FMT_FP4)
        nt = 1 if max_rows <= 8 else 2 if max_rows <= 16 else 4
        fn = K.function_with_smem("gemv_tc", f"tcgemv_{_FMT_TAG[w.fmt]}_n{nt}", TC_SMEM)
        tiles, nseg = -(-n // 16), seg.size // 5
        kw = _tc_split(tiles * nseg, -(-w.row_bytes() // TC_STAGE_BYTES))
        fn((-(-tiles // (TC_WARPS // kw)), nseg), (32 * TC_WARPS,), (
            xs, xinv, np.int32(a.shape[1]), y, np.int32(y.shape[1]), np.int32(n), np.int32(k), seg, wptrs, sptrs,
            np.int32(w.block[0]), np.int32(w.block[1]), np.int32(w.gk), np.int32(kw)), shared_mem=TC_SMEM)

    @staticmethod
    def _tc_split_x(a: cp.ndarray, fp4: bool) -> tuple[cp.ndarray, cp.ndarray]:
        """x [m, lda] -> its hi / lo f16 terms in the tensor-core GEMV's order, and the inverse
        power-of-two scale of each 128-element group (kernels/gemv_tc.cu tc_split_x)."""
        m, lda = a.shape
        ngx = -(-lda // 128)
        xs = cp.empty(m * lda, dtype=cp.uint32)
        xinv = cp.empty((m, ngx), dtype=F32)
        K.function("gemv_tc", "tc_split_x")((-(-ngx // 8), m), (256,), (a, np.int32(lda), xs, xinv, np.int32(fp4)))
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

    def linear(self, x: cp.ndarray, w) -> cp.ndarray:
        """y = x @ w.T with w [out, in] (a GpuWeight in any stored format)."""
        if not isinstance(w, GpuWeight):
            w = self.prepare(w)
        n, k = w.shape
        lead = x.shape[:-1]
        a = _c32(x).reshape(-1, k)
        m = a.shape[0]
        y = cp.empty((m, n), dtype=F32)
        if m == 0:
            return y.reshape(*lead, n)
        if not w.kernel_ok(m):
            return (a @ w.dequant().T).reshape(*lead, n)
        segs, mr = self._row_segments(m, fmt=w.fmt)
        wp, sp = w.ptr_tables()
        self._run_linear(a, y, n, k, segs, wp, sp, w, mr)
        return y.reshape(*lead, n)

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
        if not ok or t == 0:
            wg = w.dequant().reshape(groups, nout, kin)
            return cp.einsum("tgi,goi->tgo", _c32(x), wg)
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
        segs = []
        for gi in range(groups):
            s, mr = self._row_segments(t, gi, 0, gi * kin, gi * nout, w.fmt)
            segs += s
        self._run_linear(a, y, nout, kin, segs, hit[1], hit[2], w, mr)
        return y.reshape(t, g, nout)

    # ---- small ops ---------------------------------------------------------------------
    def engram_mix(self, h: cp.ndarray, key: cp.ndarray, value: cp.ndarray, qk: cp.ndarray, eps: float) -> cp.ndarray:
        """Gate the Engram value into each stream by the normalised stream-key match."""
        t, hc, d = h.shape
        h, key, value, qk = _c32(h), _c32(key), _c32(value), _c32(qk)
        y = cp.empty_like(h)
        if t:
            K.function("elementwise", "engram_mix")((t * hc,), (256,), (h, key, value, qk, y, np.int32(hc),
                                                                       np.int32(d), F32(eps)))
        return y

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

    def rmsnorm(self, x: cp.ndarray, weight: cp.ndarray | None, eps: float) -> cp.ndarray:
        d = x.shape[-1]
        x = _c32(x)
        y = cp.empty_like(x)
        rows = x.size // d if d else 0
        if rows:
            wt = None if weight is None else _c32(weight)
            args = (x, wt if wt is not None else _NULL, y, np.int32(d), F32(eps))
            if d % 4 == 0 and 1024 <= d <= 4 * 256 * 8:
                K.function("elementwise", "rmsnorm_v4")((rows,), (256,), args)
            else:
                K.function("elementwise", "rmsnorm")((rows,), (256 if d >= 256 else 64,), args)
        return y

    def rope(self, x: cp.ndarray, cos: cp.ndarray, sin: cp.ndarray, inverse: bool = False) -> cp.ndarray:
        """Interleaved-pair RoPE on the trailing 2*cos.shape[-1] channels of x [T, ..., D]."""
        x = _c32(x)
        y = cp.empty_like(x)
        if x.size == 0:
            return y
        t, d, p = x.shape[0], x.shape[-1], cos.shape[-1]
        m = x.size // (t * d)
        K.function("elementwise", "rope")(_grid(x.size), (_ELT_BLOCK,), (
            x, _c32(cos), _c32(sin), y, np.int64(x.size), np.int32(m), np.int32(d), np.int32(p),
            F32(-1.0 if inverse else 1.0)))
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
            return norm_rope_quant_chain(self, x, cos, sin, norm, quant, keep_normed)
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
            np.int32(p), F32(1.0), np.int32(quant), y, _NULL if yn is None else yn))
        return (yn, y) if keep_normed else y

    # ---- mHC -------------------------------------------------------------------------
    def _hc_partials(self, streams: cp.ndarray, fn: cp.ndarray) -> tuple[cp.ndarray, int]:
        t, hc, d = streams.shape
        f, nm = hc * d, fn.shape[0]
        if nm > 80:
            raise ValueError(f"mHC kernel supports <= 80 mixes (got {nm})")
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
        if nm <= 32 and f % 4 == 0 and t <= HC_COUNTERS and (mode == 1 or (hc * hc <= 32 and hc & (hc - 1) == 0)):
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
        if d % 4 or d > 8192:
            return self.rmsnorm(self.hc_collapse(streams, pre), weight, eps)
        out = cp.empty((t, d), F32)
        if t:
            K.function("elementwise", "hc_collapse_norm")((t,), (256,), (
                _c32(streams), _c32(pre), _c32(weight) if weight is not None else _NULL, out, np.int32(hc),
                np.int32(d), F32(eps)))
        return out

    def hc_collapse(self, streams: cp.ndarray, pre: cp.ndarray) -> cp.ndarray:
        t, hc, d = streams.shape
        out = cp.empty((t, d), F32)
        if out.size:
            K.function("elementwise", "hc_collapse")(_grid(out.size), (_ELT_BLOCK,), (
                _c32(streams), _c32(pre), out, np.int64(out.size), np.int32(hc), np.int32(d)))
        return out

    def hc_expand(self, out: cp.ndarray, residual: cp.ndarray, post: cp.ndarray, comb: cp.ndarray) -> cp.ndarray:
        t, hc, d = residual.shape
        y = cp.empty((t, hc, d), F32)
        if y.size:
            K.function("elementwise", "hc_expand")(_grid(y.size), (_ELT_BLOCK,), (
                _c32(out), _c32(residual), _c32(post), _c32(comb), y, np.int64(y.size), np.int32(hc), np.int32(d)))
        return y

    # ---- MoE -------------------------------------------------------------------------
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
            return self.linear(self._swiglu(self.linear(x, w1), self.linear(x, w3), limit), w2)
        hit = self._pair_ptrs.get((id(w1), id(w3)))
        if hit is None or hit[0] is not w1 or hit[1] is not w3:
            hit = (w1, w3, cp.asarray(np.array([_ptr(w1.data), _ptr(w3.data)], np.uint64)),
                   cp.asarray(np.array([_ptr(w1.scale), _ptr(w3.scale)], np.uint64)))
            self._pair_ptrs[(id(w1), id(w3))] = hit
        s1, mr = self._row_segments(m, 0, fmt=w1.fmt)
        s3, _ = self._row_segments(m, 1, 0, 0, inter, fmt=w1.fmt)
        gu = cp.empty((m, 2 * inter), F32)
        self._run_linear(a, gu, inter, w1.shape[1], s1 + s3, hit[2], hit[3], w1, mr)
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
        segments of min(8, T) rows (GEMV) up to MOE_DEVICE_MAX_PAIRS pairs, else GEMM_TILE; gate and up
        in one doubled table where the expert tables pair w1 and w3."""
        step = min(GEMV_MAX_ROWS, t) if p <= MOE_DEVICE_MAX_PAIRS else GEMM_TILE
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
        Above MOE_DEVICE_MAX_PAIRS pairs, segments of GEMM_TILE rows, as the host path cuts an expert
        with more than 8 pairs (the tensor-core GEMM)."""
        step, dup = self._group_shape(tabs, ids.size, x.shape[0])
        segs, gather, inv, _ = self._moe_group(ids, n_experts, step, dup)
        return self._moe_project(x, gather, tabs, segs, step, weights, inv, int(ids.shape[1]), limit,
                                 doubled=bool(dup), shared=shared)

    def _moe_project(self, x: cp.ndarray, gather: cp.ndarray, tabs, segs: cp.ndarray, max_rows: int, weights,
                     inv: cp.ndarray, k: int, limit: float, doubled: bool = False,
                     shared=None) -> cp.ndarray:
        """The experts over pairs sorted by expert (x rows gather [P]): w1, w3, swiglu, w2, each one
        launch over the segment table; then y[t] = sum_j weights[t, j] * out[inv[t * k + j]] (+ the
        shared branch's result, joined just before the combine). doubled: segs already holds w3's
        half after w1's (moe_group dup_col)."""
        d = x.shape[1]
        p = gather.size
        # one token (decode at batch 1): every pair reads row 0, so x itself with a zero row stride
        # stands in for the gathered rows (one-row segments only: the GEMV kernels)
        shared_row = x.shape[0] == 1 and max_rows == 1
        xp_rows, lda = (x, 0) if shared_row else (x[gather], None)
        (w1, p1, s1), (w2, p2, s2), (w3, p3, s3) = tabs[:3]
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
            self._run_linear(xp_rows, gu, inter, d, segs_gu, tabs[3][1], tabs[3][2], w1, max_rows, lda)
            self._run_linear(self._swiglu_pairs(gu, inter, limit), out, d, inter, segs, p2, s2, w2, max_rows)
        else:
            gate = cp.empty((p, inter), F32)
            up = cp.empty((p, inter), F32)
            self._run_linear(xp_rows, gate, inter, d, segs, p1, s1, w1, max_rows, lda)
            self._run_linear(xp_rows, up, inter, d, segs, p3, s3, w3, max_rows, lda)
            self._run_linear(self._swiglu(gate, up, limit), out, d, inter, segs, p2, s2, w2, max_rows)
        y = cp.empty_like(x)
        K.function("elementwise", "moe_combine")(_grid(y.size), (_ELT_BLOCK,), (
            out, _c32(weights), inv, y, np.int64(y.size), np.int32(k), np.int32(d)))
        return y + shared.result() if shared is not None else y

    def moe(self, x: cp.ndarray, experts: list, weights: cp.ndarray, ids: cp.ndarray, limit: float,
            shared=None) -> cp.ndarray:
        """Routed experts: sum_k weights[t,k] * expert_{ids[t,k]}(x_t), plus `shared` (a side branch:
        the shared expert), joined only after the combine. experts[e] = (w1, w2, w3).
        Pairs (t, k) are grouped by expert, then each projection is one launch over per-expert
        segments. Up to MOE_DEVICE_MAX_PAIRS pairs (decode, small chunks) the grouping is moe_group
        (no host sync: CUDA-graph capturable); above, moe_group_large (the same table in segments of
        up to 64 rows for the tensor-core GEMM)."""
        x = _c32(x)
        t, d = x.shape
        if t == 0:
            return cp.zeros_like(x) if shared is None else _c32(shared.result())
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
            return y + shared.result() if shared is not None else y
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
                                            inv.astype(np.int32)]))
        nsg = 5 * len(segs)
        return self._moe_project(x, packed[nsg:nsg + order.size], tabs, packed[:nsg], mr, weights,
                                 packed[nsg + order.size:], k, limit, shared=shared)

    # ---- attention -------------------------------------------------------------------
    def attention_ranges(self, q: cp.ndarray, keys: cp.ndarray, lo: np.ndarray, hi: np.ndarray,
                         entries: cp.ndarray | None, emask: cp.ndarray | None, sinks: cp.ndarray, scale: float,
                         selected: int = 0, exact: bool = False) -> cp.ndarray:
        """NumpyOps.attention_ranges, each query over its own keys only: its window read as a range
        of `keys`, then its entries under its mask row (through the row's list of selected rows
        where `selected` bounds them far below the entries' count). On tensor cores where heads and
        head_dim are multiples of 64 (_attention_ranges_tc; exact: keys and entries on state codecs'
        grids), else one attention_decode query per row."""
        s, h, d = q.shape
        if s == 0:
            return cp.empty((0, h, d), F32)
        keys = _c32(keys)
        entries = None if entries is None else _c32(entries)
        n_e = 0 if entries is None else entries.shape[0]
        masks = None if entries is None else cp.ascontiguousarray(emask, dtype=cp.bool_)
        lists = self._mask_rows(masks, selected) if n_e and 0 < selected and 2 * selected <= n_e else None
        if h % 64 == 0 and d % 64 == 0:  # (attn_tc_* take heads and head_dim in 64-wide tiles)
            return self._attention_ranges_tc(q, keys, lo, hi, entries, masks, lists, sinks, scale, exact)
        if d % 32 or d > 512:
            raise ValueError(f"attention kernel needs head_dim % 32 == 0 and <= 512 (got {d})")
        tab = np.zeros((s, 6), np.int64)
        tab[:, 0] = _ptr(keys) + np.asarray(lo, np.int64) * d * 4
        tab[:, 1] = np.asarray(hi, np.int64) - np.asarray(lo, np.int64)
        if entries is not None:
            tab[:, 3], tab[:, 4], tab[:, 5] = _ptr(entries), n_e, 1
        longest = int(tab[:, 1].max()) + (selected if lists is not None else n_e)
        out = cp.empty((s, h, d), F32)
        # (keys / entries stay referenced here until the launch below is enqueued)
        return self._attention_decode(q, self.asarray(tab, dtype=np.int64), masks, sinks, scale, longest, out, lists)

    def _attention_ranges_tc(self, q, keys: cp.ndarray, lo: np.ndarray, hi: np.ndarray, entries, masks, lists,
                             sinks, scale: float, exact: bool) -> cp.ndarray:
        """attention_ranges on tensor cores (kernels/attention.cu attn_tc_*): per block of up to
        ATC_QUERIES queries, their [n, H, L] scores over each one's keys (window, then its listed
        entries, or without lists those its mask row allows), softmax with the sinks in place,
        then times V. keys / entries: contiguous f32; masks: contiguous bool [S, n_e]."""
        s, h, d = q.shape
        qc, sk = _c32(q), _c32(sinks)
        n_e = 0 if entries is None else entries.shape[0]
        ents = entries if entries is not None else _NULL
        masks = masks if lists is None else None  # (the lists stand for the mask)
        width = lists[0].shape[1] if lists is not None else n_e
        span = int((np.asarray(hi) - np.asarray(lo)).max()) + width
        L = max(64, -(-span // 64) * 64)
        lo_d, hi_d = (self.asarray(np.asarray(a, np.int64), dtype=np.int64) for a in (lo, hi))
        terms = 1 if exact else 3
        out = cp.empty((s, h, d), F32)
        for s0 in range(0, s, ATC_QUERIES):
            s1 = min(s, s0 + ATC_QUERIES)
            n = s1 - s0
            sc = cp.empty((n, h, L), F32)
            args = (qc[s0:s1], keys, lo_d[s0:s1], hi_d[s0:s1], ents,
                    lists[0][s0:s1] if lists is not None else _NULL, lists[1][s0:s1] if lists is not None else _NULL,
                    np.int32(width if lists is not None else 0), masks[s0:s1] if masks is not None else _NULL,
                    np.int32(n_e), sc, np.int32(h), np.int32(d), np.int32(L))
            K.function("attention", f"attn_tc_scores{terms}")((L // 64, n, h // 64), (128,), args)
            K.function("attention", "attn_tc_softmax")((-(-(n * h) // 8),), (256,), (
                sc, sk, np.int32(h), np.int32(L), np.int64(n * h), F32(scale)))
            K.function("attention", f"attn_tc_pv{terms}")((d // 64, n, h // 64), (128,), (*args, out[s0:s1]))
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
        if masks is not None and (masks.dtype != cp.bool_ or not masks.flags.c_contiguous):
            raise ValueError("attend_decode: the mask must be a C-contiguous bool [B, N] array")
        K.function("attention", "attention_decode")((-(-h // 8), b, nsplit), (256,), (
            qc, tab, masks if masks is not None else _NULL, np.int32(masks_ld), sk, out, part_o, part_ml,
            np.int32(h), np.int32(d), np.int32(nsplit), np.int32(chunk), F32(scale),
            _NULL if lists is None else lists[0], _NULL if lists is None else lists[1],
            np.int32(0 if lists is None else lists[0].shape[1])), shared_mem=16 * d * 4)
        if nsplit > 1:
            K.function("attention", "attention_combine")((-(-(b * h) // 8),), (256,), (
                part_o, part_ml, sk, out, np.int32(b * h), np.int32(h), np.int32(d), np.int32(nsplit)))
        return out

    def indexer_scores(self, q: cp.ndarray, k: cp.ndarray, w: cp.ndarray, n_heads: int, head_dim: int,
                       exact: bool = False) -> cp.ndarray:
        """sum_h w[s,h] * relu(q[s,h] . k[n]) * head_dim^-0.5 * n_heads^-0.5 -> [S, N]. Many
        queries on tensor cores, q and k as one bf16 term each if `exact` (values on a state codec's
        grid), else three; few queries, or a shape the tensor-core kernel does not take, on the
        CUDA-core kernel."""
        s, h, dh = q.shape
        n = k.shape[0]
        out = cp.empty((s, n), F32)
        if s == 0 or n == 0:
            return out
        if _indexer_tc_shape(s, h, dh):
            terms = 1 if exact else 3
            smem = _indexer_tc_smem(dh, terms)
            _smem_function("attention", f"indexer_scores_tc{terms}", smem)((math.ceil(s / (ITC_ROWS // h)),), (256,), (
                _c32(q), _c32(k), _c32(w), out, np.int32(s), np.int32(h), np.int32(n), np.int32(dh),
                F32(head_dim**-0.5), F32(n_heads**-0.5)), shared_mem=smem)
            return out
        if dh % 32 or dh > 256:
            raise ValueError(f"indexer kernel needs index_head_dim % 32 == 0 and <= 256 (got {dh})")
        smem = _indexer_smem(h, dh)
        _smem_function("attention", "indexer_scores", smem)((math.ceil(n / 32), s), (256,), (
            _c32(q), _c32(k), _c32(w), out, np.int32(s), np.int32(h), np.int32(n), np.int32(dh),
            F32(head_dim**-0.5), F32(n_heads**-0.5)), shared_mem=smem)
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
        smem = _indexer_smem(h, dh)
        _smem_function("attention", "indexer_scores_spans", smem)((math.ceil(width / 32), b), (256,), (
            _c32(q), table, _c32(w), out, np.int32(h), np.int32(width), np.int32(dh),
            F32(head_dim**-0.5), F32(n_heads**-0.5)), shared_mem=smem)
        return out

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
                _c32(kv), _c32(gate), out, np.int64(out.size), np.int32(r), np.int32(d)))
        return out

    def gated_pool_rows(self, kv: cp.ndarray, gate: cp.ndarray, ratio: int, width: int) -> cp.ndarray:
        """Decode: row b pools the `ratio` pending rows of sequence b's closing group (staged span
        tables [B, 2] of kv and gate rows; address 0: no group closes, a zero row) -> [B, width]."""
        out = cp.empty((kv.shape[0], width), F32)
        if out.size:
            K.function("elementwise", "gated_pool_rows")(_grid(out.size), (_ELT_BLOCK,), (
                kv, gate, out, np.int64(out.size), np.int32(ratio), np.int32(width)))
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

    # ---- a step's inputs -------------------------------------------------------------
    def _upload(self, inputs) -> tuple:
        """A step's inputs packed (cupy_staging.py): the int64 and float32 arrays on the device,
        and where each field lies in them."""
        i64, f32, layout = cupy_staging.pack(inputs)
        return self.asarray(i64, dtype=np.int64), self.asarray(f32), layout

    def stage(self, inputs):
        """A step's inputs (engine/state/decode_plan.py StepInputs) on the device: tables of addresses
        and host arrays, in one int64 and one float32 upload."""
        i64, f32, layout = self._upload(inputs)
        return layout.views(i64, f32)

    def prestage(self, inputs):
        """A step's tables packed on the host ahead of the step (Model.prepare_next: its token ids
        and Engram hash ids are placeholders, filled in by graphed_step), with its signature."""
        return (*cupy_staging.pack(inputs), inputs.signature())

    def graphed_step(self, key, inputs, run, rows: int, pre=None):
        """run(staged inputs) as one CUDA graph per (key, launch signature): a whole decode step
        replays with one upload of its tables and one graph launch. pre: prestage(inputs as they
        were but for the token fields), their ids and hash ids written in before the upload."""
        if pre is None:
            i64, f32, layout = self._upload(inputs)
            sig = inputs.signature()
        else:
            i64, f32, layout, sig = pre
            cupy_staging.fill(i64, layout, "ids", inputs.ids)
            if inputs.hash_ids is not None:
                cupy_staging.fill(i64, layout, "hash_ids", inputs.hash_ids)
            i64, f32 = self.asarray(i64, dtype=np.int64), self.asarray(f32)
        return self.graphs((key, sig), lambda a, b: run(layout.views(a, b)), i64, f32, rows=rows)

    # ---- state quantization ----------------------------------------------------------
    def fake_quant_fp8(self, x: cp.ndarray, block: int = 32) -> cp.ndarray:
        n = x.shape[-1]
        if n % block:
            return x
        x = _c32(x)
        y = cp.empty_like(x)
        nb = x.size // block
        if nb:
            K.function("quant", "fake_quant_fp8")(_grid(nb, 128), (128,), (x, y, np.int64(nb), np.int32(block)))
        return y

    def fake_quant_fp4(self, x: cp.ndarray, block: int, e4m3_scales: bool = False) -> cp.ndarray:
        n = x.shape[-1]
        if n % block:
            return x
        x = _c32(x)
        y = cp.empty_like(x)
        nb = x.size // block
        if nb:
            K.function("quant", "fake_quant_fp4")(_grid(nb, 128), (128,), (
                x, y, np.int64(nb), np.int32(block), np.int32(bool(e4m3_scales))))
        return y
