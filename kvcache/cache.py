"""The state cache as the scheduler sees it: `lookup` before prefill, `snapshot` after.

    cache = StateCache(CacheConfig.from_args(args), model_id, model_key)
    await cache.start()                                   # on the event loop
    hit = await cache.lookup(prompt_ids, session_id, copies=n)
    if hit: seq.state, seq.n_prefilled = hit.states[i], hit.n_tokens
    cache.snapshot(tokens, state, session_id)             # thread-safe, before `state` moves on

lookup: the longest stored prefix here, or a longer one advertised by another server in Redis,
fetched over RDMA/TCP (this server then owns it and announces it). Any fetch failure is logged,
counted by reason and answered by a local hit or a miss: the caller recomputes, the output is
unchanged. Without DSUF_REDIS_URL the server keeps its own states only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.state.sequence import VERSION as STATE_VERSION
from engine.state.sequence import SequenceState, StateError, StateShape

from .auth import MIN_SECRET_LEN, SECRET_ENV, PeerAuth
from .directory import Directory, Record
from .keys import PrefixKeys, namespace, snapshot_points
from .peer import Offer, TransferServer, fetch
from .protocol import INVALID, FetchError
from .stats import KVStats
from .store import Entry, HostStore
from .transport_tcp import TcpMover

log = logging.getLogger("dsuf.kvcache")


def _one_address(host: str | None) -> str:
    """The HTTP --host as one address for the transfer listener, which peers reach by one address:
    `localhost` (the HTTP default, bound on every loopback address) is 127.0.0.1 here, since ::1 may
    not exist in a container."""
    return "127.0.0.1" if host in (None, "", "localhost") else host


@dataclass
class CacheConfig:
    host_cache_gb: float = 4.0
    redis_url: str | None = None
    node_id: str | None = None
    transfer_host: str = "127.0.0.1"
    transfer_port: int = 0
    advertise_host: str | None = None
    transport: str = "auto"  # auto | tcp | rdma
    rdma_device: str | None = None
    rdma_port: int | None = None
    rdma_gid_index: int | None = None
    fetch_timeout_s: float = 5.0
    stall_timeout_s: float = 2.0
    min_rate_mb_s: float = 200.0
    ttl_s: float = 120.0
    pin: bool = True
    secret: str | None = field(default=None, repr=False)  # DSUF_KV_SECRET: sharing needs it

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CacheConfig:
        g = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        return cls(host_cache_gb=float(g("host_cache_gb", 4.0)), redis_url=os.environ.get("DSUF_REDIS_URL") or None,
                   node_id=g("kv_node_id"), transfer_host=g("kv_transfer_host") or _one_address(g("host")),
                   transfer_port=int(g("kv_transfer_port") or 0), advertise_host=g("kv_advertise_host"),
                   transport=g("kv_transport") or "auto", rdma_device=g("kv_rdma_device"),
                   rdma_port=g("kv_rdma_port"), rdma_gid_index=g("kv_rdma_gid_index"),
                   fetch_timeout_s=float(g("kv_fetch_timeout", 5.0)), ttl_s=float(g("kv_ttl", 120.0)),
                   secret=os.environ.get(SECRET_ENV) or None)


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """`dsuf.py serve` flags of the state cache (DSUF_REDIS_URL turns sharing on)."""
    p.add_argument("--host-cache-gb", type=float, default=4.0, help="host memory for sequence states (0: off)")
    p.add_argument("--kv-node-id", default=None, help="this server's id in the directory (default host:port)")
    p.add_argument("--kv-transfer-host", default=None, help="address the state-transfer listener binds")
    p.add_argument("--kv-transfer-port", type=int, default=0, help="state-transfer port (0: any free port)")
    p.add_argument("--kv-advertise-host", default=None, help="address peers use to reach this server")
    p.add_argument("--kv-transport", choices=("auto", "tcp", "rdma"), default="auto",
                   help="state transfer: RDMA when a device is found (auto), or force one")
    p.add_argument("--kv-rdma-device", default=None, help="RDMA device name (default: first active)")
    p.add_argument("--kv-rdma-port", type=int, default=None, help="RDMA port number (default: first active)")
    p.add_argument("--kv-rdma-gid-index", type=int, default=None, help="GID index (default: RoCE v2 IPv4)")
    p.add_argument("--kv-fetch-timeout", type=float, default=5.0, help="seconds before a fetch is abandoned")
    p.add_argument("--kv-ttl", type=float, default=120.0, help="directory record TTL, refreshed while held")


@dataclass
class Hit:
    n_tokens: int
    source: str  # local | remote
    states: list[SequenceState] = field(default_factory=list)

    @property
    def state(self) -> SequenceState:
        return self.states[0]


class StateCache:
    def __init__(self, cfg: CacheConfig, model_id: str, model_key: str, shape: StateShape | None = None):
        self.cfg, self.model_id, self.model_key = cfg, model_id, model_key
        self.shape = shape  # the model's state layout: every state read back is checked against it
        self.auth = PeerAuth.from_secret(cfg.secret)
        self.ns = namespace(f"{model_id}|{model_key}", STATE_VERSION)
        self._tenant_ns: dict[str, bytes] = {"": self.ns}
        self._withdrawn = False  # the transfer listener cannot accept: nothing advertised meanwhile
        self._health_lock = asyncio.Lock()
        self.stats = KVStats()
        self.store = HostStore(int(cfg.host_cache_gb * (1 << 30)), pin=cfg.pin, on_evict=self._on_evict)
        self.movers: dict[str, Any] = {"tcp": TcpMover()}
        self.transport_note = "TCP only (sharing off)"
        self.server: TransferServer | None = None
        self.directory: Directory | None = None
        self.addr = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._refresher: asyncio.Task | None = None
        self._bad: dict[tuple[bytes, int], float] = {}  # failed (key, epoch): not retried for a while
        self._first_connect = True
        # snapshots are encoded off the engine thread, one at a time, in the order taken
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="dsuf-snapshot")
        self._pending: set[bytes] = set()
        self._pending_lock = threading.Lock()
        s = self.stats
        s.gauge("bytes", "Bytes of states held in host memory.", lambda: self.store.used)
        s.gauge("capacity_bytes", "Host-memory budget for states.", lambda: self.store.capacity)
        s.gauge("entries", "States held in host memory.", lambda: len(self.store))
        s.gauge("owned_entries", "States this server owns in the directory.", lambda: len(self.store.owned()))
        s.gauge("evictions", "States evicted by the LRU.", lambda: self.store.evictions)
        s.gauge("directory_up", "1 while the Redis directory is reachable.",
                lambda: float(bool(self.directory and self.directory.connected and self.directory.available)))
        s.gauge("rdma", "1 when states move over RDMA.", lambda: float("rdma" in self.movers))
        s.gauge("transfer_listener_up", "1 while the state-transfer listener accepts (0: records withdrawn).",
                lambda: float(self.server is not None and self.server.healthy))
        s.counter_fn("served_total", lambda: self.server.served if self.server is not None else 0)
        s.counter_fn("served_bytes_total", lambda: self.server.served_bytes if self.server is not None else 0)
        s.counter_fn("accept_errors_total", lambda: self.server.accept_errors if self.server is not None else 0)
        s.counter_fn("refused_total", lambda: dict(self.server.refused) if self.server is not None else {},
                     label="reason")

    @property
    def enabled(self) -> bool:
        return self.store.capacity > 0

    @property
    def sharing(self) -> bool:
        return self.directory is not None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.enabled or not self.cfg.redis_url:
            log.info("state cache: %.1f GiB host memory, no sharing%s", self.cfg.host_cache_gb,
                     "" if self.cfg.redis_url else " (DSUF_REDIS_URL not set)")
            return
        if self.auth is None:
            log.error("state sharing is OFF: DSUF_REDIS_URL is set but %s is not (or is shorter than %d "
                      "characters). Without a shared secret this server neither serves its states to peers nor "
                      "fetches theirs; it keeps its own states only. Give every server the same secret to share.",
                      SECRET_ENV, MIN_SECRET_LEN)
            return
        from .transport_rdma import make_mover

        rdma, self.transport_note = await asyncio.to_thread(
            make_mover, self.cfg.transport, self.cfg.rdma_device, self.cfg.rdma_port, self.cfg.rdma_gid_index)
        if rdma is not None:
            self.movers["rdma"] = rdma
            self.store.registrar = rdma.registrar
        self.server = TransferServer(self.store, self.movers, self.cfg.transfer_host, self.cfg.transfer_port,
                                     timeout_s=max(self.cfg.fetch_timeout_s * 2, 10.0),
                                     stall_s=self.cfg.stall_timeout_s * 2, min_rate=self.cfg.min_rate_mb_s * 1e6,
                                     auth=self.auth, on_health=self._on_listener_health)
        port = await self.server.start()
        host = self.cfg.advertise_host or self.cfg.transfer_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        self.addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        node = self.cfg.node_id or f"{socket.gethostname()}:{self.addr}"
        self.directory = Directory(self.cfg.redis_url, node, self.addr, tuple(self.movers), ttl_s=self.cfg.ttl_s)
        self.directory.on_event = self._on_directory_event
        self.directory.on_connect = self._resync
        await self.directory.start()
        self._refresher = self._loop.create_task(self._refresh_loop(), name="kv-refresh")
        log.info("state cache: %.1f GiB host memory, sharing via %s as %s, transfers at %s (%s)",
                 self.cfg.host_cache_gb, self.cfg.redis_url, node, self.addr, self.transport_note)

    async def close(self, release: bool = True) -> None:
        """Stop sharing; with release, give up every directory record first (drain)."""
        await asyncio.to_thread(self._encoder.shutdown, True)  # queued snapshots land first
        if self._refresher:
            self._refresher.cancel()
        if self._tasks:  # let claims in flight land first, so release sees them
            await asyncio.wait(list(self._tasks), timeout=2.0)
        if self.directory is not None and release:
            n = await self.directory.release_node()
            log.info("state cache: released %d directory records", n)
        for t in list(self._tasks):
            t.cancel()
        if self.directory is not None:
            await self.directory.close()
        if self.server is not None:
            await self.server.close()
        self.store.clear()

    # ---- the scheduler's calls --------------------------------------------------------------
    def snapshot_points(self, prompt_len: int, n_cached: int = 0) -> list[int]:
        """Prompt positions to snapshot at (the scheduler ends a prefill chunk there)."""
        return [p for p in snapshot_points(prompt_len) if p > n_cached] if self.enabled else []

    def namespace_of(self, tenant: str = "") -> bytes:
        """Key seed of one tenant's states (the default tenant: a single-tenant server)."""
        ns = self._tenant_ns.get(tenant)
        if ns is None:
            if len(self._tenant_ns) > 4096:
                self._tenant_ns = {"": self.ns}
            ns = self._tenant_ns[tenant] = namespace(f"{self.model_id}|{self.model_key}", STATE_VERSION, tenant)
        return ns

    def snapshot(self, tokens: list[int], state: SequenceState, session_id: str | None = None,
                 tenant: str = "") -> bool:
        """Store `state` as the state after tokens[:state.position]. Call it before the state is
        stepped again: a host copy is taken here (cheap), and encoded and stored on the cache's
        own thread, so the engine thread never waits for an encode (~0.3 s for a long V4.1
        state). Thread-safe; the announcement runs on the loop. True when stored or queued."""
        n = state.position
        if not self.enabled or n <= 0 or len(tokens) < n:
            return False
        pk = PrefixKeys(self.namespace_of(tenant), tokens[:n])
        key = pk.key(n)
        with self._pending_lock:
            if self.store.get(key) is not None or key in self._pending:
                return True
            self._pending.add(key)
        host = state.host_copy()
        self._encoder.submit(self._store_snapshot, key, n, pk.anchor(n), host, session_id)
        return True

    def _store_snapshot(self, key: bytes, n: int, anchor: bytes, host: SequenceState, session_id) -> None:
        try:
            entry = self.store.put(key, n, anchor, host.to_bytes(), session_id)
        except Exception:  # a snapshot must never hurt serving
            log.exception("state snapshot failed (ignored)")
            entry = None
        finally:
            with self._pending_lock:
                self._pending.discard(key)
        if entry is None:
            return
        self.stats.inc("snapshots_total")
        if self.directory is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._spawn, self._claim(entry, force=False))

    async def lookup(self, tokens: list[int], session_id: str | None = None, copies: int = 1,
                     tenant: str = "") -> Hit | None:
        """Longest reusable prefix of tokens (at most len - 1: the last token must be fed to get
        logits) among the tenant's states; `copies` independent states. None: prefill everything."""
        if not self.enabled or len(tokens) < 2:
            return None
        self.stats.inc("lookups_total")
        limit = len(tokens) - 1
        pk = PrefixKeys(self.namespace_of(tenant), tokens)
        local = self.store.best_match(pk, limit, session_id)
        local_n = local.n_tokens if local else 0
        if self.directory is not None:
            rec = await self.directory.find(pk, limit, session_id, min_n=local_n)
            if rec is not None and self._bad.get((rec.key, rec.epoch), 0) < time.monotonic():
                hit = await self._fetch(rec, pk, session_id, copies)
                if hit is not None:
                    return hit
                local = self.store.best_match(pk, limit, session_id)  # a local hit still saves work
        if local is None:
            return None
        try:
            states = await self._load(local, copies)
        except StateError as e:
            log.warning("stored state %s unreadable (%s): dropped", local.key.hex()[:12], e)
            self.store.remove(local.key)
            return None
        self._count_hit("local", local.n_tokens)
        return Hit(local.n_tokens, "local", states)

    def render_metrics(self) -> str:
        return self.stats.render(self.model_id)

    # ---- fetch ------------------------------------------------------------------------------
    async def _fetch(self, rec: Record, pk: PrefixKeys, session_id: str | None, copies: int) -> Hit | None:
        t0 = time.monotonic()
        offer = Offer(rec.key, rec.epoch, rec.addr, rec.size, rec.n_tokens, rec.transports)
        max_size = None
        if self.shape is not None:
            max_size = self.shape.max_bytes(rec.n_tokens) + 64  # header and digest
            if rec.n_tokens > self.shape.max_position:
                self._fallback(rec, "too_large", f"record claims {rec.n_tokens} tokens, past the context")
                return None
        try:
            buf, reply = await fetch(offer, self.store, self.movers, auth=self.auth, max_size=max_size,
                                     timeout_s=self.cfg.fetch_timeout_s,
                                     stall_s=self.cfg.stall_timeout_s, min_rate=self.cfg.min_rate_mb_s * 1e6)
        except FetchError as e:
            self._fallback(rec, e.reason, str(e))
            return None
        except Exception as e:  # a transport bug must cost a recompute, never the request
            self._fallback(rec, "error", f"{type(e).__name__}: {e}")
            return None
        dt = time.monotonic() - t0
        entry = self.store.insert(rec.key, rec.n_tokens, pk.anchor(rec.n_tokens), buf, session_id,
                                  digest=bytes.fromhex(reply["digest"]))
        try:
            if entry is None:
                raise FetchError("too_large", "fetched state does not fit the host cache")
            states = await self._load(entry, copies, from_peer=True)
        except (FetchError, StateError) as e:
            if entry is not None:
                self.store.remove(entry.key)
            self._fallback(rec, getattr(e, "reason", INVALID), str(e))
            return None
        self.stats.inc("fetched_bytes_total", buf.size)
        self.stats.observe_fetch(dt)
        self._count_hit("remote", rec.n_tokens)
        log.info("fetched state of %d tokens (%d bytes) from %s in %.1f ms over %s", rec.n_tokens, buf.size,
                 rec.owner, dt * 1e3, reply.get("transport"))
        self._spawn(self._claim(entry, force=True))  # we hold it now: become the owner, announce it
        return Hit(rec.n_tokens, "remote", states)

    async def _load(self, entry: Entry, copies: int, from_peer: bool = False) -> list[SequenceState]:
        """Fresh SequenceStates from an entry's bytes (checksummed, checked against the model's
        layout; a peer's values are checked too, once, when it arrives)."""
        def read() -> list[SequenceState]:
            with self.store.lease(entry):
                if entry.evicted:
                    raise StateError("state evicted before it was read")
                view = entry.view()
                out = [SequenceState.from_bytes(view, model_key=self.model_key, shape=self.shape,
                                                finite=from_peer and i == 0) for i in range(max(1, copies))]
                del view
            if out[0].position != entry.n_tokens:
                raise StateError(f"state position {out[0].position} != its key's {entry.n_tokens} tokens")
            return out

        return await asyncio.to_thread(read) if entry.size > (1 << 20) else read()

    def _fallback(self, rec: Record, reason: str, message: str) -> None:
        self.stats.inc("fallbacks_total", reason=reason)
        self._bad[(rec.key, rec.epoch)] = time.monotonic() + 30.0
        log.warning("state fetch of %d tokens from %s (epoch %d) failed, recomputing: %s [%s]",
                    rec.n_tokens, rec.owner, rec.epoch, message, reason)
        if reason in ("missing", "stale", "unreachable") and self.directory is not None:
            # the record points at nothing usable: remove it (fenced on its epoch) for everyone
            self._spawn(self.directory.release(rec.key, epoch=rec.epoch))

    def _count_hit(self, source: str, n: int) -> None:
        self.stats.inc("hits_total", source=source)
        self.stats.inc("hit_tokens_total", n, source=source)

    # ---- ownership ----------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _claim(self, entry: Entry, force: bool) -> bool:
        """Claim (force) or re-check our record of an entry; False when Redis was not reached."""
        if self.directory is None or entry.evicted or self._withdrawn:
            return True  # (withdrawn: re-advertised when the listener accepts again)
        epoch = await self.directory.claim(entry.key, entry.n_tokens, entry.anchor, entry.size, entry.session,
                                           force=force, my_epoch=entry.epoch)
        if epoch is None:  # Redis down: the resync after reconnect (and its retries) advertises it
            return False
        if entry.evicted or self._withdrawn:  # evicted (or withdrawn) while we claimed: leave no record
            if epoch:
                await self.directory.release(entry.key, epoch=epoch)
            return True
        entry.epoch = epoch or None
        entry.advertise = bool(epoch)
        return True

    async def _resync(self) -> None:
        """After every (re)connect: messages may have been lost and Redis may have restarted.
        Re-read (and re-create where missing) the record of everything we advertise."""
        if self._first_connect:
            self._first_connect = False
            n = await self.directory.release_node()  # a previous run of this node id held them
            if n:
                log.info("state cache: removed %d records of a previous run of this node", n)
        if not await self._refresh_all():
            # a pooled command connection may have died with the link (its first use fails and
            # backs the directory off for a second): retry soon rather than at the next refresh
            self._spawn(self._resync_retry())

    async def _resync_retry(self, attempts: int = 8) -> None:
        for i in range(attempts):
            await asyncio.sleep(min(0.5 * (i + 1), 2.0) + 1.0)
            if await self._refresh_all():
                return

    async def _refresh_all(self) -> bool:
        """Re-check every advertised entry's record; False if Redis could not be reached for one."""
        if self._withdrawn:
            return True
        reached = True
        for e in self.store.entries():
            if e.advertise and not e.evicted:
                reached = await self._claim(e, force=False) and reached
        return reached

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.cfg.ttl_s / 3))
            try:
                await self._refresh_all()
            except Exception:
                log.exception("directory refresh failed")
            now = time.monotonic()
            self._bad = {k: v for k, v in self._bad.items() if v > now}

    def _on_listener_health(self, ok: bool) -> None:
        """The transfer listener stopped (False) or resumed (True) accepting: peers must not be
        sent to a server that cannot answer, so its records go while it cannot."""
        self._withdrawn = not ok
        self._spawn(self._apply_health())

    async def _apply_health(self) -> None:
        async with self._health_lock:  # one withdrawal or re-advertisement at a time, the latest state wins
            if self._withdrawn:
                await self._withdraw()
            elif await self._refresh_all():
                log.warning("state cache: transfer listener accepts again; states re-advertised")

    async def _withdraw(self) -> None:
        for e in self.store.entries():
            e.epoch = None  # still ours to offer (advertise stays): claimed afresh on recovery
        if self.directory is not None:
            n = await self.directory.release_node()
            log.warning("state cache: withdrew %d directory records while the transfer listener cannot accept", n)

    def _on_directory_event(self, ev: dict) -> None:
        try:
            key, epoch = bytes.fromhex(ev["key"]), int(ev["epoch"])
        except (KeyError, ValueError, TypeError):
            return
        e = self.store.get(key)
        if e is None:
            return
        if ev.get("ev") == "own" and e.epoch is not None and e.epoch != epoch:
            e.epoch, e.advertise = None, False  # another server owns it now: keep the bytes as a local copy
        elif ev.get("ev") == "release" and e.epoch is None:
            e.advertise = True  # its owner let go; we still hold it, so offer it
            self._spawn(self._claim(e, force=False))

    def _on_evict(self, e: Entry) -> None:
        if e.epoch is not None and self.directory is not None and self._loop is not None:
            epoch = e.epoch
            e.epoch = None
            self._loop.call_soon_threadsafe(self._spawn, self.directory.release(e.key, epoch=epoch))
