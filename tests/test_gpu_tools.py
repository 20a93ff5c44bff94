"""The developer tools' GPU kernels against numpy (skipped where there is no GPU)."""

from __future__ import annotations

import pytest
from gpu_required import require_gpu

cp = require_gpu()


def test_stream_chain_both_ways_match_numpy():
    """tools/stream_chain.py: a small two-layer chain of dependent FP8 GEMVs, as one persistent
    launch (items waiting on their input's counter, weights prefetched ahead) and as one launch per
    GEMV, equals numpy's products within 1e-4, with no dependency wait timing out."""
    from tools import stream_chain

    assert stream_chain.check()


@pytest.mark.parametrize("fine", [False, True])
@pytest.mark.parametrize("mode", [2, 3, 4, 5])
def test_stream_chain_tensor_core_modes_match_numpy(mode, fine):
    """Its tensor-core consumers (FP8 and FP4, f16 and e4m3 MMAs) with a ring of 3 units in flight
    per warp (not a power of two: a slot mix-up shows), waiting for the whole input or (fine) per
    128-row group of it by each warp, equal numpy within CHECK_TOL both ways, no wait timing out."""
    from tools import stream_chain

    assert stream_chain.check(mode, units=3, fine=fine)
