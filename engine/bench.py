"""`python dsuf.py bench`: GPU timings against the HBM floor (bytes moved / measured bandwidth).

Three parts, each printed as a table:
1. copy bandwidth (device-to-device, bytes read + written), the yardstick for everything below;
2. the linear kernels on one V4.1-Flash layer's weight shapes (random weights in the stored
   formats: FP8 32x32 UE8M0 attention / shared expert, FP4 routed experts) at M = 1, 8, 32 and a
   4k-row prefill, with the floor for each;
3. with --ckpt: whole-model decode at batch 1/8/32 (time per step and per layer, tokens/s)
   and prefills of --prefill tokens (4k and 64k); decode floors from the bytes a step reads,
   prefill floors from its multiply-adds at the tensor cores' measured rates (prefill_parts: under
   --numerics deepseek the FP8 work at the FP8 MMA rate, kernels/peak.cu); each prefill then again
   by part (engine/bench_parts.py: each part's time against its own floor, its largest ops, the
   rest's against their bytes at the copy rate). With --gpus
   0,1,...: the same over one tensor-parallel rank per GPU (floors from the busiest rank), and
   with --compare-tp1 the sharded logits against the model on one GPU.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine.bench_parts import by_op, parts_of, report
from engine.bench_spec import bench_speculative, dense_weights, gpu_weights, weight_bytes
from engine.runtime.engine import warm_up
from engine.runtime.sampling import SampleJob, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
# prefills up to this long run twice: timed, then by part (engine/bench_parts.py); 1M included, where the
# indexer's quadratic work decides the time
PARTS_MAX_TOKENS = 1 << 20

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


def _timeit_graph(fn, x, reps: int = 20) -> float:
    """Median seconds per fn(x) with `reps` calls captured in one CUDA graph (the engine's own
    region graphs, engine/ops/gpu/graphs.py), so Python launch overhead is out of the
    number: what a captured decode step sees."""
    from engine.ops.gpu.graphs import RegionGraphs

    graphs = RegionGraphs(enabled=True)

    def many(a):  # one flat tuple of every call's outputs (a region returns arrays)
        out = []
        for _ in range(reps):
            r = fn(a)
            out.extend(r if isinstance(r, tuple) else (r,))
        return tuple(out)

    for _ in range(2):  # eager warm-up, then capture
        graphs("bench", many, x)
    return _timeit(lambda: graphs("bench", many, x), iters=10) / reps


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    import cupy as cp

    src = cp.ones(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    t = _timeit(lambda: dst.__setitem__(Ellipsis, src), iters=10)
    return 2 * nbytes / t


def _weight(fmt: str, n: int, k: int):
    import cupy as cp

    from engine.ops.gpu.ops import GpuWeight
    from engine.ops.kernels import FMT_FP4, FMT_FP8

    rng = cp.random.default_rng(0)
    if fmt == "fp8":  # random bytes with the NaN codes masked out; scales around 2^-8
        data = (rng.integers(0, 256, (n, k), dtype=cp.uint8) & 0xF7).astype(cp.uint8)
        scale = cp.full((-(-n // 32), -(-k // 32)), 2.0**-8, dtype=cp.float32)
        return GpuWeight(FMT_FP8, data, scale, (n, k), (32, 32))
    data = rng.integers(0, 256, (n, k // 2), dtype=cp.uint8).astype(cp.uint8)
    scale = cp.full((n, k // 32), 120, dtype=cp.uint8)
    return GpuWeight(FMT_FP4, data, scale, (n, k), (1, 32))



def _copies(w, nbytes: int = 256 << 20) -> list:
    """w and copies of it, about nbytes in all (2 to 40): a graph that reads each once streams
    them from HBM, where repeating one weight that fits the 50 MB L2 would time the cache."""
    from engine.ops.gpu.ops import GpuWeight

    c = max(2, min(40, -(-nbytes // weight_bytes(w))))
    return [w] + [GpuWeight(w.fmt, w.data.copy(), None if w.scale is None else w.scale.copy(), w.shape, w.block)
                  for _ in range(c - 1)]


def bench_linears(bw: float, rows=(1, 8, 32, 4096)) -> None:
    import cupy as cp

    from engine.ops.gpu.ops import CupyOps

    ops = CupyOps()
    print(f"\n{'linear':12s} {'N x K':>13s} {'fmt':>4s} " + " ".join(f"{'M=' + str(m):>18s}" for m in rows))
    for name, (n, k), fmt, _ in FLASH_LINEARS:
        w = _weight(fmt, n, k)
        ws = _copies(w)
        cells = []
        for m in rows:
            x = cp.random.default_rng(1).standard_normal((m, k), dtype=cp.float32)
            if m <= 32:  # memory-bound: one call per copy, so the weights come from HBM, not from L2
                t = _timeit_graph(lambda a, ws=ws: tuple(ops.linear(a, v) for v in ws), x, reps=1) / len(ws)
            else:
                t = _timeit_graph(lambda a, w=w: ops.linear(a, w), x)
            floor = (weight_bytes(w) + x.nbytes + m * n * 4) / bw
            flops = 2 * m * n * k / t
            cells.append(f"{t * 1e6:7.1f}us/{floor * 1e6:5.1f}" + (f" {flops / 1e12:4.0f}TF" if m > 32 else ""))
        print(f"{name:12s} {n:>6d}x{k:<6d} {fmt:>4s} " + " ".join(f"{c:>18s}" for c in cells))
    print("(each cell: median per call, CUDA-graph replay / HBM floor, microseconds; up to 32 rows over copies of "
          "the weight that L2 cannot hold; TF = achieved TFLOP/s)")


def tensor_core_rate(n: int = 8192) -> float:
    """Dense fp16 matmul FLOP/s through cuBLAS (bf16 runs at the same tensor-core rate on Hopper)."""
    import cupy as cp

    a = cp.random.default_rng(0).standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = a.T.copy()
    t = _timeit(lambda: a @ b, iters=10)
    return 2 * n**3 / t


def fp8_rate(iters: int = 512) -> tuple[float, str]:
    """The tensor cores' e4m3 x e4m3 MMA rate in FLOP/s (kernels/peak.cu: operands in shared
    memory, no global traffic) and the instruction it issues: wgmma on sm_90a, mma.sync elsewhere
    (a lower bound there)."""
    import cupy as cp

    from engine.ops import kernels as K

    hopper = K.device_arch() == "90a"
    # multiply-adds a block runs: 2 warpgroups x 8 wgmma m64n128k32 an iteration, or 8 warps x
    # 16 mma.sync m16n8k32 (kernels/peak.cu)
    per_block = iters * (2 * 8 * 64 * 128 * 32 if hopper else 8 * 16 * 16 * 8 * 32)
    blocks = 4 * cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.zeros(1, cp.float32)
    fn = K.function("peak", "mma_peak_fp8")
    t = _timeit(lambda: fn((blocks,), (256,), (out, np.int32(iters))), iters=10)
    return 2 * per_block * blocks / t, "wgmma" if hopper else "mma.sync"


def _macs(ws: list, fp8: bool | None = None) -> int:
    """Multiply-adds per row of the weights ws (fp8: only FP8 / FP4 ones, or only the others)."""
    from engine.ops.kernels import FMT_FP4, FMT_FP8

    return sum(w.shape[0] * w.shape[1] for w in ws if fp8 is None or (w.fmt in (FMT_FP8, FMT_FP4)) == fp8)


def _weight_stats(model) -> dict:
    """Bytes and multiply-adds of the weights a token touches on this model (or tensor-parallel
    rank): dense (attention, router, shared expert, summed over layers; of them the FP8 / FP4
    weights' multiply-adds, which DeepSeek's numerics run on FP8 MMA; and of them the router's and
    the shared expert's, which bench_parts counts in the MoE), one routed expert (and its FP8 / FP4
    part) and how many this rank holds per layer, the head."""
    dense = dense_macs = dense_fp8 = moe_macs = moe_fp8 = expert = expert_macs = expert_fp8 = owned = 0
    for L in model.w.layers:
        ws = dense_weights(L)
        dense += sum(weight_bytes(w) for w in ws)
        dense_macs += _macs(ws)
        dense_fp8 += _macs(ws, fp8=True)
        ffn = gpu_weights([L.ffn.gate, L.ffn.shared_experts])
        moe_macs += _macs(ffn)
        moe_fp8 += _macs(ffn, fp8=True)
        mine = [ex for ex in L.ffn.experts if ex is not None]
        owned = len(mine)
        if mine:
            expert = sum(weight_bytes(w) for w in mine[0])
            expert_macs, expert_fp8 = _macs(mine[0]), _macs(mine[0], fp8=True)
    return dict(dense=dense, dense_macs=dense_macs, dense_fp8_macs=dense_fp8, moe_dense_macs=moe_macs,
                moe_dense_fp8_macs=moe_fp8, expert=expert, expert_macs=expert_macs, expert_fp8_macs=expert_fp8,
                owned=owned, head=weight_bytes(model.w.head))


def prefill_parts(cfg, stats: list[dict], tokens: int, numerics: str) -> dict[str, dict[str, float]]:
    """Multiply-adds of a prefill of `tokens` on the tensor cores, summed over the ranks, by the
    part of the model bench_parts times them in (GEMMs: the linears outside the MoE; MoE: the
    router, the shared expert and the routed experts; indexer; attention) and the rate they run at:
    'fp8' (under DeepSeek's numerics: the FP8 / FP4 weights' linears, on e4m3 activations, and the
    indexers' scores of every compressed entry before each query, on the FP4 grid) and 'bf16' (the
    other linears, attention's q.k and p.v over each query's window and selected entries; exact
    numerics: everything). Weights count once per row (the ranks hold slices; a rank holds whole
    experts or a width slice of each); the indexers are replicated, so every rank scores everything."""
    e, k, nl, d = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.num_layers, cfg.head_dim
    attn = sum(cfg.num_heads * d * 2 * (cfg.sliding_window + (cfg.index_topk if r else 0))
               for r in cfg.compress_ratios)
    # an indexer scores query i against the (i + 1) // ratio entries closed before it (V4.1: the
    # index sources; V4: every CSA layer)
    scorers = cfg.index_source_layer_ids if cfg.arch == "v41" else [
        li for li, kind in enumerate(cfg.layer_kinds) if kind == "csa"]
    index = len(stats) * sum(cfg.index_n_heads * cfg.index_head_dim * tokens * (tokens + 1) / 2
                             / cfg.compress_ratios[li] for li in scorers)
    # (one whole expert's multiply-adds: a rank holds whole experts, or a width slice of each)
    expert = sum(ws["expert_macs"] * ws["owned"] for ws in stats) / e
    expert8 = sum(ws["expert_fp8_macs"] * ws["owned"] for ws in stats) / e
    moe = sum(ws["moe_dense_macs"] for ws in stats) + nl * k * expert
    moe8 = sum(ws["moe_dense_fp8_macs"] for ws in stats) + nl * k * expert8
    gemms = sum(ws["dense_macs"] - ws["moe_dense_macs"] for ws in stats)
    gemms8 = sum(ws["dense_fp8_macs"] - ws["moe_dense_fp8_macs"] for ws in stats)
    if numerics != "deepseek":
        return {"GEMMs": {"bf16": tokens * gemms}, "MoE": {"bf16": tokens * moe}, "indexer": {"bf16": index},
                "attention": {"bf16": tokens * attn}}
    return {"GEMMs": {"fp8": tokens * gemms8, "bf16": tokens * (gemms - gemms8)},
            "MoE": {"fp8": tokens * moe8, "bf16": tokens * (moe - moe8)}, "indexer": {"fp8": index},
            "attention": {"bf16": tokens * attn}}


def work_by_kind(parts: dict[str, dict[str, float]]) -> dict[str, float]:
    """prefill_parts' multiply-adds summed over the parts, by the rate they run at."""
    work = {"fp8": 0.0, "bf16": 0.0}
    for kinds in parts.values():
        for kind, macs in kinds.items():
            work[kind] += macs
    return work


