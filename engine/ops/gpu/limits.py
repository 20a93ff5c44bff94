"""Limits of the GPU backend's CUDA-graph cache, importable without cupy: the memory planner
(engine/runtime/memory_plan.py) sizes the memory the graphs keep from them on any machine."""

from __future__ import annotations

# The most rows a captured step takes: a verify step of 32 sequences (the default --max-seqs) of
# DSpark's block 5 + 1. Prompt chunks never capture (the runner graphs decode steps alone), and
# the memory plan counts graph memory only up to the rows the engine's decode steps can have.
MAX_GRAPH_ROWS = 192
