"""Where two backends part: run one forward of a checkpoint on two backends / numerics and compare
every top-level op's output, call by call (the k-th call of an op on one against the k-th on the
other), printing the ops whose outputs differ by more than --tol (norm-relative).

  python tools/dev/compare_ops.py CKPT --a numpy:deepseek --b cupy:deepseek [--prompt 300] [--decode 3]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.bench_parts import watching  # noqa: E402

OPS = ("linear", "grouped_linear", "embed", "rmsnorm", "rope", "norm_rope_quant", "engram_mix", "hc_mixes",
       "hc_head_pre", "hc_collapse_norm", "hc_expand", "route", "swiglu_mlp", "moe", "attention_ranges",
       "attention_decode", "attend_decode", "indexer_scores", "indexer_scores_spans", "topk_mask", "gated_pool",
       "gated_pool_rows")


def _record(log: dict):
    """A watching() callback: each top-level call's outputs land in log[name] (host arrays)."""
    def around(ops, name: str, call):
        out = call()
        outs = out if isinstance(out, tuple) else (out,)
        log[name].append([np.asarray(ops.to_host(o), np.float64) for o in outs])
        return out
    return around


def _run(ckpt: str, spec: str, prompt: list[int], decode: int) -> dict:
    from engine.runtime.engine import Engine
    from engine.settings import Settings

    backend, numerics = spec.split(":")
    eng = Engine.load(ckpt, gpus=[0] if backend == "cupy" else None,
                      settings=Settings.from_env(numerics=numerics, cuda_graphs=False))
    model = eng.model
    log: dict = defaultdict(list)
    with watching([model.ops], _record(log), OPS):
        st = model.new_state()
        logits = model.forward([st], [prompt])[0]
        for _ in range(decode):
            model.forward([st], [[int(np.argmax(np.asarray(model.ops.to_host(logits))))]])
    return log


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--a", default="numpy:deepseek")
    ap.add_argument("--b", default="cupy:deepseek")
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--decode", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-2)
    a = ap.parse_args()
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 4000, a.prompt)]
    la, lb = _run(a.ckpt, a.a, prompt, a.decode), _run(a.ckpt, a.b, prompt, a.decode)
    for name in OPS:
        calls = list(zip(la.get(name, []), lb.get(name, []), strict=False))
        errs = []
        for ya, yb in calls:
            e = 0.0
            for x, y in zip(ya, yb, strict=False):
                if x.shape != y.shape:
                    e = float("inf")
                    break
                fin = np.isfinite(x) & np.isfinite(y)
                d = np.linalg.norm(np.where(fin, x - y, 0)) / max(np.linalg.norm(np.where(fin, x, 0)), 1e-30)
                e = max(e, float(d), 0.0 if (np.isfinite(x) == np.isfinite(y)).all() else float("inf"))
            errs.append(e)
        if errs:
            bad = [i for i, e in enumerate(errs) if e > a.tol]
            print(f"{name:22s} calls {len(la.get(name, []))}/{len(lb.get(name, []))}  worst {max(errs):.2e}  "
                  f"first over tol: {bad[:6]}  errs {[f'{e:.1e}' for e in errs[:8]]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
