"""tools/dev/gpu_profile.py's accounting of a timeline (CPU: synthetic kernel spans)."""

from __future__ import annotations

import pytest

from tools.dev.gpu_profile import kernel_overlap


def test_kernel_overlap_splits_alone_overlapped_and_idle_time():
    # a: 0-10; b: 5-12 beside it on another stream; a gap 12-15; c: 15-20; d (PDL) starts early
    # inside c at 18 and runs to 25
    spans = [("a", 0.0, 10.0), ("b", 5.0, 12.0), ("c", 15.0, 20.0), ("d", 18.0, 25.0)]
    alone, gaps, span = kernel_overlap(spans)
    assert span == 25.0
    assert gaps == pytest.approx(3.0)
    assert alone == pytest.approx({"a": 5.0, "b": 2.0, "c": 3.0, "d": 5.0})


def test_kernel_overlap_sums_a_name_over_its_launches():
    alone, gaps, span = kernel_overlap([("g", 0.0, 4.0), ("g", 6.0, 7.0), ("h", 6.5, 9.0)])
    assert (alone["g"], alone["h"], gaps, span) == pytest.approx((4.5, 2.0, 2.0, 9.0))
    assert kernel_overlap([]) == ({}, 0.0, 0.0)
