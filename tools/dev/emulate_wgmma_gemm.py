"""Emulate kernels/fp8_gemm.cu gemm_e4m3_{fp8,fp4}_sm90 (the wgmma kernel, kernels/fp8_wgmma.cuh) in
numpy and compare its Y with a plain product; no GPU needed. Exits non-zero on a mismatch.

What is emulated, with the kernel's constants parsed from its #defines (WG_*), and its host-side
sizes read from engine/ops/gpu/fp8_linear.py:
- shared memory as flat bytes at absolute addresses, the ring placed as the kernel places it (its
  dynamic buffer deliberately not 1024-aligned, so the alignment pad is exercised);
- the producer warpgroup's every cp.async: destination (the 128B swizzle as the kernel computes it),
  source and source size (zero fill), bounds (no byte read outside an array: a copy reads its whole size
  unless its src-size is 0, as compute-sanitizer counts it; even at src-size 0
  the pointer must be valid) and alignment; FP4's staging, expansion of nibbles into e4m3 and of
  UE8M0 bytes into f32;
- the mbarrier protocol: arrival counts, phases and the parities the threads wait on (PTX ISA
  "mbarrier": try_wait.parity(p) is true once the phase of parity p has completed; a fresh
  barrier counts as having completed the phase of parity 1); cp.async copies land at the latest
  moment the protocol allows (when the barrier their arrive-on feeds is polled, or at
  cp.async.wait_group), so data read before its barrier completes is stale and shows up as an error;
  each arrival is checked to belong to the barrier's current phase;
- each wgmma operand read through its descriptor as the PTX ISA documents it, not as the kernel
  means it: section "Matrix Descriptor Format" (bits 0-13 start address >> 4, 16-29 leading byte
  offset >> 4, 32-45 stride byte offset >> 4, 49-51 base offset, 62-63 swizzle mode, 1 = 128B) and
  "Shared Memory Matrix Layout" (canonical K-major layout with 128-byte swizzling, T = 16 one-byte
  elements per 16 bytes: Swizzle<3,4,3> o ((8,m),(T,2k)):((8T,SBO),(1,T)); the swizzle XORs address
  bits [4,7) with bits [7,10) of the address, the pattern repeating every 1024 bytes; the base offset
  is (start >> 7) & 7 when the start is not on that pattern's boundary; LBO is not used by swizzled
  K-major layouts whose K extent fits the swizzle width). Moving the start by 32 bytes per k32 step
  inside a swizzled row is what DeepGEMM's sm90 FP8 GEMM does too;
- the wgmma m64nNk32 accumulator fragment (PTX ISA "Register Fragments" for wgmma .m64nNk32 D: thread
  lane of warp w holds rows 16 w + lane / 4 (+ 8) and columns 8 i + 2 (lane % 4) (+ 1)), the promotion
  with the scales in f32 in the kernel's order, and the bounded epilogue.
The tensor core's sum of one k32 step is taken exact (float64), then rounded to f32.
"""

import ast
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from engine.checkpoint import formats  # noqa: E402
from engine.ops.kernels import FMT_FP4, FMT_FP8  # noqa: E402

SRC = (ROOT / "kernels" / "fp8_wgmma.cuh").read_text()
D = {k: int(v) for k, v in re.findall(r"^#define (WG_\w+) (\d+)", SRC, re.MULTILINE)}
BM, BN, BK, LAG = D["WG_BM"], D["WG_BN"], D["WG_BK"], D["WG_LAG"]
TILE, SCALE, STG = D["WG_TILE_BYTES"], D["WG_SCALE_BYTES"], D["WG_STG_BYTES"]
assert TILE == BM * BK == BN * BK and SCALE == 4 * (BK // 32) * BM and STG == BN * BK // 2 + 8 * BN
assert D["WG_THREADS"] == 3 * 128 and BM == 2 * 64 and BK == 128


def host_constants() -> dict:
    """WG_* and wgmma_smem() of engine/ops/gpu/fp8_linear.py (which imports CuPy: read, not imported)."""
    tree = ast.parse((ROOT / "engine/ops/gpu/fp8_linear.py").read_text())
    keep = [n for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, (ast.Name, ast.Tuple)) and "WG_" in ast.unparse(t) for t in n.targets)]
    keep += [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "wgmma_smem"]
    ns = {"FMT_FP8": FMT_FP8, "FMT_FP4": FMT_FP4}
    exec(compile(ast.Module(keep, []), "fp8_linear", "exec"), ns)
    return ns


