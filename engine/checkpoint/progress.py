"""Weight-loading progress: bytes and tensors read, rate and ETA, as lines for an operator.

engine.checkpoint.loader.load_weights tells a LoadProgress of each tensor it reads (every
tensor-parallel rank adds its own share to the totals); the caller (the server, `dsuf.py run`)
decides where the lines go. Lines come at most every `interval_s`, plus one when loading ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["LoadProgress", "format_bytes"]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class LoadProgress:
    """Thread-safe counters of a load, reported through `emit(line)`.

    delay_s: seconds to wait after each tensor, standing for slow storage (a hook for tests of
    what happens while a load is in progress; 0 in normal use)."""

    def __init__(self, emit: Callable[[str], None], interval_s: float = 1.0, delay_s: float = 0.0):
        self.emit, self.interval_s, self.delay_s = emit, interval_s, delay_s
        self._lock = threading.Lock()
        self.total_bytes = self.done_bytes = 0
        self.total_tensors = self.done_tensors = 0
        self._t0 = time.monotonic()
        self._last = self._t0
        self._finished = False

    def add_total(self, nbytes: int, ntensors: int) -> None:
        with self._lock:
            self.total_bytes += int(nbytes)
            self.total_tensors += int(ntensors)

    def advance(self, nbytes: int) -> None:
        """One tensor read (nbytes of it as stored)."""
        with self._lock:
            self.done_bytes += int(nbytes)
            self.done_tensors += 1
            now = time.monotonic()
            line = None
            if now - self._last >= self.interval_s:
                self._last = now
                line = self.line(now)
        if line is not None:
            self.emit(line)
        if self.delay_s > 0:
            time.sleep(self.delay_s)

    def finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            line = self.line(time.monotonic(), done=True)
        self.emit(line)

    def line(self, now: float, done: bool = False) -> str:
        dt = max(now - self._t0, 1e-9)
        rate = self.done_bytes / dt
        pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
        head = (f"loaded weights: {format_bytes(self.done_bytes)}, {self.done_tensors} tensors in {dt:.1f} s"
                if done else
                f"loading weights: {format_bytes(self.done_bytes)} / {format_bytes(self.total_bytes)} ({pct:.0f}%), "
                f"{self.done_tensors}/{self.total_tensors} tensors")
        tail = f", {format_bytes(rate)}/s"
        if not done:
            left = self.total_bytes - self.done_bytes
            tail += f", ETA {left / rate:.0f} s" if rate > 0 else ", ETA ?"
        return head + tail
