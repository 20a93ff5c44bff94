"""Attacks on state sharing, against real `dsuf.py serve` processes, a real redis-server and real TCP.

A and B share states (same DSUF_KV_SECRET); R keeps no states and gives the reference answer; N
has DSUF_REDIS_URL but no secret. The attacker can reach the transfer ports and write to Redis
(it has no password), and in some tests even holds the secret (a compromised or buggy peer).
Every attack must end in a refusal or a recompute with R's answer, never other text, never
another request's failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import struct
import threading
import urllib.error
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest
from test_sharing import (  # the cluster helpers (real servers, real Redis)
    SECRET,
    Server,
    _fallbacks,
    _records,
    _redis,
    _same,
    _settled,
    _snapshots_stored,
    _wait,
)

from engine.state.sequence import _HEADER, MAGIC, VERSION, SequenceState
from kvcache.auth import PeerAuth, new_nonce
from kvcache.peer import Offer, fetch
from kvcache.protocol import PROTO_VERSION, Deadline, FetchError, recv_frame, send_all, send_frame, tree_digest, tune
from kvcache.store import HostStore
from kvcache.testing import RedisServer
from kvcache.transport_tcp import TcpMover

pytestmark = [pytest.mark.redis, pytest.mark.slow]
AUTH = PeerAuth(SECRET)
OTHER = PeerAuth(os.urandom(16).hex())  # a secret the cluster does not use
SYSTEM = ("You are a careful Python assistant. Answer with code only, keep it short, prefer the standard "
          "library, name things clearly and add type hints. ") * 6
FOLLOW = "Now add a docstring and handle the empty input."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attacks")
    redis = RedisServer().start()
    servers = {"A": Server("A", tmp, redis.url), "B": Server("B", tmp, redis.url),
               "R": Server("R", tmp, None, cache_gb=0, secret=None), "N": Server("N", tmp, redis.url, secret=None)}
    try:
        for s in servers.values():
            s.wait_ready()
        yield {"redis": redis, "tmp": tmp, **servers}
    finally:
        for s in servers.values():
            s.stop()
        redis.close()


def _turn1(server: Server, task: str, **extra) -> list[dict]:
    """Turn 1 of a conversation on `server`; returns turn 2's messages (history resent) once
    the server has advertised the turn's two snapshots (when it shares)."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    before = len(_records_of(server))
    r1 = server.chat(msgs, **extra)
    if server.secret and server.redis_url:
        assert _wait(lambda: len(_records_of(server)) >= before + 2)
        _settled(lambda: len(_records_of(server)))
    return msgs + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                   {"role": "user", "content": FOLLOW}]


def _records_of(server: Server) -> dict:
    import redis

    if not server.redis_url:
        return {}
    r = redis.Redis.from_url(server.redis_url, decode_responses=True)
    out = {k: r.hgetall(k) for k in r.keys("dsuf:kv:rec:*")}
    return {k: v for k, v in out.items() if v.get("owner") == server.name}


def _offer(rec: dict, key_name: str) -> Offer:
    return Offer(bytes.fromhex(key_name.rsplit(":", 1)[1]), int(rec["epoch"]), rec["addr"], int(rec["size"]),
                 int(rec["n"]), tuple(json.loads(rec["transports"])))


def _fetch(offer: Offer, auth: PeerAuth | None = AUTH, **kw) -> bytes:
    async def go() -> bytes:
        buf, _ = await fetch(offer, HostStore(1 << 28, pin=False), {"tcp": TcpMover()}, auth=auth, **kw)
        try:
            return bytes(buf.view())
        finally:
            buf.close()

    return asyncio.run(go())


def _reason(fn: Callable[[], object]) -> str:
    try:
        fn()
        return "ok"
    except FetchError as e:
        return e.reason


# ---------------------------------------------------------------- a raw client and a rogue owner


def _frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return b"DSKV" + struct.pack("<I", len(body)) + body


def _read_frame(s: socket.socket) -> dict:
    def exact(n: int) -> bytes:
        out = b""
        while len(out) < n:
            got = s.recv(n - len(out))
            if not got:
                raise ConnectionError("closed")
            out += got
        return out

    _, n = struct.unpack("<4sI", exact(8))
    return json.loads(exact(n))


def _closed(s: socket.socket) -> bool:
    s.settimeout(5)
    return s.recv(1) == b""