def part_floors(parts: dict[str, dict[str, float]], rates: dict) -> dict[str, float]:
    """Each part's seconds at the tensor-core rates (summed over the ranks, as bench_parts' times)."""
    return {part: sum(2 * macs / rates[kind] for kind, macs in kinds.items()) for part, kinds in parts.items()}


def _load(ckpt: str, gpus: list[int] | None, expert_split: str = "ep", numerics: str = "exact"):
    """(model, its per-rank Models, their CUDA devices): one GPU, or one rank per GPU."""
    import cupy as cp

    from engine.checkpoint.reader import Checkpoint
    from engine.model.config import load_config
    from engine.runtime.engine import make_ops
    from engine.runtime.runner import ModelRunner as Model
    from engine.settings import Settings

    settings = Settings.from_env(numerics=numerics)

    cfg = load_config(ckpt)
    ck, tok = Checkpoint(ckpt, block_size=cfg.weight_block_size), f"{ckpt}/tokenizer.json"
    if gpus and len(gpus) > 1:
        from engine.parallel.gpu import GpuTP

        model = GpuTP(cfg, ck, gpus, tok, make_ops=lambda: make_ops("cupy", settings), expert_split=expert_split)
        return cfg, model, model.ranks, list(gpus)
    dev = gpus[0] if gpus else cp.cuda.Device().id
    with cp.cuda.Device(dev):
        model = Model(cfg, ck, make_ops("cupy", settings), tok)
    return cfg, model, [model], [dev]


