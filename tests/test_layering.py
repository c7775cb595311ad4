"""The package layers point down: ``codecs`` (pure torch) below ``kernels``, ``kernels`` below ``cache``, ``cache``
below ``methods`` and ``eval``. Read from the source (every import, also those inside
functions), so a new upward import or import cycle fails here before it tangles the code."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kvshrink"

# What each subpackage must not import (anything of kvshrink above it).
FORBIDDEN = {
    "kvshrink.kernels": ("kvshrink.cache", "kvshrink.methods", "kvshrink.eval", "kvshrink.cli", "kvshrink.demo"),
    "kvshrink.codecs": ("kvshrink.kernels", "kvshrink.cache", "kvshrink.methods", "kvshrink.eval", "kvshrink.cli",
                        "kvshrink.demo"),
    "kvshrink.cache": ("kvshrink.methods", "kvshrink.eval", "kvshrink.cli", "kvshrink.demo"),
}
# Imports (all inside functions) that close a cycle today, each with what ends it. A new cycle fails.
KNOWN_BACK_EDGES = {
    # the cache framework's save/load (a loaded cache is made by the registry), and the model loader
    ("kvshrink.cache.base", "kvshrink.cache.persist"), ("kvshrink.cache.persist", "kvshrink.cache.registry"),
    ("kvshrink.cache.registry", "kvshrink.models"),
    # the row-wise split of a batch, made by the framework for methods that need it
    ("kvshrink.cache.base", "kvshrink.cache.rowwise"),
    # the command line registers the eval subcommands
    ("kvshrink.cli", "kvshrink.eval.cli"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str | None = None) -> set[str]:
    """Every kvshrink module ``path`` imports, at the top or inside a function (not the typing-only ones)."""
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m == "kvshrink" or m.startswith("kvshrink.")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        # "from pkg import mod" names a module; "from mod import func" names the module itself
        graph[name] = {m if m in modules else m.rsplit(".", 1)[0] for m in _imports(path)} & set(modules)
        graph[name].discard(name)
    return graph


def test_no_package_imports_a_layer_above_it():
    bad = [f"{module} imports {target}" for module, targets in _graph().items()
           for layer, above in FORBIDDEN.items() if module.startswith(layer + ".") or module == layer
           for target in targets if target.startswith(above)]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = {m: {t for t in ts if (m, t) not in KNOWN_BACK_EDGES} for m, ts in _graph().items()}
    # package __init__ files import their own submodules by design (registration, exports)
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [node, target]) if target in stack
                              else f"{node} -> {target}")
            elif target not in state:
                visit(target, stack + [node])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "\n".join(cycles)


def test_the_known_back_edges_still_exist():
    """An allowance whose import is gone is dropped from the list (so it cannot hide a new cycle)."""
    graph = _graph()
    assert not [edge for edge in KNOWN_BACK_EDGES if edge[1] not in graph.get(edge[0], ())]


def test_imports_inside_functions_and_relative_ones_are_seen(tmp_path):
    probe = PACKAGE / "codecs" / "probe.py"   # never written: parsed from a temporary copy below
    source = tmp_path / "probe.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .pca import PCACode\n"
                      "def f():\n    from kvshrink.cache.store import ExactStore\n    from . import fused\n")
    found = _imports(source, _module_name(probe))
    assert {"kvshrink.cache.store", "kvshrink.codecs.fused"} <= found and "kvshrink.codecs.pca" not in found
