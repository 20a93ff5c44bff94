"""What a sequence state of one model may look like, checked before a state read from bytes is used.

A state that came from a peer (or from memory this process did not write just now) is checked
against the model's own layout before anything is allocated for it: the layer count, each
array's field, rows and width for that layer at that position, its byte size in its codec,
the position against the context length, the look-back tokens against the vocabulary, and the
whole buffer against the largest state the model can have for that many tokens. A state that
fails raises StateError; the caller recomputes the prompt. The layout comes from the model's
config (duck-typed here: the state package imports nothing of the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

FIELDS = ("window", "buf_kv", "buf_gate", "ovl_kv", "ovl_gate", "entries",
          "idx_buf_kv", "idx_buf_gate", "idx_ovl_kv", "idx_ovl_gate", "idx_keys")
CODECS = {0: 1, 1: 32, 2: 16, 3: 32}  # codec -> elements per scale (float32: none)
MAX_LAYERS = 1024  # no checkpoint comes near; a claim beyond it is refused even without a model at hand
_META_SLACK = 4096  # header, model key, codecs, look-back tokens
_META_PER_ARRAY = 96  # one directory entry in JSON, generously


class StateError(ValueError):
    """A state buffer that cannot be read back (bad magic, version, model, layout or truncation)."""


@dataclass(frozen=True)
class StateShape:
    """The layout of one model's sequence states (engine/model/base.py state_shape)."""

    model_key: str
    num_layers: int
    head_dim: int
    index_head_dim: int
    window_rows: int
    ratios: tuple[int, ...]  # per layer: compression ratio, 0 where the layer keeps only its window
    max_position: int
    max_recent: int
    vocab_size: int

    @classmethod
    def of(cls, cfg: Any, model_key: str, max_position: int) -> StateShape:
        """From a ModelConfig (only its fields are read)."""
        ratios = tuple(int(r) for r in cfg.compress_ratios)
        if cfg.arch == "v41":  # only the KV sources keep compressor state and entries
            ratios = tuple(r if i in cfg.kv_source_layer_ids else 0 for i, r in enumerate(ratios))
        return cls(model_key=model_key, num_layers=int(cfg.num_layers), head_dim=int(cfg.head_dim),
                   index_head_dim=int(cfg.index_head_dim), window_rows=max(int(cfg.sliding_window), 0),
                   ratios=ratios, max_position=int(max_position),
                   max_recent=max(int(getattr(cfg, "engram_max_ngram_size", 0) or 0) - 1, 0),
                   vocab_size=int(cfg.vocab_size))

    def limit(self, layer: int, name: str, position: int) -> tuple[int, tuple[int, ...]] | None:
        """(most rows, allowed widths) of a field of a layer at a position; None: not in this layer."""
        d, di = self.head_dim, self.index_head_dim
        if name == "window":
            return self.window_rows, (d,)
        r = self.ratios[layer] if layer < len(self.ratios) else 0
        if r <= 0:
            return None
        if name == "entries":
            return position // r, (d,)
        if name == "idx_keys":
            return position // r, (di,)
        return 2 * r, (d, 2 * d, di, 2 * di)  # a pending group or an overlap slice

    def max_bytes(self, n_tokens: int) -> int:
        """The largest serialized state of n_tokens tokens: every array at its bound, in float32."""
        total, arrays = 0, 0
        for li in range(self.num_layers):
            for name in FIELDS:
                lim = self.limit(li, name, n_tokens)
                if lim is not None:
                    total += lim[0] * max(lim[1]) * 4
                    arrays += 1
        return total + _META_SLACK + arrays * _META_PER_ARRAY + len(self.model_key)


def blob_size(shape: tuple[int, ...], codec: int) -> int:
    """Bytes of an array of `shape` in `codec` (what decode_array expects)."""
    count = 1
    for s in shape:
        count *= s
    block = CODECS[codec]
    if codec == 0:
        return count * 4
    if count % block:
        raise StateError("state array does not fill its codec's blocks")
    return count // block + (count if codec == 1 else count // 2)


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise StateError(f"state {what} out of range")
    return v


def check_directory(meta: Any, n_arrays: int, position: int, body_len: int, shape: StateShape | None) -> None:
    """Refuse a state whose header and directory do not fit (the model's layout, when given)
    before any array is decoded; every size is checked against what is actually there."""
    if not isinstance(meta, dict) or not isinstance(meta.get("arrays"), list):
        raise StateError("state directory is not an object with arrays")
    n_layers = _int(meta.get("layers"), 0, MAX_LAYERS, "layer count")
    arrays = meta["arrays"]
    if len(arrays) != n_arrays or n_arrays > n_layers * len(FIELDS):
        raise StateError("state directory does not match its header")
    if not isinstance(meta.get("model"), str) or not isinstance(meta.get("recent"), list):
        raise StateError("state directory lacks its model or look-back tokens")
    codecs = meta.get("codecs", {})
    if not isinstance(codecs, dict) or any(k not in FIELDS or v not in CODECS for k, v in codecs.items()):
        raise StateError("state codecs are not known")
    if shape is not None:
        if n_layers != shape.num_layers:
            raise StateError(f"state claims {n_layers} layers; the model has {shape.num_layers}")
        _int(position, 0, shape.max_position, "position")
        if len(meta["recent"]) > shape.max_recent:
            raise StateError("state carries too many look-back tokens")
        for t in meta["recent"]:
            _int(t, 0, shape.vocab_size - 1, "look-back token")
        if body_len > shape.max_bytes(position):
            raise StateError(f"state of {body_len} bytes exceeds the model's largest for {position} tokens")
    seen, total = set(), 0
    for a in arrays:
        if not isinstance(a, list) or len(a) != 5:
            raise StateError("state directory entry malformed")
        li, name, dims, codec, nbytes = a
        _int(li, 0, n_layers - 1, "array layer")
        if name not in FIELDS or (li, name) in seen:
            raise StateError("state array named twice or unknown")
        seen.add((li, name))
        if codec not in CODECS or not isinstance(dims, list) or len(dims) != 2:
            raise StateError("state array codec or rank not supported")
        rows, width = (_int(x, 0, body_len, "array dimension") for x in dims)
        if shape is not None:
            lim = shape.limit(li, name, position)
            if lim is None or rows > lim[0] or width not in lim[1]:
                raise StateError(f"state array {name} of layer {li} ({rows} x {width}) does not fit the model")
        if _int(nbytes, 0, body_len, "array size") != blob_size((rows, width), codec):
            raise StateError("state array size does not match its shape")
        total += nbytes
    if total != body_len:
        raise StateError("state buffer length does not match its directory")


def check_values(layers: list) -> None:
    """Every array finite (a NaN or inf row would poison the sequence's attention)."""
    for ls in layers:
        for name in FIELDS:
            a = getattr(ls, name)
            if a is not None and a.size and not np.isfinite(a).all():
                raise StateError(f"state array {name} holds non-finite values")
