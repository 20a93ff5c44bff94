"""V4.1 Engram n-gram hashing: token ids -> row ids of the Engram tables.

Each position is hashed as the 2..N-grams ending there, over a *compressed* vocabulary where
tokens that normalise alike (" The", "the", "THE") share an id; each (n-gram size, head) pair
owns a disjoint prime-sized bucket range of the layer's table. The layout, the multipliers and
the compressed map must be reproduced exactly or a trained table reads as noise.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def layer_primes(n_layers: int, max_ngram: int, n_heads: int, vocab_size: int) -> list[list[list[int]]]:
    """Primes [layer][ngram-2][head], drawn in order above `vocab_size - 1`, never reused."""
    seen: set[int] = set()
    out = []
    for _ in range(n_layers):
        per_ngram = []
        for _ in range(max_ngram - 1):
            sizes, cur = [], vocab_size - 1
            for _ in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                sizes.append(cur)
            per_ngram.append(sizes)
        out.append(per_ngram)
    return out


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """One odd multiplier per (layer, look-back) from a per-layer seeded RNG, bounded so that
    id * multiplier cannot overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * lid).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for lid in layer_ids]
    return np.stack(rows)


@lru_cache(maxsize=4)
def compressed_token_map(tokenizer_json: str) -> tuple[np.ndarray, int]:
    """token id -> compressed id, and the compressed vocabulary size (NFKC, accents stripped,
    lower-cased, whitespace runs collapsed, stripped; partial UTF-8 byte tokens keyed raw)."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(tokenizer_json)
    sentinel = "\ue000"  # keeps a token that is exactly one space distinct from the empty string
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    n = tok.get_vocab_size(with_added_tokens=True)
    key_to_new: dict[str, int] = {}
    lookup = np.zeros(n, dtype=np.int64)
    for tid in range(n):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        lookup[tid] = key_to_new.setdefault(key, len(key_to_new))
    return lookup, len(key_to_new)


class NgramHasher:
    """Hash ids [T, n_engram_layers, (N-1) * heads] for the tokens of one forward call."""

    def __init__(self, cfg, tokenizer_json: str | Path):
        token_map, size = compressed_token_map(str(tokenizer_json))
        if size != cfg.engram_compressed_vocab_size:
            raise ValueError(
                f"Engram: the tokenizer's compressed vocabulary has {size} ids but the config says "
                f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}; the tables would be misread")
        self.n = cfg.engram_max_ngram_size
        self.token_map = token_map
        self.pad = int(token_map[cfg.engram_pad_id])
        primes = layer_primes(len(cfg.engram_layer_ids), self.n, cfg.engram_n_heads, cfg.engram_vocab_size)
        self.primes = np.asarray(primes, dtype=np.int64)  # [L, N-1, heads]
        flat = self.primes.reshape(len(primes), -1)
        self.offsets = np.concatenate([np.zeros((flat.shape[0], 1), np.int64), np.cumsum(flat, axis=1)[:, :-1]],
                                      axis=1)  # [L, (N-1)*heads]
        self.multipliers = hash_multipliers(tuple(cfg.engram_layer_ids), self.n, size)  # [L, N]
        for li, rows in enumerate(cfg.engram_num_embeddings):
            if rows and int(flat[li].sum()) > rows:
                raise ValueError(f"Engram layer {cfg.engram_layer_ids[li]}: table has {rows} rows, "
                                 f"the hash layout needs {int(flat[li].sum())}")

    @property
    def row_shape(self) -> tuple[int, int]:
        """One token's hash ids: [Engram layers, (N-1) * heads]."""
        return self.offsets.shape

    def __call__(self, histories: list[list[int]], chunks: list, positions: list[int]) -> np.ndarray:
        """Hash ids of B sequences' chunks of one forward, row after row ([sum of chunk lengths, L,
        (N-1)*heads]), vectorized over every row: histories[b] the raw ids before chunks[b], whose
        first token sits at positions[b]. A row's n-gram reaches back into its chunk, then its
        history; a token before position 0 or not in the history is the pad."""
        n, last = self.n, self.n - 1
        if all(len(c) == 1 for c in chunks):  # a decode step (every step's host time): rows built directly
            pad = [-1] * n
            raw = np.array([([int(c[0]), *(h[::-1][:last] if last else ())] + pad)[:n]
                            for h, c in zip(histories, chunks, strict=True)], dtype=np.int64)
            ok = (raw >= 0) & (np.asarray(positions, dtype=np.int64)[:, None] - np.arange(n)[None, :] >= 0)
            return self._hash(np.where(ok, self.token_map[np.maximum(raw, 0)], self.pad))
        lens = np.fromiter((len(c) for c in chunks), np.int64, len(chunks))
        cat = np.concatenate([np.asarray(c, np.int64).reshape(-1) for c in chunks])
        cstart = np.cumsum(lens) - lens
        row_seq = np.repeat(np.arange(lens.size), lens)
        back = (np.arange(cat.size) - cstart[row_seq])[:, None] - np.arange(n)[None, :]  # [rows, N]: in the chunk
        raw = cat[np.maximum(cstart[row_seq][:, None] + back, 0)]
        if last:  # before the chunk: its sequence's last N-1 history ids (-1 where it has fewer)
            hist = np.array([([-1] * last + [int(t) for t in h[-last:]])[-last:] for h in histories], np.int64)
            raw = np.where(back >= 0, raw, hist[row_seq[:, None], np.clip(last + back, 0, last - 1)])
        pos = np.asarray(positions, np.int64)[row_seq][:, None] + back
        ok = (raw >= 0) & (pos >= 0)
        return self._hash(np.where(ok, self.token_map[np.maximum(raw, 0)], self.pad))

    def _hash(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [S, N] (compressed ids, column j = the token j places back) -> hash ids."""
        products = tokens[:, None, :] * self.multipliers[None]  # [S, L, N]
        rolling = products[..., 0]
        hashes = []
        for i in range(1, self.n):
            rolling = np.bitwise_xor(rolling, products[..., i])
            hashes.append(rolling[..., None] % self.primes[None, :, i - 1, :])
        return np.concatenate(hashes, axis=-1) + self.offsets[None]
