"""The same weights under HF transformers naming and DeepSeek's upstream naming give the same logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint.reader import Checkpoint
from engine.checkpoint.writer import write_safetensors
from engine.model.config import load_config
from engine.ops.numpy_ops import NumpyOps
from engine.runtime.runner import ModelRunner as Model

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "ref"
TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "demo-v41" / "tokenizer.json"


def _logits(d: Path, ids: list[int]) -> np.ndarray:
    cfg = load_config(d)
    m = Model(cfg, Checkpoint(d), NumpyOps(), TOKENIZER)
    return m.forward([m.new_state()], [ids], all_logits=True)[0]


@pytest.mark.parametrize("case", ["v41_engram", "v4_real_rates"])
def test_upstream_and_hf_names_give_equal_logits(case: str, tmp_path: Path) -> None:
    src = FIX / case
    hf = Checkpoint(src)
    stored = {hf.raw(n).stored_name for n in hf.names()}
    # the fixture really is in HF naming (a `model.` prefix), so the rewrite below changes names
    assert any(s.startswith("model.") for s in stored)
    tensors = {n: (hf.raw(n).dtype, np.asarray(hf.raw(n).array)) for n in hf.names()}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    shutil.copy(src / "config.json", tmp_path / "config.json")
    up = Checkpoint(tmp_path)
    assert sorted(up.names()) == sorted(hf.names())
    assert all(up.raw(n).stored_name == n for n in up.names())
    ids = np.load(src / "expected.npz")["input_ids"][:96].tolist()
    np.testing.assert_array_equal(_logits(tmp_path, ids), _logits(src, ids))
