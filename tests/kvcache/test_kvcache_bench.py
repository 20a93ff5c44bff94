"""tools/bench_transfer.py builds V4.1 states without running the model: its layout must be
exactly what the model's states serialize to, and its buffers must load as states."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from engine.state.sequence import _HEADER, SequenceState

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_transfer as bt  # noqa: E402


def _directory(buf: bytes) -> list:
    meta_len = _HEADER.unpack_from(buf, 0)[5]
    return json.loads(buf[_HEADER.size:_HEADER.size + meta_len])["arrays"]


def test_synthetic_layout_matches_model_states(engine):
    cfg = bt.shape_of("demo-v41")
    assert cfg.model_key == engine.model.model_key
    rng = np.random.default_rng(0)
    for n in (37, 64, 129):
        st = engine.new_state()
        engine.step([st], [[int(t) for t in rng.integers(10, 8000, n)]])
        real = st.to_bytes()
        assert _directory(real) == bt.layout(cfg, n)
        assert abs(len(real) - bt.state_size(cfg, n)) <= 12  # only the digits of the last token ids differ
        syn = bt.synthetic_state(cfg, n)
        assert len(syn) == bt.state_size(cfg, n)
        back = SequenceState.from_bytes(syn, model_key=cfg.model_key)
        assert back.position == n
        assert [a.shape for a in back.layers[3].__dict__.values() if isinstance(a, np.ndarray)] == \
            [a.shape for a in st.layers[3].__dict__.values() if isinstance(a, np.ndarray)]


def test_flash_state_size_per_token():
    cfg = bt.shape_of("v41-flash")
    n = 1 << 20
    per_token = (bt.state_size(cfg, n) - bt.state_size(cfg, n - 1024)) / 1024
    assert abs(per_token - 890) < 1  # DESIGN.md: 890 B per token in DeepSeek's stored formats
    assert abs(bt.state_size(cfg, 1 << 16) - (1 << 16) * 890 - 40 * 127 * 528) < 20_000  # + window rings
