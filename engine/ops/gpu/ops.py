"""CuPy backend: the ops of engine/ops/protocol.py on our own CUDA kernels (kernels/*.cu via NVRTC).

CupyOps is composed of one mixin per job: weights.py (GpuWeight, prepare*), linear.py (the GEMV /
GEMM dispatch), norms.py (norms, RoPE, state fake quantization, Engram's gate, mHC), moe.py
(routing, the experts), attention.py (attention, indexer, top-k, pooling, state-row scatters) and
fork.py (fork / join_all: a captured step's independent chains on a second stream). This module
holds the glue: arrays, host <-> device copies, a step's staged inputs and its CUDA graph, sampling
and the collectives.

Activations are float32 CuPy arrays throughout and every kernel is float32-accurate, so results
match the numpy reference up to summation order (linear.py says where the bf16 GEMM rounds a
weight). That matters because V4.1's FP8 / FP4 state rounding amplifies small errors.
--numerics deepseek: DeepseekCupyOps (deepseek.py), the reference's bf16 / FP8 quantization points.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from engine.ops.gpu import sampling as cupy_sampling
from engine.ops.gpu import spec_sampling as cupy_spec
from engine.ops.gpu import staging as cupy_staging
from engine.ops.gpu.attention import AttentionOps
from engine.ops.gpu.common import F32, _ptr, copy_table
from engine.ops.gpu.fork import Forks, joins_inputs
from engine.ops.gpu.graphs import RegionGraphs
from engine.ops.gpu.linear import LinearOps
from engine.ops.gpu.moe import MoeOps
from engine.ops.gpu.norms import HC_COUNTERS, NormOps
from engine.ops.gpu.pinned import PinnedUploader
from engine.ops.gpu.weights import GpuWeight, WeightOps
from engine.settings import Settings

__all__ = ["CupyOps", "GpuWeight", "use_direct_alloc"]

# copy_rows: larger copies (a state buffer's growth) go through cudaMemcpyAsync; a whole DSpark window
# (128 rows of 512 floats: DSpark.absorb moves one per sequence and draft layer) still goes in the table
COPY_ROWS_MAX = 256 << 10


def use_direct_alloc() -> None:
    """Every device array from now on its own cudaMalloc instead of a slice of CuPy's pool, process-wide
    (Settings.direct_alloc): compute-sanitizer then knows each array's exact bounds (inside a pool chunk
    an overrun lands in pooled memory, where memcheck cannot see it). For `make gpu-memcheck`; slower,
    never for serving."""
    cp.cuda.set_allocator(None)


@joins_inputs
class CupyOps(Forks, WeightOps, LinearOps, NormOps, MoeOps, AttentionOps):
    """The ops of engine/ops/protocol.py; arrays are CuPy float32 on the current device."""

    name = "cupy"
    numerics = "exact"  # (engine/ops/gpu/deepseek.py: DeepseekCupyOps)
    # the kernels round what they store to bf16 where DeepSeek's reference stores bf16 (its norms,
    # RoPE, mHC, pooling, attention and indexer outputs, sparse_attn's rounding points): DeepseekCupyOps
    bf16 = False
    xp = cp
    comm = None  # the tensor-parallel ranks' collectives (engine/parallel/); None: one rank

    def __init__(self, settings: Settings | None = None) -> None:
        """settings: the run-time knobs (default: Settings.from_env(), read from the environment)."""
        settings = Settings.from_env() if settings is None else settings
        if settings.direct_alloc:
            use_direct_alloc()
        self._init_forks()
        self._uploader = PinnedUploader()
        self.graphs = RegionGraphs(settings.cuda_graphs, settings.graph_buckets, upload=self._uploader.upload)
        self.device = cp.cuda.Device().id  # the device this backend's arrays live on
        self.placement = f"cupy:{self.device}"
        # caches of device tables, made once (eagerly: a captured step finds them made)
        self._tables: dict[int, tuple] = {}  # moe: id(expert list) -> (list, pointer tables)
        self._seg_cache: dict[tuple, cp.ndarray] = {}  # linear: segment tables
        self._group_ptrs: dict[tuple[int, int], tuple] = {}  # grouped_linear: (weight, groups) -> pointers
        self._pair_ptrs: dict[tuple[int, int], tuple] = {}  # swiglu_mlp: (w1, w3) -> one pointer table
        self._seg_offsets: dict[tuple, cp.ndarray] = {}  # moe: fused gate / up, w3's segment offsets
        self._rows_of_mask: tuple | None = None  # attend_decode: (mask, k, its row lists), the last
        self._no_scale = cp.zeros(1, F32)  # embed: the scale argument of unscaled tables
        self._hc_count = cp.zeros(HC_COUNTERS, dtype=cp.int32)  # hc_mix's block counters (each resets its own)
        self._argmax_count = cp.zeros(cupy_sampling.ARGMAX_ROWS, dtype=cp.int32)  # add_argmax's, likewise

    # ---- arrays ----------------------------------------------------------------------
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
        costs more host time per call than the copies themselves."""
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

    def act(self, x: cp.ndarray) -> cp.ndarray:
        """An activation as stored between ops: float32 here (exact numerics); DeepseekCupyOps
        rounds it to bf16."""
        return x

    def to_host(self, x) -> np.ndarray:
        return cp.asnumpy(x) if isinstance(x, cp.ndarray) else np.asarray(x)

    def sample_rows(self, logits: cp.ndarray, jobs: list, ahead=None) -> list:
        """One token per engine.runtime.sampling.SampleJob, drawn on the device (sampling.py); ahead():
        host work done while the device finishes, before the tokens are read back."""
        return cupy_sampling.sample_rows(self.asarray(logits), jobs,
                                         upload=lambda table: self.asarray(table, dtype=np.int32), ahead=ahead)

    def add_argmax(self, x: cp.ndarray, bias: cp.ndarray | None, out: cp.ndarray) -> cp.ndarray:
        """x += bias in place, out = x's argmax per row, in one launch (sampling.py). Its block
        counters are one buffer of this backend: draft positions run one after another on the
        current stream, never forked."""
        return cupy_sampling.add_argmax(x, bias, out, self._argmax_count)

    def draw_drafts(self, logits: cp.ndarray, rows, temperatures, uniforms) -> tuple[cp.ndarray, cp.ndarray]:
        """One position of a draft block, drawn on the device (spec_sampling.py)."""
        return cupy_spec.draw_drafts(logits, rows, temperatures, uniforms, upload=self._upload32)

    def verify_rows(self, logits: cp.ndarray, jobs: list) -> list:
        """Speculative verify of free sequences on the device (spec_sampling.py): verdicts only come back."""
        return cupy_spec.verify_rows(self.asarray(logits), jobs, upload=self._upload32)

    def _upload32(self, table: np.ndarray) -> cp.ndarray:
        return self.asarray(table, dtype=np.int32)

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
            copy_table(tab, lambda a: self.asarray(a, dtype=np.int64), 8)

    # ---- collectives -----------------------------------------------------------------
    def all_reduce(self, x: cp.ndarray) -> cp.ndarray:
        """The ranks' parts summed (one rank: x)."""
        return x if self.comm is None else self.comm.all_reduce(x)

    def all_gather(self, x: cp.ndarray) -> cp.ndarray:
        """The ranks' parts joined (one rank: x)."""
        return x if self.comm is None else self.comm.all_gather(x)

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
        """A step's tables packed on the host ahead of the step (ModelRunner.prepare_next: its token ids
        and Engram hash ids are placeholders, filled in by graphed_step), with its signature."""
        return (*cupy_staging.pack(inputs), inputs.signature())

    def graphed_step(self, key, inputs, run, rows: int, pre=None):
        """run(staged inputs) as one CUDA graph per (key, launch signature): a whole decode step
        replays with one upload of its tables and one graph launch (graphs.py: eagerly the first
        time, captured the second). pre: prestage(inputs as they were but for the token fields),
        their ids and hash ids written in before the upload. Every fork run opened is joined at
        its end."""
        if pre is None:
            i64, f32, layout = self._upload(inputs)
            sig = inputs.signature()
        else:
            i64, f32, layout, sig = pre
            cupy_staging.fill(i64, layout, "ids", inputs.ids)
            if inputs.hash_ids is not None:
                cupy_staging.fill(i64, layout, "hash_ids", inputs.hash_ids)
            i64, f32 = self.asarray(i64, dtype=np.int64), self.asarray(f32)

        def joined(a, b):  # (a capture must join every stream it forked)
            try:
                out = run(layout.views(a, b))
                self.join_all()
                return out
            except BaseException:
                self._drop_forks()
                raise

        return self.graphs((key, sig), joined, i64, f32, rows=rows)