def _decode_graph_seconds(graphs, rows: int, verify: bool = False) -> float:
    """Device seconds of the last decode-step graph captured at `rows` rows (verify: a speculative
    verify step's, which also returns the draft's target inputs), replayed back to back (its state
    writes repeat the same rows: harmless for timing); nan where none was captured."""
    import cupy as cp

    steps = [g for key, g in graphs.captured(rows)
             if isinstance(key[0], tuple) and key[0][0] == "decode" and bool(key[0][3]) == verify]
    if not steps:
        return float("nan")
    stream = cp.cuda.get_current_stream()
    return _timeit(lambda: steps[-1].launch(stream), iters=20)


def _sync(devices: list[int]) -> None:
    import cupy as cp

    for d in devices:
        with cp.cuda.Device(d):
            cp.cuda.Device().synchronize()


def bench_model(ckpt: str, bw: float, batches=(1, 8, 32), prefills=(4096, 65536), steps: int = 10,
                chunk: int | None = None, gpus: list[int] | None = None, compare_tp1: bool = False,
                expert_split: str = "ep", speculative: str | None = None, numerics: str = "exact") -> None:
    if prefills and chunk is None:
        chunk = _served_chunk(ckpt, gpus, 1, max(prefills), expert_split)  # (each prompt prefills alone)
    cfg, model, ranks, devices = _load(ckpt, gpus, expert_split, numerics)
    stats = [_weight_stats(r) for r in ranks]
    e, k, nl = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.num_layers
    rng = np.random.default_rng(0)
    tp = f", tensor parallel over GPUs {devices}, experts split by {expert_split}" if len(ranks) > 1 else ""
    print(f"\nmodel {ckpt}: {nl} layers, hidden {cfg.hidden_size}, {e} experts top-{k}; "
          f"CUDA graphs {'on' if ranks[0].ops.graphs.enabled else 'off'}, --numerics {numerics}{tp}")
    tc = tensor_core_rate() if prefills else 0.0
    rates = {"bf16": tc, "fp8": tc}
    if prefills:
        print(f"tensor-core rate (fp16 cuBLAS GEMM): {tc / 1e12:.0f} TFLOP/s per GPU")
        if numerics == "deepseek":
            rates["fp8"], how = fp8_rate()
            print(f"FP8 tensor-core rate (e4m3 {how}, operands in shared memory): {rates['fp8'] / 1e12:.0f} "
                  "TFLOP/s per GPU")
    _bench_decode(model, cfg, ranks, devices, stats, batches, steps, bw, rng)
    dsp = getattr(getattr(model, "model", None), "dspark", None)
    if speculative == "dspark" and dsp is None:
        print("--speculative dspark: this checkpoint has no draft layers (or runs tensor parallel)")
    elif dsp is not None and speculative != "off":
        bench_speculative(model, cfg, batches, bw, rng, lambda fn: _timeit(fn, iters=5, warmup=1),
                          lambda rows, verify: _decode_graph_seconds(ranks[0].ops.graphs, rows, verify),
                          lambda: _sync(devices))
    if prefills:
        _bench_prefill(model, cfg, ranks, devices, stats, prefills, chunk, rates, numerics, rng, bw)
    if compare_tp1 and len(ranks) > 1:
        _compare_tp1(ckpt, cfg, model, devices[0], rng, numerics)


