"""Tensor parallelism over the GPUs of one process: one rank per device, one Python thread.

Rank r's ModelRunner (engine/runtime/runner.py, its ShardPlan slice of the weights read straight
from the safetensors files) lives on devices[r] with its own CupyOps. The lockstep driver
(engine/parallel/lockstep.py run_ranks) resumes each rank's forward under its device until the
next collective; sums are NCCL all-reduces (cupy.cuda.nccl, in place, one group call over all
ranks on each device's current stream), and the logits gather is a host concatenation of the
ranks' vocabulary slices, or (step_sample) a device-to-device gather onto the first GPU, where
the tokens are drawn.

Sequence state: K=V, compressors, indexer and Engram are replicated, so every rank holds an
identical copy of a sequence's state. The caller sees one SequenceState per sequence: rank 0's;
the others' copies ride along in its `replicas`. A state restored from bytes (host arrays) is
placed on every device before its first step.

A decode step alone (one token per sequence) comes to the driver as one StepRegion per rank. Each
rank's step is captured as one CUDA graph, the NCCL all-reduces inside it (one group call over
the ranks' capturing streams), and later steps replay every rank's graph: one launch per GPU.

The same driver runs several ranks on one device (devices [0, 0]): collectives are then device
sums instead of NCCL, which lets one GPU test the sharded path (their steps are never captured:
each rank's capture would read another's stream).
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np

from engine.parallel.draft import ShardedDraft, rank_targets
from engine.parallel.lockstep import Collective, RankComm, combine, run_ranks, run_steps
from engine.parallel.shard import ShardPlan
from engine.state.sequence import SequenceState, place

log = logging.getLogger("dsuf.tp")


class GpuTP:
    """A model sharded over `devices` (one rank each); the Model-like forward / new_state."""

    def __init__(self, cfg, ckpt, devices: list[int], tokenizer_json=None, store_quantized: bool = True,
                 make_ops=None, expert_split: str = "ep") -> None:
        import cupy as cp

        from engine.ops.gpu.ops import CupyOps
        from engine.runtime.runner import ModelRunner

        self.cp, self.cfg, self.devices = cp, cfg, list(devices)
        self.size = len(self.devices)
        make_ops = make_ops or CupyOps
        self.ranks = []
        for r, dev in enumerate(self.devices):
            with cp.cuda.Device(dev):
                ops = make_ops()
                ops.comm = RankComm()
                self.ranks.append(ModelRunner(cfg, ckpt, ops, tokenizer_json, store_quantized,
                                              plan=ShardPlan.make(cfg, r, self.size, expert_split)))
        self.model_key = self.ranks[0].model_key
        # what each rank's work runs under: its device, and while its step is captured, the capture
        self._ctx = [self._device(d) for d in self.devices]
        self.comms = None
        if len(set(self.devices)) == self.size:  # one rank per GPU: NCCL (also for one rank)
            from cupy.cuda import nccl

            self.nccl = nccl
            self.comms = nccl.NcclCommunicator.initAll(self.devices)
            log.info("NCCL %s communicators over GPUs %s", nccl.get_version(), self.devices)
        # the DSpark draft, each rank's on its device (engine/parallel/draft.py)
        self.draft = ShardedDraft(self) if self.ranks[0].model.dspark is not None else None

    # ---- the Model interface the Engine uses -------------------------------------------------
    @property
    def ops(self):
        return self.ranks[0].ops

    def state_bytes_per_token(self):
        return self.ranks[0].state_bytes_per_token()

    def new_state(self) -> SequenceState:
        states = []
        for dev, m in zip(self.devices, self.ranks, strict=True):
            with self.cp.cuda.Device(dev):
                states.append(m.new_state())
        states[0].replicas = states[1:]
        return states[0]

    def forward(self, states: list[SequenceState], chunks: list, all_logits: bool = False,
                on_device: bool = False, targets: dict | None = None, verify: bool = False) -> list[np.ndarray]:
        """ModelRunner.forward over every rank (targets: a RankTargets from `draft.targets`, each
        rank filling its own on its device)."""
        per_rank, tg = self._per_rank(states), rank_targets(targets, self.size)
        outs = self.lockstep([lambda r=r, m=m: m.forward(per_rank[r], chunks, all_logits, on_device, tg[r], verify)
                              for r, m in enumerate(self.ranks)])
        return outs[0]

    def lockstep(self, fns: list) -> list:
        """One function per rank run to its end under its device, the collectives through NCCL
        (or device sums); each one's result."""
        return run_ranks(fns, reduce=self._reduce, contexts=self._ctx)

    def step_sample(self, states: list[SequenceState], chunks: list, jobs: list) -> list:
        """ModelRunner.step_sample: the vocabulary slices are gathered on rank 0's device and drawn there."""
        logits = self.forward(states, chunks, on_device=True)
        with self.cp.cuda.Device(self.devices[0]):
            return self.ranks[0].ops.sample_rows(logits, jobs)

    # ---- internals ---------------------------------------------------------------------------
    def _gather_on_first(self, msgs: list[Collective]):
        """The ranks' logits slices [rows, v_r] (device arrays), joined along the vocabulary on
        devices[0]: each other rank's slice is copied device to device once its stream made it."""
        cp, first = self.cp, self.devices[0]
        parts = []
        for dev, m in zip(self.devices, msgs, strict=True):
            with cp.cuda.Device(dev):
                src = cp.ascontiguousarray(m.value, dtype=cp.float32)
                if dev == first:
                    parts.append(src)
                    continue
                cp.cuda.get_current_stream().synchronize()
            with cp.cuda.Device(first):
                parts.append(cp.empty(src.shape, dtype=cp.float32))
                parts[-1].data.copy_from_device_async(src.data, src.nbytes)
        with cp.cuda.Device(first):
            return cp.concatenate(parts, axis=-1)

    def _gather_everywhere(self, msgs: list[Collective]) -> list:
        """The joined slices on the first GPU for the first rank, and a copy on its own device for
        each other rank: the DSpark draft's Markov loop goes on from the gathered logits on every
        rank, and may write them in place."""
        cp, whole = self.cp, self._gather_on_first(msgs)
        out = [whole]
        for dev in self.devices[1:]:
            if dev == self.devices[0]:
                out.append(whole.copy())
                continue
            cp.cuda.Device(self.devices[0]).synchronize()
            with cp.cuda.Device(dev):
                out.append(cp.empty(whole.shape, dtype=whole.dtype))
                out[-1].data.copy_from_device_async(whole.data, whole.nbytes)
        return out

    def _device(self, dev: int):
        return lambda: self.cp.cuda.Device(dev)

    def _per_rank(self, states: list[SequenceState]) -> list[list[SequenceState]]:
        """Rank r's copy of every sequence's state, made on first sight (a state restored from
        bytes, or one made outside this model): a host copy placed on each rank's device."""
        for st in states:
            if len(st.replicas) == self.size - 1:
                continue
            host = st.host_copy()
            reps = []
            for dev, m in zip(self.devices[1:], self.ranks[1:], strict=True):
                with self.cp.cuda.Device(dev):
                    rep = host.clone()
                    place(rep, m.ops.placement, m.ops.asarray)
                reps.append(rep)
            st.replicas = reps
        return [list(states)] + [[st.replicas[r - 1] for st in states] for r in range(1, self.size)]

    def _reduce(self, msgs: list[Collective]) -> list:
        op = msgs[0].op
        cp = self.cp
        if op == "step":
            return self._steps(msgs)
        if op == "gather" and isinstance(msgs[0].value, cp.ndarray):
            return self._gather_everywhere(msgs)
        if op != "sum":
            return [combine(msgs)] * self.size  # the logits gather: host arrays
        parts = []
        for ctx, m in zip(self._ctx, msgs, strict=True):
            with ctx():
                parts.append(cp.ascontiguousarray(m.value, dtype=cp.float32))
        if self.comms is None:  # ranks share a device: a plain sum, one copy per rank
            total = parts[0].copy()
            for p in parts[1:]:
                total += p
            return [total] + [total.copy() for _ in parts[1:]]
        nccl = self.nccl
        nccl.groupStart()
        for ctx, comm, p in zip(self._ctx, self.comms, parts, strict=True):
            with ctx():  # (each rank's current stream: a capturing one while its step is captured)
                comm.allReduce(p.data.ptr, p.data.ptr, p.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                               cp.cuda.get_current_stream().ptr)
        nccl.groupEnd()
        return parts

    # ---- a decode step as one graph per rank -------------------------------------------------
    def _steps(self, msgs: list[Collective]) -> list:
        """Every rank's StepRegion: eagerly on its first sight, captured (all ranks at once, the
        all-reduces inside) on its second, replayed after that."""
        if self.comms is None or not steps_graphed(msgs):
            return run_steps(msgs, self._reduce, self._ctx)
        steps = [m.value for m in msgs]
        staged, sigs, modes = [], [], []
        for ctx, s in zip(self._ctx, steps, strict=True):
            with ctx():
                i64, f32, layout = s.ops._upload(s.inputs)
                staged.append((i64, f32, layout))
                sigs.append(s.ops.graphs.signature((s.key, s.inputs.signature()), (i64, f32)))
                modes.append(s.ops.graphs.mode(sigs[-1], s.rows, (i64, f32)))
        mode = modes[0] if all(m == modes[0] for m in modes) else "eager"
        if mode == "capture":  # (a capture runs nothing: the graphs are then replayed)
            mode = "replay" if self._capture(steps, sigs, staged) else "eager"
        if mode == "replay":
            outs = []
            for ctx, s, sig, (i64, f32, _) in zip(self._ctx, steps, sigs, staged, strict=True):
                with ctx():
                    outs.append(s.ops.graphs.replay(sig, _not_direct, (i64, f32)))
            return outs
        return self._run_inline(steps, [layout.views(i64, f32) for i64, f32, layout in staged])

    def _capture(self, steps: list, sigs: list, staged: list) -> bool:
        """Capture every rank's step (its inputs copied into its graph's own buffers) with the
        collectives inside; whether every rank kept its graph (else all stay eager)."""
        cp = self.cp
        caps = []
        try:
            for ctx, s, sig, (i64, f32, _) in zip(self._ctx, steps, sigs, staged, strict=True):
                with ctx():
                    caps.append(s.ops.graphs.begin_capture(sig, (i64, f32), s.rows, keep=s.run))
        except Exception as e:  # noqa: BLE001 - end the captures begun; the steps run eagerly
            for dev, s, c in zip(self.devices, steps, caps, strict=False):
                with cp.cuda.Device(dev):
                    s.ops.graphs.end_capture(c, None, e)
            for s, sig in zip(steps, sigs, strict=True):
                s.ops.graphs.forget(sig)
            return False
        plain = self._ctx
        self._ctx = [_within(self._device(d), s.ops.graphs, c)
                     for d, s, c in zip(self.devices, steps, caps, strict=True)]
        outs, err = [None] * self.size, None
        try:
            outs = self._run_inline(steps, [lay.views(*c.inputs) for c, (_, _, lay) in zip(caps, staged, strict=True)])
        except Exception as e:  # noqa: BLE001 - the steps run eagerly instead
            err = e
        finally:
            self._ctx = plain
        kept = []
        for dev, s, c, out in zip(self.devices, steps, caps, outs, strict=True):
            with cp.cuda.Device(dev):
                kept.append(s.ops.graphs.end_capture(c, out, err))
        if not all(kept):
            for s, sig in zip(steps, sigs, strict=True):
                s.ops.graphs.forget(sig)
            return False
        return True

    def _run_inline(self, steps: list, views: list) -> list:
        """Every rank's step over its staged views (eagerly, or inside its capture), the
        collectives through _reduce under each rank's current context."""
        return run_ranks([lambda s=s, v=v: s.run(v) for s, v in zip(steps, views, strict=True)], self._reduce,
                         self._ctx)


def steps_graphed(msgs: list[Collective]) -> bool:
    """Whether the ranks' backends replay steps as graphs (Settings.cuda_graphs)."""
    return all(m.value.ops.graphs.enabled for m in msgs)


def _within(device_ctx, graphs, cap):
    """A rank's context while its step is captured: its device, then its capture's stream and
    graph memory pool (entered anew around each resumption)."""
    @contextlib.contextmanager
    def enter():
        with device_ctx(), graphs.capturing(cap):
            yield
    return enter


def _not_direct(*_):
    raise RuntimeError("a captured decode step's inputs are always copies, never read in place")

