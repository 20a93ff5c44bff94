"""The architecture's rules, checked on the source: the model apart from its runner, modules of one
job each, the engine's knobs read in one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = sorted((REPO / "engine" / "model").glob("*.py"))


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_model_imports_nothing_of_the_runner():
    """engine/model/ says what the model computes: it imports no runner, no driver of ranks, no
    GPU backend, and asks the ops for nothing by name (no getattr on them)."""
    assert MODEL
    for p in MODEL:
        bad = {m for m in _imports(p) if m.startswith(("engine.runtime", "engine.parallel.lockstep",
                                                        "engine.parallel.gpu", "engine.ops.gpu", "cupy"))}
        assert not bad, (p.name, bad)
        assert "getattr(ops" not in p.read_text() and "getattr(self.ops" not in p.read_text(), p.name


def test_no_module_is_too_large():
    for p in [*REPO.glob("engine/**/*.py"), *REPO.glob("server/*.py"), *REPO.glob("kvcache/*.py"),
              *REPO.glob("tests/**/*.py"), *REPO.glob("tools/**/*.py"), REPO / "dsuf.py"]:
        assert len(p.read_text().splitlines()) <= 620, p


def test_engine_knobs_are_read_in_one_place():
    """The engine reads its DSUF_* environment variables only in engine/settings.py."""
    for p in REPO.glob("engine/**/*.py"):
        if p.name == "settings.py":
            continue
        assert not re.search(r"environ[^\n]*DSUF_", p.read_text()), p
