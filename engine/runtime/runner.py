"""How a step runs: the model (engine/model/) over a backend's ops, on one tensor-parallel rank.

A forward call takes several sequences, each with its own state and a chunk of >= 1 new tokens
(prefill, chunked prefill and decode are the same call). The runner
- picks the path: V4.1 sequences fed one token take the batched decode path, their state rows
  planned on the host first (engine/state/decode_plan.py); prompt chunks take the chunk path,
  one sequence at a time; a step may mix both;
- runs a decode step alone as one CUDA graph per batch size (ops.graphed_step), or under tensor
  parallelism offers it to the driver, which captures every rank's step with its collectives; a
  speculative verify step is such a decode step, and the DSpark draft's layers run as one graph
  per batch size too (DSpark.region);
- plans the next decode step on the host while the device runs this one (prepare_next);
- trims rows no later layer needs (bounded replay);
- runs some model parts on a side stream while a graph is captured (FORKED: ops.fork), so that
  independent chains overlap; an op that reads their outputs waits for them;
- draws tokens (step_sample).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import numpy as np

from engine.checkpoint.loader import load_weights
from engine.model.base import Transformer, resident_state_bytes_per_token
from engine.model.batch import Batch, Seq
from engine.model.config import ModelConfig
from engine.parallel.lockstep import StepRegion
from engine.parallel.shard import ShardPlan
from engine.state.decode_plan import StepInputs, plan_decode
from engine.state.sequence import SequenceState, marks_hold, place, plan_marks, restore_marks

# Model parts that run beside the layer's main chain while a decode step is captured (object
# path in a layer, method): the query heads (the layer's largest projection) beside the K=V,
# compressor and indexer chain; the indexer's queries beside the compressor's; an mHC site's
# mixes, needed only at its expand; the shared expert beside the routing and the routed experts.
FORKED = (("attn", "query_heads"), ("attn.indexer", "queries"), ("", "hc_mixes"), ("ffn", "shared_expert"))


class _Ahead(NamedTuple):
    """A decode step planned ahead (prepare_next): its sequences and positions, their bookkeeping
    before and after the plan, its inputs (token fields placeholders) and the backend's staging."""

    states: list
    pos: np.ndarray
    before: tuple
    after: tuple
    inputs: StepInputs
    pre: object


def _token_ids(chunks: list) -> tuple[np.ndarray, np.ndarray]:
    """Every chunk's token ids in one int64 array, and each chunk's length (a decode step's
    one-token chunks without a numpy call apiece)."""
    if all(isinstance(ch, (list, tuple)) and len(ch) == 1 for ch in chunks):
        ids = np.array([ch[0] for ch in chunks], np.int64)
        if ids.ndim == 1:
            return ids, np.ones(len(chunks), np.int64)
    arrs = [np.asarray(ch, dtype=np.int64).reshape(-1) for ch in chunks]
    return np.concatenate(arrs), np.array([a.size for a in arrs], np.int64)


