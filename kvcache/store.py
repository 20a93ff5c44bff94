"""Host-memory store of sequence-state snapshots: an LRU bounded by bytes.

Each snapshot is one serialized `SequenceState` (engine/state/sequence.py) in its own page-aligned
anonymous mapping, locked in RAM where RLIMIT_MEMLOCK allows, so the RDMA transport can
register it as a memory region and peers can read it in place. Entries are indexed by exact
prefix key, by anchor (see keys.py) and by conversation id. Leased entries (a transfer or a
deserialization in progress) are never freed under the reader.

The store is used from the engine thread (snapshots) and the event loop (lookups,
transfers), so everything runs under one lock; callbacks run outside it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import mmap
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .keys import PrefixKeys, candidates_in_block
from .protocol import tree_digest

log = logging.getLogger("dsuf.kvcache.store")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mlock.argtypes = _libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_warned_pin = False


class HostBuffer:
    """A page-aligned anonymous mapping, pinned if the memlock limit allows."""

    def __init__(self, size: int, pin: bool = True):
        global _warned_pin
        self.size = size
        self.mm = mmap.mmap(-1, max(size, 1))
        self._anchor = ctypes.c_char.from_buffer(self.mm)  # keeps the address valid; dropped in close()
        self.addr = ctypes.addressof(self._anchor)
        self.pinned = False
        self.reg: Any = None  # transport registration (RDMA memory region), closed with the buffer
        if pin and size:
            self.pinned = _libc.mlock(self.addr, size) == 0
            if not self.pinned and not _warned_pin:
                _warned_pin = True
                log.warning("mlock failed (errno %d): host cache buffers are not pinned; raise the memlock limit",
                            ctypes.get_errno())

    def view(self) -> memoryview:
        return memoryview(self.mm)[:self.size]

    def close(self) -> None:
        if self.reg is not None:
            self.reg.close()
            self.reg = None
        if self.pinned:
            _libc.munlock(self.addr, self.size)
            self.pinned = False
        del self._anchor
        try:
            self.mm.close()
        except BufferError:  # a view still lives in a finished socket future: unmap when it dies
            gc.collect()
            try:
                self.mm.close()
            except BufferError:
                pass


@dataclass(eq=False)
class Entry:
    key: bytes
    n_tokens: int
    anchor: bytes
    buf: HostBuffer
    session: str | None = None
    epoch: int | None = None  # fencing token of our directory record; None: not advertised by us
    advertise: bool = True  # False once another server took ownership (we keep a local copy)
    created: float = field(default_factory=time.time)
    leases: int = 0
    evicted: bool = False
    _digest: bytes | None = None

    @property
    def size(self) -> int:
        return self.buf.size

    def view(self) -> memoryview:
        return self.buf.view()

    def digest(self) -> bytes:
        """Transfer checksum, computed on first use (most snapshots are never fetched)."""
        if self._digest is None:
            self._digest = tree_digest(self.view())
        return self._digest


class HostStore:
    def __init__(self, capacity_bytes: int, pin: bool = True,
                 on_evict: Callable[[Entry], None] | None = None,
                 registrar: Callable[[HostBuffer], Any] | None = None):
        self.capacity = int(capacity_bytes)
        self.pin = pin
        self.on_evict = on_evict
        self.registrar = registrar  # set by the RDMA transport: registers every buffer
        self._lock = threading.RLock()
        self._lru: OrderedDict[bytes, Entry] = OrderedDict()
        # anchor -> {n_tokens: keys}: conversations that share a prefix (a system prompt) share
        # anchors, and may have the same length
        self._anchors: dict[bytes, dict[int, set[bytes]]] = {}
        self._sessions: dict[str, set[bytes]] = {}
        self.used = 0
        self.evictions = 0

    # ---- allocation ----------------------------------------------------------------------
    def alloc(self, size: int) -> HostBuffer:
        """A buffer for a snapshot of `size` bytes (registered with the transport if any)."""
        buf = HostBuffer(size, self.pin)
        if self.registrar is not None and size:
            try:
                buf.reg = self.registrar(buf)
            except Exception:
                buf.close()
                raise
        return buf

    # ---- insert / find -------------------------------------------------------------------
    def put(self, key: bytes, n_tokens: int, anchor: bytes, payload: bytes | memoryview,
            session: str | None = None) -> Entry | None:
        """Copy payload in; None when it cannot fit even after evicting everything unleased."""
        with self._lock:
            old = self._lru.get(key)
            if old is not None:
                self._touch(old, session)
                return old
        if len(payload) > self.capacity:
            return None
        buf = self.alloc(len(payload))
        buf.view()[:] = payload
        return self.insert(key, n_tokens, anchor, buf, session)

    def insert(self, key: bytes, n_tokens: int, anchor: bytes, buf: HostBuffer,
               session: str | None = None, digest: bytes | None = None) -> Entry | None:
        """Take ownership of a filled buffer (a fetched state): no copy."""
        evicted: list[Entry] = []
        with self._lock:
            old = self._lru.get(key)
            if old is not None:
                self._touch(old, session)
                buf.close()
                return old
            if not self._make_room(buf.size, evicted):
                buf.close()
                entry = None
            else:
                entry = Entry(key=key, n_tokens=n_tokens, anchor=anchor, buf=buf, session=session,
                              _digest=digest)
                self._lru[key] = entry
                self._anchors.setdefault(anchor, {}).setdefault(n_tokens, set()).add(key)
                if session:
                    self._sessions.setdefault(session, set()).add(key)
                self.used += buf.size
        self._notify(evicted)
        return entry

    def get(self, key: bytes) -> Entry | None:
        with self._lock:
            e = self._lru.get(key)
            if e is not None:
                self._lru.move_to_end(key)
            return e

    def best_match(self, pk: PrefixKeys, limit: int, session: str | None = None) -> Entry | None:
        """Longest stored prefix of pk's tokens of at most `limit` tokens."""
        with self._lock:
            if session and session in self._sessions:  # narrowed: this conversation's snapshots only
                for e in sorted((self._lru[k] for k in self._sessions[session] if k in self._lru),
                                key=lambda e: -e.n_tokens):
                    if e.n_tokens <= limit and pk.key(e.n_tokens) == e.key:
                        self._lru.move_to_end(e.key)
                        return e
            for k in pk.blocks_desc(limit):
                lengths = self._anchors.get(pk.chain[k])
                if not lengths:
                    continue
                for n in candidates_in_block(k, lengths, limit):
                    key = pk.key(n)
                    if key in lengths[n] and key in self._lru:
                        self._lru.move_to_end(key)
                        return self._lru[key]
        return None

    @contextmanager
    def lease(self, entry: Entry) -> Iterator[Entry]:
        """Keep entry's memory alive while it is read (transfer, deserialization)."""
        with self._lock:
            entry.leases += 1
        try:
            yield entry
        finally:
            with self._lock:
                entry.leases -= 1
                free = entry.evicted and entry.leases == 0
            if free:
                entry.buf.close()

    def owned(self) -> list[Entry]:
        with self._lock:
            return [e for e in self._lru.values() if e.epoch is not None]

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._lru.values())

    def __len__(self) -> int:
        return len(self._lru)

    def remove(self, key: bytes) -> None:
        with self._lock:
            e = self._lru.get(key)
            if e is not None:
                self._drop(e)
        if e is not None:
            self._notify([e])

    def clear(self) -> None:
        with self._lock:
            gone = list(self._lru.values())
            for e in gone:
                self._drop(e)
        self._notify(gone)

    # ---- internals -------------------------------------------------------------------------
    def _touch(self, e: Entry, session: str | None) -> None:
        self._lru.move_to_end(e.key)
        if session and e.session is None:
            e.session = session
            self._sessions.setdefault(session, set()).add(e.key)

    def _make_room(self, size: int, evicted: list[Entry]) -> bool:
        if size > self.capacity:
            return False
        for e in list(self._lru.values()):  # oldest first
            if self.used + size <= self.capacity:
                break
            if e.leases == 0:
                self._drop(e)
                evicted.append(e)
                self.evictions += 1
        return self.used + size <= self.capacity

    def _drop(self, e: Entry) -> None:
        del self._lru[e.key]
        lengths = self._anchors.get(e.anchor)
        keys = lengths.get(e.n_tokens) if lengths is not None else None
        if keys is not None:
            keys.discard(e.key)
            if not keys:
                del lengths[e.n_tokens]
            if not lengths:
                del self._anchors[e.anchor]
        if e.session and e.session in self._sessions:
            self._sessions[e.session].discard(e.key)
            if not self._sessions[e.session]:
                del self._sessions[e.session]
        self.used -= e.size
        e.evicted = True
        if e.leases == 0:
            e.buf.close()

    def _notify(self, evicted: list[Entry]) -> None:
        if self.on_evict:
            for e in evicted:
                try:
                    self.on_evict(e)
                except Exception:  # a directory hiccup must not break an insert
                    log.exception("eviction callback failed")
