"""Continuous batching on the event loop.

Each iteration of the loop builds one batch: every running sequence past its prompt decodes one
token, and prompts are prefilled in chunks from a per-step token budget, so a long prompt never
stalls the decodes. New sequences join at the next step; finished or cancelled ones leave at
once. The engine step (and sampling) runs in a one-thread executor shared by everything that
uses the same engine, so the loop stays free for HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.runtime.sampling import SampleJob, SamplingParams, make_rngs
from kvcache import serving as kv_serving

from . import guided, speculate
from .metrics import Metrics
from .protocol import MAX_TOP_LOGPROBS, APIError, GenRequest, bad, short
from .streaming import Delta, OutputProcessor

log = logging.getLogger("dsuf.scheduler")

_EXECUTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_executor(engine: Any) -> ThreadPoolExecutor:
    """One worker per engine: engine steps are never concurrent, whoever submits them."""
    ex = _EXECUTORS.get(engine)
    if ex is None:
        ex = _EXECUTORS[engine] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
    return ex


@dataclass
class Event:
    """Output of one sequence since its previous event, sent to the request's queue."""

    index: int
    delta: Delta = field(default_factory=Delta)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(eq=False)
class Sequence:
    gen: GenRequest
    index: int  # choice index in the response
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    rng: np.random.Generator
    proc: OutputProcessor
    sink: asyncio.Queue
    state: Any = None
    n_prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    t_arrival: float = field(default_factory=time.monotonic)
    t_scheduled: float | None = None  # admitted into the running batch
    t_first: float | None = None
    t_last: float | None = None
    # state cache (kvcache/serving.py): conversation id, prompt tokens reused, snapshot points
    session: str | None = None
    n_cached: int = 0
    snap_at: list[int] = field(default_factory=list)
    # n > 1: choices 1.. of a prompt wait for choice 0's prefill and fork its state
    leader: Sequence | None = None
    # constrained decoding (server/guided.py): the matcher, or why it failed
    constraint: Any = None
    guide_error: str | None = None
    # speculative decoding (server/speculate.py): whether s speculates, its draft's state, and
    # whether its state ran ahead of plain decoding's (it finished inside a block)
    speculate: bool = False
    draft: Any = None
    spec_steps: int = 0  # its verify steps so far, and the tokens they emitted (server/speculate.py)
    spec_tokens: int = 0
    state_ahead: bool = False

    @property
    def waits_for_leader(self) -> bool:
        ld = self.leader
        return ld is not None and not ld.finished and ld.prefilling and self.prefilling

    @property
    def prefilling(self) -> bool:
        return self.n_prefilled < len(self.prompt)