class Rogue:
    """A TCP server speaking the transfer protocol and serving whatever `serve(request)` gives:
    with `auth` it passes the handshake (it holds the secret), without it it cannot."""

    def __init__(self, serve: Callable[[dict], tuple[dict, bytes]], auth: PeerAuth | None):
        self.serve, self.auth, self.requests = serve, auth, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._accept(), self.loop)

    async def _accept(self) -> None:
        while True:
            conn, _ = await self.loop.sock_accept(self.sock)
            tune(conn)
            self.loop.create_task(self._handle(conn))

    async def _handle(self, conn: socket.socket) -> None:
        d = Deadline(10, 5)
        try:
            nonce = new_nonce()
            await send_frame(conn, {"v": PROTO_VERSION, "op": "hello", "nonce": nonce}, d)
            req = await recv_frame(conn, d)
            self.requests += 1
            reply, payload = self.serve(req)
            reply["mac"] = (self.auth.proof("serve", nonce, req["nonce"], req["key"], reply) if self.auth
                            else os.urandom(32).hex())
            await send_frame(conn, reply, d)
            await send_all(conn, memoryview(payload), d)
        except Exception:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.sock.close()


def _ok(req: dict, n: int, payload: bytes, state_mac: str | None, size: int | None = None) -> dict:
    out = {"status": "ok", "size": len(payload) if size is None else size, "digest": tree_digest(payload).hex(),
           "n_tokens": n, "epoch": req["epoch"], "transport": "tcp"}
    if state_mac is not None:
        out["state_mac"] = state_mac
    return out


def _forge(data: bytes) -> bytes:
    """A state with other values and every digest recomputed (what a forger sends)."""
    st = SequenceState.from_bytes(data)
    for ls in st.layers:
        ls.window = np.flip(ls.window, axis=0).copy() * np.float32(0.5)
    return st.to_bytes()


def _layers_bomb(model_key: str, n: int) -> bytes:
    """~150 bytes claiming 200,000 layers, with a valid digest."""
    import hashlib

    meta = json.dumps({"model": model_key, "layers": 200_000, "recent": [], "codecs": {}, "arrays": []},
                      separators=(",", ":")).encode()
    head = _HEADER.pack(MAGIC, VERSION, 0, 0, n, len(meta))
    return head + meta + hashlib.blake2b(head + meta, digest_size=16).digest()


# ---------------------------------------------------------------- unauthenticated fetch


def test_unauthenticated_fetch_is_refused_and_closed(cluster):
    A = cluster["A"]
    _turn1(A, "Write a function that returns the median of a list of numbers.")
    name, rec = next(iter(_records(cluster, "A").items()))
    offer = _offer(rec, name)
    host, port = rec["addr"].rsplit(":", 1)
    before = A.metrics().get('dsuf_kvcache_refused_total{reason="unauthorized"}', 0)
    req = {"v": PROTO_VERSION, "op": "fetch", "key": offer.key.hex(), "epoch": offer.epoch, "transport": "tcp",
           "offer": {}}

    # 1. a client that knows the key (keys are computable) but not the secret
    with socket.create_connection((host, int(port)), timeout=5) as s:
        assert _read_frame(s)["op"] == "hello"
        s.sendall(_frame({**req, "nonce": new_nonce()}))
        assert _read_frame(s) == {"status": "unauthorized"}
        assert _closed(s)  # no payload follows: the connection is closed
    # 2. the old protocol (request first, no proof)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(_frame({**req, "v": 1}))
        assert _read_frame(s)["op"] == "hello"
        assert _read_frame(s) == {"status": "unauthorized"}
        assert _closed(s)
    # 3. a peer with another secret, through the real fetch code
    assert _reason(lambda: _fetch(offer, OTHER)) == "unauthorized"
    # 4. a replay: a valid request recorded on one connection is useless on the next (fresh nonce)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        nonce = _read_frame(s)["nonce"]
        good = {**req, "nonce": new_nonce()}
        good["mac"] = AUTH.proof("fetch", nonce, good["nonce"], good["key"], good)
        s.sendall(_frame(good))
        reply = _read_frame(s)
        assert reply["status"] == "ok" and AUTH.check(reply["mac"], "serve", nonce, good["nonce"], good["key"], reply)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        assert _read_frame(s)["op"] == "hello"
        s.sendall(_frame(good))
        assert _read_frame(s) == {"status": "unauthorized"}
        assert _closed(s)
    assert _fetch(offer) and _reason(lambda: _fetch(offer, None)) == "unauthorized"
    assert A.metrics()['dsuf_kvcache_refused_total{reason="unauthorized"}'] == before + 4


