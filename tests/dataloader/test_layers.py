"""The dataloader's walls (the layer map in dataloader/__init__.py): imports between its
folders go one way only, no module imports itself through others, only ckptstore's public API
is used, and a module over 400 lines says at its top why it is one module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dataloader"

#: layer -> the layers it may import (lazy imports inside functions included)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "format": {"errors"},
    "sources": {"errors", "format"},
    "write": {"errors", "format", "sources"},
    "order": set(),
    "read": {"errors", "format", "order"},
    "loading": {"errors", "format", "order", "read"},
    "cli": {"errors", "format", "sources", "write", "order", "read", "loading"},
}
#: what the package front (``__init__``, ``__main__``) may import
TOP = {"errors", "format", "sources", "write", "order", "read", "loading", "cli"}
CKPTSTORE_PUBLIC = {"ckptstore", "ckptstore.errors", "ckptstore.stores", "ckptstore.toolkit"}
#: module names of ckptstore's that the dataloader must not repeat
TAKEN = {"format.py", "pipeline.py", "writer.py", "reader.py"}
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the module, at any depth. `from X import
    y` counts as an import of X.y when that is a module of ours, else of X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub if sub in MODULES else target, node.lineno))
    return out


def _layer(module: str) -> str | None:
    """The top-level folder (or module) of the dataloader a module lies in; None for the
    package front."""
    parts = module.split(".")
    return None if len(parts) == 1 or parts[1] == "__main__" else parts[1]


GRAPH = {
    name: sorted({m for m, _ in _imports(name, path) if m in MODULES and m != name})
    for name, path in MODULES.items()
}


def test_imports_between_layers_go_one_way() -> None:
    bad = []
    for name, path in MODULES.items():
        here = _layer(name)
        for target, line in _imports(name, path):
            if target not in MODULES:
                continue
            there = _layer(target)
            if there is None:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports the package front")
            elif here is None:
                assert there in TOP
            elif there != here and there not in ALLOWED[here]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {here}/ imports {target}")
    assert not bad, "\n".join(bad)
    assert set(ALLOWED) == {_layer(m) for m in MODULES} - {None}  # every layer has a rule


def test_no_import_cycles() -> None:
    """No module reaches itself through the modules it imports (lazy imports included)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in GRAPH[node]:
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in GRAPH:
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_only_public_ckptstore_api_is_used() -> None:
    used = {
        (target, f"{path.relative_to(ROOT)}:{line}")
        for name, path in MODULES.items()
        for target, line in _imports(name, path)
        if target.split(".")[0] == "ckptstore"
    }
    bad = sorted(f"{where} imports {target}" for target, where in used
                 if target not in CKPTSTORE_PUBLIC)
    assert not bad, "\n".join(bad)


def test_module_names_and_sizes() -> None:
    for path in MODULES.values():
        assert path.name not in TAKEN, f"{path}: a module name ckptstore uses"
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            assert "Why one module" in doc, f"{path}: over {MAX_LINES} lines, without a reason"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_imports(module: str) -> None:
    if module.endswith("ray_datasink") or module.endswith("zarr_adapter"):
        pytest.importorskip("ray" if module.endswith("ray_datasink") else "zarr")
    if module == "dataloader.__main__":
        return  # runs the command line
    __import__(module)
