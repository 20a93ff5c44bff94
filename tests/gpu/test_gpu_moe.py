"""CupyOps' routing, SwiGLU experts, MoE grouping and forks against the numpy reference; tolerances
in gpu_cases.py. Skipped where CuPy or a GPU is absent (CI)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_cases import F32_TOL, GEMM_TOL, GPU, REF, RNG, cp, make_weight, rel, rnd

from engine.checkpoint.reader import Weight
from engine.ops import kernels as K
from engine.ops.gpu.ops import CupyOps


# ---- MoE -------------------------------------------------------------------------------------
@pytest.mark.parametrize("scoring,bias,hashed", [("sqrtsoftplus", True, False), ("softmax", False, False),
                                                 ("sigmoid", True, False), ("sqrtsoftplus", False, True)])
def test_route(scoring, bias, hashed):
    """The exact comparison routes 8 tokens (one block), the other 33 (a partial last block)."""
    m = 8
    t, e, k, d = 33, 384, 6, 5120
    x = rnd(t, d)
    gw = make_weight("bf16", e, d)
    b = rnd(e, scale=0.1) if bias else None
    hid = RNG.integers(0, e, size=(t, k)) if hashed else None
    rw, ri = REF.route(x, REF.prepare(gw), b, k, scoring, 1.0, 1.5, True, hid)
    # route the reference's own logits too, so ids compare exactly (the GEMM rounds to bf16)
    gw32 = Weight("w", REF.prepare(gw), "f32", shape=(e, d))
    gwt, git = GPU.route(cp.asarray(x[:m]), GPU.prepare(gw32), None if b is None else cp.asarray(b), k, scoring,
                         1.0, 1.5, True, None if hid is None else hid[:m])
    assert np.array_equal(cp.asnumpy(git), ri[:m])
    assert rel(gwt, rw[:m]) < 1e-5
    gw_, gi_ = GPU.route(cp.asarray(x), GPU.prepare(gw), None if b is None else cp.asarray(b), k, scoring, 1.0,
                         1.5, True, hid)
    assert (cp.asnumpy(gi_) == ri).mean() > 0.99


def test_route_ties_pick_lower_ids():
    """Experts with equal biased scores (repeated router rows) are picked lowest id first, as the
    reference's stable argsort does; 384 experts and 200 (a partial last register) per token."""
    for e in (384, 200):
        t, k, d = 5, 6, 64
        rows = rnd(7, d, scale=0.3)
        gw = Weight("w", rows[np.arange(e) % 7], "f32", shape=(e, d))
        x = rnd(t, d)
        for b in (None, np.repeat(rnd(1), e).astype(np.float32)):
            rw, ri = REF.route(x, REF.prepare(gw), b, k, "sqrtsoftplus", 1.0, 1.5, True)
            gwt, git = GPU.route(cp.asarray(x), GPU.prepare(gw), None if b is None else cp.asarray(b), k,
                                 "sqrtsoftplus", 1.0, 1.5, True)
            assert np.array_equal(cp.asnumpy(git), ri)
            assert rel(gwt, rw) < 1e-5


def test_swiglu_mlp():
    d, inter = 5120, 2304
    w1, w2, w3 = (make_weight("fp8", *s) for s in ((inter, d), (d, inter), (inter, d)))
    for t in (1, 20, 64):  # (gate and up as one launch: gemvx, tensor-core GEMV, GEMM)
        x = rnd(t, d)
        ref = REF.swiglu_mlp(x, *(REF.prepare(w) for w in (w1, w2, w3)), 10.0)
        got = GPU.swiglu_mlp(cp.asarray(x), *(GPU.prepare(w) for w in (w1, w2, w3)), 10.0)
        assert rel(got, ref) < (F32_TOL if t <= 32 else GEMM_TOL)


