"""tools/dev/host_profile.py on the CPU: every part of a decode step's host work is timed, and of a
verify step's (--rows), the parts planned ahead and those left serial."""

from __future__ import annotations

from engine.runtime.engine import DEFAULT_CKPT
from tools.dev import host_profile


def test_host_profile_times_every_part() -> None:
    got = host_profile.profile(str(DEFAULT_CKPT), batch=2, steps=2, rounds=1)
    assert set(got) == set(host_profile.PARTS)
    assert got["fill"] == 0  # (a decode step's token fields: not timed)
    assert all(0 < v < 1.0 for p, v in got.items() if p != "fill"), got
    got = host_profile.profile(str(DEFAULT_CKPT), batch=2, steps=2, rounds=1, rows=3)
    assert all(0 < v < 1.0 for v in got.values()), got
