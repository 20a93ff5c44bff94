"""Test helper: an engine whose DSpark draft proposes one chosen token everywhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.runtime.engine import Engine


def proposing(ckpt: Path, token: int) -> Engine:
    """An engine on `ckpt` whose draft proposes `token` at every position (its Markov bias dwarfs
    its logits)."""
    eng = Engine.load(ckpt)
    mh = eng.model.model.dspark.markov_head
    mh.embed.weight = np.ones_like(mh.embed.weight)
    head = np.zeros_like(mh.head)
    head[token] = 1e4 / head.shape[1]
    mh.head = head
    return eng
