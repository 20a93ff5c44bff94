"""DSpark speculation under tensor parallelism (engine/parallel/draft.py over the lockstep driver,
simulated on numpy ranks: engine/parallel/simulated.py). The draft layers are split like the main
ones, so this checks the sharding of every draft part (heads, experts, the vocabulary-parallel
Markov head and head) and the driver's plumbing: greedy output equal to plain decoding on the same
ranks token for token, every rank's sequence and draft state equal byte for byte to plain
decoding's at the same position, seeded sampled runs reproducible, and the draft's logits those of
one rank up to the ranks' reordered sums.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint.reader import Checkpoint
from engine.checkpoint.tiny_model import write_tiny_model
from engine.model.config import load_config
from engine.ops.numpy_ops import NumpyOps
from engine.parallel.draft import replica
from engine.parallel.simulated import SimulatedTP
from engine.runtime.runner import ModelRunner
from engine.runtime.sampling import SamplingParams
from engine.runtime.spec_decode import SpecStats, draft_of, feed, speculative_generate

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-v41"
GREEDY = SamplingParams(temperature=0.0)


def _tp(d: Path, size: int, split: str = "ep") -> SimulatedTP:
    return SimulatedTP(load_config(d), Checkpoint(d), NumpyOps, size, d / "tokenizer.json", expert_split=split)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab - 10, size=n)]


def _plain(model, ids: list[int], n: int):
    """Greedy plain decoding: n tokens, and the state (holding every token but the last)."""
    st = model.new_state()
    out = [int(np.argmax(model.forward([st], [ids])[0]))]
    while len(out) < n:
        out.append(int(np.argmax(model.forward([st], [[out[-1]]])[0])))
    return out, st


def _plain_draft(model, ids: list[int], out: list[int]):
    """The draft state plain decoding of `out` after `ids` leaves (each row absorbed as fed)."""
    dsp = draft_of(model)
    st, ds = model.new_state(), dsp.new_state()
    feed(model, dsp, st, ds, ids, False)
    for t in out[:-1]:
        feed(model, dsp, st, ds, [t], False)
    return ds


def _same_ranks(tp: SimulatedTP, st, ds) -> None:
    """Every rank's copy of the sequence state and the draft state equal the first rank's."""
    for r in range(1, tp.size):
        assert replica(st, r).to_bytes() == st.to_bytes()
        assert replica(ds, r).position == ds.position
        for a, b in zip(replica(ds, r).windows, ds.windows, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # 8 heads in 4 output groups, 16 main and 4 draft experts: at 8 ranks every rank holds one
    # head, and half of them no draft expert
    return write_tiny_model(tmp_path_factory.mktemp("tp-draft"), arch="v41", seed=5, heads=8, o_groups=4,
                            experts=16, hidden=128, vocab=1024, layers=4, moe_inter=256, draft=True)


@pytest.mark.parametrize("size", [2, 4])
def test_demo_greedy_speculation_equals_plain_on_the_same_ranks(size: int) -> None:
    """The trained demo draft (drafts are kept): output, sequence state and draft state as plain."""
    tp = _tp(DEMO, size)
    vocab = load_config(DEMO).vocab_size
    kept = 0.0
    for n, seed in ((7, 1), (30, 2)):
        ids = _prompt(n, seed, vocab)
        want, plain_st = _plain(tp, ids, 48)
        st, stats = tp.new_state(), SpecStats()
        got = speculative_generate(tp, ids, 48, GREEDY, [], st, stats)
        assert got == want
        assert st.to_bytes() == plain_st.to_bytes()
        kept = max(kept, stats.tokens_per_step)
    assert kept > 1.2  # (drafts were kept and cut inside blocks, not only rejected)


def test_speculating_ranks_keep_equal_states_and_the_plain_draft_state() -> None:
    tp = _tp(DEMO, 2)
    ids = _prompt(25, 3, load_config(DEMO).vocab_size)
    dsp = draft_of(tp)
    st, ds = tp.new_state(), dsp.new_state()
    logits = feed(tp, dsp, st, ds, ids, False)
    out = [int(np.argmax(logits))]
    from engine.runtime.spec_decode import speculative_step

    while len(out) < 40:
        out.extend(speculative_step(tp, dsp, st, ds, out, 40 - len(out), GREEDY, [], np.random.default_rng(0),
                                    SpecStats()))
        _same_ranks(tp, st, ds)
    plain = _plain_draft(tp, ids, out)
    assert plain.position == ds.position
    for r in range(tp.size):
        for a, b in zip(replica(plain, r).windows, replica(ds, r).windows, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("size,split", [(2, "ep"), (8, "ep"), (4, "width")])
def test_random_draft_greedy_equals_plain(tiny: Path, size: int, split: str) -> None:
    """A random draft (its drafts rejected: every step cuts the verify chunk to one row) on every
    split, including ranks with no draft expert."""
    tp = _tp(tiny, size, split)
    ids = _prompt(20, 4, 1024)
    want, plain_st = _plain(tp, ids, 12)
    st = tp.new_state()
    assert speculative_generate(tp, ids, 12, GREEDY, [], st) == want
    assert st.to_bytes() == plain_st.to_bytes()


def test_sharded_draft_matches_one_rank(tiny: Path) -> None:
    """The draft's logits over 4 ranks are one rank's, up to float32 reordering of the sums (its
    window rows sit on the FP8 grid, where a reordered sum may move one element a grid step)."""
    cfg, ck = load_config(tiny), Checkpoint(tiny)
    one, tp = ModelRunner(cfg, ck, NumpyOps(), tiny / "tokenizer.json"), _tp(tiny, 4)
    ids = _prompt(30, 5, 1024)
    drafts = []
    for m in (one, tp):
        dsp = draft_of(m)
        st, ds = m.new_state(), dsp.new_state()
        feed(m, dsp, st, ds, ids, False)
        drafts.append(dsp.draft(ds, 42))
    a, b = drafts
    assert np.abs(a.logits - b.logits).max() / np.abs(a.logits).max() < 1e-3
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_seeded_sampled_speculation_repeats_under_tp() -> None:
    """Each rank draws with its own copy of the generator: the ranks agree (ShardedDraft checks)
    and a seeded run repeats."""
    tp = _tp(DEMO, 2)
    ids = _prompt(12, 6, load_config(DEMO).vocab_size)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    runs = []
    for _ in range(2):
        st = tp.new_state()
        runs.append(speculative_generate(tp, ids, 32, params, [], st, rng=np.random.default_rng(7)))
        for r in range(1, tp.size):
            assert replica(st, r).to_bytes() == st.to_bytes()
    assert runs[0] == runs[1]


def test_guided_speculation_under_tp_equals_masked_plain(tmp_path) -> None:
    """Constrained drafting (engine/runtime/spec_guided.py) reads the sharded draft's Markov head
    through the driver: greedy guided speculation emits plain masked greedy decoding's tokens."""
    import json

    from engine.runtime.constraint import GrammarSpec
    from engine.runtime.engine import Engine
    from engine.runtime.sampling import sample
    from engine.runtime.spec_decode import SpecJob, speculative_steps
    from engine.runtime.spec_guided import guided_drafter
    from tests.unit.test_spec_guided import SCHEMA, _constrainer
    from tests.unit.test_speculative_decode import SIZES

    d = write_tiny_model(tmp_path / "guided", "v41", seed=13, draft=True, **SIZES)
    eng, tp = Engine.load(d), _tp(d, 2)
    c, dsp, eos = _constrainer(eng), draft_of(tp), tuple(eng.eos_ids)
    prompt, n = _prompt(15, 7, 1000), 30

    def start():
        return c.start(GrammarSpec("json", json.dumps(SCHEMA)), False)

    tc, st, want = start(), tp.new_state(), []
    chunk = prompt
    while len(want) < n and (not want or want[-1] not in eos):
        want.append(sample(tp.forward([st], [chunk])[0], GREEDY, want, None, c.masks([tc])[0])[0])
        assert tc.advance(want[-1])
        chunk = [want[-1]]

    tc, st, ds, stats = start(), tp.new_state(), dsp.new_state(), SpecStats()
    got = [sample(feed(tp, dsp, st, ds, prompt, False), GREEDY, [], None, c.masks([tc])[0])[0]]
    assert tc.advance(got[0])
    while len(got) < n and got[-1] not in eos:
        job = SpecJob(st, ds, list(got), n - len(got), GREEDY, eos, None, stats, None, guided_drafter(tc, c, eos))
        for t in speculative_steps(tp, dsp, [job])[0]:
            got.append(t)
            assert tc.advance(t)
    assert got == want
    assert stats.accepted > 0
