"""DeepseekCupyOps (--numerics deepseek on the GPU) against the numpy backend's DeepseekOps, op by
op and for whole models. Skipped where CuPy or a GPU is absent (CI).

Tolerances. act() is bit-exact. Elsewhere both backends round the same values to bf16 at the same
points, but sum in another order; a float32 difference can move an output across a bf16 rounding
boundary (one bf16 step, 2^-8 relative), and where a rounded value feeds the FP8 activation
quantization, across an e4m3 code boundary (one e4m3 step, 2^-4 relative, for that one element).
Such flips are rare, so norm-relative errors stay far below one step: OP_TOL for one op, CHAIN_TOL
for the experts (three rounding points and two quantizations in a row).

A whole model compounds them: each flip moves the next layer's inputs, and over a few layers and
steps the logits spread as far as the quantization noise itself. On the H100 the GPU sat as far
from DeepseekOps as exact numerics do, and so does DeepseekOps itself with its linears' sums
perturbed at the size of another summation order (~2^-14 of the products' magnitude on FP8 MMA,
~2^-22 in f32). So the whole-model test measures the GPU against that spread (_Reordered): the
median distance within MODEL_SPREAD of it, and greedy tokens that differ only where DeepseekOps'
own top-2 margin is within the GPU's difference. A race (the fork join's, logits 50-100% off and
not repeatable) fails both.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gpu_cases import RNG, cp, make_weight, rel, rnd

from engine.checkpoint.formats import round_bf16
from engine.model.numerics import BF16, F32, QUANT
from engine.ops import kernels as K
from engine.ops.deepseek_ops import DeepseekOps, LinearWeight
from engine.ops.gpu.deepseek import DeepseekCupyOps
from engine.ops.gpu.ops import CupyOps
from engine.ops.numpy_ops import NumpyOps
from engine.state.rows import Span

REF, GPU = DeepseekOps(), DeepseekCupyOps()
EXACT = CupyOps()  # (the fused tails' exact-numerics side)
OP_TOL, CHAIN_TOL = 2e-3, 1e-2
# the attention kernels' online softmax (decode and prompt chunks) rounds each probability relative
# to the running maximum, the reference relative to the final one: bf16 noise of its own on them
ONLINE_ATTN_TOL = 5e-3
MODEL_SPREAD = 3.0  # median ||gpu - deepseek|| <= MODEL_SPREAD * median ||reordered - deepseek||
ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo-v41"


def _w(fmt: str, n: int, k: int, use: str, block=(128, 128)):
    return replace(make_weight(fmt, n, k, block=block), use=use)


def test_act_rounds_to_bf16_bit_for_bit():
    x = rnd(257, 300, scale=3.0)
    x[0, :6] = [np.inf, -np.inf, 0.0, -0.0, 1e-40, 3.0e38]
    x[1] = np.float32(1.0) + np.float32(2.0**-8) * np.arange(300, dtype=np.float32) % 4  # ties
    np.testing.assert_array_equal(cp.asnumpy(GPU.act(cp.asarray(x))), round_bf16(x))


@pytest.mark.parametrize("fmt,use", [("fp8", QUANT), ("fp4", QUANT), ("bf16", BF16), ("f32", F32)])
@pytest.mark.parametrize("m", [1, 5, 20, 77, 300])
def test_linear_by_use(fmt, use, m):
    """Every row count (the GEMVs on fake-quantized rows up to 32, the e4m3 GEMM above) and every
    use: QUANT (FP8 block-128 and FP4 weights), BF16 and F32."""
    n, k = 320, 1024
    w = _w(fmt, n, k, use, block=(128, 128) if fmt == "fp8" else (32, 32))
    x = rnd(m, k) * np.exp(RNG.uniform(-4, 4, (m, 1))).astype(np.float32)
    ref = REF.linear(x, REF.prepare(w))
    got = GPU.linear(cp.asarray(x), GPU.prepare(w))
    assert rel(got, ref) < OP_TOL
    if use != F32:  # bf16 out
        g = cp.asnumpy(got)
        np.testing.assert_array_equal(g, round_bf16(g))


@pytest.mark.parametrize("fmt,use,m,n,k", [
    *[(f, QUANT, 1, n, k) for f in ("fp8", "fp4") for n, k in ((320, 1024), (4096, 4096))],
    *[("bf16", BF16, 1, n, k) for n, k in ((320, 1024), (4096, 4096))]])
def test_gemvs_quantize_x_as_they_stage_it(fmt, use, m, n, k):
    """The one-row GEMVs (gemvx, gemvr) round x to bf16 and put it on the e4m3 grid per 32 as they
    stage it, and the bf16 weights' GEMVs round it: bit for bit the GEMV of the rows prepared in a
    pass of their own (_linear_input). (At 2 to 32 rows x is laid out for the tensor-core GEMVs in a
    pass of its own, gemv_q8_x / gemv_bf_x: tests/gpu/test_gpu_gemv_q8.py.)"""
    w = GPU.prepare(_w(fmt, n, k, use, block=(128, 128) if fmt == "fp8" else (32, 32)))
    x = cp.asarray(rnd(m, k) * np.exp(RNG.uniform(-4, 4, (m, 1))).astype(np.float32))
    got = cp.asnumpy(GPU.linear(x, w))
    want = cp.asnumpy(CupyOps.linear(GPU, GPU._linear_input(x, GPU._linear_xq(w)), w))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("m", [33, 77, 300])
@pytest.mark.parametrize("n,k,block,sfmt", [(320, 1024, (128, 128), "fp32"), (1000, 4096, (32, 32), "ue8m0"),
                                            (200, 544, (32, 32), "ue8m0")])
def test_bf16_use_fp8_weights_take_x_as_one_term(m, n, k, block, sfmt, monkeypatch):
    """A prompt chunk through a bf16-use weight stored in FP8 (wo_a, the indexer's wk): gemm_tc1
    takes the bf16 rows as one scaled f16 term (tc_split_x's PERM_ONE), float32-grade: every output
    is the reference's bf16 output or its neighbour, where the sums differ by float32 rounding. Rows
    of unlike magnitude, and elements 2^-40 of their group's largest (below the f16 normals)."""
    from engine.ops.gpu import linear as gpu_linear

    perms = []
    split = gpu_linear.LinearOps._tc_split_x
    monkeypatch.setattr(gpu_linear.LinearOps, "_tc_split_x",
                        staticmethod(lambda a, perm, xq=0: perms.append(perm) or split(a, perm, xq)))
    w = replace(make_weight("fp8", n, k, block=block, scale_fmt=sfmt), use=BF16)
    x = rnd(m, k) * np.exp(RNG.uniform(-6, 6, (m, 1))).astype(np.float32)
    x[::3, 5::11] *= np.float32(2.0**-40)
    ref = REF.linear(x, REF.prepare(w)).astype(np.float64)
    got = cp.asnumpy(GPU.linear(cp.asarray(x), GPU.prepare(w))).astype(np.float64)
    assert perms == [gpu_linear.PERM_ONE]
    np.testing.assert_array_equal(got, round_bf16(got.astype(np.float32)))
    mag = np.abs(round_bf16(x)).astype(np.float64) @ np.abs(REF.prepare(w).view(np.ndarray)).T.astype(np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 1e-38))) - 7)
    assert (np.abs(got - ref) <= ulp + 1e-6 * mag).all()


