"""The check for a GEMM on FP8 tensor cores, shared by the FP8 GEMM tests.

Hopper's FP8 MMA adds the 32 products of a k32 step in a fixed-point accumulator aligned to the
largest of them and keeps about 14 bits (DeepSeek-V3 technical report, section 3.3.2, which is why
DeepGEMM and our kernels promote every k32 step to f32). So an output is exact only to about 2^-14
of the sum of its products' magnitudes, not of its own value, which cancellation can make far
smaller: the bound is per element against |xq| @ |w|^T. A wrong scale, code or row is off by O(1)
of that sum and still fails.
"""

from __future__ import annotations

import numpy as np

FP8_MMA_TOL = 2.0 ** -10  # of sum_k |x_k w_k|: the MMA's ~2^-14 per step with room for the f32 sums


def assert_fp8_mma_close(y: np.ndarray, want: np.ndarray, magnitude: np.ndarray) -> None:
    """y from the GPU, want = xq @ w^T and magnitude = |xq| @ |w|^T in float64."""
    assert np.isfinite(y).all(), "a non-finite output"
    err = np.abs(y - want) / np.maximum(magnitude, 1e-30)
    assert float(err.max()) < FP8_MMA_TOL, f"worst error {err.max():.2e} of the products' magnitude"
