#!/usr/bin/env python3
"""The host's cost of planning a decode step on V4.1-Flash's whole layer schedule (a developer's
tool; no GPU, no weights): `python3 tools/dev/host_plan.py [--batches 1,8,32] [--rows 1,6]
[--context 200]`.

The 2-layer benchmark checkpoint has two KV source layers; the released model has 40 layers, four
KV sources and eight indexer sources, and engine/state/decode_plan.plan_decode walks every source's
rows on the host. Each batch's sequences first decode `context` one-token steps (full
windows, compressed entries, indexer keys), then a step of `rows` rows per sequence (6: a DSpark
verify step, block 5) is planned, with the trial marks a verify records, and packed into the
tables a GPU step uploads (engine/ops/gpu/staging.py pack, here with numpy buffers' host
addresses), 8 times over; the medians are printed. Both are made while the device runs the step
before (or the draft), so they bound the step from below where they take longer than the device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.checkpoint.tiny_model import flash_config  # noqa: E402
from engine.model.config import parse_config  # noqa: E402
from engine.ops.gpu.staging import pack  # noqa: E402
from engine.state.decode_plan import StepInputs, plan_decode  # noqa: E402
from engine.state.sequence import LayerState, SequenceState  # noqa: E402


def host_seconds(cfg, batch: int, rows: int, context: int, repeats: int = 8) -> tuple[float, float]:
    """Median seconds of plan_decode and of staging.pack of its step, for `rows` rows of each of
    `batch` sequences `context` tokens in."""

    def rope(pos):
        half = cfg.rope_dim // 2
        return np.zeros((len(pos), half), np.float32), np.zeros((len(pos), half), np.float32)

    states = [SequenceState(position=0, layers=[LayerState(window=np.zeros((0, cfg.head_dim), np.float32))
                                                for _ in range(cfg.num_layers)]) for _ in range(batch)]
    for _ in range(context):
        plan_decode(cfg, states, np, [], rope, True)
        for s in states:
            s.position += 1
    plans, packs = [], []
    n = batch * rows
    for _ in range(repeats):  # (on the states themselves: a copy holds no growth headroom, so it allocates)
        t0 = time.perf_counter()
        win, layers = plan_decode(cfg, states, np, [], rope, True, counts=[rows] * batch,
                                  marks=[] if rows > 1 else None)
        t1 = time.perf_counter()
        pack(StepInputs(ids=np.zeros(n, np.int64), hash_ids=None, rope=np.zeros((4, n, cfg.rope_dim // 2), np.float32),
                        layers=layers, window=win))
        plans.append(t1 - t0)
        packs.append(time.perf_counter() - t1)
        for s in states:
            s.position += rows
    return float(np.median(plans)), float(np.median(packs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rows", default="1,6", help="rows per sequence: 1 a decode step, 6 a DSpark verify step")
    ap.add_argument("--context", type=int, default=200)
    a = ap.parse_args(argv)
    cfg = parse_config(flash_config())
    print(f"V4.1-Flash schedule: {cfg.num_layers} layers, KV sources {list(cfg.kv_source_layer_ids)}, "
          f"indexer sources {list(cfg.index_source_layer_ids)}; context {a.context} tokens")
    for rows in map(int, a.rows.split(",")):
        for b in map(int, a.batches.split(",")):
            plan, packed = host_seconds(cfg, b, rows, a.context)
            print(f"b{b} x {rows} row(s): plan_decode {plan * 1e3:.2f} ms, staging.pack {packed * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
