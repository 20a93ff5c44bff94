"""CupyOps' attention, indexer and top-k kernels against the numpy reference; tolerances in
gpu_cases.py. Skipped where CuPy or a GPU is absent (CI)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_cases import GPU, REF, RNG, cp, rel, rnd

from engine.state.rows import Span


# ---- attention -------------------------------------------------------------------------------
def _mask(s, n, window, p_drop, rng):
    pos = np.arange(n - s, n)
    kpos = np.arange(n)
    vis = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - window)
    vis |= rng.random((s, n)) > p_drop  # extra "compressed" entries
    vis[:, -1] |= True
    return np.where(vis, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


@pytest.mark.parametrize("b,min_split", [(1, 64), (3, 64), (32, 64), (40, 64), (1, 16), (3, 32)])
def test_attention_decode(b, min_split, monkeypatch):
    """Batched decode attention (split over the keys, splits merged with the sinks) equals the
    reference over each sequence's visible rows: windows of different lengths (one empty), compressed
    entries under top-k masks (one selecting nothing, one sequence without entries) and long ones;
    40 sequences fill the GPU without splitting (one split writes the output directly). min_split:
    the fewest keys per split (ATT_MIN_SPLIT; 16: one tile each)."""
    monkeypatch.setattr("engine.ops.gpu.attention.ATT_MIN_SPLIT", min_split)
    h, d = 64, 512
    q, sinks = rnd(b, h, d), rnd(h)
    sources_ref, sources_gpu = [], []
    for i in range(b):
        win = rnd(0 if i == 2 else 128 if i % 5 == 1 else int(RNG.integers(1, 128)), d)
        n = [5000, 0, 700, 1][i % 4]
        srcs = [(win, None)]
        if n:
            mask = RNG.random(n) < (0.0 if i % 7 == 6 else 0.3)
            srcs.append((rnd(n, d), mask))
        sources_ref.append(srcs)
        sources_gpu.append([(cp.asarray(kv), None if m is None else cp.asarray(m)) for kv, m in srcs])
    ref = REF.attention_decode(q, sources_ref, sinks, d**-0.5)
    got = GPU.attention_decode(cp.asarray(q), sources_gpu, cp.asarray(sinks), d**-0.5)
    assert rel(got, ref) < 1e-5


def test_attention_decode_spans():
    """Sources given as Spans (rows of state buffers, read in place) and masks as rows of one
    [B, N] batch mask give the same result as the same rows passed as arrays."""
    b, h, d = 6, 64, 512
    q, sinks = rnd(b, h, d), rnd(h)
    mask = RNG.random((b, 900)) < 0.3
    mask_gpu = cp.asarray(mask)
    ref_src, span_src, gpu_src = [], [], []
    for i in range(b):
        wbuf, ebuf = rnd(200, d), rnd(1000, d)
        w0, wn, e0 = int(RNG.integers(0, 60)), int(RNG.integers(1, 128)), int(RNG.integers(0, 90))
        en = [900, 0, 17, 300, 1, 512][i]
        ref_src.append([(wbuf[w0:w0 + wn], None)] + ([(ebuf[e0:e0 + en], mask[i, :en])] if en else []))
        span_src.append([(Span(wbuf, w0, wn), None)] + ([(Span(ebuf, e0, en), Span(mask, i, en))] if en else []))
        gw, ge = cp.asarray(wbuf), cp.asarray(ebuf)
        gpu_src.append([(Span(gw, w0, wn), None)] + ([(Span(ge, e0, en), Span(mask_gpu, i, en))] if en else []))
    ref = REF.attention_decode(q, ref_src, sinks, d**-0.5)
    np.testing.assert_array_equal(REF.attention_decode(q, span_src, sinks, d**-0.5), ref)
    got = GPU.attention_decode(cp.asarray(q), gpu_src, cp.asarray(sinks), d**-0.5)
    assert rel(got, ref) < 1e-5


def test_indexer_scores_spans():
    """Each decode query against its own keys (rows of a buffer at an offset; one sequence without
    keys yet), -inf past each sequence's count; equal to the single-sequence kernel's rows."""
    h, dh = 32, 128
    counts = [700, 0, 5, 333]
    q, w = rnd(len(counts), h, dh), rnd(len(counts), h)
    bufs = [rnd(n + 50, dh) for n in counts]
    offs = [int(RNG.integers(0, 50)) for _ in counts]
    ref = REF.indexer_scores_spans(q, [Span(bf, o, n) for bf, o, n in zip(bufs, offs, counts, strict=True)], w, h, dh)
    got = GPU.indexer_scores_spans(cp.asarray(q), [Span(cp.asarray(bf), o, n) for bf, o, n in
                                                   zip(bufs, offs, counts, strict=True)], cp.asarray(w), h, dh)
    got = cp.asnumpy(got)
    assert got.shape == (4, 700)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    for i, n in enumerate(counts):
        if n:
            assert rel(got[i, :n], ref[i, :n]) < 1e-5
            assert np.isneginf(ref[i, n:]).all()


def test_copy_rows():
    """Batched row copies: many small aligned ones in one launch (up to COPY_ROWS_MAX: a whole draft
    window of 128 rows of 512 floats), unaligned widths and large ones through cudaMemcpyAsync;
    every byte lands where numpy's copies put it."""
    srcs = [rnd(300, 512), rnd(40, 3), rnd(5000, 128), rnd(130, 512)]
    dsts = [rnd(310, 512), rnd(45, 3), rnd(5100, 128), rnd(140, 512)]
    jobs = [(0, 0, 0, 5, 1), (0, 7, 0, 300, 10), (1, 0, 1, 1, 40), (2, 0, 2, 100, 5000), (0, 299, 0, 0, 1),
            (2, 17, 2, 0, 3), (0, 100, 0, 200, 64), (3, 2, 3, 11, 128)]
    ref_d = [a.copy() for a in dsts]
    gpu_d = [cp.asarray(a) for a in dsts]
    gpu_s = [cp.asarray(a) for a in srcs]
    REF.copy_rows([(srcs[a], sr, ref_d[c], dr, n) for a, sr, c, dr, n in jobs])
    GPU.copy_rows([(gpu_s[a], sr, gpu_d[c], dr, n) for a, sr, c, dr, n in jobs])
    for r, g in zip(ref_d, gpu_d, strict=True):
        np.testing.assert_array_equal(cp.asnumpy(g), r)
    with pytest.raises(ValueError):
        GPU.copy_rows([(gpu_s[0], 299, gpu_d[0], 0, 2)])  # past the source's end


