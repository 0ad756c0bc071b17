"""The shape of the package: no import cycle among mmpipe's modules (function-level imports
included) and no function longer than 80 lines."""
from __future__ import annotations

import ast
import os

from conftest import ROOT

PKG = os.path.join(ROOT, "mmpipe")
MAX_LINES = 80


def _modules() -> dict:
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(name: str, path: str, mods: dict) -> set:
    tree = ast.parse(open(path).read())
    pkg = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                for cand in (f"{base}.{alias.name}", base):
                    if cand in mods and cand != name:
                        deps.add(cand)
                        break
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name in mods and a.name != name)
    return deps


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_mmpipe_modules():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    # the check can fail: a cycle planted in a copy of the graph is found
    planted = dict(graph, **{"mmpipe.errors": graph["mmpipe.errors"] | {"mmpipe.config.schema"}})
    assert any({"mmpipe.config.schema", "mmpipe.errors"} <= set(c) for c in _cycles(planted))
    assert _cycles(graph) == []


def test_no_function_longer_than_80_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert long == []