class Layout:
    """WgCfg<FMT> of the kernel: byte offsets from the 1024-aligned ring base."""

    def __init__(self, fmt):
        self.st = D["WG_STAGES_FP8"] if fmt == FMT_FP8 else D["WG_STAGES_FP4"]
        st = self.st
        self.A, self.B, self.SA = 0, st * TILE, 2 * st * TILE
        self.SW = self.SA + st * SCALE
        self.STG = self.SW + st * SCALE
        self.BAR = self.STG + (0 if fmt == FMT_FP8 else st * STG)
        self.SCR = self.BAR + 16 * st
        self.end = self.SCR + (0 if fmt == FMT_FP8 else st * D["WG_SCRATCH_BYTES"])
        self.full_count = 128 if fmt == FMT_FP8 else 256


def swz(r, c):  # wg_swz
    return r * 128 + ((c ^ (r & 7)) << 4)


class Mbar:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self, phase):
        assert phase == self.phase, f"an arrival for phase {phase} while the barrier is in phase {self.phase}"
        self.pending -= 1
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def done(self, parity):  # mbarrier.try_wait.parity
        return (self.phase & 1) != parity


def byte_perm(x, y, s):  # __byte_perm, selectors with bit 3 clear: byte j of the result is byte (s >> 4j) & 7 of y:x
    x, y, s = np.broadcast_arrays(np.uint32(x), np.uint32(y), np.uint32(s))
    b = np.stack([(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)], -1)
    sel = np.stack([(s >> (4 * j)) & 7 for j in range(4)], -1)
    picked = np.take_along_axis(b, sel.astype(np.int64), -1).astype(np.uint32)
    return sum(picked[..., j] << np.uint32(8 * j) for j in range(4)).astype(np.uint32)


E2M1_LO, E2M1_HI = 0x3C383000, 0x4C484440


def e2m1_table(d):  # kernels/fp8_mma.cuh: the magnitudes' table times 2^d, as uint32 arithmetic
    d = int(d)
    return (E2M1_LO + ((8 * d) & 0xFFFFFFFF) * 0x01010100) & 0xFFFFFFFF, \
        (E2M1_HI + ((8 * d) & 0xFFFFFFFF) * 0x01010101) & 0xFFFFFFFF


def e2m1x4_to_e4m3(h, lo=E2M1_LO, hi=E2M1_HI):  # kernels/fp8_mma.cuh, on uint32 arrays
    mag = byte_perm(np.uint32(lo), np.uint32(hi), h & np.uint32(0x7777))
    u = byte_perm(h, np.uint32(0), np.uint32(0x1100))
    sgn = ((u << np.uint32(4)) & np.uint32(0x00FF00FF)) | (u & np.uint32(0xFF00FF00))
    return mag | (sgn & np.uint32(0x80808080))


def e2m1x32_to_e4m3(v, lo=E2M1_LO, hi=E2M1_HI):  # 16 bytes of nibbles -> 32 e4m3 bytes in order
    w = v.view("<u4").astype(np.uint32)
    out = np.stack([e2m1x4_to_e4m3(w, lo, hi), e2m1x4_to_e4m3(w >> np.uint32(16), lo, hi)], 1)  # [word, half]
    return out.astype("<u4").view(np.uint8).reshape(32)


