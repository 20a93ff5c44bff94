"""`bench --speculative dspark`: DSpark's two steps on the GPU against their HBM floors, beside
the 1-token decode step, and the tokens/s they imply at acceptance 3.5 and 5.6 tokens per step.

- verify step: every sequence's [last token, block_size drafts] as decode rows of one decode step
  (ModelRunner.forward(verify=True)), replayed as its CUDA graph; floor: the main model's weights
  it reads (dense, the routed experts its rows touch, the head) and the windows, once;
- draft step: every sequence's draft block in one draft forward (DSpark.draft_many), as served:
  for an argmax-only batch the draft layers, the head, the Markov head's position-by-position
  argmax and the confidence head as one CUDA graph (DSpark.region), with the host's work around
  it (the inputs' uploads and copies, the tokens read back); floor: the draft layers' weights
  (dense, the experts the batch's block rows touch), main_proj, the head and the Markov head once
  a position;
- 1-token step: the plain decode step's graph at the same batch size;
- served step: spec_decode.speculative_steps end to end, as the server runs it (draft, verify, the
  host work between them, the trials cut to the drafts the random checkpoint keeps), with the
  verify step planned while the device drafts (ModelRunner.prepare_verify) and planned inline
  after it (prepare_verify hidden): their difference is the overlap.
A speculative step is one draft step and one verify step, so at acceptance a it emits a tokens
per sequence in (draft + verify) time.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

ACCEPTANCE = (3.5, 5.6)  # a realistic agent workload; the seed engine's benchmark


def gpu_weights(v) -> list:
    """Every GpuWeight in a part (stacked projections and sub-parts included)."""
    from engine.ops.gpu.ops import GpuWeight

    if isinstance(v, GpuWeight):
        return [v]
    if isinstance(v, (list, tuple)):
        return [w for x in v for w in gpu_weights(x)]
    if hasattr(v, "__dict__"):
        return [w for x in vars(v).values() for w in gpu_weights(x)]
    return []


def weight_bytes(w) -> int:
    """A GpuWeight's bytes on the device: its data and its scales."""
    return int(w.data.nbytes + (0 if w.scale is None else w.scale.nbytes))


def dense_weights(layer) -> list:
    """A layer's weights every token reads: attention, router, shared expert, Engram."""
    return gpu_weights([layer.attn, layer.ffn.gate, layer.ffn.shared_experts, getattr(layer, "engram", None)])


def _touched(experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts `rows` rows route to (uniform routing)."""
    return experts * (1 - (1 - top_k / experts) ** rows)


def _layer_bytes(layers) -> tuple[int, int]:
    """(dense bytes summed over layers, one routed expert's bytes)."""
    dense = expert = 0
    for L in layers:
        dense += sum(weight_bytes(w) for w in dense_weights(L))
        mine = [ex for ex in L.ffn.experts if ex is not None]
        if mine:
            expert = sum(weight_bytes(w) for w in mine[0])
    return dense, expert


def floors(model, cfg, b: int, bw: float) -> dict:
    """Seconds each step takes at copy bandwidth bw for b sequences: "step" (1 token), "verify",
    "draft" (see the module's docstring)."""
    dsp, w = model.model.dspark, model.w
    k, nl, d = dsp.block_size, cfg.num_layers, cfg.head_dim
    dense, expert = _layer_bytes(w.layers)
    head = weight_bytes(w.head)
    window = nl * (cfg.sliding_window - 1) * d * 4
    main = {rows: dense + nl * _touched(cfg.n_routed_experts, cfg.num_experts_per_tok, rows) * expert + head
            for rows in (b, b * (k + 1))}
    dw = w.dspark
    ddense, dexpert = _layer_bytes(dw.layers)
    dcfg = dsp.cfg
    draft = (ddense + len(dw.layers) * _touched(dcfg.n_routed_experts, dcfg.num_experts_per_tok, b * k) * dexpert
             + weight_bytes(dw.main_proj) + head + k * weight_bytes(dw.markov_head.head)
             + b * len(dw.layers) * cfg.sliding_window * d * 4)
    return {"step": (main[b] + b * window) / bw, "verify": (main[b * (k + 1)] + b * (window + k * nl * d * 4)) / bw,
            "draft": draft / bw}


def served_sequences(model, dsp, cfg, b: int, rng) -> list[tuple]:
    """b fresh sequences a window and a token into random prompts, their drafts' windows full:
    (state, draft state, tokens so far, SpecStats) each, as speculative_steps' jobs take them."""
    from engine.runtime.spec_decode import SpecStats, feed

    seqs = []
    for _ in range(b):
        st, ds = model.new_state(), dsp.new_state()
        prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, cfg.sliding_window + 1)]
        feed(model, dsp, st, ds, prompt, all_logits=False)
        seqs.append((st, ds, [prompt[-1]], SpecStats()))
    return seqs


