"""Whole model on CupyOps vs the numpy reference: models/demo-v41, prompt + 200 greedy tokens.

Teacher-forced: both backends are fed the reference's greedy tokens, so one flipped near-tie
cannot derail the rest. Every step's argmax must match unless the reference's top-2 margin is
below NEAR_TIE; logits must agree within LOGIT_TOL (relative, max-abs over the vocabulary).
Skipped where CuPy or a GPU is absent (CI).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gpu_required import require_gpu

cp = require_gpu()

from engine.checkpoint.reader import Checkpoint  # noqa: E402
from engine.model.config import load_config  # noqa: E402
from engine.ops.gpu.ops import CupyOps, GpuWeight  # noqa: E402
from engine.ops.gpu.weights import _host_dequant  # noqa: E402
from engine.ops.numpy_ops import NumpyOps, fake_quant  # noqa: E402
from engine.runtime.runner import ModelRunner as Model  # noqa: E402
from engine.settings import Settings  # noqa: E402
from engine.state.rows import Span  # noqa: E402
from engine.text.tokenizer import Tokenizer  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-v41"
STEPS = 200
NEAR_TIE = 2e-2  # top-2 logit margin (absolute) under which summation order may flip the argmax
PROMPT = "def mean(xs):\n    \"\"\"Return the arithmetic mean.\"\"\"\n"


def _model(ops, store_quantized: bool = True) -> Model:
    cfg = load_config(DEMO)
    return Model(cfg, Checkpoint(DEMO, block_size=cfg.weight_block_size), ops, DEMO / "tokenizer.json",
                 store_quantized=store_quantized)


def _gpu_state(model: Model):
    # Model.new_state() makes numpy windows; a GPU backend needs them on the device.
    st = model.new_state()
    for layer in st.layers:
        layer.window = cp.asarray(layer.window)
    return st


def _teacher_forced(store_quantized: bool) -> tuple[list[float], int, list[int]]:
    """Feed both backends the reference's greedy tokens. Returns per-step logit errors (max abs
    difference / max abs reference logit), the number of argmax flips, and the reference's
    tokens. A flip is only allowed at a near-tie of the reference."""
    ref, gpu = _model(NumpyOps(), store_quantized), _model(CupyOps(), store_quantized)
    ids = Tokenizer.from_dir(DEMO).encode(PROMPT)
    rs, gs = ref.new_state(), _gpu_state(gpu)
    r_logits, g_logits = ref.forward([rs], [ids])[0], gpu.forward([gs], [ids])[0]
    errs, flips, tokens = [], 0, []
    for step in range(STEPS + 1):
        errs.append(float(np.abs(g_logits - r_logits).max() / np.abs(r_logits).max()))
        top2 = np.sort(r_logits)[-2:]
        if int(np.argmax(g_logits)) != int(np.argmax(r_logits)):
            assert top2[1] - top2[0] < NEAR_TIE, f"step {step}: argmax differs, margin {top2[1] - top2[0]:.3g}"
            flips += 1
        if step == STEPS:
            break
        nxt = int(np.argmax(r_logits))
        tokens.append(nxt)
        r_logits, g_logits = ref.forward([rs], [[nxt]])[0], gpu.forward([gs], [[nxt]])[0]
    return errs, flips, tokens


def test_step_sample_draws_from_the_models_logits():
    """Model.step_sample on the GPU (a batch of prompts, mixed sampling settings, rows out of
    order, one row drawn twice) draws what the reference sampler draws from the same forward's
    logits, except where float32 may decide a row differently (test_gpu_sampling._close_call)."""
    from test_gpu_sampling import LP_TOL, _close_call

    from engine.runtime.sampling import SampleJob, SamplingParams, make_rngs, sample_batch

    gpu = _model(CupyOps())
    tok = Tokenizer.from_dir(DEMO)
    chunks = [tok.encode(PROMPT), tok.encode("The capital of France is"), tok.encode("1, 2, 3,")]
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, top_k=20, presence_penalty=0.5, logprobs=True, top_logprobs=2)]

    def jobs():
        rngs = make_rngs(7, 4)
        return [SampleJob(r, params[i % 3], [5, 9, 9], rngs[i]) for i, r in enumerate([2, 0, 1, 2])]

    logits = np.stack(gpu.forward([_gpu_state(gpu) for _ in chunks], chunks))
    want = sample_batch(logits, jobs())
    got = gpu.step_sample([_gpu_state(gpu) for _ in chunks], chunks, jobs())
    for j, (g, w) in zip(jobs(), zip(got, want, strict=True), strict=True):
        if g[0] != w[0]:
            assert _close_call(logits[j.row], j.params, j.generated, j.rng.random()), (j, g, w)
        elif w[1] is not None:
            assert abs(g[1] - w[1]) < LP_TOL and [t for t, _ in g[2]] == [t for t, _ in w[2]]


def test_next_step_planned_ahead_on_the_gpu():
    """Decode steps that take the plan and the tables packed while the device ran the step before
    (ModelRunner.prepare_next, CupyOps.prestage; the grown buffers' copies enqueued then) draw the
    same greedy tokens and leave the same states, byte for byte, as steps planned in turn (forward,
    then the draw); through window-block growth, a sequence leaving and one joining with a prompt."""
    from engine.bench import GREEDY
    from engine.runtime.sampling import SampleJob

    tok = Tokenizer.from_dir(DEMO)
    prompts = {"a": tok.encode(PROMPT), "b": tok.encode("Hello, world."), "c": tok.encode("1, 2, 3,")}
    script = [["a", "b"]] * 75 + [["a"]] * 3 + [["a", "c"]] * 20
    runs = []
    for ahead in (False, True):
        model = _model(CupyOps())
        states, last, toks = {}, {}, []
        rng = np.random.default_rng(0)
        for step in script:
            chunks = []
            for n in step:
                if n not in states:
                    states[n] = _gpu_state(model)
                chunks.append(prompts[n] if n not in last else [last[n]])
            sts, jobs = [states[n] for n in step], [SampleJob(i, GREEDY, [], rng) for i in range(len(step))]
            out = (model.step_sample(sts, chunks, jobs) if ahead else
                   model.ops.sample_rows(model.forward(sts, chunks, on_device=True), jobs))
            last.update({n: t for n, (t, _, _) in zip(step, out, strict=True)})
            toks.append([t for t, _, _ in out])
        runs.append((toks, [states[n].to_bytes() for n in sorted(states)], model.ahead_used))
    assert runs[0][2] == 0 and runs[1][2] == 73 + 2 + 18  # (not after a prompt or a change of batch)
    assert runs[0][:2] == runs[1][:2]


def test_demo_v41_unquantized_state_matches():
    """Without V4.1's state rounding the backends differ only by float32 summation order."""
    errs, flips, _ = _teacher_forced(store_quantized=False)
    print("first steps:", " ".join(f"{e:.1e}" for e in errs[:8]))
    print(f"demo-v41 unquantized state: worst logit error {max(errs):.2e} over {STEPS} steps, flips {flips}")
    assert max(errs) < 1e-3
    assert flips == 0


def test_demo_v41_greedy_200():
    """The real model (FP8 window / FP4 entries and keys). Summation-order noise can move a value
    across an FP8/FP4 rounding boundary, which the state then carries, so logits are compared
    loosely and greedy tokens strictly (near-ties excepted)."""
    errs, flips, _ = _teacher_forced(store_quantized=True)
    print("first steps:", " ".join(f"{e:.1e}" for e in errs[:8]))
    print(f"demo-v41: worst logit error {max(errs):.2e} (median {np.median(errs):.2e}) over {STEPS} steps, "
          f"near-tie flips {flips}")
    assert flips <= 2
    assert np.median(errs) < 1e-2


def _host(a):
    if isinstance(a, cp.ndarray):
        return cp.asnumpy(a)
    if isinstance(a, GpuWeight):
        return _host_dequant(a)
    if isinstance(a, list):
        return [_host(x) for x in a]
    if isinstance(a, Span):
        return Span(_host(a.buf), a.start, a.n)
    if isinstance(a, tuple):
        return tuple(_host(x) for x in a)
    return a


def _err(got, ref) -> float:
    if isinstance(ref, tuple):
        return max(_err(g, r) for g, r in zip(got, ref, strict=True))
    g, r = _host(got), np.asarray(ref)
    if g.shape != r.shape:
        return float("inf")
    if r.dtype == bool or r.dtype.kind in "iu":
        return float((g != r).mean())
    g, r = g.astype(np.float64), r.astype(np.float64)
    fin = np.isfinite(r)
    if not np.array_equal(fin, np.isfinite(g)):
        return float("inf")
    return float(np.linalg.norm(g[fin] - r[fin]) / max(np.linalg.norm(r[fin]), 1e-30))


class DualOps:
    """CupyOps that also runs every op through NumpyOps on the same (host-copied) inputs and
    records the worst error per op: it points at the op, not at where the error surfaces."""

    name, xp = "dual", cp

    def __init__(self):
        self.gpu, self.ref, self.worst = CupyOps(), NumpyOps(), {}

    def graphed_step(self, key, inputs, run, rows, pre=None):  # op by op, eagerly: each op is compared
        return run(self.gpu.stage(inputs))

    def norm_rope_quant(self, x, cos, sin, norm=None, quant=0, keep_normed=False):
        """Compared in two parts: before the quantization within float32 tolerance, and the
        quantization exactly, on the GPU's own unquantized result (after another summation order a
        value near a rounding boundary may round the other way)."""
        out = self.gpu.norm_rope_quant(x, cos, sin, norm, quant, keep_normed)
        plain = self.gpu.norm_rope_quant(x, cos, sin, norm, 0, keep_normed)
        ref = self.ref.norm_rope_quant(*_host((x, cos, sin, norm)), 0, keep_normed)
        key = f"norm_rope_quant[{'>8' if x.shape[0] > 8 else '<=8'} rows]"
        self.worst[key] = max(self.worst.get(key, 0.0), _err(plain, ref))
        got, plain = (out[1], plain[1]) if keep_normed else (out, plain)
        want = fake_quant(self.ref, _host(plain), quant)
        self.worst["norm_rope_quant codec"] = max(self.worst.get("norm_rope_quant codec", 0.0), _err(got, want))
        return out

    def __getattr__(self, name):
        fn = getattr(self.gpu, name)
        # (in place, or reading staged address tables the reference cannot: test_gpu_ops checks those)
        if name in ("prepare", "prepare_rows", "asarray", "to_host", "copy_rows", "stage", "scatter_rows",
                    "gated_pool_rows", "attend_decode", "indexer_scores_spans", "fork", "join_all",
                    "all_reduce", "all_gather", "prestage", "sample_rows") or not callable(fn):
            return fn

        def call(*args, **kw):
            # (the reference's inputs copied first: an op in place, rope's in_place, rewrites them)
            hargs, hkw = _host(args), {k: _host(v) for k, v in kw.items()}
            out = fn(*args, **kw)
            ref = getattr(self.ref, name)(*hargs, **hkw)
            rows = args[0].shape[0] if getattr(args[0], "ndim", 0) else 1
            key = f"{name}[{'>8' if rows > 8 else '<=8'} rows]"
            self.worst[key] = max(self.worst.get(key, 0.0), _err(out, ref))
            return out

        return call


def test_demo_v41_each_op_matches_reference():
    ops = DualOps()
    model = _model(ops)
    ids = Tokenizer.from_dir(DEMO).encode(PROMPT)
    st = _gpu_state(model)
    nxt = [ids]
    for _ in range(6):
        logits = model.forward([st], nxt)[0]
        nxt = [[int(np.argmax(logits))]]
    for k, v in sorted(ops.worst.items()):
        print(f"{k:32s} {v:.2e}")
    bad = {k: v for k, v in ops.worst.items()
           if v > (1e-2 if k.startswith(("linear", "grouped", "swiglu", "moe", "route")) and ">8" in k else 1e-4)}
    assert not bad, bad


def test_cuda_graphs_replay_equals_eager():
    """Decode steps replayed as CUDA graphs (engine/ops/gpu/graphs.py) give bit-identical
    logits and state to the same kernels launched one by one; three sequences at different
    positions, so batch rows, windows and compressed entries all differ."""
    tok = Tokenizer.from_dir(DEMO)
    prompts = [tok.encode(PROMPT), tok.encode("Hello, world."), tok.encode(PROMPT * 2)]
    runs = {}
    for graphs in (False, True):
        ops = CupyOps(Settings(cuda_graphs=graphs))
        model = _model(ops)
        states = [_gpu_state(model) for _ in prompts]
        first = model.forward(states, prompts)
        nxt = [[int(np.argmax(lg))] for lg in first]
        out = []
        for _ in range(12):
            logits = model.forward(states, nxt)
            out.append(np.stack(logits))
            nxt = [[int(np.argmax(lg))] for lg in logits]
        runs[graphs] = (np.stack(out), [s.to_bytes() for s in states], ops.graphs)
    eager, graphed = runs[False], runs[True]
    # (a decode step is one graph: replayed for at least half of the 12 steps)
    steps = [sig for sig in graphed[2]._graphs if sig[0][0][0] == "decode"]
    assert steps and graphed[2].replays >= 6
    assert eager[2].captures == 0
    assert np.array_equal(eager[0], graphed[0])
    assert eager[1] == graphed[1]


def test_flash_shaped_4_layers_logits(tmp_path):
    """Full V4.1-Flash widths (hidden 5120, 64 x 512 heads, q_lora 1280, 8 output groups, expert
    width 2304, index 32 x 128, window 128), 4 layers, 8 experts (not 384: the numpy reference
    dequantizes every expert to float32), small vocab: GPU vs numpy logits over a 24-token
    prefill and 6 decode steps. Unrounded state: summation order only; FP8/FP4 state: loose."""
    from engine.checkpoint.tiny_model import PRESETS, write_tiny_model

    sizes = {k: v for k, v in PRESETS["v41-flash-shaped"].items() if k != "arch"}
    sizes.update(layers=4, experts=8, vocab=4096, engram_vocab=1024)
    ckpt = write_tiny_model(tmp_path / "flash4", "v41", seed=5, **sizes)
    cfg = load_config(ckpt)
    ids = list(np.random.default_rng(0).integers(10, cfg.vocab_size, 24))
    models = [Model(cfg, Checkpoint(ckpt, block_size=cfg.weight_block_size), ops, ckpt / "tokenizer.json")
              for ops in (NumpyOps(), CupyOps())]
    for quantized, tol in ((False, 1e-3), (True, 2e-2)):
        for m in models:
            m.store_quantized = quantized
        states = [models[0].new_state(), _gpu_state(models[1])]
        logits = [m.forward([s], [ids])[0] for m, s in zip(models, states, strict=True)]
        errs = []
        for step in range(7):
            errs.append(float(np.abs(logits[1] - logits[0]).max() / np.abs(logits[0]).max()))
            if step == 6:
                break
            nxt = int(np.argmax(logits[0]))
            logits = [m.forward([s], [[nxt]])[0] for m, s in zip(models, states, strict=True)]
        print("flash-shaped 4 layers, "
              f"{'FP8/FP4' if quantized else 'unrounded'} state: logit errors "
              + " ".join(f"{e:.1e}" for e in errs))
        assert np.median(errs) < tol


def test_v4_tiny_checkpoint_matches_numpy_and_graphs_are_exact(tmp_path):
    """V4 (CSA with its own indexer, HCA, hash-routed first layer, hc_head) on the GPU: logits vs
    the numpy reference over a prefill and 12 greedy decode steps, and decode with CUDA graphs
    bit-identical to eager kernels."""
    from engine.checkpoint.tiny_model import write_tiny_model

    ckpt = write_tiny_model(tmp_path / "v4", "v4", seed=11)
    cfg = load_config(ckpt)
    ids = list(np.random.default_rng(1).integers(3, cfg.vocab_size, 40))
    runs = []
    for ops in (NumpyOps(), CupyOps(Settings(cuda_graphs=False)), CupyOps(Settings(cuda_graphs=True))):
        m = Model(cfg, Checkpoint(ckpt, block_size=cfg.weight_block_size), ops, ckpt / "tokenizer.json")
        st = m.new_state() if ops.name == "numpy" else _gpu_state(m)
        out = [m.forward([st], [ids])[0]]
        for t in ids[:12]:  # teacher-forced decode
            out.append(m.forward([st], [[t]])[0])
        runs.append(np.stack(out))
    ref, eager, graphed = runs
    err = float(np.abs(eager - ref).max() / np.abs(ref).max())
    print(f"tiny V4 on the GPU vs numpy: worst relative logit error {err:.2e}")
    assert err < 1e-3
    assert np.array_equal(eager, graphed)


def test_cuda_graph_buckets_are_bounded_and_eviction_is_safe():
    """With room for 2 batch sizes, decoding at batch sizes 1, 2, 3 in turn keeps evicting the
    least recently used one; logits stay bit-identical to eager kernels."""
    tok = Tokenizer.from_dir(DEMO)
    prompts = [tok.encode(PROMPT), tok.encode("Hello, world."), tok.encode("Count to ten:")]
    runs = {}
    for graphs in (False, True):
        ops = CupyOps(Settings(cuda_graphs=graphs))
        ops.graphs.max_buckets = 2
        model = _model(ops)
        states = [_gpu_state(model) for _ in prompts]
        nxt = [[int(np.argmax(lg))] for lg in model.forward(states, prompts)]
        out = []
        for step in range(18):
            b = 1 + step % 3
            logits = model.forward(states[:b], nxt[:b])
            out.append(np.stack(logits))
            nxt[:b] = [[int(np.argmax(lg))] for lg in logits]
        runs[graphs] = (out, ops.graphs)
    assert runs[True][1].evictions > 0 and runs[True][1].replays > 0
    assert len(runs[True][1]._buckets) <= 2
    assert all(np.array_equal(a, b) for a, b in zip(runs[False][0], runs[True][0], strict=True))


def test_decode_rows_beside_prompt_chunks_match_numpy():
    """A step mixing one-token sequences (the batched decode path, staged tables) with a prompt
    fed in chunks (the chunk path), as the scheduler runs them: GPU logits equal the numpy
    reference's, with unrounded state (summation order only)."""
    tok = Tokenizer.from_dir(DEMO)
    seqs = [tok.encode(PROMPT * 2), tok.encode("Hello, world. " * 6), tok.encode(PROMPT)]
    models = [_model(NumpyOps(), store_quantized=False), _model(CupyOps(), store_quantized=False)]
    states = [[models[0].new_state() for _ in seqs], [_gpu_state(models[1]) for _ in seqs]]
    for m, sts in zip(models, states, strict=True):
        m.forward([sts[0]], [seqs[0][:20]])
    pos, step, worst, mixed = [20, 0, 0], [1, 9, 1], 0.0, 0
    while any(p < len(x) for p, x in zip(pos, seqs, strict=True)):
        live = [i for i in range(3) if pos[i] < len(seqs[i])]
        chunks = [seqs[i][pos[i]:pos[i] + step[i]] for i in live]
        mixed += len({len(c) == 1 for c in chunks}) == 2
        out = [m.forward([sts[i] for i in live], chunks) for m, sts in zip(models, states, strict=True)]
        for r, g in zip(*out, strict=True):
            worst = max(worst, float(np.abs(g - r).max() / np.abs(r).max()))
        for j, i in enumerate(live):
            pos[i] += len(chunks[j])
    print(f"decode rows beside prompt chunks: {mixed} mixed steps, worst relative logit error {worst:.2e}")
    assert mixed >= 3 and worst < 1e-4