def test_wo_a_grouped_takes_x_as_one_term():
    """wo_a's block-diagonal form (segments at x columns g * in_g) on gemm_tc1, as the reference."""
    groups, nout, kin, t = 4, 256, 512, 100
    w = replace(make_weight("fp8", groups * nout, kin, block=(32, 32)), use=BF16)
    x = rnd(t, groups, kin)
    got = GPU.grouped_linear(cp.asarray(x), GPU.prepare(w), groups)
    assert rel(got, REF.grouped_linear(x, REF.prepare(w), groups)) < OP_TOL


@pytest.mark.parametrize("m", [7, 192])
def test_stacked_rows_of_mixed_uses_round_only_the_bf16_rows(m):
    """A projection stacked from two bf16-stored weights of different uses (the indexer's
    weights_proj and a ratio > 1 compressor's wkv, say): the BF16 part's columns come out in bf16,
    the F32 part's do not; on the GEMV (7 rows) and on gemm_bf16w (192, a verify step's)."""
    k = 256
    a, b = _w("bf16", 96, k, BF16), _w("bf16", 64, k, F32)
    x = rnd(m, k)
    ref = REF.linear(x, REF.prepare_rows([a, b]))
    got = cp.asnumpy(GPU.linear(cp.asarray(x), GPU.prepare_rows([a, b])))
    assert rel(got, ref) < OP_TOL
    np.testing.assert_array_equal(got[:, :96], round_bf16(got[:, :96]))
    assert not np.array_equal(got[:, 96:], round_bf16(got[:, 96:]))