def _served_chunk(ckpt: str, gpus: list[int] | None, seqs: int, context: int, expert_split: str) -> int:
    """The prefill chunk serve would take on these GPUs (Engine.load: the largest of GPU_PREFILL_CHUNKS
    that the memory plan fits) for `seqs` sequences of `context` tokens; the smallest where none fits."""
    import cupy as cp

    from engine.checkpoint.reader import Checkpoint
    from engine.model.config import load_config
    from engine.runtime.engine import GPU_PREFILL_CHUNKS, _plan_gpus
    from engine.runtime.memory_plan import MemoryPlanError

    cfg = load_config(ckpt)
    try:
        _, plan = _plan_gpus(cfg, Checkpoint(ckpt, block_size=cfg.weight_block_size), gpus or [cp.cuda.Device().id],
                             seqs, context, None, expert_split)
        chunk = plan.prefill_chunk
    except MemoryPlanError:
        chunk = min(GPU_PREFILL_CHUNKS)
    print(f"prefill chunk {chunk} tokens: as serve takes it for {seqs} sequences of {context} tokens")
    return chunk


def _bench_decode(model, cfg, ranks, devices, stats, batches, steps: int, bw: float, rng) -> None:
    """The decode table: per batch size, a served step's time and its graph's, against the floor."""
    e, k, nl, d = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.num_layers, cfg.head_dim
    ctx = 16  # tokens of context before the timed decode steps
    graphs = [r.ops.graphs for r in ranks]
    print(f"{'batch':>6s} {'step ms':>9s} {'layer ms':>9s} {'tok/s':>9s} {'floor ms':>9s} {'% of floor':>10s} "
          f"{'graph ms':>9s} {'graph %':>8s}")
    for b in batches:
        states = [model.new_state() for _ in range(b)]
        model.forward(states, [rng.integers(0, cfg.vocab_size, ctx) for _ in range(b)])
        toks = [[int(t)] for t in rng.integers(0, cfg.vocab_size, b)]
        jobs = [SampleJob(i, GREEDY, [], rng) for i in range(b)]
        for _ in range(3):  # eager warm-up, capture, first replay
            toks = [[t] for t, _, _ in model.step_sample(states, toks, jobs)]
        _sync(devices)
        t0 = time.perf_counter()
        for _ in range(steps):  # as served: the forward, the draw on the device, its tokens fed back
            toks = [[t] for t, _, _ in model.step_sample(states, toks, jobs)]
        _sync(devices)
        dt = (time.perf_counter() - t0) / steps
        state = b * nl * (cfg.sliding_window - 1) * d * 4  # f32 window rows read (replicated)
        # the busiest rank sets the pace: its slices, and the experts it holds that the batch touches
        floor = max(ws["dense"] + nl * ws["owned"] * (1 - (1 - k / e) ** b) * ws["expert"] + ws["head"] + state
                    for ws in stats) / bw
        step_graph = _decode_graph_seconds(graphs[0], b) if len(ranks) == 1 else float("nan")
        print(f"{b:6d} {dt * 1e3:9.2f} {dt / nl * 1e3:9.3f} {b / dt:9.1f} {floor * 1e3:9.3f} "
              f"{100 * floor / dt:9.1f}% {step_graph * 1e3:9.3f} {100 * floor / step_graph:7.1f}%")
    print(f"(graphs captured {sum(g.captures for g in graphs)}, replays {sum(g.replays for g in graphs)}; "
          "a step = forward + greedy draw on the device; "
          "floor = weight + state bytes a step reads on the busiest GPU / copy bandwidth; "
          "graph ms = the decode step's forward graph replayed back to back: its device time, no host in it; "
          "graph % = floor / graph ms)")


