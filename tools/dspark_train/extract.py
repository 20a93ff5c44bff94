"""What the frozen main model gives the draft to learn from, computed by our own numpy engine (the
reference backend, so the draft learns exactly the inputs it is served): for chunks of the token
stream, each position's target-layer inputs (dspark_target_layer_ids, concatenated in layer
order) and the main model's greedy next token there."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np

_runner = None


def _load(ckpt: str) -> None:
    global _runner
    from engine.runtime.engine import Engine

    _runner = Engine.load(ckpt).model


def _one(job: tuple[np.ndarray, tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    chunk, layer_ids = job
    targets = dict.fromkeys(layer_ids)
    logits = _runner.forward([_runner.new_state()], [[int(t) for t in chunk]], all_logits=True, targets=targets)[0]
    tin = np.concatenate([np.asarray(targets[i]) for i in layer_ids], axis=1)
    return tin.astype(np.float16), np.asarray(logits).argmax(axis=1).astype(np.int32)


def extract(ckpt: str | Path, stream: np.ndarray, out: Path, length: int, chunks: int, workers: int,
            target_layer_ids: list[int], hidden: int) -> None:
    """Write out/{tokens,tin,greedy}.npy for `chunks` consecutive chunks of `length` tokens, each
    run as a sequence of its own from position 0."""
    tokens = np.asarray(stream[: chunks * length], np.int32).reshape(chunks, length)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "tokens.npy", tokens)
    tin = np.lib.format.open_memmap(out / "tin.npy", "w+", np.float16,
                                    (chunks, length, len(target_layer_ids) * hidden))
    greedy = np.zeros((chunks, length), np.int32)
    with mp.get_context("fork").Pool(workers, initializer=_load, initargs=(str(ckpt),)) as pool:
        for i, (t, g) in enumerate(pool.imap(_one, [(t, tuple(target_layer_ids)) for t in tokens])):
            tin[i], greedy[i] = t, g
            if i % 50 == 0:
                print(f"extract: {i + 1}/{chunks} chunks", flush=True)
    tin.flush()
    np.save(out / "greedy.npy", greedy)