@pytest.mark.parametrize("t", [1, 6, 300])
def test_moe_weights_before_w2(t):
    """Routed FP4 experts: the routing weight scales each hidden row before w2's quantization (not
    the expert's output), through the device grouping (GEMV segments, then GEMM segments at 300
    tokens), plus the shared expert's output."""
    e, k, d, inter = 16, 4, 1024, 512
    ws = [tuple(_w("fp4", *s, QUANT) for s in ((inter, d), (d, inter), (inter, d))) for _ in range(e)]
    x = rnd(t, d)
    ids = np.stack([RNG.permutation(e)[:k] for _ in range(t)])
    wts = (RNG.random((t, k), dtype=np.float32) * 2.5).astype(np.float32)
    shared = round_bf16(rnd(t, d))
    ref = REF.moe(x, [tuple(REF.prepare(w) for w in ex) for ex in ws], wts, ids, 10.0, shared)
    got = GPU.moe(cp.asarray(x), [tuple(GPU.prepare(w) for w in ex) for ex in ws], cp.asarray(wts),
                  cp.asarray(ids), 10.0, cp.asarray(shared))
    err = rel(got, ref)
    assert err < CHAIN_TOL
    # the weight's place matters (w2's FP8 quantization is not linear): weighting the experts'
    # outputs instead lands measurably further away
    after = np.zeros_like(x)
    for r in range(t):
        for j in range(k):
            w1, w2, w3 = (REF.prepare(w) for w in ws[ids[r, j]])
            after[r] += wts[r, j] * REF.swiglu_mlp(x[r:r + 1], w1, w2, w3, 10.0)[0]
    assert rel(got, round_bf16(after + shared)) > 3 * err


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_moe_prompt_chunk_grouped_gemm(fmt):
    """A prompt chunk's experts on the grouped e4m3 GEMM (past moe.gemv_grouping: GEMM tiles), routed
    unevenly: an expert with no pairs, some with more than a segment's 128 rows (several segments)."""
    e, k, t, d, inter = 24, 6, 400, 512, 384
    block = (128, 128) if fmt == "fp8" else (32, 32)
    ws = [tuple(_w(fmt, *s, QUANT, block=block) for s in ((inter, d), (d, inter), (inter, d))) for _ in range(e)]
    x = rnd(t, d) * np.exp(RNG.uniform(-3, 3, (t, 1))).astype(np.float32)
    pop = np.r_[np.geomspace(1.0, 0.02, e - 1), 0.0]
    ids = np.stack([RNG.choice(e, k, replace=False, p=pop / pop.sum()) for _ in range(t)])
    assert np.bincount(ids.ravel(), minlength=e).max() > 128
    wts = (RNG.random((t, k), dtype=np.float32) * 2.5).astype(np.float32)
    ref = REF.moe(x, [tuple(REF.prepare(w) for w in ex) for ex in ws], wts, ids, 10.0, None)
    got = GPU.moe(cp.asarray(x), [tuple(GPU.prepare(w) for w in ex) for ex in ws], cp.asarray(wts),
                  cp.asarray(ids), 10.0, None)
    assert rel(got, ref) < CHAIN_TOL


def test_shared_expert_mlp(monkeypatch):
    """Decode and verify rows (up to TC_MAX_ROWS) take gate and up in one GEMV launch (their
    outputs rounded to bf16 as linear() rounds them); a prompt chunk's rows the e4m3 GEMMs."""
    d, inter = 1024, 512
    w1, w2, w3 = (_w("fp8", *s, QUANT) for s in ((inter, d), (d, inter), (inter, d)))
    fused = []
    pairs = GPU._swiglu_pairs
    monkeypatch.setattr(GPU, "_swiglu_pairs", lambda gu, inter, limit: fused.append(gu.shape[0]) or pairs(gu, inter,
                                                                                                       limit))
    for t in (1, 20, 64):
        x = rnd(t, d)
        ref = REF.swiglu_mlp(x, *(REF.prepare(w) for w in (w1, w2, w3)), 10.0)
        got = GPU.swiglu_mlp(cp.asarray(x), *(GPU.prepare(w) for w in (w1, w2, w3)), 10.0)
        assert rel(got, ref) < CHAIN_TOL, t
    assert fused == [1, 20]


@pytest.mark.parametrize("h,d,selected", [(16, 512, 0), (64, 512, 0), (64, 512, 60), (128, 192, 60), (64, 64, 0)])
def test_attention_ranges_bf16(h, d, selected):
    """A prompt chunk's attention in the reference's sparse_attn numerics (bf16 q and K=V, bf16
    probabilities into P V): attn_sparse_bf at 64 and 128 heads (its entries through the mask or
    through the lists of selected rows; a head dim it pads), the decode kernel at 16."""
    s, n_state, n_e, win = 150, 40, 300, 64
    q, sinks = rnd(s, h, d), rnd(h)
    keys, entries = rnd(n_state + s, d), rnd(n_e, d)
    i = np.arange(s) + n_state
    lo, hi = np.maximum(i - (win - 1), 0), i + 1
    emask = RNG.random((s, n_e)) < 0.1
    if selected:
        emask[:, selected:] = False  # (at most `selected` true values a row)
        emask[:3] = False  # queries with no entries
    ref = REF.attention_ranges(q, keys, lo, hi, entries, emask, sinks, d**-0.5, selected)
    got = GPU.attention_ranges(cp.asarray(q), cp.asarray(keys), lo, hi, cp.asarray(entries), cp.asarray(emask),
                               cp.asarray(sinks), d**-0.5, selected)
    assert rel(got, ref) < ONLINE_ATTN_TOL


