"""kernels/fp8_gemm.cu against the numpy backend in DeepSeek's numerics: act_quant_fp8 bit for
bit with NumpyOps.fake_quant_fp8 (codes times scales), and the GEMM (FP8 and FP4 weights) within float32 summation
order of the product of the fake-quantized activations and the dequantized weight (the products
are exact; the tensor core sums each 32-wide block, the kernel adds the scaled blocks in f32).
Prints the GEMM's TFLOP/s on 4096-row chunks of V4.1-Flash's largest FP8 linears.
Skipped where CuPy or a GPU is absent (CI).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_required import require_gpu

cp = require_gpu()

from engine.bench import _timeit, _weight  # noqa: E402
from engine.checkpoint import formats  # noqa: E402
from engine.ops.gpu.fp8_linear import act_quant_fp8, fp8_linear  # noqa: E402
from engine.ops.gpu.weights import _host_dequant  # noqa: E402
from engine.ops.numpy_ops import NumpyOps  # noqa: E402

RTOL = 1e-5  # of the largest |y|: float32 sums in another order


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


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (77, 200, 1280), (130, 520, 2304), (64, 5120, 8192)])
def test_fp8_gemm_matches_numpy(m, n, k, fmt):
    x = _x(m, k, seed=n)
    w = _weight(fmt, n, k)
    y = cp.asnumpy(fp8_linear(cp.asarray(x), w))
    xq = NumpyOps().fake_quant_fp8(x, 32).astype(np.float64)
    want = xq @ _host_dequant(w).astype(np.float64).T
    err = np.abs(y - want).max(axis=1) / np.maximum(np.abs(want).max(axis=1), 1e-30)
    assert float(err.max()) < RTOL, f"worst row error {err.max():.2e}"


def test_fp8_gemm_rate_on_flash_linears():
    """Not a timed assertion: the figures, for docs/performance.md and bench."""
    x = cp.asarray(_x(4096, 8192, seed=1))
    for name, (n, k), fmt in (("wq_b", (32768, 1280), "fp8"), ("wo_b", (5120, 8192), "fp8"),
                              ("expert w1", (2304, 5120), "fp4"), ("expert w2", (5120, 2304), "fp4")):
        w = _weight(fmt, n, k)
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