def served_step(model, dsp, cfg, b: int, rng, ahead: bool, steps: int = 8) -> tuple[float, float]:
    """Mean seconds of one speculative_steps call over b fresh greedy sequences (after two warm-up
    calls), and the tokens a sequence kept per step; ahead False: the verify planned inline."""
    from engine.runtime.sampling import SamplingParams
    from engine.runtime.spec_decode import SpecJob, speculative_steps

    greedy = SamplingParams(temperature=0.0)
    seqs = served_sequences(model, dsp, cfg, b, rng)

    def step() -> None:
        jobs = [SpecJob(st, ds, out, 1 << 20, greedy, (), None, stats) for st, ds, out, stats in seqs]
        for (_, _, out, _), toks in zip(seqs, speculative_steps(model, dsp, jobs), strict=True):
            out.extend(toks)

    if not ahead:
        model.prepare_verify = None  # (hidden: speculative_steps plans the verify inline)
    try:
        step()
        step()
        kept = sum(len(s[3].lengths) for s in seqs), sum(sum(s[3].lengths) for s in seqs)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = (time.perf_counter() - t0) / steps
    finally:
        if not ahead:
            del model.prepare_verify
    n = sum(len(s[3].lengths) for s in seqs) - kept[0]
    return seconds, (sum(sum(s[3].lengths) for s in seqs) - kept[1]) / max(n, 1)


def verify_ready(model, cfg, b: int, rng, experts: list | None = None) -> tuple[list, list, list[int]]:
    """(states, draft states, last tokens) of b sequences a window into their context, whose verify
    step ([last token, drafts] as decode rows) has run three times and been rolled back each time:
    eager, captured, replayed (its graph). experts (a list): given the distinct experts each MoE
    layer routed the verify rows to, in the eager run (what the step's time depends on: its rows are
    a random checkpoint's drafts, and the floor assumes uniform routing)."""
    from engine.runtime.spec_decode import feed
    from engine.state import trial as trials

    dsp = model.model.dspark
    states, drafts = [model.new_state() for _ in range(b)], [dsp.new_state() for _ in range(b)]
    for st, ds in zip(states, drafts, strict=True):
        # (a window's worth of context: the draft's windows are full, as in a conversation)
        feed(model, dsp, st, ds, [int(t) for t in rng.integers(0, cfg.vocab_size, cfg.sliding_window + 1)],
             all_logits=False)
    last = [int(t) for t in rng.integers(0, cfg.vocab_size, b)]
    blocks = [[t, *(int(x) for x in dr.tokens)]
              for dr, t in zip(dsp.draft_many(drafts, last, tokens_only=True), last, strict=True)]
    for i in range(3):
        marks = [trials.begin(st) for st in states]
        with _routes_counted(getattr(model, "ops", None), experts if i == 0 else None):
            model.forward(states, blocks, all_logits=True, on_device=True, targets=dsp.targets, verify=True)
        for st, tr in zip(states, marks, strict=True):
            trials.restore(st, tr)
    return states, drafts, last