class Block:
    """One thread block of the kernel: its shared memory, barriers and the two roles."""

    RAW = 0x400 + 0x90  # the dynamic buffer's address (16-aligned, not 1024-aligned)

    def __init__(self, fmt, g, m0, n0, smem_bytes):
        self.fmt, self.g, self.m0, self.n0, self.L = fmt, g, m0, n0, Layout(fmt)
        self.base = self.RAW + ((1024 - (self.RAW & 1023)) & 1023)
        self.limit = self.RAW + smem_bytes
        assert self.base + self.L.end <= self.limit, "the ring overflows the dynamic smem"
        self.smem = np.full(self.limit, 0xEE, np.uint8)  # garbage until written
        self.full = [Mbar(self.L.full_count) for _ in range(self.L.st)]
        self.empty = [Mbar(8) for _ in range(self.L.st)]
        self.deferred = {s: [] for s in range(self.L.st)}  # cp.async arrive-ons not yet fired
        self.unlanded = [[] for _ in range(128)]  # each producer thread's copies not yet landed
        self.uncommitted = [[] for _ in range(128)]
        self.groups = [[] for _ in range(128)]  # committed cp.async groups
        self.folds = []  # FP4: each stage's choice (scales folded into the codes or not)

    # ---- producer ----
    def cp(self, t, dst, name, off, size, src_size):
        arr = self.g[name]
        assert dst % size == 0 and off % size == 0, (name, dst, off, size)
        # (a copy reads its whole size from src unless src-size is 0)
        assert 0 <= off and off + (size if src_size else 1) <= arr.size, f"cp.async reads outside {name}: {off}"
        assert self.base <= dst and dst + size <= self.base + self.L.BAR, "cp.async writes outside the ring"
        data = np.zeros(size, np.uint8)
        data[:src_size] = arr[off : off + src_size]
        copy = [dst, data, False]
        self.unlanded[t].append(copy)
        self.uncommitted[t].append(copy)

    def cp4_clip(self, t, dst, name, off, n):  # wg_cp4_clip: a word the array ends inside, stored at once
        if n in (0, 4):
            self.cp(t, dst, name, off, 4, n)
        else:
            arr = self.g[name]
            assert 0 <= off and off + n <= arr.size, f"loads outside {name}"
            self.smem[dst : dst + 4] = 0
            self.smem[dst : dst + n] = arr[off : off + n]

    def land(self, copies):
        for c in copies:
            if not c[2]:
                self.smem[c[0] : c[0] + c[1].size] = c[1]
                c[2] = True

    def arrive_cp_async(self, t, s, phase):  # cp.async.mbarrier.arrive.noinc: all this thread's prior copies
        self.deferred[s].append((self.unlanded[t], phase))
        self.unlanded[t] = []

    def commit_and_wait(self, t, keep):  # cp.async.commit_group, then wait_group keep (None: no wait)
        self.groups[t].append(self.uncommitted[t])
        self.uncommitted[t] = []
        if keep is not None:
            for grp in self.groups[t][: max(0, len(self.groups[t]) - keep)]:
                self.land(grp)

    def produce(self, kt, i):  # stage kt of K, the i-th of the block's run (ring slot i % ST)
        g, L, n0, fmt = self.g, self.L, self.n0, self.fmt
        N, K, bn, bk, gk = g["N"], g["K"], g["bn"], g["bk"], g["gk"]
        s, k0 = i % L.st, kt * BK
        nkk = min(4, (K - k0) // 32)
        assert self.empty[s].done(((i // L.st) & 1) ^ 1), "producer ran ahead of the empty barrier"
        at, bt = self.base + L.A + s * TILE, self.base + L.B + s * TILE
        sa, sw = self.base + L.SA + s * SCALE, self.base + L.SW + s * SCALE
        for t in range(128):
            r8, c8, r4, c4 = t >> 3, t & 7, t >> 2, t & 3
            w_ok = n0 + t < N
            self.copy_a(t, at, sa, k0, nkk)
            if fmt == FMT_FP8:
                if c8 < 2 * nkk:
                    w_row = min(n0 + r8, N - 1) * K + 16 * c8 + k0
                    self.copy_rows(t, bt + swz(r8, c8), "W", w_row, 16 * K, N - n0 - r8, 8, 16)
                row = (n0 + t) // bn * gk if w_ok else 0
                for kk in range(nkk):
                    self.cp(t, sw + 4 * (128 * kk + t), "SW", 4 * (row + (k0 + 32 * kk) // bk), 4, 4 if w_ok else 0)
                self.arrive_cp_async(t, s, i // L.st)
            else:
                stg = self.base + L.STG + s * STG
                if c4 < nkk:
                    self.copy_rows(t, stg + 64 * r4 + 16 * c4, "W", min(n0 + r4, N - 1) * (K // 2) + 16 * c4 + k0 // 2,
                                   16 * K, N - n0 - r4, 4, 32)
                b0 = ((n0 + t) * gk + k0 // 32) & ~3
                left = N * gk - b0
                n0b = min(max(left, 0), 4) if w_ok else 0
                n1 = min(max(left - 4, 0), 4) if w_ok else 0
                self.cp4_clip(t, stg + 8192 + 8 * t, "SW", b0 if n0b else 0, n0b)
                self.cp4_clip(t, stg + 8192 + 8 * t + 4, "SW", b0 + 4 if n1 else 0, n1)
                self.arrive_cp_async(t, s, i // L.st)
                self.commit_and_wait(t, LAG if i >= LAG else None)
        if fmt == FMT_FP4 and i >= LAG:
            self.expand(kt - LAG, i - LAG)

    def copy_a(self, t, at, sa, k0, nkk):  # the A tile's chunks and row t's scales of thread t
        M, K, m0 = self.g["M"], self.g["K"], self.m0
        r8, c8, a_ok, nbk = t >> 3, t & 7, m0 + t < M, K // 32
        if c8 < 2 * nkk:
            a_row = min(m0 + r8, M - 1) * K + 16 * c8 + k0
            self.copy_rows(t, at + swz(r8, c8), "A", a_row, 16 * K, M - m0 - r8, 8, 16)
        for kk in range(nkk):
            self.cp(t, sa + 4 * (128 * kk + t), "SA", 4 * ((m0 + t if a_ok else 0) * nbk + k0 // 32 + kk), 4,
                    4 if a_ok else 0)

    def copy_rows(self, t, dst, name, src, step, rows, ni, row_step):  # wg_copy_rows<NI, ROWS>
        for i in range(ni):
            ok = row_step * i < rows
            self.cp(t, dst + 2048 * i, name, src + step * i if ok else src, 16, 16 if ok else 0)

    def drain(self, kt0, T):
        for t in range(128):  # cp.async.wait_all
            self.commit_and_wait(t, 0)
        for pos in range(max(0, T - LAG), T):
            self.expand(kt0 + pos, pos)

    def expand(self, kt, pos):  # wg_expand_fp4, all 128 producer threads (bar.sync 1, 128 in the middle)
        L, g, n0 = self.L, self.g, self.n0
        s, k0, gk = pos % L.st, kt * BK, g["gk"]
        nkk = min(4, (g["K"] - k0) // 32)
        stg, bt = self.base + L.STG + s * STG, self.base + L.B + s * TILE
        sw = self.base + L.SW + s * SCALE
        scr = self.base + L.SCR + s * D["WG_SCRATCH_BYTES"]

        def expo(r, kk):  # row r's clamped exponent byte of step kk, from the staged window
            off = ((n0 + r) * gk + k0 // 32) & 3
            return min(max(int(self.smem[stg + 8192 + 8 * r + off + kk]), 1), 254)

        ints = np.zeros(33, np.int32)
        for warp in range(4):  # __reduce_max_sync / __reduce_min_sync, lane 0 writes
            for kk in range(4):
                es = [expo(t, kk) for t in range(32 * warp, 32 * warp + 32) if n0 + t < g["N"] and kk < nkk]
                ints[4 * warp + kk] = max(es, default=0)
                ints[16 + 4 * warp + kk] = min(es, default=255)
        self.smem[scr : scr + 128] = ints[:32].view(np.uint8)
        sc = self.smem[scr : scr + 128].view(np.int32)  # read back after the barrier
        mx = [max(sc[kk], sc[4 + kk], sc[8 + kk], sc[12 + kk]) for kk in range(4)]
        mn = [min(sc[16 + kk], sc[20 + kk], sc[24 + kk], sc[28 + kk]) for kk in range(4)]
        fold = all(mx[kk] - mn[kk] <= 11 for kk in range(nkk))
        eref = [min(mn[kk] + 5, 254) for kk in range(4)]
        for t in range(128):
            c = t & 3
            for i in range(4):
                r = (t >> 2) + 32 * i
                if c < nkk:
                    v = self.smem[stg + 64 * r + 16 * c : stg + 64 * r + 16 * c + 16]
                    # folded: the kernel's lookup in row r's table times 2^(e_r - eref)
                    out = e2m1x32_to_e4m3(v, *(e2m1_table(expo(r, c) - eref[c]) if fold else (E2M1_LO, E2M1_HI)))
                    self.smem[bt + swz(r, 2 * c) : bt + swz(r, 2 * c) + 16] = out[:16]
                    self.smem[bt + swz(r, 2 * c + 1) : bt + swz(r, 2 * c + 1) + 16] = out[16:]
            ok = n0 + t < g["N"]
            for kk in range(nkk):
                if fold:
                    val = np.uint32(eref[kk] << 23).view(np.float32)
                else:
                    val = np.float32(2.0 ** (expo(t, kk) - 127)) if ok else np.float32(0)
                at = sw + 4 * (128 * kk + t)
                self.smem[at : at + 4] = np.frombuffer(np.float32(val).tobytes(), np.uint8)
        self.smem[scr + 128 : scr + 132] = np.frombuffer(np.int32(fold).tobytes(), np.uint8)
        self.folds.append(fold)
        for _ in range(128):
            self.full[s].arrive(pos // L.st)

    # ---- consumers ----
    def poll_full(self, s):
        for copies, phase in self.deferred[s]:
            self.land(copies)
            self.full[s].arrive(phase)
        self.deferred[s] = []

    def operand(self, desc, rows):
        """The rows x 32 e4m3 operand a descriptor names (PTX ISA layout, see the module docstring)."""
        start = (desc & 0x3FFF) << 4
        sbo = ((desc >> 32) & 0x3FFF) << 4
        base_off, mode = (desc >> 49) & 7, desc >> 62
        assert mode == 1, "128B swizzle expected"
        assert base_off == (start >> 7) & 7, "base offset must name the start's place in the swizzle pattern"
        m = np.arange(rows)[:, None]
        k = np.arange(32)[None, :]
        addr = start + (m % 8) * 128 + (m // 8) * sbo + (k % 16) + (k // 16) * 16
        addr = addr ^ (((addr >> 7) & 7) << 4)
        assert addr.min() >= self.base and addr.max() < self.base + self.L.BAR
        return formats.fp8_e4m3_to_f32(self.smem[addr]).astype(np.float64)

    def consume(self, kt, nkk, tot, g32):
        L = self.L
        s = kt % L.st
        self.poll_full(s)
        assert self.full[s].done((kt // L.st) & 1), f"stage {kt}: consumers would wait forever"
        if self.fmt == FMT_FP4:  # wg_stage_any
            scr = self.base + L.SCR + s * D["WG_SCRATCH_BYTES"]
            g32 = bool(self.smem[scr + 128 : scr + 132].view(np.int32)[0])
        sa = self.smem[self.base + L.SA + s * SCALE :][:SCALE].view(np.float32).reshape(4, 128)
        sw = self.smem[self.base + L.SW + s * SCALE :][:SCALE].view(np.float32).reshape(4, 128)
        lane = np.arange(32)
        q = lane & 3
        for wg in range(2):
            if self.m0 + 64 * wg >= self.g["M"]:  # wg_idle: no rows, no wgmma; its warps release the stage
                for _warp in range(4):
                    self.empty[s].arrive(kt // L.st)
                continue
            at = self.base + L.A + s * TILE + 64 * 128 * wg
            bt = self.base + L.B + s * TILE
            for kk in range(nkk):
                da, db = desc(at + 32 * kk), desc(bt + 32 * kk)
                acc = (self.operand(da, 64) @ self.operand(db, BN).T).astype(np.float32)  # [64, 128]
                for warp in range(4):
                    rl = 64 * wg + 16 * warp + (lane >> 2)
                    s0, s1 = sa[kk, rl], sa[kk, rl + 8]
                    for i in range(16):
                        for h, sr in ((0, s0), (1, s1)):
                            for c in range(2):
                                d = acc[16 * warp + (lane >> 2) + 8 * h, 8 * i + 2 * q + c]
                                scale = sr * sw[kk, 32 * (i // 4)] if g32 else sr * sw[kk, 8 * i + 2 * q + c]
                                tot[wg, warp, :, 4 * i + 2 * h + c] += d * scale.astype(np.float32)
            for _warp in range(4):
                self.empty[s].arrive(kt // L.st)

    def epilogue(self, tot, Y):
        M, N = self.g["M"], self.g["N"]
        lane = np.arange(32)
        for wg in range(2):
            for warp in range(4):
                for i in range(16):
                    for h in range(2):
                        for c in range(2):
                            r = self.m0 + 64 * wg + 16 * warp + (lane >> 2) + 8 * h
                            n = self.n0 + 8 * i + 2 * (lane & 3) + c
                            ok = (r < M) & (n < N)
                            Y[r[ok], n[ok]] = tot[wg, warp, ok, 4 * i + 2 * h + c]


def desc(addr):  # wg_desc
    return ((addr & 0x3FFFF) >> 4) | ((D["WG_LBO"] >> 4) << 16) | ((D["WG_SBO"] >> 4) << 32) | (
        D["WG_SWIZZLE_MODE"] << 62)


def run_block(fmt, g, m0, n0, smem_bytes, Y, cls=Block, kt0=0, kt1=None):
    """One block over K's stages kt0 .. kt1 - 1 (all of K by default), its tile written into Y."""
    b = cls(fmt, g, m0, n0, smem_bytes)
    K, bn = g["K"], g["bn"]
    kt1 = -(-K // BK) if kt1 is None else kt1
    T, T4 = kt1 - kt0, min(kt1, K // BK) - kt0
    g32 = fmt == FMT_FP8 and bn % 32 == 0
    tot = np.zeros((2, 4, 32, 64), np.float32)
    kp = kc = 0
    drained = fmt == FMT_FP8
    while kc < T:
        moved = False
        if kp < T and b.empty[kp % b.L.st].done(((kp // b.L.st) & 1) ^ 1):
            b.produce(kt0 + kp, kp)
            kp, moved = kp + 1, True
        elif kp == T and not drained:
            b.drain(kt0, T)
            drained = moved = True
        s = kc % b.L.st
        b.poll_full(s)
        if b.full[s].done((kc // b.L.st) & 1):
            b.consume(kc, 4 if kc < T4 else 2, tot, g32)
            kc, moved = kc + 1, True
        assert moved, f"deadlock: producer at stage {kp}, consumers at {kc}"
    b.epilogue(tot, Y)
    return set(b.folds) if fmt == FMT_FP4 else {g32}


# DENSE_WG's stage range of split z of S (kernels/fp8_gemm.cu), T = ceil(K / WG_BK)
_SPLIT = re.search(r"S > 1 \? 0 : bf, (.+?), (.+?)\);", (ROOT / "kernels" / "fp8_gemm.cu").read_text()).groups()


def split_stages(T, S, z):
    env = {"T": T, "S": S, "z": z}
    return tuple(eval(e.replace("/", "//"), {}, env) for e in _SPLIT)  # noqa: S307 (the kernel's expressions)


def gemm(fmt, A, SA, W, SW, M, N, K, bn, bk, gk, smem_bytes, splits=1):
    """Y from every block; with splits (FP8), each split's blocks into a partial of its own, the
    partials then added in split order (bw_sum_splits)."""
    g = {"A": A.reshape(-1), "SA": SA.astype(np.float32).view(np.uint8).reshape(-1), "W": W.reshape(-1),
         "SW": (SW.astype(np.float32).view(np.uint8) if fmt == FMT_FP8 else SW).reshape(-1),
         "M": M, "N": N, "K": K, "bn": bn, "bk": bk, "gk": gk}
    T, parts, modes = -(-K // BK), [], set()
    covered = []
    for z in range(splits):
        kt0, kt1 = split_stages(T, splits, z)
        covered += list(range(kt0, kt1))
        Y = np.full((M, N), np.nan, np.float32)
        for m0 in range(0, M, BM):
            for n0 in range(0, N, BN):
                modes |= run_block(fmt, g, m0, n0, smem_bytes, Y, kt0=kt0, kt1=kt1)
        parts.append(Y)
    assert covered == list(range(T)), f"the splits' stages do not tile K: {covered}"
    Y = parts[0]
    for part in parts[1:]:
        Y = Y + part
    return Y, modes


def quantized_x(rng, M, K):
    x = (rng.standard_normal((M, K)) * np.exp(rng.uniform(-6, 6, (M, 1)))).astype(np.float32)
    b = x.reshape(M, K // 32, 32)
    s = formats.pow2_ceil_f32(np.maximum(np.abs(b).max(-1), np.float32(1e-4)) * np.float32(1 / 448))
    codes = formats.f32_to_fp8_e4m3(np.clip(b / s[..., None], -448, 448)).reshape(M, K)
    xq = (formats.fp8_e4m3_to_f32(codes).reshape(M, K // 32, 32) * s[..., None]).reshape(M, K)
    return codes, s.astype(np.float32), xq


def check(fmt, M, N, K, block=(32, 32), seed=0, exps=(110, 135), splits=1):
    host = host_constants()
    smem = host["wgmma_smem"](fmt)
    assert host["WG_TILE"] == BM == BN and host["WG_THREADS"] == D["WG_THREADS"]
    assert host["WG_STAGES"][fmt] == Layout(fmt).st
    assert smem <= 232448, "over the opt-in shared memory of a Hopper block"
    rng = np.random.default_rng(seed)
    codes, sa, xq = quantized_x(rng, M, K)
    if fmt == FMT_FP8:
        bn, bk = block
        W = (rng.integers(0, 256, (N, K)) & 0xF7).astype(np.uint8)  # no NaN codes
        SW = (2.0 ** rng.uniform(-10, -5, (-(-N // bn), -(-K // bk)))).astype(np.float32)
        gk = SW.shape[1]
        wd = formats.dequant_fp8_blocks(W, SW, (bn, bk))
    else:
        bn, bk = 1, 32
        W = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
        SW = rng.integers(*exps, (N, K // 32)).astype(np.uint8)
        gk = K // 32
        wd = formats.dequant_fp4_experts(W, SW, 32)
    y, modes = gemm(fmt, codes, sa, W, SW, M, N, K, bn, bk, gk, smem, splits)
    want = xq.astype(np.float64) @ wd.astype(np.float64).T
    assert not np.isnan(y).any(), "an output element was never written"
    err = float((np.abs(y - want).max(1) / np.maximum(np.abs(want).max(1), 1e-30)).max())
    name = "fp8" if fmt == FMT_FP8 else "fp4"
    what = f"exponents {exps}, stages folded" if fmt == FMT_FP4 else f"block={(bn, bk)}, one scale per 32 columns"
    print(f"{name} M={M} N={N} K={K} {what}, {splits} split(s) of K: {sorted(modes)}: max row rel err {err:.2e}")
    assert err < 1e-5, err
    return err


CASES = [  # M, N not multiples of 128; K = 64 (half a stage), K % 128 == 64 (a tail), rings that wrap;
    # FP4 exponents spread over more than 12 values (per-column scales), 12 (stages of both kinds),
    # at most 12 (scales folded into the codes)
    (FMT_FP8, 1, 72, 64, (32, 32)), (FMT_FP8, 130, 200, 320, (32, 32)), (FMT_FP8, 70, 136, 1024, (128, 128)),
    (FMT_FP8, 129, 256, 896, (128, 128)), (FMT_FP8, 3, 130, 192, (64, 64)), (FMT_FP8, 70, 136, 256, (16, 32)),
    (FMT_FP4, 1, 72, 64, (110, 135)), (FMT_FP4, 130, 200, 320, (110, 135)), (FMT_FP4, 70, 136, 1024, (110, 135)),
    (FMT_FP4, 130, 200, 320, (115, 127)), (FMT_FP4, 70, 136, 1024, (120, 132)), (FMT_FP4, 1, 72, 64, (118, 128)),
    (FMT_FP4, 5, 129, 320, (118, 128)),  # N * K / 32 scale bytes not a multiple of 4: the last window clipped
]
# split K (FP8): splits of 1 to 3 stages, a ring that wraps inside a split, the K % 128 tail in the last
SPLIT_CASES = [(FMT_FP8, 130, 136, 1088, (32, 32), 4), (FMT_FP8, 3, 72, 960, (128, 128), 2),
               (FMT_FP8, 70, 200, 2048, (32, 32), 2)]

if __name__ == "__main__":
    for fmt, m, n, k, extra in CASES:
        if fmt == FMT_FP8:
            check(fmt, m, n, k, extra)
        else:
            check(fmt, m, n, k, exps=extra)
    for fmt, m, n, k, block, splits in SPLIT_CASES:
        check(fmt, m, n, k, block, splits=splits)
    print("all cases match")
