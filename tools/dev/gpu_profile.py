#!/usr/bin/env python3
"""Where a decode step's device time goes, on a GPU machine (a developer's tool; not the runtime).

  timeline CKPT [--batch B] [--numerics exact|deepseek] [--what decode|verify|draft]
                              kernels of one decode-step graph replay (verify: DSpark's verify
                              step, B x (block + 1) rows, as bench times it; draft: one draft block
                              per sequence as served, graph and eager work) in launch order, with their
                              durations; per kernel name the total and the part no other kernel
                              overlapped; the time with no kernel running (CUPTI through
                              torch.profiler, so torch must be installed; PDL lets a kernel start
                              before its predecessor ends, so its span may include that overlap)
  prefill CKPT [--context N] [--chunk C] [--numerics exact|deepseek]
                              one prompt chunk of C tokens fed after N tokens of context: its
                              wall time against the sum of its kernels' times (the rest is the
                              host and its synchronizations) and the totals per kernel name
  draft CKPT [--batches 1,8,32] [--numerics exact|deepseek]
                              DSpark's draft step as served (draft_many, greedy) against its
                              graph replayed alone, per batch (each on a freshly loaded model):
                              the difference is the host's work around the graph
  served CKPT [--batch B] [--numerics exact|deepseek]
                              a served speculative step (draft, verify, the host's work between)
                              against its draft and verify graphs alone; our functions' time per
                              step under cProfile
  host CKPT [--batch B]       a served decode step's wall time against its graph's device time;
                              the step in parts by wall clock (the forward's host work and its
                              planning, Engram hashes, graph key, upload and replay call; the
                              device after it; the draw); our functions' time under cProfile
  step CKPT                   one eager decode step (graphs off) inside the NVTX range "decode",
                              for Nsight Compute: DSUF_GRAPHS=0 ncu --nvtx --nvtx-include decode/
                              -k regex:hc_mix python tools/dev/gpu_profile.py step CKPT
  linear NAME                 three eager one-row calls of a V4.1-Flash linear of the bench table
                              (engine/bench.py FLASH_LINEARS, e.g. wo_b), for ncu --launch-skip 2
  replay CKPT [--batch B] [--numerics exact|deepseek] [--what decode|verify]
                              the step's graph (as timeline's) replayed three times, then once inside
                              the NVTX range "replay", for Nsight Compute on a graph's kernels:
                              ncu --nvtx --nvtx-include replay/ -k regex:tcgemv8_fp4_n1 python
                              tools/dev/gpu_profile.py replay CKPT --batch 32 --what verify
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _decode_ready(ckpt: str, batch: int, numerics: str = "exact"):
    """The model on this GPU with `batch` sequences of 16 tokens, warmed through 4 decode steps."""
    from engine.bench import GREEDY, SampleJob, _load

    cfg, model, _, _ = _load(ckpt, None, numerics=numerics)
    rng = np.random.default_rng(0)
    states = [model.new_state() for _ in range(batch)]
    model.forward(states, [rng.integers(0, cfg.vocab_size, 16) for _ in range(batch)])
    toks = [[int(t)] for t in rng.integers(0, cfg.vocab_size, batch)]
    jobs = [SampleJob(i, GREEDY, [], rng) for i in range(batch)]
    for _ in range(4):
        toks = [[t] for t, _, _ in model.step_sample(states, toks, jobs)]
    return model, states, toks, jobs


def _decode_graphs(model, batch: int) -> list:
    """The decode-step graphs captured for `batch` sequences (none: graphs off, or not V4.1)."""
    return [g for key, g in model.ops.graphs.captured(batch) if isinstance(key[0], tuple) and key[0][0] == "decode"]


def _verify_ready(ckpt: str, batch: int, numerics: str = "exact"):
    """(the model, its verify step's rows, the draft states, the last tokens): `batch` sequences a
    window into their context, each step's [last token, drafts] verified three times (eager,
    captured, replayed), as bench does."""
    from engine.bench import _load
    from engine.bench_spec import verify_ready

    cfg, model, _, _ = _load(ckpt, None, numerics=numerics)
    if model.model.dspark is None:
        raise SystemExit("the checkpoint has no DSpark draft layers")
    _, drafts, last = verify_ready(model, cfg, batch, np.random.default_rng(0))
    return model, batch * (model.model.dspark.block_size + 1), drafts, last


def _step_run(ckpt: str, batch: int, numerics: str, what: str):
    """A callable running what timeline / replay time: the 1-token step's or the verify step's graph,
    or one draft block for every sequence as served."""
    import cupy as cp

    stream = cp.cuda.get_current_stream()
    if what == "decode":
        (model, *_), rows = _decode_ready(ckpt, batch, numerics), batch
    else:
        model, rows, drafts, last = _verify_ready(ckpt, batch, numerics)
    if what == "draft":
        def run():
            model.model.dspark.draft_many(drafts, last, tokens_only=True)
        return run
    graphs = _decode_graphs(model, rows)
    if not graphs:
        raise SystemExit("no decode-step graph was captured (DSUF_GRAPHS=0, more rows than a graph takes, "
                         "or not a V4.1 checkpoint)")

    def run():
        graphs[-1].launch(stream)
    return run


def replay(ckpt: str, batch: int, numerics: str = "deepseek", what: str = "verify") -> None:
    """The step's graph three times, then once inside the NVTX range "replay" (ncu --nvtx-include)."""
    import cupy as cp

    run = _step_run(ckpt, batch, numerics, what)
    for _ in range(3):
        run()
    cp.cuda.Device().synchronize()
    cp.cuda.nvtx.RangePush("replay")
    run()
    cp.cuda.Device().synchronize()
    cp.cuda.nvtx.RangePop()


