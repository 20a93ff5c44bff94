"""DSpark draft layers (V4.1 `mtp.*`): the config fields, the schema's draft entries, tiny-model
writing them, the loader's w.dspark structure (values equal to what the writer wrote, in both
namings, sliced for tensor parallelism), the memory plan's count, and clear errors for
checkpoints whose draft layers are partial or malformed."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from checkpoint_edits import fails, open_ckpt, rewritten

from engine.checkpoint import formats as F
from engine.checkpoint import loader, schema
from engine.checkpoint import tiny_model as T
from engine.checkpoint.dspark_schema import draft_layer_of
from engine.checkpoint.reader import SAFETENSORS_DTYPES, Checkpoint
from engine.model.config import ConfigError, load_config, parse_config
from engine.ops.numpy_ops import NumpyOps
from engine.parallel.shard import ShardPlan, even_range
from engine.runtime import memory_plan as mp

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
# 8 heads in 4 output groups, 8 draft experts: TP up to 8 splits heads, groups, experts for real
SIZES = dict(layers=4, hidden=128, heads=8, head_dim=64, rope_dim=16, q_lora=64, o_groups=4, o_lora=64,
             experts=4, topk=2, moe_inter=64, vocab=1024, index_heads=16, index_head_dim=32,
             engram_head_dim=32, engram_vocab=300, draft_experts=8, draft_topk=3, markov_rank=64)
STORED = {"bf16": "BF16", "f32": "F32", "fp8": "F8_E4M3", "fp4": "I8"}
SEED = 4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dspark")
    return {"draft": T.write_tiny_model(root / "draft", "v41", seed=SEED, draft=True, **SIZES),
            "plain": T.write_tiny_model(root / "plain", "v41", seed=SEED, **SIZES)}


def _load(d: Path, plan: ShardPlan | None = None):
    cfg, ck = open_ckpt(d)
    return cfg, loader.load_weights(cfg, ck, NumpyOps(), plan or ShardPlan.make(cfg))


def _draft_entries(cfg) -> list:
    return [e for e in schema.tensor_schema(cfg) if e.name.startswith("mtp.")]


def _at(w, place: str):
    obj = w
    for seg in place.split("."):
        obj = obj[int(seg)] if seg.isdigit() else getattr(obj, seg)
    return obj


# ---------------------------------------------------------------------------------------------
# Config


def _raw(**over) -> dict:
    c = T.make_config("v41", draft=True, **SIZES)
    c["engram_compressed_vocab_size"] = 100
    c.update(over)
    return c


def test_config_fields_in_both_namings():
    hf = parse_config(_raw())
    assert (hf.dspark_layers, hf.dspark_block_size, hf.dspark_target_layer_ids) == (3, 5, (1, 2, 3))
    assert (hf.dspark_n_routed_experts, hf.dspark_num_experts_per_tok, hf.dspark_markov_rank) == (8, 3, 64)
    assert hf.dspark_noise_token_id == 1023 and hf.has_draft
    up = _raw()
    up["n_mtp_layers"] = up.pop("num_nextn_predict_layers")
    up["dspark_n_activated_experts"] = up.pop("dspark_num_experts_per_tok")
    assert parse_config(up) == hf
    # absent (or 0) = no draft layers, whatever dspark_* fields say
    assert not parse_config(_raw(num_nextn_predict_layers=0)).has_draft
    demo = json.loads((REPO / "models" / "demo-v41" / "config.json").read_text())
    assert not parse_config({**demo, "num_nextn_predict_layers": 0}).has_draft
    assert load_config(REPO / "models" / "demo-v41").has_draft  # (its trained draft: tests/unit/test_demo_draft.py)
    flash = parse_config({**T.make_config("v41", draft=True, **{k: v for k, v in T.PRESETS["v41-flash-shaped"].items()
                                                                if k != "arch"}), "engram_compressed_vocab_size": 1})
    assert (flash.dspark_block_size, flash.dspark_noise_token_id, flash.dspark_markov_rank,
            flash.dspark_n_routed_experts, flash.dspark_num_experts_per_tok) == (5, 128799, 256, 128, 3)


@pytest.mark.parametrize("over, needle", [
    (dict(dspark_block_size=1), "dspark_block_size 1 must be >= 2"),
    (dict(dspark_target_layer_ids=[2, 4]), "dspark_target_layer_ids [2, 4]"),
    (dict(dspark_target_layer_ids=[]), "dspark_target_layer_ids"),
    (dict(dspark_target_layer_ids=[3, 3]), "distinct"),
    (dict(dspark_noise_token_id=1024), "dspark_noise_token_id 1024 is outside"),
    (dict(dspark_num_experts_per_tok=9), "dspark_num_experts_per_tok 9"),
    (dict(compress_ratios=[0, 2, 1, 1, 0, 2, 0]), "draft layers must be 0"),
    (dict(compress_ratios=[0, 2, 1, 1, 0, 0, 0, 0]), "8 entries"),
    (dict(dspark_block_size=None), "dspark_block_size"),
])
def test_config_validation(over, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(_raw(**over))
    assert needle in str(e.value)


# ---------------------------------------------------------------------------------------------
# What tiny-model writes


def test_every_draft_tensor_has_the_schema_shape_and_format(ckpts):
    cfg, ck = open_ckpt(ckpts["draft"])
    entries = _draft_entries(cfg)
    block = cfg.weight_block_size
    assert {n for e in entries for n, _, _ in schema.stored_tensors(e.name, e.fmt, e.shape, block)} == \
           {n for n in ck.names() if n.startswith("mtp.")}
    for e in entries:
        raw = ck.raw(e.name)
        assert raw.dtype == STORED[e.fmt], e.name
        if e.kind == schema.LINEAR:
            w = ck.weight(e.name)
            assert tuple(w.shape) == e.shape and w.fmt == e.fmt, e.name
            if e.fmt in ("fp8", "fp4"):
                assert ck.raw(e.name[:-len("weight")] + "scale").dtype == "F8_E8M0"
        else:
            assert raw.shape == e.shape, e.name
    h, r, v = cfg.hidden_size, cfg.dspark_markov_rank, cfg.vocab_size
    shapes = {e.name: (e.fmt, e.shape) for e in entries}
    assert shapes["mtp.0.main_proj.weight"] == ("fp8", (h, 3 * h))
    assert shapes["mtp.2.markov_head.embed.weight"] == shapes["mtp.2.markov_head.head.weight"] == ("bf16", (v, r))
    assert shapes["mtp.2.confidence_head.proj.weight"] == ("bf16", (1, h + r))
    assert shapes["mtp.1.ffn.experts.7.w2.weight"] == ("fp4", (h, cfg.moe_intermediate_size))
    assert shapes["mtp.1.ffn.gate.weight"] == ("bf16", (8, h))
    assert shapes["mtp.0.hc_attn_fn"] == ("f32", (24, 4 * h))
    assert "mtp.1.main_proj.weight" not in shapes and "mtp.1.norm.weight" not in shapes


def test_no_draft_output_unchanged(ckpts, tmp_path):
    """Without draft layers the writer writes what it wrote before they existed (weights and
    config of the default tiny model, byte for byte); with them the main tensors are the same."""
    d = T.write_tiny_model(tmp_path / "m", "v41", seed=3)
    h = hashlib.sha256()
    for p in sorted(d.iterdir()):
        if p.suffix in (".safetensors", ".json") and not p.name.startswith("tokenizer"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    assert h.hexdigest() == "3ece45b6429b01f707bed35ba7e4d19756ceaf0d8b5ec87c9eb6ff3cb64af47d"
    a, b = (json.loads((ckpts[k] / "config.json").read_text()) for k in ("plain", "draft"))
    assert {k: v for k, v in b.items() if not k.startswith("dspark_")} == {
        **a, "num_nextn_predict_layers": 3, "compress_ratios": a["compress_ratios"] + [0, 0, 0]}
    ca, cb = Checkpoint(ckpts["plain"]), Checkpoint(ckpts["draft"])
    assert set(cb.names()) - set(ca.names()) == {n for n in cb.names() if n.startswith("mtp.")}
    for n in ca.names():
        assert np.array_equal(ca.raw(n).array, cb.raw(n).array), n


def test_cli_writes_draft_layers_unless_told_not_to(tmp_path):
    small = ["--layers", "3", "--hidden", "64", "--experts", "2", "--vocab", "512", "--moe-inter", "32",
             "--q-lora", "32", "--o-lora", "32", "--draft-layers", "2", "--draft-experts", "2"]
    assert T.tiny_model_main([str(tmp_path / "d"), "--arch", "v41", *small]) == 0
    assert T.tiny_model_main([str(tmp_path / "n"), "--arch", "v41", "--no-draft", *small]) == 0
    assert load_config(tmp_path / "d").dspark_layers == 2 and Checkpoint(tmp_path / "d").has("mtp.1.norm.weight")
    assert not load_config(tmp_path / "n").has_draft
    assert not any(n.startswith("mtp.") for n in Checkpoint(tmp_path / "n").names())
    with pytest.raises(ValueError, match="V4.1's"):
        T.make_config("v4", draft=True)


# ---------------------------------------------------------------------------------------------
# What the loader makes of them


def _written(spec: T.TensorSpec, cfg: dict) -> np.ndarray:
    """The writer's values of one tensor, regenerated and dequantized independently of the reader."""
    block = tuple(cfg["quantization_config"]["weight_block_size"])
    chunks = list(T._tensor_chunks(spec, cfg, SEED, block))
    x = np.concatenate([c[spec.name] for c in chunks])
    scale = chunks[-1].get(spec.name[:-len("weight")] + "scale")
    if spec.fmt == "fp8":
        return F.dequant_fp8_blocks(x, scale, block)
    if spec.fmt == "fp4":
        return F.dequant_fp4_experts(x, scale, 32)
    return F.bf16_to_f32(x) if spec.fmt == "bf16" else x


