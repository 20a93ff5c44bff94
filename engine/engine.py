"""Engine: a loaded checkpoint (config, weights on a backend, tokenizer) behind one step() call.

This is what the server and the CLI talk to. `step` is one batched forward of several sequences
at different positions; it blocks (numpy) and must run on one worker thread at a time.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from engine.checkpoint import Checkpoint
from engine.config import ModelConfig, load_config
from engine.model import Model
from engine.sampling import SamplingParams, make_rngs, sample
from engine.state import SequenceState
from engine.tokenizer import Tokenizer

log = logging.getLogger("dsuf.engine")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CKPT = REPO_ROOT / "models" / "demo-v41"


def make_ops(backend: str):
    if backend == "numpy":
        from engine.backends.numpy_ops import NumpyOps

        return NumpyOps()
    if backend == "cupy":
        from engine.backends.cupy_ops import CupyOps

        return CupyOps()
    raise ValueError(f"unknown backend {backend!r} (available: numpy, cupy)")


class Engine:
    def __init__(self, config: ModelConfig, model: Model, tokenizer: Tokenizer, model_id: str, ckpt_dir: Path):
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.model_id, self.ckpt_dir = model_id, ckpt_dir

    @classmethod
    def load(cls, ckpt_dir: str | Path | None = None, backend: str = "numpy") -> Engine:
        """Load a checkpoint directory (None: the embedded demo-v41 model)."""
        path = Path(ckpt_dir) if ckpt_dir is not None else DEFAULT_CKPT
        cfg = load_config(path)
        tok_json = path / "tokenizer.json"
        if not tok_json.is_file():
            raise FileNotFoundError(f"{tok_json}: checkpoint has no tokenizer.json")
        tokenizer = Tokenizer.from_dir(path)
        model = Model(cfg, Checkpoint(path, block_size=cfg.weight_block_size), make_ops(backend), tok_json)
        log.info("loaded %s (%s, %d layers, hidden %d) on %s", path.name, cfg.arch, cfg.num_layers,
                 cfg.hidden_size, backend)
        return cls(cfg, model, tokenizer, path.name, path)

    # ---- the engine contract ------------------------------------------------------------
    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.config.eos_token_ids) | {self.tokenizer.eos_id}))

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    def new_state(self) -> SequenceState:
        return self.model.new_state()

    def step(self, states: list[SequenceState], chunks: list[list[int]]) -> np.ndarray:
        """One batched forward: returns float32 logits [len(states), vocab] at each chunk's last token."""
        return np.stack(self.model.forward(states, chunks))

    # ---- convenience for the CLI and tests ------------------------------------------------
    def generate(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams | None = None,
                 stop_at_eos: bool = True, state: SequenceState | None = None) -> list[int]:
        """Prefill the prompt, then decode up to max_tokens tokens (one sequence)."""
        params = params or SamplingParams(temperature=0.0)
        rng = make_rngs(params.seed)[0]
        st = state or self.new_state()
        logits = self.step([st], [list(prompt_ids)])[0]
        out: list[int] = []
        while len(out) < max_tokens:
            tok, _, _ = sample(logits, params, out, rng)
            out.append(tok)
            if stop_at_eos and tok in self.eos_ids or len(out) >= max_tokens:
                break
            logits = self.step([st], [[tok]])[0]
        return out
