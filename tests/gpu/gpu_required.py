"""Shared by the GPU test modules: import CuPy or skip the whole module where there is no GPU (CI)."""

from __future__ import annotations

import pytest


def require_gpu():
    """The cupy module, or a module-level skip when CuPy or a CUDA device is missing."""
    cp = pytest.importorskip("cupy")
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver / no device both surface here
        count = 0
    if count < 1:
        pytest.skip("no CUDA device", allow_module_level=True)
    return cp
