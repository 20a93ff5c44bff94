"""Both ends of a state transfer, independent of how the payload moves (transport_*.py).

Owner: `TransferServer` answers fetches for entries of its HostStore, authenticating the
fetcher first (auth.py), then checking the key and the fencing epoch, and keeps the entry
leased until the payload is out. Its accept loop survives descriptor shortages and reports
them (on_health), so the cache withdraws its directory records while it cannot serve.
Fetcher: `fetch` connects to the advertised address, checks that the owner holds the secret,
negotiates the transport, receives into a fresh host buffer and verifies the digest and the
state's MAC; it raises FetchError and leaves nothing behind on any failure.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .auth import SECRET_ENV, PeerAuth, new_nonce
from .protocol import (
    BAD_MAC,
    CHECKSUM,
    INVALID,
    MISSING,
    PROTO_VERSION,
    PROTOCOL,
    STALE,
    TOO_LARGE,
    UNAUTHORIZED,
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

MAX_REQUEST_FRAME = 64 << 10  # a fetch request (with an RDMA offer) is far smaller
_TRANSIENT_ACCEPT = {errno.ECONNABORTED, errno.EINTR, errno.EAGAIN, errno.EPROTO}


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
                 timeout_s: float = 30.0, stall_s: float = 5.0, min_rate: float = 100e6, *,
                 auth: PeerAuth | None = None, max_conns: int = 64,
                 on_health: Callable[[bool], None] | None = None):
        self.store, self.movers = store, movers
        self.host, self.port = host, port
        self.timeout_s, self.stall_s, self.min_rate = timeout_s, stall_s, min_rate
        self.auth = auth  # None: every fetch is refused (no secret, no sharing)
        self.max_conns = max_conns
        self.on_health = on_health  # called with False when accepting fails, True when it works again
        self.healthy = True
        self.accept_errors = 0
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

    def _refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def _set_health(self, ok: bool) -> None:
        if ok == self.healthy:
            return
        self.healthy = ok
        if ok:
            log.warning("state-transfer listener accepts again: re-advertising this server's states")
        if self.on_health is not None:
            try:
                self.on_health(ok)
            except Exception:
                log.exception("listener health callback failed")

    async def _accept(self) -> None:
        """Accept forever. An accept error (descriptor or memory shortage) never ends the loop: it
        is logged, the states are withdrawn from the directory (on_health), and accepting resumes
        once descriptors are available again."""
        loop = asyncio.get_running_loop()
        backoff = 0.05
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as e:
                if e.errno in _TRANSIENT_ACCEPT:
                    continue
                self.accept_errors += 1
                if self.healthy:
                    log.error("state-transfer listener cannot accept (%s): withdrawing this server's states "
                              "from the directory until it can", e)
                self._set_health(False)
                backoff = await self._wait_for_descriptors(backoff)
                self._set_health(True)  # descriptors are back: serve (a new failure withdraws again)
                continue
            backoff = 0.05
            self._set_health(True)
            if len(self._conns) >= self.max_conns:  # a flood of connections must not eat every descriptor
                self._refuse("busy")
                conn.close()
                continue
            tune(conn)
            t = loop.create_task(self._handle(conn))
            self._conns.add(t)
            t.add_done_callback(self._conns.discard)

    async def _wait_for_descriptors(self, backoff: float) -> float:
        """Sleep with back-off until a few descriptors can be opened; returns the next back-off."""
        while True:
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)
            fds: list[int] = []
            try:
                for _ in range(4):
                    fds.append(os.dup(self._sock.fileno()))
                return backoff
            except OSError:
                continue
            finally:
                for fd in fds:
                    os.close(fd)

    async def _handle(self, conn: socket.socket) -> None:
        # before it has authenticated, a connection gets a short deadline: idle or slow strangers
        # must not hold the connection slots peers need
        deadline = Deadline(min(self.timeout_s, self.stall_s * 2), self.stall_s)
        try:
            if self.auth is None:
                self._refuse(UNAUTHORIZED)
                await send_frame(conn, {"status": UNAUTHORIZED, "error": "state sharing is off here"}, deadline)
                return
            server_nonce = new_nonce()
            await send_frame(conn, {"v": PROTO_VERSION, "op": "hello", "nonce": server_nonce}, deadline)
            req = await recv_frame(conn, deadline, MAX_REQUEST_FRAME)
            client_nonce, key = req.get("nonce"), req.get("key")
            if not (isinstance(client_nonce, str) and isinstance(key, str)
                    and self.auth.check(req.get("mac"), "fetch", server_nonce, client_nonce, key, req)):
                self._refuse(UNAUTHORIZED)
                n = self.refused[UNAUTHORIZED]
                if n == 1 or n % 100 == 0:
                    log.warning("refused an unauthenticated state fetch (%d so far)", n)
                await send_frame(conn, {"status": UNAUTHORIZED}, deadline)
                return

            deadline.restart(self.timeout_s)

            def seal(reply: dict) -> dict:
                return {**reply, "mac": self.auth.proof("serve", server_nonce, client_nonce, key, reply)}

            await self._answer(conn, req, deadline, seal)
        except FetchError as e:
            log.info("transfer to a peer ended early: %s (%s)", e, e.reason)
        except (OSError, asyncio.CancelledError) as e:
            log.info("transfer connection closed: %s", e)
        finally:
            conn.close()

    async def _answer(self, conn: socket.socket, req: dict, deadline: Deadline, seal: Callable[[dict], dict]) -> None:
        if req.get("op") != "fetch" or req.get("v") != PROTO_VERSION:
            await send_frame(conn, seal({"status": "error", "error": "unsupported request"}), deadline)
            return
        try:
            key = bytes.fromhex(str(req.get("key")))
        except ValueError:
            key = b""
        entry = self.store.get(key)
        if entry is None:
            self._refuse(MISSING)
            await send_frame(conn, seal({"status": MISSING}), deadline)
            return
        if req.get("epoch") is not None and entry.epoch != req.get("epoch"):
            # our record was superseded (or never ours at that epoch): a stale directory entry
            self._refuse(STALE)
            await send_frame(conn, seal({"status": STALE, "epoch": entry.epoch}), deadline)
            return
        with self.store.lease(entry):
            if entry.evicted:
                await send_frame(conn, seal({"status": MISSING}), deadline)
                return
            digest = await asyncio.get_running_loop().run_in_executor(None, entry.digest)
            mover = self.movers.get(str(req.get("transport"))) or self.movers["tcp"]
            deadline.restart(transfer_budget(entry.size, self.timeout_s, self.min_rate))
            reply = {"status": "ok", "size": entry.size, "digest": digest.hex(), "n_tokens": entry.n_tokens,
                     "epoch": entry.epoch, "transport": mover.name,
                     "state_mac": self.auth.state_mac(entry.key, entry.n_tokens, entry.size, digest)}
            await mover.serve(conn, entry, req.get("offer") or {}, reply, deadline, seal)
            self.served += 1
            self.served_bytes += entry.size


def choose_mover(movers: dict[str, Any], peer_transports: tuple[str, ...]) -> Any:
    for name in ("rdma", "tcp"):
        if name in movers and name in peer_transports:
            return movers[name]
    return movers["tcp"]


async def fetch(offer: Offer, store: HostStore, movers: dict[str, Any], *, auth: PeerAuth | None,
                max_size: int | None = None, timeout_s: float = 5.0, stall_s: float = 2.0,
                min_rate: float = 100e6) -> tuple[HostBuffer, dict]:
    """Fetch one state from its owner into a new host buffer (not yet inserted in the store).
    The owner must prove it holds our secret, sizes are checked against `max_size` (what the
    model's state of that many tokens can take) before any allocation, and the state's MAC is
    checked before the bytes are handed back."""
    if auth is None:
        raise FetchError(UNAUTHORIZED, f"no {SECRET_ENV}: states are not fetched from peers")
    limit = store.capacity if max_size is None else min(store.capacity, max_size)
    if offer.size > limit:
        raise FetchError(TOO_LARGE, f"state of {offer.size} bytes exceeds the {limit} bytes allowed")
    t0 = time.perf_counter()
    deadline = Deadline(transfer_budget(offer.size, timeout_s, min_rate), stall_s)
    parse_addr(offer.addr)
    sock = await connect(offer.addr, deadline)
    mover = choose_mover(movers, offer.transports)
    ctx = None
    buf: HostBuffer | None = None
    key = offer.key.hex()
    try:
        hello = await recv_frame(sock, deadline, MAX_REQUEST_FRAME)
        server_nonce = hello.get("nonce")
        if hello.get("status") == UNAUTHORIZED:
            raise FetchError(UNAUTHORIZED, f"owner {offer.addr} does not share states")
        if hello.get("op") != "hello" or not isinstance(server_nonce, str):
            raise FetchError(PROTOCOL, f"owner {offer.addr} did not greet with a nonce")
        ctx, client_offer = await mover.open()
        client_nonce = new_nonce()
        req = {"v": PROTO_VERSION, "op": "fetch", "key": key, "epoch": offer.epoch, "transport": mover.name,
               "offer": client_offer, "nonce": client_nonce}
        req["mac"] = auth.proof("fetch", server_nonce, client_nonce, key, req)
        await send_frame(sock, req, deadline)
        reply = await recv_frame(sock, deadline)
        status = reply.get("status")
        if status == UNAUTHORIZED:
            raise FetchError(UNAUTHORIZED, f"owner {offer.addr} refused our credentials (another {SECRET_ENV}?)")
        if not auth.check(reply.get("mac"), "serve", server_nonce, client_nonce, key, reply):
            raise FetchError(UNAUTHORIZED, f"{offer.addr} answered without proving it holds our secret")
        if status in (MISSING, STALE):
            raise FetchError(status, f"owner {offer.addr} answered {status} for epoch {offer.epoch}")
        if status != "ok" or reply.get("transport") != mover.name:
            raise FetchError(PROTOCOL, f"owner {offer.addr} answered status {str(status)[:40]!r}")
        try:
            size, n_tokens = int(reply["size"]), int(reply["n_tokens"])
        except (KeyError, TypeError, ValueError):
            raise FetchError(PROTOCOL, "owner's reply lacks the size") from None
        if n_tokens != offer.n_tokens:
            raise FetchError(INVALID, "owner's state covers a different prefix length")
        if not 0 < size <= limit:
            raise FetchError(TOO_LARGE, f"state of {size} bytes exceeds the {limit} bytes allowed")
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
        if not auth.check_state(reply.get("state_mac"), offer.key, n_tokens, size, got):
            raise FetchError(BAD_MAC, f"state from {offer.addr} failed its MAC (forged, or sent under another key)")
        return buf, reply
    except BaseException:
        if buf is not None:
            buf.close()
        raise
    finally:
        if ctx is not None:
            mover.close_client(ctx)
        sock.close()
