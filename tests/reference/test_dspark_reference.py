"""The numpy DSpark draft equals DeepSeek's own V4.1 reference draft forward (fixtures in
tests/fixtures/dspark, made by tools/dev/gen_dspark_fixtures.py from the reference), in both
numerics:
- `exact` (NumpyOps) against the reference's float32 run with its FP8 window rounding kept
  (`statequant_f32`);
- `deepseek` (DeepseekOps) against the reference's own bf16 run (`faithful`: bf16 activations
  between ops, FP8 block-32 activation quantization before the FP8 / FP4 linears, FP8 window K=V,
  bf16 sparse attention, fp32 gate and heads), the `_fix` one where main layers have an indexer.

Per case: the prompt's prefill collects the target layers' inputs, the draft windows absorb them,
a block is drafted right after the prompt; then one decode step of the main model's token and the
block after it. Compared: the target inputs, the main token, every draft position's logits (with
the Markov bias), the confidence scores and the greedy draft tokens.

Tolerances, relative to the largest magnitude of the quantity. `exact`: RTOL, as
tests/reference/test_reference_logits.py. `deepseek`: each op takes the same bf16 / FP8 values as
the reference's faithful run on these fixtures (the target inputs come out bit for bit equal), so
what remains is the float32 summation order of the GEMMs and reductions (numpy's einsum against
torch's kernels): about 1e-7. DEEPSEEK_RTOL holds it to the float32 comparison's bound, an order
of magnitude under what one quantization point missed or added costs (the draft's collapsed
stream left in float32 instead of bf16: 1.5e-3 to 2.7e-3 on the draft logits) and far under the
`exact` numerics' distance from the same keys (7e-3 to 1). It is also far under the reference's
smallest greedy margin on these fixtures (4e-3 of the largest logit), so the greedy tokens agree by
more than the tolerance, not by chance; the test checks that margin. The bound assumes a value
near a bf16 or FP8 rounding boundary rounds as the reference's does, which holds on these fixtures;
a platform whose summation order moved one across would show here first.
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
from engine.ops.deepseek_ops import DeepseekOps
from engine.ops.numpy_ops import NumpyOps
from engine.runtime.runner import ModelRunner

FIX = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "dspark"
CASES = sorted(p.name for p in FIX.iterdir() if (p / "expected.npz").is_file()) if FIX.is_dir() else []
MODES = ("statequant_f32", "statequant_f32_fix")  # the _fix one where main layers have an indexer
FAITHFUL = ("faithful", "faithful_fix")  # the reference in bf16, as it computes
RTOL = 1e-4  # relative to the largest magnitude, as tests/reference/test_reference_logits.py
DEEPSEEK_RTOL = 1e-4  # deepseek numerics vs the faithful keys (see the module doc)


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
def checkpoint(request, tmp_path_factory):
    return request.param, _checkpoint(request.param, tmp_path_factory)


def _case(checkpoint, ops, modes: tuple) -> tuple:
    """(name, runner on `ops`, its draft, the fixture's keys of the first of `modes` it has, all keys)."""
    name, d = checkpoint
    cfg = load_config(d)
    tok = d / "tokenizer.json"  # Engram layers hash n-grams with it
    runner = ModelRunner(cfg, Checkpoint(d, block_size=cfg.weight_block_size), ops,
                         tokenizer_json=tok if tok.is_file() else None)
    dsp = runner.model.dspark
    assert dsp is not None
    z = np.load(FIX / name / "expected.npz")
    mode = next(m for m in modes if m + ".draft_ids" in z.files)
    return name, runner, dsp, {k.split(".", 1)[1]: z[k] for k in z.files if k.startswith(mode + ".")}, z


@pytest.fixture(scope="module")
def case(checkpoint):
    return _case(checkpoint, NumpyOps(), MODES)


@pytest.fixture(scope="module")
def deepseek_case(checkpoint):
    return _case(checkpoint, DeepseekOps(), FAITHFUL)


def _draft_twice(runner, dsp, prompt: list[int]) -> tuple[list, list, list]:
    """As the fixture generator: the prompt's prefill, the block drafted after it, one decode step
    of the main model's greedy token and the block after that. ([targets of each step], [main
    logits of each step], [each Draft])."""
    st, ds = runner.new_state(), dsp.new_state()
    targets, logits, drafts, chunk = [], [], [], prompt
    for _ in range(2):
        t = dsp.targets
        logits.append(runner.forward([st], [chunk], targets=t)[0])
        targets.append(t)
        dsp.absorb(ds, t, len(chunk))
        chunk = [int(np.argmax(logits[-1]))]
        drafts.append(dsp.draft(ds, chunk[0]))
        assert ds.position == len(prompt) + len(targets) - 1  # drafting reads the state, never grows it
    return targets, logits, drafts


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


def test_deepseek_numerics_target_inputs_and_main_tokens_match_faithful(deepseek_case) -> None:
    name, runner, dsp, ref, z = deepseek_case
    targets, logits, _ = _draft_twice(runner, dsp, z["input_ids"].tolist())
    n = len(dsp.target_layer_ids)
    for step, want in enumerate((ref["main_hidden"], ref["main_hidden_next"][None])):
        for i, w in zip(dsp.target_layer_ids, np.split(want, n, axis=1), strict=True):
            got = targets[step][i]  # (bounded replay: a later layer's trailing rows only, at prefill)
            assert _rel(got, w[-got.shape[0]:]) <= DEEPSEEK_RTOL, (name, step, i, _rel(got, w[-got.shape[0]:]))
        assert _rel(logits[step], ref["main_logits"][step]) <= DEEPSEEK_RTOL, (name, step)
    assert [int(np.argmax(x)) for x in logits] == ref["main_token"].tolist(), name


def test_deepseek_numerics_draft_matches_faithful(deepseek_case) -> None:
    name, runner, dsp, ref, z = deepseek_case
    _, logits, drafts = _draft_twice(runner, dsp, z["input_ids"].tolist())
    for k, d in enumerate(drafts):
        where = f"{name} block {k}"
        want = ref["draft_logits"][k]
        rel = _rel(d.logits, want)
        assert rel <= DEEPSEEK_RTOL, f"{where}: logits {rel:.2e}"
        assert _rel(d.confidence, ref["confidence"][k]) <= DEEPSEEK_RTOL, f"{where}: confidence"
        # greedy: each position's margin in the reference (top 1 - top 2, relative to the largest
        # logit) is well over our difference, so agreement is owed to the numerics, not to chance
        top2 = np.sort(want, axis=-1)[:, -2:]
        margin = (top2[:, 1] - top2[:, 0]) / np.abs(want).max()
        assert margin.min() > 10 * rel, f"{where}: a near-tie (margins {margin.round(4).tolist()}, diff {rel:.2e})"
        first = int(np.argmax(logits[k]))
        assert [first, *d.tokens.tolist()] == ref["draft_ids"][k].tolist(), f"{where}: tokens"


def test_faithful_keys_tell_the_numerics_apart(case, deepseek_case) -> None:
    """The quantization points decide: exact numerics are far from the faithful keys that the
    deepseek numerics meet (else the deepseek test above could not fail on a missed rounding)."""
    name, runner, dsp, _, z = case
    faithful = deepseek_case[3]
    _, _, drafts = _draft_twice(runner, dsp, z["input_ids"].tolist())
    rel = max(_rel(d.logits, faithful["draft_logits"][k]) for k, d in enumerate(drafts))
    assert rel > 10 * DEEPSEEK_RTOL, (name, rel)
