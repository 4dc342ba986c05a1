"""The tree's layering, enforced by walking every module's import statements (top level and inside
functions):
  - `actors/` (the data plane) runs without Ray and knows nothing of the control plane or the wire
    API: no `ray`, `cluster`, `protos`, `specd` or `specd_client`;
  - `cluster/` (the control plane) does not go through the client SDK: no `specd_client`;
  - the SDK imports only grpcio, protobuf and the wire API: no `actors`, `cluster`, `specd` or torch
    (see test_client_sdk).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("ray", "cluster", "protos", "specd", "specd_client")  # in actors/
CLUSTER_FORBIDDEN = ("specd_client",)
SDK_FORBIDDEN = ("actors", "cluster", "specd", "torch", "transformers", "ray")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def forbidden_imports(path: Path, forbidden: tuple[str, ...] = FORBIDDEN) -> list[str]:
    return sorted(m for m in imported_modules(path) if m.split(".")[0] in forbidden)


@pytest.mark.parametrize("path", sorted((ROOT / "actors").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_data_plane_imports_neither_ray_nor_the_control_plane(path):
    assert forbidden_imports(path) == []


@pytest.mark.parametrize("path", sorted((ROOT / "cluster").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_control_plane_does_not_go_through_the_sdk(path):
    assert forbidden_imports(path, CLUSTER_FORBIDDEN) == []


@pytest.mark.parametrize("path", sorted((ROOT / "specd_client").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_sdk_imports_no_server_code_and_no_torch(path):
    assert forbidden_imports(path, SDK_FORBIDDEN) == []


def test_the_walk_catches_a_forbidden_import(tmp_path):
    """The check can fail: a module that imports Ray lazily, inside a function, is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\ndef f():\n    from ray import serve\n    import cluster.config\n")
    assert forbidden_imports(bad) == ["cluster.config", "ray"]
