"""Redis directory: which server owns which snapshot, with fencing epochs and pub/sub.

Layout (prefix `dsuf:kv:`):
    rec:<key>      hash  owner, addr, transports, size, n, epoch, anchor, session   (TTL)
    anc:<anchor>   set   "<n>:<key>" of snapshots whose last full block has that anchor (TTL)
    sess:<sid>     set   "<n>:<key>" of one conversation's snapshots (TTL)
    own:<node>     set   keys a node owns (release on drain, cleanup after a restart)
    epoch          counter of fencing tokens, seeded from the clock so a restarted Redis
                   never hands out an epoch an old record or a server's memory still holds
    channel events JSON {ev: own|release, key, owner, epoch}

Every write is a Lua script that checks the epoch first, so a server that missed a pub/sub
message can never overwrite or refresh a record it no longer owns. Pub/sub is only a fast
path: after each (re)connect the server re-reads the records of everything it holds
(`resync`), and the periodic refresh does the same check. Any Redis error marks the
directory down for a short back-off; callers then see "no record" and serve without
sharing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .keys import BLOCK, PrefixKeys, candidates_in_block

log = logging.getLogger("dsuf.kvcache.directory")

PREFIX = "dsuf:kv:"
CHANNEL = PREFIX + "events"

# KEYS: rec, anc, sess, own(me), epoch   ARGV: node, addr, transports, size, n, ttl, member, seed,
# anchor, session, mode (force|nx), my_epoch, keyhex, prefix, channel
_CLAIM = """
local cur_epoch = redis.call('HGET', KEYS[1], 'epoch')
local cur_owner = redis.call('HGET', KEYS[1], 'owner')
local ttl = tonumber(ARGV[6])
if ARGV[11] == 'nx' and cur_epoch then
  if cur_owner == ARGV[1] and cur_epoch == ARGV[12] then
    redis.call('EXPIRE', KEYS[1], ttl)
    redis.call('SADD', KEYS[2], ARGV[7]) redis.call('EXPIRE', KEYS[2], ttl)
    if ARGV[10] ~= '' then redis.call('SADD', KEYS[3], ARGV[7]) redis.call('EXPIRE', KEYS[3], ttl) end
    redis.call('SADD', KEYS[4], ARGV[13])
    return tonumber(cur_epoch)
  end
  return 0
end
if redis.call('EXISTS', KEYS[5]) == 0 then redis.call('SET', KEYS[5], ARGV[8]) end
local epoch = redis.call('INCR', KEYS[5])
local epoch_s = string.format('%d', epoch)
if cur_owner and cur_owner ~= ARGV[1] then redis.call('SREM', ARGV[14] .. 'own:' .. cur_owner, ARGV[13]) end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'addr', ARGV[2], 'transports', ARGV[3], 'size', ARGV[4],
           'n', ARGV[5], 'epoch', epoch_s, 'anchor', ARGV[9], 'session', ARGV[10])
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('SADD', KEYS[2], ARGV[7]) redis.call('EXPIRE', KEYS[2], ttl)
if ARGV[10] ~= '' then redis.call('SADD', KEYS[3], ARGV[7]) redis.call('EXPIRE', KEYS[3], ttl) end
redis.call('SADD', KEYS[4], ARGV[13])
redis.call('PUBLISH', ARGV[15], cjson.encode({ev='own', key=ARGV[13], owner=ARGV[1], epoch=epoch_s}))
return epoch
"""

# KEYS: rec   ARGV: epoch ('' = any), owner ('' = any), prefix, channel, keyhex
_RELEASE = """
local f = redis.call('HMGET', KEYS[1], 'epoch', 'owner', 'anchor', 'session', 'n')
if not f[1] then return 0 end
if ARGV[1] ~= '' and f[1] ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' and f[2] ~= ARGV[2] then return 0 end
local member = f[5] .. ':' .. ARGV[5]
redis.call('DEL', KEYS[1])
redis.call('SREM', ARGV[3] .. 'anc:' .. f[3], member)
if f[4] and f[4] ~= '' then redis.call('SREM', ARGV[3] .. 'sess:' .. f[4], member) end
redis.call('SREM', ARGV[3] .. 'own:' .. f[2], ARGV[5])
redis.call('PUBLISH', ARGV[4], cjson.encode({ev='release', key=ARGV[5], owner=f[2], epoch=f[1]}))
return 1
"""

# KEYS: anchor sets, longest prefix first   ARGV: max sets to return
_FIND = """
local out = {}
for i, k in ipairs(KEYS) do
  local m = redis.call('SMEMBERS', k)
  if #m > 0 then
    table.insert(out, {i, m})
    if #out >= tonumber(ARGV[1]) then break end
  end
