"""Limits of the GPU backend's CUDA-graph cache, importable without cupy: the memory planner
(engine/runtime/memory_plan.py) sizes the memory the graphs keep from them on any machine."""

from __future__ import annotations

MAX_GRAPH_ROWS = 64  # steps of more rows (prefill) run eagerly: their shapes rarely repeat
