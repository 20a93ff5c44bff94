"""A prompt chunk's indexer selection in blocks of query rows (engine/model/v41.py Indexer.select,
ops.indexer_rows): whatever the blocks, the same top-k and candidate masks, logits and state, bit
for bit, in both numerics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint.reader import Checkpoint
from engine.model import v41
from engine.model.config import load_config
from engine.runtime.engine import make_ops
from engine.runtime.runner import ModelRunner
from engine.settings import Settings

DEMO_V41 = Path(__file__).resolve().parents[2] / "models" / "demo-v41"


def _model(numerics: str) -> ModelRunner:
    if not DEMO_V41.is_dir():
        pytest.skip(f"{DEMO_V41} not present")
    cfg = load_config(DEMO_V41)
    ops = make_ops("numpy", Settings(numerics=numerics))  # what --numerics selects
    return ModelRunner(cfg, Checkpoint(DEMO_V41, block_size=cfg.weight_block_size), ops,
                       DEMO_V41 / "tokenizer.json")


def _run(m: ModelRunner, monkeypatch, block: int | None) -> tuple[list, list, list, int]:
    """Logits, final states and every select's published masks of a fixed workload (prompt
    chunks of two sequences, past the index top-k and the candidate blocks' reach, then decode
    steps), with selection blocks of at most `block` rows (None: the backend's own), and the
    number of blocks scored."""
    masks, blocks, inside = [], [0], [False]
    real_select, real_scores = v41.Indexer.select, m.ops.indexer_scores

    def select(self, p, s) -> None:
        keys = s.state.layers[self.cfg.kv_group_source(self.attn.li)].idx_keys
        inside[0] = True
        try:
            real_select(self, p, s)
        finally:
            inside[0] = False
        if keys is not None and keys.shape[0]:  # (else nothing is scored or published)
            masks.append([None if s.shared.get(k) is None else s.shared[k].copy() for k in ("topk", "cand")])

    def scores(*args, **kw):
        blocks[0] += inside[0]  # (numpy's decode scores call it too: those are not a chunk's blocks)
        return real_scores(*args, **kw)

    monkeypatch.setattr(v41.Indexer, "select", select)
    monkeypatch.setattr(m.ops, "indexer_scores", scores)
    if block is not None:
        monkeypatch.setattr(m.ops, "indexer_rows", lambda rows, entries: block)
    rng = np.random.default_rng(5)
    a, b = (rng.integers(3, m.cfg.vocab_size, size=n).tolist() for n in (230, 97))
    sa, sb = m.new_state(), m.new_state()
    logits = [m.forward([sa], [a[:23]], all_logits=True)[0]]
    logits += m.forward([sa, sb], [a[23:190], b[:60]], all_logits=True)
    logits += m.forward([sb, sa], [b[60:], a[190:]], all_logits=True)
    for t in (7, 11, 13):  # the batched decode path: no chunk selection, but it reads what chunks left
        logits += m.forward([sa, sb], [[t], [t + 1]])
    monkeypatch.undo()
    return logits, [sa.to_bytes(), sb.to_bytes()], masks, blocks[0]


@pytest.mark.parametrize("numerics", ["exact", "deepseek"])
def test_select_in_row_blocks_is_bit_identical(numerics: str, monkeypatch) -> None:
    m = _model(numerics)
    ref, ref_states, ref_masks, whole = _run(m, monkeypatch, None)
    assert whole == len(ref_masks) > 0  # the numpy backend: one block per chunk select
    assert any(t is not None and t.shape[1] > m.cfg.index_topk for t, _ in ref_masks)  # the top-k chose
    assert any(c is not None and c.shape[1] > m.cfg.candidate_topk_blocks * m.cfg.candidate_block_size
               for _, c in ref_masks)  # and the candidate blocks did
    for block in (1, 5):
        got, states, masks, count = _run(m, monkeypatch, block)
        # every chunk's rows went through blocks of at most `block` rows
        rows = [t.shape[0] for t, _ in ref_masks]
        assert count == sum(-(-r // block) for r in rows) > whole
        assert len(masks) == len(ref_masks)
        for (t, c), (rt, rc) in zip(masks, ref_masks, strict=True):
            np.testing.assert_array_equal(t, rt)
            assert (c is None) == (rc is None)
            if c is not None:
                np.testing.assert_array_equal(c, rc)
        assert len(got) == len(ref)
        for g, r in zip(got, ref, strict=True):
            np.testing.assert_array_equal(g, r)
        assert states == ref_states


def test_row_blocks() -> None:
    """Balanced blocks: as few as the bound allows, sizes within one, covering every row once."""
    for rows in (0, 1, 5, 16, 17, 100, 4096):
        for most in (1, 5, 32, 341, 5000):
            b = v41.row_blocks(rows, most)
            assert [r for r0, r1 in b for r in range(r0, r1)] == list(range(rows))
            assert len(b) == -(-rows // most)
            sizes = [r1 - r0 for r0, r1 in b]
            assert not sizes or (max(sizes) <= most and max(sizes) - min(sizes) <= 1)
