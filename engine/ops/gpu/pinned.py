"""Asynchronous host->device uploads of the small per-step inputs (token ids, RoPE tables, hash
ids, masks) through a ring of pinned host memory.

cupy.asarray(numpy_array) copies from pageable memory, which the driver stages synchronously: the
host waits for the stream, so every such upload in a forward serialises Python with the GPU (a
decode step paid for its kernels and its Python one after the other). From pinned memory the
copy is a plain stream-ordered memcpyAsync and the host runs ahead.

The ring is split in two halves. Before writing into a half again, the host waits on the event
recorded when it last left that half, so no upload still in flight is overwritten (with a few
MB per half that wait is for copies long finished).
"""

from __future__ import annotations

import cupy as cp
import numpy as np

_ALIGN = 256


class PinnedUploader:
    def __init__(self, nbytes: int = 8 << 20) -> None:
        self.half = nbytes // 2
        self._mem = cp.cuda.alloc_pinned_memory(2 * self.half)
        self._host = np.frombuffer(self._mem, dtype=np.uint8, count=2 * self.half)
        self._events: list[cp.cuda.Event | None] = [None, None]
        self._side = 0
        self._off = 0

    def upload(self, a: np.ndarray) -> cp.ndarray:
        """A device copy of a (contiguous numpy array), ordered on the current stream."""
        a = np.ascontiguousarray(a)
        n = a.nbytes
        out = cp.empty(a.shape, dtype=a.dtype)
        if n == 0:
            return out
        if n > self.half:  # too big to stage: the plain (synchronous) path
            out.set(a)
            return out
        if self._off + n > self.half:
            self._switch()
        start = self._side * self.half + self._off
        self._host[start:start + n] = a.reshape(-1).view(np.uint8)
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(out.data.ptr, self._host.ctypes.data + start, n,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        self._off += -(-n // _ALIGN) * _ALIGN
        return out

    def _switch(self) -> None:
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record()
        self._events[self._side] = ev
        self._side ^= 1
        self._off = 0
        pending = self._events[self._side]
        if pending is not None:
            pending.synchronize()
