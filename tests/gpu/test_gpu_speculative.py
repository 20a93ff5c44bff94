"""DSpark speculative decoding on CupyOps, models/demo-v41 (its trained draft layers).

- A verify step (ModelRunner.forward(verify=True): [last token, drafts] as decode rows of one
  decode step) gives each row the logits of the plain decode step at its position, and after
  the cut the state of plain decoding, byte for byte. Its rows run in the same kernels as one-row
  steps, and those compute each row alone, so equality is exact (checked, not assumed: a kernel
  whose rows depended on the batch would fail here).
- The verify step replays as a CUDA graph, its target inputs among the graph's outputs.
- The draft on the GPU equals the numpy draft (logits within LOGIT_TOL, tokens equal).
- The draft windows absorbed for a batch of sequences at once equal numpy's and per-sequence
  absorb's (within WINDOW_TOL).
- Greedy output with and without speculation is identical, token for token.
Skipped where CuPy or a GPU is absent (CI).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gpu_required import require_gpu

cp = require_gpu()

from engine.runtime.engine import Engine  # noqa: E402
from engine.runtime.sampling import SamplingParams  # noqa: E402
from engine.runtime.spec_decode import SpecStats, feed  # noqa: E402
from engine.settings import Settings  # noqa: E402
from engine.state import trial as trials  # noqa: E402
from engine.state.draft import DraftState  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-v41"
LOGIT_TOL = 1e-3  # GPU vs numpy draft logits (relative to the largest): summation order only
WINDOW_TOL = 1e-2  # GPU vs numpy windows (relative norm): summation order, the odd FP8 grid step apart
PROMPTS = ("def mean(xs):\n", "The capital of France is", "import numpy as np\n\nclass Stack:\n    def push(self, x):")


def _engine(gpu: bool) -> Engine:
    # (exact numerics: GPU and numpy then differ by summation order only, what LOGIT_TOL allows)
    return Engine.load(DEMO, gpus=[0] if gpu else None, settings=Settings(numerics="exact"))


def _ids(eng: Engine, text: str) -> list[int]:
    return eng.tokenizer.encode(text)


def test_verify_rows_are_plain_decode_steps_and_graphed():
    eng = _engine(True)
    model = eng.model
    prompt = _ids(eng, PROMPTS[2])
    block = [int(t) for t in np.random.default_rng(0).integers(100, 1000, 6)]

    def before():
        st = model.new_state()
        model.forward([st], [prompt])
        return st

    plain = before()
    want = np.stack([model.forward([plain], [[t]])[0] for t in block])
    for m in (1, 3, 6):
        for _ in range(3):  # eager, captured, replayed
            st, targets = before(), model.model.dspark.targets
            tr = trials.begin(st)
            rows = model.forward([st], [block], all_logits=True, verify=True, targets=targets)[0]
            assert all(v is not None and v.shape[0] == 6 for v in targets.values())
            np.testing.assert_array_equal(rows, want)
            trials.cut(st, tr, m)
        ref = before()
        for t in block[:m]:
            model.forward([ref], [[t]])
        assert st.to_bytes() == ref.to_bytes(), f"m={m}"
    graphs = model.ops.graphs
    assert any(isinstance(k[0], tuple) and k[0][0] == "decode" and k[0][3] for k, _ in graphs.captured(6)), \
        "the verify step was not captured"


def test_gpu_draft_matches_numpy():
    ref, gpu = _engine(False), _engine(True)
    worst = 0.0
    for text in PROMPTS:
        drafts = []
        for eng in (ref, gpu):
            dsp, st = eng.model.model.dspark, eng.model.new_state()
            ds = dsp.new_state()
            logits = feed(eng.model, dsp, st, ds, _ids(ref, text), all_logits=False)
            d = dsp.draft(ds, int(np.argmax(np.asarray(logits))))
            drafts.append((np.asarray(d.tokens), np.asarray(eng.model.ops.to_host(d.logits)),
                           np.asarray(eng.model.ops.to_host(d.confidence))))
        (rt, rl, rc), (gt, gl, gc) = drafts
        err = float(np.abs(gl - rl).max() / np.abs(rl).max())
        worst = max(worst, err)
        assert err < LOGIT_TOL, f"{text!r}: draft logits differ by {err:.2e}"
        np.testing.assert_allclose(gc, rc, rtol=0, atol=LOGIT_TOL * np.abs(rc).max())
        np.testing.assert_array_equal(gt, rt)
    print(f"GPU vs numpy draft: worst logit difference {worst:.2e}")


def test_batched_absorb_matches_numpy_and_per_sequence_absorb():
    """absorb_kept of 8 sequences at once on the GPU (one gather per target layer, one main_x and
    window_rows per draft layer for all, the windows grown by one copy_rows launch, whole windows
    among its copies) against numpy's absorb_kept and per-sequence absorb on the GPU, over three
    verify steps from windows empty, part-full and full: positions and shapes equal, rows within
    WINDOW_TOL."""
    ref, gpu = _engine(False), _engine(True)
    dr, dg = ref.model.model.dspark, gpu.model.model.dspark
    rng = np.random.default_rng(0)
    win, d = dr.cfg.sliding_window, dr.cfg.head_dim
    states = [DraftState(f + 3, [rng.standard_normal((f, d)).astype(np.float32) for _ in dr.layers])
              for f in (0, 1, win - 1, win, 5, win, win, 2)]
    batched = [DraftState(s.position, [cp.asarray(w) for w in s.windows]) for s in states]
    alone = [DraftState(s.position, [cp.asarray(w) for w in s.windows]) for s in states]
    for _ in range(3):
        lengths = [int(n) for n in rng.integers(1, dr.block_size + 2, len(states))]
        keeps = [int(rng.integers(1, n + 1)) for n in lengths]
        targets = {i: rng.standard_normal((sum(lengths), dr.cfg.hidden_size)).astype(np.float32)
                   for i in dr.target_layer_ids}
        dr.absorb_kept(states, targets, lengths, keeps)
        dg.absorb_kept(batched, {i: cp.asarray(x) for i, x in targets.items()}, lengths, keeps)
        starts = np.cumsum([0, *lengths])
        for b, k in enumerate(keeps):
            dg.absorb(alone[b], {i: cp.asarray(x[starts[b] : starts[b] + k]) for i, x in targets.items()}, k)
    worst = 0.0
    for s, g, a in zip(states, batched, alone, strict=True):
        assert g.position == a.position == s.position
        for w, gw, aw in zip(s.windows, g.windows, a.windows, strict=True):
            assert gw.shape == aw.shape == w.shape
            for x in (gw, aw):
                worst = max(worst, float(np.linalg.norm(cp.asnumpy(x) - w) / max(np.linalg.norm(w), 1e-30)))
    assert worst < WINDOW_TOL, worst
    print(f"GPU vs numpy absorbed windows: worst relative difference {worst:.2e}")


def test_speculative_greedy_equals_plain_on_gpu():
    eng = _engine(True)
    greedy = SamplingParams(temperature=0.0)
    total = SpecStats()
    for text in PROMPTS:
        ids = _ids(eng, text)
        plain = eng.generate(ids, 96, greedy, speculative=False)
        spec = eng.generate(ids, 96, greedy, speculative=True)
        assert spec == plain, text
        total.lengths += eng.last_acceptance.lengths
    print(f"GPU speculative greedy: {sum(total.lengths)} tokens in {total.steps} verify steps, "
          f"acceptance {total.tokens_per_step:.2f} tokens/step")
    assert total.tokens_per_step > 1.5


def _batched_greedy(eng: Engine, texts: list[str], limit: int) -> list[tuple[list[int], SpecStats]]:
    """The texts' sequences speculating together, greedily, up to `limit` tokens each: one draft
    forward and one verify step a step for all live sequences. Each sequence's tokens and stats."""
    from engine.runtime.spec_decode import SpecJob, speculative_steps

    model, dsp = eng.model, eng.model.model.dspark
    greedy = SamplingParams(temperature=0.0)
    seqs = []
    for text in texts:
        st, ds = model.new_state(), dsp.new_state()
        first = int(np.argmax(feed(model, dsp, st, ds, _ids(eng, text), all_logits=False)))
        seqs.append((st, ds, [first], SpecStats()))
    while live := [s for s in seqs if len(s[2]) < limit]:
        jobs = [SpecJob(st, ds, out, limit - len(out), greedy, (), np.random.default_rng(0), stats)
                for st, ds, out, stats in live]
        for s, toks in zip(live, speculative_steps(model, dsp, jobs), strict=True):
            s[2].extend(toks)
    return [(out, stats) for _, _, out, stats in seqs]


