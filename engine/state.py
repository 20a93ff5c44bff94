"""Per-sequence state ("KV cache") of DeepSeek-V4 / V4.1, and its byte serialization.

What a sequence carries between forward calls, per layer:
- `window`: the last sliding_window - 1 K=V rows (the current token makes the window full);
- compressor state (V4.1 KV sources, V4 CSA/HCA layers): rows of an unfinished group
  (`buf_kv`, `buf_gate`), V4 CSA's overlap slice of the last closed window, the compressed
  entries emitted so far (`entries`) and their count;
- indexer state: V4.1 KV sources keep the indexer keys of their entries (`idx_keys`); V4 CSA
  layers run a second, smaller compressor for them (`idx_*`).
Plus the position and, for V4.1 Engram, the last few token ids.

Because every piece is kept exactly, a prompt can be fed at once, in chunks or token by token
with the same result. Arrays hold float32 values; for V4.1 they already lie on DeepSeek's
storage grids (FP8 window, FP4 entries and keys), so serializing them in those formats is
lossless (see `to_bytes`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field

import numpy as np

MAGIC = b"DSUFSTAT"
VERSION = 1
_HEADER = struct.Struct("<8sHHIqI")  # magic, version, reserved, n_arrays, position, meta_len


class StateError(ValueError):
    """A state buffer that cannot be read back (bad magic, version, model or truncation)."""


_ARRAY_FIELDS = ("window", "buf_kv", "buf_gate", "ovl_kv", "ovl_gate", "entries",
                 "idx_buf_kv", "idx_buf_gate", "idx_ovl_kv", "idx_ovl_gate", "idx_keys")


@dataclass
class LayerState:
    window: np.ndarray
    buf_kv: np.ndarray | None = None
    buf_gate: np.ndarray | None = None
    ovl_kv: np.ndarray | None = None
    ovl_gate: np.ndarray | None = None
    entries: np.ndarray | None = None
    idx_buf_kv: np.ndarray | None = None
    idx_buf_gate: np.ndarray | None = None
    idx_ovl_kv: np.ndarray | None = None
    idx_ovl_gate: np.ndarray | None = None
    idx_keys: np.ndarray | None = None

    @property
    def n_entries(self) -> int:
        return 0 if self.entries is None else int(self.entries.shape[0])


@dataclass
class SequenceState:
    position: int
    layers: list[LayerState]
    recent_tokens: list[int] = field(default_factory=list)  # V4.1 Engram look-back
    model_key: str = ""

    # ---- sizes -------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(a.nbytes for ls in self.layers for a in _arrays(ls).values())

    # ---- serialization -------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """One contiguous buffer: fixed header, JSON directory, then the raw float32 arrays."""
        directory, blobs = [], []
        for li, ls in enumerate(self.layers):
            for name, arr in _arrays(ls).items():
                a = np.ascontiguousarray(arr, dtype=np.float32)
                directory.append([li, name, list(a.shape)])
                blobs.append(a.tobytes())
        meta = json.dumps({"model": self.model_key, "layers": len(self.layers), "recent": self.recent_tokens,
                           "arrays": directory}, separators=(",", ":")).encode()
        head = _HEADER.pack(MAGIC, VERSION, 0, len(directory), self.position, len(meta))
        body = b"".join(blobs)
        digest = hashlib.blake2b(head + meta + body, digest_size=16).digest()
        return head + meta + body + digest

    @classmethod
    def from_bytes(cls, buf: bytes | memoryview, model_key: str | None = None) -> SequenceState:
        buf = memoryview(buf)
        if len(buf) < _HEADER.size + 16:
            raise StateError("state buffer truncated (shorter than its header)")
        magic, version, _, n_arrays, position, meta_len = _HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise StateError("not a dsuf state buffer (bad magic)")
        if version != VERSION:
            raise StateError(f"state format version {version} is not supported (this build reads {VERSION})")
        if hashlib.blake2b(buf[:-16], digest_size=16).digest() != bytes(buf[-16:]):
            raise StateError("state buffer checksum mismatch (corrupted or truncated)")
        off = _HEADER.size
        meta = json.loads(bytes(buf[off : off + meta_len]))
        off += meta_len
        if model_key is not None and meta["model"] != model_key:
            raise StateError(f"state belongs to model {meta['model']!r}, not {model_key!r}")
        layers = [LayerState(window=np.zeros((0, 0), np.float32)) for _ in range(meta["layers"])]
        for li, name, shape in meta["arrays"]:
            count = int(np.prod(shape)) if shape else 1
            arr = np.frombuffer(buf, dtype=np.float32, count=count, offset=off).reshape(shape).copy()
            off += count * 4
            setattr(layers[li], name, arr)
        if off != len(buf) - 16 or len(meta["arrays"]) != n_arrays:
            raise StateError("state buffer length does not match its directory")
        return cls(position=int(position), layers=layers, recent_tokens=list(meta["recent"]),
                   model_key=meta["model"])


def _arrays(ls: LayerState) -> dict[str, np.ndarray]:
    out = {}
    for name in _ARRAY_FIELDS:
        a = getattr(ls, name)
        if a is not None:
            out[name] = np.asarray(a)
    return out
