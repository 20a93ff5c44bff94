"""The scheduler's side of speculative decoding with the checkpoint's DSpark draft
(engine/runtime/spec_decode.py), exact: the same tokens as plain decoding for greedy requests, the
same distribution for sampled ones.

Speculating sequences run inside the engine thread beside the batched step of the others: their
prompt chunks of a step share one forward whose target-layer inputs each sequence's draft absorbs
(DSpark.absorb_many), and their decode steps share one verify forward (spec_decode's
speculative_steps: draft, verify [last, drafts] in place as a trial, cut each state back to its kept
rows), so each state always equals plain decoding's at the same position.

Each emitted token's logprobs come from its own verify row (the main model's logits there), as
plain decoding reports them from the row that drew it.

The n choices of a request all speculate: choice 0 prefills the prompt, and when it completes the
others fork its state and its draft's state (DraftState.clone) and draw their first tokens from the
same logits, as on the plain path.

Constrained requests speculate too: the draft proposes what the grammar allows and verify applies
the grammar's mask at every position (engine/runtime/spec_guided.py), on a copy of the matcher; the
scheduler feeds the sequence's own matcher each emitted token, as on the plain path.

By default (no --speculative) a sequence speculates while it pays: after its first verify steps,
once its acceptance is at or below the backend's breakeven for the verify step's batch
(engine/runtime/spec_cost.py, each batch bucket measured once, at its first judgement), it goes
back to plain decoding, its state being plain decoding's at every step; where a measured breakeven
is beyond any acceptance (the block + 1), after its first verify step. `--speculative dspark`
speculates whatever the acceptance.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.runtime import spec_cost
from engine.runtime.sampling import sample
from engine.runtime.spec_decode import SpecJob, SpecStats, draft_of, feed_many, speculative_steps
from engine.runtime.spec_guided import guided_drafter
from kvcache import serving as kv_serving

MODES = ("dspark", "off")
log = logging.getLogger("dsuf.speculate")


@dataclass
class Emitted:
    """A speculating sequence's tokens of one step (stats: None for the prompt's first token), and
    each one's (logprob, top_logprobs) when the request asks for them."""

    tokens: list[int]
    stats: SpecStats | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    stopped: bool = False  # the sequence decodes plainly from its next step (its acceptance did not pay)

    def entry(self, j: int) -> tuple[float | None, list[tuple[int, float]] | None]:
        """Token j's (logprob, top_logprobs), or (None, None)."""
        return self.logprobs[j] if self.logprobs else (None, None)


