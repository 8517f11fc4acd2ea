"""The import graph of the product is acyclic, with the torch-free frontend on top.

Every ``import``/``from ... import`` in ``blink/``, ``dpu/`` (``blink.dpu``) and ``kernels/``
(``blink.kernels``), at module level or inside a function, is an edge. The test fails on any
cycle (strongly connected component of more than one module) and on any ``blink.dpu`` module
that reaches, directly or not, a module importing torch, triton or cupy.

For cycles, an import under ``if TYPE_CHECKING:`` is an edge too (a type checker, and the
reader, still see the two modules depend on each other), and importing ``a.b.c`` is also an
edge to the packages ``a.b`` and ``a`` whose ``__init__`` it runs, except the importer's own
packages (already running when it runs).
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


def _all_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node, ``if TYPE_CHECKING:`` bodies included."""
    return list(ast.walk(tree))


def import_graph(*, type_checking: bool = False) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between project modules, third-party top-level names each module imports).
    ``type_checking``: imports under ``if TYPE_CHECKING:`` are edges too."""
    mods = _modules()
    nodes = _all_nodes if type_checking else _runtime_nodes
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
        for node in nodes(ast.parse(path.read_text(encoding="utf-8"))):
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


def _with_package_inits(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first: an edge to each of
    those packages, except the importer's own (they are running already when it runs)."""
    out = {m: set(t) for m, t in edges.items()}
    for m, targets in edges.items():
        parts = m.split(".")
        own = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
        for t in targets:
            tp = t.split(".")
            out[m].update(p for p in (".".join(tp[:n]) for n in range(1, len(tp)))
                          if p in edges and p not in own)
    return out


def cycle_graph() -> dict[str, set[str]]:
    """The graph the cycle test judges: type-only imports and package ``__init__``s included."""
    edges, _ = import_graph(type_checking=True)
    return _with_package_inits(edges)


def test_the_import_graph_has_no_cycle():
    edges = cycle_graph()
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


#: modules only tests and benchmarks import (the product is built without them)
TEST_ONLY = {"blink.engine.gpu.host_sim"}


def test_no_product_module_imports_test_only_code():
    edges, _ = import_graph(type_checking=True)
    bad = sorted(f"{m} -> {t}" for m, targets in edges.items() for t in targets & TEST_ONLY)
    assert not bad, "product modules importing test-only code:\n  " + "\n  ".join(bad)


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "blink"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_the_detector_sees_a_cycle_under_type_checking(tmp_path, monkeypatch):
    pkg = _plant(tmp_path, {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from blink.b import B\n",
        "b.py": "from blink.a import x\n",
    })
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", {"blink": pkg})
    assert _cycles(import_graph()[0]) == []  # at run time there is none
    assert _cycles(cycle_graph()) == [["blink.a", "blink.b"]]


def test_the_detector_sees_a_cycle_through_a_package_init(tmp_path, monkeypatch):
    pkg = _plant(tmp_path, {
        "__init__.py": "",
        "p/__init__.py": "from blink.p.inner import thing\n",
        "p/inner.py": "from blink.q import helper\n",
        "q.py": "from blink.p.other import y\n",  # runs blink/p/__init__, which needs blink.q
        "p/other.py": "y = 1\n",
        # a package's own modules importing each other through it is no cycle
        "r/__init__.py": "from blink.r.one import z\n",
        "r/one.py": "from blink.r.two import w\n",
        "r/two.py": "w = 1\n",
    })
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", {"blink": pkg})
    assert _cycles(import_graph()[0]) == []
    assert _cycles(cycle_graph()) == [["blink.p", "blink.p.inner", "blink.q"]]


def test_the_walker_sees_a_planted_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "blink"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from blink import b\n")
    (pkg / "b.py").write_text("def f():\n    from blink.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", {"blink": pkg})
    edges, _ = import_graph()
    assert _cycles(edges) == [["blink.a", "blink.b"]]
