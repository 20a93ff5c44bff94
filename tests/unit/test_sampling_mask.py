"""Token masks of constrained decoding in the numpy sampler (engine.runtime.sampling), the device
sampler's job table (engine/ops/gpu/sample_table.py, host side) and llguidance's packing."""

from __future__ import annotations

import llguidance.numpy as llg_np
import numpy as np
import pytest

from engine.ops.gpu.sample_table import JOB_MASK, JOB_WORDS, JOB_WORK, job_table, mask_words
from engine.runtime.sampling import SampleJob, SamplingParams, allowed_mask, make_rngs, sample, sample_batch, token_mask

VOCAB = 1000
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=200, top_p=0.8, min_p=0.01, presence_penalty=1.0,
                   logit_bias=((3, 100.0), (4, -50.0))),
]


def _pack(allowed: np.ndarray) -> np.ndarray:
    """Booleans -> llguidance's layout (int32 words, bit i of word w = id 32 * w + i)."""
    words = np.zeros((len(allowed) + 31) // 32, dtype=np.uint32)
    for i in np.flatnonzero(allowed):
        words[i >> 5] |= np.uint32(1 << (i & 31))
    return words.view(np.int32)


def test_token_mask_unpacks_llguidance_layout():
    g = np.random.default_rng(0)
    allowed = g.random(VOCAB) < 0.3
    m = _pack(allowed)
    assert np.array_equal(token_mask(m, VOCAB), allowed)
    # llguidance's own reference application agrees
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    llg_np.apply_token_bitmask_inplace(logits, m[None].copy())
    assert np.array_equal(np.isfinite(logits[0]), allowed)
    # ids past the mask's words are disallowed; words past the vocabulary are ignored
    assert not token_mask(m[:10], VOCAB)[320:].any()
    assert token_mask(np.full(40, -1, np.int32), VOCAB).all()


@pytest.mark.parametrize("density", [0.001, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("p", PARAMS, ids=range(len(PARAMS)))
def test_masked_draws_stay_in_the_mask(p, density):
    g = np.random.default_rng(int(density * 1000) + 7)
    for trial in range(30):
        logits = (g.standard_normal(VOCAB) * 3).astype(np.float32)
        allowed = g.random(VOCAB) < density
        allowed[g.integers(VOCAB)] = True
        gen = list(g.integers(0, VOCAB, 10))
        tok, _, _ = sample(logits, p, gen, make_rngs(trial)[0], _pack(allowed))
        assert allowed[tok], (trial, tok)


def test_masked_sample_is_the_sample_of_masked_logits():
    """A mask is -inf on the disallowed logits, before penalties, temperature and truncation:
    the same draw (same generator) as on logits already masked; logprobs stay the model's own."""
    g = np.random.default_rng(3)
    for trial, p in enumerate(PARAMS * 5):
        logits = (g.standard_normal(VOCAB) * 3).astype(np.float32)
        allowed = g.random(VOCAB) < 0.2
        masked = np.where(allowed, logits, -np.inf).astype(np.float32)
        got = sample(logits, p, [1, 2, 2], make_rngs(trial)[0], _pack(allowed))
        want = sample(masked, p, [1, 2, 2], make_rngs(trial)[0])
        assert got[0] == want[0]
        if p.greedy:
            x = logits.astype(np.float64)
            x[3] += 100 if p.logit_bias else 0
            assert got[0] == int(np.flatnonzero(allowed)[np.argmax(np.where(allowed, x, -np.inf)[allowed])])
    lp = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    logits = np.arange(VOCAB, dtype=np.float32)
    allowed = np.zeros(VOCAB, bool)
    allowed[5] = True
    tok, lpv, top = sample(logits, lp, [], make_rngs(0)[0], _pack(allowed))
    assert tok == 5 and top[0][0] == VOCAB - 1 and lpv < top[-1][1]


def test_logit_bias_cannot_lift_a_masked_token():
    logits = np.zeros(VOCAB, dtype=np.float32)
    allowed = np.zeros(VOCAB, bool)
    allowed[[10, 11]] = True
    p = SamplingParams(temperature=0.0, logit_bias=((500, 100.0),))
    assert sample(logits, p, [], make_rngs(0)[0], _pack(allowed))[0] in (10, 11)
    assert allowed_mask(np.where(allowed, 0.0, -np.inf), SamplingParams(top_k=50)).sum() == 2


def test_batch_rows_masked_and_unmasked():
    g = np.random.default_rng(9)
    logits = (g.standard_normal((4, 20000)) * 2).astype(np.float32)  # (the threaded path)
    allowed = g.random(20000) < 0.01
    jobs = [SampleJob(r, SamplingParams(temperature=1.0), [], make_rngs(r)[0], _pack(allowed) if r % 2 else None)
            for r in range(4)]
    out = sample_batch(logits, jobs)
    for r, (tok, _, _) in enumerate(out):
        assert tok == sample(logits[r], jobs[r].params, [], make_rngs(r)[0], jobs[r].mask)[0]
        if r % 2:
            assert allowed[tok]


def test_device_job_table_carries_masks():
    """Host half of the GPU path: a masked row gets a scratch row and its mask words, padded or cut
    to the vocabulary (bits past it cleared); unmasked rows keep no scratch and no mask."""
    vocab = 1000
    allowed = np.zeros(vocab, bool)
    allowed[[0, 31, 32, 999]] = True
    short = _pack(allowed)[:10]  # ids >= 320 cut away
    wide = np.concatenate([_pack(allowed), np.full(5, -1, np.int32)])
    p = SamplingParams(temperature=0.0)
    jobs = [SampleJob(0, p, [], make_rngs(0)[0]), SampleJob(1, p, [], make_rngs(0)[0], short),
            SampleJob(2, SamplingParams(logit_bias=((7, 1.0),)), [], make_rngs(0)[0], wide)]
    table, ndelta, nwork = job_table(jobs, vocab)
    head = table[:3 * JOB_WORDS].reshape(3, JOB_WORDS)
    assert ndelta == 1 and nwork == 2
    assert list(head[:, JOB_WORK]) == [-1, 0, 1] and list(head[:, JOB_MASK]) == [-1, 0, mask_words(vocab)]
    masks = table[3 * JOB_WORDS + 2 * ndelta:]
    assert masks.size == 2 * mask_words(vocab)
    first = token_mask(masks[:mask_words(vocab)], vocab)
    assert list(np.flatnonzero(first)) == [0, 31, 32]
    second = masks[mask_words(vocab):]
    assert list(np.flatnonzero(token_mask(second, 32 * second.size))) == [0, 31, 32, 999]
