#!/usr/bin/env python3
"""Writes to the A registers of a wgmma still in flight, found in a kernel's SASS; no GPU needed.

A wgmma.mma_async with A from registers (HGMMA ... R<a>, gdesc) reads R<a> .. R<a + 3> until a
wgmma.wait_group retires it (WARPGROUP.DEPBAR.LE gsb0, N: the HGMMAs issued before it, all but the
newest N). ptxas does not always keep those registers: where a kernel's fragments were plain copies
of loaded words (gemm_bf16w) or were converted into temporaries and assigned after the wait, its
register moves at a K loop's chunk boundary wrote them while the wgmma was in flight, and the
products were wrong, with no C7513 warning. This tool walks each function's listing in address order
(branches are not followed: a loop's body is straight-line code here) and reports every such write.

    python3 tools/dev/wgmma_hazards.py [kernel ...]     (default: every kernels/*.cu, sm_90a)

It needs cuobjdump and the nvdisasm it runs (pip packages nvidia-cuda-cuobjdump==13.*,
nvidia-cuda-nvdisasm==13.*) besides NVRTC.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import check_kernels  # noqa: E402

from engine.ops import kernels  # noqa: E402

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_FUNC = re.compile(r"^\s*Function : (\S+)")
_RS_HGMMA = re.compile(r"\bHGMMA\.\S+ R\d+, R(\d+), gdesc")
_DEPBAR = re.compile(r"\bWARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)")
_NO_REG_DEST = ("ST", "RED", "ATOM", "BRA", "BAR", "SYNCS", "HGMMA", "WARPGROUP", "EXIT", "RET", "CALL",
                "MEMBAR", "FENCE", "ARRIVES", "NOP", "BSSY", "BSYNC", "DEPBAR", "LDGDEPBAR", "ERRBAR")


def _written(op: str, dest: str) -> set[int]:
    """The general registers an instruction writes (its first operand), by its width."""
    m = re.fullmatch(r"R(\d+)", dest)
    if not m or op.startswith(_NO_REG_DEST) or op.endswith("SETP"):
        return set()
    if op.startswith("LDSM"):  # ldmatrix: one register per 8x8 matrix (.x1 / .x2 / .x4: ...M88, .2, .4)
        width = 4 if op.endswith(".4") else 2 if op.endswith(".2") else 1
    else:
        width = 4 if ".128" in op else 2 if (".64" in op or op.startswith("CS2R") or ".WIDE" in op) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def hazards(listing: str) -> list[str]:
    """Each write to an in-flight RS HGMMA's A registers in cuobjdump's SASS listing, as text."""
    found, func, inflight = [], "?", []
    for line in listing.splitlines():
        f = _FUNC.match(line)
        if f:
            func, inflight = f.group(1), []
            continue
        m = _LINE.match(line)
        if not m:
            continue
        addr, body = m.group(1), m.group(2)
        h = _RS_HGMMA.search(body)
        if h:
            inflight.append((addr, set(range(int(h.group(1)), int(h.group(1)) + 4))))
            continue
        d = _DEPBAR.search(body)
        if d:
            keep = int(d.group(1), 16)
            inflight = inflight[len(inflight) - keep:] if keep else []
            continue
        toks = body.split()
        if toks and toks[0].startswith("@"):
            toks = toks[1:]
        if len(toks) < 2:
            continue
        hit = _written(toks[0], toks[1].rstrip(","))
        for at, regs in inflight:
            if hit & regs:
                found.append(f"{func} {addr}: {body} writes R{min(hit & regs)}.., read by the HGMMA at {at}")
    return found


def cuobjdump() -> str | None:
    """The cuobjdump binary: on PATH, or the nvidia-cuda-cuobjdump wheel's."""
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cand in Path(root).glob("cu*/bin/cuobjdump"):
            return str(cand)
    return None


def sass(name: str, arch: str = "90a") -> str:
    """cuobjdump's SASS listing of kernels/<name>.cu for sm_<arch>."""
    exe = cuobjdump()
    if exe is None:
        raise RuntimeError("cuobjdump not found (pip install nvidia-cuda-cuobjdump==13.* nvidia-cuda-nvdisasm==13.*)")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{name}.cubin"
        path.write_bytes(check_kernels.cubin(name, arch))
        # (cuobjdump -sass runs nvdisasm, from its own directory in the wheels' layout)
        env = dict(os.environ, PATH=os.pathsep.join([str(Path(exe).parent), os.environ.get("PATH", "")]))
        return subprocess.run([exe, "-sass", str(path)], check=True, capture_output=True, text=True, env=env).stdout


def main() -> int:
    names = sys.argv[1:] or [p.stem for p in kernels.kernel_files()]
    bad = 0
    for name in names:
        for h in hazards(sass(name)):
            print(f"{name}.cu: {h}")
            bad += 1
    print(f"{bad} write(s) to in-flight wgmma A registers")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