def test_staged_decode_ops(monkeypatch):
    """The ops of a V4.1 decode step's device half (engine/state/decode_plan.py), from a plan staged by
    each backend (the GPU's: one upload of address tables), against the numpy reference: the new
    K=V rows scattered into each sequence's window block, closing groups pooled (one sequence
    without a closing group: a zero row), the indexer over each sequence's keys at a capacity
    width, and the attention over windows and top-k-masked entries (one sequence without entries,
    one whose entry count the mask did not score) sized for a longer capacity than any sequence has,
    split over the keys or not."""
    from engine.state.decode_plan import LayerPlan, StepInputs, WindowPlan, plan_attention

    b, h, d, dh, ratio = 5, 64, 512, 128, 2
    start = np.array([3, 0, 10, 50, 7], np.int64)
    dst = start + np.array([127, 0, 49, 127, 8])
    ns, pub = [600, 0, 37, 1, 257], [600, 0, 37, 2, 257]
    closes = [True, False, True, True, True]
    host = {"blocks": [rnd(1, 200, d) for _ in range(b)], "pend": [rnd(4, d) for _ in range(b)],
            "gate": [rnd(4, d) for _ in range(b)], "ents": [rnd(700, d) for _ in range(b)],
            "keys": [rnd(700, dh) for _ in range(b)]}

    def staged(ops, xp):
        g = {k: [xp.asarray(a) for a in v] for k, v in host.items()}
        plan = LayerPlan(
            ents_from=0, mask_from=0,
            pool_kv=[Span(g["pend"][i], 1, ratio) if closes[i] else None for i in range(b)],
            pool_gate=[Span(g["gate"][i], 1, ratio) if closes[i] else None for i in range(b)],
            entries=[Span(g["ents"][i], 20, ns[i]) for i in range(b)], pub_ns=np.array(pub, np.int64),
            keys=[Span(g["keys"][i], 30, ns[i]) for i in range(b)], keys_cap=1024)
        window = WindowPlan(g["blocks"], start, dst)
        plan_attention([plan], window)
        step = StepInputs(ids=np.arange(b, dtype=np.int64), hash_ids=None, rope=rnd(4, b, 32), layers=[plan],
                          window=window)
        return g, ops.stage(step).layers[0]

    (ref_g, sr), (gpu_g, sg) = staged(REF, np), staged(GPU, cp)
    new = rnd(b, d)
    REF.scatter_rows(new, sr.win_dst)
    GPU.scatter_rows(cp.asarray(new), sg.win_dst)
    for r, g in zip(ref_g["blocks"], gpu_g["blocks"], strict=True):
        np.testing.assert_array_equal(cp.asnumpy(g), r)
    assert all(np.array_equal(ref_g["blocks"][i][0, dst[i]], new[i]) for i in range(b))
    wide = rnd(b, d + 64)  # rows of a column slice (a stacked projection's part), read in place
    REF.scatter_rows(wide[:, 64:], sr.win_dst)
    GPU.scatter_rows(cp.asarray(wide)[:, 64:], sg.win_dst)
    for r, g in zip(ref_g["blocks"], gpu_g["blocks"], strict=True):
        np.testing.assert_array_equal(cp.asnumpy(g), r)
    assert all(np.array_equal(ref_g["blocks"][i][0, dst[i]], wide[i, 64:]) for i in range(b))
    pooled_ref = REF.gated_pool_rows(sr.pool_kv, sr.pool_gate, ratio, d)
    assert not pooled_ref[1].any()
    assert rel(GPU.gated_pool_rows(sg.pool_kv, sg.pool_gate, ratio, d), pooled_ref) < 1e-6
    q, w = rnd(b, 32, dh), rnd(b, 32)
    sc_ref = REF.indexer_scores_spans(q, sr.keys, w, 32, dh, sr.keys_cap)
    sc_gpu = cp.asnumpy(GPU.indexer_scores_spans(cp.asarray(q), sg.keys, cp.asarray(w), 32, dh, sg.keys_cap))
    assert sc_gpu.shape == sc_ref.shape == (b, 1024)
    np.testing.assert_array_equal(np.isneginf(sc_gpu), np.isneginf(sc_ref))
    fin = np.isfinite(sc_ref)
    assert rel(sc_gpu[fin], sc_ref[fin]) < 1e-5
    assert [e is not None for _, e in sr.attend] == [True, False, True, False, True]
    assert sr.mask_cap == sr.attend_cap == 1024  # (128 window rows + 600 entries, the longest)
    mask = RNG.random((b, 1024)) < 0.3
    qa, sinks = rnd(b, h, d), rnd(h)
    ref = REF.attend_decode(qa, sr.attend, mask, sinks, d**-0.5, sr.attend_cap)
    got = GPU.attend_decode(cp.asarray(qa), sg.attend, cp.asarray(mask), cp.asarray(sinks), d**-0.5, sg.attend_cap)
    assert rel(got, ref) < 1e-5
    # a top-k mask (at most 40 true a row; two past each row's entries, which count for nothing), the
    # entries read through each row's list of selected rows
    topk = np.zeros((b, 1024), bool)
    for i, n in enumerate(ns):
        topk[i, RNG.choice(n, min(n, 30), replace=False)] = True
        topk[i, RNG.choice(np.arange(n, 1024), 2, replace=False)] = True
    ref = REF.attend_decode(qa, sr.attend, topk, sinks, d**-0.5, sr.attend_cap)
    for min_split in (64, 1024):  # (7 splits merged by attention_combine; one, written directly)
        monkeypatch.setattr("engine.ops.gpu.attention.ATT_MIN_SPLIT", min_split)
        got = GPU.attend_decode(cp.asarray(qa), sg.attend, cp.asarray(topk), cp.asarray(sinks), d**-0.5,
                                sg.attend_cap, 128, 40)
        assert rel(got, ref) < 1e-5, min_split


