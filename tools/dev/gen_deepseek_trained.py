"""Fixtures of DeepSeek's own V4.1 reference forward on TRAINED weights: the FP8 / FP4 copy of
models/demo-v41 (tools/dev/quantize_demo.py), chat prompts of the demo's kind, greedy decoding
(tests/reference/test_deepseek_trained.py).

Random tiny models are a poor judge of numerics (flat, chaotic logits: a last-bit difference
flips an FP8 grid point and the layers amplify it); a trained model's logits are not chaotic, so
here `--numerics deepseek` is held to bf16-level agreement with the reference's faithful mode.

This is a *tool*: it runs outside the repo's runtime and tests, like gen_deepseek_fixtures.py (a
torch venv with the reference package, and ../shared/tools/dsref_golden.py, whose `ref` command
it calls with its own prompts in place of the driver's random ones). It also measures the
reference's self-consistency: the logits of its decode step k against a fresh prefill of the
prompt and its first k greedy ids (same mode), and prints the figures (`figures`).

    python tools/dev/gen_deepseek_trained.py --refpy /path/to/torchvenv/bin/python \
        --ref-pkg /path/to/refpkg --driver ../shared/tools/dsref_golden.py [--out tests/fixtures/deepseek_trained]
    python tools/dev/gen_deepseek_trained.py figures   # our side only, from the committed fixtures
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.dev.quantize_demo import quantize_checkpoint  # noqa: E402

MODES = ("faithful_fix", "statequant_f32_fix")
DECODE = 40
N_SAMPLE, N_TOP = 128, 16
# decode steps re-run as a fresh prefill of the prompt and the ids before them (the reference's
# self-consistency; its faithful prefill logits are kept as fixtures too)
SELF_STEPS = {"faithful_fix": tuple(range(2, DECODE, 3)), "statequant_f32_fix": (4, 20, 36)}
# chat prompts of the demo's kind (module docstrings as the user turn); the third passes the
# sliding window (64), index_topk (64) and, with its answer, the candidate blocks (16 x 8)
PROMPTS = (
    "Read and write ZIP files.",
    "Utilities for with-statement contexts.",
    "JSON (JavaScript Object Notation) is a subset of JavaScript syntax used as a lightweight data "
    "interchange format. This module exposes an API familiar to users of the standard library marshal "
    "and pickle modules: dumps() encodes Python objects as JSON strings, loads() decodes them, and "
    "dump() / load() work on file-like objects. Encoding basic Python object hierarchies, compact "
    "encoding, pretty printing, specializing JSON object decoding and extending the encoder are all "
    "shown in the examples below.",
)
# the driver with our prompts in place of its random ones (prompts_for is its only prompt source)
_DRIVE = ("import json, sys; sys.path.insert(0, sys.argv[1]); import dsref_golden as d; "
          "P = json.load(open(sys.argv[2])); d.prompts_for = lambda vocab, lens, seed: P; "
          "sys.exit(d.main(sys.argv[3:]))")


def prompt_ids(ckpt: Path) -> list[list[int]]:
    from engine.text.chat_encoding import render_messages
    from engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ckpt)
    return [tok.encode_segments(render_messages([{"role": "user", "content": p}], arch="v41", thinking=False))
            for p in PROMPTS]


def weights_sha256(ckpt: Path) -> str:
    return hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()


def run_ref(a: argparse.Namespace, ckpt: Path, prompts: list[list[int]], modes: tuple[str, ...], decode: int,
            work: Path, tag: str) -> tuple[dict, dict]:
    pfile, golden, npz = work / f"{tag}.prompts.json", work / f"{tag}.json", work / f"{tag}.npz"
    pfile.write_text(json.dumps(prompts))
    subprocess.run([a.refpy, "-c", _DRIVE, str(Path(a.driver).resolve().parent), str(pfile), "ref",
                    "--ref-pkg", a.ref_pkg, "--ckpt", str(ckpt), "--out", str(golden), "--npz", str(npz),
                    "--prompt-lens", ",".join(str(len(p)) for p in prompts), "--decode", str(decode),
                    "--modes", ",".join(modes), "--threads", str(a.threads)], check=True)
    return json.loads(golden.read_text()), dict(np.load(npz))


def generate(a: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = quantize_checkpoint(a.src, work / "demo-v41-fp8")
        prompts = prompt_ids(ckpt)
        g, logits = run_ref(a, ckpt, prompts, MODES, DECODE, work, "main")
        # self-consistency: a fresh prefill of prompt + the first k greedy ids, per mode
        self_rel: dict[str, list] = {}
        prefill: dict[str, np.ndarray] = {}
        for mode in MODES:
            ks = SELF_STEPS[mode]
            pre = [prompts[pi] + g["extra_modes"][mode]["ids"][pi][:k] for pi in range(len(prompts)) for k in ks]
            _, lg = run_ref(a, ckpt, pre, (mode,), 1, work, f"self_{mode}")
            rows = []
            for pi in range(len(prompts)):
                steps = logits[f"{mode}_p{pi}"]
                fresh = np.stack([lg[f"{mode}_p{pi * len(ks) + j}"][0] for j in range(len(ks))])
                prefill[f"{mode}_p{pi}"] = fresh
                rows.append([float(np.abs(f - steps[k]).max() / np.abs(steps[k]).max())
                             for f, k in zip(fresh, ks, strict=True)])
            self_rel[mode] = rows
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        sample = np.sort(np.random.default_rng(41).choice(vocab, size=N_SAMPLE, replace=False))
        out: dict[str, np.ndarray] = {}
        for pi, prompt in enumerate(prompts):
            out[f"p{pi}.prompt"] = np.asarray(prompt, dtype=np.int32)
            for mode in MODES:
                steps = logits[f"{mode}_p{pi}"]
                top = np.argsort(-steps, axis=-1, kind="stable")[:, :N_TOP]
                rows = [np.unique(np.concatenate([sample, t])) for t in top]
                width = max(c.size for c in rows)
                cols = np.stack([np.pad(c, (0, width - c.size), mode="edge") for c in rows])
                out[f"p{pi}.{mode}.ids"] = np.asarray(g["extra_modes"][mode]["ids"][pi], dtype=np.int32)
                out[f"p{pi}.{mode}.cols"] = cols.astype(np.int16)
                out[f"p{pi}.{mode}.logits"] = np.take_along_axis(steps, cols, axis=-1).astype(np.float32)
                if mode == "faithful_fix":  # the reference's fresh prefills at SELF_STEPS, same columns
                    ks = list(SELF_STEPS[mode])
                    out[f"p{pi}.{mode}.prefill_steps"] = np.asarray(ks, dtype=np.int32)
                    out[f"p{pi}.{mode}.prefill_logits"] = np.take_along_axis(
                        prefill[f"{mode}_p{pi}"], cols[ks], axis=-1).astype(np.float32)
        dst = Path(a.out)
        dst.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(dst / "demo_v41_fp8.npz", **out)
        meta = {"source": "models/demo-v41 through tools/dev/quantize_demo.py", "weights_sha256": weights_sha256(ckpt),
                "prompts": list(PROMPTS), "decode": DECODE, "modes": list(MODES),
                "reference": g["meta"]["reference"], "decode_rule": g["meta"]["decode"],
                "self_consistency_steps": {m: list(v) for m, v in SELF_STEPS.items()},
                "self_consistency_rel": self_rel,
                "bridges": g["bridges"]}
        (dst / "demo_v41_fp8.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"[gen] {dst / 'demo_v41_fp8.npz'} ({(dst / 'demo_v41_fp8.npz').stat().st_size} B)", file=sys.stderr)
        if a.full:
            np.savez_compressed(a.full, **logits)
        figures(dst, ckpt)
    return 0


@dataclass
class Agreement:
    """One prompt: teacher-forced per-step relative max logit difference (max |ours - ref| /
    max |ref| on the fixture's columns) and argmax agreement; free-running greedy agreement."""

    prompt_len: int
    rel: np.ndarray
    argmax: np.ndarray
    greedy_agree: int
    n: int
    first_divergence: int | None
    rel_prefill: np.ndarray  # against the reference's fresh prefills (where the fixture has them)


def load_model(ckpt: Path, numerics: str):
    from engine.checkpoint.reader import Checkpoint
    from engine.model.config import load_config
    from engine.ops.deepseek_ops import DeepseekOps
    from engine.ops.numpy_ops import NumpyOps
    from engine.runtime.runner import ModelRunner

    cfg = load_config(ckpt)
    ops = DeepseekOps() if numerics == "deepseek" else NumpyOps()
    return ModelRunner(cfg, Checkpoint(ckpt, block_size=cfg.weight_block_size), ops, ckpt / "tokenizer.json")


def compare_case(ckpt: Path, z: dict, numerics: str, mode: str, model=None) -> list[Agreement]:
    """Our `numerics` against the reference's `mode` on every prompt of fixture `z`."""
    model = model or load_model(ckpt, numerics)
    out = []
    n_prompts = len([k for k in z if k.endswith(".prompt")])
    for pi in range(n_prompts):
        prompt, ids = z[f"p{pi}.prompt"].tolist(), z[f"p{pi}.{mode}.ids"].tolist()
        st = model.new_state()
        steps = [model.forward([st], [prompt])[0]]
        for t in ids[:-1]:
            steps.append(model.forward([st], [[t]])[0])
        steps = np.stack(steps)
        ref, cols = z[f"p{pi}.{mode}.logits"], z[f"p{pi}.{mode}.cols"].astype(np.int64)
        rel = np.abs(np.take_along_axis(steps, cols, -1) - ref).max(-1) / np.abs(ref).max(-1)
        st, mine = model.new_state(), []
        logits = model.forward([st], [prompt])[0]
        for i in range(len(ids)):
            mine.append(int(np.argmax(logits)))
            if i < len(ids) - 1:
                logits = model.forward([st], [[mine[-1]]])[0]
        rel_pre = np.zeros(0)
        if f"p{pi}.{mode}.prefill_steps" in z:
            ks = z[f"p{pi}.{mode}.prefill_steps"]
            pre = z[f"p{pi}.{mode}.prefill_logits"]
            rel_pre = np.abs(np.take_along_axis(steps[ks], cols[ks], -1) - pre).max(-1) / np.abs(pre).max(-1)
        first = next((i for i, (x, y) in enumerate(zip(mine, ids, strict=True)) if x != y), None)
        out.append(Agreement(len(prompt), rel, steps.argmax(-1) == np.asarray(ids),
                             sum(int(x == y) for x, y in zip(mine, ids, strict=True)), len(ids), first, rel_pre))
    return out


def figures(fix: Path, ckpt: Path | None = None) -> None:
    """Per prompt and numerics: teacher-forced max / median relative logit difference, argmax
    agreement, free-running greedy agreement; and the reference's own prefill-vs-decode figure."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = ckpt or quantize_checkpoint(REPO / "models" / "demo-v41", Path(tmp) / "q")
        meta = json.loads((fix / "demo_v41_fp8.json").read_text())
        z = dict(np.load(fix / "demo_v41_fp8.npz"))
        for numerics, mode in (("deepseek", "faithful_fix"), ("exact", "statequant_f32_fix"),
                               ("exact", "faithful_fix")):
            for pi, r in enumerate(compare_case(ckpt, z, numerics, mode)):
                print(f"{numerics:8s} vs {mode:18s} p{pi} (prompt {r.prompt_len} tok): rel max {r.rel.max():.2e} "
                      f"median {np.median(r.rel):.2e}; argmax {int(r.argmax.sum())}/{r.argmax.size}; "
                      f"greedy {r.greedy_agree}/{r.n} (first divergence {r.first_divergence})")
        for mode, per in meta["self_consistency_rel"].items():
            for pi, rows in enumerate(per):
                print(f"reference {mode} p{pi}: decode vs its own prefill at steps "
                      f"{meta['self_consistency_steps'][mode]}: rel max {max(rows):.2e} median {np.median(rows):.2e}")
        for pi, r in enumerate(compare_case(ckpt, z, "deepseek", "faithful_fix")):
            print(f"deepseek vs faithful_fix PREFILL p{pi} at its steps: rel max {r.rel_prefill.max():.2e} "
                  f"median {np.median(r.rel_prefill):.2e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", nargs="?", default="generate", choices=("generate", "figures"))
    ap.add_argument("--refpy", help="the torch venv's python")
    ap.add_argument("--ref-pkg", help="the reference package directory")
    ap.add_argument("--driver", help="dsref_golden.py")
    ap.add_argument("--src", default=str(REPO / "models" / "demo-v41"))
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "deepseek_trained"))
    ap.add_argument("--full", default=None, help="also keep the reference's full logits here (.npz)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.cmd == "figures":
        figures(Path(a.out))
        return 0
    if not (a.refpy and a.ref_pkg and a.driver):
        ap.error("generate needs --refpy, --ref-pkg and --driver")
    return generate(a)


if __name__ == "__main__":
    raise SystemExit(main())
