"""Engine.warm_up on the GPU (the demo model, as serve runs it before /readyz): it runs, it takes
the prompt chunk the memory plan chose, and it leaves no trace: a prompt's greedy tokens are those
of an engine that did not warm up. Prints the warm-up's seconds and a first prompt's after it.
Skipped where CuPy or a GPU is absent (CI)."""

from __future__ import annotations

import time
from pathlib import Path

from gpu_required import require_gpu

cp = require_gpu()

from engine.runtime.engine import Engine  # noqa: E402
from engine.runtime.sampling import SamplingParams  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-v41"


def test_warm_up_on_the_gpu_leaves_no_trace():
    greedy = SamplingParams(temperature=0.0)
    cold = Engine.load(DEMO, gpus=[0], max_seqs=4, max_context=8192)
    prompt = cold.tokenizer.encode("A warm-up runs on a scratch sequence " * 40)
    want = cold.generate(prompt, 16, greedy, speculative=False)  # (no warm-up: compiled as it goes)
    eng = Engine.load(DEMO, gpus=[0], max_seqs=4, max_context=8192)
    seconds = eng.warm_up()
    assert seconds > 0
    t0 = time.perf_counter()
    got = eng.generate(prompt, 16, greedy, speculative=False)
    print(f"warm-up {seconds:.2f} s (chunk {eng.prefill_chunk}); then a {len(prompt)}-token prompt and 16 tokens "
          f"in {time.perf_counter() - t0:.3f} s")
    assert got == want
