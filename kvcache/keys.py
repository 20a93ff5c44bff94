"""Prefix keys: a sequence state is found by the token ids it has consumed.

The key of a prefix of n tokens is a chained hash: a block chain over the ids in blocks of
BLOCK tokens, seeded with the model id, the state format version and the tenant, closed by the tail of
the prefix and its length. Chaining by blocks keeps hashing a 1M-token prompt to ~16k hash
calls, and gives every snapshot an *anchor* (the chain value at its last full block): a
lookup walks the request's anchors from the longest down and only then compares exact
keys, so it never has to try every prefix length.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BLOCK = 64
DIGEST = 16


def namespace(model_id: str, state_version: int, tenant: str = "") -> bytes:
    """Seed of every chain: states of different models, formats or tenants never share keys
    (so neither a local lookup nor a directory lookup can match across tenants)."""
    seed = f"dsuf-kv\0{model_id}\0v{state_version}" + (f"\0t{len(tenant)}:{tenant}" if tenant else "")
    return hashlib.blake2b(seed.encode(), digest_size=DIGEST).digest()


class PrefixKeys:
    """Keys and anchors of every prefix of one token list (chain computed once, up front)."""

    def __init__(self, ns: bytes, tokens: Sequence[int]):
        ids = array("I", tokens)  # uint32 (no numpy: the RDMA module also loads under the system Python)
        if sys.byteorder == "big":
            ids.byteswap()
        self.tokens = ids
        self._raw = ids.tobytes()
        chain = [ns]
        step = BLOCK * 4
        for k in range(len(self.tokens) // BLOCK):
            chain.append(hashlib.blake2b(chain[-1] + self._raw[k * step:(k + 1) * step],
                                         digest_size=DIGEST).digest())
        self.chain = chain

    def __len__(self) -> int:
        return len(self.tokens)

    def anchor(self, n: int) -> bytes:
        """Chain value at the last full block of the n-token prefix."""
        return self.chain[n // BLOCK]

    def key(self, n: int) -> bytes:
        """Key of the prefix of n tokens (0 < n <= len)."""
        if not 0 < n <= len(self.tokens):
            raise ValueError(f"prefix length {n} outside (0, {len(self.tokens)}]")
        k = n // BLOCK
        tail = self._raw[k * BLOCK * 4:n * 4]
        return hashlib.blake2b(self.chain[k] + tail + n.to_bytes(8, "little"), digest_size=DIGEST,
                               person=b"dsuf-snap").digest()

    def blocks_desc(self, limit: int) -> range:
        """Block indices whose anchors can hold a prefix of at most `limit` tokens, longest first."""
        return range(min(limit, len(self.tokens)) // BLOCK, -1, -1)


def candidates_in_block(k: int, lengths: Sequence[int], limit: int) -> list[int]:
    """Snapshot lengths recorded under block k's anchor that fit under limit, longest first."""
    return sorted((n for n in lengths if k * BLOCK <= n <= limit and n // BLOCK == k), reverse=True)


def snapshot_points(prompt_len: int) -> list[int]:
    """Where to snapshot a prompt: one token before its end.

    The last prompt token is the generation opener (`</think>` in chat mode, `<think>` in
    thinking mode). Thinking-mode history re-renders the previous answer as `</think>content`,
    so a state that has consumed `<think>` matches nothing later; a state just before it is
    a prefix of the next turn in both modes, and of a retried prompt too. A state cannot be
    rewound (sliding window), so the point has to be chosen before prefill.
    """
    return [prompt_len - 1] if prompt_len >= 2 else []
