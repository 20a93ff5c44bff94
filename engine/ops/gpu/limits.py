"""Limits of the GPU backend, importable without cupy: the memory planner
(engine/runtime/memory_plan.py) sizes the memory the backend keeps from them on any machine."""

from __future__ import annotations

# The most rows a captured step takes: a verify step of 32 sequences (the default --max-seqs) of
# DSpark's block 5 + 1. Prompt chunks never capture (the runner graphs decode steps alone), and
# the memory plan counts graph memory only up to the rows the engine's decode steps can have.
MAX_GRAPH_ROWS = 192

# A prompt chunk's indexer selection (engine/model/v41.py Indexer.select) scores its query rows in
# blocks whose temporaries stay under INDEXER_BLOCK_BYTES: at a ratio-1 group's one entry per token
# a whole chunk's [rows, entries] float32 scores outgrow the GPU at long contexts. Per (row, entry)
# a block holds at most two float32 arrays at once (the scores and their masked copy) and a few
# bool temporaries (visibility, the block's candidate and top-k masks): INDEXER_BYTES_PER_SCORE.
INDEXER_BLOCK_BYTES = 4 << 30
INDEXER_BYTES_PER_SCORE = 12
# A block is whole waves of the scores kernel (each CTA walks every entry for a few queries, so a
# block of a fraction of a wave costs the whole wave's time): the runtime passes its wave (queries
# per CTA x SMs); the memory plan counts this bound of it (4 queries per CTA x 160 SMs).
INDEXER_WAVE_MAX = 640


def indexer_block_rows(rows: int, entries: int, wave: int = INDEXER_WAVE_MAX) -> int:
    """The most query rows of a `rows`-row chunk one indexer block scores against `entries`
    entries: under INDEXER_BLOCK_BYTES, rounded down to whole waves of `wave` rows but at least one
    wave (and at least one row: a single row over more entries than the budget still runs)."""
    most = INDEXER_BLOCK_BYTES // max(1, INDEXER_BYTES_PER_SCORE * entries)
    if most < rows:
        most = max(wave, most // wave * wave)
    return max(1, min(rows, most))
