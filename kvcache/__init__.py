"""Sequence states kept between turns and shared across servers.

auth.py (shared secret: handshake proofs, state MACs) ·
keys.py (prefix keys, per tenant) · store.py (pinned host LRU) · directory.py (Redis ownership, epochs,
pub/sub) · protocol.py + peer.py (transfer protocol, both ends) · transport_tcp.py /
transport_rdma.py (payload movers) · cache.py (StateCache: lookup / snapshot) · serving.py
(the server's hooks) · stats.py (/metrics) · release.py (preStop) · testing.py (real redis,
fault proxy).
"""