def _bench_prefill(model, cfg, ranks, devices, stats, prefills, chunk: int, rates: dict, numerics: str,
                   rng, bw: float) -> None:
    """Each prompt length fed in chunks: its time, tokens/s (per layer) and the tensor-core floor
    (prefill_parts' multiply-adds at their rates, spread over the ranks). Chunks go in as serve feeds
    a prompt (step_sample with nothing to draw: no logits read back, so the host prepares a chunk
    while the device runs the one before); the time ends when the device is done."""
    nl = cfg.num_layers
    # warm-up: the kernels a chunk of this size runs are compiled on first use (seconds per module)
    warm = warm_up(model, cfg.vocab_size, min(chunk, max(prefills)), cfg.max_position_embeddings)
    print(f"warm-up (two prompt chunks and a decode step, kernels compiled on first use): {warm:.2f} s")

    def feed(ids) -> None:  # a fresh sequence's prompt, chunk by chunk, nothing drawn
        st = model.new_state()
        for c0 in range(0, ids.size, chunk):
            model.step_sample([st], [ids[c0:c0 + chunk]], [])

    for prefill in prefills:
        ids = rng.integers(0, cfg.vocab_size, prefill)
        _sync(devices)
        t0 = time.perf_counter()
        feed(ids)
        _sync(devices)
        dt = time.perf_counter() - t0
        parts = prefill_parts(cfg, stats, prefill, numerics)
        work = work_by_kind(parts)
        floor = sum(2 * macs / rates[kind] for kind, macs in work.items()) / len(ranks)
        split = (f" ({2 * work['fp8'] / rates['fp8'] / len(ranks):.3f} s of FP8 work, "
                 f"{2 * work['bf16'] / rates['bf16'] / len(ranks):.3f} s of bf16)" if work["fp8"] else "")
        print(f"prefill {prefill} tokens in chunks of {min(chunk, prefill)}: {dt:.3f} s, {prefill / dt:.0f} tok/s, "
              f"{dt / nl * 1e3:.2f} ms/layer, {prefill / dt * nl:.0f} tok/s per layer; tensor-core floor "
              f"{floor:.3f} s{split} ({100 * floor / dt:.1f}% of it)")
        if prefill <= PARTS_MAX_TOKENS:  # the same prefill again, its ops timed by part
            moved: dict[str, int] = {}
            ops_s = by_op([r.ops for r in ranks], lambda ids=ids: feed(ids), moved)
            floors = part_floors(parts, rates)
            print("  by part (device time of each op, summed over the ranks; floor: the part's multiply-adds at "
                  "the tensor-core rates, or for the rest's ops their arrays' bytes at the copy rate): "
                  f"{report(parts_of(ops_s), dt, floors, ops_s, op_floors={n: b / bw for n, b in moved.items()})}")