def test_loaded_values_equal_what_the_writer_wrote(ckpts):
    cfg, w = _load(ckpts["draft"])
    raw = json.loads((ckpts["draft"] / "config.json").read_text())
    ds = w.dspark
    assert len(ds.layers) == 3 and all(len(L.ffn.experts) == 8 for L in ds.layers)
    for L in ds.layers:  # sliding-window attention and a plain MoE only
        got = (L.attn.compressor, L.attn.indexer, L.attn.x_proj, L.engram, L.ffn.tid2eid)
        assert got == (None, None, [], None, None)
    specs = {s.name: s for s in T.tensor_specs(raw)}
    stacked = {}
    for e in _draft_entries(cfg):
        if e.place is None:
            continue
        want = _written(specs[e.name], raw)
        if e.part is not None:
            stacked.setdefault(e.place, []).append(want)
            continue
        got = np.asarray(_at(w, e.place))
        assert got.shape == want.shape and np.array_equal(got, want.astype(np.float32)), e.name
    for place, parts in stacked.items():  # q / K=V latents, stacked in part order
        (weight, ranges), = _at(w, place)
        assert [p for p, _, _ in ranges] == ["q_lat", "kv_lat"]
        assert np.array_equal(np.asarray(weight), np.concatenate(parts)), place
    assert _at(w, "dspark.layers.2.hc_ffn")[1].shape == (3,)  # (fn, scale, base)


