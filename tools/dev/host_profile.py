#!/usr/bin/env python3
"""A V4.1 decode step's host work by part, on any CPU (a developer's tool; not the runtime).

  python tools/dev/host_profile.py CKPT [--batch 1,32] [--steps 20] [--rounds 5] [--rows 6]

On the numpy backend (CKPT: a narrow checkpoint with the layer structure of interest, e.g.
`dsuf.py tiny-model DIR --arch v41 --layers 2`), per batch size, the best of --rounds rounds of
--steps decode steps' mean time of each part the GPU backend runs on the host before its graph
replay: the plan (engine/state/decode_plan.py plan_decode), the Engram hashes with the look-back update,
the step's inputs (RoPE tables), the packing of its tables (engine/ops/gpu/staging.py pack, with
the numpy buffers' host addresses), the graph key (StepInputs.signature) and the draw's job table; then
the two parts of planning ahead: the next step planned (ModelRunner.prepare_next, which a GPU
overlaps with the step before) and that plan taken at the step (ModelRunner._take_next, serial). The GPU
machine's own split of a served step is `tools/dev/gpu_profile.py host`. --rows R > 1: a speculative
verify step instead, R rows a sequence ([last token, R - 1 drafts]) planned row by row under a trial
(engine/state/trial.py), which is put back after each step; a verify step is not planned ahead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PARTS = ("plan", "engram", "inputs", "pack", "key", "jobs", "ahead", "take")


def profile(ckpt: str, batch: int, steps: int, rounds: int, rows: int = 1) -> dict[str, float]:
    """Best-of-rounds mean seconds per decode step (rows > 1: verify step) of each part (PARTS)."""
    from engine.bench import GREEDY
    from engine.model.batch import Seq
    from engine.ops.gpu.sample_table import job_table
    from engine.ops.gpu.staging import pack
    from engine.runtime.engine import Engine
    from engine.runtime.sampling import SampleJob
    from engine.state import trial as trials
    from engine.state.decode_plan import StepInputs, plan_decode

    eng = Engine.load(ckpt)
    runner, cfg = eng.model, eng.config
    model = runner.model
    if cfg.arch != "v41":
        raise SystemExit("the decode plan is V4.1's")
    rng = np.random.default_rng(0)
    states = [runner.new_state() for _ in range(batch)]
    runner.forward(states, [rng.integers(0, cfg.vocab_size, 40 + 3 * i) for i in range(batch)])
    toks = [rng.integers(0, cfg.vocab_size, rows).astype(np.int64) for _ in range(batch)]
    jobs = [SampleJob(i, GREEDY, [], rng) for i in range(batch * rows)]
    best = dict.fromkeys(PARTS, float("inf"))
    for _ in range(rounds):
        spent = dict.fromkeys(PARTS, 0.0)
        for _ in range(steps):
            seqs = [Seq(st, slice(rows * i, rows * (i + 1)), st.position + np.arange(rows))
                    for i, st in enumerate(states)]
            marks = [trials.begin(st) for st in states] if rows > 1 else None
            t0 = time.perf_counter()
            win, layers = plan_decode(cfg, states, model.ops.xp, [], model.rope.compressed,
                                      runner.plan.heads[1] > runner.plan.heads[0], [rows] * batch if marks else None,
                                      [] if marks else None)
            t1 = time.perf_counter()
            hashes = model.engram_hashes(seqs, toks) if model.hasher else None
            t2 = time.perf_counter()
            pos = np.concatenate([s.pos for s in seqs])
            inputs = StepInputs(ids=np.concatenate(toks), hash_ids=hashes, layers=layers, window=win, dec_rows=None,
                                rope=model.rope.rows(pos))
            t3 = time.perf_counter()
            pack(inputs)
            t4 = time.perf_counter()
            inputs.signature()
            t5 = time.perf_counter()
            job_table(jobs, cfg.vocab_size)
            t6 = time.perf_counter()
            stamps = [t0, t1, t2, t3, t4, t5, t6]
            if marks is not None:  # (a verify step: the trial put back, not planned ahead)
                for st, tr in zip(states, marks, strict=True):
                    trials.restore(st, tr)
            else:
                for st in states:  # (planned but not run: the next step plans the next position)
                    st.position += 1
                runner.prepare_next(states)
                stamps.append(time.perf_counter())
                if runner._take_next(states, np.array([st.position for st in states], np.int64)) is None:
                    raise RuntimeError("the plan made ahead was not taken")
                stamps.append(time.perf_counter())
                for st in states:
                    st.position += 1
            for part, a, b in zip(PARTS, stamps, stamps[1:], strict=False):  # (a verify step: the first six)
                spent[part] += b - a
        best = {p: min(best[p], spent[p] / steps) for p in PARTS}
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt")
    ap.add_argument("--batch", default="1,32", help="batch sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=1, help="rows a sequence (> 1: a speculative verify step)")
    args = ap.parse_args(argv)
    for b in (int(v) for v in args.batch.split(",")):
        got = profile(args.ckpt, b, args.steps, args.rounds, args.rows)
        ahead = (f"; planned ahead: ahead {got['ahead'] * 1e6:.0f}, take {got['take'] * 1e6:.0f} us"
                 if args.rows == 1 else "")
        print(f"b{b}" + (f" x {args.rows} rows" if args.rows > 1 else "") + ": "
              + ", ".join(f"{p} {got[p] * 1e6:.0f}" for p in PARTS[:6])
              + f" us (total {sum(got[p] for p in PARTS[:6]) * 1e6:.0f}){ahead}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
