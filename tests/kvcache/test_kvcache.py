"""kvcache building blocks: prefix keys, the host LRU, the Redis directory (real redis-server)
and the transfer protocol over real loopback TCP, with faults injected by a real proxy."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engine.state.sequence import SequenceState
from kvcache.auth import PeerAuth
from kvcache.cache import CacheConfig, StateCache
from kvcache.directory import PREFIX, Directory
from kvcache.keys import BLOCK, PrefixKeys, namespace, snapshot_points
from kvcache.peer import Offer, TransferServer, fetch
from kvcache.protocol import FetchError, tree_digest
from kvcache.store import HostStore
from kvcache.testing import FaultProxy, RedisServer
from kvcache.transport_tcp import TcpMover

ROOT = Path(__file__).resolve().parents[2]
NS = namespace("demo-v41|test", 1)
SECRET = os.urandom(16).hex()  # each run its own: no secret lives in the repository
AUTH = PeerAuth(SECRET)
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


@pytest.fixture(scope="module")
def redis_srv():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    r = RedisServer().start()
    yield r
    r.close()


def _run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- keys


def test_keys_chain_prefixes_and_namespaces():
    toks = list(range(1000, 1000 + 3 * BLOCK + 7))
    a, b = PrefixKeys(NS, toks), PrefixKeys(NS, toks[:2 * BLOCK + 3])
    for n in (1, BLOCK - 1, BLOCK, 2 * BLOCK + 3):
        assert a.key(n) == b.key(n)  # a key depends on the prefix only
        assert a.anchor(n) == b.anchor(n)
    assert len({a.key(n) for n in range(1, len(toks) + 1)}) == len(toks)
    other = PrefixKeys(namespace("demo-v41|test", 2), toks)  # another state format version
    assert other.key(10) != a.key(10)
    changed = PrefixKeys(NS, toks[:5] + [7] + toks[6:])
    assert changed.key(BLOCK + 3) != a.key(BLOCK + 3) and changed.key(5) == a.key(5)
    assert snapshot_points(100) == [99] and snapshot_points(1) == []


# ---------------------------------------------------------------- store


def test_store_keeps_prompts_that_share_an_anchor_and_a_length():
    """Two conversations with one system prompt and prompts of equal length share an anchor
    and a length: both stay findable (the index holds every key, not the last one)."""
    system = list(range(500, 500 + 3 * BLOCK))
    a, b = PrefixKeys(NS, system + [1, 2, 3, 4]), PrefixKeys(NS, system + [5, 6, 7, 8])
    st = HostStore(capacity_bytes=1 << 20, pin=False)
    n = len(system) + 3
    assert a.anchor(n) == b.anchor(n)
    st.put(a.key(n), n, a.anchor(n), b"a" * 10)
    st.put(b.key(n), n, b.anchor(n), b"b" * 10)
    assert st.best_match(a, n).key == a.key(n) and st.best_match(b, n).key == b.key(n)
    st.remove(a.key(n))
    assert st.best_match(a, n) is None and st.best_match(b, n).key == b.key(n)


def test_store_lru_by_bytes_longest_prefix_and_leases():
    toks = list(range(500))
    pk = PrefixKeys(NS, toks)
    st = HostStore(capacity_bytes=3000, pin=True)
    for n in (10, 70, 200):
        assert st.put(pk.key(n), n, pk.anchor(n), bytes([n % 256]) * 1000) is not None
    assert st.best_match(pk, 499).n_tokens == 200
    assert st.best_match(pk, 199).n_tokens == 70  # limit respected
    assert st.best_match(PrefixKeys(NS, [9] + toks[1:]), 499) is None
    e10 = st.get(pk.key(10))  # touch: 70 is now the oldest
    with st.lease(e10):
        st.put(pk.key(300), 300, pk.anchor(300), b"x" * 1500)  # evicts 70 and 200, never the leased one
        assert e10.view()[0] == 10
    assert {e.n_tokens for e in st.entries()} == {10, 300} and st.used == 2500
    assert st.put(pk.key(400), 400, pk.anchor(400), b"y" * 4000) is None  # larger than the whole cache
    # session narrowing finds the conversation's own snapshot first
    st.put(pk.key(450), 450, pk.anchor(450), b"z" * 10, session="s1")
    assert st.best_match(pk, 499, session="s1").n_tokens == 450


# ---------------------------------------------------------------- directory


@needs_redis
def test_directory_fencing_find_and_events(redis_srv):
    import redis

    r = redis.Redis.from_url(redis_srv.url)
    r.flushall()
    toks = list(range(2000, 2600))
    pk = PrefixKeys(NS, toks)
    key, n = pk.key(300), 300

    async def go():
        a = Directory(redis_srv.url, "A", "127.0.0.1:1", ttl_s=30)
        b = Directory(redis_srv.url, "B", "127.0.0.1:2", ttl_s=30)
        events: list[dict] = []
        a.on_event = events.append
        await a.start()
        await b.start()
        for _ in range(50):
            if a.connected and b.connected:
                break
            await asyncio.sleep(0.05)
        e1 = await a.claim(key, n, pk.anchor(n), 1234, "conv", force=False)
        assert e1 > 0
        assert await b.claim(key, n, pk.anchor(n), 1234, None, force=False) == 0  # nx: A holds it
        assert await a.claim(key, n, pk.anchor(n), 1234, "conv", force=False, my_epoch=e1) == e1  # refresh
        rec = await b.find(pk, 599)
        assert rec.owner == "A" and rec.n_tokens == n and rec.epoch == e1 and rec.size == 1234
        assert (await b.find(pk, 299)) is None  # only prefixes within the limit
        assert (await b.find(pk, 599, session="conv")).epoch == e1
        assert (await a.find(pk, 599)) is None  # our own records are not "remote"
        e2 = await b.claim(key, n, pk.anchor(n), 1234, None, force=True)  # B fetched it: B owns it now
        assert e2 > e1
        for _ in range(40):
            if events:
                break
            await asyncio.sleep(0.05)
        assert events and events[-1]["owner"] == "B" and int(events[-1]["epoch"]) == e2
        # A missed nothing here, but even with a stale memory it cannot refresh or release B's record
        assert await a.claim(key, n, pk.anchor(n), 1234, None, force=False, my_epoch=e1) == 0
        assert not await a.release(key, epoch=e1)
        assert (await a.get(key)).owner == "B"
        assert await b.release_node() == 1 and (await a.get(key)) is None
        await a.close()
        await b.close()

    _run(go())
    assert not [k for k in r.keys(PREFIX + "rec:*")]


def test_directory_down_is_a_fast_miss():
    async def go():
        d = Directory("redis://127.0.0.1:1", "A", "127.0.0.1:1", op_timeout_s=0.3)
        await d.start()
        t0 = asyncio.get_running_loop().time()
        assert await d.claim(b"k" * 16, 5, b"a" * 16, 10, None, force=False) is None
        assert await d.find(PrefixKeys(NS, list(range(50))), 49) is None
        dt = asyncio.get_running_loop().time() - t0
        await d.close()
        return dt

    assert _run(go()) < 2.0


# ---------------------------------------------------------------- transfer


def _state_bytes(engine, n: int) -> tuple[list[int], bytes]:
    toks = [int(t) for t in np.random.default_rng(n).integers(10, 8000, n)]
    st = engine.new_state()
    engine.step([st], [toks])
    return toks, st.to_bytes()


def test_transfer_tcp_ok_and_every_failure(engine):
    toks, payload = _state_bytes(engine, 90)
    pk = PrefixKeys(NS, toks)
    key = pk.key(90)

    async def go():
        owner = HostStore(1 << 24)
        entry = owner.put(key, 90, pk.anchor(90), payload)
        entry.epoch = 7
        srv = TransferServer(owner, {"tcp": TcpMover()}, stall_s=0.5, auth=AUTH)
        port = await srv.start()
        mine = HostStore(1 << 24)
        movers = {"tcp": TcpMover()}
        offer = Offer(key, 7, f"127.0.0.1:{port}", len(payload), 90)
        buf, reply = await fetch(offer, mine, movers, auth=AUTH)
        assert bytes(buf.view()) == payload and reply["digest"] == tree_digest(payload).hex()
        assert SequenceState.from_bytes(buf.view()).position == 90
        buf.close()

        async def reason(off: Offer, **kw) -> str:
            try:
                b, _ = await fetch(off, mine, movers, **{"auth": AUTH, **kw})
                b.close()
                return "ok"
            except FetchError as e:
                return e.reason

        assert await reason(Offer(key, 6, offer.addr, len(payload), 90)) == "stale"
        assert await reason(Offer(pk.key(89), 7, offer.addr, len(payload), 89)) == "missing"
        assert await reason(Offer(key, 7, "127.0.0.1:1", len(payload), 90)) == "unreachable"
        loop = asyncio.get_running_loop()
        corrupt = FaultProxy(offer.addr, "corrupt", at=len(payload) // 2)
        stall = FaultProxy(offer.addr, "stall")
        try:
            assert await reason(Offer(key, 7, corrupt.addr, len(payload), 90)) == "checksum"
            t0 = loop.time()
            assert await reason(Offer(key, 7, stall.addr, len(payload), 90), timeout_s=1.0, stall_s=0.3) == "timeout"
            assert loop.time() - t0 < 2.0
        finally:
            corrupt.close()
            stall.close()
        assert not owner.get(key).leases  # every lease was returned
        await srv.close()

    _run(go())


@needs_redis
def test_cache_two_nodes_share_and_survive_redis_restart(engine, redis_srv):
    toks = [int(t) for t in np.random.default_rng(3).integers(10, 8000, 150)]
    st = engine.new_state()
    engine.step([st], [toks])
    query = toks + [11, 12, 13]

    async def wait_for(cond, timeout=5.0):
        for _ in range(int(timeout / 0.05)):
            if cond():
                return True
            await asyncio.sleep(0.05)
        return False

    async def go():
        cfg = dict(host_cache_gb=0.1, redis_url=redis_srv.url, ttl_s=5, secret=SECRET)
        a = StateCache(CacheConfig(node_id="A", **cfg), engine.model_id, engine.model.model_key)
        b = StateCache(CacheConfig(node_id="B", **cfg), engine.model_id, engine.model.model_key)
        await a.start()
        await b.start()
        assert await wait_for(lambda: a.directory.connected and b.directory.connected)
        assert a.snapshot(toks, st)
        assert await wait_for(lambda: bool(a.store.owned()))
        hit = await b.lookup(query, copies=2)
        assert hit.source == "remote" and hit.n_tokens == 150 and len(hit.states) == 2
        assert hit.states[0] is not hit.states[1] and hit.state.to_bytes() == st.to_bytes()
        assert await wait_for(lambda: not a.store.owned() and bool(b.store.owned()))  # A heard B's announcement
        assert (await b.lookup(query)).source == "local"
        # Redis crashes and comes back empty: B re-advertises what it holds after reconnecting
        redis_srv.restart()
        assert await wait_for(lambda: b.directory.reconnects >= 2 and a.directory.reconnects >= 2, 10)
        assert await wait_for(lambda: b.store.owned() and b.store.owned()[0].epoch is not None)
        a.store.clear()
        hit = await a.lookup(query)
        assert hit is not None and hit.source == "remote"
        assert a.stats.get("fallbacks_total", reason="stale") == 0
        await a.close()
        await b.close()

    _run(go())


def test_rdma_discovery_reports_why_not():
    """The RDMA module's device discovery (pyverbs, loaded lazily), here and under the system
    Python that Debian's python3-pyverbs is built for."""
    from kvcache.transport_rdma import discover, make_mover

    ports, why = discover()
    if not ports:
        assert why
        mover, note = make_mover("auto", None, None, None)
        assert mover is None and note == why
        with pytest.raises(RuntimeError):
            make_mover("rdma", None, None, None)
    if os.access("/usr/bin/python3", os.X_OK):
        code = "from kvcache.transport_rdma import discover; print(discover())"
        out = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr


def test_rdma_verbs_structs_build_without_a_device():
    """The parts of the RDMA mover that need no device: QP attributes towards a peer and the
    RDMA READ work requests (pyverbs structs), as the fetcher and the owner build them."""
    from kvcache.transport_rdma import READ_CHUNK, RdmaPort, import_pyverbs, read_wrs, rts_attr

    try:
        import_pyverbs()
    except ImportError as e:
        pytest.skip(str(e))
    rp = RdmaPort("mlx5_0", 1, 3, "0000:0000:0000:0000:0000:ffff:0a00:0001", 0, "ethernet", 5)
    peer = {"qpn": 77, "psn": 1234, "gid": "0000:0000:0000:0000:0000:ffff:0a00:0002", "lid": 0, "mtu": 3}
    attr = rts_attr(rp, 99, peer)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn, attr.path_mtu) == (77, 1234, 99, 3)
    size = 2 * READ_CHUNK + 5
    wrs = read_wrs(0x10000, size, 11, 0x20000, 22)
    assert [end for end, _ in wrs] == [READ_CHUNK, 2 * READ_CHUNK, size]
    assert all(wr.num_sge == 1 for _, wr in wrs)
