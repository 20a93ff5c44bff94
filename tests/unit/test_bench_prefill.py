"""bench's prefill timing (engine/bench.py _bench_prefill) on the demo model and the numpy backend:
chunks go in as serve feeds a prompt, with nothing drawn and no logits read back between them
(a read-back makes the host wait for each chunk before it prepares the next)."""

from __future__ import annotations

import numpy as np
from test_bench_floor import _stats

from engine.bench import _bench_prefill
from engine.runtime.engine import Engine


def test_prefill_chunks_read_nothing_back(capsys, monkeypatch) -> None:
    eng = Engine.load(None)
    model, ops, chunk = eng.model, eng.model.ops, 32
    reads = []
    to_host = ops.to_host
    monkeypatch.setattr(ops, "to_host", lambda x: reads.append(1) or to_host(x))
    counts = []
    for prompt in (chunk, 4 * chunk):
        reads.clear()
        _bench_prefill(model, eng.config, [model], [], _stats(1), [prompt], chunk, {"fp8": 1e15, "bf16": 1e15},
                       "deepseek", np.random.default_rng(0), 1e11)
        counts.append(len(reads))
    out = capsys.readouterr().out
    assert f"prefill {4 * chunk} tokens in chunks of {chunk}" in out and "by part" in out
    # the warm-up's reads alone: none per chunk
    assert counts[0] == counts[1]
