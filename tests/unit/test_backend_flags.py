"""The GPU backend's DSUF_* switches (engine/ops/gpu/ops.py SWITCHES): the table that
set_flags uses to switch paths in a running process covers every variable the module reads at
import, parses each as the import did, and set_flags / restore_flags round-trip (runs on any CPU:
importing the module needs CuPy, not a GPU)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

cupy_ops = pytest.importorskip("engine.ops.gpu.ops")

SOURCE = Path(cupy_ops.__file__).read_text()


def _read_at_import() -> dict[str, str]:
    """Each DSUF_* variable the module reads, and the default it reads it with."""
    got = {m[0]: m[1] for m in re.findall(r'os\.environ\.get\("(DSUF_\w+)", "([^"]*)"\)', SOURCE)}
    got.update({m: "1" for m in re.findall(r'_on\("(DSUF_\w+)"\)', SOURCE)})
    return got


def test_switches_cover_what_the_module_reads() -> None:
    read = _read_at_import()
    assert len(read) >= 20 and set(read) == set(cupy_ops.SWITCHES)
    for env, default in read.items():
        attr, parse = cupy_ops.SWITCHES[env]
        assert getattr(cupy_ops, attr) == parse(os.environ.get(env, default)), env


def test_set_flags_round_trip_and_errors() -> None:
    before = {attr: getattr(cupy_ops, attr) for attr, _ in cupy_ops.SWITCHES.values()}
    old = cupy_ops.set_flags({"DSUF_FUSED_EXPAND": "1", "DSUF_SIDE": "0", "DSUF_ATT_MIN_SPLIT": "32",
                              "DSUF_GEMVR_FP4": "e4u6"})
    try:
        assert (cupy_ops.FUSED_EXPAND, cupy_ops.SIDE_BRANCHES, cupy_ops.ATT_MIN_SPLIT, cupy_ops.GEMVR_FP4) == (
            True, False, 32, "e4u6")
    finally:
        cupy_ops.restore_flags(old)
    assert {attr: getattr(cupy_ops, attr) for attr, _ in cupy_ops.SWITCHES.values()} == before
    for bad in ({"DSUF_NOT_A_SWITCH": "1"}, {"DSUF_GEMVR_FP4": "u7"}, {"DSUF_ATT_MIN_SPLIT": "20"}):
        with pytest.raises(ValueError):
            cupy_ops.set_flags(bad)
    assert {attr: getattr(cupy_ops, attr) for attr, _ in cupy_ops.SWITCHES.values()} == before
