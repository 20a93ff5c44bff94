"""Engine: a loaded checkpoint (config, weights on a backend, tokenizer) behind one step() call.

This is what the server and the CLI talk to. `step` is one batched forward of several sequences
at different positions; it blocks (numpy) and must run on one worker thread at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import numpy as np

from engine.checkpoint.progress import LoadProgress
from engine.checkpoint.reader import Checkpoint
from engine.model.config import ModelConfig, load_config
from engine.runtime.runner import ModelRunner as Model
from engine.runtime.sampling import SampleJob, SamplingParams, make_rngs
from engine.runtime.spec_decode import SpecStats, draft_of, speculative_generate
from engine.settings import DEFAULT_NUMERICS, Settings
from engine.state.sequence import SequenceState
from engine.text.tokenizer import Tokenizer

log = logging.getLogger("dsuf.engine")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CKPT = REPO_ROOT / "models" / "demo-v41"
# The id a checkpoint is served under by default: DeepSeek's API name for its architecture.
CANONICAL_IDS = {"v41": "deepseek-v4.1-flash", "v4": "deepseek-v4-flash"}
# Prompt tokens a step prefills by default. On the CPU a small budget keeps the streams decoding beside a
# long prompt responsive. On GPUs a chunk's GEMMs want rows: a MoE's experts average chunk x top-k /
# experts rows, and a grouped GEMM's 128-row tiles run near their rate only once those fill; so the
# largest of GPU_PREFILL_CHUNKS whose workspace the memory plan fits (the indexer's scores grow with
# chunk x context).
CPU_PREFILL_CHUNK = 512
GPU_PREFILL_CHUNKS = (16384, 8192, 4096, 2048, 1024, 512)
GPU_UNPLANNED_CHUNK = 4096  # the cupy backend loaded without --gpus (no memory plan): bench's old chunk


def canonical_model_id(cfg: ModelConfig, ckpt_dir: Path) -> str:
    """config.json's explicit `served_model_name` when it carries one, else the architecture's
    canonical name (never the directory's name, which clients cannot guess)."""
    try:
        raw = json.loads((ckpt_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raw = {}
    name = raw.get("served_model_name") if isinstance(raw, dict) else None
    if isinstance(name, str) and name.strip():
        return name.strip()
    return CANONICAL_IDS.get(cfg.arch, f"deepseek-{cfg.arch}")


def make_ops(backend: str, settings: Settings | None = None):
    """The backend's ops in the numerics settings.numerics names (settings None: Settings.from_env())."""
    settings = Settings.from_env() if settings is None else settings
    if backend == "numpy":
        if settings.numerics == "deepseek":
            from engine.ops.deepseek_ops import DeepseekOps

            return DeepseekOps()
        from engine.ops.numpy_ops import NumpyOps

        return NumpyOps()
    if backend == "cupy":
        if settings.numerics == "deepseek":
            from engine.ops.gpu.deepseek import DeepseekCupyOps

            return DeepseekCupyOps(settings)
        from engine.ops.gpu.ops import CupyOps

        return CupyOps(settings)
    raise ValueError(f"unknown backend {backend!r} (available: numpy, cupy)")


class Engine:
    def __init__(self, config: ModelConfig, model: Model, tokenizer: Tokenizer, model_id: str, ckpt_dir: Path,
                 device: int | None = None):
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.model_id, self.ckpt_dir = model_id, ckpt_dir
        self.device = device  # CUDA device id (cupy backend with --gpus), else None
        self.memory_plan = None  # engine.runtime.memory_plan.MemoryPlan when loaded with gpus
        self.prefill_chunk = CPU_PREFILL_CHUNK  # prompt tokens a step prefills (the server's default budget)
        self.last_acceptance: SpecStats | None = None  # the last speculative generate()'s figures

    @classmethod
    def load(cls, ckpt_dir: str | Path | None = None, backend: str = "numpy",
             gpus: str | list[int] | None = None, *, max_seqs: int = 32, max_context: int | None = None,
             prefill_chunk: int | None = None, expert_split: str = "ep", settings: Settings | None = None,
             progress: LoadProgress | None = None) -> Engine:
        """Load a checkpoint directory (None: the embedded demo-v41 model). With `gpus` (ids or
        '0,1'): the cupy backend, after checking the memory plan for max_seqs sequences of
        max_context tokens with prompt chunks of prefill_chunk tokens (default: the largest of
        GPU_PREFILL_CHUNKS that fits) against each GPU's free memory (raises
        engine.runtime.memory_plan.MemoryPlanError when it does not fit); several GPUs split the
        routed experts by expert id or by width (`expert_split`, engine/parallel/shard.py).
        settings: the backends' knobs (engine/settings.py; default: Settings.from_env()), numerics
        among them.
        progress: told of every tensor read (engine/checkpoint/progress.py); the caller prints it."""
        path = Path(ckpt_dir) if ckpt_dir is not None else DEFAULT_CKPT
        cfg = load_config(path)
        tok_json = path / "tokenizer.json"
        if not tok_json.is_file():
            raise FileNotFoundError(f"{tok_json}: checkpoint has no tokenizer.json")
        tokenizer = Tokenizer.from_dir(path)
        ckpt = Checkpoint(path, block_size=cfg.weight_block_size)
        ckpt.progress = progress  # read by engine.checkpoint.loader.load_weights (every rank)
        # ---- --gpus: memory plan, then one device, or one tensor-parallel rank per device ----
        device, plan, ids = None, None, []
        if gpus is not None:
            ids, plan = _plan_gpus(cfg, ckpt, gpus, max_seqs, max_context or cfg.max_position_embeddings,
                                   prefill_chunk, expert_split, (settings or Settings.from_env()).numerics)
            backend, device = "cupy", ids[0]
        if len(ids) > 1:
            from engine.parallel.gpu import GpuTP

            model = GpuTP(cfg, ckpt, ids, tok_json, expert_split=expert_split,
                          make_ops=lambda: make_ops(backend, settings))
        elif device is not None:
            import cupy

            with cupy.cuda.Device(device):
                model = Model(cfg, ckpt, make_ops(backend, settings), tok_json)
        else:
            model = Model(cfg, ckpt, make_ops(backend, settings), tok_json)
        log.info("loaded %s (%s, %d layers, hidden %d) on %s%s, %s numerics", path.name, cfg.arch, cfg.num_layers,
                 cfg.hidden_size, backend, f" (GPUs {ids}, tensor parallel)" if len(ids) > 1
                 else f" (GPU {device})" if device is not None else "",
                 (settings or Settings.from_env()).numerics)
        if progress is not None:
            progress.finish()
        eng = cls(cfg, model, tokenizer, canonical_model_id(cfg, path), path, device=device)
        eng.memory_plan = plan
        eng.prefill_chunk = (plan.prefill_chunk if plan is not None else prefill_chunk
                             or (GPU_UNPLANNED_CHUNK if backend == "cupy" else CPU_PREFILL_CHUNK))
        return eng

    def warm_up(self) -> float:
        """Run what the first requests would otherwise pay for, before the engine reports ready:
        on a GPU, compiling the kernels (NVRTC, on a cold cache seconds per module) and allocating
        a prompt chunk's workspace. Returns its seconds (0 on the numpy backend: nothing to do)."""
        if self.device is None:
            return 0.0
        with self._on_device():
            return warm_up(self.model, self.config.vocab_size, self.prefill_chunk, self.context_length)

    def _on_device(self):
        """The engine's CUDA device as the current one (CuPy's current device is per thread, and
        step() runs on a worker thread); a no-op context without one."""
        if self.device is None:
            return contextlib.nullcontext()
        import cupy

        return cupy.cuda.Device(self.device)

    # ---- the engine contract ------------------------------------------------------------
    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.config.eos_token_ids) | {self.tokenizer.eos_id}))

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    def new_state(self) -> SequenceState:
        with self._on_device():
            return self.model.new_state()

    def step(self, states: list[SequenceState], chunks: list[list[int]]) -> np.ndarray:
        """One batched forward: returns float32 logits [len(states), vocab] at each chunk's last token."""
        with self._on_device():
            return np.stack(self.model.forward(states, chunks))

    def step_sample(self, states: list[SequenceState], chunks: list[list[int]], jobs: list[SampleJob]) -> list:
        """One batched forward, then one token per job (job.row: an index into states), drawn
        where the logits are (on the GPU with the cupy backend). Returns per job
        (token, logprob | None, top_logprobs | None) as engine.runtime.sampling.sample does."""
        with self._on_device():
            return self.model.step_sample(states, chunks, jobs)

    # ---- convenience for the CLI and tests ------------------------------------------------
    def generate(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams | None = None,
                 stop_at_eos: bool = True, state: SequenceState | None = None,
                 speculative: bool | None = None) -> list[int]:
        """Prefill the prompt (in pieces of prefill_chunk tokens, as the server does), then decode up
        to max_tokens tokens (one sequence). speculative: decode with the checkpoint's DSpark draft
        (engine/runtime/spec_decode.py; None: where the checkpoint has draft layers); its figures
        are left in last_acceptance (else None)."""
        params = params or SamplingParams(temperature=0.0)
        rng = make_rngs(params.seed)[0]
        st = state or self.new_state()
        self.last_acceptance = None
        if speculative is None:
            speculative = draft_of(self.model) is not None
        if speculative:
            stats = SpecStats()
            with self._on_device():
                out = speculative_generate(self.model, prompt_ids, max_tokens, params,
                                           self.eos_ids if stop_at_eos else (), st, stats, rng,
                                           chunk=self.prefill_chunk)
            self.last_acceptance = stats
            return out
        out: list[int] = []
        chunk = list(prompt_ids)
        if max_tokens > 0:
            while len(chunk) > self.prefill_chunk:  # all but the prompt's last piece, nothing drawn
                self.step_sample([st], [chunk[:self.prefill_chunk]], [])
                chunk = chunk[self.prefill_chunk:]
        while len(out) < max_tokens:
            tok = self.step_sample([st], [chunk], [SampleJob(0, params, out, rng)])[0][0]
            out.append(tok)
            if stop_at_eos and tok in self.eos_ids:
                break
            chunk = [tok]
        return out