def test_no_secret_means_no_sharing(cluster):
    N, R = cluster["N"], cluster["R"]
    msgs2 = _turn1(N, "Write a function that returns the mode of a list of numbers.")
    _same(N.chat(msgs2), R.chat(msgs2))
    assert N.chat(msgs2)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its own states still serve it
    assert not _records(cluster, "N")  # nothing advertised, no listener
    assert "state sharing is OFF" in N.log_tail(100_000)


# ---------------------------------------------------------------- forged and oversized states


def _attack(cluster, task: str, serve: Callable[[dict, dict], tuple[dict, bytes]], auth: PeerAuth | None,
            reason: str, alongside: str | None = None) -> None:
    """Turn 1 on A; every record of A is pointed at a rogue owner; turn 2 on B must recompute."""
    A, B, R = cluster["A"], cluster["B"], cluster["R"]
    msgs2 = _turn1(A, task)
    recs = _records(cluster, "A")
    genuine = {name.rsplit(":", 1)[1]: (int(rec["n"]), _fetch(_offer(rec, name))) for name, rec in recs.items()}
    rogue = Rogue(lambda req: serve(req, genuine), auth)
    r = _redis(cluster)
    out: dict = {}
    try:
        for name in recs:
            r.hset(name, "addr", rogue.addr)
        before = _fallbacks(B, reason)
        other = None
        if alongside:  # another client's request at the same time must be untouched
            other_msgs = [{"role": "user", "content": alongside}]
            other = threading.Thread(target=lambda: out.update(other=B.chat(other_msgs)))
            other.start()
        r2 = B.chat(msgs2)
        if other is not None:
            other.join(120)
            _same(out["other"], R.chat(other_msgs))
        assert rogue.requests >= 1
    finally:
        for name, rec in recs.items():
            if r.exists(name):
                r.hset(name, "addr", rec["addr"])
        rogue.close()
    _same(r2, R.chat(msgs2))
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _fallbacks(B, reason) == before + 1


def _forged_reply(req: dict, genuine: dict, mac: Callable[[bytes, int, bytes], str | None]) -> tuple[dict, bytes]:
    n, data = genuine[req["key"]]
    payload = _forge(data)
    return _ok(req, n, payload, mac(bytes.fromhex(req["key"]), n, payload)), payload


def test_forged_state_from_a_peer_without_the_secret(cluster):
    _attack(cluster, "Write a function that reverses the words of a sentence.",
            lambda req, g: _forged_reply(req, g, lambda k, n, p: os.urandom(32).hex()), None, "unauthorized")


def test_forged_state_without_a_mac(cluster):
    _attack(cluster, "Write a function that removes duplicates from a list, keeping order.",
            lambda req, g: _forged_reply(req, g, lambda k, n, p: None), AUTH, "bad_mac")


def test_forged_state_with_a_mac_of_another_secret(cluster):
    _attack(cluster, "Write a function that converts a Roman numeral to an integer.",
            lambda req, g: _forged_reply(req, g, lambda k, n, p: OTHER.state_mac(k, n, len(p), tree_digest(p))),
            AUTH, "bad_mac")


def test_valid_state_replayed_under_another_key(cluster):
    def serve(req: dict, genuine: dict) -> tuple[dict, bytes]:
        n = genuine[req["key"]][0]
        other_key, (other_n, data) = next((k, v) for k, v in genuine.items() if k != req["key"])
        mac = AUTH.state_mac(bytes.fromhex(other_key), other_n, len(data), tree_digest(data))  # the owner's own
        return _ok(req, n, data, mac), data

    _attack(cluster, "Write a function that checks whether two strings are anagrams.", serve, AUTH, "bad_mac")


def test_state_claiming_200000_layers_fails_no_other_request(cluster):
    def serve(req: dict, genuine: dict) -> tuple[dict, bytes]:
        n, data = genuine[req["key"]]
        bomb = _layers_bomb(SequenceState.from_bytes(data).model_key, n)
        assert len(bomb) < 200
        return _ok(req, n, bomb, AUTH.state_mac(bytes.fromhex(req["key"]), n, len(bomb), tree_digest(bomb))), bomb

    _attack(cluster, "Write a function that splits a list into chunks of a given size.", serve, AUTH,
            "invalid_state", alongside="Name three prime numbers.")