class Scheduler:
    def __init__(self, engine: Any, metrics: Metrics, *, max_batch: int = 32, max_queue: int = 256,
                 prefill_chunk: int | None = None, kv: Any = None, speculative: str | None = None):
        self.engine = engine
        self.kv = kv  # kvcache.cache.StateCache or None
        self.metrics = metrics
        self.max_batch = max(1, max_batch)
        self.max_queue = max(0, max_queue)
        # prompt tokens per step: the engine's default for its backend (Engine.prefill_chunk) unless given
        self.prefill_chunk = max(1, prefill_chunk or getattr(engine, "prefill_chunk", 512))
        self.executor = engine_executor(engine)
        self.eos_ids = {int(t) for t in getattr(engine, "eos_ids", (engine.tokenizer.eos_id,))}
        self.guide = guided.Guide(engine)
        self.spec = speculate.Speculator(engine, speculative, self.guide)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.accepting = True
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="scheduler")
        self._task.add_done_callback(self._on_loop_exit)

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("scheduler loop died", exc_info=task.exception())
            for s in list(self.waiting) + list(self.running):
                self._fail(s, "scheduler stopped")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        """Cancel whatever is left and end the loop."""
        self.accepting = False
        for s in list(self.waiting) + list(self.running):
            self._fail(s, "server is shutting down")
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def drain(self, timeout: float) -> bool:
        """Stop taking work and wait up to timeout for the accepted work to finish."""
        self.accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # ------------------------------------------------------------ admission

    def new_sequences(self, gen: GenRequest, prompt: list[int], max_tokens: int, sink: asyncio.Queue,
                      first_index: int = 0) -> list[Sequence]:
        """The n choices for one prompt. Choice i's random stream depends only on (seed, i)."""
        params = SamplingParams(**{**gen.sampling.__dict__, "logprobs": gen.logprobs,
                                   "top_logprobs": gen.top_logprobs})
        rngs = make_rngs(gen.sampling.seed, gen.n)
        seqs = [
            Sequence(gen=gen, index=first_index + i, prompt=prompt, max_tokens=max_tokens, params=params,
                     rng=rngs[i], sink=sink,
                     proc=OutputProcessor(self.engine.tokenizer, stop=gen.stop, thinking=gen.thinking,
                                          tools=gen.tools))
            for i in range(gen.n)
        ]
        for s in seqs[1:]:  # the prompt is prefilled once, by choice 0
            s.leader = seqs[0]
        for s in seqs:
            s.speculate = self.spec.eligible(s)
        return seqs

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences, all or none. Raises 400 for sampling parameters the engine
        cannot take, 503 when draining, 429 when full."""
        for s in seqs:
            problem = self.params_problem(s.params)
            if problem is not None:
                raise bad(f"invalid sampling parameters: {problem}")
        if not self.accepting:
            raise APIError(503, "server is shutting down", type="service_unavailable", code="shutting_down")
        room = self.max_queue + max(0, self.max_batch - len(self.running)) - len(self.waiting)
        if len(seqs) > room:
            self.metrics.rejected.inc()
            raise APIError(429, "too many requests: the queue is full, retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.waiting.extend(seqs)
        if seqs:
            self.metrics.admitted(seqs[0].gen.n, sum(s.leader is None for s in seqs))
        self._idle.clear()
        self._wake.set()

    def params_problem(self, p: SamplingParams) -> str | None:
        """Why the engine's sampler would raise on p (None: it will not). Checked at admission, so
        one sequence's parameters never reach the shared step; the protocol's checks are stricter."""
        vocab = int(self.engine.config.vocab_size)
        finite = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty)
        if not all(isinstance(v, int | float) and np.isfinite(v) for v in finite):
            return "non-finite or non-numeric value"
        if p.temperature < 0 or not 0 < p.top_p <= 1 or not 0 <= p.min_p <= 1:
            return "temperature, top_p or min_p out of range"
        if not isinstance(p.top_k, int) or not -(1 << 31) <= p.top_k < 1 << 31:
            return "top_k out of range"
        if p.seed is not None and (not isinstance(p.seed, int) or not 0 <= p.seed < 1 << 64):
            return "seed out of range"
        if not isinstance(p.top_logprobs, int) or not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
            return "top_logprobs out of range"
        for tid, b in p.logit_bias:
            if not isinstance(tid, int) or not 0 <= tid < vocab:
                return f"logit_bias id {short(tid)} outside [0, {vocab})"
            if not isinstance(b, int | float) or not np.isfinite(b) or abs(b) > 100:
                return "logit_bias value not in [-100, 100]"
        return None

    def cancel(self, seqs: list[Sequence]) -> None:
        """Client went away: drop the sequences now. A step in flight finishes, its result is ignored."""
        for s in seqs:
            if s.finished:
                continue
            s.finished = True
            if s in self.waiting:
                self.waiting.remove(s)
            if s in self.running:
                self.running.remove(s)
            self.metrics.finished(s, "cancelled")
        self._check_idle()

    def _check_idle(self) -> None:
        if not self.running and not self.waiting:
            self._idle.set()

    # ------------------------------------------------------------ the loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.running and not self.waiting:
                self._check_idle()
                self._wake.clear()
                await self._wake.wait()
                continue
            while self.waiting and len(self.running) < self.max_batch:
                self.running.append(self.waiting.popleft())
                self.running[-1].t_scheduled = time.monotonic()
            batch, chunks, do_sample = self._plan()
            try:
                batch, chunks, results, failed = await loop.run_in_executor(
                    self.executor, self._execute_isolated, batch, chunks, do_sample)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the isolation itself broke: fail the batch, not the server
                log.exception("engine step failed")
                for s in batch:
                    self._fail(s, f"engine error: {type(e).__name__}: {short(str(e))}")
                continue
            for s, message in failed:
                self._fail(s, message)
            self.metrics.step(sum(map(len, chunks)) + speculate.drafted_rows(results))
            self._apply(batch, chunks, results)
            # let handlers run between steps even if the executor answered instantly
            await asyncio.sleep(0)

    def _plan(self) -> tuple[list[Sequence], list[list[int]], list[bool]]:
        batch, chunks, do_sample = [], [], []
        budget = self.prefill_chunk
        for s in self.running:
            if not s.prefilling:
                batch.append(s)
                chunks.append([s.generated[-1]])
                do_sample.append(True)
        for s in self.running:  # FIFO: the oldest prompt gets the budget first
            if s.prefilling and budget > 0 and not s.waits_for_leader:
                take = min(budget, len(s.prompt) - s.n_prefilled, kv_serving.chunk_limit(s) or budget)
                batch.append(s)
                chunks.append(s.prompt[s.n_prefilled:s.n_prefilled + take])
                do_sample.append(s.n_prefilled + take == len(s.prompt))
                budget -= take
        return batch, chunks, do_sample

    def _execute(self, batch: list[Sequence], chunks: list[list[int]], do_sample: list[bool]) -> list:
        """Runs in the engine thread: speculating sequences (server/speculate.py), then
        the others in one batched step. batch / chunks are reordered in place to match the results."""
        mine = [i for i, s in enumerate(batch) if s.speculate]
        if not mine:
            return self._execute_batched(batch, chunks, do_sample)
        rest = [i for i in range(len(batch)) if not batch[i].speculate]  # (before run_all: it may stop one)
        forks = self._forks([batch[i] for i in mine], [chunks[i] for i in mine])
        results = self.spec.run_all([(batch[i], chunks[i], do_sample[i], self._eos(batch[i])) for i in mine],
                                    self.kv, forks)
        b, c = [batch[i] for i in rest], [chunks[i] for i in rest]
        if b:
            results += self._execute_batched(b, c, [do_sample[i] for i in rest])
        batch[:] = [batch[i] for i in mine] + [f for _, f in forks] + b
        chunks[:] = [chunks[i] for i in mine] + [[] for _ in forks] + c
        return results

    def _forks(self, batch: list[Sequence], chunks: list[list[int]]) -> list[tuple[int, Sequence]]:
        """(i, f): choice f waits on batch[i], whose prompt completes in this step."""
        return [(i, f) for i, (s, chunk) in enumerate(zip(batch, chunks, strict=True))
                if s.prefilling and s.n_prefilled + len(chunk) == len(s.prompt)
                for f in self.running if f.leader is s and f.prefilling and not f.finished]

    def _eos(self, s: Sequence) -> tuple[int, ...]:
        return () if s.gen.ignore_eos else tuple(sorted(self.eos_ids))

    def _execute_batched(self, batch: list[Sequence], chunks: list[list[int]], do_sample: list[bool]) -> list:
        """Runs in the engine thread. A leader that finishes its prompt forks its state to the
        choices waiting on it, which sample their first token from the same logits; they are
        appended to batch / chunks (with an empty chunk) so _apply handles them alike."""
        for s in batch:
            if s.state is None:
                s.state = self.engine.new_state()
        # choices waiting on a leader whose prompt completes now draw from the leader's row
        forks = self._forks(batch, chunks)
        draws = [(i, s) for i, s in enumerate(batch) if do_sample[i]] + forks
        masks = self.guide.masks([s for _, s in draws])  # after the last step's tokens reached the matchers
        jobs = [SampleJob(i, s.params, s.generated, s.rng, m) for (i, s), m in zip(draws, masks, strict=True)]
        drawn = iter(self.engine.step_sample([s.state for s in batch], chunks, jobs))
        for s, chunk in zip(batch, chunks, strict=True):
            if s.prefilling:  # snapshot before the state moves on (kvcache/serving.py)
                kv_serving.snapshot_prompt(self.kv, s, s.n_prefilled + len(chunk))
        results = [next(drawn) if do_sample[i] else None for i in range(len(batch))]
        for i, f in forks:
            f.state = batch[i].state.clone()
            batch.append(f)
            chunks.append([])
            results.append(next(drawn))
        return results

    def _execute_isolated(self, batch: list[Sequence], chunks: list[list[int]], do_sample: list[bool]
                          ) -> tuple[list[Sequence], list[list[int]], list, list[tuple[Sequence, str]]]:
        """_execute, and if the step raises, each of its sequences again on its own, so only the
        ones that fail alone get the error. Returns (batch, chunks, results, [(failed, why)]).

        A step that raised may have moved some states on: the runner's forward advances every
        state of the batch (positions, cache rows) before sampling, and states have no undo. So
        every sequence of the failed step is rebuilt from its own tokens (a prefill of what it had
        consumed) before it is retried; a rebuilt state may differ from the original in rounding."""
        b, c = list(batch), list(chunks)
        try:
            return b, c, self._execute(b, c, list(do_sample)), []
        except Exception:
            log.exception("engine step failed; retrying its %d sequences one by one", len(batch))
        out_b: list[Sequence] = []
        out_c: list[list[int]] = []
        out_r: list = []
        failed: list[tuple[Sequence, str]] = []
        for s, chunk, sample in zip(batch, chunks, do_sample, strict=True):
            if s.finished:
                continue
            b, c = [s], [chunk]
            try:
                self._rebuild(s)
                r = self._execute(b, c, [sample])
            except Exception as e:
                log.warning("sequence %s failed alone: %s: %s", s.gen.request_id, type(e).__name__, e)
                s.state = None
                failed.append((s, f"engine error: {type(e).__name__}: {short(str(e))}"))
                continue
            out_b += b
            out_c += c
            out_r += r
        return out_b, out_c, out_r, failed

    def _rebuild(self, s: Sequence) -> None:
        """A fresh state for s holding exactly the tokens it had consumed before this step."""
        consumed = s.prompt[:s.n_prefilled] if s.prefilling else s.prompt + s.generated[:-1]
        s.state = None
        s.speculate, s.draft = False, None  # its draft state is lost with it: plain decoding from here
        if not consumed:
            return
        st = self.engine.new_state()
        for i in range(0, len(consumed), self.prefill_chunk):
            self.engine.step_sample([st], [consumed[i:i + self.prefill_chunk]], [])
        s.state = st

    def _apply(self, batch: list[Sequence], chunks: list[list[int]], results: list) -> None:
        now = time.monotonic()
        for s, chunk, res in zip(batch, chunks, results, strict=True):
            if s.finished:  # cancelled while the step ran
                continue
            try:
                self._apply_one(s, chunk, res, now)
            except Exception as e:  # a bug in one sequence's output handling fails that sequence only
                log.exception("processing the step's result for %s failed", s.gen.request_id)
                self._fail(s, f"internal error: {type(e).__name__}: {short(str(e))}")

    def _apply_one(self, s: Sequence, chunk: list[int], res: Any, now: float) -> None:
        if s.prefilling:
            # an empty chunk: a forked choice, its leader prefilled the prompt for it
            s.n_prefilled = s.n_prefilled + len(chunk) if chunk else len(s.prompt)
            self.metrics.prefill_tokens.inc(len(chunk))
            if not s.prefilling and s.leader is None:  # once per prompt, as usage counts it
                self.metrics.prompt_tokens.inc(len(s.prompt))
        if res is None:
            return
        if isinstance(res, speculate.Emitted):
            if res.stats is not None:
                self.metrics.spec(res.stats)
            if res.stopped:
                self.metrics.spec_stopped.inc()
            for j, tok in enumerate(res.tokens):
                # the state holds the step's tokens but the last: one that ends earlier (a stop
                # string) leaves it ahead of plain decoding's, so it gives no answer snapshot
                s.state_ahead = j + 1 < len(res.tokens)
                if not self._emit(s, tok, *res.entry(j), now):
                    break
            return
        self._emit(s, *res, now)

    def _emit(self, s: Sequence, tok: int, lp: float | None, top: Any, now: float) -> bool:
        """One generated token of s; whether s goes on."""
        if s.gen.grammar is not None and (err := guided.advance(s, tok)) is not None:
            self._fail(s, err)
            return False
        s.generated.append(tok)
        self.metrics.token(s, now)
        if s.t_first is None:
            s.t_first = now
        s.t_last = now
        ev = Event(index=s.index, token_ids=[tok])
        if lp is not None:
            ev.logprobs.append((tok, lp, top or []))
        finish, by_stop_string = None, False
        if tok in self.eos_ids and not s.gen.ignore_eos:
            finish = "stop"
        else:
            ev.delta, by_stop_string = s.proc.push(tok)
            if by_stop_string:
                finish = "stop"
            elif len(s.generated) >= s.max_tokens:
                finish = "length"
        if finish is None:
            s.sink.put_nowait(ev)
            return True
        ev.delta.extend(s.proc.finish(stopped=by_stop_string))
        if finish == "stop" and s.proc.has_tool_calls:
            finish = "tool_calls"
        self._finish(s, finish, ev)
        return False

    def _finish(self, s: Sequence, reason: str, ev: Event) -> None:
        s.finished = True
        if s in self.running:
            self.running.remove(s)
        ev.finish_reason = reason
        ev.prompt_tokens, ev.completion_tokens = len(s.prompt), len(s.generated)
        ev.cached_tokens = s.n_cached
        s.sink.put_nowait(ev)
        # the answer's state, serialized in the engine thread (in step order)
        if self.kv is not None and not s.state_ahead:
            self.executor.submit(kv_serving.snapshot_answer, self.kv, s)
        self.metrics.finished(s, reason)
        self._check_idle()

    def _fail(self, s: Sequence, message: str) -> None:
        if s.finished:
            return
        s.finished = True
        if s in self.waiting:
            self.waiting.remove(s)
        if s in self.running:
            self.running.remove(s)
        s.sink.put_nowait(Event(index=s.index, error=message, prompt_tokens=len(s.prompt),
                                completion_tokens=len(s.generated)))
        self.metrics.finished(s, "error")
        self._check_idle()
