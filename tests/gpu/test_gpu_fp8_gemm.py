"""kernels/fp8_gemm.cu against the numpy backend in DeepSeek's numerics: act_quant_fp8 bit for
bit with NumpyOps.fake_quant_fp8 (codes times scales), and the GEMM (FP8 and FP4 weights) against
the product of the fake-quantized activations and the dequantized weight, within the FP8 MMA's
accumulation precision (fp8_mma.py: the tensor core sums each 32-wide step in ~14 bits, the kernel
adds the scaled steps in f32).
Prints the GEMM's TFLOP/s on 4096-row chunks of V4.1-Flash's largest FP8 linears.
On sm_90a this tests the wgmma kernel (128 x 128 tiles, a ring of 128-byte K stages): the shapes
below also cover K = 64 (half a stage), K % 128 == 64 (a tail stage), rings that wrap, M and N
between tile sizes, and FP8 weights whose 128 x 128 blocks give a tile one scale per step.
Skipped where CuPy or a GPU is absent (CI).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_required import require_gpu

cp = require_gpu()

from fp8_mma import assert_fp8_mma_close  # noqa: E402

from engine.bench import _timeit, _weight  # noqa: E402
from engine.checkpoint import formats  # noqa: E402
from engine.ops.gpu.fp8_linear import act_quant_fp8, fp8_linear  # noqa: E402
from engine.ops.gpu.weights import GpuWeight, _host_dequant  # noqa: E402
from engine.ops.kernels import FMT_FP4, FMT_FP8  # noqa: E402
from engine.ops.numpy_ops import NumpyOps  # noqa: E402


def _x(m: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-12, 6, (m, 1)))).astype(np.float32)
    x[:, : min(k, 32)] *= np.float32(1e-7)  # a block under the 1e-4 floor of amax
    if m > 2:
        x[1] = 0.0
    return x


@pytest.mark.parametrize("m,k", [(1, 64), (5, 2304), (77, 5120)])
def test_act_quant_matches_fake_quant(m, k):
    x = _x(m, k, seed=m)
    codes, scales = act_quant_fp8(cp.asarray(x))
    got = formats.fp8_e4m3_to_f32(cp.asnumpy(codes)).reshape(m, k // 32, 32) * cp.asnumpy(scales)[:, :, None]
    want = NumpyOps().fake_quant_fp8(x, 32)
    np.testing.assert_array_equal(got.reshape(m, k), want)


@pytest.mark.parametrize("m,k", [(5, 2304), (77, 5120)])
def test_act_quant_rounds_to_bf16_first(m, k):
    """bf16=True: the codes and scales of x rounded to bf16, bit for bit, from one pass."""
    x = _x(m, k, seed=m + 1)
    got = act_quant_fp8(cp.asarray(x), bf16=True)
    want = act_quant_fp8(cp.asarray(formats.round_bf16(x)))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(cp.asnumpy(g), cp.asnumpy(w))


def _fp8_weight(n: int, k: int, block: tuple[int, int]) -> GpuWeight:
    """Random e4m3 codes (NaN codes masked out) with varied f32 scales per (bn x bk) block."""
    rng = np.random.default_rng(n + k)
    data = (rng.integers(0, 256, (n, k)) & 0xF7).astype(np.uint8)
    scale = (2.0 ** rng.uniform(-10, -5, (-(-n // block[0]), -(-k // block[1])))).astype(np.float32)
    return GpuWeight(FMT_FP8, cp.asarray(data), cp.asarray(scale), (n, k), block)


def _fp4_weight(n: int, k: int, lo: int, hi: int) -> GpuWeight:
    """Random e2m1 nibbles with UE8M0 exponents drawn from [lo, hi)."""
    rng = np.random.default_rng(n + k)
    data = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    scale = rng.integers(lo, hi, (n, k // 32)).astype(np.uint8)
    return GpuWeight(FMT_FP4, cp.asarray(data), cp.asarray(scale), (n, k), (1, 32))


def _check(x: np.ndarray, w) -> None:
    y = cp.asnumpy(fp8_linear(cp.asarray(x), w))
    xq = NumpyOps().fake_quant_fp8(x, 32).astype(np.float64)
    wd = _host_dequant(w).astype(np.float64)
    assert_fp8_mma_close(y, xq @ wd.T, np.abs(xq) @ np.abs(wd).T)


SHAPES = [(1, 64, 64), (77, 200, 1280), (130, 520, 2304), (64, 5120, 8192),
          # the sm_90a ring: half a stage, a tail stage, rings that wrap, M and N between tiles
          (200, 128, 64), (129, 130, 192), (257, 300, 1024), (1, 1000, 896), (255, 129, 4160)]


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_gemm_matches_numpy(m, n, k, fmt):
    _check(_x(m, k, seed=n), _weight(fmt, n, k))


@pytest.mark.parametrize("block", [(128, 128), (64, 128)])
@pytest.mark.parametrize("m,n,k", [(130, 520, 2304), (257, 300, 1024), (3, 130, 192)])
def test_fp8_gemm_block_scales(m, n, k, block):
    """Checkpoint-sized blocks (one weight scale per tile and step on sm_90a) and blocks narrower
    than the tile (a scale per column)."""
    _check(_x(m, k, seed=k), _fp8_weight(n, k, block))


@pytest.mark.parametrize("exps", [(110, 135), (118, 130)])
@pytest.mark.parametrize("m,n,k", [(130, 520, 2304), (257, 300, 1024), (3, 130, 192)])
def test_fp4_gemm_scale_spreads(m, n, k, exps):
    """FP4 exponents spread over more than 12 values (a scale per column) and over at most 12 (on
    sm_90a folded into the e4m3 codes, one scale per step); _weight's are all equal."""
    _check(_x(m, k, seed=k), _fp4_weight(n, k, *exps))


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("m,n,k", [(130, 200, 320), (70, 136, 1024)])
def test_fp8_linear_bf16_in_and_out(fmt, m, n, k):
    """bf16=True (the reference's linear): the output is the f32 one of the bf16-rounded input,
    rounded to bf16 as stored, bit for bit (the same kernel sums in the same order)."""
    x = _x(m, k, seed=n)
    w = _fp8_weight(n, k, (32, 32)) if fmt == "fp8" else _fp4_weight(n, k, 110, 135)
    got = cp.asnumpy(fp8_linear(cp.asarray(x), w, bf16=True))
    want = formats.round_bf16(cp.asnumpy(fp8_linear(cp.asarray(formats.round_bf16(x)), w)))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("m,n,k", [(192, 1536, 5120), (48, 512, 4160)])
