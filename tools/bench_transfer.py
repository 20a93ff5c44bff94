#!/usr/bin/env python3
"""State-transfer benchmark: bytes/s and latency of fetching sequence states between two
processes over loopback TCP (the same code path servers use: kvcache.peer + transport_tcp),
for V4.1 states of 1k .. 1M tokens.

    python3 tools/bench_transfer.py [--configs demo-v41,v41-flash-shaped,v41-flash]
                                    [--tokens 1k,4k,16k,64k,256k,1M] [--repeat 3] [--json OUT]

Configs: demo-v41 (models/demo-v41), v41-flash-shaped (tiny-model preset: V4.1-Flash widths,
4 layers) and v41-flash (the released V4.1-Flash: 40 layers, KV sources 2/8/14/20). States are
built in the exact engine/state/sequence.py layout and storage formats (FP8 window, FP4 entries and
indexer keys) with filler contents: a 1M-token V4.1-Flash state would need ~7 GB of float32
arrays to build from real tensors. tests/test_kvcache_bench.py checks the layout against
states the model computes. An owner subprocess holds the states; this process fetches each
one `repeat` times after one warm-up (which also computes the owner's cached digest).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.state import sequence as S  # noqa: E402
from engine.state.sequence import SequenceState  # noqa: E402

_BLOCK = {S.FP8_UE8M0_32: 32, S.FP4_E4M3_16: 16, S.FP4_UE8M0_32: 32}


def shape_of(name: str) -> SimpleNamespace:
    """The few config fields that decide a V4.1 state's layout."""
    if name == "v41-flash":  # DESIGN.md / the released text_config
        return SimpleNamespace(num_layers=40, head_dim=512, sliding_window=128, index_head_dim=128,
                               compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20, kv_source_layer_ids=(2, 8, 14, 20),
                               engram_max_ngram_size=4, model_key="deepseek_v41:40x5120:129280")
    from engine.model.config import load_config, parse_config

    if name == "demo-v41":
        cfg = load_config(ROOT / "models" / "demo-v41")
    elif name == "v41-flash-shaped":
        from engine.checkpoint.tiny_model import PRESETS, make_config

        preset = {k: v for k, v in PRESETS[name].items() if k != "arch"}
        cfg = parse_config(make_config("v41", **preset))
    else:
        raise SystemExit(f"unknown config {name!r}")
    return SimpleNamespace(num_layers=cfg.num_layers, head_dim=cfg.head_dim, sliding_window=cfg.sliding_window,
                           index_head_dim=cfg.index_head_dim, compress_ratios=tuple(cfg.compress_ratios),
                           kv_source_layer_ids=tuple(cfg.kv_source_layer_ids),
                           engram_max_ngram_size=cfg.engram_max_ngram_size,
                           model_key=f"{cfg.model_type}:{cfg.num_layers}x{cfg.hidden_size}:{cfg.vocab_size}")


