"""CupyOps' host <-> device glue: pinned uploads, concatenation, graph release. Skipped where CuPy or
a GPU is absent (CI)."""

from __future__ import annotations

import numpy as np
from gpu_cases import GPU, RNG, cp, rnd


# ---- host <-> device glue --------------------------------------------------------------------
def test_pinned_uploads_survive_ring_wraps():
    from engine.ops.gpu.pinned import PinnedUploader

    up = PinnedUploader(8192)  # 4 KB halves: the 60 uploads below wrap many times
    host = [rnd(50 + 7 * i) for i in range(60)] + [RNG.integers(0, 9, (3, 5)), rnd(5000)]  # last: > a half
    dev = [up.upload(a) for a in host]
    cp.cuda.Device().synchronize()
    for a, d in zip(host, dev, strict=True):
        assert d.dtype == a.dtype and np.array_equal(cp.asnumpy(d), a)
    assert GPU.asarray(np.arange(5), dtype=np.int64).dtype == np.int64


def test_cat_matches_numpy():
    cases = [([rnd(127, 512), rnd(1, 512)], 0), ([rnd(0, 512), rnd(3, 512)], 0), ([rnd(1, 128), rnd(1, 40)], 1),
             ([rnd(3, 128), rnd(3, 40)], 1), ([rnd(4, 6)[:, ::2], rnd(2, 3)], 0)]  # the last two: cupy's path
    for arrays, axis in cases:
        got = GPU.cat([cp.asarray(a) if a.flags.c_contiguous else cp.asarray(a.copy())[:, :] for a in arrays], axis)
        assert np.array_equal(cp.asnumpy(got), np.concatenate(arrays, axis=axis))
    strided = cp.asarray(rnd(4, 6))[:, ::2]
    assert np.array_equal(cp.asnumpy(GPU.cat([strided, strided], 0)), np.concatenate([cp.asnumpy(strided)] * 2))


def test_region_graphs_release():
    """RegionGraphs.release drops every graph and its memory; the region runs eagerly once more,
    is captured anew and replays the same values."""
    from engine.ops.gpu.graphs import RegionGraphs

    graphs = RegionGraphs(enabled=True)
    x = cp.asarray(rnd(4, 256))

    def fn(a):
        return GPU.rmsnorm(a * 2.0, None, 1e-6)

    first = [cp.asnumpy(graphs("r", fn, x)) for _ in range(3)]
    assert graphs.captures == 1
    graphs.release()
    again = [cp.asnumpy(graphs("r", fn, x)) for _ in range(3)]
    assert graphs.captures == 2 and all(np.array_equal(a, first[-1]) for a in again)


def test_region_replay_copies_many_inputs():
    """A replay with more than BATCHED_COPIES inputs copies the 16-byte-aligned ones in one copy_rows
    launch (the rest, and an input converted for its slot, through cudaMemcpyAsync): each replay on
    fresh inputs gives what the region gives eagerly."""
    from engine.ops.gpu.graphs import BATCHED_COPIES, RegionGraphs

    graphs = RegionGraphs(enabled=True, upload=lambda a: GPU.asarray(a, dtype=a.dtype))  # (the int64 table)

    def fn(*xs):
        return sum(x.sum(axis=-1) for x in xs[:-1]) + xs[-1].sum()

    def inputs(seed: int) -> list:
        rng = np.random.default_rng(seed)
        xs = [cp.asarray(rng.standard_normal((3, 128 * (i + 1))).astype(np.float32)) for i in range(BATCHED_COPIES + 3)]
        xs.append(cp.asarray(rng.standard_normal(3).astype(np.float32)))  # 12 bytes: not on 16
        return xs

    for seed in range(4):  # eager, capture, then replays on new values
        xs = inputs(seed)
        got = cp.asnumpy(graphs("many", fn, *xs))
        assert np.allclose(got, cp.asnumpy(fn(*xs)), rtol=1e-5, atol=1e-4)
    assert graphs.captures == 1 and graphs.replays >= 2
    xs = inputs(9)
    xs[0] = cp.asfortranarray(xs[0])  # not C-contiguous: converted for its slot
    assert not xs[0].flags.c_contiguous
    assert np.allclose(cp.asnumpy(graphs("many", fn, *xs)), cp.asnumpy(fn(*xs)), rtol=1e-5, atol=1e-4)