def _keep_trailing(seqs: list[Seq], keep: int) -> np.ndarray | None:
    """Restrict every sequence to its last `keep` rows; returns the row index (None: no change)."""
    if all(s.pos.size <= keep for s in seqs):
        return None
    idx, start = [], 0
    for s in seqs:
        n = min(s.pos.size, keep)
        idx.append(np.arange(s.rows.stop - n, s.rows.stop))
        s.rows, s.pos = slice(start, start + n), s.pos[-n:]
        s.shared = {k: v[-n:] for k, v in s.shared.items()}  # per-query masks follow their rows
        start += n
    return np.concatenate(idx)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, ckpt, ops, tokenizer_json: str | Path | None = None,
                 store_quantized: bool = True, plan: ShardPlan | None = None) -> None:
        self.cfg, self.ops, self.ckpt, self.tokenizer_json = cfg, ops, ckpt, tokenizer_json
        self.plan = plan or ShardPlan.make(cfg)
        self.w = load_weights(cfg, ckpt, ops, self.plan)
        self.model = Transformer(cfg, self.w, ops, self.plan, tokenizer_json, store_quantized)
        self.model_key = self.model.model_key
        self.bounded_replay = True
        self._next: _Ahead | None = None  # the next decode step's plan, made ahead (prepare_next)
        self.ahead_used = 0  # decode steps that took a plan made ahead (for tests and profiles)
        if self.model.dspark is not None and getattr(ops, "graphs", None) is not None and self.plan.single:
            # the draft's layers as one CUDA graph per batch size (a rank's draft has collectives:
            # under tensor parallelism it runs eagerly)
            self.model.dspark.region = ops.graphs
        for layer in self.model.layers:
            for path, name in FORKED:
                part = functools.reduce(lambda o, a: getattr(o, a, None), path.split(".") if path else [], layer)
                if part is not None:
                    setattr(part, name, functools.partial(ops.fork, getattr(part, name)))

    # ---- state ------------------------------------------------------------------------------
    @property
    def store_quantized(self) -> bool:
        return self.model.store_quantized

    @store_quantized.setter
    def store_quantized(self, on: bool) -> None:
        self.model.set_store_quantized(on)

    def new_state(self) -> SequenceState:
        return self.model.new_state()

    @property
    def draft(self):
        """The DSpark draft (engine/model/dspark.py), None without draft layers."""
        return self.model.dspark

    def state_bytes_per_token(self) -> tuple[float, int]:
        return self.model.state_bytes_per_token()

    def resident_state_bytes_per_token(self) -> tuple[float, int]:
        return resident_state_bytes_per_token(self.cfg)

    # ---- steps ------------------------------------------------------------------------------
    def forward(self, states: list[SequenceState], chunks: list, all_logits: bool = False,
                on_device: bool = False, targets: dict | None = None, verify: bool = False) -> list[np.ndarray]:
        """Feed chunks[i] (>= 1 token ids) to states[i]; advance the states. Returns, per sequence,
        logits [vocab] of its last token (or [len(chunk), vocab] with all_logits); on_device: those
        rows as one backend array [len(states) or every chunk's rows, vocab], left on the device.
        targets: {layer index: None} to collect the DSpark draft's inputs of those layers (filled
        with the mean of the streams entering each, per row the layer ran; see Batch.targets).
        verify: a speculative verify step (engine/runtime/spec_decode.py): each chunk, [last token,
        drafts], runs as that many decode rows of a V4.1 decode step (planned row by row:
        decode_plan.plan_decode's counts), not as a prompt chunk; a state with a trial in progress
        (engine/state/trial.py) gets the bookkeeping after each of its rows, to keep the first m."""
        ops = self.ops
        if self.plan.size > 1 and ops.comm is None:
            raise RuntimeError("a sharded rank runs under the lockstep driver (engine/parallel/lockstep.py)")
        local, seqs = self._forward(states, chunks, all_logits, targets, verify)
        if on_device:  # [rows, vocab]: each sequence's last row, or every row with all_logits
            return ops.all_gather(local)
        logits = ops.all_gather(ops.to_host(local))
        if not all_logits:
            return [logits[i] for i in range(len(seqs))]
        return [logits[s.rows] for s in seqs]

    def step_sample(self, states: list[SequenceState], chunks: list, jobs: list) -> list:
        """forward(), then one token per engine.runtime.sampling.SampleJob (its row: the index of a
        state) drawn by the backend: on the GPU only the tokens and logprobs come back. A V4.1
        decode step on one rank plans the next one for the same sequences while the device runs
        this one (prepare_next)."""
        logits = self.forward(states, chunks, on_device=True)
        ahead = None
        if self.cfg.arch == "v41" and self.plan.size == 1 and all(len(ch) == 1 for ch in chunks):
            def ahead():
                self.prepare_next(states)
        return self.ops.sample_rows(logits, jobs, ahead=ahead)

    def _forward(self, states: list[SequenceState], chunks: list, all_logits: bool, targets: dict | None = None,
                 verify: bool = False):
        """This rank's logits of the step (its vocabulary slice), and the step's sequences."""
        cfg, ops, model = self.cfg, self.ops, self.model
        if len(states) != len(chunks) or not states:
            raise ValueError("forward needs one chunk per state")
        for st in states:
            place(st, ops.placement, ops.asarray)  # e.g. one restored from bytes
        # (checked and laid out for the whole batch at once: per-sequence numpy calls cost ~7 us
        # each sequence, 0.2 ms a decode step at batch 32)
        ids_all, sizes = _token_ids(chunks)
        if not sizes.all():
            raise ValueError("every chunk needs at least one token")
        if ids_all.min() < 0 or ids_all.max() >= cfg.vocab_size:
            raise ValueError(f"token id out of range [0, {cfg.vocab_size})")
        pos_all = np.array([st.position for st in states], np.int64)
        if ids_all.size == len(states):  # one token each (a decode step)
            bounds = [(i, i + 1) for i in range(len(states))]
        else:
            ends = np.cumsum(sizes)
            starts = ends - sizes
            pos_all = np.repeat(pos_all - starts, sizes) + np.arange(ends[-1])
            bounds = list(zip(starts.tolist(), ends.tolist(), strict=True))
        seqs = [Seq(st, slice(a, b), pos_all[a:b]) for st, (a, b) in zip(states, bounds, strict=True)]
        ids = [ids_all[a:b] for a, b in bounds]
        # V4.1 sequences fed one token take the batched decode path: every layer's state rows are
        # planned on the host first, so its device half has the same launches whatever the
        # positions; a step of only such sequences is one graph. Prompt chunks sharing the step
        # take the chunk path beside them.
        verify = verify and cfg.arch == "v41"
        if verify:
            dec = list(range(len(ids)))
        else:
            dec = [i for i, ch in enumerate(ids) if ch.size == 1] if cfg.arch == "v41" else []
        window = layers = dec_rows = None
        ahead = (self._take_next(states, pos_all) if self._next is not None and len(dec) == len(seqs) and not verify
                 else None)
        self._next = None
        if ahead is not None:
            window, layers = ahead.inputs.window, ahead.inputs.layers
        elif dec:
            growth: list = []
            marks: list | None = [] if verify else None
            window, layers = plan_decode(cfg, [states[i] for i in dec], ops.xp, growth, model.rope.compressed,
                                         self.plan.heads[1] > self.plan.heads[0], sizes.tolist() if verify else None,
                                         marks)
            for st, mk in zip(states, marks or (), strict=False):
                if st.trial is not None:
                    st.trial.rows = mk
            ops.copy_rows(growth)
            if len(dec) < len(seqs):
                dec_rows = np.array([seqs[i].rows.start for i in dec], np.int64)
        inputs = StepInputs(
            ids=ids_all, hash_ids=model.engram_hashes(seqs, ids) if model.hasher else None, layers=layers,
            rope=ahead.inputs.rope if ahead is not None else model.rope.rows(pos_all), window=window,
            dec_rows=dec_rows)
        if layers is not None and dec_rows is None:  # a decode step alone: one graph per rank
            names = tuple(targets) if targets else ()
            key = ("decode", id(self.w), all_logits, names)
            if ops.comm is None:
                def graphed(staged):  # (the target inputs are the graph's outputs too: a replay rewrites them)
                    got = dict.fromkeys(names)
                    local = self._run(staged, seqs, all_logits, got if names else None)
                    return (local, *(got[i] for i in names)) if names else local

                staged = {"pre": ahead.pre} if ahead is not None else {}  # (its tables packed ahead)
                local = ops.graphed_step(key, inputs, graphed, rows=int(ids_all.size), **staged)
                if names:
                    local, *got = local
                    targets.update(zip(names, got, strict=True))
            else:  # every rank's step at once, as the driver runs them
                def run(staged):
                    return self._run(staged, seqs, all_logits, targets)

                local = ops.comm.step(StepRegion(key, inputs, run, ops, int(ids_all.size)))
        else:
            local = self._run(ops.stage(inputs), seqs, all_logits, targets)
        for s, ch in zip(seqs, ids, strict=True):
            s.state.position += ch.size
        return local, seqs

    def _run(self, st: StepInputs, seqs: list[Seq], all_logits: bool, targets: dict | None = None):
        """The step's device work over staged inputs (ops.stage): the embedding, every layer, the
        head; returns this rank's logits (of each sequence's last row, or of every row)."""
        cfg, ops, model = self.cfg, self.ops, self.model
        if st.layers is None:  # prompt chunks only
            chunks, decoding = seqs, []
        elif st.dec_rows is None:  # decode rows only (a decode step, a verify step)
            chunks, decoding = [], seqs
        else:  # one-token sequences beside prompt chunks
            chunks, decoding = [s for s in seqs if s.pos.size > 1], [s for s in seqs if s.pos.size == 1]
        batch = Batch(ids=st.ids, hash_ids=st.hash_ids, rope={"main": (st.rope[0], st.rope[1]),
                                                               "compress": (st.rope[2], st.rope[3])},
                      chunks=chunks, plans=st.layers, dec_rows=st.dec_rows, targets=targets)
        h, pre_mix = model.embed(batch)
        replay_from = self._replay_start() if not all_logits else cfg.num_layers
        for li, layer in enumerate(model.layers):
            if li >= replay_from:  # bounded replay: drop rows no later output or state depends on
                idx = _keep_trailing(seqs, 1 + (cfg.num_layers - li) * (cfg.sliding_window - 1))
                if idx is not None:
                    idx = ops.asarray(idx, dtype=np.int64)
                    h, pre_mix = h[idx], pre_mix[idx] if pre_mix is not None else None
                    batch.take(idx)
                    if decoding and chunks:
                        batch.dec_rows = ops.asarray([s.rows.start for s in decoding], dtype=np.int64)
            h, pre_mix = layer(h, pre_mix, batch)
        last = np.array([s.rows.stop - 1 for s in seqs])
        if not all_logits and not np.array_equal(last, np.arange(h.shape[0])):  # (decode: every row)
            rows = ops.asarray(last, dtype=np.int64)
            h, pre_mix = h[rows], pre_mix[last] if pre_mix is not None else None
        logits = model.head(h, pre_mix)
        ops.join_all()  # (a captured step must join every part it forked)
        return logits

    def _replay_start(self) -> int:
        """First layer of V4.1's "bounded replay": after the last KV source no layer publishes
        anything later layers read except its own window, so layer l only needs the trailing
        in(l) = 1 + (n_layers - l) * (window - 1) rows of a chunk (its window for the state plus
        the window of every row the next layer needs). Exact, and O(1) in the prompt length."""
        last = self.model.last_kv_source
        return self.cfg.num_layers if not self.bounded_replay or last < 0 else last + 1

    # ---- planning the next decode step ahead ---------------------------------------------------
    def prepare_next(self, states: list[SequenceState]) -> None:
        """The token-independent host work of a decode step of `states` (one new token each), done
        ahead: its plan (decode_plan.plan_decode, whose bookkeeping of the grown state is set aside
        again until that step: state.plan_marks / restore_marks; the copies into grown buffers go
        out now, after the step before, and are simply unused if the plan is), its RoPE tables and
        the backend's staging of them (ops.prestage: the tables packed, token ids to come).
        forward() takes it if its next call is that step, with nothing changed in between."""
        cfg, ops, model = self.cfg, self.ops, self.model
        self._next = None
        sources = [li for li, kind in enumerate(cfg.layer_kinds) if kind == "source"]  # (their rows grow)
        before = plan_marks(states, sources)
        growth: list = []
        try:
            window, layers = plan_decode(cfg, states, ops.xp, growth, model.rope.compressed,
                                         self.plan.heads[1] > self.plan.heads[0])
            after = plan_marks(states, sources, like=before)
        finally:
            restore_marks(before)
        ops.copy_rows(growth)
        pos = np.array([st.position for st in states], np.int64)
        hasher = model.hasher
        inputs = StepInputs(ids=np.zeros(len(states), np.int64),
                            hash_ids=np.zeros((len(states), *hasher.row_shape), np.int64) if hasher else None,
                            layers=layers, rope=model.rope.rows(pos), window=window, dec_rows=None)
        self._next = _Ahead(list(states), pos, before, after, inputs, ops.prestage(inputs))

    def _take_next(self, states: list[SequenceState], pos: np.ndarray) -> _Ahead | None:
        """The plan made ahead (prepare_next) if it is this decode step's, its bookkeeping applied;
        else None (it is dropped either way)."""
        nxt, self._next = self._next, None
        if (nxt is None or len(nxt.states) != len(states) or any(a is not b for a, b in zip(nxt.states, states,
                                                                                         strict=True))
                or not np.array_equal(nxt.pos, pos) or not marks_hold(nxt.before)):
            return None
        restore_marks(nxt.after)
        self.ahead_used += 1
        return nxt