def _compare_tp1(ckpt: str, cfg, model, device: int, rng, numerics: str = "exact") -> None:
    """Logits of the sharded model vs one GPU holding it whole: a 64-token prompt, 8 greedy steps."""
    _, plain, _, _ = _load(ckpt, [device], numerics=numerics)
    ids = [int(t) for t in rng.integers(0, cfg.vocab_size, 64)]
    a, b = model.new_state(), plain.new_state()
    la, lb = model.forward([a], [ids])[0], plain.forward([b], [ids])[0]
    errs = []
    for _ in range(8):
        errs.append(float(np.abs(la - lb).max() / np.abs(lb).max()))
        nxt = [[int(np.argmax(lb))]]
        la, lb = model.forward([a], nxt)[0], plain.forward([b], nxt)[0]
    errs.append(float(np.abs(la - lb).max() / np.abs(lb).max()))
    print(f"TP{len(model.ranks)} vs TP1 logits (max |diff| / max |logit|): worst {max(errs):.2e}, median "
          f"{float(np.median(errs)):.2e} over a 64-token prefill and 8 decode steps")


def bench_main(argv: list[str] | None = None) -> int:
    """CLI entry: `bench [--ckpt DIR] [--batches 1,8,32] [--prefill 4096,65536] [--chunk N] [--no-linears]
    [--gpus 0,1,2,3 [--compare-tp1]]`."""
    from engine.parallel.shard import EXPERT_SPLITS
    from engine.settings import DEFAULT_NUMERICS, NUMERICS

    ap = argparse.ArgumentParser(prog="dsuf bench", description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=None, help="checkpoint to time whole-model decode / prefill on")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prefill", default="4096,65536", help="prompt lengths to time, e.g. 4096,65536 (0: none)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="prefill chunk (tokens per forward; default: serve's for one sequence of the longest prompt)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-linears", action="store_true", help="skip the V4.1-Flash linear-kernel table")
    ap.add_argument("--linear-rows", default="1,8,32,4096", help="rows of x in the linear-kernel table")
    ap.add_argument("--gpus", default=None, help="e.g. 0,1,2,3: one tensor-parallel rank per GPU")
    ap.add_argument("--compare-tp1", action="store_true", help="with --gpus: logits vs the model on one GPU")
    ap.add_argument("--expert-split", choices=EXPERT_SPLITS, default="ep",
                    help="with --gpus: routed experts by expert id or by width")
    ap.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                    help="deepseek (the default): as DeepSeek's reference (bf16, FP8 GEMMs); exact: float32")
    ap.add_argument("--speculative", choices=("dspark", "off"), default=None,
                    help="time DSpark's draft and verify steps (default: dspark when the checkpoint has draft layers)")
    a = ap.parse_args(argv)
    gpus = [int(g) for g in a.gpus.split(",")] if a.gpus else None
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)")
    if not a.no_linears:
        bench_linears(bw, tuple(int(m) for m in a.linear_rows.split(",")))
    if a.ckpt:
        prefills = tuple(n for n in (int(v) for v in a.prefill.split(",")) if n > 0)
        bench_model(a.ckpt, bw, tuple(int(b) for b in a.batches.split(",")), prefills, a.steps, a.chunk, gpus,
                    a.compare_tp1, a.expert_split, a.speculative, a.numerics)
    return 0