def test_fp8_gemm_split_k(m, n, k, monkeypatch):
    """A skinny launch (a verify step's rows against wq_a's shape; a K with a tail stage) split over K
    on sm_90a (wg_splits; the splits' sums added in order by bw_sum_splits): within the FP8 MMA's
    bound of the reference, as one pass over K is, and the same bits twice."""
    import engine.ops.gpu.fp8_linear as fl
    from engine.ops import kernels as K

    if K.device_arch() != "90a":
        pytest.skip("split K is the sm_90a kernel's")
    x, w = _x(m, k, seed=3), _fp8_weight(n, k, (32, 32))
    assert fl.wg_splits(-(-n // fl.WG_TILE) * -(-m // fl.WG_TILE), -(-k // fl.WG_STAGE_K)) > 1
    split = cp.asnumpy(fp8_linear(cp.asarray(x), w))
    np.testing.assert_array_equal(split, cp.asnumpy(fp8_linear(cp.asarray(x), w)))
    _check(x, w)
    monkeypatch.setattr(fl, "SPLIT_MIN_STAGES", k)
    _check(x, w)  # (one pass)


def test_fp8_gemm_rate_on_flash_linears():
    """Not a timed assertion: the figures, for docs/performance.md and bench. FP8 weights in the
    V4 checkpoints' 128 x 128 blocks and in V4.1's 32 x 32 (bench's random weights too); both take
    one weight scale per 32 columns and k32 step."""
    x = cp.asarray(_x(4096, 8192, seed=1))
    for name, (n, k), fmt in (("wq_b", (32768, 1280), "fp8"), ("wo_b", (5120, 8192), "fp8"),
                              ("wo_b", (5120, 8192), "fp8/32"), ("expert w1", (2304, 5120), "fp4"),
                              ("expert w2", (5120, 2304), "fp4")):
        w = _fp8_weight(n, k, (128, 128)) if fmt == "fp8" else _weight(fmt[:3], n, k)
        codes = act_quant_fp8(x[:, :k])
        t = _timeit(lambda w=w, codes=codes: fp8_linear(None, w, codes), iters=10)
        tq = _timeit(lambda k=k: act_quant_fp8(x[:, :k]), iters=10)
        rate = 2 * 4096 * n * k / t / 1e12
        print(f"{name} ({fmt}) [{n} x {k}] x 4096 rows: GEMM {t * 1e3:.3f} ms = {rate:.0f} TFLOP/s, "
              f"act_quant {tq * 1e3:.3f} ms")


def test_fp8_peak_rate_bounds_the_gemm():
    """bench's FP8 rate (kernels/peak.cu) is at least what the GEMM achieves on the largest FP8
    linear, and not above the vendor's dense FP8 figure for Hopper (about 1,979 TFLOP/s on an
    H100 SXM): a kernel that skipped its work would read far above it."""
    from engine.bench import fp8_rate

    rate, how = fp8_rate()
    x = cp.asarray(_x(4096, 8192, seed=1))
    w = _weight("fp8", 5120, 8192)
    codes = act_quant_fp8(x)
    gemm = 2 * 4096 * 5120 * 8192 / _timeit(lambda: fp8_linear(None, w, codes), iters=10)
    print(f"FP8 MMA rate ({how}): {rate / 1e12:.0f} TFLOP/s; wo_b GEMM at 4096 rows {gemm / 1e12:.0f} TFLOP/s")
    assert gemm <= rate <= 2.0e15