def warm_up(model: Model, vocab: int, chunk: int, context: int) -> float:
    """Two prompt chunks (the second attends to the first: the paths that read context) and one
    decode step of a scratch sequence, then its seconds. Kernels are compiled on first use and
    a decode step's graph captured at its first batch, so a model's first prompt of `chunk`
    tokens would otherwise wait for them."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    n = max(1, min(chunk, (context - 2) // 2))
    st = model.new_state()
    for _ in range(2):
        model.forward([st], [rng.integers(0, vocab, n)])
    # (the drawn token comes back to the host: the device work above has finished)
    model.step_sample([st], [[int(rng.integers(0, vocab))]], [SampleJob(0, SamplingParams(temperature=0.0), [], rng)])
    return time.perf_counter() - t0


def _plan_gpus(cfg: ModelConfig, ckpt: Checkpoint, gpus, max_seqs: int, max_context: int,
               prefill_chunk: int | None, expert_split: str = "ep", numerics: str = DEFAULT_NUMERICS):
    """--gpus: check the memory plan (one tensor-parallel rank per GPU) against the GPUs' free
    memory (MemoryPlanError if it does not fit); prefill_chunk None: the largest of
    GPU_PREFILL_CHUNKS that fits. Returns (the device ids, the plan)."""
    from engine.runtime import memory_plan as mp

    ids = mp.parse_gpus(gpus)
    free = mp.gpu_free_bytes(ids)
    plan = mp.check(mp.plan_largest_chunk(cfg, ckpt, len(ids), min(free), max_seqs, max_context,
                                          (prefill_chunk,) if prefill_chunk else GPU_PREFILL_CHUNKS,
                                          name=Path(ckpt.path).name,
                                          weights=mp.weight_bytes(cfg, ckpt, len(ids), expert_split),
                                          numerics=numerics))
    log.info("%s", plan.summary())
    return ids, plan
