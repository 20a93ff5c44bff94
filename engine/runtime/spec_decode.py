"""Speculative decoding of one sequence with the checkpoint's DSpark draft (engine/model/dspark.py),
exact: the same tokens as plain decoding for greedy requests, the same distribution for sampled
ones (the verify rule: engine/runtime/speculative.py).

A step, with the sequence's state holding every emitted token but the last, t:
- the draft proposes k = block_size tokens d_0 .. d_{k-1} after t (it reads its window state only);
- the main model runs [t, d_0 .. d_{k-1}] as k + 1 decode rows of one step on the state itself
  (ModelRunner.forward(verify=True): planned row by row, as many one-row steps would be), marked
  first (engine/state/trial.py), its logits at every row and its target layers' inputs collected;
- verify keeps d_0 .. d_{n-1} and appends the main model's own token (n + 1 tokens);
- the state is cut back to the rows [t, d_0 .. d_{n-1}] (trial.cut: the bookkeeping after its
  last kept row put back; no second forward), and the draft absorbs those rows' target inputs,
  which the verify forward already computed.
So rejected rows leave no trace (window rings, compressor groups, indexer keys, Engram look-back,
the draft's windows), and the state always equals plain decoding's at the same position: plain
decoding feeds each token at the step after it is drawn, so after its last token its state holds
the prompt and every emitted token but the last, as here. A step that ends inside its block (EOS)
keeps only the rows up to the last emitted token, for the same reason; max_tokens never ends
inside one (the block is shortened to what may still be emitted).

For a greedy request the draft takes its argmax tokens and verify weighs them as point masses
(draft_probs=None); for a sampled one it draws them with the sequence's generator from its own
distribution at the request's temperature, and verify weighs them by it (speculative sampling:
exact for any draft distribution, and a draft that samples is kept more often than its argmax
when the main model's distribution is spread out). A constrained request drafts greedily within
its grammar (engine/runtime/spec_guided.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from engine.runtime.sampling import SamplingParams, make_rngs, sample, token_logprobs
from engine.runtime.spec_sampling import VerifyJob
from engine.runtime.speculative import verify
from engine.state import trial as trials
from engine.state.sequence import SequenceState


@dataclass
class SpecStats:
    """What a speculative generation did: tokens emitted at each verify step (1 .. k + 1; the
    prompt's step, which emits one token with no draft, is not counted), drafts proposed and kept."""

    lengths: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    @property
    def steps(self) -> int:
        return len(self.lengths)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per verify step (plain decoding: 1.0)."""
        return sum(self.lengths) / len(self.lengths) if self.lengths else 0.0


def draft_of(model):
    """The model's DSpark draft (ModelRunner.draft; under simulated tensor parallelism the sharded
    draft, engine/parallel/draft.py), or None: no draft layers, or the GPU tensor-parallel driver,
    which does not speculate yet."""
    return getattr(model, "draft", None)


def feed(model, dsp, st: SequenceState, ds, chunk: list[int], all_logits: bool):
    """Feed a chunk (a prompt chunk, or re-fed kept rows) to the main model and let the draft
    absorb its rows; the logits."""
    return feed_many(model, dsp, [st], [ds], [chunk], all_logits)[0]


def feed_many(model, dsp, states: list[SequenceState], drafts: list, chunks: list[list[int]], all_logits: bool):
    """feed for several sequences in one main forward, each draft absorbing its own rows
    (DSpark.absorb_many); each sequence's logits."""
    targets = dsp.targets
    logits = model.forward(states, chunks, all_logits=all_logits, targets=targets)
    dsp.absorb_many(drafts, targets, [len(c) for c in chunks])
    return logits


def _first_stop(tokens: list[int], stops: Iterable[int]) -> int:
    """How many of tokens to emit: up to and including the first stop id."""
    stops = set(stops)
    for j, t in enumerate(tokens):
        if t in stops:
            return j + 1
    return len(tokens)


