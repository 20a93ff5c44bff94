"""The developer tools' GPU kernels against numpy (skipped where there is no GPU)."""

from __future__ import annotations

from gpu_required import require_gpu

cp = require_gpu()


def test_stream_chain_both_ways_match_numpy():
    """tools/stream_chain.py: a small two-layer chain of dependent FP8 GEMVs, as one persistent
    launch (items waiting on their input's counter, weights prefetched ahead) and as one launch per
    GEMV, equals numpy's products within 1e-4, with no dependency wait timing out."""
    from tools import stream_chain

    assert stream_chain.check()
