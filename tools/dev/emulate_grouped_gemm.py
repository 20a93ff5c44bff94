"""Emulate kernels/fp8_grouped.cu's grouped wgmma tile (a MoE's experts in one launch) in numpy and
compare its Y with a plain product; no GPU needed. Exits non-zero on a mismatch. gemm_e4m3_grouped_fp8_sm90
is the kernel; the FP4 cases run the same tile on wg_gemm<FMT_FP4> (the dense FP4 kernel's; FP4
experts on sm_90a run kernels/fp4_experts.cu instead).

The tile's work is tools/dev/emulate_wgmma_gemm.py's Block (every cp.async, barrier, descriptor and
fragment of kernels/fp8_wgmma.cuh); this adds what the grouped kernels change:
- the launch of engine/ops/gpu/fp8_linear.py fp8_grouped_linear (grid, mtiles from its step,
  GROUPED_ROWS read from that file) over a segment table built as kernels/moe.cu moe_group_large
  builds it (pairs in a stable sort by expert, runs cut every step rows, zero-row slots after, the
  doubled table's second half for w3: experts E.., y column N);
- grouped_tile: block y -> segment and its tile's first row, blocks past a segment's rows (and
  zero-row slots) returning at once; the pointer table: expert e's data and scales are arrays of
  their own, so a read outside them fails the emulator's bounds check; A and SA moved to the
  segment's first row (w1 / w3 read the tokens' codes gathered into pair order first, as
  fp8_linear.py gather_codes does);
- the epilogue through Y moved to the segment's first row and y column: rows row0 + r, columns
  ycol + n; every element written (Y starts as NaN).
"""

import ast
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import emulate_wgmma_gemm as wg  # noqa: E402

FMT_FP8, FMT_FP4 = wg.FMT_FP8, wg.FMT_FP4


def grouped_rows() -> int:
    """GROUPED_ROWS of engine/ops/gpu/fp8_linear.py (read, not imported: it imports CuPy)."""
    tree = ast.parse((wg.ROOT / "engine/ops/gpu/fp8_linear.py").read_text())
    ns = {}
    for n in tree.body:
        names = {x.id for t in getattr(n, "targets", []) for x in ast.walk(t) if isinstance(x, ast.Name)}
        if isinstance(n, ast.Assign) and names & {"WG_TILE", "GROUPED_ROWS"}:
            exec(compile(ast.Module([n], []), "fp8_linear", "exec"), ns)
    return ns["GROUPED_ROWS"]