@pytest.mark.parametrize("n_state,s,n_e,k", [(127, 300, 900, 40), (0, 70, 0, 0), (20, 200, 50, 0)])
def test_attention_ranges(n_state, s, n_e, k):
    """A prompt chunk's attention (each query: a window range of the keys, then its entries under
    its mask row, at most k true; k 0: a plain causal mask) through the decode kernel (16 heads:
    not the tensor-core kernel's), its entries through row lists where k bounds them, against the
    numpy reference."""
    h, d, win = 16, 512, 128
    keys, q, sinks = rnd(n_state + s, d), rnd(s, h, d), rnd(h)
    i = np.arange(s) + n_state
    lo, hi = np.maximum(i - (win - 1), 0), i + 1
    entries = rnd(n_e, d) if n_e else None
    emask = None
    if n_e:
        emask = np.zeros((s, n_e), bool)
        for r in range(s):
            emask[r, RNG.choice(n_e, min(n_e, k) if k else int(RNG.integers(0, n_e + 1)), replace=False)] = True
    ref = REF.attention_ranges(q, keys, lo, hi, entries, emask, sinks, d**-0.5, k)
    args = (cp.asarray(q), cp.asarray(keys), lo, hi, None if entries is None else cp.asarray(entries),
            None if emask is None else cp.asarray(emask), cp.asarray(sinks), d**-0.5, k)
    assert rel(GPU.attention_ranges(*args), ref) < 1e-5


