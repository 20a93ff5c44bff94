"""Wire format of the state-transfer protocol, shared by the TCP and RDMA transports.

Every transfer starts on a TCP control connection to the owner's advertised address:

    owner  -> fetcher  frame {op: hello, nonce}
    fetcher -> owner   frame {op: fetch, key, epoch, transport, offer, nonce, mac}
    owner  -> fetcher  frame {status, size, digest, state_mac, n_tokens, epoch, transport, ..., mac}
    payload            TCP: `size` raw bytes on the same socket;
                       RDMA: the fetcher RDMA-READs the owner's memory region, then sends
                       frame {op: done} so the owner can release its buffer.

A frame is b"DSKV" + u32 length + JSON. The digest is a tree hash (blake2b over 4 MiB
chunks, hashed in parallel) of the whole payload, checked before a state is used; `mac` and
`state_mac` are the handshake proofs and the state's MAC (auth.py). Every
wait is bounded by a deadline and a stall timeout; every failure is a FetchError whose
reason names the metric label.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

PROTO_VERSION = 2
MAGIC = b"DSKV"
_FRAME = struct.Struct("<4sI")
MAX_FRAME = 1 << 20
DIGEST_CHUNK = 4 << 20
IO_CHUNK = 8 << 20

# FetchError reasons (metric labels)
UNREACHABLE, MISSING, STALE, TIMEOUT, CHECKSUM, PROTOCOL, INVALID, TOO_LARGE, PEER_CLOSED = (
    "unreachable", "missing", "stale", "timeout", "checksum", "protocol", "invalid_state", "too_large",
    "peer_closed")
UNAUTHORIZED, BAD_MAC = "unauthorized", "bad_mac"

_hash_pool = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="kv-digest")


class FetchError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _chunk_digest(part: memoryview) -> bytes:
    return hashlib.blake2b(part, digest_size=16).digest()


class TreeHasher:
    """blake2b of 4 MiB chunk digests. Chunks are hashed on a thread pool (hashlib drops the
    GIL) as soon as they are complete, so a receiver verifies while the bytes still arrive."""

    def __init__(self, view: memoryview | bytes):
        self.view = memoryview(view)
        self.futures: list = []
        self.done = 0  # bytes handed to the pool

    def advance(self, upto: int) -> None:
        """Bytes [0, upto) are final: hash every complete chunk in them."""
        while self.done + DIGEST_CHUNK <= upto:
            self.futures.append(_hash_pool.submit(_chunk_digest, self.view[self.done:self.done + DIGEST_CHUNK]))
            self.done += DIGEST_CHUNK

    def digest(self) -> bytes:
        n = len(self.view)
        if self.done < n or n == 0:
            self.futures.append(_hash_pool.submit(_chunk_digest, self.view[self.done:n]))
            self.done = n
        parts = b"".join(f.result() for f in self.futures)
        self.futures = []
        self.view = memoryview(b"")  # drop the export: the buffer may be unmapped now
        return hashlib.blake2b(parts + n.to_bytes(8, "little"), digest_size=16, person=b"dsuf-tree").digest()


def tree_digest(view: memoryview | bytes) -> bytes:
    h = TreeHasher(view)
    h.advance(len(h.view))
    return h.digest()


class Deadline:
    """Overall time bound of one transfer plus a bound on each silent wait."""

    def __init__(self, total_s: float, stall_s: float):
        self.end = time.monotonic() + total_s
        self.stall_s = stall_s

    def restart(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def wait_s(self) -> float:
        left = self.remaining()
        if left <= 0:
            raise FetchError(TIMEOUT, "transfer deadline passed")
        return min(left, self.stall_s)


async def _bounded(aw, deadline: Deadline, what: str):
    try:
        return await asyncio.wait_for(aw, deadline.wait_s())
    except TimeoutError:
        raise FetchError(TIMEOUT, f"timed out waiting for {what}") from None


async def send_frame(sock: socket.socket, obj: dict, deadline: Deadline) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    await send_all(sock, memoryview(_FRAME.pack(MAGIC, len(body)) + body), deadline)


async def _ready(sock: socket.socket, write: bool) -> None:
    """Wait until the socket is readable (or writable)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = sock.fileno()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        remove(fd)


async def recv_exact(sock: socket.socket, view: memoryview, deadline: Deadline, what: str = "data",
                     hasher: TreeHasher | None = None) -> None:
    """Fill view from the socket; each silent gap is bounded by the stall timeout. Reads
    straight into view and awaits only when the socket is empty (one await per recv would
    cost more than the copy on loopback)."""
    off, n = 0, len(view)
    while off < n:
        try:
            got = sock.recv_into(view[off:off + IO_CHUNK])
        except (BlockingIOError, InterruptedError):
            await _bounded(_ready(sock, False), deadline, what)
            continue
        except OSError as e:
            raise FetchError(PEER_CLOSED, f"connection failed after {off} of {n} bytes of {what}: {e}") from None
        if got == 0:
            raise FetchError(PEER_CLOSED, f"peer closed the connection after {off} of {n} bytes of {what}")
        off += got
        if hasher is not None:
            hasher.advance(off)


async def send_all(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    off, n = 0, len(view)
    while off < n:
        try:
            off += sock.send(view[off:off + IO_CHUNK])
        except (BlockingIOError, InterruptedError):
            await _bounded(_ready(sock, True), deadline, "the peer to read")


async def recv_frame(sock: socket.socket, deadline: Deadline, limit: int = MAX_FRAME) -> dict:
    """One frame; `limit` bounds what an unauthenticated peer can make us allocate."""
    head = bytearray(_FRAME.size)
    await recv_exact(sock, memoryview(head), deadline, "a frame header")
    magic, length = _FRAME.unpack(head)
    if magic != MAGIC or length > limit:
        raise FetchError(PROTOCOL, "not a dsuf transfer frame")
    body = bytearray(length)
    await recv_exact(sock, memoryview(body), deadline, "a frame")
    try:
        obj = json.loads(body)
    except ValueError:
        raise FetchError(PROTOCOL, "transfer frame is not JSON") from None
    if not isinstance(obj, dict):
        raise FetchError(PROTOCOL, "transfer frame is not an object")
    return obj


async def send_payload(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    await send_all(sock, view, deadline)


def tune(sock: socket.socket) -> None:
    """Non-blocking, no Nagle, large buffers (fewer wake-ups per MB)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:
            pass


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


async def connect(addr: str, deadline: Deadline) -> socket.socket:
    host, port = parse_addr(addr)
    loop = asyncio.get_running_loop()
    try:
        infos = await _bounded(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), deadline, "DNS")
        fam, typ, proto, _, sa = infos[0]
        sock = socket.socket(fam, typ, proto)
    except OSError as e:
        raise FetchError(UNREACHABLE, f"cannot resolve {addr}: {e}") from None
    tune(sock)
    try:
        await _bounded(loop.sock_connect(sock, sa), deadline, f"a connection to {addr}")
    except OSError as e:
        sock.close()
        raise FetchError(UNREACHABLE, f"cannot connect to {addr}: {e}") from None
    except FetchError:
        sock.close()
        raise
    return sock


def transfer_budget(size: int, timeout_s: float, min_rate: float) -> float:
    """Time allowed for a transfer: the fixed timeout plus size at the slowest acceptable rate."""
    return timeout_s + size / max(min_rate, 1.0)
