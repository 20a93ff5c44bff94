"""What a state read back must satisfy (engine/state/validate.py), the peer credentials
(kvcache/auth.py) and the tenant rule (kvcache/serving.py), on the demo model's real states."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from engine.state.sequence import _HEADER, MAGIC, VERSION, SequenceState, StateError, StateShape
from kvcache.auth import PeerAuth
from kvcache.serving import tenant


@pytest.fixture(scope="module")
def shape(engine):
    return StateShape.of(engine.model.cfg, engine.model.model_key, engine.context_length)


def _state(engine, n: int) -> SequenceState:
    st = engine.new_state()
    engine.step([st], [[int(t) for t in np.random.default_rng(n).integers(10, 8000, n)]])
    return st


def _rebuild(buf: bytes, edit) -> bytes:
    """The buffer with its directory edited and every digest recomputed (as a forger would)."""
    magic, version, res, n_arrays, position, meta_len = _HEADER.unpack_from(buf, 0)
    meta = json.loads(buf[_HEADER.size:_HEADER.size + meta_len])
    body = buf[_HEADER.size + meta_len:-16]
    position, meta, body = edit(position, meta, body)
    raw = json.dumps(meta, separators=(",", ":")).encode()
    head = _HEADER.pack(magic, version, res, len(meta["arrays"]), position, len(raw))
    return head + raw + body + hashlib.blake2b(head + raw + body, digest_size=16).digest()


def test_real_states_pass_and_round_trip(engine, shape):
    for n in (1, 5, 64, 300):
        st = _state(engine, n)
        buf = st.to_bytes()
        back = SequenceState.from_bytes(buf, model_key=engine.model.model_key, shape=shape)
        assert back.to_bytes() == buf
        assert len(buf) <= shape.max_bytes(n)
    assert shape.max_bytes(1000) < shape.max_bytes(2000) < 64 * shape.max_bytes(1000)


@pytest.mark.parametrize("attack", ["layers", "layers_200k", "width", "rows", "dims_huge", "position",
                                    "recent", "field_in_sliding_layer", "nan", "codec", "duplicate"])
def test_forged_layouts_are_refused(engine, shape, attack):
    st = _state(engine, 300)
    buf = st.to_bytes()

    def edit(position, meta, body):
        arrays = meta["arrays"]
        entries = next(a for a in arrays if a[1] == "entries")
        if attack == "layers":
            meta["layers"] = shape.num_layers + 1
        elif attack == "layers_200k":
            meta["layers"], meta["arrays"], body = 200_000, [], b""
        elif attack == "width":  # a window of the wrong width, its bytes consistent
            a = arrays[0]
            a[2] = [a[2][0] * 2, a[2][1] // 2]
        elif attack == "rows":  # 10 more entries than a 300-token prefix can have, in float32
            old = entries[4]
            entries[2][0], entries[3] = position // shape.ratios[entries[0]] + 10, 0
            entries[4] = entries[2][0] * entries[2][1] * 4
            body = body + b"\0" * (entries[4] - old)  # (placement does not matter: the directory is refused first)
        elif attack == "dims_huge":
            entries[2] = [1 << 40, 64]
        elif attack == "position":
            position = shape.max_position + 1
        elif attack == "recent":
            meta["recent"] = [shape.vocab_size + 5]
        elif attack == "field_in_sliding_layer":
            arrays.append([0, "entries", [0, 64], 0, 0])
        elif attack == "nan":
            win = np.frombuffer(body, np.uint8).copy()
            a0 = arrays[0]
            if a0[3] == 0:
                win[:4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
            else:  # FP8 window: scale byte 0xFF is NaN in e8m0
                win[0] = 0xFF
            body = win.tobytes()
        elif attack == "codec":
            entries[3] = 9
        elif attack == "duplicate":
            arrays.append(list(arrays[0]))
            body = body + body[:arrays[0][4]]
        return position, meta, body

    bad = _rebuild(buf, edit)
    why = {"layers": "layers", "layers_200k": "layer count", "width": "does not fit", "rows": "does not fit",
           "dims_huge": "dimension", "position": "position", "recent": "look-back", "field_in_sliding_layer":
           "does not fit", "nan": "non-finite", "codec": "codec", "duplicate": "named twice"}[attack]
    with pytest.raises(StateError, match=why):
        SequenceState.from_bytes(bad, model_key=engine.model.model_key, shape=shape)


def test_the_150_byte_200000_layer_state_is_refused_even_without_a_model(engine):
    meta = json.dumps({"model": engine.model.model_key, "layers": 200_000, "recent": [], "codecs": {},
                       "arrays": []}, separators=(",", ":")).encode()
    head = _HEADER.pack(MAGIC, VERSION, 0, 0, 10, len(meta))
    bomb = head + meta + hashlib.blake2b(head + meta, digest_size=16).digest()
    assert len(bomb) < 200
    with pytest.raises(StateError, match="layer count"):
        SequenceState.from_bytes(bomb)


def test_peer_auth_proofs_and_state_macs():
    a, b = PeerAuth("s" * 32), PeerAuth("t" * 32)
    fields = {"op": "fetch", "key": "ab", "epoch": 3}
    mac = a.proof("fetch", "n1", "n2", "ab", fields)
    assert a.check(mac, "fetch", "n1", "n2", "ab", {**fields, "mac": mac})
    assert not b.check(mac, "fetch", "n1", "n2", "ab", fields)  # another secret
    assert not a.check(mac, "fetch", "n9", "n2", "ab", fields)  # another server nonce (a replay)
    assert not a.check(mac, "serve", "n1", "n2", "ab", fields)  # a reflected proof
    assert not a.check(mac, "fetch", "n1", "n2", "ab", {**fields, "epoch": 4})
    sm = a.state_mac(b"k1", 10, 100, b"d" * 16)
    assert a.check_state(sm, b"k1", 10, 100, b"d" * 16)
    assert not a.check_state(sm, b"k2", 10, 100, b"d" * 16) and not b.check_state(sm, b"k1", 10, 100, b"d" * 16)
    assert not a.check_state(None, b"k1", 10, 100, b"d" * 16)
    assert PeerAuth.from_secret(None) is None and PeerAuth.from_secret("short") is None


def test_tenant_rule():
    h = {"Authorization": "Bearer key-one"}
    assert tenant({}, None, None) == ""  # single-tenant server
    assert tenant({}, "alice", None) != tenant({}, "bob", None) != ""
    assert tenant(h, None, "key-one") != tenant({"Authorization": "Bearer key-two"}, None, "key-one")
    assert tenant(h, "alice", "key-one") not in (tenant(h, None, "key-one"), tenant({}, "alice", None))
    assert "key-one" not in tenant(h, None, "key-one") and "alice" not in tenant({}, "alice", None)