class SpecJob(NamedTuple):
    """One sequence's speculative step: its state (holding every token before generated[-1]), its
    draft state, its tokens so far, how many it may still emit (>= 1), its sampling parameters,
    stop ids and generator, and the figures to add to. logprobs: where each emitted token's
    (logprob, top_logprobs) is appended when params.logprobs (from its own verify row, as plain
    decoding reports it from the row that drew it). guide: a constrained sequence's drafter
    (engine/runtime/spec_guided.py), None for a free one."""

    state: SequenceState
    ds: Any
    generated: list[int]
    room: int
    params: SamplingParams
    eos: tuple[int, ...]
    rng: np.random.Generator
    stats: SpecStats
    logprobs: list | None = None
    guide: Any = None  # constrained decoding: spec_guided.Drafter, the drafts and verify's masks


def _on_device(j: SpecJob) -> bool:
    """Whether a sequence's verify runs on the backend (ops.verify_rows): every free one, greedy or
    sampled; a constrained one's rows come to the host for its grammar's masks."""
    return j.guide is None


def speculative_steps(model, dsp, jobs: list[SpecJob]) -> list[list[int]]:
    """One step of each job's sequence: draft, then every sequence's [last, drafts] verified in
    one main forward on the states themselves as trials, each cut back to its kept rows. Returns
    each sequence's 1 .. min(block + 1, room) tokens, ending at the first id of its eos if one is
    drawn; `generated` is not changed."""
    ks = [min(dsp.block_size, j.room - 1) for j in jobs]
    # the free sequences draft together, in one draft forward; a sampled one draws from the
    # draft's distribution and verify weighs it by that; a constrained one drafts within its grammar
    free = [b for b, j in enumerate(jobs) if j.guide is None and ks[b] > 0]
    states, targets, marks, ops = [j.state for j in jobs], dsp.targets, [], model.ops
    # The verify step's plan depends on its rows, not on the drafted tokens: where every sequence is
    # free (a constrained one's draft may stop early) it is planned while the device drafts.
    prepare = getattr(model, "prepare_verify", None)
    ahead = None
    if prepare is not None and all(j.guide is None for j in jobs):
        def ahead() -> None:
            prepare(states, [k + 1 for k in ks])
    try:
        marks += [trials.begin(j.state) for j in jobs]  # (before the plan made ahead, which they hold)
        blocks = dict(zip(free, dsp.draft_many(
            [jobs[b].ds for b in free], [jobs[b].generated[-1] for b in free],
            [None if jobs[b].params.greedy else jobs[b].rng for b in free],
            [jobs[b].params.temperature for b in free], ahead=ahead,
            tokens_only=all(jobs[b].params.greedy for b in free)), strict=True)) if free else {}
        chunks, drafts, masks, qs = [], [], [], []
        for b, (j, k) in enumerate(zip(jobs, ks, strict=True)):
            q = m = None
            if j.guide is not None:
                d, m = j.guide(dsp, j.ds, j.generated[-1], k)
            elif k > 0:
                d = [int(x) for x in blocks[b].tokens[:k]]
                q = None if j.params.greedy else blocks[b].probs  # (q rows on the backend)
            else:
                d = []
            drafts.append(d)
            masks.append(m)
            qs.append(q)
            chunks.append([j.generated[-1], *d])
        logits = model.forward(states, chunks, all_logits=True, on_device=True, targets=targets,
                               verify=True)
        starts = np.cumsum([0, *map(len, chunks)])
        # A free sequence's rows are verified by the backend (ops.verify_rows: drawn on the device
        # on the GPU, row i counting drafts 0 .. i-1 as generated, as it is reached only if they are
        # kept), so only tokens and logprobs leave the device; a constrained sequence's rows come to
        # the host for the verify rule under its grammar's masks.
        free_jobs = [b for b, j in enumerate(jobs) if _on_device(j)]
        judged = dict(zip(free_jobs, ops.verify_rows(logits, [
            VerifyJob(int(starts[b]), drafts[b], qs[b], jobs[b].params, jobs[b].generated, jobs[b].rng)
            for b in free_jobs]), strict=True)) if free_jobs else {}
        verdicts, rows = [], []
        for b, (j, d, q, m) in enumerate(zip(jobs, drafts, qs, masks, strict=True)):
            if b in judged:
                verdicts.append((judged[b].tokens, judged[b].kept))
                rows.append(judged[b].logprobs)
            else:
                x = np.asarray(ops.to_host(logits[int(starts[b]) : int(starts[b + 1])]), np.float32)
                verdicts.append(verify(x, d, q, j.params, j.generated, j.rng, m))
                rows.append(x)
    except BaseException:
        if prepare is not None:
            model.drop_ahead()  # (made for a step that will not come)
        for j, tr in zip(jobs, marks, strict=False):
            trials.restore(j.state, tr)
        raise
    out, keeps = [], []
    for j, tr, d, x, (tokens, n) in zip(jobs, marks, drafts, rows, verdicts, strict=True):
        keep = _first_stop(tokens, j.eos)
        if j.params.logprobs and j.logprobs is not None:
            if isinstance(x, list):  # verified by the backend: each row's logprobs, reported with it
                j.logprobs.extend(x[:keep])
            else:
                j.logprobs.extend(token_logprobs(x[r], t, j.params.top_logprobs) for r, t in enumerate(tokens[:keep]))
        trials.cut(j.state, tr, keep)  # the state holds exactly the emitted tokens but the last
        keeps.append(keep)
        j.stats.lengths.append(keep)
        j.stats.drafted += len(d)
        j.stats.accepted += min(n, keep)
        out.append(tokens[:keep])
    # (the target inputs' rows: every chunk's, in order; all_logits trims none)
    dsp.absorb_kept([j.ds for j in jobs], targets, [len(c) for c in chunks], keeps)
    return out