class Speculator:
    """Per scheduler: the engine's draft, or none (mode "off", or a checkpoint without draft layers)."""

    def __init__(self, engine: Any, mode: str | None = None, guide: Any = None):
        if mode not in (None, *MODES):
            raise ValueError(f"speculative mode must be one of {MODES}, not {mode!r}")
        self.engine = engine
        self.guide = guide  # server/guided.Guide: constrained requests speculate where there is one
        self.always = mode == "dspark"  # the default: each sequence while its acceptance pays
        self._breakeven: dict[int, float] = {}  # by spec_cost.batch_bucket
        self.dsp = None if mode == "off" else draft_of(getattr(engine, "model", None))
        if mode == "dspark" and self.dsp is None:
            raise ValueError("--speculative dspark needs a checkpoint with DSpark draft layers (and, on GPUs, "
                             "one GPU: tensor parallelism does not speculate yet)")

    @property
    def enabled(self) -> bool:
        return self.dsp is not None

    @property
    def block_size(self) -> int:
        return int(self.dsp.block_size) if self.dsp is not None else 0

    def eligible(self, s: Any) -> bool:
        """Whether sequence s speculates (decided at admission, before its first step)."""
        return self.dsp is not None and (s.gen.grammar is None or self.guide is not None)

    def run_all(self, steps: list[tuple[Any, list[int], bool, tuple[int, ...]]], kv: Any,
                forks: list[tuple[int, Any]] = ()) -> list[Emitted | None]:
        """Engine thread: one step of each speculating sequence of (s, chunk, do_sample, eos): the
        prompt chunks in one forward, the decode steps' verify chunks in one forward. forks: (i, f),
        choice f forks steps[i]'s state and draft state when its prompt completes here, and draws
        its first token from the same logits; their results follow the steps' in order."""
        out: list[Emitted | None] = [None] * len(steps)
        firsts: dict[int, Emitted] = {}
        decoding, prefilling = [], []
        for i, (s, _, _, _) in enumerate(steps):
            if s.state is None:
                s.state = self.engine.new_state()
            if s.draft is None:  # a state restored from the cache, or forked from a plain leader:
                s.draft = self.dsp.new_state(s.state.position)  # the draft's windows start here
            (prefilling if s.prefilling else decoding).append(i)
        if prefilling:
            done = self._prefill([steps[i][:3] for i in prefilling], kv,
                                 [[f for k, f in forks if k == i] for i in prefilling])
            for i, (first, followers, drawn) in zip(prefilling, done, strict=True):
                out[i] = first
                firsts.update(zip((id(f) for f in followers), drawn, strict=True))
        jobs = [self._job(s, eos) for s, _, _, eos in (steps[i] for i in decoding)]
        emitted = speculative_steps(self.engine.model, self.dsp, jobs) if jobs else []
        for i, job, tokens in zip(decoding, jobs, emitted, strict=True):
            out[i] = Emitted(tokens, job.stats, job.logprobs,
                             stopped=self._judge(steps[i][0], len(tokens), len(jobs)))
        return out + [firsts[id(f)] for _, f in forks]

    def breakeven(self, batch: int = 1) -> float:
        """The acceptance above which speculating beats plain decoding here for a verify step of
        `batch` sequences, measured once per spec_cost.batch_bucket. If the measurement fails, 0:
        those sequences speculate, as with --speculative dspark."""
        b = spec_cost.batch_bucket(batch)
        if b not in self._breakeven:
            try:
                cost = spec_cost.measure(self.engine.model, self.dsp, batch=b)
            except Exception:
                log.exception("measuring the speculation breakeven failed (batch %d): those sequences speculate", b)
                self._breakeven[b] = 0.0
                return 0.0
            self._breakeven[b] = cost.breakeven
            log.info("speculation breakeven at batch %d: %.2f tokens per verify step (1-token step %.2f ms, verify "
                     "%.2f ms, draft %.2f ms)", b, cost.breakeven, 1e3 * cost.step, 1e3 * cost.verify,
                     1e3 * cost.draft)
        return self._breakeven[b]

    def _judge(self, s: Any, emitted: int, batch: int) -> bool:
        """Count s's verify step (one of `batch` sequences'); whether it now stops speculating (it
        decodes plainly from here)."""
        s.spec_steps += 1
        s.spec_tokens += emitted
        if self.always or spec_cost.pays(s.spec_tokens, s.spec_steps, lambda: self.breakeven(batch),
                                         self.block_size + 1, spec_cost.batch_bucket(batch) in self._breakeven):
            return False
        s.speculate, s.draft = False, None
        return True

    def run(self, s: Any, chunk: list[int], do_sample: bool, eos: tuple[int, ...], kv: Any) -> Emitted | None:
        """Engine thread: one step of speculating sequence s (a prompt chunk, or a decode step
        after s.generated[-1], which `chunk` then holds)."""
        return self.run_all([(s, chunk, do_sample, eos)], kv)[0]

    def _prefill(self, items: list[tuple[Any, list[int], bool]], kv: Any, followers: list[list[Any]]
                 ) -> list[tuple[Emitted | None, list[Any], list[Emitted]]]:
        """Prompt chunks (s, chunk, do_sample) in one forward, each draft absorbing its sequence's
        rows; per item its first token when the prompt completes (else None), its followers, which
        fork its state and draft state, and their first tokens."""
        seqs, chunks = [s for s, _, _ in items], [list(c) for _, c, _ in items]
        logits = feed_many(self.engine.model, self.dsp, [s.state for s in seqs], [s.draft for s in seqs], chunks,
                           all_logits=False)
        out = []
        for (s, chunk, do_sample), fs, row in zip(items, followers, logits, strict=True):
            row = np.asarray(row)
            kv_serving.snapshot_prompt(kv, s, s.n_prefilled + len(chunk))
            first = self._first(s, row) if do_sample else None
            drawn = []
            for f in fs:
                f.state, f.draft = s.state.clone(), s.draft.clone()
                drawn.append(self._first(f, row))
            out.append((first, fs, drawn))
        return out

    def _mask(self, s: Any) -> Any:
        """s's next-token mask (None: unconstrained), its matcher started if it has none yet."""
        return self.guide.masks([s])[0] if s.gen.grammar is not None else None

    def _first(self, s: Any, logits: np.ndarray) -> Emitted:
        """The first token of s after its prompt, drawn as plain decoding draws it."""
        tok, lp, top = sample(logits, s.params, s.generated, s.rng, self._mask(s))
        return Emitted([int(tok)], logprobs=[(lp, top)] if lp is not None else None)

    def _job(self, s: Any, eos: tuple[int, ...]) -> SpecJob:
        """Sequence s's decode step as a SpecJob (a constrained one drafts what its grammar allows)."""
        guide = None
        if s.gen.grammar is not None:
            if s.constraint is None:
                self._mask(s)
            guide = guided_drafter(s.constraint, self.guide.constrainer, eos)
        return SpecJob(s.state, s.draft, s.generated, s.max_tokens - len(s.generated), s.params, eos, s.rng,
                       SpecStats(), [] if s.params.logprobs else None, guide)


def drafted_rows(results: list) -> int:
    """The rows a step's verify forwards ran beyond each sequence's one fed token: its drafts."""
    return sum(r.stats.drafted for r in results if isinstance(r, Emitted) and r.stats is not None)