def _plain_greedy(eng: Engine, text: str, limit: int) -> list[int]:
    return eng.generate(_ids(eng, text), limit, SamplingParams(temperature=0.0), stop_at_eos=False,
                        speculative=False)


def test_batched_speculative_steps_equal_plain_greedy_on_gpu():
    """Three sequences speculating together (one draft forward, one graphed verify step a step)
    emit plain greedy decoding's tokens."""
    eng = _engine(True)
    for text, (out, stats) in zip(PROMPTS, _batched_greedy(eng, list(PROMPTS), 64), strict=True):
        assert out == _plain_greedy(eng, text, 64), text
        assert stats.tokens_per_step > 1.0


def test_verify_steps_above_64_rows_replay_as_graphs():
    """Sixteen sequences speculating together (verify steps of 16 x 6 = 96 rows, as the server's
    16 concurrent streams run): the verify step is captured at its row count and the output is
    plain greedy decoding's."""
    eng = _engine(True)
    texts = [f"{PROMPTS[i % len(PROMPTS)]}{' ' * (i // len(PROMPTS))}" for i in range(16)]
    got = _batched_greedy(eng, texts, 24)
    assert any(isinstance(k[0], tuple) and k[0][0] == "decode" and k[0][3]
               for k, _ in eng.model.ops.graphs.captured(96)), "the 96-row verify step was not captured"
    for text, (out, _) in zip(texts, got, strict=True):
        assert out == _plain_greedy(eng, text, 24), text