def speculative_step(model, dsp, state: SequenceState, ds, generated: list[int], room: int,
                     params: SamplingParams, eos: Iterable[int], rng: np.random.Generator,
                     stats: SpecStats) -> list[int]:
    """One step of one sequence (speculative_steps)."""
    return speculative_steps(model, dsp, [SpecJob(state, ds, generated, room, params, tuple(eos), rng, stats)])[0]


def speculative_generate(model, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
                         eos_ids: Iterable[int], state: SequenceState, stats: SpecStats | None = None,
                         rng: np.random.Generator | None = None, chunk: int | None = None) -> list[int]:
    """Prefill the prompt into `state` (in pieces of `chunk` tokens; None: at once), then decode up
    to max_tokens tokens speculatively, stopping after an id of eos_ids (empty: never). `model`: a
    ModelRunner with a draft."""
    dsp = draft_of(model)
    if dsp is None:
        raise ValueError("speculative decoding needs a checkpoint with DSpark draft layers (and one GPU, "
                         "not tensor parallelism, on the GPU)")
    stats = stats if stats is not None else SpecStats()
    rng = rng if rng is not None else make_rngs(params.seed)[0]
    eos = tuple(eos_ids)
    out: list[int] = []
    if max_tokens <= 0:
        return out
    ds = dsp.new_state(state.position)  # (a state passed in with history: the draft's windows start here)
    prompt = list(prompt_ids)
    step = chunk or max(len(prompt), 1)
    for i in range(0, max(len(prompt), 1), step):  # (an empty prompt is fed as one empty chunk)
        logits = feed(model, dsp, state, ds, prompt[i:i + step], all_logits=False)
    out.append(sample(logits, params, out, rng)[0])
    while len(out) < max_tokens and out[-1] not in eos:
        out.extend(speculative_step(model, dsp, state, ds, out, max_tokens - len(out), params, eos, rng, stats))
    return out
