"""Both ends of a state transfer, independent of how the payload moves (transport_*.py).

Owner: `TransferServer` answers fetches for entries of its HostStore, checking the key and
the fencing epoch first, and keeps the entry leased until the payload is out.
Fetcher: `fetch` connects to the advertised address, negotiates the transport, receives into
a fresh host buffer and verifies the digest; it raises FetchError and leaves nothing behind
on any failure.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

from .protocol import (
    CHECKSUM,
    INVALID,
    MISSING,
    PROTO_VERSION,
    PROTOCOL,
    STALE,
    TOO_LARGE,
    Deadline,
    FetchError,
    TreeHasher,
    connect,
    parse_addr,
    recv_frame,
    send_frame,
    transfer_budget,
    tune,
)
from .store import HostBuffer, HostStore

log = logging.getLogger("dsuf.kvcache.peer")


@dataclass
class Offer:
    """What a fetcher needs to know about a record to fetch it."""

    key: bytes
    epoch: int
    addr: str
    size: int
    n_tokens: int
    transports: tuple[str, ...] = ("tcp",)


class TransferServer:
    def __init__(self, store: HostStore, movers: dict[str, Any], host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 30.0, stall_s: float = 5.0, min_rate: float = 100e6):
        self.store, self.movers = store, movers
        self.host, self.port = host, port
        self.timeout_s, self.stall_s, self.min_rate = timeout_s, stall_s, min_rate
        self.served = 0
        self.served_bytes = 0
        self.refused: dict[str, int] = {}
        self._sock: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listen; returns the bound port."""
        host, port = self.host, self.port
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(128)
        s.setblocking(False)
        self._sock, self.port = s, s.getsockname()[1]
        self._task = asyncio.get_running_loop().create_task(self._accept(), name="kv-transfer-accept")
        return self.port

    async def close(self) -> None:
        for t in [self._task, *self._conns]:
            if t:
                t.cancel()
        for t in [self._task, *self._conns]:
            if t:
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
        if self._sock:
            self._sock.close()
            self._sock = None

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            tune(conn)
            t = loop.create_task(self._handle(conn))
            self._conns.add(t)
            t.add_done_callback(self._conns.discard)

    async def _handle(self, conn: socket.socket) -> None:
        deadline = Deadline(self.timeout_s, self.stall_s)
        try:
            req = await recv_frame(conn, deadline)
            await self._answer(conn, req, deadline)
        except FetchError as e:
            log.info("transfer to a peer ended early: %s (%s)", e, e.reason)
        except (OSError, asyncio.CancelledError) as e:
            log.info("transfer connection closed: %s", e)
        finally:
            conn.close()

    async def _answer(self, conn: socket.socket, req: dict, deadline: Deadline) -> None:
        if req.get("op") != "fetch" or req.get("v") != PROTO_VERSION:
            await send_frame(conn, {"status": "error", "error": "unsupported request"}, deadline)
            return
        try:
            key = bytes.fromhex(str(req.get("key")))
        except ValueError:
            key = b""
        entry = self.store.get(key)
        if entry is None:
            self.refused[MISSING] = self.refused.get(MISSING, 0) + 1
            await send_frame(conn, {"status": MISSING}, deadline)
            return
        if req.get("epoch") is not None and entry.epoch != req.get("epoch"):
            # our record was superseded (or never ours at that epoch): a stale directory entry
            self.refused[STALE] = self.refused.get(STALE, 0) + 1
            await send_frame(conn, {"status": STALE, "epoch": entry.epoch}, deadline)
            return
        with self.store.lease(entry):
            if entry.evicted:
                await send_frame(conn, {"status": MISSING}, deadline)
                return
            digest = await asyncio.get_running_loop().run_in_executor(None, entry.digest)
            mover = self.movers.get(str(req.get("transport"))) or self.movers["tcp"]
            deadline.restart(transfer_budget(entry.size, self.timeout_s, self.min_rate))
            reply = {"status": "ok", "size": entry.size, "digest": digest.hex(), "n_tokens": entry.n_tokens,
                     "epoch": entry.epoch, "transport": mover.name}
            await mover.serve(conn, entry, req.get("offer") or {}, reply, deadline)
            self.served += 1
            self.served_bytes += entry.size


def choose_mover(movers: dict[str, Any], peer_transports: tuple[str, ...]) -> Any:
    for name in ("rdma", "tcp"):
        if name in movers and name in peer_transports:
            return movers[name]
    return movers["tcp"]


async def fetch(offer: Offer, store: HostStore, movers: dict[str, Any], *, timeout_s: float = 5.0,
                stall_s: float = 2.0, min_rate: float = 100e6) -> tuple[HostBuffer, dict]:
    """Fetch one state from its owner into a new host buffer (not yet inserted in the store)."""
    if offer.size > store.capacity:
        raise FetchError(TOO_LARGE, f"state of {offer.size} bytes exceeds the host cache")
    t0 = time.perf_counter()
    deadline = Deadline(transfer_budget(offer.size, timeout_s, min_rate), stall_s)
    parse_addr(offer.addr)
    sock = await connect(offer.addr, deadline)
    mover = choose_mover(movers, offer.transports)
    ctx = None
    buf: HostBuffer | None = None
    try:
        ctx, client_offer = await mover.open()
        await send_frame(sock, {"v": PROTO_VERSION, "op": "fetch", "key": offer.key.hex(), "epoch": offer.epoch,
                                "transport": mover.name, "offer": client_offer}, deadline)
        reply = await recv_frame(sock, deadline)
        status = reply.get("status")
        if status in (MISSING, STALE):
            raise FetchError(status, f"owner {offer.addr} answered {status} for epoch {offer.epoch}")
        if status != "ok" or reply.get("transport") != mover.name:
            raise FetchError(PROTOCOL, f"owner {offer.addr} answered {reply!r}")
        size = int(reply["size"])
        if int(reply["n_tokens"]) != offer.n_tokens:
            raise FetchError(INVALID, "owner's state covers a different prefix length")
        if size > store.capacity:
            raise FetchError(TOO_LARGE, f"state of {size} bytes exceeds the host cache")
        t_reply = time.perf_counter()
        buf = store.alloc(size)
        t_alloc = time.perf_counter()
        hasher = TreeHasher(buf.view())
        try:
            await mover.receive(sock, buf, reply, ctx, deadline, hasher)
        finally:  # also on failure: no hashing thread may still read the buffer when it is freed
            t_recv = time.perf_counter()
            got = await asyncio.get_running_loop().run_in_executor(None, hasher.digest)
        reply["_timing"] = {"handshake_s": t_reply - t0, "alloc_s": t_alloc - t_reply, "receive_s": t_recv - t_alloc,
                            "verify_s": time.perf_counter() - t_recv}
        if got.hex() != reply.get("digest"):
            raise FetchError(CHECKSUM, f"state from {offer.addr} failed its checksum")
        return buf, reply
    except BaseException:
        if buf is not None:
            buf.close()
        raise
    finally:
        if ctx is not None:
            mover.close_client(ctx)
        sock.close()