def test_attention_decode_bf16():
    b, h, d = 5, 64, 512
    q, sinks = rnd(b, h, d), rnd(h)
    src_ref, src_gpu = [], []
    for i in range(b):
        win, ent = rnd(int(RNG.integers(1, 128)), d), rnd(400 * i, d)
        mask = RNG.random(400 * i) < 0.2
        src_ref.append([(win, None)] + ([(ent, mask)] if i else []))
        src_gpu.append([(cp.asarray(win), None)] + ([(cp.asarray(ent), cp.asarray(mask))] if i else []))
    ref = REF.attention_decode(q, src_ref, sinks, d**-0.5)
    got = GPU.attention_decode(cp.asarray(q), src_gpu, cp.asarray(sinks), d**-0.5)
    assert rel(got, ref) < ONLINE_ATTN_TOL


def _spy_kernels(monkeypatch) -> list:
    """The names of the attention kernels launched through _smem_function from here on."""
    import engine.ops.gpu.attention as att

    names, real = [], att._smem_function

    def spy(mod, name, smem):
        names.append(name)
        return real(mod, name, smem)

    monkeypatch.setattr(att, "_smem_function", spy)
    return names


@pytest.mark.parametrize("b,h,d", [(64, 64, 512), (70, 128, 512), (64, 64, 192)])
def test_attention_decode_bf16_on_tensor_cores(b, h, d, monkeypatch):
    """A step of ATB_MIN_ROWS rows or more (a verify step's) on attn_table_bf: each row's window and
    its entries under its mask (one row without entries, one whose mask selects nothing, one with a
    single window row, long and short ones, a head dim it pads), within the online softmax's
    tolerance of the reference; and q rounded by the kernel, bit for bit the kernel on q rounded."""
    from engine.ops.gpu.attention import ATB_MIN_ROWS

    assert b >= ATB_MIN_ROWS
    names = _spy_kernels(monkeypatch)
    q, sinks = rnd(b, h, d), rnd(h)
    src_ref, src_gpu = [], []
    for i in range(b):
        win = rnd(1 if i == 3 else int(RNG.integers(1, 129)), d)
        n = [0, 700, 90, 64][i % 4]
        mask = RNG.random(n) < (0.0 if i == 5 else 0.2)
        src_ref.append([(win, None)] + ([(rnd(n, d), mask)] if n else []))
        src_gpu.append([(cp.asarray(a), None if m is None else cp.asarray(m)) for a, m in src_ref[-1]])
    ref = REF.attention_decode(q, src_ref, sinks, d**-0.5)
    got = GPU.attention_decode(cp.asarray(q), src_gpu, cp.asarray(sinks), d**-0.5)
    assert names and all(nm.startswith("attn_table_bf") for nm in names), names
    assert rel(got, ref) < ONLINE_ATTN_TOL
    again = GPU.attention_decode(GPU.act(cp.asarray(q)), src_gpu, cp.asarray(sinks), d**-0.5)
    np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(again))


def test_attention_decode_bf16_keys_after_empty_tiles(monkeypatch):
    """attn_table_bf skips a 64-key tile with no visible key: rows whose window fills tile 0 and whose
    visible entries all sit one, two or three tiles further, empty tiles between (the vote on a tile
    must see its own flags: read from shared memory after a skipped tile, a stale one once skipped a
    tile of keys). Within the online softmax's tolerance of the reference, every row."""
    b, h, d, n = 64, 64, 512, 512
    names = _spy_kernels(monkeypatch)
    q, sinks = rnd(b, h, d), rnd(h)
    src_ref, src_gpu = [], []
    for i in range(b):
        mask = np.zeros(n, bool)
        first = 64 * (1 + i % 3)  # tiles 1 .. 3 of the entries: after 0, 1 or 2 empty tiles
        mask[first + RNG.choice(64, 5, replace=False)] = True
        src_ref.append([(rnd(64, d), None), (rnd(n, d), mask)])
        src_gpu.append([(cp.asarray(a), None if m is None else cp.asarray(m)) for a, m in src_ref[-1]])
    ref = REF.attention_decode(q, src_ref, sinks, d**-0.5)
    got = cp.asnumpy(GPU.attention_decode(cp.asarray(q), src_gpu, cp.asarray(sinks), d**-0.5))
    assert names and all(nm.startswith("attn_table_bf") for nm in names), names
    worst = max(rel(got[i], ref[i]) for i in range(b))
    assert worst < ONLINE_ATTN_TOL, worst