def layout(cfg: SimpleNamespace, n: int) -> list[list]:
    """A V4.1 state's array directory after n tokens (engine/state/sequence.py): [layer, name, shape, codec, nbytes]."""
    d, out = cfg.head_dim, []

    def add(li: int, name: str, shape: tuple[int, int], codec: int) -> None:
        count = shape[0] * shape[1]
        if count == 0 or codec == S.F32 or shape[1] % _BLOCK[codec]:
            codec, nbytes = S.F32, 4 * count
        else:
            nb = count // _BLOCK[codec]
            nbytes = nb + (count if codec == S.FP8_UE8M0_32 else count // 2)
        out.append([li, name, list(shape), codec, nbytes])

    for li in range(cfg.num_layers):
        add(li, "window", (min(n, cfg.sliding_window - 1), d), S.FP8_UE8M0_32)
        if li in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[li]
            if r > 1:
                add(li, "buf_kv", (n % r, d), S.F32)
                add(li, "buf_gate", (n % r, d), S.F32)
            add(li, "entries", (n // r, d), S.FP4_E4M3_16)
            add(li, "idx_keys", (n // r, cfg.index_head_dim), S.FP4_UE8M0_32)
    return out


def _meta(cfg: SimpleNamespace, n: int) -> tuple[list[list], bytes]:
    arrays = layout(cfg, n)
    keep = max(0, cfg.engram_max_ngram_size - 1)
    meta = json.dumps({"model": cfg.model_key, "layers": cfg.num_layers, "recent": list(range(n - keep, n)),
                       "codecs": dict(S.V41_CODECS), "arrays": arrays}, separators=(",", ":")).encode()
    return arrays, meta


def state_size(cfg: SimpleNamespace, n: int) -> int:
    arrays, meta = _meta(cfg, n)
    return S._HEADER.size + len(meta) + sum(a[4] for a in arrays) + 16


def synthetic_state(cfg: SimpleNamespace, n: int) -> bytes:
    """A state buffer of that layout (valid header, directory and digest; filler contents)."""
    arrays, meta = _meta(cfg, n)
    head = S._HEADER.pack(S.MAGIC, S.VERSION, 0, len(arrays), n, len(meta))
    # 0x38: a finite value in every codec (e4m3 1.0, small e8m0 scales, fp4 1.5 / -0); transfers
    # neither compress nor look at the contents
    out = head + meta + b"\x38" * sum(a[4] for a in arrays)
    return out + hashlib.blake2b(out, digest_size=16).digest()


def _key(config: str, n: int) -> bytes:
    return hashlib.blake2b(f"bench|{config}|{n}".encode(), digest_size=16).digest()


def _parse_tokens(s: str) -> list[int]:
    out = []
    for t in s.split(","):
        t = t.strip().lower()
        mult = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
        out.append(int(float(t.rstrip("km")) * mult))
    return out


# ---------------------------------------------------------------- owner process


async def _owner(configs: list[str], tokens: list[int]) -> None:
    from kvcache.peer import TransferServer
    from kvcache.store import HostStore
    from kvcache.transport_tcp import TcpMover

    store = HostStore(64 << 30, pin=True)
    for c in configs:
        cfg = shape_of(c)
        for n in tokens:
            e = store.put(_key(c, n), n, b"\0" * 16, synthetic_state(cfg, n))
            e.epoch = 1
    srv = TransferServer(store, {"tcp": TcpMover()}, timeout_s=120, stall_s=30, auth=_auth())
    port = await srv.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin


# ---------------------------------------------------------------- fetcher


async def _bench(configs: list[str], tokens: list[int], repeat: int, port: int, load_max: int) -> list[dict]:
    from kvcache.peer import Offer, fetch
    from kvcache.store import HostStore
    from kvcache.transport_tcp import TcpMover

    store = HostStore(64 << 30, pin=True)
    movers = {"tcp": TcpMover()}
    rows = []
    for c in configs:
        cfg = shape_of(c)
        for n in tokens:
            size = state_size(cfg, n)
            offer = Offer(_key(c, n), 1, f"127.0.0.1:{port}", size, n)
            times, load = [], []
            for i in range(repeat + 1):
                t0 = time.perf_counter()
                buf, reply = await fetch(offer, store, movers, auth=_auth(), timeout_s=120, stall_s=30, min_rate=1e6)
                dt = time.perf_counter() - t0
                t1 = time.perf_counter()
                st = None
                if i == repeat and n <= load_max:
                    st = SequenceState.from_bytes(buf.view(), model_key=cfg.model_key)
                if st is not None:
                    load.append(time.perf_counter() - t1)
                    assert st.position == n
                    del st
                size, phases = buf.size, reply.get("_timing", {})
                buf.close()
                if i:
                    times.append(dt)
            med = statistics.median(times)
            row = {"config": c, "tokens": n, "state_bytes": size, "bytes_per_token": size / n,
                   "fetch_ms": med * 1e3, "fetch_ms_min": min(times) * 1e3, "gb_per_s": size / med / 1e9,
                   "from_bytes_ms": load[0] * 1e3 if load else None, **{k: v * 1e3 for k, v in phases.items()}}
            rows.append(row)
            load_txt = f"{load[0] * 1e3:8.1f} ms" if load else "       -   "
            last = " ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in phases.items())
            print(f"{c:17s} {n:>8d} tok  {size / 1e6:10.2f} MB  {size / n:8.1f} B/tok  fetch {med * 1e3:9.2f} ms "
                  f"(min {min(times) * 1e3:8.2f})  {size / med / 1e9:6.2f} GB/s  from_bytes {load_txt}  "
                  f"[last: {last} ms]", flush=True)
    return rows


def _auth():
    """Both processes authenticate with the secret main() put in the environment."""
    from kvcache.auth import SECRET_ENV, PeerAuth

    return PeerAuth(os.environ[SECRET_ENV])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="demo-v41,v41-flash-shaped,v41-flash")
    ap.add_argument("--tokens", default="1k,4k,16k,64k,256k,1M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--from-bytes-max", type=int, default=1 << 16,
                    help="also time SequenceState.from_bytes (the engine's decoder) up to this many tokens")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the owner subprocess
    args = ap.parse_args(argv)
    configs, tokens = args.configs.split(","), _parse_tokens(args.tokens)
    if args.serve:
        asyncio.run(_owner(configs, tokens))
        return 0
    os.environ.setdefault("DSUF_KV_SECRET", os.urandom(16).hex())  # the owner subprocess inherits it
    owner = subprocess.Popen([sys.executable, __file__, "--serve", "--configs", args.configs, "--tokens",
                              args.tokens], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(owner.stdout.readline())
        print(f"loopback TCP, owner pid {owner.pid}, {os.cpu_count()} CPUs; median of {args.repeat} fetches "
              "(connect + handshake + pinned alloc + payload + digest check), then SequenceState.from_bytes "
              f"up to {args.from_bytes_max} tokens", flush=True)
        rows = asyncio.run(_bench(configs, tokens, args.repeat, port, args.from_bytes_max))
    finally:
        owner.stdin.close()
        owner.wait(30)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
