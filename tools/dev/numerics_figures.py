"""Print the numerics figures of the numpy backend against the committed reference fixtures.

- tests/fixtures/deepseek (DeepSeek's own inference/model.py, CPU kernels): `--numerics deepseek`
  against its faithful mode and `--numerics exact` against its float32 mode with state
  quantization; teacher-forced on the reference's greedy ids, and free-running greedy.
- tests/fixtures/ref (transformers' V4 / V4.1 references): `--numerics exact`, prefill logits at
  the fixture's positions and free-running greedy ids.

Relative difference: max |ours - ref| / max |ref| of a step's logits (on the stored columns).

    python tools/dev/numerics_figures.py
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from engine.checkpoint.reader import Checkpoint  # noqa: E402
from engine.model.config import load_config  # noqa: E402
from engine.ops.deepseek_ops import DeepseekOps  # noqa: E402
from engine.ops.numpy_ops import NumpyOps  # noqa: E402
from engine.runtime.runner import ModelRunner as Model  # noqa: E402


def _model(ckpt: Path, ops, tok: Path | None = None) -> Model:
    cfg = load_config(ckpt)
    return Model(cfg, Checkpoint(ckpt, block_size=cfg.weight_block_size), ops, tok or ckpt / "tokenizer.json")


def _greedy(model: Model, prompt: list[int], n: int, forced: list[int] | None = None):
    """(ids, logits per step): free-running, or teacher-forced on `forced`."""
    st, ids = model.new_state(), []
    steps = [model.forward([st], [prompt])[0]]
    for i in range(n):
        ids.append(int(np.argmax(steps[-1])))
        if i < n - 1:
            steps.append(model.forward([st], [[forced[i] if forced else ids[-1]]])[0])
    return ids, np.stack(steps)


def deepseek_fixtures(tmp: Path) -> None:
    fix = REPO / "tests" / "fixtures" / "deepseek"
    for meta_path in sorted(fix.glob("*.json")):
        name, meta = meta_path.stem, json.loads(meta_path.read_text())
        z = dict(np.load(fix / f"{name}.npz"))
        ckpt = tmp / name
        subprocess.run([sys.executable, str(REPO / "dsuf.py"), "tiny-model", str(ckpt), *meta["tiny_model_args"]],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        sha = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(ckpt.glob("*.safetensors")))).hexdigest()
        assert sha == meta["weights_sha256"], name
        for numerics, ops, mode in (("deepseek", DeepseekOps(), "faithful_fix"), ("exact", NumpyOps(), "faithful_fix"),
                                    ("exact", NumpyOps(), "statequant_f32_fix")):
            model = _model(ckpt, ops)
            for pi in range(len(meta["prompt_lens"])):
                prompt, ref_ids = z[f"p{pi}.prompt"].tolist(), z[f"p{pi}.{mode}.ids"].tolist()
                _, steps = _greedy(model, prompt, len(ref_ids), forced=ref_ids)
                ref, cols = z[f"p{pi}.{mode}.logits"], z[f"p{pi}.{mode}.cols"]
                rel = np.abs(np.take_along_axis(steps, cols, -1) - ref).max(-1) / np.abs(ref).max(-1)
                tf = int((steps.argmax(-1) == np.asarray(ref_ids)).sum())
                free, _ = _greedy(model, prompt, len(ref_ids))
                first = next((i for i, (a, b) in enumerate(zip(free, ref_ids, strict=True)) if a != b), len(free))
                print(f"{name} p{pi} (len {len(prompt)}) {numerics:8s} vs {mode:18s} rel max {rel.max():.2e} "
                      f"median {np.median(rel):.2e} first {rel[0]:.2e} | teacher-forced argmax {tf}/{len(ref_ids)} "
                      f"| free-running greedy equal for {first}/{len(ref_ids)}")


def transformers_fixtures() -> None:
    fix = REPO / "tests" / "fixtures" / "ref"
    demo = {"demo_v4": REPO.parent / "shared" / "models" / "demo-v4", "demo_v41_chat": REPO / "models" / "demo-v41",
            "demo_v41_long": REPO / "models" / "demo-v41"}
    tok = REPO / "models" / "demo-v41" / "tokenizer.json"
    for case in sorted(p.name for p in fix.iterdir() if (p / "expected.npz").is_file()):
        d = demo.get(case, fix / case)
        if not (d / "config.json").is_file():
            print(f"{case}: checkpoint not present, skipped")
            continue
        z = np.load(fix / case / "expected.npz")
        model = _model(d, NumpyOps(), d / "tokenizer.json" if (d / "tokenizer.json").is_file() else tok)
        ids = z["input_ids"].tolist()
        logits = model.forward([model.new_state()], [ids], all_logits=True)[0][z["positions"]]
        rel = float(np.abs(logits - z["logits"]).max() / np.abs(z["logits"]).max())
        agree = int((logits.argmax(-1) == z["logits"].argmax(-1)).sum())
        line = f"{case:18s} exact    rel max {rel:.2e} | argmax at {agree}/{len(z['positions'])} positions"
        if "greedy_ids" in z:
            want = z["greedy_ids"].tolist()
            got, _ = _greedy(model, ids, len(want))
            line += f" | free-running greedy {sum(a == b for a, b in zip(got, want, strict=True))}/{len(want)}"
        print(line)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        deepseek_fixtures(Path(tmp))
    transformers_fixtures()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
