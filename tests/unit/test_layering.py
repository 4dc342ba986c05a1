"""The tree's layering, enforced by walking every module's import statements (top level and inside
functions):
  - `actors/` (the data plane) runs without Ray and knows nothing of the control plane or the wire
    API: no `ray`, `cluster`, `protos`, `specd` or `specd_client`;
  - `cluster/` (the control plane) does not go through the client SDK: no `specd_client`;
  - the SDK imports only grpcio, protobuf and the wire API: no `actors`, `cluster`, `specd` or torch
    (see test_client_sdk);
  - no package has an import cycle, counting imports made only for type checking.
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


def module_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (absolute and relative imports, top level,
    inside functions and under TYPE_CHECKING alike; `from pkg import mod` counts as mod)."""
    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", ["actors", "cluster", "specd", "specd_client"])
def test_no_import_cycle(package):
    assert cycles(module_graph(package)) == []


def test_the_cycle_check_catches_a_cycle(tmp_path):
    """The check can fail: two modules importing each other (one only for type checking) are a cycle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert cycles(module_graph("pkg", tmp_path)) == [["pkg.a", "pkg.b"]]
