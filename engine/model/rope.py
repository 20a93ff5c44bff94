"""Rotary position embedding: YaRN-corrected inverse frequencies and cos / sin tables."""

from __future__ import annotations

import numpy as np

from engine.model.config import RopeSpec


def inv_freq(spec: RopeSpec) -> np.ndarray:
    """Per-pair inverse frequencies (float64 math, rounded once to float32), YaRN-corrected."""
    dim = spec.dim
    pos_freqs = spec.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    if spec.rope_type != "yarn":
        return extrapolation.astype(np.float32)
    interpolation = 1.0 / (spec.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * np.log(spec.original_max_position / (rotations * 2 * np.pi))) / (2 * np.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    return (interpolation * (1 - extra_factor) + extrapolation * extra_factor).astype(np.float32)


def rope_tables(freqs: np.ndarray, positions: np.ndarray, attention_factor: float = 1.0):
    """(cos, sin) [len(positions), dim / 2] float32, scaled by YaRN's attention factor."""
    angles = positions.astype(np.float32)[:, None] * freqs[None, :]
    return np.cos(angles) * np.float32(attention_factor), np.sin(angles) * np.float32(attention_factor)


class Rope:
    """A model's two RoPE tables (the main one, and the compressed entries' own theta and
    YaRN), evaluated at positions on the host."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.freq_main, self.freq_comp = inv_freq(cfg.rope_main), inv_freq(cfg.rope_compress)

    def compressed(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return rope_tables(self.freq_comp, positions, self.cfg.rope_compress.attention_factor)

    def rows(self, pos: np.ndarray) -> np.ndarray:
        """Both tables (cos, sin of the main and the compressed one) at each row's position."""
        return np.stack([*rope_tables(self.freq_main, pos, self.cfg.rope_main.attention_factor),
                         *self.compressed(pos)])