def _moe_case(t: int, e: int, k: int, d: int, inter: int, shared: bool = False) -> tuple:
    """(reference, GPU result, the most pairs one expert got) of t tokens through e FP4 experts;
    shared: plus a random addend, the shared expert's output."""
    ws = [tuple(make_weight("fp4", *s) for s in ((inter, d), (d, inter), (inter, d))) for _ in range(e)]
    x = rnd(t, d)
    ids = np.stack([RNG.permutation(e)[:k] for _ in range(t)])
    wts = RNG.random((t, k), dtype=np.float32)
    add = rnd(t, d) if shared else None
    ref = REF.moe(x, [tuple(REF.prepare(w) for w in ex) for ex in ws], wts, ids, 10.0)
    if shared:
        ref = ref + add
    got = GPU.moe(cp.asarray(x), [tuple(GPU.prepare(w) for w in ex) for ex in ws], cp.asarray(wts),
                  cp.asarray(ids), 10.0, cp.asarray(add) if shared else None)
    return ref, got, np.bincount(ids.ravel()).max()


@pytest.mark.parametrize("t", [1, 3, 64])
def test_moe(t):
    ref, got, most = _moe_case(t, 12, 6, 5120, 2304)
    assert rel(got, ref) < (F32_TOL if most <= 8 else GEMM_TOL)


@pytest.mark.parametrize("t", [1, 5])
def test_moe_plus_shared(t):
    """moe() with the shared expert's output, summed after the combine."""
    ref, got, _ = _moe_case(t, 8, 6, 1024, 512, shared=True)
    assert rel(got, ref) < F32_TOL


def test_fork_matches_inline(monkeypatch):
    """CupyOps.fork: the shared expert forked onto the side stream beside the routed experts (as a
    captured decode step forks it) equals both run inline, bit for bit, replayed as a CUDA graph (the
    fork and its join become graph edges; eagerly the fork runs inline); the fork's input is a
    temporary the caller drops at once; moe() joins it after the routed experts' launches; a fork
    whose output nothing reads is joined by join_all."""
    from engine.ops.gpu.graphs import RegionGraphs

    e, k, d, inter = 8, 6, 5120, 2304
    shared = tuple(GPU.prepare(make_weight("fp8", *s)) for s in ((inter, d), (d, inter), (inter, d)))
    experts = [tuple(GPU.prepare(make_weight("fp4", *s)) for s in ((inter, d), (d, inter), (inter, d)))
               for _ in range(e)]
    x = cp.asarray(rnd(1, d))
    ids = cp.asarray(RNG.permutation(e)[:k].reshape(1, k))
    wts = cp.asarray(RNG.random((1, k), dtype=np.float32))

    def inline(a):
        return GPU.moe(a, experts, wts, ids, 10.0) + GPU.swiglu_mlp(a, *shared, 10.0)

    def forked(a):
        b = GPU.fork(GPU.swiglu_mlp, a * 1.0, *shared, 10.0)
        y = GPU.moe(a, experts, wts, ids, 10.0, b)
        GPU.fork(GPU.rmsnorm, a * 2.0, None, 1e-6)  # (read by nothing)
        GPU.join_all()
        assert not GPU._open and not GPU._pending
        return y

    ref = cp.asnumpy(inline(x))
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    assert np.array_equal(cp.asnumpy(forked(x)), ref)
    monkeypatch.setattr(GPU, "_side_stream", None)  # (made on first use: by this capture, below)
    graphs = RegionGraphs(enabled=True)
    for _ in range(4):  # eager, capture, then replays
        assert np.array_equal(cp.asnumpy(graphs("fork", forked, x)), ref)
    assert graphs.captures == 1 and graphs.replays >= 2
    assert GPU._side_stream is not None  # the capture forked


def test_fork_outputs_join_at_the_ops_that_read_them():
    """A forked output passed to an op (also inside a list, or as a view) joins its fork there, and
    only its own: the other fork stays open until join_all. Captured and replayed, the results equal
    the same ops run inline."""
    from engine.ops.gpu.graphs import RegionGraphs

    w = GPU.prepare(make_weight("bf16", 512, 1024))
    x = cp.asarray(rnd(4, 1024))
    opened = []  # the forks open after the first op that read a forked output, per call

    def inline(a):
        n = GPU.rmsnorm(a * 1.0, None, 1e-6)
        m = GPU.rmsnorm(a * 2.0, None, 1e-6)
        return GPU.linear(n[:2], w), GPU.cat([m, n], 0)

    def forked(a):
        n = GPU.fork(GPU.rmsnorm, a * 1.0, None, 1e-6)
        m, none = GPU.fork(lambda v: (GPU.rmsnorm(v, None, 1e-6), None), a * 2.0)
        assert none is None
        y = GPU.linear(n[:2], w)  # (a view of n: joins n's fork)
        opened.append(len(GPU._open))
        z = GPU.cat([m, n], 0)  # (inside a list: joins m's)
        assert not GPU._open
        GPU.join_all()
        return y, z

    ref = [cp.asnumpy(a) for a in inline(x)]
    graphs = RegionGraphs(enabled=True)
    for _ in range(3):  # eager, capture, replay
        got = graphs("fork-join", forked, x)
        assert all(np.array_equal(cp.asnumpy(g), r) for g, r in zip(got, ref, strict=True))
    assert opened == [0, 1]  # (eagerly the forks ran inline; captured, m's stayed open past the linear)


