"""Random checkpoints: shapes match the reference modeling, formats as declared, determinism."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import formats as F
from engine.checkpoint import tiny_model as T
from engine.checkpoint.reader import Checkpoint

REPO = Path(__file__).resolve().parents[2]
DEMO_V41 = REPO / "models" / "demo-v41"
DEMO_V4 = REPO.parent / "shared" / "models" / "demo-v4"

SMALL = dict(layers=4, hidden=128, heads=4, head_dim=64, rope_dim=16, q_lora=64, o_groups=2, o_lora=64,
             experts=4, topk=2, moe_inter=64, vocab=1024, index_heads=16, index_head_dim=32,
             engram_head_dim=32, engram_vocab=300)

STORED = {"bf16": "BF16", "f32": "F32", "i64": "I64", "fp8": "F8_E4M3", "fp8_rows": "F8_E4M3", "fp4": "I8"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: T.write_tiny_model(root / arch, arch, seed=3, **SMALL) for arch in ("v41", "v4")}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_every_tensor_has_its_declared_format(models, arch):
    d = models[arch]
    cfg = json.loads((d / "config.json").read_text())
    ck = Checkpoint(d)
    block = tuple(cfg["quantization_config"]["weight_block_size"])
    assert block == ((32, 32) if arch == "v41" else (128, 128))
    specs = T.tensor_specs(cfg)
    expected = {n for sp in specs for n, _, _ in T.stored_tensors(sp, block)}
    assert set(ck.names()) == expected
    assert not any(n.startswith("model.") for n in ck.names())
    for sp in specs:
        raw = ck.raw(sp.name)
        assert raw.dtype == STORED[sp.fmt], sp.name
        if sp.fmt == "i64":
            ids = raw.array
            assert raw.shape == sp.shape and ids.min() >= 0 and ids.max() < cfg["n_routed_experts"]
            assert all(len(set(r)) == len(r) for r in ids.tolist())
            continue
        w = ck.weight(sp.name, expect_shape=sp.shape)
        if sp.fmt in ("bf16", "f32"):
            assert w.fmt == sp.fmt and w.scale is None
        elif sp.fmt == "fp8":
            assert (w.fmt, w.scale_fmt, w.block) == ("fp8", "ue8m0", block), sp.name
            assert ck.raw(sp.name[:-len("weight")] + "scale").dtype == "F8_E8M0"
        elif sp.fmt == "fp8_rows":
            assert (w.fmt, w.scale_fmt, w.block) == ("fp8", "ue8m0", (1, 32))
        elif sp.fmt == "fp4":
            assert (w.fmt, w.scale_fmt, w.block) == ("fp4", "ue8m0", (1, 32))
            assert w.data.shape == (sp.shape[0], sp.shape[1] // 2)
        x = w.dequant()
        assert x.shape == tuple(sp.shape) and np.isfinite(x).all(), sp.name
        if sp.init == "linear" and x.size >= 1024:  # O(1) activations: std ~ fan_in**-0.5
            assert 0.5 < x.std() * math.sqrt(sp.shape[-1]) < 2.0, sp.name
        if sp.init in ("sink", "hc_base", "bias", "ape"):
            assert np.all(x != 0), sp.name  # zero-initialised parameters hide bugs


def test_v41_config_fields(models):
    cfg = json.loads((models["v41"] / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v41_text"
    assert cfg["compress_ratios"] == [0, 2, 1, 1]
    assert (cfg["kv_source_layer_ids"], cfg["index_source_layer_ids"], cfg["candidate_source_layer_id"]) == (
        [1, 2], [1, 2, 3], 2)
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                          "expert_dtype": "fp4"}
    primes = T.engram_primes(1, cfg["engram_max_ngram_size"], cfg["engram_n_heads"], cfg["engram_vocab_size"])
    assert cfg["engram_num_embeddings"] == [sum(map(sum, primes[0]))]
    assert cfg["engram_compressed_vocab_size"] == T.compressed_vocab_size(models["v41"] / "tokenizer.json")
    tok = json.loads((models["v41"] / "tokenizer.json").read_text())
    assert [t["content"] for t in tok["added_tokens"][:3]] == T.SPECIAL_TOKENS[:3]
    assert tok["model"]["type"] == "BPE"


def test_configs_parse_with_engine_config(models):
    config = pytest.importorskip("engine.model.config")
    c41, c4 = config.load_config(models["v41"]), config.load_config(models["v4"])
    assert (c41.arch, c41.weight_block_size, c41.expert_dtype) == ("v41", (32, 32), "fp4")
    assert (c4.arch, c4.weight_block_size, c4.layer_kinds) == ("v4", (128, 128), ("sliding", "csa", "hca", "csa"))


def test_same_seed_same_bytes_other_seed_differs(models, tmp_path):
    again = T.write_tiny_model(tmp_path / "again", "v41", seed=3, **SMALL)
    assert _files(again) == _files(models["v41"])
    other = T.write_tiny_model(tmp_path / "other", "v41", seed=4, **SMALL)
    a, b = _files(other), _files(models["v41"])
    assert a["config.json"] == b["config.json"] and a["tokenizer.json"] == b["tokenizer.json"]
    assert a["model-00001-of-00001.safetensors"] != b["model-00001-of-00001.safetensors"]


def test_streams_in_chunks_and_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "_CHUNK_ELEMS", 1000)  # force many chunks per tensor
    d = T.write_tiny_model(tmp_path / "m", "v4", seed=0, shard_bytes=1 << 20, **SMALL)
    shards = sorted(d.glob("*.safetensors"))
    assert len(shards) > 1
    ck = Checkpoint(d)
    cfg = json.loads((d / "config.json").read_text())
    for sp in T.tensor_specs(cfg):
        if sp.fmt != "i64":
            assert np.isfinite(ck.weight(sp.name, expect_shape=sp.shape).dequant()).all()


def test_cli(tmp_path):
    assert T.tiny_model_main([str(tmp_path / "c"), "--arch", "v4", "--layers", "2", "--hidden", "64",
                              "--experts", "2", "--vocab", "512", "--moe-inter", "32", "--q-lora", "32",
                              "--o-lora", "32", "--seed", "7"]) == 0
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (2, 64, 512)
    assert Checkpoint(tmp_path / "c").has("layers.1.attn.indexer.compressor.ape")
    with pytest.raises(ValueError, match="multiple of 32"):
        T.make_config("v41", hidden=100)


# ----------------------------------------------------------------------------- against real checkpoints
@pytest.mark.parametrize("path", [DEMO_V41, DEMO_V4], ids=["demo-v41", "demo-v4"])
def test_shape_table_matches_trained_checkpoints(path):
    """The demo models were saved by the transformers reference: same names, same shapes. (demo-v41's
    DSpark draft layers, trained later, are stored as the release stores them: FP8 / FP4 with
    scales; tests/unit/test_demo_draft.py checks them.)"""
    if not path.exists():
        pytest.skip(f"{path} absent")
    cfg = json.loads((path / "config.json").read_text())
    ck = Checkpoint(path)
    want = {sp.name: tuple(sp.shape) for sp in T.tensor_specs(cfg) if not sp.name.startswith("mtp.")}
    # bf16 exports keep the (then unused) engram row scales as a float tensor
    assert (set(n for n in ck.names() if not n.startswith("mtp.")) - set(want)
            <= {n for n in ck.names() if n.endswith("engram.embed.scale")})
    assert set(want) <= set(ck.names())
    for n, shape in want.items():
        assert ck.raw(n).shape == shape, n


def test_engram_layout_and_compressed_vocab_match_demo():
    cfg = json.loads((DEMO_V41 / "config.json").read_text())
    primes = T.engram_primes(len(cfg["engram_layer_ids"]), cfg["engram_max_ngram_size"],
                             cfg["engram_n_heads"], cfg["engram_vocab_size"])
    assert [sum(map(sum, layer)) for layer in primes] == cfg["engram_num_embeddings"]
    assert T.compressed_vocab_size(DEMO_V41 / "tokenizer.json") == cfg["engram_compressed_vocab_size"]


def test_flash_shaped_presets_shapes():
    p = dict(T.PRESETS["v41-flash-shaped"])
    cfg = T.make_config(p.pop("arch"), **p)
    specs = {sp.name: sp for sp in T.tensor_specs(cfg)}
    assert specs["layers.0.attn.wq_b.weight"].shape == (64 * 512, 1280)
    assert specs["layers.0.attn.wo_a.weight"].shape == (8 * 1024, 64 * 512 // 8)
    assert specs["layers.0.attn.wo_b.weight"].shape == (5120, 8 * 1024)
    assert specs["layers.3.ffn.experts.383.w2.weight"].shape == (5120, 2304)
    assert specs["layers.1.attn.compressor.wgate.weight"].shape == (512, 5120)
    assert "layers.2.attn.compressor.wgate.weight" not in specs  # ratio 1: no gate
    assert specs["layers.2.attn.indexer.wk.weight"].shape == (128, 512)
    assert "layers.3.attn.indexer.wk.weight" not in specs  # re-index layer reuses the source's keys
    assert specs["layers.1.engram.wkv.weight"].shape == (5120 * 5, 3 * 8 * 256)
    assert cfg["vocab_size"] == 129280 and cfg["n_routed_experts"] == 384
    q = dict(T.PRESETS["v4-flash-shaped"])
    cfg4 = T.make_config(q.pop("arch"), **q)
    s4 = {sp.name: sp for sp in T.tensor_specs(cfg4)}
    assert s4["layers.1.attn.compressor.wkv.weight"].shape == (2 * 512, 4096)  # CSA: two series
    assert s4["layers.2.attn.compressor.ape"].shape == (128, 512)  # HCA
    assert s4["layers.1.attn.indexer.compressor.ape"].shape == (4, 2 * 128)
    assert s4["hc_head_fn"].shape == (4, 4 * 4096)


def test_fp4_expert_values_are_e2m1_times_scale(models):
    ck = Checkpoint(models["v41"])
    w = ck.weight("layers.0.ffn.experts.1.w2.weight")
    vals = F.fp4_unpack(w.data)
    assert set(np.unique(np.abs(vals)).tolist()) <= set(F.FP4_E2M1_VALUES.tolist())
    assert np.array_equal(w.dequant(), F.dequant_fp4_experts(w.data, w.scale))