def _on_fp8_grid(*shape) -> np.ndarray:
    """Random non-zero e4m3-representable values times powers of two: bf16-exact, like FP8 state rows."""
    mant = RNG.integers(8, 16, shape).astype(np.float32) / 8  # 1 + 3 mantissa bits
    sign = RNG.choice(np.array([-1, 1], np.float32), shape)
    return (mant * sign * np.exp2(RNG.integers(-6, 3, shape))).astype(np.float32)


@pytest.mark.parametrize("n_state,s,n_e,k", [(127, 300, 900, 40), (20, 200, 50, 0), (0, 70, 0, 0),
                                             (5, 130, 600, 512)])
def test_attention_ranges_tc(n_state, s, n_e, k):
    """The tensor-core prefill attention (64 heads): each query's window range, then its
    entries through its row list (k 40 of 900), under its mask (k 0: any number; k 512 of 600: too
    many for lists), or none; f32 keys as three bf16 terms within 1e-5 of the reference, and keys on
    codec grids as one term (exact) bit-identical to three and within 1e-5."""
    h, d, win = 64, 512, 128
    q, sinks = rnd(s, h, d), rnd(h)
    i = np.arange(s) + n_state
    lo, hi = np.maximum(i - (win - 1), 0), i + 1
    emask = None
    if n_e:
        emask = np.zeros((s, n_e), bool)
        for r in range(s):
            emask[r, RNG.choice(n_e, min(n_e, k) if k else int(RNG.integers(0, n_e + 1)), replace=False)] = True
    for grid in (False, True):
        keys = _on_fp8_grid(n_state + s, d) if grid else rnd(n_state + s, d)
        entries = (_on_fp4_grid(n_e, d) if grid else rnd(n_e, d)) if n_e else None
        ref = REF.attention_ranges(q, keys, lo, hi, entries, emask, sinks, d**-0.5, k)
        args = (cp.asarray(q), cp.asarray(keys), lo, hi, None if entries is None else cp.asarray(entries),
                None if emask is None else cp.asarray(emask), cp.asarray(sinks), d**-0.5, k)
        three = GPU.attention_ranges(*args)
        assert rel(three, ref) < 1e-5, grid
        if grid:
            one = GPU.attention_ranges(*args, exact=True)
            np.testing.assert_array_equal(cp.asnumpy(one), cp.asnumpy(three))


@pytest.mark.parametrize("b,n,k", [(1, 16384, 512), (5, 1000, 64), (3, 70, 70), (2, 300, 8)])
def test_mask_rows(b, n, k):
    """Each mask row's true positions in order, the first k of them, and how many (at most k)."""
    mask = RNG.random((b, n)) < min(1.0, 1.3 * k / n)
    rows, cnt = GPU._mask_rows(cp.asarray(mask), k)
    rows, cnt = cp.asnumpy(rows), cp.asnumpy(cnt)
    for i in range(b):
        want = np.flatnonzero(mask[i])[:k]
        assert cnt[i] == want.size and np.array_equal(rows[i, :cnt[i]], want), i


@pytest.mark.parametrize("s,n,h,dh", [(1, 2048, 32, 128), (9, 333, 64, 128), (3, 40, 16, 32), (2, 70, 40, 64),
                                     (2, 50, 64, 256)])
def test_indexer_scores(s, n, h, dh):
    """The CUDA-core kernel (fewer queries than the tensor-core path takes; h 40: heads not a
    multiple of the lanes; dh 256: over 48 KB of shared memory)."""
    q, k, w = rnd(s, h, dh), rnd(n, dh), rnd(s, h)
    ref = REF.indexer_scores(q, k, w, h, dh)
    assert rel(GPU.indexer_scores(cp.asarray(q), cp.asarray(k), cp.asarray(w), h, dh), ref) < 1e-5