def test_hf_naming_loads_the_same(ckpts, tmp_path):
    """The HF V4.1 export names every tensor `model.` + upstream (the transformers port has no
    modules of its own for the draft layers and keeps their names): the same weights load."""
    d = rewritten(ckpts["draft"], tmp_path / "hf", lambda t: {"model." + n: x for n, x in t.items()})
    cfg, ck = open_ckpt(d)
    assert any(n.startswith("mtp.") for n in ck.names())
    _, a = _load(ckpts["draft"])
    _, b = _load(d)
    for e in _draft_entries(cfg):
        if e.place is not None and e.part is None:
            assert np.array_equal(np.asarray(_at(a, e.place)), np.asarray(_at(b, e.place))), e.name


@pytest.mark.parametrize("n, split", [(2, "ep"), (4, "ep"), (8, "ep"), (2, "width"), (4, "width")])
def test_tp_slices_of_the_draft_tensors(ckpts, n, split):
    """Each rank holds its heads' wq_b rows and sinks, its vocab rows of the Markov embedding and
    head, its draft experts (by id, or a width slice of each) and its slice of the shared expert;
    put together they are the whole of TP1's, and the replicated parts are whole everywhere."""
    cfg, full = _load(ckpts["draft"])
    ranks = [_load(ckpts["draft"], ShardPlan.make(cfg, r, n, split))[1].dspark for r in range(n)]
    one = full.dspark
    for name in ("main_proj", "main_norm", "norm"):
        assert all(np.array_equal(getattr(r, name), getattr(one, name)) for r in ranks)
    assert all(np.array_equal(r.confidence_head.proj, one.confidence_head.proj) for r in ranks)
    for part in ("embed", "head"):
        got = np.concatenate([getattr(r.markov_head, part) for r in ranks])
        assert np.array_equal(got, getattr(one.markov_head, part)), part
    for j, L in enumerate(one.layers):
        assert np.array_equal(np.concatenate([r.layers[j].attn.wq_b for r in ranks]), L.attn.wq_b)
        assert np.array_equal(np.concatenate([r.layers[j].attn.sinks for r in ranks]), L.attn.sinks)
        shared = [r.layers[j].ffn.shared_experts for r in ranks if r.layers[j].ffn.shared_experts is not None]
        assert np.array_equal(np.concatenate([s[0] for s in shared]), L.ffn.shared_experts[0])
        assert np.array_equal(np.concatenate([s[1] for s in shared], axis=1), L.ffn.shared_experts[1])
        for x in range(cfg.dspark_n_routed_experts):
            held = [(rk, r.layers[j].ffn.experts[x]) for rk, r in enumerate(ranks)
                    if r.layers[j].ffn.experts[x] is not None]
            if split == "ep":
                lo, hi = even_range(cfg.dspark_n_routed_experts, held[0][0], n)
                assert len(held) == 1 and lo <= x < hi
                assert all(np.array_equal(a, b) for a, b in zip(held[0][1], L.ffn.experts[x], strict=True))
            else:
                assert np.array_equal(np.concatenate([e[0] for _, e in held]), L.ffn.experts[x][0])
                assert np.array_equal(np.concatenate([e[1] for _, e in held], axis=1), L.ffn.experts[x][1])