def test_draft_layers_replay_as_a_graph():
    """Once every window is full, the draft's layers run as a CUDA graph (eager, captured, then
    replayed), and its blocks equal the eager draft's bit for bit."""
    eng = _engine(True)
    model, dsp = eng.model, eng.model.model.dspark
    win = dsp.cfg.sliding_window
    drafts = []
    for n in (win + 3, win + 40):
        st, ds = model.new_state(), dsp.new_state()
        feed(model, dsp, st, ds, [10 + i % 500 for i in range(n)], all_logits=False)
        drafts.append(ds)
    region, dsp.region = dsp.region, None
    want = dsp.draft_many(drafts, [5, 6])
    dsp.region = region
    for _ in range(3):
        got = dsp.draft_many(drafts, [5, 6])
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g.tokens, w.tokens)
            np.testing.assert_array_equal(cp.asnumpy(g.logits), cp.asnumpy(w.logits))
            np.testing.assert_array_equal(cp.asnumpy(g.confidence), cp.asnumpy(w.confidence))
    keys = [k for k, _ in model.ops.graphs.captured(2 * dsp.block_size)]
    assert any(k[0] == "draft" for k in keys), keys


def test_sampled_and_constrained_speculation_on_gpu():
    """Sampled requests draw their drafts from the draft's distribution and verify them against
    the main model's on the device (ops.draw_drafts, ops.verify_rows): seeded runs repeat exactly.
    A constrained request drafts within its grammar on the GPU and emits what plain constrained
    decoding emits."""
    eng = _engine(True)
    ids = _ids(eng, PROMPTS[0])
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    first = eng.generate(ids, 64, params, speculative=True)
    stats = eng.last_acceptance
    assert eng.generate(ids, 64, params, speculative=True) == first
    assert len(first) == 64 or first[-1] in eng.eos_ids
    assert stats.steps and stats.tokens_per_step > 1.0
    print(f"GPU sampled speculation: acceptance {stats.tokens_per_step:.2f} tokens/step")
