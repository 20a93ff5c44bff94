"""The tensor-parallel code path on one GPU: CupyOps ranks of a sharded model (collectives as
sums on the same device) give the plain GPU path's logits. Skipped where CuPy or a GPU is absent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_required import require_gpu

cp = require_gpu()

from engine.checkpoint.reader import Checkpoint  # noqa: E402
from engine.model.config import load_config  # noqa: E402
from engine.ops.gpu.ops import CupyOps  # noqa: E402
from engine.parallel.simulated import SimulatedTP  # noqa: E402
from engine.runtime.runner import ModelRunner as Model  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-v41"


@pytest.mark.parametrize("size,split", [(1, "ep"), (2, "ep"), (4, "ep"), (2, "width"), (4, "width")])
def test_gpu_tp_ranks_match_plain_gpu_path(size: int, split: str) -> None:
    cfg = load_config(DEMO)
    ck, tok = Checkpoint(DEMO), DEMO / "tokenizer.json"
    ids = np.random.default_rng(size).integers(3, cfg.vocab_size, size=120).tolist()
    plain = Model(cfg, ck, CupyOps(), tok, store_quantized=False)
    ref = plain.forward([plain.new_state()], [ids], all_logits=True)[0]
    tp = SimulatedTP(cfg, ck, CupyOps, size, tok, store_quantized=False, expert_split=split)
    out = tp.forward([tp.new_state()], [ids], all_logits=True)[0]
    err = float(np.abs(out - ref).max() / np.abs(ref).max())
    print(f"TP{size} ({split} experts) on one GPU vs plain GPU path: relative error {err:.2e}")
    assert err < 1e-3
    assert (out.argmax(-1) == ref.argmax(-1)).mean() > 0.97


def _gpu_tp_case(devices: list[int]):
    from engine.parallel.gpu import GpuTP

    cfg = load_config(DEMO)
    ck, tok = Checkpoint(DEMO), DEMO / "tokenizer.json"
    ids = np.random.default_rng(len(devices)).integers(3, cfg.vocab_size, size=90).tolist()
    plain = Model(cfg, ck, CupyOps(), tok, store_quantized=False)
    tp = GpuTP(cfg, ck, devices, tok, store_quantized=False)
    sp, st = plain.new_state(), tp.new_state()
    errs = []
    ref, out = plain.forward([sp], [ids[:80]])[0], tp.forward([st], [ids[:80]])[0]
    for t in ids[80:]:  # decode steps (CUDA-graph regions on every rank) after the prefill
        errs.append(float(np.abs(out - ref).max() / np.abs(ref).max()))
        ref, out = plain.forward([sp], [[t]])[0], tp.forward([st], [[t]])[0]
    errs.append(float(np.abs(out - ref).max() / np.abs(ref).max()))
    return tp, st, errs


@pytest.mark.parametrize("devices", [[0], [0, 0], [0, 0, 0, 0]])
def test_gpu_tp_driver_matches_plain(devices: list[int]) -> None:
    """engine/tp_gpu.GpuTP: one rank per listed device (NCCL when they are distinct GPUs, device
    sums when ranks share one), prefill then decode, against the plain GPU path."""
    tp, _, errs = _gpu_tp_case(devices)
    print(f"GpuTP {devices} ({'NCCL' if tp.comms else 'device sums'}) vs plain GPU: worst relative error "
          f"{max(errs):.2e} over {len(errs)} steps")
    assert max(errs) < 1e-3


def test_gpu_tp_restored_state_replicates():
    """A state serialized from rank 0 and read back (host arrays) is placed on every rank and
    continues exactly like the live state."""
    from engine.state.sequence import SequenceState

    tp, st, _ = _gpu_tp_case([0, 0])
    restored = SequenceState.from_bytes(st.to_bytes(), model_key=tp.model_key)
    a = tp.forward([st], [[7]])[0]
    b = tp.forward([restored], [[7]])[0]
    assert len(restored.replicas) == 1
    assert np.array_equal(a, b)


def test_gpu_tp_step_graphs_equal_eager_steps():
    """Each rank's decode step captured as one CUDA graph with the NCCL all-reduces inside (here one
    rank, through NCCL) gives bit-identical logits and state to the same steps run eagerly."""
    from engine.parallel.gpu import GpuTP
    from engine.settings import Settings

    cfg = load_config(DEMO)
    ck, tok = Checkpoint(DEMO), DEMO / "tokenizer.json"
    ids = np.random.default_rng(7).integers(3, cfg.vocab_size, size=40).tolist()
    runs = {}
    for whole in (False, True):
        tp = GpuTP(cfg, ck, [0], tok, make_ops=lambda whole=whole: CupyOps(Settings(cuda_graphs=whole)))
        st = tp.new_state()
        out = [tp.forward([st], [ids[:30]])[0]]
        out += [tp.forward([st], [[t]])[0] for t in ids[30:]]
        runs[whole] = (np.stack(out), st.to_bytes(), tp.ranks[0].ops.graphs)
    assert np.array_equal(runs[False][0], runs[True][0])
    assert runs[False][1] == runs[True][1]
    g = runs[True][2]
    steps = [k for k, _ in g.captured(1) if isinstance(k[0], tuple) and k[0][0] == "decode"]
    assert steps and g.replays >= 5, (g.captures, g.replays)


@pytest.mark.skipif(cp.cuda.runtime.getDeviceCount() < 2, reason="needs 2 GPUs")
def test_gpu_tp_two_gpus_nccl() -> None:
    n = min(cp.cuda.runtime.getDeviceCount(), 8)
    tp, _, errs = _gpu_tp_case(list(range(n)))
    print(f"GpuTP over {n} GPUs with NCCL: worst relative error {max(errs):.2e}")
    assert tp.comms is not None and max(errs) < 1e-3


@pytest.mark.parametrize("size", [2, 4])
def test_simulated_tp_speculates_on_the_gpu(size: int) -> None:
    """Speculation over CupyOps ranks sharing one GPU (engine/parallel/draft.py through the
    simulated driver: the draft's collectives as device sums and gathers): greedy output equals
    the same ranks' plain greedy decoding, and every rank keeps the same state."""
    from engine.runtime.sampling import SamplingParams
    from engine.runtime.spec_decode import SpecStats, speculative_generate

    cfg = load_config(DEMO)
    tp = SimulatedTP(cfg, Checkpoint(DEMO), CupyOps, size, DEMO / "tokenizer.json")
    ids = np.random.default_rng(size).integers(3, cfg.vocab_size, size=30).tolist()
    st = tp.new_state()
    want = [int(np.argmax(tp.forward([st], [ids])[0]))]
    while len(want) < 48:
        want.append(int(np.argmax(tp.forward([st], [[want[-1]]])[0])))
    sp, stats = tp.new_state(), SpecStats()
    got = speculative_generate(tp, ids, 48, SamplingParams(temperature=0.0), [], sp, stats)
    print(f"TP{size} on one GPU, speculative: acceptance {stats.tokens_per_step:.2f} tokens/step")
    assert got == want
    assert sp.to_bytes() == st.to_bytes()
    assert all(r.to_bytes() == sp.to_bytes() for r in sp.replicas)