def timeline(ckpt: str, batch: int, numerics: str = "exact", what: str = "decode") -> None:
    """what: "decode" (the 1-token step's graph), "verify" (the verify step's graph) or "draft" (one
    draft block for every sequence, as served: its graph and the eager work around it)."""
    import time

    import cupy as cp
    from torch.profiler import ProfilerActivity, profile

    stream = cp.cuda.get_current_stream()
    run = _step_run(ckpt, batch, numerics, what)
    for _ in range(5):
        run()
    stream.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()  # (inside: the profiler's own start and trace collection are not the calls')
        for _ in range(3):
            run()
        stream.synchronize()
        wall = time.perf_counter() - t0
    print(f"3 calls under the profiler: {wall * 1e3 / 3:.3f} ms each, wall clock")
    ev = _cuda_events(prof)
    n = len(ev) // 3
    one = ev[n:2 * n]  # the middle replay
    t0, totals = one[0].time_range.start, collections.defaultdict(float)
    print(f"{'start us':>9s} {'us':>7s}  kernel")
    for e in one:
        totals[e.name] += e.time_range.elapsed_us()
        print(f"{e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():7.1f}  {e.name[:70]}")
    alone, gaps, span = kernel_overlap([(e.name, e.time_range.start, e.time_range.end) for e in one])
    print(f"\none replay: {span:.1f} us, {n} kernels, {gaps:.1f} us of it with no kernel running; per kernel name,"
          f" its time and the part of it no other kernel overlapped (the critical path's share):")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{us:9.1f} {alone[name]:9.1f}  {name[:70]}")
    # the host's graph launches in that replay's window: a launch still submitting a long graph's
    # nodes while the device runs its first ones shows as a gap early in the graph
    launches = [e for e in prof.events() if e.name == "cudaGraphLaunch"
                and one[0].time_range.start - 2000 <= e.time_range.start <= one[-1].time_range.end]
    for e in launches:
        print(f"cudaGraphLaunch at {e.time_range.start - t0:9.1f} us (host clock), {e.time_range.elapsed_us():7.1f} us")


def kernel_overlap(spans: list) -> tuple[dict, float, float]:
    """(name -> time during which a kernel of that name ran alone, time with no kernel running,
    first start to last end) of (name, start, end) spans: what the step waits on, as opposed to work
    hidden beside other work (side streams, PDL's early starts)."""
    alone: dict = collections.defaultdict(float)
    if not spans:
        return alone, 0.0, 0.0
    edges = sorted({t for _, a, b in spans for t in (a, b)})
    gaps = 0.0
    for lo, hi in zip(edges, edges[1:], strict=False):
        active = [name for name, a, b in spans if a <= lo and b >= hi]
        if not active:
            gaps += hi - lo
        elif len(active) == 1:
            alone[active[0]] += hi - lo
    return alone, gaps, edges[-1] - edges[0]