def group(ids, n_experts, step, dup_col, spare=2):
    """moe_group_large's outputs (order, inv, gather, segs [2 x] maxseg x 5) for ids [T, k]."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    segs = []
    base = 0
    for e in range(n_experts):
        c = int((flat == e).sum())
        segs += [(e, base + r, min(step, c - r), 0, 0) for r in range(0, c, step)]
        base += c
    segs += [(0, 0, 0, 0, 0)] * spare
    if dup_col:
        segs += [(e + n_experts, r0, n, 0, dup_col) if n else (0, 0, 0, 0, 0) for e, r0, n, _, _ in segs]
    return order, inv, (order // ids.shape[1]).astype(np.int32), np.asarray(segs, np.int32).reshape(-1)


def launch(fmt, codes, sa, segs, wtab, stab, Y, N, K, bn, bk, gk, step, smem):
    """fp8_grouped_linear on sm_90a and the blocks of its grid, as grouped_tile maps them."""
    mtiles = -(-step // wg.BM)
    nseg = segs.size // 5
    grid = (-(-N // wg.BN), nseg * mtiles)
    for by in range(grid[1]):
        e, row0, rows, acol, ycol = (int(v) for v in segs[5 * (by // mtiles): 5 * (by // mtiles) + 5])
        m0 = (by % mtiles) * wg.BM
        if m0 >= rows:
            continue
        assert acol == 0 and rows <= step
        # (grouped_tile moves A and SA to the segment's first row: the dense block's copies from there)
        g = {"A": codes[row0:].reshape(-1), "SA": sa[row0:].astype(np.float32).view(np.uint8).reshape(-1),
             "W": wtab[e].reshape(-1),
             "SW": (stab[e].astype(np.float32).view(np.uint8) if fmt == FMT_FP8 else stab[e]).reshape(-1),
             "M": rows, "N": N, "K": K, "bn": bn, "bk": bk, "gk": gk}
        ys = Y[row0:row0 + rows, ycol:ycol + N]  # Y + row0 * ldy + ycol, rows of ldy
        assert ys.shape == (rows, N), "a segment's output outside Y"
        for bx in range(grid[0]):
            wg.run_block(fmt, g, m0, bx * wg.BN, smem, ys)


def weights(rng, fmt, E, N, K):
    """E experts' (data, scales, dequantized) of one shape, as the pointer tables list them."""
    out = []
    for _ in range(E):
        if fmt == FMT_FP8:
            W = (rng.integers(0, 256, (N, K)) & 0xF7).astype(np.uint8)
            SW = (2.0 ** rng.uniform(-10, -5, (-(-N // 128), -(-K // 128)))).astype(np.float32)
            out.append((W, SW, wg.formats.dequant_fp8_blocks(W, SW, (128, 128))))
        else:
            W = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
            lo = int(rng.integers(110, 125))
            SW = rng.integers(lo, lo + int(rng.choice([8, 20])), (N, K // 32)).astype(np.uint8)
            out.append((W, SW, wg.formats.dequant_fp4_experts(W, SW, 32)))
    return out


def check(fmt, T, k, E, D, N, counts_skew, seed=0):
    """w1 / w3 (the tokens' rows gathered into pair order, one doubled table) then w2 of a MoE with T
    tokens, top-k of E."""
    step, smem = grouped_rows(), wg.host_constants()["wgmma_smem"](fmt)
    rng = np.random.default_rng(seed)
    pop = np.geomspace(1.0, counts_skew, E)
    pop[E // 2] = pop[-1] = 0.0  # an expert with no pairs, and the last with one:
    ids = np.stack([rng.choice(E, k, replace=False, p=pop / pop.sum()) for _ in range(T)])
    ids[0, 0] = E - 1
    order, inv, gather, segs = group(ids, E, step, N)
    P = order.size
    bn, bk = (128, 128) if fmt == FMT_FP8 else (1, 32)
    ws = weights(rng, fmt, 2 * E, N, D)
    codes, sa, xq = wg.quantized_x(rng, T, D)
    gu = np.full((P, 2 * N), np.nan, np.float32)
    launch(fmt, codes[gather], sa[gather], segs, [w[0] for w in ws], [w[1] for w in ws], gu, N, D, bn, bk,
           D // 32 if fmt == FMT_FP4 else -(-D // 128), step, smem)
    want = np.empty((P, 2 * N))
    e_sorted = ids.reshape(-1)[order]
    for h in range(2):
        for e in range(E):
            rows = np.flatnonzero(e_sorted == e)
            want[rows, h * N:(h + 1) * N] = xq[gather[rows]].astype(np.float64) @ ws[e + h * E][2].astype(np.float64).T
    err1 = rel_err(gu, want)
    # w2: the rows in pair order, the first half of the table
    w2 = weights(rng, fmt, E, D, N)
    hc, hs, hq = wg.quantized_x(rng, P, N)
    out = np.full((P, D), np.nan, np.float32)
    launch(fmt, hc, hs, segs[: segs.size // 2], [w[0] for w in w2], [w[1] for w in w2], out, D, N, bn, bk,
           N // 32 if fmt == FMT_FP4 else -(-N // 128), step, smem)
    want2 = np.empty((P, D))
    for e in range(E):
        rows = np.flatnonzero(e_sorted == e)
        want2[rows] = hq[rows].astype(np.float64) @ w2[e][2].astype(np.float64).T
    err2 = rel_err(out, want2)
    counts = np.bincount(ids.reshape(-1), minlength=E)
    name = "fp8" if fmt == FMT_FP8 else "fp4"
    print(f"{name} T={T} k={k} E={E} D={D} N={N} pairs per expert {sorted(counts.tolist())}: "
          f"w1/w3 max row rel err {err1:.2e}, w2 {err2:.2e}")
    assert err1 < 1e-5 and err2 < 1e-5, (err1, err2)


def rel_err(y, want):
    assert not np.isnan(y).any(), "an output element was never written"
    return float((np.abs(y - want).max(1) / np.maximum(np.abs(want).max(1), 1e-30)).max())


CASES = [  # (fmt, T, k, E, D, N, skew): experts with 1 row, > 128 rows (several segments), none;
    # K = 64 (half a stage) and K % 128 == 64 (a tail); N between tiles (w2's K is w1's N)
    (FMT_FP8, 90, 3, 6, 192, 192, 0.02), (FMT_FP4, 90, 3, 6, 192, 192, 0.02),
    (FMT_FP8, 60, 2, 5, 64, 320, 0.05), (FMT_FP4, 150, 2, 5, 320, 64, 0.5), (FMT_FP8, 300, 2, 5, 64, 64, 0.3),
    (FMT_FP4, 300, 2, 5, 128, 64, 0.1),
]

if __name__ == "__main__":
    for case in CASES:
        check(*case)
    print("all cases match")
