"""tools/dev/host_plan.py on the CPU: a decode step and a verify step planned on V4.1-Flash's layer
schedule, with context enough for compressed entries and indexer keys."""

from __future__ import annotations

from engine.checkpoint.tiny_model import flash_config
from engine.model.config import parse_config
from tools.dev import host_plan


def test_host_plan_times_a_flash_schedule_step(capsys) -> None:
    cfg = parse_config(flash_config())
    assert cfg.num_layers == 40 and len(cfg.index_source_layer_ids) == 8
    for rows in (1, 6):
        plan, packed = host_plan.host_seconds(cfg, batch=2, rows=rows, context=12, repeats=2)
        assert 0 < plan < 1.0 and 0 < packed < 1.0
    assert host_plan.main(["--batches", "2", "--rows", "1", "--context", "4"]) == 0
    assert "b2 x 1 row(s): plan_decode" in capsys.readouterr().out