def _cuda_events(prof) -> list:
    import torch

    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def prefill(ckpt: str, context: int, chunk: int, numerics: str = "exact") -> None:
    import time

    import cupy as cp
    from torch.profiler import ProfilerActivity, profile

    from engine.bench import _load

    cfg, model, _, _ = _load(ckpt, None, numerics=numerics)
    rng = np.random.default_rng(0)
    st = model.new_state()
    for start in range(0, context, chunk):
        model.forward([st], [rng.integers(0, cfg.vocab_size, min(chunk, context - start))])
    ids = rng.integers(0, cfg.vocab_size, chunk)
    cp.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        model.forward([st], [ids])
        cp.cuda.Device().synchronize()
        wall = time.perf_counter() - t0
    ev = _cuda_events(prof)
    totals, counts = collections.defaultdict(float), collections.Counter()
    for e in ev:
        totals[e.name] += e.time_range.elapsed_us()
        counts[e.name] += 1
    busy = sum(totals.values())
    print(f"chunk of {chunk} tokens after {context}: wall {wall * 1e3:.1f} ms, kernels {busy / 1e3:.1f} ms "
          f"({len(ev)} launches); per kernel name (ms, launches):")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{us / 1e3:9.2f} {counts[name]:6d}  {name[:70]}")


def host(ckpt: str, batch: int, steps: int) -> None:
    """Where a served decode step's host time goes: the step's wall time, its graph's device time
    alone, and (under cProfile, which slows Python ~2x) each of our functions' cumulative time per
    step: planning, staging, the graph key, upload, launch, the draw and its read-back."""
    import cProfile
    import pstats
    import time

    import cupy as cp

    model, states, toks, jobs = _decode_ready(ckpt, batch)

    def run() -> float:
        nonlocal toks
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            toks = [[t] for t, _, _ in model.step_sample(states, toks, jobs)]
        return (time.perf_counter() - t0) / steps

    captures = model.ops.graphs.captures
    wall = run()
    _host_split(model, states, toks, jobs, steps)
    if model.ops.graphs.captures != captures:  # a capacity bucket crossed: an eager step and a capture inside
        print(f"WARNING: {model.ops.graphs.captures - captures} graph(s) captured during the timed steps; "
              "fewer --steps keeps them out")
    graphs = _decode_graphs(model, batch)
    dev = 0.0
    if graphs:
        stream = cp.cuda.get_current_stream()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        for _ in range(steps):
            graphs[-1].launch(stream)
        b.record(stream)
        b.synchronize()
        dev = cp.cuda.get_elapsed_time(a, b) * 1e-3 / steps
    print(f"batch {batch}: step as served {wall * 1e6:.0f} us, its graph alone {dev * 1e6:.0f} us, "
          f"the rest (host, upload, draw) {(wall - dev) * 1e6:.0f} us")
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    root = str(Path(__file__).resolve().parents[2])
    rows = [(ct / steps, f"{Path(f).relative_to(root)}:{fn}") for (f, _, fn), (_, _, _, ct, _)
            in pstats.Stats(prof).stats.items() if f.startswith(root) and "tools/" not in f]
    print("per step under cProfile, cumulative (us), our functions:")
    for us, name in sorted(rows, reverse=True)[:25]:
        print(f"{us * 1e6:9.0f}  {name}")