@pytest.mark.parametrize("selected", [0, 40])
def test_attend_decode_bf16_on_tensor_cores(selected, monkeypatch):
    """V4.1's staged decode table on attn_table_bf (64 rows): entries under row b of the published
    top-k mask, walked or through each row's list of selected rows (two true values past a row's
    entries count for nothing), against the reference and against attention_decode's kernel."""
    b, h, d, win, n_e = 64, 64, 512, 128, 600
    wins = [rnd(int(RNG.integers(1, win + 1)), d) for _ in range(b)]
    ns = [int(RNG.integers(0, n_e + 1)) for _ in range(b)]
    ents = [rnd(n_e, d) for _ in range(b)]
    mask = np.zeros((b, n_e), bool)
    for i in range(b):
        mask[i, RNG.choice(ns[i], min(ns[i], 30), replace=False)] = True
        mask[i, RNG.choice(np.arange(ns[i], n_e), min(2, n_e - ns[i]), replace=False)] = True
    gw, ge = [cp.asarray(w) for w in wins], [cp.asarray(e) for e in ents]
    rows = [(w.data.ptr, w.shape[0], 0, e.data.ptr, n, 1) for w, e, n in zip(gw, ge, ns, strict=True)]
    tab = cp.asarray(np.array(rows, np.int64))
    q, sinks = rnd(b, h, d), rnd(h)
    src_ref = [[(wins[i], None)] + ([(ents[i][:ns[i]], mask[i, :ns[i]])] if ns[i] else []) for i in range(b)]
    ref = REF.attention_decode(q, src_ref, sinks, d**-0.5)
    args = (tab, cp.asarray(mask), cp.asarray(sinks), d**-0.5, win + n_e, win, selected)
    names = _spy_kernels(monkeypatch)
    got = cp.asnumpy(GPU.attend_decode(cp.asarray(q), *args))
    assert names == ["attn_table_bf512"], names
    assert rel(got, ref) < ONLINE_ATTN_TOL
    monkeypatch.setattr("engine.ops.gpu.attention.ATB_MIN_ROWS", b + 1)
    assert rel(got, cp.asnumpy(GPU.attend_decode(cp.asarray(q), *args))) < ONLINE_ATTN_TOL


@pytest.mark.parametrize("s,n,h,dh", [(3, 500, 16, 32), (40, 333, 64, 128), (41, 333, 32, 128),
                                      (130, 1100, 32, 128), (17, 129, 128, 64)])
def test_indexer_scores_bf16(s, n, h, dh):
    """The indexer's bf16 rounding points on the CUDA-core kernel (3 queries) and the tensor-core
    one (indexer_scores_bf: a partial last block of queries and of keys; 32, 64 and 128 heads), q
    and k on the FP4 grid as the model gives them. The heads' sum is another f32 summation order
    than numpy's, so a few scores land on the neighbouring bf16 value; the rest are equal."""
    q, k = REF.fake_quant_fp4(rnd(s, h, dh), 32), REF.fake_quant_fp4(rnd(n, dh), 32)
    w = rnd(s, h)
    ref = REF.indexer_scores(q, k, w, h, dh, exact=True)
    got = cp.asnumpy(GPU.indexer_scores(cp.asarray(q), cp.asarray(k), cp.asarray(w), h, dh, exact=True))
    assert rel(got, ref) < OP_TOL
    assert np.mean(got == ref) > 0.97
    assert np.all(np.abs(got - ref) <= 2.0**-7 * np.abs(ref) + 1e-5 * np.abs(ref).max())


