"""Writing safetensors files: streamed tensor by tensor (ShardWriter), or whole (write_safetensors)."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from engine.checkpoint.reader import SAFETENSORS_DTYPES


class ShardWriter:
    """Streams one safetensors file: the header is written from the declared specs first,
    then each tensor's bytes as it is produced, so memory stays bounded by one tensor.

    specs: ordered (name, safetensors dtype, shape); `write` must follow the same order."""

    def __init__(self, path: str | os.PathLike, specs: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        off = 0
        self._order: list[tuple[str, str, tuple[int, ...], int]] = []
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
            self._order.append((name, dtype, tuple(shape), nbytes))
            off += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned, as the reference writer does
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(blob)))
        self._f.write(blob)
        self._next = 0
        self._left = 0

    def begin(self, name: str) -> None:
        """Start the next declared tensor; its bytes follow through write_part()."""
        if self._next >= len(self._order) or self._order[self._next][0] != name:
            want = self._order[self._next][0] if self._next < len(self._order) else None
            raise ValueError(f"{self.path}: expected tensor {want!r} next, got {name!r}")
        self._left = self._order[self._next][3]

    def write_part(self, array: np.ndarray) -> None:
        """Append row-major bytes of the current tensor (any chunking along axis 0)."""
        name, dtype, _, _ = self._order[self._next]
        a = np.ascontiguousarray(array)
        if a.dtype.itemsize != SAFETENSORS_DTYPES[dtype].itemsize:
            raise ValueError(f"{name}: {a.dtype} data for a {dtype} tensor")
        if a.nbytes > self._left:
            raise ValueError(f"{name}: more data than its declared shape holds")
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        self._f.write(memoryview(a).cast("B"))
        self._left -= a.nbytes

    def end(self) -> None:
        name = self._order[self._next][0]
        if self._left:
            raise ValueError(f"{name}: {self._left} bytes missing")
        self._next += 1

    def write(self, name: str, array: np.ndarray) -> None:
        """Write one whole tensor (shape must match its declaration)."""
        shape = self._order[self._next][2] if self._next < len(self._order) else None
        if shape is not None and tuple(np.shape(array)) != shape:
            raise ValueError(f"{name}: array shape {list(np.shape(array))} != declared {list(shape)}")
        self.begin(name)
        self.write_part(array)
        self.end()

    def close(self) -> None:
        if self._next != len(self._order):
            self._f.close()
            raise ValueError(f"{self.path}: {len(self._order) - self._next} declared tensors never written")
        self._f.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._f.close()


def write_safetensors(path: str | os.PathLike, tensors: dict[str, tuple[str, np.ndarray]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write {name: (safetensors dtype, array)} to one file (small checkpoints, tests)."""
    specs = [(n, dt, tuple(a.shape)) for n, (dt, a) in tensors.items()]
    with ShardWriter(path, specs, metadata) as w:
        for n, (_, a) in tensors.items():
            w.write(n, a)
