"""Logits equal the peer references' (fixtures in tests/fixtures/ref, made by tools/gen_ref_fixtures_*.py).

V4: Hugging Face transformers' DeepseekV4ForCausalLM (released). V4.1: the transformers-main
DeepSeek-V4.1 reference (commit 0a2080b4), which fake-quantizes the state as DeepSeek's
inference code does. Fixtures hold float32 reference logits at chosen positions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.backends.numpy_ops import NumpyOps
from engine.checkpoint import Checkpoint
from engine.config import load_config
from engine.model import Model

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures" / "ref"
DEMO_DIRS = {"demo_v4": REPO.parent / "shared" / "models" / "demo-v4", "demo_v41": REPO / "models" / "demo-v41"}
TOKENIZER = REPO / "models" / "demo-v41" / "tokenizer.json"

# The bar: logits within 1e-4 relative (of the largest logit) of the reference.
RTOL = 1e-4


def _cases() -> list[str]:
    return sorted(p.name for p in FIX.iterdir() if (p / "expected.npz").is_file()) if FIX.is_dir() else []


def _ckpt_dir(case: str) -> Path:
    d = DEMO_DIRS.get(case, FIX / case)
    if not (d / "config.json").is_file():
        pytest.skip(f"{d} not present")
    return d


def _model(d: Path) -> Model:
    cfg = load_config(d)
    tok = d / "tokenizer.json" if (d / "tokenizer.json").is_file() else TOKENIZER
    return Model(cfg, Checkpoint(d, block_size=cfg.weight_block_size), NumpyOps(), tok)


@pytest.fixture(scope="module", params=_cases())
def case(request):
    d = _ckpt_dir(request.param)
    z = np.load(FIX / request.param / "expected.npz")
    return request.param, _model(d), z


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_prefill_logits_match_reference(case) -> None:
    name, m, z = case
    ids = z["input_ids"].tolist()
    logits = m.forward([m.new_state()], [ids], all_logits=True)[0]
    pos = z["positions"]
    err = _rel(logits[pos], z["logits"])
    assert err < RTOL, f"{name}: relative error {err:.3g}"


def test_token_by_token_matches_reference(case) -> None:
    name, m, z = case
    ids = z["input_ids"].tolist()
    st = m.new_state()
    want = set(z["positions"].tolist())
    got = {}
    for i, t in enumerate(ids):
        out = m.forward([st], [[t]])[0]
        if i in want:
            got[i] = out
    err = _rel(np.stack([got[p] for p in z["positions"].tolist()]), z["logits"])
    assert err < RTOL, f"{name}: relative error {err:.3g}"


def test_greedy_tokens_match_reference(case) -> None:
    name, m, z = case
    if "greedy_ids" not in z:
        pytest.skip("no greedy continuation in this fixture")
    prompt = (z["greedy_prompt_ids"] if "greedy_prompt_ids" in z else z["input_ids"]).tolist()
    st = m.new_state()
    logits = m.forward([st], [prompt])[0]
    out = []
    for ref_tok in z["greedy_ids"].tolist():
        tok = int(np.argmax(logits))
        out.append(tok)
        # teacher-force the reference token so one near-tie cannot derail the rest
        logits = m.forward([st], [[ref_tok]])[0]
    assert out == z["greedy_ids"].tolist(), f"{name}: greedy continuation differs"


def test_fixture_report_is_self_consistent() -> None:
    """The reference agreed with itself across chunkings when the fixtures were made."""
    for rep in FIX.glob("report_*.json"):
        for case_name, r in json.loads(rep.read_text())["cases"].items():
            scale = r.get("max_abs_logit", 1.0)
            for key in ("chunked_max_abs_diff", "tbt_max_abs_diff"):
                if key in r:
                    assert r[key] / scale < RTOL, f"{case_name}: reference {key} too large"
