"""Emulate kernels/fp4_experts.cu fd_gemm (gemm_fp4_experts_sm90, the FP4 experts' grouped GEMM, and
gemm_fd_fp8_sm90, FP8 weights', whose producer decodes the weights into shared memory) in numpy,
thread by thread, and compare its Y with a plain product; no GPU needed. Exits non-zero on a
mismatch, a deadlock or a hazard.

What is emulated, the constants parsed from the kernel's #defines (FD_*, BW_*; FdCfg's layout as
the kernel computes it) and the launch's shared memory read from engine/ops/gpu/fp4_experts.py
(FD_SMEM):
- the launch: grid (ceil(N / 128), segments), a segment (weight g, first row, rows, x column, y
  column): the MoE's pairs as kernels/moe.cu groups them (tools/dev/emulate_grouped_gemm.py group),
  or a dense / block-diagonal linear's rows per 256; unused slots returning at once, X, Y and the
  weight's pointers moved to the segment;
- the dynamic buffer at an address that is not 1024-aligned, so the kernel's alignment pad is used,
  and the layout (tokens, decoded A tiles, staging, barriers) checked to fit FD_SMEM;
- the token tile by TMA: thread 0's boxes of 64 elements x FD_BOX_ROWS rows (as many as the wgmma N
  reads) from X's tensor map (engine/ops/gpu/tma.py: X's whole rows and columns, elements past them
  zeros), landing with the 128-byte swizzle of their shared-memory addresses (destinations checked
  1024-aligned and inside the stage's tile), their bytes the tx-count of thread 0's arrival;
- the producer warpgroup's every cp.async (the weight row's 32 (FP4) or 64 (FP8) code bytes, the
  scale window through wg_cp4_clip): destination, source, bounds (a copy reads its whole size unless
  its src-size is 0; even then the pointer must be valid) and alignment; its commit groups and
  cp.async.wait_group LAG - 1 before each decode;
- fd_decode bit for bit: FP4, each code word's pairs of nibbles (j, 4 + j) by shifts and masks into
  bf16 magnitudes times 2^-126; FP8, codes j of two words by __byte_perm, then shifts and masks into
  bf16 magnitudes times 2^-120 (subnormal bf16 numbers among them, as IEEE arithmetic has them);
  times the scale's factors (mul.rn.bf16x2; both paths, scales past 2^1 / 2^7 too), the signs by
  XOR, stored at the 128-byte-swizzled place of row t; the tokens' rows in act_quant_bf16w's K order
  (fd_order); an FP8 weight's block scales as the host's UE8M0 bytes per row and 32 of K;
- the mbarrier protocol (full: 128 cp.async arrive-ons, the TMA's arrival with its tx-count and 128
  arrivals after the decode; empty: one per consumer warp), each arrival checked to belong to the
  barrier's current phase;
- the roles run in a random interleaving (a seeded schedule) until all finish; none can run is a
  deadlock. cp.async and TMA copies land either at issue or at the latest moment the protocol allows
  (when the barrier their arrive-on or tx-count feeds is polled, or at cp.async.wait_group), chosen
  per copy at random,
  so a read before the data's barrier sees stale bytes, and a copy into a tile still being read
  shows up below;
- each consumer's four SS wgmmas a chunk through their descriptors as the PTX ISA lays the operands
  out (K-major, 128-byte swizzle, SBO between 8-row groups; both operands' addresses checked to lie in
  their stage's tiles), read when issued and again when wgmma.wait_group retires them: an operand
  that changed in flight is a hazard;
- the accumulator fragment (m64nNk16: lane of warp w holds rows 16 w + lane / 4 (+ 8), columns 8 i
  + 2 (lane % 4) (+ 1)), the wgmma N by the segment's rows, and the bounded epilogue (bf16 rounding).
The tensor core's sums are taken exact (float64); the products are of bf16 values, so exact too.

    python3 tools/dev/emulate_fp4_experts.py
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import emulate_grouped_gemm as grouped  # noqa: E402  (group: moe_group_large's segments)
import emulate_wgmma_gemm as wg  # noqa: E402  (Mbar, byte_perm, e2m1x4_to_e4m3, desc, swz)

formats = wg.formats
# (the kernel, and the geometry it shares with kernels/bf16_weights.cu)
_SRC = "\n".join((wg.ROOT / "kernels" / f).read_text() for f in ("fp4_experts.cu", "bf16_wgmma.cuh"))
_DEF = {k: v.strip() for k, v in re.findall(r"^#define (FD_\w+|BW_\w+) +([^/\n]+)", _SRC, re.MULTILINE)}


def _const(name: str) -> int:
    """A #define of the kernel, its expression evaluated over the others."""
    expr = _DEF[name]
    for k in sorted(_DEF, key=len, reverse=True):
        if k in expr and k != name:
            expr = re.sub(rf"\b{k}\b", str(_const(k)), expr)
    return int(eval(expr, {}, {}))  # noqa: S307 (the kernel's own constant expressions)


