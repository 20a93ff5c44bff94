"""One sequence's bad sampling parameters never fail the others of its batch: the scheduler refuses
them at admission, and if a step still raises, it retries the step's sequences one by one on
rebuilt states so only the culprit gets the error (real demo engine, real Scheduler)."""

from __future__ import annotations

import asyncio

import pytest

from engine.runtime.sampling import SamplingParams
from server.metrics import Metrics
from server.protocol import APIError, GenRequest
from server.scheduler import Scheduler

PROMPTS = [[0, 100, 200, 300, 400], [0, 7, 8, 9], [0, 1234, 55, 66, 77, 88]]
MAX_TOKENS = 6
N = [1, 1, 2]  # the last prompt's two choices fork one prefilled state
BAD = SamplingParams(temperature=0.0, logit_bias=((1 << 70, 5.0),))  # past int64: numpy raises


class Unchecked(Scheduler):
    """Lets parameters through admission, so they reach the shared engine step."""

    def params_problem(self, p: SamplingParams) -> str | None:
        return None


def _gen(params: SamplingParams, n: int = 1, max_tokens: int = MAX_TOKENS) -> GenRequest:
    return GenRequest(kind="completion", model="m", n=n, max_tokens=max_tokens, sampling=params, stop=[],
                      stream=False, ignore_eos=True)


def _scheduler(engine, cls=Scheduler, **kw) -> Scheduler:
    metrics = Metrics()
    sched = cls(engine, metrics, **kw)
    metrics.bind("m", sched, engine, context_len=engine.context_length)  # as the server does on attach
    return sched


async def _run(engine, sched_cls, bad_at: int | None, bad_from_step: int = 0, speculative: str = "off",
               max_tokens: int = MAX_TOKENS):
    sched = _scheduler(engine, sched_cls, max_batch=8, max_queue=8, prefill_chunk=64, speculative=speculative)
    sched.start()
    sinks, seqs, firsts = [], [], []
    for i, prompt in enumerate(PROMPTS):
        sink: asyncio.Queue = asyncio.Queue()
        gen = _gen(BAD if i == bad_at and not bad_from_step else SamplingParams(temperature=0.0), n=N[i],
                   max_tokens=max_tokens)
        firsts.append(len(seqs))
        seqs += sched.new_sequences(gen, prompt, max_tokens, sink)
        sinks.append(sink)
    sched.submit(seqs)  # one submit: they all share every step
    if bad_from_step:  # the culprit turns bad mid-decode, so the others' states have moved on
        culprit = seqs[firsts[bad_at]]
        while len(culprit.generated) < bad_from_step:
            await asyncio.sleep(0.001)
        culprit.params = BAD
    out = []  # per prompt, per choice: (tokens, error)
    for i, sink in enumerate(sinks):
        toks: dict[int, list[int]] = {c: [] for c in range(N[i])}
        errs: dict[int, str | None] = {}
        while len(errs) < N[i]:
            ev = await asyncio.wait_for(sink.get(), 60)
            toks[ev.index] += ev.token_ids
            if ev.error is not None or ev.finish_reason is not None:
                errs[ev.index] = ev.error
        out.append([(toks[c], errs[c]) for c in range(N[i])])
    await sched.stop()
    return out


def _reference(engine, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return [engine.generate(p, max_tokens, SamplingParams(temperature=0.0), stop_at_eos=False, speculative=False)
            for p in PROMPTS]


def test_admission_refuses_parameters_the_engine_cannot_take(engine):
    async def go():
        sched = _scheduler(engine)
        seqs = sched.new_sequences(_gen(BAD), PROMPTS[0], MAX_TOKENS, asyncio.Queue())
        with pytest.raises(APIError) as e:
            sched.submit(seqs)
        assert e.value.status == 400 and not sched.waiting

    asyncio.run(go())


@pytest.mark.parametrize("bad_at,bad_from_step", [(1, 0), (1, 3), (2, 3)],
                         ids=["from-prefill", "mid-decode", "one-choice-of-two-mid-decode"])
def test_a_raising_sequence_fails_alone(engine, bad_at, bad_from_step):
    ref = _reference(engine)
    got = asyncio.run(_run(engine, Unchecked, bad_at=bad_at, bad_from_step=bad_from_step))
    for i, choices in enumerate(got):
        for c, (toks, err) in enumerate(choices):
            if i == bad_at and (c == 0 or not bad_from_step):  # mid-decode: only choice 0 turns bad
                assert err is not None and "engine error" in err, got
            else:
                assert err is None and toks == ref[i], (i, toks, ref[i])
    # and the scheduler keeps serving: a clean run afterwards matches too
    again = asyncio.run(_run(engine, Unchecked, bad_at=None))
    assert again == [[(ref[i], None)] * N[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("bad_at,bad_from_step", [(1, 0), (1, 1), (2, 1)],
                         ids=["from-prefill", "mid-decode", "one-choice-of-two-mid-decode"])
def test_a_raising_speculating_sequence_fails_alone(engine, bad_at, bad_from_step):
    """The same with the demo's draft speculating: a failed verify step is retried sequence by
    sequence; the others keep plain decoding's tokens. (A verify step emits several tokens, so
    the culprit turns bad after its first and has many more to go.)"""
    ref = _reference(engine, 48)
    got = asyncio.run(_run(engine, Unchecked, bad_at=bad_at, bad_from_step=bad_from_step, speculative="dspark",
                           max_tokens=48))
    for i, choices in enumerate(got):
        for c, (toks, err) in enumerate(choices):
            if i == bad_at and (c == 0 or not bad_from_step):
                assert err is not None and "engine error" in err, got
            else:
                assert err is None and toks == ref[i], (i, toks, ref[i])
    again = asyncio.run(_run(engine, Unchecked, bad_at=None, speculative="dspark", max_tokens=48))
    assert again == [[(ref[i], None)] * N[i] for i in range(len(PROMPTS))]


def test_prefill_budget_is_the_engines_unless_given(engine, monkeypatch) -> None:
    """The scheduler's per-step prompt budget: --prefill-chunk where given, else the engine's own
    (Engine.prefill_chunk: 512 on the numpy backend, the memory plan's on GPUs)."""
    assert engine.prefill_chunk == 512
    assert _scheduler(engine).prefill_chunk == 512
    assert _scheduler(engine, prefill_chunk=64).prefill_chunk == 64
    monkeypatch.setattr(engine, "prefill_chunk", 8192)
    assert _scheduler(engine).prefill_chunk == 8192
