"""The engine's run-time knobs, in one typed object given at construction.

Everything else about how a step runs has one path. The environment variables below are read
here and nowhere else (Settings.from_env), once, when a backend or engine is built:

| variable            | field          | what it is for                                                         |
|---------------------|----------------|------------------------------------------------------------------------|
| DSUF_GRAPHS=0       | cuda_graphs    | run decode steps eagerly instead of replaying CUDA graphs (profilers)  |
| DSUF_GRAPH_BUCKETS  | graph_buckets  | how many batch sizes keep captured decode graphs (LRU; default 8)      |
| DSUF_DIRECT_ALLOC=1 | direct_alloc   | every device array its own cudaMalloc, so compute-sanitizer sees its   |
|                     |                | bounds (`make gpu-memcheck`); slow, for checking only                  |

`numerics` (no variable: `--numerics` of run, serve and bench) is how the forward computes:
`deepseek` (the default) as DeepSeek's reference inference does, the numerics the model was trained
for (bf16 activations, FP8 block-32 activation quantization before FP8 / FP4 linears;
engine/ops/deepseek_ops.py, engine/ops/gpu/deepseek.py), or `exact` float32 (the bridge to the
transformers references). Both backends implement both, so they give the same tokens for the same
checkpoint and flags.

Deployment settings of the server (DSUF_REDIS_URL, DSUF_API_KEY) are read by its command line
(server/app.py) and documented in README.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

NUMERICS = ("exact", "deepseek")
DEFAULT_NUMERICS = "deepseek"


@dataclass(frozen=True)
class Settings:
    cuda_graphs: bool = True
    graph_buckets: int = 8
    direct_alloc: bool = False
    numerics: str = DEFAULT_NUMERICS

    def __post_init__(self) -> None:
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, not {self.numerics!r}")
        if self.graph_buckets < 1:
            raise ValueError(f"graph_buckets must be >= 1, not {self.graph_buckets}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> Settings:
        """The defaults, changed by the DSUF_* variables of `env` (os.environ) and then `overrides`."""
        env = os.environ if env is None else env
        s = cls(cuda_graphs=_flag(env, "DSUF_GRAPHS", True), graph_buckets=int(env.get("DSUF_GRAPH_BUCKETS", "8")),
                direct_alloc=_flag(env, "DSUF_DIRECT_ALLOC", False))
        return replace(s, **overrides)


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    v = env.get(name)
    if v is None or v == "":
        return default
    if v not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, not {v!r}")
    return v == "1"