end
return out
"""


@dataclass
class Record:
    key: bytes
    owner: str
    addr: str
    transports: tuple[str, ...]
    size: int
    n_tokens: int
    epoch: int

    @classmethod
    def parse(cls, key: bytes, h: dict) -> Record | None:
        try:
            return cls(key=key, owner=h["owner"], addr=h["addr"], transports=tuple(json.loads(h["transports"])),
                       size=int(h["size"]), n_tokens=int(h["n"]), epoch=int(h["epoch"]))
        except (KeyError, ValueError, TypeError):
            return None


def session_tag(session_id: str) -> str:
    """Client-chosen ids are hashed: bounded key length, no odd characters in key names."""
    return hashlib.blake2b(session_id.encode(), digest_size=12).hexdigest()


class Directory:
    def __init__(self, url: str, node_id: str, addr: str, transports: tuple[str, ...] = ("tcp",),
                 ttl_s: float = 120.0, op_timeout_s: float = 1.0):
        self.url, self.node_id, self.addr, self.transports = url, node_id, addr, transports
        self.ttl = max(2, int(ttl_s))
        self.op_timeout = op_timeout_s
        self.on_event: Callable[[dict], None] | None = None  # another node's ownership change
        self.on_connect: Callable[[], Awaitable[None]] | None = None  # re-read after every (re)connect
        self._down_until = 0.0
        self.connected = False
        self.reconnects = 0
        self.errors = 0
        self._r: Any = None
        self._sub: Any = None
        self._scripts: dict[str, Any] = {}
        self._task: asyncio.Task | None = None
        self._closing = False

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        # one immediate retry: the first command on a pooled connection to a restarted Redis fails
        self._r = aioredis.Redis.from_url(self.url, socket_timeout=self.op_timeout,
                                          socket_connect_timeout=self.op_timeout, decode_responses=True,
                                          retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError])
        # the subscriber must see every disconnect (messages were lost): no silent re-subscribe
        self._sub = aioredis.Redis.from_url(self.url, socket_connect_timeout=self.op_timeout, decode_responses=True,
                                            retry=Retry(NoBackoff(), 0))
        for name, src in (("claim", _CLAIM), ("release", _RELEASE), ("find", _FIND)):
            self._scripts[name] = self._r.register_script(src)
        self._task = asyncio.get_running_loop().create_task(self._listen(), name="kv-directory-listen")

    async def close(self) -> None:
        self._closing = True
        if self._task:
            self._task.cancel()  # redis-py may swallow one cancellation inside a read: bound the wait
            try:
                await asyncio.wait_for(self._task, 2.0)
            except (asyncio.CancelledError, Exception):
                pass
        for client in (self._r, self._sub):
            try:
                await client.aclose()
            except Exception:
                pass

    @property
    def available(self) -> bool:
        return self._r is not None and time.monotonic() >= self._down_until

    async def _call(self, what: str, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run one Redis operation; on any failure mark the directory down and return None."""
        if not self.available:
            return None
        try:
            return await asyncio.wait_for(coro_fn(), self.op_timeout * 2)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.errors += 1
            self._down_until = time.monotonic() + 1.0
            log.warning("redis %s failed (%s: %s): serving without sharing for now", what, type(e).__name__, e)
            return None

    # ---- ownership -------------------------------------------------------------------------
    async def claim(self, key: bytes, n_tokens: int, anchor: bytes, size: int, session: str | None,
                    force: bool, my_epoch: int | None = None) -> int | None:
        """Become the owner (force) or keep/create a record only if nobody else holds it (nx).

        Returns our epoch, 0 when another node owns the record, None when Redis is down.
        """
        hx, sess = key.hex(), session_tag(session) if session else ""
        member = f"{n_tokens}:{hx}"
        keys = [PREFIX + "rec:" + hx, PREFIX + "anc:" + anchor.hex(), PREFIX + "sess:" + (sess or "-"),
                PREFIX + "own:" + self.node_id, PREFIX + "epoch"]
        args = [self.node_id, self.addr, json.dumps(list(self.transports)), size, n_tokens, self.ttl, member,
                int(time.time() * 1e6), anchor.hex(), sess, "force" if force else "nx",
                "" if my_epoch is None else str(my_epoch), hx, PREFIX, CHANNEL]
        res = await self._call("claim", lambda: self._scripts["claim"](keys=keys, args=args))
        return None if res is None else int(res)

    async def release(self, key: bytes, epoch: int | None = None, owner: str | None = None) -> bool:
        """Delete a record if it still has this epoch / owner (fenced)."""
        hx = key.hex()
        res = await self._call("release", lambda: self._scripts["release"](
            keys=[PREFIX + "rec:" + hx],
            args=["" if epoch is None else str(epoch), owner or "", PREFIX, CHANNEL, hx]))
        return bool(res)

    async def release_node(self, node_id: str | None = None) -> int:
        """Release every record a node owns (drain, preStop, or cleanup after a restart)."""
        node = node_id or self.node_id
        keys = await self._call("smembers", lambda: self._r.smembers(PREFIX + "own:" + node))
        n = 0
        for hx in keys or ():
            n += await self.release(bytes.fromhex(hx), owner=node)
        await self._call("del", lambda: self._r.delete(PREFIX + "own:" + node))
        return n

    async def get(self, key: bytes) -> Record | None:
        h = await self._call("hgetall", lambda: self._r.hgetall(PREFIX + "rec:" + key.hex()))
        return Record.parse(key, h) if h else None

    # ---- lookup ------------------------------------------------------------------------------
    async def find(self, pk: PrefixKeys, limit: int, session: str | None = None, min_n: int = 0) -> Record | None:
        """Longest advertised prefix of pk of at most `limit` tokens, longer than min_n, owned by
        another node. Checks the record itself, never only an index entry."""
        if not self.available or limit <= min_n:
            return None
        cands: list[tuple[int, bytes]] = []
        if session:
            members = await self._call("smembers", lambda: self._r.smembers(PREFIX + "sess:" + session_tag(session)))
            for m in members or ():
                n, key = _member(m)
                if min_n < n <= limit and pk.key(n) == key:
                    cands.append((n, key))
            cands.sort(reverse=True)
            rec = await self._first_live(cands)
            if rec is not None:
                return rec
        blocks = [k for k in pk.blocks_desc(limit) if (k + 1) * BLOCK > min_n]
        i = 0
        while i < len(blocks):  # batches of anchors, longest first; usually one round trip
            batch = blocks[i:i + 4096]
            found = await self._call("find", lambda b=batch: self._scripts["find"](
                keys=[PREFIX + "anc:" + pk.chain[k].hex() for k in b], args=[4]))
            if not found:
                i += len(batch)
                continue
            cands = []
            last = 0
            for idx, members in found:
                last = int(idx)
                k = batch[last - 1]
                by_n: dict[int, set[bytes]] = {}  # prompts sharing a prefix share anchors, and lengths too
                for m in members:
                    n, key = _member(m)
                    by_n.setdefault(n, set()).add(key)
                for n in candidates_in_block(k, list(by_n), limit):
                    if n > min_n and pk.key(n) in by_n[n]:
                        cands.append((n, pk.key(n)))
            rec = await self._first_live(cands)
            if rec is not None:
                return rec
            i += last if last else len(batch)
        return None

    async def _first_live(self, cands: list[tuple[int, bytes]]) -> Record | None:
        for _, key in cands[:8]:
            rec = await self.get(key)
            if rec is not None and rec.owner != self.node_id:
                return rec
        return None

    # ---- pub/sub -----------------------------------------------------------------------------
    async def _listen(self) -> None:
        """Subscribe forever; after every (re)connect, re-read what we hold (messages were lost)."""
        backoff = 0.1
        me = asyncio.current_task()
        while not self._closing and not me.cancelling():
            pubsub = None
            try:
                pubsub = self._sub.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(CHANNEL)
                await pubsub.ping()
                if not self.connected:
                    log.info("redis directory connected (%s)", self.url)
                self.connected = True
                self._down_until = 0.0
                backoff = 0.1
                self.reconnects += 1
                if self.on_connect:
                    await self.on_connect()
                while not self._closing:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is None:
                        await pubsub.ping()  # notice a dead server even when nobody publishes
                        continue
                    if msg.get("type") == "message":
                        self._dispatch(msg.get("data"))
            except asyncio.CancelledError:
                if pubsub is not None:
                    try:
                        await pubsub.aclose()
                    except Exception:
                        pass
                raise
            except Exception as e:
                if me.cancelling():  # a cancel that redis-py turned into a timeout
                    raise asyncio.CancelledError from e
                if self.connected:
                    log.warning("redis subscription lost (%s: %s); reconnecting", type(e).__name__, e)
                self.connected = False
                self._down_until = time.monotonic() + backoff
                if pubsub is not None:
                    try:
                        await pubsub.aclose()
                    except Exception:
                        pass
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def _dispatch(self, data: Any) -> None:
        try:
            ev = json.loads(data)
        except (TypeError, ValueError):
            return
        if isinstance(ev, dict) and ev.get("owner") != self.node_id and self.on_event:
            self.on_event(ev)


def _member(m: str) -> tuple[int, bytes]:
    n, _, hx = m.partition(":")
    return int(n), bytes.fromhex(hx)