# ---- decode's fused tails: bit for bit the passes of their own they replaced -------------------
def _combine_in_passes(ops, calls: list):
    """MoeOps._combine as it ran before moe_combine took over the tail: the combine alone, then
    `y += shared` and act() as passes of their own."""
    def combine(out, weights, inv, k, d, shared=None):
        calls.append(shared is not None)
        y = cp.empty((inv.size // k, d), np.float32)
        K.function("elementwise", "moe_combine")(((y.size + 255) // 256,), (256,), (
            out, cp.ascontiguousarray(weights, dtype=np.float32), inv, np.uint64(0), y, np.int64(y.size),
            np.int32(k), np.int32(d), np.int32(0)))
        return ops.act(ops._plus_shared(y, shared))
    return combine


def _moe_inputs(ops, t: int, e: int, k: int, d: int, inter: int) -> tuple:
    """(experts, x, weights, ids): t random tokens through e FP4 experts, k of them each."""
    ws = [tuple(ops.prepare(_w("fp4", *s, QUANT)) for s in ((inter, d), (d, inter), (inter, d))) for _ in range(e)]
    ids = np.stack([RNG.permutation(e)[:k] for _ in range(t)])
    wts = (RNG.random((t, k), dtype=np.float32) * 2.5).astype(np.float32)
    return ws, cp.asarray(rnd(t, d)), cp.asarray(wts), cp.asarray(ids)


@pytest.mark.parametrize("numerics", ["deepseek", "exact"])
@pytest.mark.parametrize("t", [1, 8, 300])
@pytest.mark.parametrize("with_shared", [True, False])
def test_moe_combine_adds_shared_and_rounds(numerics, t, with_shared, monkeypatch):
    """moe_combine adds the shared expert's row and (deepseek) rounds to bf16 in its own launch: bit
    for bit the combine, `y += shared` and act() as passes of their own, on each path to it (one
    token's GEMV segments, a batch's, a prompt chunk's GEMM tiles or grouped e4m3 GEMM)."""
    ops = GPU if numerics == "deepseek" else EXACT
    d = 512
    ws, x, wts, ids = _moe_inputs(ops, t, 16, 4, d, 256)
    shared = cp.asarray(rnd(t, d)) if with_shared else None  # (not bf16: the order of add and round shows)
    got = cp.asnumpy(ops.moe(x, ws, wts, ids, 10.0, shared))
    calls = []
    monkeypatch.setattr(ops, "_combine", _combine_in_passes(ops, calls))
    want = cp.asnumpy(ops.moe(x, ws, wts, ids, 10.0, shared))
    assert calls == [with_shared]  # (the path under test reaches the combine)
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    np.testing.assert_array_equal(got, want)
    if numerics == "deepseek":
        np.testing.assert_array_equal(got, round_bf16(got))
        if with_shared:  # the experts' sum rounded before the shared row is added: other values
            alone = cp.asnumpy(ops.moe(x, ws, wts, ids, 10.0, None))
            assert not np.array_equal(got, round_bf16(alone + cp.asnumpy(shared)))


def test_moe_combine_joins_a_forked_shared_expert(monkeypatch):
    """A captured decode step forks the shared expert beside the routed ones; the combine that adds
    its output joins the fork first: the replayed graph equals the tail in passes of its own, inline."""
    from engine.ops.gpu.graphs import RegionGraphs

    d, inter = 1024, 512
    shared_w = tuple(GPU.prepare(_w("fp8", *s, QUANT)) for s in ((inter, d), (d, inter), (inter, d)))
    ws, x, wts, ids = _moe_inputs(GPU, 1, 8, 6, d, inter)

    def forked(a):
        y = GPU.moe(a, ws, wts, ids, 10.0, GPU.fork(GPU.swiglu_mlp, a * 1.0, *shared_w, 10.0))
        GPU.join_all()
        return y

    with monkeypatch.context() as m:
        m.setattr(GPU, "_combine", _combine_in_passes(GPU, []))
        want = cp.asnumpy(GPU.moe(x, ws, wts, ids, 10.0, GPU.swiglu_mlp(x, *shared_w, 10.0)))
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    monkeypatch.setattr(GPU, "_side_stream", None)  # (made on first use: by this capture, below)
    graphs = RegionGraphs(enabled=True)
    for _ in range(4):  # eager, capture, then replays
        np.testing.assert_array_equal(cp.asnumpy(graphs("fork", forked, x)), want)
    assert graphs.captures == 1 and graphs.replays >= 2
    assert GPU._side_stream is not None  # the capture forked


@pytest.mark.parametrize("b", [1, 40])
def test_attention_decode_rounds_q_as_it_loads_it(b):
    """The decode kernel rounds q to bf16 as it loads it (no act() pass): bit for bit the kernel on
    q rounded first, split over the keys (1 sequence) or in one split (40 write the output directly)."""
    h, d = 64, 512
    q, sinks = cp.asarray(rnd(b, h, d)), cp.asarray(rnd(h))
    src = []
    for _ in range(b):
        win, ent = rnd(int(RNG.integers(1, 128)), d), rnd(int(RNG.integers(300, 800)), d)
        src.append([(cp.asarray(win), None), (cp.asarray(ent), cp.asarray(RNG.random(ent.shape[0]) < 0.3))])
    got = cp.asnumpy(GPU.attention_decode(q, src, sinks, d**-0.5))
    np.testing.assert_array_equal(got, cp.asnumpy(GPU.attention_decode(GPU.act(q), src, sinks, d**-0.5)))
    # (q's rounding reaches the output: exact numerics, which keep q, tell the two apart)
    assert not np.array_equal(cp.asnumpy(EXACT.attention_decode(q, src, sinks, d**-0.5)),
                              cp.asnumpy(EXACT.attention_decode(GPU.act(q), src, sinks, d**-0.5)))


@pytest.mark.parametrize("selected", [0, 40])
def test_attend_decode_rounds_q_as_it_loads_it(selected):
    """V4.1's decode attention from a staged table (each sequence's window, then its entries under
    its top-k mask row, walked or through the row's list of selected entries): q rounded by the
    kernel, bit for bit the kernel on q rounded first."""
    b, h, d, win, n_e = 3, 64, 512, 128, 600
    wins = [cp.asarray(rnd(int(RNG.integers(1, win + 1)), d)) for _ in range(b)]
    ents = [cp.asarray(rnd(n_e, d)) for _ in range(b)]
    rows = [(w.data.ptr, w.shape[0], 0, e.data.ptr, n_e, 1) for w, e in zip(wins, ents, strict=True)]
    tab = cp.asarray(np.array(rows, np.int64))  # (the staged table: window rows, then entries under row b)
    mask = np.zeros((b, n_e), bool)
    for i in range(b):
        mask[i, RNG.choice(n_e, 30, replace=False)] = True
    q, args = cp.asarray(rnd(b, h, d)), (tab, cp.asarray(mask), cp.asarray(rnd(h)), d**-0.5, win + n_e, win, selected)
    got = cp.asnumpy(GPU.attend_decode(q, *args))
    np.testing.assert_array_equal(got, cp.asnumpy(GPU.attend_decode(GPU.act(q), *args)))
    assert not np.array_equal(cp.asnumpy(EXACT.attend_decode(q, *args)),
                              cp.asnumpy(EXACT.attend_decode(GPU.act(q), *args)))


def _head_weights_in_passes(ops, rounded: bool = True):
    """DeepseekCupyOps._indexer_weights as it was: bf16(bf16(w) * Dh^-0.5 * H^-0.5) in passes of its
    own, both scales folded in (the kernels' rounding of them then changes nothing). rounded False:
    w times the scales as they are, which the kernels then round once: other weights."""
    def weights(w, n_heads, head_dim):
        c = np.float32(head_dim**-0.5 * n_heads**-0.5)
        wc = cp.ascontiguousarray(w, dtype=np.float32)
        return (ops.act(ops.act(wc) * c) if rounded else wc * c), np.float32(1.0), np.float32(1.0)
    return weights


@pytest.mark.parametrize("s,n,h,dh,exact", [(3, 500, 16, 32, False), (40, 333, 64, 128, True),
                                            (40, 333, 32, 64, True), (40, 333, 64, 128, False)])
def test_indexer_kernels_form_the_head_weights(s, n, h, dh, exact, monkeypatch):
    """The score kernels form the reference's bf16(bf16(w) * hscale) as they load w: bit for bit the
    weights rounded, scaled and rounded in passes of their own, on the CUDA-core kernel (3 queries;
    and the decode spans kernel) and the tensor-core ones (indexer_scores_bf with 64 and 32 heads,
    and three bf16 terms). (At 32 heads of 128 the scale is a power of two, which makes the last
    check vacuous: that case takes a head dim of 64.)"""
    q, k = cp.asarray(REF.fake_quant_fp4(rnd(s, h, dh), 32)), cp.asarray(REF.fake_quant_fp4(rnd(n, dh), 32))
    w = cp.asarray(rnd(s, h))
    spans = [Span(k, int(RNG.integers(0, n // 2)), int(RNG.integers(1, n // 2))) for _ in range(s)]

    def scores():
        sc = cp.asnumpy(GPU.indexer_scores(q, k, w, h, dh, exact=exact))
        return sc, (cp.asnumpy(GPU.indexer_scores_spans(q, spans, w, h, dh)) if s < 16 else None)

    got, got_spans = scores()
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    monkeypatch.setattr(GPU, "_indexer_weights", _head_weights_in_passes(GPU))
    want, want_spans = scores()
    np.testing.assert_array_equal(got, want)
    if got_spans is not None:
        np.testing.assert_array_equal(got_spans, want_spans)
    # (the weights' rounding reaches the scores: weights rounded only after the scaling give others)
    monkeypatch.setattr(GPU, "_indexer_weights", _head_weights_in_passes(GPU, rounded=False))
    assert not np.array_equal(scores()[0], got)


# ---- whole models -------------------------------------------------------------------------
def _tiny(tmp_path: Path) -> Path:
    """A random V4.1 checkpoint in the released formats (FP8 weights, FP4 experts), every layer kind."""
    out = tmp_path / "tiny"
    subprocess.run([sys.executable, str(ROOT / "dsuf.py"), "tiny-model", str(out), "--seed", "3"], check=True,
                   capture_output=True)
    return out


class _Reordered(DeepseekOps):
    """DeepseekOps whose tagged linears carry the error of another summation order before their
    rounding: N(0, 1) times 2^-14 (FP8 MMA's k32 sums) or 2^-22 (f32 sums) of |x| @ |w|^T."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = np.random.default_rng(seed)

    def sums(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        y = super().sums(x, w)
        mag = NumpyOps.linear(self, np.abs(x), np.abs(w.view(np.ndarray)))
        return y + self.rng.standard_normal(y.shape).astype(np.float32) * mag * np.float32(
            2.0 ** -14 if w.quant else 2.0 ** -22)


def _teacher_forced(ckpt: Path, prompt: list[int], steps: int) -> tuple[list[float], list[float], list[float],
                                                                          int, int]:
    """GPU deepseek, numpy deepseek, numpy exact and _Reordered fed numpy deepseek's greedy tokens.
    Returns per step ||gpu - ds|| / ||ds||, ||exact - ds|| / ||ds|| and ||reordered - ds|| / ||ds||
    of the logits, the argmax flips, and the flips allowed (DeepseekOps' top-2 margin within the
    GPU's largest difference)."""
    from engine.checkpoint.reader import Checkpoint
    from engine.runtime.engine import Engine
    from engine.runtime.runner import ModelRunner
    from engine.settings import Settings

    ds_engine = Engine.load(ckpt, settings=Settings(numerics="deepseek"))
    ds = ds_engine.model
    ex = Engine.load(ckpt, settings=Settings(numerics="exact")).model
    gpu = Engine.load(ckpt, gpus=[0], settings=Settings(numerics="deepseek")).model
    assert type(gpu.ops) is DeepseekCupyOps
    cfg = ds_engine.config
    ro = ModelRunner(cfg, Checkpoint(ckpt, block_size=cfg.weight_block_size), _Reordered(7), ckpt / "tokenizer.json")
    models = (ds, ex, gpu, ro)
    sts = [m.new_state() for m in models]
    logits = [np.asarray(m.ops.to_host(m.forward([st], [prompt])[0])) for m, st in zip(models, sts, strict=True)]
    g_err, x_err, n_err, flips, near = [], [], [], 0, 0
    for step in range(steps + 1):
        r, x, g, n = logits
        for errs, other in ((g_err, g), (x_err, x), (n_err, n)):
            errs.append(float(np.linalg.norm(other - r) / np.linalg.norm(r)))
        top2 = np.sort(r)[-2:]
        if int(np.argmax(g)) != int(np.argmax(r)):
            flips += 1
            # a flip is explained by the logits' error when r's top-2 gap is within twice it (r's winner
            # can lose up to the error, g's winner gain up to it)
            near += int(top2[1] - top2[0] <= 2 * np.abs(g - r).max())
        if step == steps:
            break
        nxt = int(np.argmax(r))
        logits = [np.asarray(m.ops.to_host(m.forward([st], [[nxt]])[0])) for m, st in zip(models, sts, strict=True)]
    return g_err, x_err, n_err, flips, near


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_whole_model_matches_deepseek_ops(which, tmp_path):
    """A 300-token prompt (prompt chunks: the e4m3 GEMM, the compressors, the indexer's sparse
    selection) then 24 teacher-forced decode steps."""
    ckpt = _tiny(tmp_path) if which == "tiny" else DEMO
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 4000, 300)]
    g_err, x_err, n_err, flips, near = _teacher_forced(ckpt, prompt, 24)
    print(f"\n{which}: distance to numpy deepseek, median (worst): GPU {np.median(g_err):.2e} ({max(g_err):.2e}); "
          f"reordered sums {np.median(n_err):.2e} ({max(n_err):.2e}); exact numerics {np.median(x_err):.2e}; "
          f"argmax flips {flips} ({near} at near-ties)")
    print("per step (gpu, reordered, exact):", " ".join(
        f"{g:.1e}/{n:.1e}/{x:.1e}" for g, n, x in zip(g_err, n_err, x_err, strict=True)))
    assert np.median(g_err) <= MODEL_SPREAD * np.median(n_err), (g_err, n_err)
    assert flips == near


def test_every_op_joins_a_pending_fork_first():
    """An op reading a fork's output (the shared expert's, run on a second stream) must join the
    fork first; the overrides of DeepseekCupyOps too (a race otherwise, seen only under graphs)."""
    import inspect

    for name in dir(DeepseekCupyOps):
        raw = inspect.getattr_static(DeepseekCupyOps, name)
        if not name.startswith("_") and inspect.isfunction(raw):
            assert getattr(raw, "_joins", False), name
