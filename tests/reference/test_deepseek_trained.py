"""`--numerics deepseek` against DeepSeek's own V4.1 reference forward on TRAINED weights, held to
bf16-level agreement.

The checkpoint is the FP8 / FP4 copy of models/demo-v41 that tools/dev/quantize_demo.py writes
(FP8 linears with UE8M0 32x32 scales, FP4 routed experts, FP8 Engram rows, as the release stores
them), rebuilt here in a temp dir and checked against the fixture's sha256. Fixtures:
tests/fixtures/deepseek_trained (tools/dev/gen_deepseek_trained.py): the reference's greedy ids
and logits for three chat prompts, 40 tokens each, in its faithful mode (bf16, FP8 block-32
activations, FP8 window KV, FP4 compressed KV and indexer q / k) and in float32 with its state
quantization kept; and, every third step, the faithful logits of a fresh prefill of the prompt and
the ids before that step.

Unlike the random tiny models of test_deepseek_numerics.py, whose flat logits turn a last-bit
summation-order difference into a different FP8 grid point and then into a different answer, a
trained model's logits are not chaotic. Relative difference: max |ours - ref| / max |ref| of a
step's logits. Against the reference's prefills our logits agree to PREFILL_REL at every step
(bf16 carries 8 significant bits: 2**-8 ~ 4e-3 per rounding); our decode equals our prefill
bit for bit, but the reference's decode steps differ from its own prefills of the same tokens by
up to ~0.09 (bf16 GEMMs of one row against many round differently, and an FP8 grid point moves),
so against its decode the median step is held to MEDIAN_REL and the worst to DECODE_REL. Every
greedy id agrees, teacher-forced and free-running, including a prompt where float32 numerics
pick a different first token.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from tools.dev.gen_deepseek_trained import compare_case, load_model
from tools.dev.quantize_demo import quantize_checkpoint

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "deepseek_trained"

PREFILL_REL = 2e-2  # deepseek numerics vs the faithful reference's prefills, every checked step
MEDIAN_REL, DECODE_REL = 1e-2, 0.1  # vs its decode steps (see the module doc)
EXACT_REL = 1e-3  # exact numerics vs the float32 reference with its state quantization


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    meta = json.loads((FIX / "demo_v41_fp8.json").read_text())
    ckpt = quantize_checkpoint(REPO / "models" / "demo-v41", tmp_path_factory.mktemp("demo-v41-fp8"))
    digest = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    assert digest == meta["weights_sha256"], "quantize_demo no longer writes the fixture's checkpoint"
    return ckpt, meta, dict(np.load(FIX / "demo_v41_fp8.npz"))


def _check(results, max_rel: float, what: str, median_rel: float | None = None) -> None:
    for pi, r in enumerate(results):
        where = f"{what} prompt {pi}: rel per step {np.round(r.rel, 4).tolist()}"
        assert r.rel.max() <= max_rel, where
        assert median_rel is None or np.median(r.rel) <= median_rel, where
        assert r.argmax.all(), f"{where}; teacher-forced argmax {r.argmax.astype(int).tolist()}"
        assert r.greedy_agree == r.n, f"{what} prompt {pi}: free-running greedy diverges at {r.first_divergence}"


def test_deepseek_numerics_match_the_faithful_reference_on_trained_weights(trained) -> None:
    ckpt, _, z = trained
    results = compare_case(ckpt, z, "deepseek", "faithful_fix", load_model(ckpt, "deepseek"))
    _check(results, DECODE_REL, "deepseek vs faithful", MEDIAN_REL)
    for pi, r in enumerate(results):
        assert r.rel_prefill.size >= 10, "the fixture lacks the reference's prefills"
        assert r.rel_prefill.max() <= PREFILL_REL, f"prompt {pi}: vs prefills {np.round(r.rel_prefill, 4).tolist()}"
    # the quantization points matter: float32 numerics are measurably further from the reference
    exact = compare_case(ckpt, z, "exact", "faithful_fix", load_model(ckpt, "exact"))
    for r, e in zip(results, exact, strict=True):
        assert np.median(r.rel) < np.median(e.rel) / 2, (np.median(r.rel), np.median(e.rel))
    assert any(e.greedy_agree < e.n for e in exact), "no prompt where the quantization points decide an id"


def test_exact_numerics_match_the_float32_reference_on_trained_weights(trained) -> None:
    ckpt, _, z = trained
    _check(compare_case(ckpt, z, "exact", "statequant_f32_fix", load_model(ckpt, "exact")), EXACT_REL,
           "exact vs statequant_f32")
