"""engine/bench_parts.py: a demo-model prefill on the numpy backend by part."""

from __future__ import annotations

import time

import numpy as np

from engine.bench_parts import OTHER, PARTS, array_bytes, by_op, part_of, parts_of, report
from engine.runtime.engine import Engine


def test_prefill_by_part_covers_the_forward_and_restores_the_ops() -> None:
    eng = Engine.load(None)
    model, ops = eng.model, eng.model.ops
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 1000, 96)]
    st, out = model.new_state(), {}
    t0 = time.perf_counter()
    moved: dict[str, int] = {}
    op_s = by_op([ops], lambda: out.setdefault("logits", model.forward([st], [ids])[0]), moved)
    wall = time.perf_counter() - t0
    parts = parts_of(op_s)
    # the demo has every part: dense and expert layers, compressed layers with the indexer
    assert set(parts) == {*PARTS.values(), OTHER}
    assert all(s > 0 for s in parts.values())
    # top-level ops only (the MoE's own linears count once, in MoE): the parts fit in the wall
    # time and cover most of it (the rest is the runner's host work between ops)
    assert 0.5 * wall < sum(parts.values()) <= wall
    # each op's arrays' bytes: a rest op moves at least its streams' (96 rows x hc x hidden f32) once
    assert set(moved) == set(op_s)
    streams = 96 * model.cfg.hc_mult * model.cfg.hidden_size * 4
    assert moved["hc_expand"] >= 2 * streams * model.cfg.num_layers
    line = report(parts, wall, {"MoE": parts["MoE"] / 4}, op_s, op_floors={n: b / 1e12 for n, b in moved.items()})
    assert "hc_expand " in line and "(floor " in line.split(f"{OTHER} ")[1]
    assert "GEMMs" in line and "floor" in line and "25% of it" in line
    # a part of several ops names its largest ones, each an op of that part; a linear by its weight
    for part in (OTHER, "indexer", "GEMMs"):
        named = line.split(f"{part} ")[1].split(")")[0].split(": ")[1]
        assert named and all(part_of(cell.rsplit(" ", 1)[0]) == part for cell in named.split(", "))
    shapes = {n.split(" ")[1] for n in op_s if n.startswith("linear ")}
    assert len(shapes) > 3 and all(len(sh.split("x")) == 2 for sh in shapes)
    assert not {"linear", "moe", "attention_ranges"} & set(vars(ops))  # the patches are gone
    # timing changes nothing: the instrumented forward's logits are the plain one's
    np.testing.assert_array_equal(out["logits"], model.forward([model.new_state()], [ids])[0])


def test_array_bytes_counts_arrays_in_tuples_and_nothing_else() -> None:
    a, b = np.zeros((3, 4), np.float32), np.zeros(5, np.uint16)
    assert array_bytes((a, 2.0, "x"), [b, (a,)], None, 7) == 2 * a.nbytes + b.nbytes
