"""The scheduler's side of constrained decoding (engine/runtime/constraint.py).

Each constrained sequence gets its matcher on the engine thread the first time it samples; before
every sampling step the masks of the sampling sequences are computed there, after the previous
step's tokens were fed to the matchers (the scheduler's _apply runs between two steps), so a mask
always follows the token before it. The runner's planning ahead of the next decode step touches no
token, so it needs nothing of this.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from engine.runtime.constraint import Constrainer, TokenConstraint

log = logging.getLogger("dsuf.guided")


class Guide:
    """Per scheduler: the engine's Constrainer, made on the first constrained request."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._constrainer: Constrainer | None = None

    @property
    def constrainer(self) -> Constrainer:
        return self._get()

    def _get(self) -> Constrainer:
        if self._constrainer is None:
            e = self.engine
            ids = e.tokenizer.special_ids
            self._constrainer = Constrainer(
                e.ckpt_dir / "tokenizer.json", int(e.config.vocab_size), sorted(e.eos_ids), e.config.arch,
                ids.get("dsml"), ids.get("think_end"))
        return self._constrainer

    def masks(self, seqs: list) -> list[np.ndarray | None]:
        """Engine thread: the next token's mask per sequence (None: unconstrained now). A matcher
        that cannot start leaves its sequence's error in `s.guide_error` and a mask of EOS only."""
        if not any(s.gen.grammar is not None for s in seqs):
            return [None] * len(seqs)
        c = self._get()
        for s in seqs:
            if s.gen.grammar is not None and s.constraint is None:
                try:
                    s.constraint = c.start(s.gen.grammar, s.gen.thinking)
                except Exception as e:  # noqa: BLE001 - one request's grammar fails only that request
                    log.warning("constrained decoding could not start: %s", e)
                    s.guide_error = f"constrained decoding failed: {e}"
                    s.constraint = c.start_eos_only()
        return c.masks([s.constraint for s in seqs])


def advance(s: Any, token: int) -> str | None:
    """Feed a sequence's drawn token to its matcher; an error message if the grammar refused it."""
    tc: TokenConstraint | None = s.constraint
    if s.guide_error is not None:
        return s.guide_error
    if tc is None or tc.advance(token):
        return None
    return f"constrained decoding failed: {tc.error or 'token refused'}"