@contextlib.contextmanager
def _routes_counted(ops, into: list | None):
    """While open, each ops.route call appends the number of distinct experts it chose to `into`
    (none if into or ops is None: a tensor-parallel model routes on its ranks)."""
    if into is None or ops is None:
        yield
        return
    real = ops.route

    def route(*args, **kwargs):
        weights, ids = real(*args, **kwargs)
        into.append(int(np.unique(np.asarray(ops.to_host(ids))).size))
        return weights, ids

    ops.route = route
    try:
        yield
    finally:
        del ops.route


def bench_speculative(model, cfg, batches, bw: float, rng, timeit, graph_seconds, sync) -> None:
    """The speculative table (see the module's docstring); timeit(fn) -> median seconds,
    graph_seconds(rows, verify) -> a captured decode graph's replay seconds, sync() waits for the GPU."""
    dsp = model.model.dspark
    k = dsp.block_size
    print(f"\nDSpark: {len(model.w.dspark.layers)} draft layers, {dsp.cfg.n_routed_experts} experts "
          f"top-{dsp.cfg.num_experts_per_tok}, block {k}")
    print(f"{'batch':>6s} {'step ms':>8s} {'floor':>7s} {'verify ms':>9s} {'floor':>7s} {'% floor':>8s} "
          f"{'draft ms':>9s} {'floor':>7s} {'% floor':>8s} " + " ".join(f"{f'tok/s@{a}':>10s}" for a in ACCEPTANCE)
          + f" {'served ms':>9s} {'inline':>7s} {'tok/step':>8s} {'experts':>8s}")
    for b in batches:
        routed: list[int] = []
        states, drafts, last = verify_ready(model, cfg, b, rng, routed)
        for _ in range(2):  # the 1-token step, eager then captured
            model.forward(states, [[t] for t in last])
        sync()
        verify_s, step_s = graph_seconds(b * (k + 1), True), graph_seconds(b, False)

        def draft_all(drafts=drafts, last=last):
            dsp.draft_many(drafts, last, tokens_only=True)  # (as a greedy served step drafts)

        draft_s = timeit(draft_all)
        f = floors(model, cfg, b, bw)
        rates = " ".join(f"{b * a / (draft_s + verify_s):10.1f}" for a in ACCEPTANCE)
        served_s, per_step = served_step(model, dsp, cfg, b, rng, ahead=True)
        inline_s, _ = served_step(model, dsp, cfg, b, rng, ahead=False)
        print(f"{b:6d} {step_s * 1e3:8.3f} {f['step'] * 1e3:7.3f} {verify_s * 1e3:9.3f} {f['verify'] * 1e3:7.3f} "
              f"{100 * f['verify'] / verify_s:7.1f}% {draft_s * 1e3:9.3f} {f['draft'] * 1e3:7.3f} "
              f"{100 * f['draft'] / draft_s:7.1f}% {rates} {served_s * 1e3:9.3f} {inline_s * 1e3:7.3f} "
              f"{per_step:8.2f} {np.mean(routed) if routed else float('nan'):8.1f}/"
              f"{_touched(cfg.n_routed_experts, cfg.num_experts_per_tok, b * (k + 1)):.0f}")
    print("(step / verify ms: the 1-token and the verify decode step's graphs replayed back to back (nan: not "
          "captured, e.g. more rows than a graph takes); draft ms: every sequence's draft block as served (its "
          "block one graph for an argmax-only batch, its layers one graph otherwise); floors: bytes each "
          "step reads / copy bandwidth; "
          "tok/s@a: batch x a / (draft + verify); served / inline ms: one speculative_steps call as served, the "
          "verify step planned while the device drafts / planned after it; tok/step: tokens a sequence kept a step; "
          "experts: distinct routed experts a MoE layer read for the verify rows / what uniform routing, which the "
          "floor assumes, gives)")
