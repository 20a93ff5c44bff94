"""The tensor schema (engine/checkpoint/schema.py) and the loader that reads through it
(engine/checkpoint/loader.py): what each tensor-parallel rank holds, the schema as the table the
tiny-model writer writes and the memory plan counts, and clear errors where a checkpoint disagrees
with the schema. (The loaded values feed every logits test: tests/reference, tests/unit/test_tp_sim.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from checkpoint_edits import fails, open_ckpt, rewritten

from engine.checkpoint import loader, schema
from engine.checkpoint import tiny_model as T
from engine.ops.numpy_ops import NumpyOps
from engine.parallel.shard import ShardPlan
from engine.runtime import memory_plan as mp

REPO = Path(__file__).resolve().parents[2]
DEMO_V41 = REPO / "models" / "demo-v41"
FIX = REPO / "tests" / "fixtures" / "ref"
V41 = dict(layers=4, hidden=128, heads=4, head_dim=64, rope_dim=16, q_lora=64, o_groups=2, o_lora=64,
           experts=4, topk=2, moe_inter=64, vocab=1024, index_heads=16, index_head_dim=32,
           engram_head_dim=32, engram_vocab=300)
# V4's 128x128 FP8 blocks: 8 heads of 64 give 128-row slices up to TP4; the shared expert's and
# the experts' 256 columns leave TP4's last two ranks without any (None in the loaded weights)
V4 = dict(layers=4, hidden=128, heads=8, head_dim=64, rope_dim=16, q_lora=128, o_groups=2, o_lora=128,
          experts=4, topk=2, moe_inter=256, vocab=1024, index_heads=16, index_head_dim=32, hash_layers=1)
PLANS = [(1, "ep"), (2, "ep"), (4, "ep"), (2, "width"), (4, "width"), (8, "ep")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("schema")
    return {"demo-v41": DEMO_V41, "tiny-v41": T.write_tiny_model(root / "v41", "v41", seed=2, **V41),
            "tiny-v4": T.write_tiny_model(root / "v4", "v4", seed=2, **V4)}


# ---------------------------------------------------------------------------------------------
# What each rank holds


def test_headless_and_expertless_ranks(ckpts):
    """A rank without heads holds no wo_a / wo_b and empty head slices; one without any of the
    experts' or the shared expert's width holds None for them."""
    cfg, ck = open_ckpt(ckpts["tiny-v41"])
    w = loader.load_weights(cfg, ck, NumpyOps(), ShardPlan.make(cfg, 7, 8))
    a = w.layers[0].attn
    assert (a.wo_a, a.wo_b, a.wo_groups) == (None, None, 0)
    assert a.wq_b.shape[0] == 0 and a.sinks.shape == (0,)
    cfg, ck = open_ckpt(ckpts["tiny-v4"])
    w = loader.load_weights(cfg, ck, NumpyOps(), ShardPlan.make(cfg, 3, 4, "width"))
    f = w.layers[1].ffn
    assert f.shared_experts is None and f.experts == [None] * cfg.n_routed_experts
    assert w.layers[0].ffn.tid2eid.dtype == np.int64 and w.layers[0].ffn.gate_bias is None


# ---------------------------------------------------------------------------------------------
# The schema is the table tiny_model writes and the planner counts


def test_tiny_model_writes_the_schema(ckpts):
    for name in ("tiny-v41", "tiny-v4"):
        cfg, ck = open_ckpt(ckpts[name])
        entries = schema.tensor_schema(cfg)
        raw = json.loads((ckpts[name] / "config.json").read_text())
        assert [(s.name, s.fmt, s.shape, s.init) for s in T.tensor_specs(raw)] == \
               [(e.name, e.fmt, e.shape, e.role) for e in entries]
        stored = [schema.stored_tensors(e.name, e.fmt, e.shape, cfg.weight_block_size) for e in entries]
        assert set(ck.names()) == {n for s in stored for n, _, _ in s}
        assert len(schema.validate(cfg, ck)) == sum(e.place is not None for e in entries)


def test_planner_counts_the_schema(ckpts):
    """Per-rank bytes from the written checkpoint's headers, from its tensor specs and from the
    config alone (the schema's formats) agree."""
    for name in ("tiny-v41", "tiny-v4"):
        cfg, ck = open_ckpt(ckpts[name])
        specs = T.tensor_specs(json.loads((ckpts[name] / "config.json").read_text()))
        for n in (1, 2):
            got = [[(r.device, r.host, r.tensors) for r in mp.weight_bytes(cfg, src, n)] for src in (ck, specs, None)]
            assert got[0] == got[1] == got[2], (name, n)


def test_every_place_is_filled(ckpts):
    """Each place of the schema exists in the loaded structure (a wrong place raises in _put)."""
    cfg, ck = open_ckpt(ckpts["tiny-v4"])
    w = loader.load_weights(cfg, ck, NumpyOps(), ShardPlan.make(cfg))
    for e in schema.tensor_schema(cfg):
        if e.place is None or e.part is not None:
            continue
        obj = w
        for seg in e.place.split("."):
            obj = obj[int(seg)] if seg.isdigit() else getattr(obj, seg)
        assert obj is not None, e.place


def test_shard_windows_cover_each_tensor():
    """Over the ranks of a plan, a split tensor's slices add up to it (out groups: shared by the
    ranks inside one), a replicated one is whole everywhere."""
    cfg, _ = open_ckpt(DEMO_V41)
    for n, split in [(2, "ep"), (4, "width"), (8, "ep")]:
        plans = [ShardPlan.make(cfg, r, n, split) for r in range(n)]
        for e in schema.tensor_schema(cfg):
            wins = [e.shard.window(cfg, p) for p in plans]
            if e.shard.replicated:
                assert wins == [(None, None)] * n, e.name
                continue
            area = 0
            for win in wins:
                if win is None:
                    continue
                rows, cols = win
                r = (rows or (0, e.shape[0]))
                c = (cols or (0, e.shape[1])) if len(e.shape) > 1 else (0, 1)
                area += (r[1] - r[0]) * (c[1] - c[0])
            whole = e.shape[0] * (e.shape[1] if len(e.shape) > 1 else 1)
            if "out_groups" in (e.shard.rows, e.shard.cols) and n > cfg.o_groups:
                assert area >= whole, e.name
            else:
                assert area == whole, (e.name, n, split)


# ---------------------------------------------------------------------------------------------
# A checkpoint that disagrees with the schema


def _edited(src: Path, dst: Path, edit) -> Path:
    """src with its tensors edited in place by edit (which returns nothing)."""
    return rewritten(src, dst, lambda t: (edit(t), t)[1])


def test_missing_tensor_is_named(ckpts, tmp_path):
    name = "layers.1.attn.wq_b.weight"

    def drop(t):
        del t[name], t["layers.1.attn.wq_b.scale"]

    fails(_edited(ckpts["tiny-v41"], tmp_path / "m", drop), name, "lacks", "fp8 [256, 64]")


def test_wrong_shape_is_named(ckpts, tmp_path):
    name = "layers.2.ffn.gate.weight"

    def narrow(t):
        t[name] = (t[name][0], t[name][1][:, :96])

    fails(_edited(ckpts["tiny-v41"], tmp_path / "s", narrow), name, "shape [4, 96]", "[4, 128]")


def test_wrong_format_is_named(ckpts, tmp_path):
    name = "layers.0.attn_norm.weight"

    def fp8(t):
        t[name] = ("F8_E4M3", np.zeros(t[name][1].shape, np.uint8))

    fails(_edited(ckpts["tiny-v41"], tmp_path / "f", fp8), name, "stored as F8_E4M3", "BF16/F16/F32/F64")
    ids = "layers.0.ffn.gate.tid2eid"

    def floats(t):
        t[ids] = ("F32", t[ids][1].astype(np.float32))

    fails(_edited(ckpts["tiny-v4"], tmp_path / "i", floats), ids, "stored as F32", "I64")


def test_optional_gate_bias_may_be_absent(ckpts, tmp_path):
    name = "layers.0.ffn.gate.bias"
    d = _edited(ckpts["tiny-v41"], tmp_path / "b", lambda t: t.pop(name))
    cfg, ck = open_ckpt(d)
    w = loader.load_weights(cfg, ck, NumpyOps(), ShardPlan.make(cfg))
    assert w.layers[0].ffn.gate_bias is None and w.layers[1].ffn.gate_bias is not None
