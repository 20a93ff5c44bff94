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


def test_bench_variants_in_one_process(tmp_path, capsys):
    """`dsuf.py bench --variants`: the default's decode table, then each variant's under its header,
    its graphs captured anew (RegionGraphs.release), and the switches restored after the run."""
    from engine.backends import cupy_ops
    from engine.bench import bench_model, parse_variants
    from engine.tiny_model import write_tiny_model

    ckpt = write_tiny_model(tmp_path / "tiny", "v41", seed=3)
    variants = parse_variants("DSUF_FUSED_EXPAND=1,DSUF_ROUTE_GROUP=1 DSUF_SIDE=0")
    before = (cupy_ops.FUSED_EXPAND, cupy_ops.ROUTE_GROUP, cupy_ops.SIDE_BRANCHES)
    bench_model(str(ckpt), 1e12, batches=(1, 2), prefills=(), steps=2, variants=variants)
    out = capsys.readouterr().out
    assert "== DSUF_FUSED_EXPAND=1,DSUF_ROUTE_GROUP=1" in out and "== DSUF_SIDE=0" in out
    rows = [line for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rows) == 6, out  # (batches 1 and 2, three times)
    assert (cupy_ops.FUSED_EXPAND, cupy_ops.ROUTE_GROUP, cupy_ops.SIDE_BRANCHES) == before
