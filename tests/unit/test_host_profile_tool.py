"""tools/dev/host_profile.py on the CPU: every part of a decode step's host work is timed."""

from __future__ import annotations

from engine.runtime.engine import DEFAULT_CKPT
from tools.dev import host_profile


def test_host_profile_times_every_part() -> None:
    got = host_profile.profile(str(DEFAULT_CKPT), batch=2, steps=2, rounds=1)
    assert set(got) == set(host_profile.PARTS)
    assert all(0 < v < 1.0 for v in got.values()), got
