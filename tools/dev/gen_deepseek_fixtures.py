"""Fixtures of DeepSeek's own V4.1 reference forward (inference/model.py, its CPU kernels' faithful
mode) for `--numerics deepseek` (tests/reference/test_deepseek_numerics.py).

This is a *tool*: it runs outside the repo's runtime and tests. It needs
- a scratch venv with torch 2.13 CPU (+ transformers, safetensors) and a package holding the
  reference's model.py / engram.py / image_processor.py, a vision.py stub and kernel_cpu.py (see
  ../shared/DESIGN.md, "DeepSeek's own V4.1 reference"), and
- the driver ../shared/tools/dsref_golden.py (its `ref` subcommand).
For each case it writes a random checkpoint with `dsuf.py tiny-model` (seeded, so the test
rebuilds the same bytes and checks their sha256), runs the driver in the `faithful_fix` mode (the
reference as it computes, with the driver's index-key fix so that its decode equals its prefill,
see DESIGN.md) and in `statequant_f32_fix` (float32, the reference's state quantization kept: what
`--numerics exact` computes), and keeps, per prompt, the greedy ids and each step's logits on a
fixed set of columns (a random sample plus the reference's top 16 at that step).

    python tools/dev/gen_deepseek_fixtures.py --refpy /path/to/torchvenv/bin/python \
        --ref-pkg /path/to/refpkg --driver ../shared/tools/dsref_golden.py --out tests/fixtures/deepseek
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
MODES = ("faithful_fix", "statequant_f32_fix")
N_SAMPLE, N_TOP = 384, 16

# tiny-model arguments; every case is V4.1 with FP8 linears (UE8M0 32x32) and FP4 routed experts.
CASES = {
    # 6 layers: [0, 2, 2, 1, 1, 1]: sliding only (hash-routed MoE); the ratio-2 KV source with its
    # indexer and Engram; a ratio-2 layer sharing it; the ratio-1 source (indexer, candidate
    # source); a ratio-1 layer sharing it; a re-index layer filtered by the candidate blocks.
    # Prompts pass the window (64) and index_topk (64) so that both select.
    "ds_v41_all": dict(args=["--layers", "6", "--seed", "41"], lens=[40, 150], decode=10),
    # narrower, smaller window and top-k: the indexer and the candidate blocks cut harder
    "ds_v41_small": dict(args=["--layers", "4", "--hidden", "128", "--window", "32", "--index-topk", "16",
                               "--candidate-blocks", "4", "--vocab", "2048", "--seed", "7"],
                         lens=[24, 100], decode=10),
}


def tiny_args(case: dict) -> list[str]:
    return ["--arch", "v41", "--no-draft", *case["args"]]


def weights_sha256(ckpt: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(ckpt.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def make_case(name: str, case: dict, a: argparse.Namespace, work: Path) -> None:
    ckpt = work / name
    subprocess.run([a.python, str(REPO / "dsuf.py"), "tiny-model", str(ckpt), *tiny_args(case)], check=True,
                   cwd=REPO, stdout=subprocess.DEVNULL)
    golden, npz = work / f"{name}.json", work / f"{name}.npz"
    subprocess.run([a.refpy, a.driver, "ref", "--ref-pkg", a.ref_pkg, "--ckpt", str(ckpt), "--out", str(golden),
                    "--npz", str(npz), "--prompt-lens", ",".join(map(str, case["lens"])),
                    "--decode", str(case["decode"]), "--modes", ",".join(MODES), "--threads", str(a.threads)],
                   check=True)
    g, logits = json.loads(golden.read_text()), dict(np.load(npz))
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(len(name))
    sample = np.sort(rng.choice(vocab, size=min(N_SAMPLE, vocab), replace=False))
    out: dict[str, np.ndarray] = {}
    for pi, prompt in enumerate(g["prompt_ids"]):
        out[f"p{pi}.prompt"] = np.asarray(prompt, dtype=np.int32)
        for mode in MODES:
            steps = logits[f"{mode}_p{pi}"]
            top = np.argsort(-steps, axis=-1, kind="stable")[:, :N_TOP]
            rows = [np.unique(np.concatenate([sample, t])) for t in top]
            width = max(c.size for c in rows)  # (a step's columns padded with its last one)
            cols = np.stack([np.pad(c, (0, width - c.size), mode="edge") for c in rows])
            out[f"p{pi}.{mode}.ids"] = np.asarray(g["extra_modes"][mode]["ids"][pi], dtype=np.int32)
            out[f"p{pi}.{mode}.cols"] = cols.astype(np.int32)
            out[f"p{pi}.{mode}.logits"] = np.take_along_axis(steps, cols, axis=-1).astype(np.float32)
            out[f"p{pi}.{mode}.min_gap"] = np.float32(g["min_gap"][mode][pi])
    dst = Path(a.out)
    dst.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(dst / f"{name}.npz", **out)
    meta = {"tiny_model_args": tiny_args(case), "weights_sha256": weights_sha256(ckpt),
            "prompt_lens": case["lens"], "decode": case["decode"], "modes": list(MODES),
            "reference": g["meta"]["reference"], "decode_rule": g["meta"]["decode"],
            "prompt_rule": g["meta"]["prompt_rule"], "prompt_seed": g["meta"]["prompt_seed"],
            "bridges": g["bridges"]}
    (dst / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"[gen] {name}: {dst / (name + '.npz')} ({(dst / (name + '.npz')).stat().st_size} B)", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refpy", required=True, help="the torch venv's python")
    ap.add_argument("--ref-pkg", required=True, help="the reference package directory")
    ap.add_argument("--driver", required=True, help="dsref_golden.py")
    ap.add_argument("--python", default=sys.executable, help="interpreter for dsuf.py tiny-model")
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "deepseek"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.cases.split(","):
            make_case(name, CASES[name], a, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