def test_oversized_size_claim_refused_before_allocating(cluster):
    def serve(req: dict, genuine: dict) -> tuple[dict, bytes]:
        n, data = genuine[req["key"]]
        return _ok(req, n, b"", None, size=1 << 40), b""

    _attack(cluster, "Write a function that rotates a matrix by 90 degrees.", serve, AUTH, "too_large")
    name, rec = next(iter(_records(cluster, "A").items()))
    offer = _offer(rec, name)  # a Redis record claiming a huge size: refused before connecting
    assert _reason(lambda: _fetch(Offer(offer.key, offer.epoch, offer.addr, 1 << 40, offer.n_tokens))) == "too_large"
    assert _reason(lambda: _fetch(offer, max_size=offer.size - 1)) == "too_large"


# ---------------------------------------------------------------- tenants


def test_cross_tenant_lookup_misses_locally_and_through_redis(cluster):
    A, B, R = cluster["A"], cluster["B"], cluster["R"]
    victim = {"cache_salt": "alice", "headers": {"x-session-id": "victim-conv"}}
    msgs2 = _turn1(A, "Write a function that validates an email address.", **victim)
    ref = R.chat(msgs2)
    n_prompt = ref["usage"]["prompt_tokens"]
    # each attacker its own tenant (an attacker's own snapshots serve its own later requests): other
    # salts, no salt (the shared tenant), the victim's session id, here and through Redis
    for server, attacker in ((A, {"cache_salt": "mallory"}), (A, {"cache_salt": "eve", "headers": victim["headers"]}),
                             (B, {}), (B, {"cache_salt": "trudy", "headers": victim["headers"]})):
        m0 = server.metrics()
        r = server.chat(msgs2, **attacker)
        m1 = server.metrics()
        _same(r, ref)
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, (server.name, attacker)
        # the whole prompt was prefilled: no reuse, so no timing difference to observe
        assert m1["dsuf_prefill_tokens_total"] - m0["dsuf_prefill_tokens_total"] == n_prompt
        assert m1.get("dsuf_kvcache_fetched_bytes_total", 0) == m0.get("dsuf_kvcache_fetched_bytes_total", 0)
    # the victim's own tenant still reuses its states, here and on another server
    for server in (B, A):
        r = server.chat(msgs2, **victim)
        _same(r, ref)
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, server.name
    for bad_salt in (5, "", "x" * 257):
        with pytest.raises(urllib.error.HTTPError) as e:
            B.chat(msgs2, cache_salt=bad_salt)
        assert e.value.code == 400 and json.load(e.value)["error"]["param"] == "cache_salt"


# ---------------------------------------------------------------- listener fault (runs last: it strains A)


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_listener_survives_accept_errors_and_withdraws_its_records(cluster):
    A, B, R = cluster["A"], cluster["B"], cluster["R"]
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Write a function that formats a number of bytes for humans."}]
    A.chat(msgs)
    _snapshots_stored(cluster, "A")
    keys_before = set(_records(cluster, "A"))
    addr = next(iter(_records(cluster, "A").values()))["addr"]
    host, port = addr.rsplit(":", 1)
    pid = A.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    held: list[socket.socket] = []
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_fd_count(pid), hard))  # no descriptor left
        for _ in range(3):  # peers dial in: A's accept fails with EMFILE
            held.append(socket.create_connection((host, int(port)), timeout=5))
        assert _wait(lambda: not _records(cluster, "A"), 20), "records still advertised while A cannot accept"
        # meanwhile a turn that A's states would serve is recomputed elsewhere, same answer
        msgs2 = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": FOLLOW}]
        r = B.chat(msgs2)
        _same(r, R.chat(msgs2))
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        for s in held:
            s.close()
    # every state A withdrew is advertised again: by A, or by B where B also held it and stepped in
    assert _wait(lambda: keys_before <= set(_records(cluster)) and len(_records(cluster, "A")) > 0, 20), \
        "records not re-advertised"
    m = A.metrics()
    assert m["dsuf_kvcache_accept_errors_total"] >= 1 and m["dsuf_kvcache_transfer_listener_up"] == 1
    assert "withdrew" in A.log_tail(200_000)
    # it serves again: another turn of that conversation on B fetches A's state
    msgs3 = msgs + [{"role": "assistant", "content": "def f(): pass"}, {"role": "user", "content": "Shorter."}]
    r3 = B.chat(msgs3)
    _same(r3, R.chat(msgs3))
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    _settled(lambda: len(_records(cluster, "A")))

