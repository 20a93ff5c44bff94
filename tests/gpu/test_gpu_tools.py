"""`dsuf.py bench` on a tiny checkpoint: the decode and prefill tables print (skipped without a GPU)."""

from __future__ import annotations

from gpu_required import require_gpu

cp = require_gpu()


def test_bench_model_prints_decode_and_prefill(tmp_path, capsys):
    from engine.bench import bench_model
    from engine.checkpoint.tiny_model import write_tiny_model

    ckpt = write_tiny_model(tmp_path / "tiny", "v41", seed=3)
    bench_model(str(ckpt), 1e12, batches=(1, 2), prefills=(64,), steps=2)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rows) == 2, out  # (batches 1 and 2)
    assert "prefill 64 tokens" in out
