"""Shared by the schema and draft-layer tests: a checkpoint rewritten with edited tensors (or
config), and the check that the loader, the validator and the memory plan all refuse it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import loader, schema
from engine.checkpoint.reader import Checkpoint
from engine.checkpoint.writer import write_safetensors
from engine.model.config import load_config
from engine.ops.numpy_ops import NumpyOps
from engine.parallel.shard import ShardPlan
from engine.runtime import memory_plan as mp


def open_ckpt(d: Path):
    cfg = load_config(d)
    return cfg, Checkpoint(d, block_size=cfg.weight_block_size)


def rewritten(src: Path, dst: Path, edit: Callable[[dict], dict],
              config_edit: Callable[[dict], dict] | None = None) -> Path:
    """src's tensors ({name: (dtype, array)}) through edit, and its config through config_edit,
    written to dst."""
    ck = Checkpoint(src)
    tensors = edit({n: (ck.raw(n).dtype, np.asarray(ck.raw(n).array)) for n in ck.names()})
    dst.mkdir()
    write_safetensors(dst / "model.safetensors", tensors)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config_edit(cfg) if config_edit else cfg))
    if (src / "tokenizer.json").exists():
        shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return dst


def fails(d: Path, *needles: str) -> None:
    """The loader, schema.validate and the memory plan each raise a SchemaError naming needles."""
    cfg, ck = open_ckpt(d)
    for call in (lambda: loader.load_weights(cfg, ck, NumpyOps(), ShardPlan.make(cfg)),
                 lambda: schema.validate(cfg, ck), lambda: mp.weight_bytes(cfg, ck, 2)):
        with pytest.raises(schema.SchemaError) as e:
            call()
        for s in needles:
            assert s in str(e.value), (s, str(e.value))