ATILE, TILE, BM, BN = _const("FD_ATILE"), _const("BW_TILE_BYTES"), _const("BW_BM"), _const("BW_BN")
BOX_ROWS, BOX = _const("FD_BOX_ROWS"), _const("FD_BOX_BYTES")
assert BM == 128 and BN == 256 and TILE == BN * 128 and ATILE == BM * 128 and BOX == BOX_ROWS * 128
FP4, FP8 = "fp4", "fp8"


class Cfg:
    """FdCfg<FMT> of the kernel: its ring and the byte offsets from the 1024-aligned base."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.st, self.lag = _const(f"FD_STAGES_{fmt.upper()}"), _const(f"FD_LAG_{fmt.upper()}")
        self.codes = 32 if fmt == FP4 else 64  # code bytes of a row's chunk
        self.stg = BM * self.codes + BM * 4  # staging: codes, then the scale windows
        self.a = self.st * TILE
        self.s = self.a + self.st * ATILE
        self.bar = self.s + self.st * self.stg
        self.bias = 126 if fmt == FP4 else 120  # the factor's exponent field is e + bias
        assert self.lag < self.st

    def piece(self, t: int, p: int) -> int:
        """FdCfg::piece: row t's staged 16-byte piece p of codes."""
        return self.codes * t + 16 * (p ^ ((t // (128 // self.codes)) & (self.codes // 16 - 1)))


CFG = {FP4: Cfg(FP4), FP8: Cfg(FP8)}
# the barriers' arrival counts as fd_gemm initializes them (full, empty)
FULL_COUNT = int(re.search(r"mbar_init\(base \+ F::BAR \+ 8 \* s, (\d+)\)", _SRC).group(1))
EMPTY_COUNT = int(re.search(r"mbar_init\(base \+ F::BAR \+ 8 \* \(F::ST \+ s\), (\d+)\)", _SRC).group(1))


def host_smem(fmt: str) -> int:
    """FD_SMEM[fmt] of engine/ops/gpu/fp4_experts.py (read, not imported: it imports CuPy)."""
    tree = ast.parse((wg.ROOT / "engine/ops/gpu/fp4_experts.py").read_text())
    ns: dict = {"FMT_FP4": FP4, "FMT_FP8": FP8}
    for n in tree.body:
        names = {x.id for t in getattr(n, "targets", []) for x in ast.walk(t) if isinstance(x, ast.Name)}
        if isinstance(n, ast.Assign) and names & {"FE_ROWS", "FE_COLS", "FD_STAGES", "FD_CODES", "FD_SMEM",
                                                  "FD_BOX_ROWS"}:
            exec(compile(ast.Module([n], []), "fp4_experts", "exec"), ns)  # noqa: S102
    c = CFG[fmt]
    assert ns["FD_STAGES"][fmt] == c.st and ns["FD_CODES"][fmt] == c.codes and ns["FE_ROWS"] == BN
    assert ns["FE_COLS"] == BM and ns["FD_BOX_ROWS"] == BOX_ROWS, "the host's tensor map boxes as the kernel's"
    return ns["FD_SMEM"][fmt]


# ---- the decode's arithmetic, on uint32 arrays ----
def bf16x2_mul(a, b):
    """mul.rn.bf16x2: each half a bf16, the product rounded to nearest even."""
    out = np.zeros_like(a, dtype=np.uint32)
    for sh in (0, 16):
        x = formats.bf16_to_f32(((a >> np.uint32(sh)) & np.uint32(0xFFFF)).astype(np.uint16)).astype(np.float64)
        y = formats.bf16_to_f32(((b >> np.uint32(sh)) & np.uint32(0xFFFF)).astype(np.uint16)).astype(np.float64)
        p = x * y
        assert np.all(p.astype(np.float32) == p), "a bf16 product not exact in f32"
        r = formats.f32_to_bf16(p.astype(np.float32))
        assert np.all(formats.bf16_to_f32(r).astype(np.float64) == p), "a bf16 product not exact in bf16"
        out |= r.astype(np.uint32) << np.uint32(sh)
    return out


def shift(x, n: int):
    """fd_shift: x << n for n >= 0, x >> -n otherwise (uint32)."""
    return (x << np.uint32(n)) if n >= 0 else (x >> np.uint32(-n))


def bw_scale2(e, sh):
    b = ((e + sh) << np.uint32(7)).astype(np.uint32)
    return b | (b << np.uint32(16))


FD_2P127, BW_ONE2 = np.uint32(0x7F007F00), np.uint32(0x3F803F80)  # 2^127, 1.0 as bf16x2


class Block:
    """One block of gemm_fp4_experts_sm90: its shared memory, barriers, cp.async state and roles."""

    RAW = 0x400 + 0x90  # the dynamic buffer's address (16-aligned, not 1024-aligned)

    def __init__(self, g: dict, n0: int, rng: np.random.Generator, smem_bytes: int):
        self.g, self.n0, self.rng, self.c = g, n0, rng, CFG[g["fmt"]]
        self.base = self.RAW + ((1024 - (self.RAW & 1023)) & 1023)
        assert self.c.bar + 16 * self.c.st + 1008 <= smem_bytes, "the layout and the largest pad overflow FD_SMEM"
        assert smem_bytes <= 232448, "over the opt-in shared memory of a Hopper block"
        self.smem = np.full(self.RAW + smem_bytes, 0xEE, np.uint8)  # garbage until written
        self.full = [wg.Mbar(FULL_COUNT) for _ in range(self.c.st)]
        self.empty = [wg.Mbar(EMPTY_COUNT) for _ in range(self.c.st)]
        self.deferred: dict[int, list] = {s: [] for s in range(self.c.st)}
        self.unlanded: list[list] = [[] for _ in range(128)]
        self.uncommitted: list[list] = [[] for _ in range(128)]
        self.groups: list[list] = [[] for _ in range(128)]

    # ---- cp.async ----
    def cp(self, t: int, dst: int, name: str, off: int, size: int, src_size: int, lo: int, hi: int) -> None:
        arr = self.g[name]
        assert dst % size == 0 and off % size == 0, (name, dst, off, size)
        assert 0 <= off and off + (size if src_size else 1) <= arr.size, f"cp.async reads outside {name}: {off}"
        assert self.base + lo <= dst and dst + size <= self.base + hi, f"cp.async writes outside its area: {dst}"
        data = np.zeros(size, np.uint8)
        data[:src_size] = arr[off:off + src_size]
        copy = [dst, data, False]
        if self.rng.random() < 0.5:  # lands at issue
            self.land([copy])
        else:
            self.unlanded[t].append(copy)
        self.uncommitted[t].append(copy)

    def land(self, copies: list) -> None:
        for c in copies:
            if not c[2]:
                self.smem[c[0]:c[0] + c[1].size] = c[1]
                c[2] = True

    def commit(self, t: int) -> None:
        self.groups[t].append(self.uncommitted[t])
        self.uncommitted[t] = []

    def wait_group(self, keep: int) -> None:  # every producer thread's cp.async.wait_group keep
        for t in range(128):
            for grp in self.groups[t][:max(0, len(self.groups[t]) - keep)]:
                self.land(grp)

    def poll_full(self, s: int) -> None:  # a consumer's try_wait: the arrive-ons' copies have landed
        for copies, phase in self.deferred[s]:
            self.land(copies)
            self.full[s].arrive(phase)
        self.deferred[s] = []

    # ---- the producer warpgroup (fd_produce) ----
    def produce(self):
        C, ST, LAG = self.g["C"], self.c.st, self.c.lag
        for i in range(C):
            if i >= LAG:
                self.wait_group(LAG - 1)
                self.decode(i - LAG)
            s = i % ST
            yield lambda s=s, i=i: self.empty[s].done(((i // ST) & 1) ^ 1)
            self.tma_tokens(i, s)
            for t in range(128):
                self.copy_chunk(t, i, s)
                self.deferred[s].append((self.unlanded[t], i // ST))  # cp.async.mbarrier.arrive.noinc
                self.unlanded[t] = []
                self.commit(t)
        self.wait_group(0)
        for i in range(max(C - LAG, 0), C):
            self.decode(i)

    def tma_tokens(self, i: int, s: int) -> None:
        """Thread 0's arrival with the boxes' bytes as its tx-count, then its TMA boxes j: X's elements
        (xcol + 64 i .., xrow + FD_BOX_ROWS j ..), zeros past X, each 16 bytes at its address swizzled
        (bits 4..6 XOR 7..9); the arrival completes when they land (at issue or at the barrier's poll)."""
        g, M, X = self.g, self.g["M"], self.g["X"]
        boxes = (256 if M > 128 else 128 if M > 64 else 64) // BOX_ROWS
        rows, cols = X.shape
        copies = []
        for j in range(boxes):
            dst = self.base + s * TILE + j * BOX
            assert dst % 1024 == 0 and self.base + s * TILE <= dst and dst + BOX <= self.base + (s + 1) * TILE
            y0, x0 = g["xrow"] + BOX_ROWS * j, g["xcol"] + 64 * i
            box = np.zeros((BOX_ROWS, 64), np.uint16)
            r1, c1 = min(rows, y0 + BOX_ROWS), min(cols, x0 + 64)
            if r1 > y0 and c1 > x0:
                box[:r1 - y0, :c1 - x0] = X[y0:r1, x0:c1]
            data = box.astype("<u2").view(np.uint8).reshape(BOX_ROWS, 128)
            for r in range(BOX_ROWS):
                for c8 in range(8):
                    a = dst + 128 * r + 16 * c8
                    copies.append([a ^ (((a >> 7) & 7) << 4), data[r, 16 * c8:16 * c8 + 16].copy(), False])
        if self.rng.random() < 0.5:  # lands at issue
            self.land(copies)
        self.deferred[s].append((copies, i // self.c.st))  # the tx-count completes as they land

    def copy_chunk(self, t: int, i: int, s: int) -> None:
        g, K, N, gk = self.g, self.g["K"], self.g["N"], self.g["gk"]
        # weight row n0 + t's code bytes of chunk i, then its scale window
        c = self.c
        wok, row = self.n0 + t < N, min(self.n0 + t, N - 1)
        st = self.base + c.s + s * c.stg
        lo, hi = c.s + s * c.stg, c.s + (s + 1) * c.stg
        for h in range(c.codes // 16):
            self.cp(t, st + c.piece(t, h), "W", row * (K // 64 * c.codes) + c.codes * i + 16 * h, 16,
                    16 if wok else 0, lo, hi)
        b0 = (row * gk + 2 * i) & ~3
        n = min(4, N * gk - b0) if wok else 0
        dst = st + BM * c.codes + 4 * t
        if n in (0, 4):
            self.cp(t, dst, "SW", b0 if n else 0, 4, n, lo, hi)
        else:  # wg_cp4_clip: the word the array ends inside, by plain loads and a store, at once
            assert 0 <= b0 and b0 + n <= g["SW"].size, "loads outside SW"
            self.smem[dst:dst + 4] = 0
            self.smem[dst:dst + n] = g["SW"][b0:b0 + n]

    def decode(self, i: int) -> None:
        """fd_decode of chunk i by all 128 producer threads (row t each), then their arrivals."""
        c = self.c
        N, gk, s = self.g["N"], self.g["gk"], i % c.st
        t = np.arange(128)
        stg = self.base + c.s + s * c.stg
        w = np.stack([np.concatenate([self.smem[stg + c.piece(r, p):][:16] for p in range(c.codes // 16)])
                      for r in range(128)]).view("<u4").astype(np.uint32)  # [t, codes / 4]
        off = ((np.minimum(self.n0 + t, N - 1) * gk + 2 * i) & 3).astype(np.uint32)
        sw = stg + BM * c.codes
        sb = self.smem[sw:sw + 512].copy().view("<u4").astype(np.uint32) >> (8 * off)
        e = [np.clip((sb >> np.uint32(8 * h)) & 0xFF, 1, 254).astype(np.uint32) for h in (0, 1)]
        big = [x + c.bias > 254 for x in e]
        one = ~big[0] & ~big[1]
        # the factors: ONE, 2^(e + bias - 127) each; otherwise 2^127 first for a large one
        fa = [np.where(b, FD_2P127, BW_ONE2).astype(np.uint32) for b in big]
        sc = [bw_scale2(x, np.where(b, c.bias - 127, c.bias).astype(np.uint32)) for x, b in zip(e, big, strict=True)]
        at = self.base + c.a + s * ATILE
        for b in range(8):
            h = b // 4
            if c.fmt == FP4:  # nibbles j and 4 + j of word b, shifted into the halves, bits 6 .. 8
                x = w[:, b]
                parts = [(shift(x, 6 - 4 * j) & np.uint32(0x01C001C0), shift(x, 12 - 4 * j) & np.uint32(0x80008000))
                         for j in range(4)]
            else:  # codes j of words 2b, 2b + 1 by __byte_perm, their magnitudes at bits 4 .. 10
                v01 = wg.byte_perm(w[:, 2 * b], w[:, 2 * b + 1], 0x5410)
                v23 = wg.byte_perm(w[:, 2 * b], w[:, 2 * b + 1], 0x7632)
                m7, sg = np.uint32(0x07F007F0), np.uint32(0x80008000)
                parts = [(shift(v, 4) & m7, shift(v, 8) & sg) if lo else (shift(v, -4) & m7, v & sg)
                         for v in (v01, v23) for lo in (True, False)]
            o = []
            for mag, sgn in parts:
                r = np.empty(128, np.uint32)
                r[one] = bf16x2_mul(mag[one], sc[h][one])
                r[~one] = bf16x2_mul(bf16x2_mul(mag[~one], fa[h][~one]), sc[h][~one])
                o.append(r ^ sgn)
            quad = np.stack(o, 1).astype("<u4").view(np.uint8)  # [t, 16]
            for r in range(128):
                a = at + wg.swz(r, b)
                assert self.base + c.a + s * ATILE <= a and a + 16 <= self.base + c.a + (s + 1) * ATILE
                self.smem[a:a + 16] = quad[r]
        for _ in range(128):  # fence.proxy.async, then mbarrier.arrive
            self.full[s].arrive(i // c.st)

    # ---- the consumer warpgroups (fd_consume, bw_idle) ----
    def operand(self, d: int, rows: int, lo: int, hi: int) -> np.ndarray:
        """The shared-memory addresses of the rows x 16 bf16 operand descriptor d names (K-major,
        128-byte swizzle: address bits [4, 7) XOR [7, 10)), [rows, 16] of the low bytes."""
        start, sbo = (d & 0x3FFF) << 4, ((d >> 32) & 0x3FFF) << 4
        assert d >> 62 == 1 and (d >> 49) & 7 == (start >> 7) & 7, "128B swizzle, base offset of the start"
        m = np.arange(rows)[:, None]
        k = np.arange(16)[None, :]
        addr = start + (m % 8) * 128 + (m // 8) * sbo + 2 * k
        addr = addr ^ (((addr >> 7) & 7) << 4)
        assert addr.min() >= self.base + lo and addr.max() + 1 < self.base + hi, "an operand outside its tile"
        return addr

    def values(self, addr: np.ndarray) -> np.ndarray:
        bits = self.smem[addr].astype(np.uint16) | (self.smem[addr + 1].astype(np.uint16) << 8)
        return formats.bf16_to_f32(bits).astype(np.float64)

    def consume(self, wgi: int, out: dict):
        C, M = self.g["C"], self.g["M"]
        n = 256 if M > 128 else 128 if M > 64 else 64  # the wgmma N
        acc = np.zeros((64, n))
        flight = None
        ST, c = self.c.st, self.c
        for i in range(C):
            s = i % ST
            yield lambda s=s, i=i: (self.poll_full(s), self.full[s].done((i // ST) & 1))[1]
            group = []
            for k in range(4):
                aa = self.operand(wg.desc(self.base + c.a + s * ATILE + 8192 * wgi + 32 * k), 64,
                                  c.a + s * ATILE + 8192 * wgi, c.a + s * ATILE + 8192 * (wgi + 1))
                ba = self.operand(wg.desc(self.base + s * TILE + 32 * k), n, s * TILE, (s + 1) * TILE)
                group.append((aa, ba, self.smem[aa].copy(), self.smem[aa + 1].copy(), self.smem[ba].copy(),
                              self.smem[ba + 1].copy()))
            if flight is not None:  # wgmma.wait_group 1: the chunk before retires
                self.retire(flight, acc)
            flight = group
            if i >= 1:
                for _ in range(4):
                    self.empty[(i - 1) % ST].arrive((i - 1) // ST)
            yield lambda: True  # (another role may run between two chunks' wgmmas)
        if flight is not None:
            self.retire(flight, acc)
        out[wgi] = acc

    def retire(self, group: list, acc: np.ndarray) -> None:
        for aa, ba, a0, a1, b0, b1 in group:
            same = all(np.array_equal(x, y) for x, y in ((self.smem[aa], a0), (self.smem[aa + 1], a1),
                                                         (self.smem[ba], b0), (self.smem[ba + 1], b1)))
            assert same, "a wgmma's operand changed while it was in flight"
            acc += self.values(aa) @ self.values(ba).T

    def idle(self):
        ST = self.c.st
        for i in range(self.g["C"]):
            s = i % ST
            yield lambda s=s, i=i: (self.poll_full(s), self.full[s].done((i // ST) & 1))[1]
            for _ in range(4):
                self.empty[s].arrive(i // ST)

    def epilogue(self, wgi: int, acc: np.ndarray, Y: np.ndarray, y0: int, ldy: int, bf: bool) -> None:
        """The accumulator fragments of the warpgroup's 4 warps x 32 lanes to Y (flat, from y0)."""
        M, N, n = self.g["M"], self.g["N"], acc.shape[1]
        for warp in range(4):
            for lane in range(32):
                gq, q = lane >> 2, lane & 3
                r0 = self.n0 + 64 * wgi + 16 * warp + gq
                d = np.zeros(n // 2)
                for i in range(n // 8):
                    for h in range(2):
                        for j in range(2):
                            d[4 * i + 2 * h + j] = acc[16 * warp + gq + 8 * h, 8 * i + 2 * q + j]
                d = d.astype(np.float32)
                for i in range(n // 8):
                    for j in range(2):
                        tok = 8 * i + 2 * q + j
                        if tok < M:
                            for h, r in ((0, r0), (1, r0 + 8)):
                                if r < N:
                                    v = np.array([d[4 * i + 2 * h + j]], np.float32)
                                    Y[y0 + tok * ldy + r] = (formats.round_bf16(v) if bf else v)[0]


def run_block(g: dict, n0: int, Y: np.ndarray, y0: int, ldy: int, bf: bool, smem: int, seed: int) -> None:
    """One block, its roles interleaved at random until all finish."""
    rng = np.random.default_rng(seed)
    b = Block(g, n0, rng, smem)
    accs: dict = {}
    roles = [b.produce()]
    work = []
    for wgi in range(2):
        if n0 + 64 * wgi >= g["N"]:
            roles.append(b.idle())
        else:
            roles.append(b.consume(wgi, accs))
            work.append(wgi)
    waits = [next(r, None) for r in roles]
    while any(w is not None for w in waits):
        live = [k for k, w in enumerate(waits) if w is not None]
        for k in rng.permutation(live):
            if waits[k]():
                waits[k] = next(roles[k], None)
                break
        else:
            raise AssertionError("deadlock: no role can go on")
    for wgi in work:
        b.epilogue(wgi, accs[wgi], Y, y0, ldy, bf)


def launch(fmt: str, X: np.ndarray, segs: np.ndarray, wtab: list, stab: list, Y: np.ndarray, N: int, K: int,
           bf: bool, seed: int) -> None:
    """fp4_experts_linear / fd_fp8_linear (_fd_launch): grid (ceil(N / 128), segments) over segs [nseg
    * 5] (g, row0, rows, x column, y column); X [rows, cols] bf16 bits (its tensor map's extent)."""
    smem, ldy = host_smem(fmt), Y.shape[1]
    yflat = Y.reshape(-1)
    for by in range(segs.size // 5):
        e, row0, rows, xcol, ycol = (int(v) for v in segs[5 * by:5 * by + 5])
        if rows == 0:
            continue
        assert rows <= BN, "a segment of more rows than a block's token tile"
        g = {"fmt": fmt, "X": X, "xrow": row0, "xcol": xcol,
             "W": wtab[e].reshape(-1), "SW": stab[e].reshape(-1), "M": rows, "N": N, "K": K, "gk": K // 32,
             "C": K // 64}
        for bx in range(-(-N // BM)):
            run_block(g, bx * BM, yflat, row0 * ldy + ycol, ldy, bf, smem, seed + 7919 * by + bx)


def fd_order(x: np.ndarray) -> np.ndarray:
    """act_quant_bf16w's K order (fd_store_quad): within each 8, element j at 2j and 4 + j at 2j + 1."""
    m, k = x.shape
    return x.reshape(m, k // 8, 2, 4).transpose(0, 1, 3, 2).reshape(m, k)


def experts(rng: np.random.Generator, E: int, N: int, K: int, exps: tuple[int, int]) -> list:
    """E random FP4 experts [N, K]: (codes, UE8M0 scales, dequantized)."""
    out = []
    for _ in range(E):
        w = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
        sw = rng.integers(*exps, (N, K // 32)).astype(np.uint8)
        out.append((w, sw, formats.dequant_fp4_experts(w, sw, 32)))
    return out


def check(T: int, k: int, E: int, D: int, N: int, exps: tuple[int, int], bf: bool, seed: int) -> float:
    """w1 / w3 (one doubled segment table, y columns 0 and N) then w2 of a MoE of T tokens, top-k of E,
    hidden D, expert width N; raises AssertionError where the emulated kernel goes wrong."""
    rng = np.random.default_rng(seed)
    pop = np.geomspace(1.0, 0.05, E)
    pop[E // 2] = 0.0  # an expert with no pairs
    ids = np.stack([rng.choice(E, k, replace=False, p=pop / pop.sum()) for _ in range(T)])
    order, _, gather, segs = grouped.group(ids, E, BN, N)
    P = order.size
    e_sorted = ids.reshape(-1)[order]
    x = formats.round_bf16(rng.standard_normal((T, D)).astype(np.float32))
    xp = x[gather]
    w13 = experts(rng, 2 * E, N, D, exps)
    y = np.full((P, 2 * N), np.nan, np.float32)
    launch(FP4, formats.f32_to_bf16(fd_order(xp)), segs, [w[0] for w in w13], [w[1] for w in w13], y, N, D, bf,
           seed)
    want = np.empty((P, 2 * N))
    for h in range(2):
        for e in range(E):
            rows = np.flatnonzero(e_sorted == e)
            want[rows, h * N:(h + 1) * N] = xp[rows].astype(np.float64) @ w13[e + h * E][2].astype(np.float64).T
    err = rel_err(y, want, bf)
    if N % 64:  # (w2's K is N: whole chunks only)
        assert err < (2 ** -8 if bf else 1e-6), err
        return err
    w2 = experts(rng, E, D, N, exps)
    hp = formats.round_bf16(rng.standard_normal((P, N)).astype(np.float32))
    out = np.full((P, D), np.nan, np.float32)
    launch(FP4, formats.f32_to_bf16(fd_order(hp)), segs[:segs.size // 2], [w[0] for w in w2],
           [w[1] for w in w2], out, D, N, bf, seed + 1)
    want2 = np.empty((P, D))
    for e in range(E):
        rows = np.flatnonzero(e_sorted == e)
        want2[rows] = hp[rows].astype(np.float64) @ w2[e][2].astype(np.float64).T
    err = max(err, rel_err(out, want2, bf))
    assert err < (2 ** -8 if bf else 1e-6), err
    return err


def scale_bytes(sw: np.ndarray, block: tuple[int, int], n: int, k: int) -> np.ndarray:
    """engine/ops/gpu/fp4_experts.fd_scale_bytes: power-of-two f32 block scales [ceil(n / bn), gk] as
    UE8M0 bytes per row and 32 of K [n, k / 32] (their exponent fields)."""
    e8 = ((sw.astype(np.float32).view(np.uint32) >> 23) & 0xFF).astype(np.uint8)
    return np.repeat(e8[:, np.arange(k // 32) * 32 // block[1]], block[0], axis=0)[:n].copy()


def check_fp8(M: int, N: int, K: int, block: tuple[int, int], exps: tuple[int, int], bf: bool, seed: int,
              groups: int = 1) -> float:
    """gemm_fd_fp8_sm90 on x [M, groups * K] (bf16 values in act_quant_bf16w's order) and a
    block-diagonal FP8 weight of `groups` row groups [N, K] with power-of-two block scales 2^(e - 127),
    e in exps, in segments of up to 256 rows per group; raises AssertionError where it goes wrong."""
    rng = np.random.default_rng(seed)
    bn, bk = block
    x = formats.round_bf16(rng.standard_normal((M, groups * K)).astype(np.float32))
    ws, ss, wd = [], [], []
    for _ in range(groups):
        w = (rng.integers(0, 256, (N, K)) & 0xF7).astype(np.uint8)  # (no NaN codes)
        sw = np.ldexp(1.0, rng.integers(*exps, (-(-N // bn), -(-K // bk))) - 127).astype(np.float32)
        ws.append(w)
        ss.append(scale_bytes(sw, block, N, K))
        wd.append(formats.dequant_fp8_blocks(w, sw, block).astype(np.float64))
    segs = np.array([(g, r, min(BN, M - r), g * K, g * N) for g in range(groups) for r in range(0, M, BN)],
                    np.int32).reshape(-1)
    y = np.full((M, groups * N), np.nan, np.float32)
    launch(FP8, formats.f32_to_bf16(np.concatenate([fd_order(x[:, g * K:(g + 1) * K]) for g in range(groups)], 1)),
           segs, ws, ss, y, N, K, bf, seed)
    want = np.concatenate([x[:, g * K:(g + 1) * K].astype(np.float64) @ wd[g].T for g in range(groups)], 1)
    err = rel_err(y, want, bf)
    assert err < (2 ** -8 if bf else 1e-6), err
    return err


def rel_err(y: np.ndarray, want: np.ndarray, bf: bool) -> float:
    assert not np.isnan(y).any(), "an output element was never written"
    return float((np.abs(y - want).max(1) / np.maximum(np.abs(want).max(1), 1e-30)).max())


CASES = (  # (T, k, E, D, N, scale exponents, bf16 Y, seed): segments of 1 to 256 rows (the wgmma N
    # 64 / 128 / 256), an expert with none; K of 1, 3, 5, 9 chunks (fewer than FD_LAG, rings that
    # wrap); N between tiles and with a consumer warpgroup idle (N % 128 <= 64); N * K / 32 scale bytes
    # ending inside a word (wg_cp4_clip; odd N, so no w2); scales past 2^1 (the decode's two-multiply
    # path, alone or beside a small one in a row); scales down to 2^-126 (subnormal products)
    (90, 3, 6, 64, 192, (110, 135), False, 0),
    (30, 2, 3, 128, 64, (1, 12), False, 4),
    (150, 2, 5, 320, 131, (118, 150), True, 1),
    (300, 2, 3, 192, 64, (100, 140), False, 2),
    (40, 2, 4, 576, 320, (120, 132), False, 3),
)


FP8_CASES = (  # (M, N, K, block, scale exponents, bf16 Y, seed[, groups]): tiles of 64 / 128 / 256
    # token rows and two segments; N between tiles, a consumer warpgroup idle; K of 1, 2, 5 chunks (a
    # 3-stage ring that wraps); 32 x 32 and 128 x 128 blocks; scales past 2^7 (two multiplies) and
    # down to 2^-124, the least fd_fp8_takes allows (subnormal products, the smallest exact); wo_a's
    # block-diagonal groups (x and y columns per group)
    (300, 192, 320, (128, 128), (110, 140), False, 5),
    (70, 131, 128, (32, 32), (3, 20), True, 6),
    (20, 320, 64, (32, 32), (118, 136), False, 7, 2),
)


def main() -> int:
    bad = 0
    for case in CASES:
        T, k, E, D, N, exps, bf, seed = case
        try:
            err = check(*case)
            print(f"fp4 T {T} k {k} E {E} D {D} N {N} exponents {exps} bf16 {bf}: max row rel err {err:.1e}")
        except AssertionError as e:
            print(f"fp4 T {T} k {k} E {E} D {D} N {N}: FAILS: {e}")
            bad += 1
    for case in FP8_CASES:
        try:
            err = check_fp8(*case)
            print(f"fp8 M {case[0]} N {case[1]} K {case[2]} block {case[3]} exponents {case[4]}: max row rel err "
                  f"{err:.1e}")
        except AssertionError as e:
            print(f"fp8 {case[:4]}: FAILS: {e}")
            bad += 1
    print("ok" if not bad else f"{bad} case(s) fail")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
