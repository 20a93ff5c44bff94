"""Speculative decoding with the DSpark draft (engine/runtime/spec_decode.py) on the numpy engine:
greedy output identical to plain decoding token for token, the state after it identical byte for
byte to plain decoding's at the same position, max_tokens and EOS ending inside a block, seeded
sampled runs reproducible, and `dsuf.py run --speculative`.

Random draft layers rarely agree with a random main model, so the tests that need accepted drafts
give the draft a Markov head that always proposes one token X (the real draft forward, weights
edited in memory) and steer the main model to X with logit_bias: every draft is then kept.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint.tiny_model import write_tiny_model
from engine.runtime.engine import Engine
from engine.runtime.sampling import SamplingParams
from tests.unit.spec_drafts import proposing

REPO = Path(__file__).resolve().parents[2]
# small enough to run hundreds of steps in seconds; window 8 and ratio-2 / ratio-1 KV groups, top-4
# sparse selection, so the prompts below wrap windows, close compressor groups and select entries
SIZES = dict(layers=4, hidden=128, heads=2, head_dim=64, q_lora=64, o_lora=64, moe_inter=64, experts=4,
             vocab=1024, window=8, index_topk=4, index_heads=4, index_head_dim=32, candidate_blocks=2,
             engram_vocab=200, markov_rank=16, draft_layers=2, draft_experts=4)
PROMPT_LENGTHS = (3, 21, 45)  # shorter than the window, past it and past several groups, past top-k
X = 777  # the token the agreeing draft proposes


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed + n).integers(10, 1000, size=n)]


@pytest.fixture(scope="module", params=[11, 12])
def ckpt(request, tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(f"spec{request.param}"), "v41", seed=request.param,
                            draft=True, **SIZES)


@pytest.fixture(scope="module")
def engine(ckpt) -> Engine:
    eng = Engine.load(ckpt)
    assert eng.config.has_draft and eng.config.dspark_block_size == 5
    return eng


@pytest.fixture()
def agreeing(ckpt) -> Engine:
    return proposing(ckpt, X)


def _run(eng: Engine, prompt: list[int], n: int, params: SamplingParams | None = None,
         speculative: bool = False, stop_at_eos: bool = True) -> tuple[list[int], bytes]:
    st = eng.new_state()
    out = eng.generate(prompt, n, params, stop_at_eos=stop_at_eos, state=st, speculative=speculative)
    return out, st.to_bytes()


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_greedy_speculative_equals_plain(engine, length) -> None:
    prompt, n = _prompt(length), 96 if length != 21 else 256
    plain, plain_state = _run(engine, prompt, n, stop_at_eos=False)
    spec, spec_state = _run(engine, prompt, n, speculative=True, stop_at_eos=False)
    assert spec == plain
    assert spec_state == plain_state  # the same position: prompt + every emitted token but the last
    acc = engine.last_acceptance
    assert acc is not None and sum(acc.lengths) == n - 1 and acc.drafted > 0
    assert acc.tokens_per_step == (n - 1) / acc.steps


@pytest.mark.parametrize("length", (3, 45))
def test_greedy_speculative_equals_plain_under_deepseek_numerics(ckpt, length) -> None:
    """The same under --numerics deepseek (bf16 activations, FP8 activation quantization per row:
    a verify row still computes exactly what the plain decode step at its position does)."""
    from engine.settings import Settings

    eng = Engine.load(ckpt, settings=Settings(numerics="deepseek"))
    prompt = _prompt(length, seed=5)
    plain, plain_state = _run(eng, prompt, 64, stop_at_eos=False)
    spec, spec_state = _run(eng, prompt, 64, speculative=True, stop_at_eos=False)
    assert spec == plain
    assert spec_state == plain_state
    assert eng.last_acceptance.drafted > 0


def test_default_is_speculative_where_the_checkpoint_has_a_draft(engine) -> None:
    prompt = _prompt(5)
    out = engine.generate(prompt, 12, stop_at_eos=False)
    assert engine.last_acceptance is not None and engine.last_acceptance.steps > 0
    assert out == engine.generate(prompt, 12, stop_at_eos=False, speculative=False)
    assert engine.last_acceptance is None


def test_an_agreeing_draft_keeps_every_block_and_the_state_matches(agreeing) -> None:
    params = SamplingParams(temperature=0.0, logit_bias=((X, 100.0),))
    prompt = _prompt(21)
    for n in (1, 2, 7, 9, 40):  # 7 = the prompt's token + one whole block + bonus; others end mid-block
        plain, plain_state = _run(agreeing, prompt, n, params)
        spec, spec_state = _run(agreeing, prompt, n, params, speculative=True)
        assert spec == plain == [X] * n
        assert spec_state == plain_state, n
        acc = agreeing.last_acceptance
        assert acc.accepted == acc.drafted == n - 1 - acc.steps  # every draft kept: k + 1 tokens a step
        assert max(acc.lengths, default=1) <= agreeing.config.dspark_block_size + 1
    assert agreeing.last_acceptance.tokens_per_step > 5.0


def test_eos_inside_a_block_and_penalties_across_kept_drafts(agreeing) -> None:
    """X is steered up and EOS just below it; each X emitted costs X one frequency penalty, so EOS
    wins after a few X's, in the middle of a block of drafted X's."""
    eos = agreeing.eos_ids[0]
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, logit_bias=((X, 60.0), (eos, 55.5)))
    prompt = _prompt(21)
    plain, plain_state = _run(agreeing, prompt, 40, params)
    spec, spec_state = _run(agreeing, prompt, 40, params, speculative=True)
    assert spec == plain and plain[-1] == eos and 2 < len(plain) < 40
    assert spec_state == plain_state
    acc = agreeing.last_acceptance
    assert acc.accepted > 0 and sum(acc.lengths) == len(spec) - 1


def test_a_kept_draft_eos_ends_the_block(ckpt) -> None:
    """The draft proposes EOS everywhere; the main model says X first (steered), then EOS, kept as
    the block's first draft with the main model's X after it: the output stops at that EOS and the
    state holds nothing of the rows after it."""
    eng = proposing(ckpt, eos := Engine.load(ckpt).eos_ids[0])
    params = SamplingParams(temperature=0.0, frequency_penalty=4.0, logit_bias=((X, 60.0), (eos, 58.0)))
    prompt = _prompt(21)
    plain, plain_state = _run(eng, prompt, 40, params)
    spec, spec_state = _run(eng, prompt, 40, params, speculative=True)
    assert spec == plain == [X, eos]
    assert spec_state == plain_state
    assert eng.last_acceptance.lengths == [1] and eng.last_acceptance.accepted == 1


def test_seeded_sampled_speculative_runs_reproduce(engine, agreeing) -> None:
    prompt = _prompt(21)
    for eng, bias in ((engine, ()), (agreeing, ((X, 6.0),))):
        params = SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.2, seed=1234, logit_bias=bias)
        a, a_state = _run(eng, prompt, 48, params, speculative=True, stop_at_eos=False)
        b, b_state = _run(eng, prompt, 48, params, speculative=True, stop_at_eos=False)
        assert a == b and a_state == b_state and len(a) == 48
        c, _ = _run(eng, prompt, 48, SamplingParams(**{**params.__dict__, "seed": 99}), speculative=True,
                    stop_at_eos=False)
        assert c != a
    assert agreeing.last_acceptance.accepted > 0  # the drafted X passes rejection sampling at times


def test_speculative_needs_draft_layers(tmp_path) -> None:
    eng = Engine.load(write_tiny_model(tmp_path, "v41", seed=3, **SIZES))
    assert not eng.config.has_draft
    out = eng.generate(_prompt(4), 4)
    assert eng.last_acceptance is None and len(out) >= 1
    with pytest.raises(ValueError, match="draft layers"):
        eng.generate(_prompt(4), 4, speculative=True)


def test_cli_run_speculative_prints_acceptance(ckpt) -> None:
    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "dsuf.py"), "run", "--ckpt", str(ckpt), "--prompt-ids",
                               ",".join(map(str, _prompt(9))), "--print-ids", "--max-tokens", "24", *extra],
                              capture_output=True, text=True, timeout=120, cwd=REPO)

    spec, off, default = run("--speculative", "dspark"), run("--speculative", "off"), run()
    assert spec.returncode == off.returncode == default.returncode == 0, spec.stderr + off.stderr
    assert spec.stdout == off.stdout == default.stdout and spec.stdout.count(",") == 23
    for r in (spec, default):
        line = next(ln for ln in r.stderr.splitlines() if ln.startswith("acceptance "))
        assert line.split()[2] == "tokens/step" and float(line.split()[1]) >= 1.0
    assert "acceptance" not in off.stderr


def test_draft_of_each_model_kind(engine, tmp_path) -> None:
    """A runner's draft is its model's DSpark; simulated tensor parallelism gives the sharded draft;
    a checkpoint without draft layers, or the GPU tensor-parallel driver, none."""
    from engine.checkpoint.reader import Checkpoint
    from engine.ops.numpy_ops import NumpyOps
    from engine.parallel.draft import ShardedDraft
    from engine.parallel.gpu import GpuTP
    from engine.parallel.simulated import SimulatedTP
    from engine.runtime.spec_decode import draft_of

    assert draft_of(engine.model) is engine.model.model.dspark is not None
    plain = Engine.load(write_tiny_model(tmp_path / "plain", "v41", seed=3, **SIZES))
    assert draft_of(plain.model) is None
    assert not hasattr(GpuTP, "draft")
    tp = SimulatedTP(engine.config, Checkpoint(engine.ckpt_dir), NumpyOps, 2, engine.ckpt_dir / "tokenizer.json")
    assert isinstance(draft_of(tp), ShardedDraft)


@pytest.mark.parametrize("speculative", [False, True])
def test_generate_prefills_in_pieces_of_the_prefill_chunk(engine, speculative, monkeypatch) -> None:
    """Engine.generate feeds a prompt longer than prefill_chunk in pieces (as the server does, so a
    long prompt on a GPU stays inside the memory plan's workspace): no forward takes more rows than
    a piece, and the tokens and the state after them are those of the prompt fed at once."""
    prompt = _prompt(45, seed=3)
    whole = _run(engine, prompt, 24, speculative=speculative, stop_at_eos=False)
    sizes, forward = [], engine.model.forward

    def spy(states, chunks, *a, **kw):
        sizes.append(max(map(len, chunks)))
        return forward(states, chunks, *a, **kw)

    monkeypatch.setattr(engine.model, "forward", spy)
    monkeypatch.setattr(engine, "prefill_chunk", 7)  # 45 = 6 x 7 + 3
    pieces = _run(engine, prompt, 24, speculative=speculative, stop_at_eos=False)
    assert sizes[:7] == [7] * 6 + [3] and max(sizes) <= 7  # (a verify step: block + 1 = 6 rows)
    assert pieces == whole
