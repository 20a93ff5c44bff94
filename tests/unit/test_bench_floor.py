"""bench's prefill floor (engine/bench.py prefill_parts, work_by_kind): the multiply-adds by the rate they run at.
Under exact numerics everything is bf16 work; under DeepSeek's numerics the FP8 / FP4 weights'
linears and the indexers' scores move to FP8, the total unchanged; the indexers' work grows with
the square of the prompt and is replicated on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.bench import part_floors, prefill_parts, work_by_kind
from engine.model.config import load_config

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-v41"


def prefill_work(cfg, stats: list[dict], tokens: int, numerics: str) -> dict:
    """The prefill's multiply-adds by the rate they run at, as bench states its floor."""
    return work_by_kind(prefill_parts(cfg, stats, tokens, numerics))


def _stats(ranks: int) -> list[dict]:
    # per rank: its dense slices (some FP8; of them the router's and the shared expert's, 400 of
    # which FP8), one expert of its own (FP4: all FP8 work), 4 experts
    return [dict(dense_macs=1000, dense_fp8_macs=600, moe_dense_macs=450, moe_dense_fp8_macs=400, expert_macs=300,
                 expert_fp8_macs=300, owned=4) for _ in range(ranks)]


def test_exact_numerics_is_all_bf16_work() -> None:
    cfg = load_config(DEMO)
    work = prefill_work(cfg, _stats(1), 4096, "exact")
    assert work["fp8"] == 0 and work["bf16"] > 0


@pytest.mark.parametrize("ranks", [1, 2])
def test_deepseek_numerics_moves_fp8_linears_and_indexers(ranks: int) -> None:
    cfg = load_config(DEMO)
    assert cfg.index_source_layer_ids  # (the demo has index sources)
    exact, ds = prefill_work(cfg, _stats(ranks), 4096, "exact"), prefill_work(cfg, _stats(ranks), 4096, "deepseek")
    assert ds["fp8"] + ds["bf16"] == pytest.approx(exact["bf16"])
    e, k, nl = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.num_layers
    weights8 = ranks * 600 + nl * k * ranks * 300 * 4 / e
    index = ds["fp8"] - 4096 * weights8
    assert index > 0
    # quadratic in the prompt, and the same on every rank
    longer = prefill_work(cfg, _stats(ranks), 8192, "deepseek")["fp8"] - 8192 * weights8
    assert longer / index == pytest.approx(8192 * 8193 / (4096 * 4097))
    one = prefill_work(cfg, _stats(1), 4096, "deepseek")
    assert index == pytest.approx(ranks * (one["fp8"] - 4096 * (600 + nl * k * 300 * 4 / e)))


@pytest.mark.parametrize("numerics", ["exact", "deepseek"])
def test_the_parts_add_up_to_the_work_and_put_the_router_and_shared_expert_in_the_moe(numerics: str) -> None:
    cfg = load_config(DEMO)
    parts = prefill_parts(cfg, _stats(2), 4096, numerics)
    assert set(parts) == {"GEMMs", "MoE", "indexer", "attention"}
    work = prefill_work(cfg, _stats(2), 4096, numerics)
    for kind in ("fp8", "bf16"):
        assert sum(p.get(kind, 0.0) for p in parts.values()) == pytest.approx(work[kind])
    e, k, nl = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.num_layers
    assert sum(parts["GEMMs"].values()) == pytest.approx(4096 * 2 * (1000 - 450))
    assert sum(parts["MoE"].values()) == pytest.approx(4096 * 2 * (450 + nl * k * 300 * 4 / e))
    if numerics == "deepseek":
        assert parts["GEMMs"]["fp8"] == pytest.approx(4096 * 2 * 200) and parts["MoE"]["bf16"] == 4096 * 2 * 50
    floors = part_floors(parts, {"fp8": 2e12, "bf16": 1e12})
    assert floors["attention"] == pytest.approx(2 * parts["attention"]["bf16"] / 1e12)