# MoE with the pairs grouped on the device (GEMV segments: moe.gemv_grouping): narrow fp4 experts,
# so that hundreds of them stay cheap to build. At these widths the GEMV never splits K (too few
# chunks), so the device and host paths launch the same per-row arithmetic.
MOE_D, MOE_INTER, MOE_K = 512, 256, 6
_MOE_POOL: list = []  # (stored Weights, GpuWeights) per expert, built on demand


def _moe_experts(e: int) -> tuple[list, list]:
    while len(_MOE_POOL) < e:
        ws = tuple(make_weight("fp4", *s) for s in ((MOE_INTER, MOE_D), (MOE_D, MOE_INTER), (MOE_INTER, MOE_D)))
        _MOE_POOL.append((ws, tuple(GPU.prepare(w) for w in ws)))
    return [p[0] for p in _MOE_POOL[:e]], [p[1] for p in _MOE_POOL[:e]]


def _moe_route(t: int, e: int, max_count: int | None = None, min_max: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Distinct experts per token (as routing gives), optionally at most max_count pairs an expert
    and at least one expert with min_max pairs."""
    for _ in range(1000):
        ids = np.stack([RNG.permutation(e)[:MOE_K] for _ in range(t)])
        most = np.bincount(ids.ravel()).max()
        if (max_count is None or most <= max_count) and most >= min_max:
            return ids, RNG.random((t, MOE_K), dtype=np.float32)
    raise AssertionError("no routing within max_count")


def _no_host(self, x):
    raise AssertionError("the device MoE path copied to the host")


def _host_grouping(monkeypatch) -> None:
    """moe() groups the pairs on the host (its path for more experts than moe_group_large takes)."""
    monkeypatch.setattr("engine.ops.gpu.moe.MOE_DEVICE_MAX_PAIRS", 0)
    monkeypatch.setattr("engine.ops.gpu.moe.MOE_GROUP_LARGE_MAXE", 0)


# (200 x 6 pairs over 384 experts: past MOE_DEVICE_MAX_PAIRS, but ~3 an expert, as a verify step of
# 32 sequences: still GEMV segments, grouped by moe_group_large)
@pytest.mark.parametrize("t,e", [(1, 64), (3, 384), (8, 256), (32, 128), (100, 64), (100, 384), (200, 384)])
def test_moe_device(t, e, monkeypatch):
    ws, gws = _moe_experts(e)
    x = rnd(t, MOE_D)
    ids, wts = _moe_route(t, e)
    used = set(ids.ravel().tolist())
    ref_ex = [tuple(REF.prepare(w) for w in ex) if i in used else None for i, ex in enumerate(ws)]
    ref = REF.moe(x, ref_ex, wts, ids, 10.0)
    monkeypatch.setattr(CupyOps, "to_host", _no_host)
    got = GPU.moe(cp.asarray(x), gws, cp.asarray(wts), cp.asarray(ids), 10.0)
    assert rel(got, ref) < F32_TOL  # GEMV at every T: segments of <= 8 rows


@pytest.mark.parametrize("t,e", [(1, 64), (4, 64), (8, 384), (32, 384)])
def test_moe_device_matches_host(t, e, monkeypatch):
    _, gws = _moe_experts(e)
    x = cp.asarray(rnd(t, MOE_D))
    # the host path stays on the GEMV too, and on the same kernel as the device path's segments of
    # min(8, t) rows: one row at t = 1, else the multi-row tensor-core GEMV (an expert with 2 pairs)
    ids, wts = _moe_route(t, e, max_count=8, min_max=min(t, 2))
    ids, wts = cp.asarray(ids), cp.asarray(wts)
    dev = cp.asnumpy(GPU.moe(x, gws, wts, ids, 10.0))
    _host_grouping(monkeypatch)
    host = cp.asnumpy(GPU.moe(x, gws, wts, ids, 10.0))
    assert np.array_equal(dev, host)


@pytest.mark.parametrize("job", [0, 1, 2])
def test_scatter_rows(job):
    """B rows into state rows at staged addresses (0: none): float4 rows, a column slice read in
    place, and an odd width moved a float at a time."""
    b, width = 5, (512, 256, 130)[job]
    wide = cp.asarray(rnd(b, 256 + 64))
    src = [cp.asarray(rnd(b, 512)), wide[:, 64:], cp.asarray(rnd(b, 130))][job]
    buf = cp.asarray(rnd(9, width))
    rows = RNG.permutation(9)[:b]
    want = cp.asnumpy(buf)
    addr = np.array([buf.data.ptr + int(i) * width * 4 for i in rows], np.int64)
    addr[job % b] = 0  # (that row is skipped)
    for k, i in enumerate(rows):
        if k != job % b:
            want[i] = cp.asnumpy(src[k])
    GPU.scatter_rows(src, cp.asarray(addr))
    assert np.array_equal(cp.asnumpy(buf), want)


def _group_ref(ids: np.ndarray, e: int, step: int, maxseg: int):
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    es = flat[order]
    starts = np.flatnonzero(np.r_[True, es[1:] != es[:-1]])
    counts = np.diff(np.r_[starts, order.size])
    segs = [(int(es[s0]), int(s0) + r, int(min(step, c - r)), 0, 0)
            for s0, c in zip(starts, counts, strict=True) for r in range(0, int(c), step)]
    assert len(segs) <= maxseg
    tab = np.zeros((maxseg, 5), np.int32)
    tab[:len(segs)] = segs
    return order, inv, order // ids.shape[1], tab.reshape(-1)


def _check_group_launch(name: str, ids: np.ndarray, e: int, step: int, smem: int = 0) -> None:
    """The grouping kernel itself, into poisoned buffers with maxseg = P (the tail must come back
    zeroed): the stable argsort's order, inverse, tokens and segments exactly."""
    p = ids.size
    buf = cp.full(8 * p, -1, cp.int32)
    segs, order, inv, gather = buf[:5 * p], buf[5 * p:6 * p], buf[6 * p:7 * p], buf[7 * p:]
    fn = K.function_with_smem("moe", name, smem) if smem else K.function("moe", name)
    fn((1,), (1024,), (cp.asarray(ids), np.int32(p), np.int32(ids.shape[1]), np.int32(e), np.int32(step),
                          np.int32(p), np.int32(0), order, inv, gather, segs), shared_mem=smem)
    for got, ref in zip((order, inv, gather, segs), _group_ref(ids, e, step, p), strict=True):
        assert np.array_equal(cp.asnumpy(got), ref)


def _check_group_helper(ids: np.ndarray, e: int, step: int) -> None:
    """Through the helper moe() uses: its tighter maxseg still holds every segment, plain and doubled
    for gate and up in one launch (the second half w3's: experts e.., y column 77)."""
    ms = CupyOps._moe_max_segments(ids.size, e, step)
    ref = _group_ref(ids, e, step, ms)
    got = GPU._moe_group(cp.asarray(ids), e, step)
    assert got[0].size == 5 * ms
    for g, r in zip(got, (ref[3], ref[2], ref[1], ref[0]), strict=True):
        assert np.array_equal(cp.asnumpy(g), r)
    segs2 = cp.asnumpy(GPU._moe_group(cp.asarray(ids), e, step, 77)[0]).reshape(2, ms, 5)
    assert np.array_equal(segs2[0], ref[3].reshape(ms, 5))
    used = segs2[0][:, 2] > 0
    assert np.array_equal(segs2[1][used], segs2[0][used] + np.array([e, 0, 0, 0, 77]))
    assert not segs2[1][~used].any()


@pytest.mark.parametrize("t,k,e,step", [(1, 1, 8, 1), (1, 6, 256, 1), (3, 6, 64, 3), (100, 6, 8, 8),
                                        (170, 6, 384, 8), (128, 8, 256, 8), (1024, 1, 3, 8), (33, 5, 40, 8)])
def test_moe_group_kernel(t, k, e, step):
    ids = RNG.integers(0, e, (t, k))  # repeats across and within tokens
    _check_group_launch("moe_group", ids, e, step)
    _check_group_helper(ids, e, step)


@pytest.mark.parametrize("t,k,e,step", [(200, 6, 384, 64), (4096, 6, 384, 64), (1500, 1, 3, 8), (333, 8, 1024, 64),
                                        (171, 6, 40, 5), (1025, 1, 1, 64)])
def test_moe_group_large_kernel(t, k, e, step):
    """moe_group_large (above 1024 pairs): moe_group's outputs exactly, stable by pair."""
    ids = RNG.integers(0, e, (t, k))
    _check_group_launch("moe_group_large", ids, e, step, smem=32 * e * 4)
    _check_group_helper(ids, e, step)


@pytest.mark.parametrize("t,e,most", [(400, 16, 65), (700, 64, 65), (700, 384, 9)])
def test_moe_device_large(t, e, most, monkeypatch):
    """A prompt chunk's MoE grouped on the device (moe_group_large, no copy to the host) equals the
    numpy reference; where an expert has more than 64 pairs the host-grouped path launches the same
    64-row GEMM segments, and the two agree bit for bit (with fewer, the host path picks the
    tensor-core GEMV for its largest count and the two differ by rounding only)."""
    ws, gws = _moe_experts(e)
    x = rnd(t, MOE_D)
    ids, wts = _moe_route(t, e, min_max=most)
    used = set(ids.ravel().tolist())
    ref = REF.moe(x, [tuple(REF.prepare(w) for w in ex) if i in used else None for i, ex in enumerate(ws)],
                  wts, ids, 10.0)
    with monkeypatch.context() as m:
        m.setattr(CupyOps, "to_host", _no_host)
        dev = cp.asnumpy(GPU.moe(cp.asarray(x), gws, cp.asarray(wts), cp.asarray(ids), 10.0))
    assert rel(dev, ref) < GEMM_TOL
    _host_grouping(monkeypatch)
    host = cp.asnumpy(GPU.moe(cp.asarray(x), gws, cp.asarray(wts), cp.asarray(ids), 10.0))
    assert np.array_equal(dev, host) if most > 64 else rel(host, ref) < GEMM_TOL


def test_moe_cuda_graph():
    t, e = 4, 64
    _, gws = _moe_experts(e)
    (ids1, w1), (ids2, w2) = _moe_route(t, e), _moe_route(t, e)
    x1, x2 = rnd(t, MOE_D), rnd(t, MOE_D)
    s = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()  # the graph's intermediates: no eager array may land there
    with s:
        xb, ib, wb = cp.asarray(x1), cp.asarray(ids1), cp.asarray(w1)
        x2d, i2d, w2d = cp.asarray(x2), cp.asarray(ids2), cp.asarray(w2)
        ref1 = cp.asnumpy(GPU.moe(xb, gws, wb, ib, 10.0))  # warm: compiles, builds the tables
        ref2 = cp.asnumpy(GPU.moe(x2d, gws, w2d, i2d, 10.0))
        with cp.cuda.using_allocator(pool.malloc):
            s.begin_capture()
            y = GPU.moe(xb, gws, wb, ib, 10.0)
            g = s.end_capture()
        y.fill(0)
        g.launch(s)
        s.synchronize()
        assert np.array_equal(cp.asnumpy(y), ref1)
        xb[...], ib[...], wb[...] = x2d, i2d, w2d  # new inputs and routing, same graph
        g.launch(s)
        s.synchronize()
        assert np.array_equal(cp.asnumpy(y), ref2)


def test_gemm_tc_moe():
    """The routed experts' grouped GEMMs (segments from the device-built table) on gemm_tc."""
    ref, got, most = _moe_case(150, 6, 4, 1024, 512)
    assert most > 32 and rel(got, ref) < F32_TOL  # (segments past 32 rows: the GEMM, not a GEMV)