def served(ckpt: str, batch: int, steps: int = 8, numerics: str = "deepseek") -> None:
    """Where a served speculative step's time goes (spec_decode.speculative_steps over `batch`
    fresh greedy sequences, as bench's served column): its wall time against the draft and verify
    graphs replayed alone, then our functions' cumulative time per step under cProfile (Python
    ~2x slower under it): the draft's host work, the verify's plan, staging and replay, the verify
    rule, the trials' cuts, the draft windows' absorb."""
    import cProfile
    import pstats
    import time

    import cupy as cp

    from engine.bench import _load
    from engine.bench_spec import served_sequences
    from engine.runtime.sampling import SamplingParams
    from engine.runtime.spec_decode import SpecJob, speculative_steps

    cfg, model, _, _ = _load(ckpt, None, numerics=numerics)
    dsp = model.model.dspark
    if dsp is None:
        raise SystemExit("the checkpoint has no DSpark draft layers")
    greedy = SamplingParams(temperature=0.0)
    seqs = served_sequences(model, dsp, cfg, batch, np.random.default_rng(0))

    def run() -> float:
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            jobs = [SpecJob(st, ds, out, 1 << 20, greedy, (), None, stats) for st, ds, out, stats in seqs]
            for (_, _, out, _), toks in zip(seqs, speculative_steps(model, dsp, jobs), strict=True):
                out.extend(toks)
        cp.cuda.Device().synchronize()
        return (time.perf_counter() - t0) / steps

    run()  # eager, captures
    wall = run()
    graphs = model.ops.graphs
    alone = {}
    for name, rows in (("draft", batch * dsp.block_size), ("verify", batch * (dsp.block_size + 1))):
        caps = [c.graph for sig, c in graphs._graphs.items() if c is not None and graphs._rows.get(sig) == rows
                and (sig[0][0] == "draft") == (name == "draft")]
        if caps:
            stream = cp.cuda.get_current_stream()
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            for _ in range(steps):
                for g in caps:
                    g.launch(stream)
            b.record(stream)
            b.synchronize()
            alone[name] = cp.cuda.get_elapsed_time(a, b) * 1e-3 / steps
    print(f"batch {batch}: speculative step as served {wall * 1e3:.3f} ms; graphs alone: "
          + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in alone.items())
          + f"; the rest (host work, uploads, reads) {(wall - sum(alone.values())) * 1e3:.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    root = str(Path(__file__).resolve().parents[2])
    rows = [(ct / steps, nc / steps, f"{Path(f).relative_to(root)}:{fn}") for (f, _, fn), (nc, _, _, ct, _)
            in pstats.Stats(prof).stats.items() if f.startswith(root) and "tools/" not in f]
    print("per step under cProfile: cumulative us, calls, our functions:")
    for us, calls, name in sorted(rows, reverse=True)[:40]:
        print(f"{us * 1e6:9.0f} {calls:7.0f}  {name}")


def _host_split(model, states, toks, jobs, steps: int) -> None:
    """A served step's wall time in parts, without a profiler: the forward's host work (timed
    inside by wrappers: planning, Engram hashes, the graph key, upload, the graph replay call),
    the device finishing after it, and the draw with its read-back; then the bare cost of one
    graph launch call."""
    import time

    import cupy as cp

    from engine.ops.gpu import graphs as cuda_graphs
    from engine.ops.gpu import ops as cupy_ops
    from engine.runtime import runner as runner_mod
    from engine.state.decode_plan import StepInputs

    spent: dict = collections.defaultdict(float)

    def timed(owner, name: str, label: str):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0
        setattr(owner, name, wrapper)
        return fn

    patches = [(runner_mod, "plan_decode", "plan_decode"), (type(model.model), "engram_hashes", "engram hashes"),
               (StepInputs, "signature", "graph key (signature)"), (cupy_ops.CupyOps, "_upload", "pack + upload"),
               (cuda_graphs.RegionGraphs, "_replay", "graph replay call"),
               (type(model), "prepare_next", "next step planned ahead (during the draw)")]
    saved = [(o, n, timed(o, n, lab)) for o, n, lab in patches]
    try:
        stream = cp.cuda.get_current_stream()
        for _ in range(steps):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            logits = model.forward(states, toks, on_device=True)
            t1 = time.perf_counter()
            stream.synchronize()
            t2 = time.perf_counter()
            ahead = (lambda: model.prepare_next(states)) if model.cfg.arch == "v41" else None
            out = model.ops.sample_rows(logits, jobs, ahead=ahead)  # (as a served step draws)
            t3 = time.perf_counter()
            toks[:] = [[t] for t, _, _ in out]
            spent["forward, host"] += t1 - t0
            spent["device after the forward returned"] += t2 - t1
            spent["draw + read-back"] += t3 - t2
    finally:
        for o, n, fn in saved:
            setattr(o, n, fn)
    graphs = _decode_graphs(model, len(states))
    if graphs:
        calls = []
        for _ in range(steps):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            graphs[-1].launch(stream)
            calls.append(time.perf_counter() - t0)
        cp.cuda.Device().synchronize()
        spent["one graph.launch call alone (median)"] = float(np.median(calls)) * steps
    print(f"a served step in parts, mean of {steps} (us, wall clock, no profiler):")
    for label, sec in spent.items():
        print(f"  {sec / steps * 1e6:9.1f}  {label}")


def step(ckpt: str) -> None:
    import cupy as cp

    model, states, toks, jobs = _decode_ready(ckpt, 1)
    cp.cuda.Device().synchronize()
    cp.cuda.nvtx.RangePush("decode")
    model.step_sample(states, toks, jobs)
    cp.cuda.Device().synchronize()
    cp.cuda.nvtx.RangePop()