def test_shard_windows_cover_each_draft_tensor(ckpts):
    cfg, _ = open_ckpt(ckpts["draft"])
    for n, split in [(2, "ep"), (4, "width"), (8, "ep")]:
        plans = [ShardPlan.make(cfg, r, n, split) for r in range(n)]
        for e in _draft_entries(cfg):
            wins = [e.shard.window(cfg, p) for p in plans]
            if e.shard.replicated:
                assert wins == [(None, None)] * n, e.name
                continue
            area = 0
            for win in filter(None, wins):
                r = win[0] or (0, e.shape[0])
                c = (win[1] or (0, e.shape[1])) if len(e.shape) > 1 else (0, 1)
                area += (r[1] - r[0]) * (c[1] - c[0])
            whole = e.shape[0] * (e.shape[1] if len(e.shape) > 1 else 1)
            if "out_groups" in (e.shard.rows, e.shard.cols) and n > cfg.o_groups:
                assert area >= whole, e.name  # (ranks inside one group share its rows)
            else:
                assert area == whole, (e.name, n, split)


# ---------------------------------------------------------------------------------------------
# Memory plan


def _device_bytes(e, block) -> int:
    """What the GPU backend keeps of a whole tensor: FP8 with float32 scales, FP4 as stored,
    BF16 linears as BF16, vectors as float32."""
    n = math.prod(e.shape)
    if e.kind != schema.LINEAR:
        return 4 * n
    if e.fmt == "fp8":
        return n + 4 * math.ceil(e.shape[0] / block[0]) * math.ceil(e.shape[1] / block[1])
    if e.fmt == "fp4":
        return n // 2 + n // 32
    return 2 * n


def test_memory_plan_counts_the_draft_bytes(ckpts):
    cfg_d, ck_d = open_ckpt(ckpts["draft"])
    cfg_p, ck_p = open_ckpt(ckpts["plain"])
    want = sum(_device_bytes(e, cfg_d.weight_block_size) for e in _draft_entries(cfg_d) if e.place is not None)
    for n in (1, 2, 4):
        d, p = mp.weight_bytes(cfg_d, ck_d, n), mp.weight_bytes(cfg_p, ck_p, n)
        for rd, rp in zip(d, p, strict=True):
            assert rd.device_total - rp.device_total == rd.device["DSpark draft layers"] > 0
        if n == 1:
            assert d[0].device["DSpark draft layers"] == want
        else:  # split over the ranks: no more in all than whole, the replicated parts on each
            assert want <= sum(r.device["DSpark draft layers"] for r in d) < n * want
    specs = T.tensor_specs(json.loads((ckpts["draft"] / "config.json").read_text()))
    assert [r.device for r in mp.weight_bytes(cfg_d, specs, 2)] == [r.device for r in mp.weight_bytes(cfg_d, ck_d, 2)]


