"""config.json parsing: every accepted spelling, and clear errors for broken configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.model.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]
DEMO_V41 = REPO / "models" / "demo-v41"


def _demo() -> dict:
    return json.loads((DEMO_V41 / "config.json").read_text())


def test_demo_v41_schedule() -> None:
    cfg = load_config(DEMO_V41)
    assert cfg.arch == "v41"
    assert cfg.compress_ratios == (0, 2, 2, 1, 1, 1)
    assert cfg.layer_kinds == ("sliding", "source", "shared", "source", "shared", "shared")
    assert [cfg.kv_group_source(i) for i in range(6)] == [-1, 1, 1, 3, 3, 3]
    assert cfg.candidate_source_layer_id == 3 and cfg.engram_layer_ids == (1,)
    assert cfg.rope_dim == 16 and cfg.rope_compress.theta == 160000.0


def test_composite_text_config_and_quantization() -> None:
    raw = {"model_type": "deepseek_v41", "text_config": _demo(),
           "quantization_config": {"weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}}
    cfg = parse_config(raw)
    assert cfg.arch == "v41" and cfg.weight_block_size == (32, 32) and cfg.expert_dtype == "fp4"


def test_upstream_names_and_yarn() -> None:
    raw = {"dim": 256, "n_layers": 4, "n_heads": 4, "head_dim": 64, "rope_head_dim": 16, "q_lora_rank": 128,
           "vocab_size": 1000, "n_routed_experts": 8, "n_activated_experts": 2, "moe_inter_dim": 128,
           "compress_ratios": [0, 4, 128, 4], "o_groups": 2,
           "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                            "beta_fast": 32, "beta_slow": 1}}
    cfg = parse_config(raw)
    assert cfg.arch == "v4" and cfg.layer_kinds == ("sliding", "csa", "hca", "csa")
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.factor == 16
    assert cfg.rope_main.rope_type == "default"  # YaRN only on compressed branches
    assert cfg.hash_layers == (True, True, True, False)  # V4 default: 3 hash layers


def test_v4_legacy_num_hash_layers() -> None:
    raw = {"model_type": "deepseek_v4", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
           "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 32, "vocab_size": 100, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_hash_layers": 1, "o_groups": 2,
           "compress_ratios": [4, 0, 128]}
    cfg = parse_config(raw)
    assert cfg.hash_layers == (True, False, False) and cfg.compress_ratios == (4, 0, 128)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("hidden_size"), "hidden_size"),
    (lambda c: c.update(model_type="llama"), "model_type"),
    (lambda c: c.update(kv_source_layer_ids=[0]), "kv_source_layer_ids"),
    (lambda c: c.update(index_source_layer_ids=[3, 4]), "must also be index sources"),
    (lambda c: c.update(compress_ratios=[0, 2]), "compress_ratios has 2 entries"),
    (lambda c: c.update(candidate_source_layer_id=2), "candidate_source_layer_id"),
    (lambda c: c.update(qk_rope_head_dim=65), "rope dim"),
    (lambda c: c.update(o_groups=3), "o_groups"),
    (lambda c: c.update(num_key_value_heads=4), "one shared KV head"),
    (lambda c: c.update(engram_num_embeddings=[1, 2]), "engram_num_embeddings"),
    (lambda c: c.update(rope_parameters=None, rope_scaling={"type": "longrope"}), "rope_type"),
])
def test_bad_configs_fail_clearly(tmp_path: Path, edit, message: str) -> None:
    c = _demo()
    edit(c)
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path)


def test_missing_and_garbled_config_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**_demo(), "num_hidden_layers": "six"}))
    with pytest.raises(ConfigError, match="malformed"):
        load_config(tmp_path)
