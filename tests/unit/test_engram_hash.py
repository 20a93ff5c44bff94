"""Engram's n-gram hash ids (engine/model/engram.py NgramHasher), vectorized over every row of
several sequences' chunks, against a plain per-row statement of what a row hashes: the token k
places back for k = 0 .. N-1, from the row's chunk, then its sequence's history, else the pad
(before position 0, or beyond the history)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.model.config import load_config
from engine.model.engram import NgramHasher

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-v41"


@pytest.fixture(scope="module")
def hasher() -> NgramHasher:
    return NgramHasher(load_config(DEMO), DEMO / "tokenizer.json")


def _row(h: NgramHasher, history: list[int], chunk: list[int], pos0: int, j: int) -> np.ndarray:
    """One row's hash ids, written out token by token."""
    seq = list(history) + list(chunk)
    at = len(history) + j
    cols = []
    for k in range(h.n):
        i = at - k
        cols.append(int(h.token_map[seq[i]]) if i >= 0 and pos0 + j - k >= 0 else h.pad)
    return h._hash(np.array([cols], np.int64))[0]


def test_rows_of_several_chunks_match_the_per_row_rule(hasher: NgramHasher) -> None:
    rng = np.random.default_rng(0)
    vocab = hasher.token_map.size
    cases = [([], [5], 0), ([7], [1, 2, 3], 1), (list(rng.integers(0, vocab, 9)), list(rng.integers(0, vocab, 6)), 40),
             ([3, 4], list(rng.integers(0, vocab, 17)), 2), (list(rng.integers(0, vocab, 1)), [9], 7),
             ([], list(rng.integers(0, vocab, 4)), 0), ([11, 12, 13], [14], 100)]
    hist, chunks, pos = map(list, zip(*cases, strict=True))
    got = hasher(hist, [np.array(c, np.int64) for c in chunks], pos)
    want = np.stack([_row(hasher, h, c, p, j) for h, c, p in cases for j in range(len(c))])
    np.testing.assert_array_equal(got, want)
    # one sequence's chunk alone hashes as it does beside others
    one = hasher([hist[2]], [np.array(chunks[2], np.int64)], [pos[2]])
    start = sum(len(c) for c in chunks[:2])
    np.testing.assert_array_equal(one, got[start:start + len(chunks[2])])


def test_a_decode_step_matches_the_per_row_rule(hasher: NgramHasher) -> None:
    """Every chunk one token (a decode step's rows, built directly)."""
    rng = np.random.default_rng(1)
    vocab = hasher.token_map.size
    cases = [([], [5], 0), ([7], [1], 1), (list(rng.integers(0, vocab, 9)), [3], 40), ([3, 4], [8], 0),
             ([2], [6], 5)]
    hist, chunks, pos = map(list, zip(*cases, strict=True))
    got = hasher(hist, [np.array(c, np.int64) for c in chunks], pos)
    np.testing.assert_array_equal(got, np.stack([_row(hasher, h, c, p, 0) for h, c, p in cases]))