def test_v41_flash_draft_layers_are_about_7_4_gib():
    """The released checkpoint's draft layers: about 2,400 tensors, 7.4 GiB (from the schema's
    stored formats at V4.1-Flash's widths; nothing written)."""
    sizes = {k: v for k, v in T.PRESETS["v41-flash-shaped"].items() if k != "arch"}
    sizes.update(layers=40)
    c = T.make_config("v41", draft=True, **sizes)
    c.update(engram_layer_ids=[], engram_num_embeddings=[], engram_compressed_vocab_size=99092)
    assert c["dspark_target_layer_ids"] == [37, 38, 39]
    specs = {s.name: s for s in T.tensor_specs(c) if s.name.startswith("mtp.")}
    assert specs["mtp.0.main_proj.weight"].shape == (5120, 3 * 5120)
    assert specs["mtp.1.attn.wq_b.weight"].shape == (64 * 512, 1280)
    assert specs["mtp.2.ffn.experts.127.w1.weight"].shape == (2304, 5120)
    assert "mtp.2.ffn.experts.128.w1.weight" not in specs
    assert specs["mtp.2.markov_head.head.weight"].shape == (129280, 256)
    assert specs["mtp.2.confidence_head.proj.weight"].shape == (1, 5120 + 256)
    stored = [t for s in specs.values() for t in T.stored_tensors(s, (32, 32))]
    nbytes = sum(math.prod(sh) * SAFETENSORS_DTYPES[dt].itemsize for _, dt, sh in stored)
    assert 2350 <= len(stored) <= 2450
    assert 7.3 * GIB < nbytes < 7.5 * GIB


# ---------------------------------------------------------------------------------------------
# Partial or malformed draft layers


def test_missing_draft_tensor_is_named(ckpts, tmp_path):
    gone = "mtp.1.ffn.experts.3.w3.weight"
    d = rewritten(ckpts["draft"], tmp_path / "m",
                   lambda t: {n: x for n, x in t.items() if not n.startswith(gone[:-len("weight")])})
    fails(d, "draft layers (mtp.*) disagree", repr(gone), "lacks", "fp4 [64, 128]")


def test_wrong_draft_shape_is_named(ckpts, tmp_path):
    def edit(t):
        t["mtp.0.main_proj.weight"] = ("F8_E4M3", np.zeros((128, 256), np.uint8))
        t["mtp.0.main_proj.scale"] = ("F8_E8M0", np.full((4, 8), 127, np.uint8))
        return t
    fails(rewritten(ckpts["draft"], tmp_path / "m", edit), "'mtp.0.main_proj.weight'", "[128, 256]",
           "fp8 [128, 384]")


def test_wrong_draft_format_is_named(ckpts, tmp_path):
    def edit(t):
        t["mtp.2.norm.weight"] = ("I32", np.zeros(128, np.int32))
        return t
    fails(rewritten(ckpts["draft"], tmp_path / "m", edit), "'mtp.2.norm.weight'", "I32")


def test_declared_but_not_stored(ckpts, tmp_path):
    d = rewritten(ckpts["draft"], tmp_path / "m", lambda t: {n: x for n, x in t.items() if not n.startswith("mtp.")})
    fails(d, "declares 3 DSpark draft layers", "no mtp.* tensor", "'mtp.0.attn_norm.weight'",
           "num_nextn_predict_layers to 0")


def test_more_draft_layers_stored_than_declared(ckpts, tmp_path):
    def fewer(c):
        c["num_nextn_predict_layers"] = 2
        c["compress_ratios"] = c["compress_ratios"][:-1]
        return c
    d = rewritten(ckpts["draft"], tmp_path / "m", lambda t: t, fewer)
    fails(d, "draft layer(s) [2]", "'mtp.2.", "declares 2")


def test_stored_but_not_declared_loads_with_a_warning(ckpts, tmp_path, caplog):
    def none(c):
        c["num_nextn_predict_layers"] = 0
        return c
    d = rewritten(ckpts["draft"], tmp_path / "m", lambda t: t, none)
    with caplog.at_level(logging.WARNING):
        cfg, w = _load(d)
    assert w.dspark is None and len(w.layers) == cfg.num_layers
    msgs = [r.getMessage() for r in caplog.records if "mtp" in r.getMessage()]
    assert len(msgs) == 1 and "draft layers are ignored" in msgs[0] and str(
        sum(draft_layer_of(n) is not None for n in Checkpoint(d).names())) in msgs[0]
    _, plain = _load(ckpts["plain"])
    assert np.array_equal(w.layers[2].attn.wq_b, plain.layers[2].attn.wq_b)
