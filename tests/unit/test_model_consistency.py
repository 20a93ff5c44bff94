"""The forward pass is chunking-, batching- and serialization-invariant, for both architectures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint.reader import Checkpoint
from engine.model.config import load_config
from engine.ops.deepseek_ops import DeepseekOps
from engine.ops.numpy_ops import NumpyOps
from engine.runtime.runner import ModelRunner as Model
from engine.state.sequence import _ARRAY_FIELDS, SequenceState, StateError

REPO = Path(__file__).resolve().parents[2]
DEMO_V41 = REPO / "models" / "demo-v41"
DEMO_V4 = REPO.parent / "shared" / "models" / "demo-v4"

# The numpy reference is chunking- and batch-invariant bit for bit: every row's reductions run over
# the same elements in the same order whatever else shares the call (see NumpyOps.linear/attention).


def _model(path: Path, ops=None) -> Model:
    if not path.is_dir():
        pytest.skip(f"{path} not present")
    cfg = load_config(path)
    return Model(cfg, Checkpoint(path, block_size=cfg.weight_block_size), ops or NumpyOps(), path / "tokenizer.json")


@pytest.fixture(scope="module", params=["v41", "v4", "tiny-fp8-v41", "tiny-fp8-v4", "tiny-8layers-v41",
                                        "v41+deepseek", "tiny-fp8-v41+deepseek"])
def model(request, tmp_path_factory) -> Model:
    """The trained demo models (bf16), and random checkpoints in DeepSeek's shipped formats
    (FP8 block-scaled linears, FP4 experts, FP8 Engram rows) from `dsuf.py tiny-model`; with 8
    layers, each KV group has two layers that only read it (a decode step's plans shared).
    +deepseek: in DeepSeek's numerics (engine/ops/deepseek_ops.py), invariant in the same way."""
    param, _, numerics = request.param.partition("+")
    ops = DeepseekOps() if numerics == "deepseek" else None
    if param.startswith("tiny"):
        from engine.checkpoint.tiny_model import write_tiny_model

        arch = param.split("-")[-1]
        layers = {"layers": 8} if "8layers" in param else {}
        return _model(write_tiny_model(tmp_path_factory.mktemp(param), arch=arch, seed=3, **layers), ops)
    return _model(DEMO_V41 if param == "v41" else DEMO_V4, ops)


def _ids(m: Model, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, m.cfg.vocab_size, size=n).tolist()


def _close(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(a, b)


# long enough to wrap the sliding window (64) and emit many compressed entries
N = 150


def test_prefill_chunked_and_decode_agree(model: Model) -> None:
    ids = _ids(model, N)
    full = model.forward([model.new_state()], [ids], all_logits=True)[0]
    st = model.new_state()
    chunks = [ids[:1], ids[1:8], ids[8:37], ids[37:64], ids[64:65], ids[65:130], ids[130:]]
    chunked = np.concatenate([model.forward([st], [c], all_logits=True)[0] for c in chunks])
    _close(chunked, full)
    st = model.new_state()
    one_by_one = np.stack([model.forward([st], [[t]])[0] for t in ids])
    _close(one_by_one, full)
    assert st.position == N


def test_batch_of_sequences_at_different_positions(model: Model) -> None:
    a, b, c = _ids(model, 90, 1), _ids(model, 40, 2), _ids(model, 7, 3)
    alone = [model.forward([model.new_state()], [x], all_logits=True)[0] for x in (a, b, c)]
    sa, sb, sc = model.new_state(), model.new_state(), model.new_state()
    # a and b start with a shared step, then continue in one batch at different positions
    first = model.forward([sa, sb], [a[:50], b[:13]], all_logits=True)
    second = model.forward([sb, sa, sc], [b[13:], a[50:], c], all_logits=True)
    _close(np.concatenate([first[0], second[1]]), alone[0])
    _close(np.concatenate([first[1], second[0]]), alone[1])
    _close(second[2], alone[2])


def test_decode_batch_at_different_positions(model: Model) -> None:
    """Sequences decoding together, one token each per forward (V4.1's batched decode path), at
    different positions and compressor phases, finishing at different steps: each equals the
    sequence fed alone at once."""
    seqs = [_ids(model, n, 10 + i) for i, n in enumerate((75, 41, 9, 24))]
    alone = [model.forward([model.new_state()], [x], all_logits=True)[0] for x in seqs]
    states = [model.new_state() for _ in seqs]
    pos = [30, 11, 0, 5]  # prefilled first (none for the third: it decodes from position 0)
    got = [[model.forward([st], [x[:n]], all_logits=True)[0]] if n else []
           for st, x, n in zip(states, seqs, pos, strict=True)]
    while True:
        live = [i for i, x in enumerate(seqs) if pos[i] < len(x)]
        if not live:
            break
        out = model.forward([states[i] for i in live], [[seqs[i][pos[i]]] for i in live])
        for j, i in enumerate(live):
            got[i].append(out[j][None])
            pos[i] += 1
    for g, ref in zip(got, alone, strict=True):
        _close(np.concatenate(g), ref)


def test_decode_rows_beside_prompt_chunks(model: Model) -> None:
    """A forward mixing one-token steps (V4.1: the batched decode path) with prompt chunks (the
    chunk path), as the scheduler runs them while prompts arrive: each sequence equals itself fed
    alone at once. Positions cross compressor groups and the sliding window."""
    seqs = [_ids(model, n, 20 + i) for i, n in enumerate((70, 60, 12))]
    alone = [model.forward([model.new_state()], [x], all_logits=True)[0] for x in seqs]
    states = [model.new_state() for _ in seqs]
    got = [[model.forward([states[0]], [seqs[0][:25]], all_logits=True)[0]], [], []]
    pos = [25, 0, 0]
    step = [1, 9, 1]  # the first and third decode token by token, the second comes in chunks of 9
    while any(p < len(x) for p, x in zip(pos, seqs, strict=True)):
        live = [i for i in range(3) if pos[i] < len(seqs[i])]
        chunks = [seqs[i][pos[i]:pos[i] + step[i]] for i in live]
        out = model.forward([states[i] for i in live], chunks, all_logits=True)
        for j, i in enumerate(live):
            got[i].append(out[j])
            pos[i] += len(chunks[j])
    for g, ref in zip(got, alone, strict=True):
        _close(np.concatenate(g), ref)


def test_decode_step_launches_repeat_between_capacity_buckets() -> None:
    """A V4.1 decode step's launch signature (what keys its CUDA graph on the GPU) stays the same
    from step to step and changes only where a context crosses a capacity bucket (a power of two),
    so the step's graph is captured a few times per sequence, not once per step."""
    from engine.state.decode_plan import capacity

    m = _model(DEMO_V41)
    states = [m.new_state(), m.new_state()]
    m.forward(states, [_ids(m, 30, 1), _ids(m, 9, 2)])
    sigs = []
    real = m.ops.graphed_step

    def record(key, inputs, run, rows):
        sigs.append(inputs.signature())
        return real(key, inputs, run, rows)

    m.ops.graphed_step = record
    for t in _ids(m, 150, 3):
        m.forward(states, [[t], [t]])
    changes = sum(a != b for a, b in zip(sigs[:-1], sigs[1:], strict=True))
    # the windows (up to 128 rows) and the groups' entries cross 64, 128 and 256 at most
    assert 1 <= changes <= 8, changes
    assert len({capacity(n) for n in (1, 64)}) == 1 and capacity(65) == 128


@pytest.mark.parametrize("ngram", [3, 4])
def test_engram_decode_hashes_equal_chunk_hashes(ngram: int, tmp_path) -> None:
    """A decode step's hash (every chunk one token: its rows built directly) equals the general
    rows' hash (the same chunks beside a longer one), for histories shorter than the n-gram (the
    first tokens of a sequence) and full ones: demo-v41's 3-grams and a random checkpoint's
    4-grams."""
    if ngram == 3:
        h = _model(DEMO_V41).model.hasher
    else:
        from engine.checkpoint.tiny_model import write_tiny_model

        h = _model(write_tiny_model(tmp_path / "m", arch="v41", seed=3, engram_ngram=4)).model.hasher
    assert h.n == ngram
    rng = np.random.default_rng(7)
    hists, toks, pos = [], [], []
    for n_hist in range(h.n + 1):
        for p in {n_hist, n_hist + 40}:
            hists.append(rng.integers(0, 1000, n_hist).tolist())
            toks.append(int(rng.integers(0, 1000)))
            pos.append(p)
    chunks = [np.array([t]) for t in toks]
    ref = h([*hists, [1, 2]], [*chunks, np.array([3, 4, 5])], [*pos, 9])[: len(toks)]
    np.testing.assert_array_equal(h(hists, chunks, pos), ref)


def test_state_round_trip_continues_identically(model: Model) -> None:
    ids = _ids(model, N, 4)
    ref = model.forward([model.new_state()], [ids], all_logits=True)[0]
    st = model.new_state()
    model.forward([st], [ids[:97]])
    buf = st.to_bytes()
    restored = SequenceState.from_bytes(buf, model_key=model.model_key)
    assert restored.position == 97
    rest = model.forward([restored], [ids[97:]], all_logits=True)[0]
    _close(rest, ref[97:])
    assert st.nbytes() > 0


def test_state_buffer_rejects_corruption(model: Model) -> None:
    st = model.new_state()
    model.forward([st], [_ids(model, 20, 5)])
    buf = bytearray(st.to_bytes())
    with pytest.raises(StateError, match="model"):
        SequenceState.from_bytes(bytes(buf), model_key="other-model")
    buf[len(buf) // 2] ^= 0xFF
    with pytest.raises(StateError, match="checksum"):
        SequenceState.from_bytes(bytes(buf))
    with pytest.raises(StateError, match="truncated"):
        SequenceState.from_bytes(bytes(buf[:10]))
    with pytest.raises(StateError, match="magic"):
        SequenceState.from_bytes(b"X" * 64)


def test_bad_token_ids_are_rejected(model: Model) -> None:
    with pytest.raises(ValueError, match="out of range"):
        model.forward([model.new_state()], [[model.cfg.vocab_size]])
    with pytest.raises(ValueError, match="at least one token"):
        model.forward([model.new_state()], [[]])


def test_v41_state_is_stored_in_deepseek_formats() -> None:
    m = _model(DEMO_V41)
    st = m.new_state()
    n = 600
    m.forward([st], [_ids(m, n, 6)])
    buf = st.to_bytes()
    per_token, fixed = m.state_bytes_per_token()
    # window rows FP8 (64 + 2 B), entries FP4 (32 + 4 B), indexer keys MXFP4 (16 + 1 B)
    assert fixed == 6 * 63 * 66
    assert per_token == (36 + 17) / 2 + (36 + 17) / 1
    # every window / entry / key array was stored in its codec, not float32 (buffer ~ analytic size)
    assert len(buf) < fixed + per_token * n + 16 * 1024
    restored = SequenceState.from_bytes(buf, model_key=m.model_key)
    for a, b in zip(st.layers, restored.layers, strict=True):
        for name in ("window", "entries", "idx_keys", "buf_kv", "buf_gate"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), name


def _resident_bytes(st) -> int:
    """Bytes of the distinct memory blocks behind a state's arrays (growth buffers included)."""
    seen = {}
    for ls in st.layers:
        for name in _ARRAY_FIELDS:
            a = getattr(ls, name)
            while a is not None and a.base is not None and isinstance(a.base, np.ndarray):
                a = a.base
            if a is not None:
                seen[id(a)] = a.nbytes
    return sum(seen.values())


def test_v41_resident_state_within_the_plan_formula() -> None:
    """The memory plan's per-sequence device bytes (Model.resident_state_bytes_per_token) bound
    what a decoding sequence really holds (float32 arrays and their growth buffers), and are
    not loose: the stored size is 4-7x smaller and must not be what the GPUs are planned by."""
    m = _model(DEMO_V41)
    st = m.new_state()
    ids = _ids(m, 400, 8)
    m.forward([st], [ids[:100]])
    worst = 0.0
    per_token, fixed = m.resident_state_bytes_per_token()
    for i, t in enumerate(ids[100:], start=101):  # token by token: the growth-buffer path
        m.forward([st], [[t]])
        got, bound = _resident_bytes(st), fixed + per_token * i
        assert got <= bound, (i, got, bound)
        worst = max(worst, got / bound)
    assert worst > 0.6, worst
    stored_per_token, stored_fixed = m.state_bytes_per_token()
    assert stored_fixed + 400 * stored_per_token < 0.5 * (fixed + 400 * per_token)


def test_v41_bounded_replay_is_exact() -> None:
    """Prefill computing only the replay cone after the last KV source gives the same last-token
    logits and the same state (hence the same continuation) as computing every row."""
    m = _model(DEMO_V41)
    ids = _ids(m, 300, 7)
    assert m._replay_start() == 4  # demo: last KV source is layer 3
    st_full, st_replay = m.new_state(), m.new_state()
    m.bounded_replay = False
    full = m.forward([st_full], [ids[:250]])[0]
    m.bounded_replay = True
    replay = m.forward([st_replay], [ids[:250]])[0]
    _close(replay, full)
    for a, b in zip(st_full.layers, st_replay.layers, strict=True):
        assert np.array_equal(a.window, b.window)
    cont_full = m.forward([st_full], [ids[250:]], all_logits=True)[0]
    cont_replay = m.forward([st_replay], [ids[250:]], all_logits=True)[0]
    _close(cont_replay, cont_full)


def test_state_codecs_are_lossless_over_a_wide_range() -> None:
    """Values out of each fake-quantizer encode in its codec (not the float32 fallback) and decode
    bit-exactly, including blocks whose scale sits in e4m3's subnormal range."""
    from engine.state.sequence import FP4_E4M3_16, FP4_UE8M0_32, FP8_UE8M0_32, decode_array, encode_array

    ops, rng = NumpyOps(), np.random.default_rng(9)
    x = (rng.standard_normal((2000, 512)) * np.exp(rng.uniform(-14, 6, (2000, 1)))).astype(np.float32)
    for codec, q, size in [(FP8_UE8M0_32, ops.fake_quant_fp8(x), 512 + 16),
                           (FP4_E4M3_16, ops.fake_quant_fp4(x, 16, e4m3_scales=True), 256 + 32),
                           (FP4_UE8M0_32, ops.fake_quant_fp4(x, 32), 256 + 16)]:
        used, blob = encode_array(q, codec)
        assert used == codec and len(blob) == 2000 * size
        np.testing.assert_array_equal(decode_array(blob, q.shape, codec), q)
    for codec in (FP8_UE8M0_32, FP4_E4M3_16, FP4_UE8M0_32):  # unrounded data falls back to float32
        used, blob = encode_array(x, codec)
        assert used == 0
        np.testing.assert_array_equal(decode_array(blob, x.shape, 0), x)



class _ForkOps:
    """Mixed into a numpy backend's ops: records what the runner forks (ops.fork: a side stream
    on the GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.forked: list[str] = []

    def fork(self, fn, *args):
        self.forked.append(fn.__name__)
        return super().fork(fn, *args)


def test_forked_parts_change_nothing(model: Model) -> None:
    """The runner's forked parts (engine/runtime/runner.py FORKED: the query heads, the indexer's
    queries, each mHC site's mixes, the shared expert) go through ops.fork, for a prompt chunk and
    for decode steps alike, and the logits are those of the plain calls, bit for bit."""
    ids = _ids(model, 43)
    ops = type("ForkOps", (_ForkOps, type(model.ops)), {})()
    forked = Model(model.cfg, model.ckpt, ops, model.tokenizer_json, model.store_quantized)

    def run(m: Model) -> list:
        st = m.new_state()
        return [m.forward([st], [ids[:40]])[0]] + [m.forward([st], [[t]])[0] for t in ids[40:]]

    for g, w in zip(run(forked), run(model), strict=True):
        _close(g, w)
    cfg = model.cfg
    per_step = {"query_heads": cfg.num_layers, "hc_mixes": 2 * cfg.num_layers,
                "shared_expert": cfg.num_layers if cfg.n_shared_experts else 0,
                "queries": sum(1 for L in forked.model.layers if getattr(L.attn, "indexer", None) is not None)}
    for name, n in per_step.items():
        assert ops.forked.count(name) == 4 * n, (name, ops.forked.count(name))


def _serve(model: Model, script: list, ahead: bool = True) -> tuple[list, list[bytes]]:
    """Run a script of steps through step_sample (greedy): each step a list of (sequence name,
    prompt ids or None: its last drawn token); a name not seen before starts a new state. Returns
    every step's tokens and the states' bytes at the end. ahead=False: forward and draw without
    planning the next step ahead."""
    from engine.bench import GREEDY
    from engine.runtime.sampling import SampleJob

    rng = np.random.default_rng(0)
    states: dict = {}
    last: dict = {}
    out = []
    for step in script:
        names = [n for n, _ in step]
        for n in names:
            states.setdefault(n, model.new_state())
        chunks = [ids if ids is not None else [last[n]] for n, ids in step]
        jobs = [SampleJob(i, GREEDY, [], rng) for i in range(len(step))]
        sts = [states[n] for n in names]
        drawn = (model.step_sample(sts, chunks, jobs) if ahead else
                 model.ops.sample_rows(model.forward(sts, chunks, on_device=True), jobs))
        toks = [t for t, _, _ in drawn]
        last.update(zip(names, toks, strict=True))
        out.append(toks)
    return out, [states[n].to_bytes() for n in sorted(states)]


def test_next_step_planned_ahead_changes_nothing(model: Model) -> None:
    """Each decode step plans the next one for the same sequences while the device would still run
    (ModelRunner.prepare_next: the grown state's bookkeeping set aside, then applied at that step),
    and a step that is not that one drops it. The same tokens and the same states, byte for byte,
    as without planning ahead, through steady decoding (window blocks and entry buffers grow,
    groups pool), a sequence leaving, one joining with a prompt chunk beside decode rows, and a
    state rebuilt from its bytes."""
    if model.cfg.arch != "v41":
        pytest.skip("V4.1's decode plan")
    a, b, c = _ids(model, 20, 1), _ids(model, 7, 2), _ids(model, 11, 3)
    script = [[("a", a), ("b", b)]] + [[("a", None), ("b", None)]] * 80 + [[("a", None)]] * 5
    script += [[("a", None), ("c", c)]] + [[("a", None), ("c", None)]] * 30
    used = model.ahead_used
    want = _serve(model, script, ahead=False)
    assert model.ahead_used == used
    assert _serve(model, script) == want
    # every decode step after a decode step of the same sequences took the plan made ahead
    assert model.ahead_used - used == 79 + 4 + 29
    # a plan made ahead leaves no trace in the state (here it is stored after the step, and a copy
    # rebuilt from its bytes goes on: not the planned-for object, so the plan is dropped)
    st, twin = model.new_state(), model.new_state()
    model.forward([twin], [a])
    model.forward([twin], [[5]])
    model.forward([st], [a])
    model.step_sample([st], [[5]], [])
    assert model._next is not None and st.to_bytes() == twin.to_bytes()
    model.step_sample([SequenceState.from_bytes(st.to_bytes())], [[6]], [])
    assert model.ahead_used - used == 112
