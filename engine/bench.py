"""`python dsuf.py bench`: GPU timings against the HBM floor (bytes moved / measured bandwidth).

Three parts, each printed as a table:
1. copy bandwidth (device-to-device, bytes read + written), the yardstick for everything below;
2. the linear kernels on one V4.1-Flash layer's weight shapes (random weights in the stored
   formats: FP8 32x32 UE8M0 attention / shared expert, FP4 routed experts) at M = 1, 8, 32 and a
   4k-row prefill, with the floor for each;
3. with --ckpt: whole-model decode at batch 1/8/32 (time per step and per layer, tokens/s)
   and a prefill of --prefill tokens, floors from the weight bytes a step reads.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

# V4.1-Flash per-layer linears: name, (N, K), format, how many per token.
FLASH_LINEARS = [
    ("wq_a", (1280, 5120), "fp8", 1), ("wq_b", (32768, 1280), "fp8", 1), ("wkv", (512, 5120), "fp8", 1),
    ("wo_b", (5120, 8192), "fp8", 1), ("shared w1", (2304, 5120), "fp8", 2), ("shared w2", (5120, 2304), "fp8", 1),
    ("expert w1", (2304, 5120), "fp4", 2), ("expert w2", (5120, 2304), "fp4", 1),
]


def _timeit(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() over iters, timed with CUDA events."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    return float(np.median(times))


def _timeit_graph(fn, reps: int = 20) -> float:
    """Median seconds per fn() with `reps` calls captured in one CUDA graph, so Python launch
    overhead is out of the number (what a captured decode step would see). Falls back to
    _timeit where capture fails."""
    import cupy as cp

    fn()  # warm: compiles, fills caches and the memory pool
    stream = cp.cuda.Stream(non_blocking=True)
    keep = []  # outputs stay alive: the graph writes into their memory on every replay
    try:
        with stream:
            stream.begin_capture()
            for _ in range(reps):
                keep.append(fn())
            graph = stream.end_capture()
    except Exception:  # noqa: BLE001 - e.g. an allocation that capture refuses
        return _timeit(fn)
    with stream:
        t = _timeit(lambda: graph.launch(stream), iters=10) / reps
    del keep
    return t


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    import cupy as cp

    src = cp.ones(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    t = _timeit(lambda: dst.__setitem__(Ellipsis, src), iters=10)
    return 2 * nbytes / t


def _weight(fmt: str, n: int, k: int):
    import cupy as cp

    from engine.backends.cupy_ops import GpuWeight
    from engine.kernels import FMT_FP4, FMT_FP8

    rng = cp.random.default_rng(0)
    if fmt == "fp8":  # random bytes with the NaN codes masked out; scales around 2^-8
        data = (rng.integers(0, 256, (n, k), dtype=cp.uint8) & 0xF7).astype(cp.uint8)
        scale = cp.full((-(-n // 32), -(-k // 32)), 2.0**-8, dtype=cp.float32)
        return GpuWeight(FMT_FP8, data, scale, (n, k), (32, 32))
    data = rng.integers(0, 256, (n, k // 2), dtype=cp.uint8).astype(cp.uint8)
    scale = cp.full((n, k // 32), 120, dtype=cp.uint8)
    return GpuWeight(FMT_FP4, data, scale, (n, k), (1, 32))


def _nbytes(w) -> int:
    return int(w.data.nbytes + (0 if w.scale is None else w.scale.nbytes))


def bench_linears(bw: float, rows=(1, 8, 32, 4096)) -> None:
    import cupy as cp

    from engine.backends.cupy_ops import CupyOps

    ops = CupyOps()
    print(f"\n{'linear':12s} {'N x K':>13s} {'fmt':>4s} " + " ".join(f"{'M=' + str(m):>18s}" for m in rows))
    for name, (n, k), fmt, _ in FLASH_LINEARS:
        w = _weight(fmt, n, k)
        cells = []
        for m in rows:
            x = cp.random.default_rng(1).standard_normal((m, k), dtype=cp.float32)
            t = _timeit_graph(lambda x=x, w=w: ops.linear(x, w))
            floor = (_nbytes(w) + x.nbytes + m * n * 4) / bw
            flops = 2 * m * n * k / t
            cells.append(f"{t * 1e6:7.1f}us/{floor * 1e6:5.1f}" + (f" {flops / 1e12:4.0f}TF" if m > 32 else ""))
        print(f"{name:12s} {n:>6d}x{k:<6d} {fmt:>4s} " + " ".join(f"{c:>18s}" for c in cells))
    print("(each cell: median per call, CUDA-graph replay / HBM floor, microseconds; TF = achieved TFLOP/s)")


def _weight_bytes(model) -> tuple[int, int, int]:
    """(non-expert bytes per layer summed over layers, bytes of one routed expert, head bytes)."""
    from engine.backends.cupy_ops import GpuWeight

    dense, expert = 0, 0
    for L in model.w.layers:
        for v in vars(L).values():
            if isinstance(v, GpuWeight):
                dense += _nbytes(v)
        if L.shared:
            dense += sum(_nbytes(w) for w in L.shared)
        expert = sum(_nbytes(w) for w in L.experts[0])
    return dense, expert, _nbytes(model.w.head)


def bench_model(ckpt: str, bw: float, batches=(1, 8, 32), prefill: int = 4096, steps: int = 10) -> None:
    import cupy as cp

    from engine.backends.cupy_ops import CupyOps
    from engine.checkpoint import Checkpoint
    from engine.config import load_config
    from engine.model import Model

    cfg = load_config(ckpt)
    tok = f"{ckpt}/tokenizer.json"
    model = Model(cfg, Checkpoint(ckpt, block_size=cfg.weight_block_size), CupyOps(), tok)
    dense, expert, head = _weight_bytes(model)
    e, k, nl = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.num_layers
    rng = np.random.default_rng(0)

    def fresh():
        st = model.new_state()
        for layer in st.layers:
            layer.window = cp.asarray(layer.window)
        return st

    print(f"\nmodel {ckpt}: {nl} layers, hidden {cfg.hidden_size}, {e} experts top-{k}")
    print(f"{'batch':>6s} {'step ms':>9s} {'layer ms':>9s} {'tok/s':>9s} {'floor ms':>9s}")
    for b in batches:
        states = [fresh() for _ in range(b)]
        model.forward(states, [rng.integers(0, cfg.vocab_size, 16) for _ in range(b)])
        toks = [[int(t)] for t in rng.integers(0, cfg.vocab_size, b)]
        model.forward(states, toks)
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            model.forward(states, toks)
        cp.cuda.Device().synchronize()
        dt = (time.perf_counter() - t0) / steps
        distinct = e * (1 - (1 - k / e) ** b)  # expected experts touched per layer
        floor = (dense + nl * distinct * expert + head) / bw
        print(f"{b:6d} {dt * 1e3:9.2f} {dt / nl * 1e3:9.3f} {b / dt:9.1f} {floor * 1e3:9.3f}")
    if prefill:
        st = fresh()
        ids = rng.integers(0, cfg.vocab_size, prefill)
        model.forward([fresh()], [ids[:64]])  # warm-up
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        model.forward([st], [ids])
        cp.cuda.Device().synchronize()
        dt = time.perf_counter() - t0
        print(f"prefill {prefill} tokens: {dt:.3f} s, {prefill / dt:.0f} tok/s, {dt / nl * 1e3:.2f} ms/layer")


def bench_main(argv: list[str] | None = None) -> int:
    """CLI entry: `bench [--ckpt DIR] [--batches 1,8,32] [--prefill N] [--no-linears]`."""
    ap = argparse.ArgumentParser(prog="dsuf bench", description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=None, help="checkpoint to time whole-model decode / prefill on")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-linears", action="store_true", help="skip the V4.1-Flash linear-kernel table")
    a = ap.parse_args(argv)
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)")
    if not a.no_linears:
        bench_linears(bw)
    if a.ckpt:
        bench_model(a.ckpt, bw, tuple(int(b) for b in a.batches.split(",")), a.prefill, a.steps)
    return 0