def draft(ckpt: str, batches: list[int], numerics: str = "deepseek", iters: int = 20) -> None:
    import time

    import cupy as cp

    for b in batches:
        model, _, drafts, last = _verify_ready(ckpt, b, numerics)
        dsp, graphs = model.model.dspark, model.ops.graphs
        for _ in range(5):  # eager, captured, replayed
            dsp.draft_many(drafts, last, tokens_only=True)
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            dsp.draft_many(drafts, last, tokens_only=True)
        cp.cuda.Device().synchronize()
        served = (time.perf_counter() - t0) / iters
        caps = [c for sig, c in graphs._graphs.items() if c is not None and sig[0][0] == "draft"]
        if not caps:
            raise SystemExit("the draft block was not captured (windows not full, or graphs off)")
        stream = cp.cuda.get_current_stream()
        for _ in range(3):
            caps[-1].graph.launch(stream)
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            caps[-1].graph.launch(stream)
        stream.synchronize()
        alone = (time.perf_counter() - t0) / iters
        # one launch at a time, waited for: what a served step pays for the launch itself, which
        # back-to-back replays hide behind the previous replay
        call, waited = [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            caps[-1].graph.launch(stream)
            t1 = time.perf_counter()
            stream.synchronize()
            call.append(t1 - t0)
            waited.append(time.perf_counter() - t0)
        print(f"b{b}: draft step as served {served * 1e3:.3f} ms, its graph alone {alone * 1e3:.3f} ms, "
              f"the host's share {(served - alone) * 1e3:.3f} ms; one launch waited for "
              f"{np.median(waited) * 1e3:.3f} ms, its launch call {np.median(call) * 1e3:.3f} ms")
        del model, drafts


def linear(name: str) -> None:
    import cupy as cp

    from engine.bench import FLASH_LINEARS, _weight
    from engine.ops.gpu.ops import CupyOps

    shapes = {nm: (shape, fmt) for nm, shape, fmt, _ in FLASH_LINEARS}
    if name not in shapes:
        raise SystemExit(f"unknown linear {name!r}; one of {', '.join(shapes)}")
    (n, k), fmt = shapes[name]
    ops, w = CupyOps(), _weight(fmt, n, k)
    x = cp.random.default_rng(1).standard_normal((1, k), dtype=cp.float32)
    for _ in range(3):
        ops.linear(x, w)
    cp.cuda.Device().synchronize()


def main() -> int:
    from engine.settings import DEFAULT_NUMERICS, NUMERICS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("timeline")
    t.add_argument("ckpt")
    t.add_argument("--batch", type=int, default=1)
    t.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS)
    t.add_argument("--what", choices=("decode", "verify", "draft"), default="decode",
                   help="the 1-token step's graph, DSpark's verify step's (batch x (block + 1) rows), or "
                        "one draft block per sequence as served")
    p = sub.add_parser("prefill")
    p.add_argument("ckpt")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS)
    d = sub.add_parser("draft")
    d.add_argument("ckpt")
    d.add_argument("--batches", default="1,8,32")
    d.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS)
    v = sub.add_parser("served")
    v.add_argument("ckpt")
    v.add_argument("--batch", type=int, default=8)
    v.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS)
    h = sub.add_parser("host")
    h.add_argument("ckpt")
    h.add_argument("--batch", type=int, default=1)
    # (three runs of 8 steps from position 20 stay below the first capacity bucket's 64 keys)
    h.add_argument("--steps", type=int, default=8)
    sub.add_parser("step").add_argument("ckpt")
    sub.add_parser("linear").add_argument("name")
    r = sub.add_parser("replay")
    r.add_argument("ckpt")
    r.add_argument("--batch", type=int, default=32)
    r.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS)
    r.add_argument("--what", choices=("decode", "verify"), default="verify")
    a = ap.parse_args()
    if a.cmd == "timeline":
        timeline(a.ckpt, a.batch, a.numerics, a.what)
    elif a.cmd == "prefill":
        prefill(a.ckpt, a.context, a.chunk, a.numerics)
    elif a.cmd == "draft":
        draft(a.ckpt, [int(b) for b in a.batches.split(",")], a.numerics)
    elif a.cmd == "served":
        served(a.ckpt, a.batch, numerics=a.numerics)
    elif a.cmd == "host":
        host(a.ckpt, a.batch, a.steps)
    elif a.cmd == "step":
        step(a.ckpt)
    elif a.cmd == "replay":
        replay(a.ckpt, a.batch, a.numerics, a.what)
    else:
        linear(a.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