def _on_fp4_grid(*shape) -> np.ndarray:
    """Random non-zero e2m1 values times powers of two: bf16-exact, like a state codec's rows."""
    mag = RNG.choice(np.array([0.5, 1, 1.5, 2, 3, 4, 6], np.float32), shape)
    sign = RNG.choice(np.array([-1, 1], np.float32), shape)
    return (mag * sign * np.exp2(RNG.integers(-4, 3, shape))).astype(np.float32)


@pytest.mark.parametrize("s,n,h,dh", [(16, 2048, 64, 128), (37, 333, 64, 128), (5, 70, 32, 64), (9, 1000, 128, 32),
                                     (300, 129, 64, 128)])
def test_indexer_scores_tc(s, n, h, dh, monkeypatch):
    """The tensor-core path (from one query on, for these small cases): f32 inputs as three bf16
    terms equal the reference to f32 precision; inputs on a codec's grid as one term (exact=True)
    equal the three-term result bit for bit (the other terms are zeros) and the reference. (s 5,
    h 32: a block of 4 queries with one query; n 129, 333: a part key tile; dh 32 and 64.)"""
    monkeypatch.setattr("engine.ops.gpu.attention.ITC_MIN_QUERIES", 1)
    q, k, w = rnd(s, h, dh), rnd(n, dh), rnd(s, h)
    ref = REF.indexer_scores(q, k, w, h, dh)
    assert rel(GPU.indexer_scores(cp.asarray(q), cp.asarray(k), cp.asarray(w), h, dh), ref) < 1e-5
    qg, kg = _on_fp4_grid(s, h, dh), _on_fp4_grid(n, dh)
    ref = REF.indexer_scores(qg, kg, w, h, dh, exact=True)
    one = GPU.indexer_scores(cp.asarray(qg), cp.asarray(kg), cp.asarray(w), h, dh, exact=True)
    three = GPU.indexer_scores(cp.asarray(qg), cp.asarray(kg), cp.asarray(w), h, dh)
    np.testing.assert_array_equal(cp.asnumpy(one), cp.asnumpy(three))
    assert rel(one, ref) < 1e-5


def test_topk_mask_ties():
    sc = rnd(6, 1000)
    sc[0, :] = 0.0  # all tied: lower index first
    sc[1, ::3] = -np.inf
    sc[2, :] = -np.inf
    sc[3, 100:200] = np.float32(-0.0)
    for k in (1, 64, 512):
        assert np.array_equal(cp.asnumpy(GPU.topk_mask(cp.asarray(sc), k)), REF.topk_mask(sc, k))


def _topk_rows(kind: str, s: int, n: int) -> np.ndarray:
    sc = rnd(s, n)
    if kind == "levels":  # many exact ties, -0.0 among them
        sc = RNG.integers(-3, 4, (s, n)).astype(np.float32)
        sc[RNG.random((s, n)) < 0.3] = np.float32(-0.0)
    elif kind == "neginf":  # most rows have fewer finite values than k
        sc[RNG.random((s, n)) < 0.97] = -np.inf
        sc[0, :] = -np.inf
    elif kind == "pins":  # +inf pinned entries ahead of everything, more pins than some k
        sc[:, RNG.choice(n, min(n, 600), replace=False)] = np.inf
        sc[:, ::5] = -np.inf
    elif kind == "zeros":  # -0.0 / +0.0 tie at the cut, and subnormals that -ftz must not flush
        sc[:, ::2] = np.float32(-0.0)
        sc[:, 1::4] = np.float32(0.0)
        sc[:, 3::8] = np.float32(1e-40)
        sc[:, 7::16] = np.float32(-1e-40)
    return sc


@pytest.mark.parametrize("kind", ["random", "levels", "neginf", "pins", "zeros"])
@pytest.mark.parametrize("s,n", [(1, 7), (3, 1000), (5, 70000), (2, 300000)])
def test_topk_mask_exact(kind, s, n):
    sc = _topk_rows(kind, s, n)
    g = cp.asarray(sc)
    for k in (1, 64, 512, 2048, n + 3):
        ref = REF.topk_mask(sc, k)
        got = cp.asnumpy(GPU.topk_mask(g, k))
        assert np.array_equal(got, ref), (kind, s, n, k, np.flatnonzero((got != ref).any(axis=0))[:8])
