"""Checkpoint reader: demo checkpoints, HF <-> upstream naming, quantized weights, malformed files."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import formats as F
from engine.checkpoint.reader import Checkpoint, CheckpointError, canonical_name
from engine.checkpoint.writer import write_safetensors

REPO = Path(__file__).resolve().parents[2]
DEMO_V41 = REPO / "models" / "demo-v41"
DEMO_V4 = REPO.parent / "shared" / "models" / "demo-v4"


def bf16(a):
    return ("BF16", F.f32_to_bf16(np.asarray(a, np.float32)))


def f32(a):
    return ("F32", np.asarray(a, np.float32))


# ----------------------------------------------------------------------------- demo checkpoints
def test_demo_v41_names_shapes_dtypes():
    ck = Checkpoint(DEMO_V41)
    cfg = json.loads((DEMO_V41 / "config.json").read_text())
    names = ck.names()
    assert "embed.weight" in names and "head.weight" in names and "norm.weight" in names
    assert not any(n.startswith(("model.", "lm_head")) for n in names)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    assert ck.raw("embed.weight").shape == (v, h) and ck.raw("embed.weight").dtype == "BF16"
    assert ck.raw("embed.weight").array.dtype == np.uint16
    assert ck.weight("head.weight", expect_shape=(v, h)).fmt == "bf16"
    assert ck.f32("norm.weight").dtype == np.float32 and ck.f32("norm.weight").shape == (h,)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        assert ck.has(p + "attn.wq_a.weight") and ck.has(p + "hc_ffn_scale")
        assert ck.has(p + "attn.compressor.wkv.weight") == (i in cfg["kv_source_layer_ids"])
        assert ck.has(p + "attn.indexer.wq_b.weight") == (i in cfg["index_source_layer_ids"])
        assert ck.has(p + "engram.embed.weight") == (i in cfg["engram_layer_ids"])
        for e in range(cfg["n_routed_experts"]):
            assert ck.raw(f"{p}ffn.experts.{e}.w2.weight").shape == (h, cfg["moe_intermediate_size"])
    w = ck.weight("layers.0.attn.wq_a.weight")
    assert w.shape == (cfg["q_lora_rank"], h) and w.scale is None
    assert np.array_equal(w.dequant(), ck.f32("layers.0.attn.wq_a.weight"))


@pytest.mark.skipif(not DEMO_V4.exists(), reason="../shared/models/demo-v4 absent")
def test_demo_v4_names_shapes_dtypes():
    ck = Checkpoint(DEMO_V4)
    cfg = json.loads((DEMO_V4 / "config.json").read_text())
    names = set(ck.names())
    h = cfg["hidden_size"]
    top = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    assert top <= names
    assert ck.raw("hc_head_fn").shape == (cfg["hc_mult"], cfg["hc_mult"] * h)
    # the main KV norm was saved as `attn.norm` by transformers 5.17
    assert "layers.0.attn.kv_norm.weight" in names and "layers.0.attn.norm.weight" not in names
    assert ck.raw("layers.0.ffn.gate.tid2eid").dtype == "I64"
    assert ck.raw("layers.0.ffn.gate.tid2eid").shape == (cfg["vocab_size"], cfg["num_experts_per_tok"])
    csa = ck.raw("layers.1.attn.indexer.compressor.ape")
    assert csa.shape == (cfg["compress_rates"]["compressed_sparse_attention"], 2 * cfg["index_head_dim"])
    assert ck.raw("layers.2.attn.compressor.ape").shape == (
        cfg["compress_rates"]["heavily_compressed_attention"], cfg["head_dim"])


# ----------------------------------------------------------------------------- naming
def _v4_tensors(rng, hf: bool):
    """The same small V4-style layer in upstream naming or in HF long-form naming."""
    h, hd, q, e, inter = 64, 32, 48, 2, 32
    t = {
        "embed": rng.standard_normal((100, h)), "head": rng.standard_normal((100, h)),
        "norm": rng.standard_normal(h), "hc_fn": rng.standard_normal((4, 4 * h)),
        "wq_a": rng.standard_normal((q, h)), "q_norm": rng.standard_normal(q),
        "wkv": rng.standard_normal((hd, h)), "kv_norm": rng.standard_normal(hd),
        "sink": rng.standard_normal(2), "ape": rng.standard_normal((4, 2 * hd)),
        "cwkv": rng.standard_normal((2 * hd, h)), "iwq_b": rng.standard_normal((64, q)),
        "iwp": rng.standard_normal((4, h)), "iape": rng.standard_normal((4, 32)),
        "bias": rng.standard_normal(e), "hcfn": rng.standard_normal((24, 4 * h)),
        "w1": rng.standard_normal((e, inter, h)), "w3": rng.standard_normal((e, inter, h)),
        "w2": rng.standard_normal((e, h, inter)), "sw1": rng.standard_normal((inter, h)),
    }
    q8, s8 = F.quant_fp8_blocks(t["wq_a"], (32, 32))
    if hf:
        L = "model.layers.0."
        out = {
            "model.embed_tokens.weight": bf16(t["embed"]), "lm_head.weight": bf16(t["head"]),
            "model.norm.weight": bf16(t["norm"]), "model.hc_head.hc_fn": f32(t["hc_fn"]),
            L + "self_attn.q_a_proj.weight": ("F8_E4M3", q8),
            L + "self_attn.q_a_proj.weight_scale_inv": ("F8_E8M0", s8),
            L + "self_attn.q_a_norm.weight": bf16(t["q_norm"]),
            L + "self_attn.kv_proj.weight": bf16(t["wkv"]),
            L + "self_attn.kv_norm.weight": bf16(t["kv_norm"]),
            L + "self_attn.sinks": f32(t["sink"]),
            L + "self_attn.compressor.position_bias": f32(t["ape"]),
            L + "self_attn.compressor.kv_proj.weight": bf16(t["cwkv"]),
            L + "self_attn.compressor.indexer.q_b_proj.weight": bf16(t["iwq_b"]),
            L + "self_attn.compressor.indexer.scorer.weights_proj.weight": bf16(t["iwp"]),
            L + "self_attn.compressor.indexer.position_bias": f32(t["iape"]),
            L + "mlp.gate.e_score_correction_bias": f32(t["bias"]),
            L + "attn_hc.fn": f32(t["hcfn"]), L + "input_layernorm.weight": bf16(t["norm"]),
            L + "mlp.experts.gate_up_proj": bf16(np.concatenate([t["w1"], t["w3"]], axis=1)),
            L + "mlp.experts.down_proj": bf16(t["w2"]),
            L + "mlp.shared_experts.gate_proj.weight": bf16(t["sw1"]),
        }
    else:
        L = "layers.0."
        out = {
            "embed.weight": bf16(t["embed"]), "head.weight": bf16(t["head"]), "norm.weight": bf16(t["norm"]),
            "hc_head_fn": f32(t["hc_fn"]),
            L + "attn.wq_a.weight": ("F8_E4M3", q8), L + "attn.wq_a.scale": ("F8_E8M0", s8),
            L + "attn.q_norm.weight": bf16(t["q_norm"]),
            L + "attn.wkv.weight": bf16(t["wkv"]), L + "attn.kv_norm.weight": bf16(t["kv_norm"]),
            L + "attn.attn_sink": f32(t["sink"]), L + "attn.compressor.ape": f32(t["ape"]),
            L + "attn.compressor.wkv.weight": bf16(t["cwkv"]),
            L + "attn.indexer.wq_b.weight": bf16(t["iwq_b"]),
            L + "attn.indexer.weights_proj.weight": bf16(t["iwp"]),
            L + "attn.indexer.compressor.ape": f32(t["iape"]),
            L + "ffn.gate.bias": f32(t["bias"]), L + "hc_attn_fn": f32(t["hcfn"]),
            L + "attn_norm.weight": bf16(t["norm"]),
            L + "ffn.shared_experts.w1.weight": bf16(t["sw1"]),
        }
        for x in range(e):
            out[f"{L}ffn.experts.{x}.w1.weight"] = bf16(t["w1"][x])
            out[f"{L}ffn.experts.{x}.w3.weight"] = bf16(t["w3"][x])
            out[f"{L}ffn.experts.{x}.w2.weight"] = bf16(t["w2"][x])
    return out


def test_hf_and_upstream_naming_agree(tmp_path):
    write_safetensors(tmp_path / "up.safetensors", _v4_tensors(np.random.default_rng(0), hf=False))
    write_safetensors(tmp_path / "hf.safetensors", _v4_tensors(np.random.default_rng(0), hf=True))
    up, hf = Checkpoint(tmp_path / "up.safetensors"), Checkpoint(tmp_path / "hf.safetensors")
    assert up.names() == hf.names()
    for n in up.names():
        a, b = up.raw(n), hf.raw(n)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.array, b.array), n
    w = hf.weight("layers.0.attn.wq_a.weight", expect_shape=(48, 64))
    assert (w.fmt, w.scale_fmt, w.block) == ("fp8", "ue8m0", (32, 32))


def test_canonical_name_rules():
    cases = {
        "model.embed.weight": "embed.weight",
        "model.layers.3.attn.wq_b.weight": "layers.3.attn.wq_b.weight",
        "layers.3.attn.wq_b.scale": "layers.3.attn.wq_b.scale",
        "model.layers.3.self_attn.o_a_proj.weight": "layers.3.attn.wo_a.weight",
        "model.layers.3.self_attn.o_b_proj.weight_scale_inv": "layers.3.attn.wo_b.scale",
        "model.layers.3.self_attn.compressor.kv_norm.weight": "layers.3.attn.compressor.norm.weight",
        "model.layers.3.self_attn.compressor.gate_proj.weight": "layers.3.attn.compressor.wgate.weight",
        "model.layers.3.self_attn.compressor.indexer.kv_norm.weight":
            "layers.3.attn.indexer.compressor.norm.weight",
        "model.layers.3.self_attn.compressor.indexer.gate_proj.weight":
            "layers.3.attn.indexer.compressor.wgate.weight",
        "model.layers.3.post_attention_layernorm.weight": "layers.3.ffn_norm.weight",
        "model.layers.3.ffn_hc.scale": "layers.3.hc_ffn_scale",
        "model.layers.3.mlp.shared_experts.down_proj.weight": "layers.3.ffn.shared_experts.w2.weight",
        "model.layers.3.mlp.experts.7.up_proj.weight": "layers.3.ffn.experts.7.w3.weight",
        "model.layers.3.mlp.gate.tid2eid": "layers.3.ffn.gate.tid2eid",
        "model.layers.3.attn.norm.weight": "layers.3.attn.kv_norm.weight",
        "model.layers.1.engram.embed.scale": "layers.1.engram.embed.scale",
        "model.language_model.layers.0.attn.wkv.weight": "layers.0.attn.wkv.weight",
        "model.hc_head.hc_scale": "hc_head_scale",
        "lm_head.weight": "head.weight",
    }
    for hf, up in cases.items():
        assert canonical_name(hf) == up, hf
        assert canonical_name(up) == up, up


def test_vision_skipped_with_one_log_line_and_mtp_kept_in_both_namings(tmp_path, caplog):
    t = {"embed.weight": bf16(np.ones((4, 8))), "mtp.0.attn.wq_a.weight": bf16(np.ones((2, 8))),
         "model.mtp.1.norm.weight": bf16(np.ones(8)), "vision.blocks.0.w": bf16(np.ones(3)),
         "model.vision_tower.x": bf16(np.ones(3)), "visual.patch_embed": bf16(np.ones(3)),
         "aligner.fc.weight": bf16(np.ones(3)), "image_newline": bf16(np.ones(8))}
    write_safetensors(tmp_path / "m.safetensors", t)
    with caplog.at_level(logging.INFO, logger="engine.checkpoint.reader"):
        ck = Checkpoint(tmp_path / "m.safetensors")
    assert sorted(ck.names()) == ["embed.weight", "mtp.0.attn.wq_a.weight", "mtp.1.norm.weight"]
    assert ck.skipped == {"vision": 5}
    lines = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "5 vision" in lines[0].getMessage()


# ----------------------------------------------------------------------------- quantized weights
def test_fp8_and_fp4_weights(tmp_path):
    rng = np.random.default_rng(1)
    w8 = rng.standard_normal((70, 100)).astype(np.float32)
    q8, s8 = F.quant_fp8_blocks(w8, (32, 32), "ue8m0")
    q8b, s8b = F.quant_fp8_blocks(w8, (128, 128), "fp32")
    w4 = rng.standard_normal((16, 64)).astype(np.float32)
    p4, s4 = F.quant_fp4_rows(w4)
    emb = rng.standard_normal((10, 64)).astype(np.float32)
    qe, se = F.quant_fp8_blocks(emb, (1, 32))
    write_safetensors(tmp_path / "q.safetensors", {
        "a.weight": ("F8_E4M3", q8), "a.scale": ("F8_E8M0", s8),
        "b.weight": ("F8_E4M3", q8b), "b.scale": ("F32", s8b),
        "layers.0.ffn.experts.0.w1.weight": ("I8", p4), "layers.0.ffn.experts.0.w1.scale": ("F8_E8M0", s4),
        "layers.1.engram.embed.weight": ("F8_E4M3", qe), "layers.1.engram.embed.scale": ("F8_E8M0", se),
        "c.weight": ("F8_E4M3", q8),
    })
    ck = Checkpoint(tmp_path / "q.safetensors")
    a = ck.weight("a.weight", expect_shape=(70, 100), expect_fmt="fp8")
    assert (a.scale_fmt, a.block) == ("ue8m0", (32, 32))
    assert np.array_equal(a.dequant(), F.dequant_fp8_blocks(q8, s8, (32, 32)))
    b = ck.weight("b.weight")
    assert (b.scale_fmt, b.block) == ("fp32", (128, 128))
    assert np.array_equal(b.dequant(), F.dequant_fp8_blocks(q8b, s8b, (128, 128)))
    e = ck.weight("layers.0.ffn.experts.0.w1.weight", expect_shape=(16, 64))
    assert (e.fmt, e.scale_fmt, e.block, e.data.shape) == ("fp4", "ue8m0", (1, 32), (16, 32))
    assert np.array_equal(e.dequant(), F.dequant_fp4_experts(p4, s4))
    g = ck.weight("layers.1.engram.embed.weight")
    assert (g.fmt, g.block) == ("fp8", (1, 32))
    with pytest.raises(CheckpointError, match=r"'c.weight'.*no scale tensor 'c.scale'"):
        ck.weight("c.weight")
    # a configured block size wins when it fits the scale shape
    ck2 = Checkpoint(tmp_path / "q.safetensors", block_size=(32, 32))
    assert ck2.weight("a.weight").block == (32, 32)


# ----------------------------------------------------------------------------- malformed
def _small(tmp_path, name="m.safetensors"):
    t = {"embed.weight": bf16(np.ones((4, 8))), "norm.weight": f32(np.ones(8)),
         "layers.0.ffn.gate.tid2eid": ("I64", np.zeros((4, 2), np.int64))}
    write_safetensors(tmp_path / name, t)
    return tmp_path / name


def test_missing_tensor_bad_shape_bad_dtype(tmp_path):
    p = _small(tmp_path)
    ck = Checkpoint(p)
    with pytest.raises(CheckpointError, match=r"missing tensor 'head.weight'"):
        ck.raw("head.weight")
    with pytest.raises(CheckpointError, match=r"m.safetensors: tensor 'embed.weight' has shape \[4, 8\]"):
        ck.weight("embed.weight", expect_shape=(8, 4))
    with pytest.raises(CheckpointError, match=r"'embed.weight' has dtype BF16, expected F32"):
        ck.raw("embed.weight", expect_dtype="F32")
    with pytest.raises(CheckpointError, match=r"'norm.weight' is f32 \(F32\), expected bf16"):
        ck.weight("norm.weight", expect_fmt="bf16")
    with pytest.raises(CheckpointError, match=r"'layers.0.ffn.gate.tid2eid' is I64, not a float"):
        ck.f32("layers.0.ffn.gate.tid2eid")


def test_truncated_file(tmp_path):
    p = _small(tmp_path)
    data = p.read_bytes()
    p.write_bytes(data[:-5])
    with pytest.raises(CheckpointError, match=r"m.safetensors: truncated file: tensor"):
        Checkpoint(p)
    p.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"m.safetensors: truncated"):
        Checkpoint(p)


def test_corrupted_header(tmp_path):
    p = _small(tmp_path)
    data = bytearray(p.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    bad = bytes(data[:8]) + b"{not json" + bytes(data[17:])
    p.write_bytes(bad)
    with pytest.raises(CheckpointError, match=r"m.safetensors: corrupted header"):
        Checkpoint(p)
    p.write_bytes(struct.pack("<Q", 1 << 40) + bytes(data[8:]))
    with pytest.raises(CheckpointError, match=r"m.safetensors: corrupted or truncated header"):
        Checkpoint(p)
    hdr = json.loads(bytes(data[8:8 + n]))
    hdr["embed.weight"]["dtype"] = "F32"  # byte count no longer matches the shape
    blob = json.dumps(hdr).encode()
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(data[8 + n:]))
    with pytest.raises(CheckpointError, match=r"tensor 'embed.weight' has 64 bytes, F32\[4, 8\] needs 128"):
        Checkpoint(p)


def test_index_missing_shard_and_missing_entry(tmp_path):
    _small(tmp_path, "model-00001-of-00002.safetensors")
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"head.weight": bf16(np.ones((4, 8)))})
    wm = {"model.embed.weight": "model-00001-of-00002.safetensors",
          "model.norm.weight": "model-00001-of-00002.safetensors",
          "model.layers.0.ffn.gate.tid2eid": "model-00001-of-00002.safetensors",
          "lm_head.weight": "model-00002-of-00002.safetensors"}
    # the writer used upstream names; the index must list names as stored
    wm = {canonical_name(k) if k != "lm_head.weight" else "head.weight": v for k, v in wm.items()}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    ck = Checkpoint(tmp_path)
    assert ck.names() == ["embed.weight", "head.weight", "layers.0.ffn.gate.tid2eid", "norm.weight"]
    assert Checkpoint(index).names() == ck.names()
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing shard model-00002-of-00002.safetensors"):
        Checkpoint(tmp_path)
    wm2 = dict(wm, **{"extra.weight": "model-00001-of-00002.safetensors"})
    del wm2["head.weight"]
    index.write_text(json.dumps({"weight_map": wm2}))
    with pytest.raises(CheckpointError, match=r"index lists tensor 'extra.weight' in model-00001"):
        Checkpoint(tmp_path)
    index.write_text("{broken")
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: bad index file"):
        Checkpoint(tmp_path)


def test_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        Checkpoint(tmp_path / "nope.safetensors")


def test_hf_merged_fp4_experts_split_per_expert(tmp_path):
    rng = np.random.default_rng(2)
    e, inter, h = 3, 32, 64
    w13 = rng.standard_normal((e, 2 * inter, h)).astype(np.float32)
    w2 = rng.standard_normal((e, h, inter)).astype(np.float32)
    p13, s13 = zip(*(F.quant_fp4_rows(w13[x]) for x in range(e)), strict=True)
    p2, s2 = zip(*(F.quant_fp4_rows(w2[x]) for x in range(e)), strict=True)
    L = "model.layers.5.mlp.experts."
    write_safetensors(tmp_path / "m.safetensors", {
        L + "gate_up_proj": ("I8", np.stack(p13)), L + "gate_up_proj_scale_inv": ("F8_E8M0", np.stack(s13)),
        L + "down_proj": ("I8", np.stack(p2)), L + "down_proj_scale_inv": ("F8_E8M0", np.stack(s2)),
    })
    ck = Checkpoint(tmp_path / "m.safetensors")
    assert len(ck.names()) == e * 3 * 2
    for x in range(e):
        w1 = ck.weight(f"layers.5.ffn.experts.{x}.w1.weight", expect_shape=(inter, h), expect_fmt="fp4")
        w3 = ck.weight(f"layers.5.ffn.experts.{x}.w3.weight", expect_shape=(inter, h))
        w2x = ck.weight(f"layers.5.ffn.experts.{x}.w2.weight", expect_shape=(h, inter))
        full = F.dequant_fp4_experts(p13[x], s13[x])
        assert np.array_equal(w1.dequant(), full[:inter]) and np.array_equal(w3.dequant(), full[inter:])
        assert np.array_equal(w2x.dequant(), F.dequant_fp4_experts(p2[x], s2[x]))
