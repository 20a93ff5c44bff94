#!/usr/bin/env python3
"""What a kernel compiles to: the SASS opcode histogram of kernels/<file>.cu's functions (a
developer's tool; NVRTC builds the cubin as the engine does, cuobjdump reads it: the GPU machine
has it, and on any x86-64 machine `pip install nvidia-cuda-cuobjdump` puts one under
site-packages/nvidia/cu13/bin, so static SASS needs no GPU).

    python3 tools/dev/sass_mix.py gemv_q8 tcgemv8_fp4_n1 tcgemv8_fp8_n1 [--arch 90a] [--sass DIR]

Per function: the count of each opcode (its name up to the first '.', predicates dropped) in the
whole function body, most frequent first; --sass DIR also writes each function's full SASS there.
A static count: unrolled loop bodies count once per copy, and what runs per iteration needs the
loop read by hand (ncu's InstructionStats gives the executed mix). Why: ptxas may lower an
instruction very differently than the PTX suggests (Hopper emulates e4m3 mma.sync with f16 MMAs
and conversions), and the count of what a GEMV's inner loop issues is what bounds it.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# an instruction line of cuobjdump -sass: "/*0370*/  @!P0 IMAD.SHL.U32 R1, R2, 0x4, RZ ;"
_INSN = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)[.\s;]")


def opcode_mix(sass: str) -> collections.Counter:
    """Opcode -> count over the instruction lines of a SASS listing."""
    mix: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = _INSN.match(line)
        if m:
            mix[m.group(1)] += 1
    return mix


def cubin(name: str, arch: str) -> bytes:
    """kernels/<name>.cu compiled by NVRTC for sm_<arch> (tools/dev/check_kernels.py's cubin)."""
    import check_kernels

    try:
        return check_kernels.cubin(name, arch)
    except RuntimeError as e:  # (the compile log)
        raise SystemExit(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="kernels/<file>.cu, without the extension")
    ap.add_argument("functions", nargs="+", help="kernel names (extern \"C\")")
    ap.add_argument("--arch", default="90a")
    ap.add_argument("--sass", type=Path, help="write each function's SASS into this folder")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{a.file}.cubin"
        path.write_bytes(cubin(a.file, a.arch))
        for fn in a.functions:
            sass = subprocess.run(["cuobjdump", "-sass", "-fun", fn, str(path)], capture_output=True, text=True,
                                  check=True).stdout
            if a.sass is not None:
                a.sass.mkdir(parents=True, exist_ok=True)
                (a.sass / f"{fn}.sass").write_text(sass)
            mix = opcode_mix(sass)
            print(f"== {fn}: {sum(mix.values())} instructions")
            for op, n in mix.most_common():
                print(f"{n:7d} {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
