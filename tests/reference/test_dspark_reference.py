"""The numpy DSpark draft equals DeepSeek's own V4.1 reference draft forward (fixtures in
tests/fixtures/dspark, made by tools/dev/gen_dspark_fixtures.py from the reference's float32 run
with its FP8 window rounding kept: `statequant_f32`).

Per case: the prompt's prefill collects the target layers' inputs, the draft windows absorb them,
a block is drafted right after the prompt; then one decode step of the main model's token and the
block after it. Compared: the target inputs, the main token, every draft position's logits (with
the Markov bias), the confidence scores and the greedy draft tokens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint.reader import Checkpoint
from engine.checkpoint.tiny_model import tiny_model_main
from engine.model.config import load_config
from engine.ops.numpy_ops import NumpyOps
from engine.runtime.runner import ModelRunner

FIX = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "dspark"
CASES = sorted(p.name for p in FIX.iterdir() if (p / "expected.npz").is_file()) if FIX.is_dir() else []
MODES = ("statequant_f32", "statequant_f32_fix")  # the _fix one where main layers have an indexer
RTOL = 1e-4  # relative to the largest magnitude, as tests/reference/test_reference_logits.py


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


def _checkpoint(name: str, tmp_path_factory) -> Path:
    """The case's checkpoint: committed beside its fixture, or (a `dsuf.py tiny-model` one) rebuilt
    from its recipe, every file checked against the sha256 the generator recorded."""
    d = FIX / name
    recipe = d / "tiny_model.json"
    if not recipe.is_file():
        return d
    r = json.loads(recipe.read_text())
    out = tmp_path_factory.mktemp(name) / "ckpt"
    assert tiny_model_main([str(out), "--arch", "v41", *r["tiny_model_args"]]) == 0
    for f, digest in r["sha256"].items():
        assert hashlib.sha256((out / f).read_bytes()).hexdigest() == digest, f"{name}: rebuilt {f} differs"
    return out


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory):
    d = _checkpoint(request.param, tmp_path_factory)
    cfg = load_config(d)
    ops = NumpyOps()
    tok = d / "tokenizer.json"  # Engram layers hash n-grams with it
    runner = ModelRunner(cfg, Checkpoint(d, block_size=cfg.weight_block_size), ops,
                         tokenizer_json=tok if tok.is_file() else None)
    dsp = runner.model.dspark
    assert dsp is not None
    z = np.load(FIX / request.param / "expected.npz")
    mode = next(m for m in MODES if m + ".draft_ids" in z.files)
    return request.param, runner, dsp, {k.split(".", 1)[1]: z[k] for k in z.files if k.startswith(mode + ".")}, z


def test_target_inputs_and_main_x_match_reference(case) -> None:
    name, runner, dsp, ref, z = case
    targets = dsp.targets
    runner.forward([runner.new_state()], [z["input_ids"].tolist()], targets=targets)
    want = np.split(ref["main_hidden"], len(dsp.target_layer_ids), axis=1)
    for i, w in zip(dsp.target_layer_ids, want, strict=True):
        # bounded replay runs a later layer on the prompt's trailing rows only (at least a window)
        got = targets[i]
        assert min(z["input_ids"].size, dsp.cfg.sliding_window) <= got.shape[0] <= w.shape[0], (name, i)
        assert _rel(got, w[-got.shape[0]:]) < RTOL, (name, i)


def test_draft_after_prefill_and_after_a_decode_step_match_reference(case) -> None:
    name, runner, dsp, ref, z = case
    st, ds = runner.new_state(), dsp.new_state()
    targets = dsp.targets
    logits = runner.forward([st], [z["input_ids"].tolist()], targets=targets)[0]
    tok = int(np.argmax(logits))
    assert tok == ref["main_token"][0]
    dsp.absorb(ds, targets, z["input_ids"].size)
    drafts = [dsp.draft(ds, tok)]
    assert ds.position == z["input_ids"].size  # drafting reads the state, never grows it
    targets = dsp.targets
    logits = runner.forward([st], [[tok]], targets=targets)[0]
    tok2 = int(np.argmax(logits))
    assert tok2 == ref["main_token"][1]
    dsp.absorb(ds, targets, 1)
    drafts.append(dsp.draft(ds, tok2))
    for k, (d, first) in enumerate(zip(drafts, (tok, tok2), strict=True)):
        assert _rel(d.logits, ref["draft_logits"][k]) < RTOL, f"{name} block {k}: logits"
        assert _rel(d.confidence, ref["confidence"][k]) < RTOL, f"{name} block {k}: confidence"
        assert [first, *d.tokens.tolist()] == ref["draft_ids"][k].tolist(), f"{name} block {k}: tokens"
        np.testing.assert_allclose(d.probs.sum(axis=1), 1.0, rtol=1e-5)
