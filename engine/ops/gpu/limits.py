"""Limits of the GPU backend's CUDA-graph cache, importable without cupy: the memory planner
(engine/runtime/memory_plan.py) sizes the buffers the graphs keep from them on any machine."""

from __future__ import annotations

import os

MAX_GRAPH_ROWS = 64  # regions over more rows (prefill) run eagerly: their shapes rarely repeat
# Graphs (and their output buffers) are kept for at most this many distinct row counts (batch
# sizes), least recently used dropped first: every batch size 1..64 across 40 layers would
# otherwise hold gigabytes of region outputs.
MAX_ROW_BUCKETS = int(os.environ.get("DSUF_GRAPH_BUCKETS", "8"))
