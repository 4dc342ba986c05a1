"""The tree's layering, enforced: `actors/` (the data plane) runs without Ray and knows nothing of
the control plane or the wire API; the SDK imports only grpcio and protobuf (see test_client_sdk).

Walks the import statements of every module under actors/ (top level and inside functions) and
fails on `ray`, `cluster`, `protos`, `specd` or `specd_client`.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("ray", "cluster", "protos", "specd", "specd_client")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def forbidden_imports(path: Path) -> list[str]:
    return sorted(m for m in imported_modules(path) if m.split(".")[0] in FORBIDDEN)


@pytest.mark.parametrize("path", sorted((ROOT / "actors").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_data_plane_imports_neither_ray_nor_the_control_plane(path):
    assert forbidden_imports(path) == []


def test_the_walk_catches_a_forbidden_import(tmp_path):
    """The check can fail: a module that imports Ray lazily, inside a function, is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\ndef f():\n    from ray import serve\n    import cluster.config\n")
    assert forbidden_imports(bad) == ["cluster.config", "ray"]
