"""The import graph of the product is acyclic, with the torch-free frontend on top.

Every ``import``/``from ... import`` in ``blink/``, ``dpu/`` (``blink.dpu``) and ``kernels/``
(``blink.kernels``), at module level or inside a function, is an edge. The test fails on any
cycle (strongly connected component of more than one module) and on any ``blink.dpu`` module
that reaches, directly or not, a module importing torch, triton or cupy.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"blink": ROOT / "blink", "blink.dpu": ROOT / "dpu", "blink.kernels": ROOT / "kernels"}
HEAVY = {"torch", "triton", "cupy"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if _is_package(path) else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except the bodies of ``if TYPE_CHECKING:`` (type-only imports never run)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between project modules, third-party top-level names each module imports)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    external: dict[str, set[str]] = {m: set() for m in mods}

    def add(src: str, target: str) -> None:
        # the longest project module that is a prefix of ``target`` (a name or a submodule)
        parts = target.split(".")
        for n in range(len(parts), 0, -1):
            cand = ".".join(parts[:n])
            if cand in mods:
                if cand != src:
                    edges[src].add(cand)
                return
        external[src].add(parts[0])

    for mod, path in mods.items():
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(mod, alias.name)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, path, node)
                for alias in node.names:  # ``from pkg import sub`` may name a submodule
                    add(mod, f"{target}.{alias.name}" if f"{target}.{alias.name}" in mods else target)
    return edges, external


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    edges, _ = import_graph()
    cycles = _cycles(edges)
    detail = "\n".join(
        "  " + " <-> ".join(c) + "\n    " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a]) if b in c)
        for c in cycles)
    assert not cycles, f"import cycles:\n{detail}"


def _with_parents(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first: add those edges."""
    out = {m: set(t) for m, t in edges.items()}
    for m, targets in edges.items():
        for t in targets:
            parts = t.split(".")
            out[m].update(".".join(parts[:n]) for n in range(1, len(parts)) if ".".join(parts[:n]) in edges)
    return out


def test_the_folders_do_not_import_each_other_in_a_loop():
    edges, _ = import_graph()
    packages = {m for m in edges if len(m.split(".")) <= 2 and any(k.startswith(m + ".") for k in edges)}
    def folder(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:2]) if ".".join(parts[:2]) in packages else m
    graph: dict[str, set[str]] = {}
    for m, targets in edges.items():
        graph.setdefault(folder(m), set()).update(folder(t) for t in targets if folder(t) != folder(m))
    for node in list(graph.values()):
        for t in node:
            graph.setdefault(t, set())
    cycles = _cycles(graph)
    detail = "\n".join(
        "  " + " <-> ".join(c) + "\n    " + "; ".join(
            f"{a} -> {b} ({', '.join(sorted(m for m in edges if folder(m) == a and any(folder(t) == b for t in edges[m])))})"
            for a in c for b in sorted(graph[a]) if b in c)
        for c in cycles)
    assert not cycles, f"folders importing each other:\n{detail}"


def test_the_frontend_reaches_no_torch_side_module():
    edges, external = import_graph()
    edges = _with_parents(edges)
    heavy = {m for m, names in external.items() if names & HEAVY}
    bad = []
    for start in (m for m in edges if m.startswith("blink.dpu")):
        seen, todo, parent = {start}, [start], {start: ""}
        while todo:
            m = todo.pop()
            if m in heavy:
                chain, x = [], m
                while x:
                    chain.append(x)
                    x = parent[x]
                bad.append(" -> ".join(reversed(chain)))
                break
            for n in edges[m] - seen:
                seen.add(n)
                parent[n] = m
                todo.append(n)
    assert not bad, "frontend modules that reach torch/triton/cupy:\n  " + "\n  ".join(bad)


def test_the_walker_sees_a_planted_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "blink"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from blink import b\n")
    (pkg / "b.py").write_text("def f():\n    from blink.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", {"blink": pkg})
    edges, _ = import_graph()
    assert _cycles(edges) == [["blink.a", "blink.b"]]
