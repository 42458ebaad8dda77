#!/usr/bin/env python3
"""The import contract of ckptstore/ and dataloader/, checked with `ast` (nothing is imported).

    python .ci/check_layers.py [--root DIR]     exit 0: clean; 1: violations, one a line

1. Layers. A package whose `__init__.py` docstring holds a layer map (a line saying "imports
   flow down this list", then an indented list of `name.py` / `folder/` entries, several
   names on one line being one level) must respect it: a module may import modules of its
   own entry and of the entries listed *above* it, never one listed below it. (The map starts
   with `errors.py`, which imports nothing of ours, and ends with `cli/`, which may import
   everything: "imports flow down" means a name flows down to the modules listed after it.)
   Every import counts: module level, inside functions and under `if TYPE_CHECKING:`.
   Top-level modules the docstring does not list are placed by EXTRA_LEVELS below (the base
   utilities beside `errors.py`; the facades above everything); a module in neither is a
   violation, and so is a map entry that no longer exists. No layer map: the layer check of
   that package is skipped with a note (the other checks still run).
2. No import cycles between modules, in either package. Runtime imports only: module level
   and function-local (an import moved into a function still runs); those under
   `if TYPE_CHECKING:` never run and cannot form a cycle. `from pkg import name` depends on
   `pkg.name` when that is a module, else on `pkg/__init__.py`.
3. Optional third-party packages only where OPTIONAL_IMPORTS allows them (so that an install
   without the extra still imports everything else). Counted: `import`/`from` statements and
   `require("x")` / `importlib.import_module("x")` / `__import__("x")` with a literal name,
   except under `if TYPE_CHECKING:` (never executed). An allowed path that does not exist
   (in a folder that does) is a violation too: the table must move with the module.
4. ckptstore never imports dataloader (dataloader is built on ckptstore, not the reverse).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("ckptstore", "dataloader")

#: Where the top-level modules that the layer docstring does not list sit: the name of an
#: entry of the docstring (same level as it), or TOP (above every entry: it may import
#: anything, nothing of the package may import it). Used only for names the docstring lacks.
TOP = "<top>"
EXTRA_LEVELS: dict[str, dict[str, tuple[str, str]]] = {
    "ckptstore": {
        "collector.py": ("errors.py", "base utility (README: errors.py collector.py ... )"),
        "concurrency.py": ("errors.py", "base utility used by format and pipeline alike"),
        "redact.py": ("errors.py", "base utility (URIs shown redacted)"),
        "version.py": ("errors.py", "base utility (the version)"),
        "deps.py": ("errors.py", "base utility: optional packages (imports errors.py)"),
        "__init__.py": (TOP, "the package facade: re-exports every layer"),
        "__main__.py": (TOP, "`python -m ckptstore`, runs cli/"),
        "lightning.py": (TOP, "documented import path of training/lightning.py"),
        "accelerate.py": (TOP, "documented import path of training/accelerate.py"),
        "torchtitan.py": (TOP, "documented import path of training/torchtitan.py"),
        "torchft.py": (TOP, "ckptstore.torchft: the torchft transport over healing/"),
        "toolkit.py": (TOP, "the stable building blocks other packages import (re-exports)"),
    },
    "dataloader": {
        "__init__.py": (TOP, "the package facade"),
        "__main__.py": (TOP, "`python -m dataloader`, runs the CLI"),
    },
}

#: Optional third-party packages (top-level import name) -> the files allowed to import them,
#: each with its reason. Everything else in ckptstore/ and dataloader/ must work without them.
TORCH_MODULES: dict[str, str] = {
    "ckptstore/format/torch_types.py": "the torch adapter: torch tensors <-> state-tree leaves",
    "ckptstore/tools/interop.py": "import/export of torch files (.pt, DCP, safetensors)",
    "ckptstore/tools/exports.py": "weights-only torch and Hugging Face exports",
    "ckptstore/training/manager.py": "CheckpointManager: modules, optimizers, torch.distributed",
    "ckptstore/training/distributed.py": "collective saves over torch.distributed",
    "ckptstore/training/collectives.py": "JSON and integer messages over torch.distributed",
    "ckptstore/training/rank_save.py": "the collective save planned on each rank",
    "ckptstore/training/peers.py": "peer replicas over torch.distributed",
    "ckptstore/training/rank_rows.py": "rank-owned rows of torch tensors",
    "ckptstore/training/rng.py": "RNGState: torch's generators",
    "ckptstore/training/lightning.py": "the Lightning plugin",
    "ckptstore/training/accelerate.py": "the accelerate integration",
    "ckptstore/training/torchtitan.py": "the torchtitan checkpointer",
    "ckptstore/healing/dtensors.py": "live healing: DTensors rebuilt on the receiver's mesh",
    "ckptstore/torchft.py": "the torchft CheckpointTransport (torch state dicts)",
    "ckptstore/dcp/api.py": "ckptstore.dcp.save/load: torch.distributed.checkpoint calls",
    "ckptstore/dcp/commit.py": "DCP saves: rank 0 commits the manifest of DCP's write results",
    "ckptstore/dcp/metadata.py": "DCP's Metadata as JSON and back",
    "ckptstore/dcp/parts.py": "DCP's chunk grids of sharded tensors",
    "ckptstore/dcp/planners.py": "DCP SavePlanner/LoadPlanner without pickled bytes",
    "ckptstore/dcp/reader.py": "the DCP StorageReader",
    "ckptstore/dcp/reads.py": "verified reads into the tensors DCP resolves",
    "ckptstore/dcp/writer.py": "the DCP StorageWriter",
    "dataloader/loading/collate.py": "batches as torch tensors, only when asked for",
}
OPTIONAL_IMPORTS: dict[str, dict[str, str]] = {
    "torch": TORCH_MODULES,
    "safetensors": {
        "ckptstore/tools/interop.py": "safetensors import/export",
        "ckptstore/tools/exports.py": "sharded safetensors exports",
    },
    "transformers": {"ckptstore/tools/exports.py": "Hugging Face exports (config, model class)"},
    "boto3": {"ckptstore/stores/s3.py": "the S3 store (the 's3' extra)"},
    "botocore": {"ckptstore/stores/s3.py": "the S3 store (boto3's errors and config)"},
    "urllib3": {"ckptstore/stores/s3.py": "botocore's HTTP layer (not a dependency of ours)"},
    "ray": {"dataloader/write/ray_datasink.py": "dataloader.RayDatasink (the 'ray' extra)"},
    "lightning": {"ckptstore/training/lightning.py": "the Lightning plugin"},
    "pytorch_lightning": {"ckptstore/training/lightning.py": "the Lightning plugin"},
    "accelerate": {"ckptstore/training/accelerate.py": "the accelerate integration"},
    "torchtitan": {"ckptstore/training/torchtitan.py": "the torchtitan checkpointer"},
    "torchdata": {"ckptstore/training/torchtitan.py": "torchtitan's stateful dataloader"},
    "torchft": {"ckptstore/torchft.py": "ckptstore.torchft.Transport, a torchft transport"},
    "pyarrow": {
        "dataloader/sources/arrow_rows.py": "Arrow record batches as rows",
        "dataloader/sources/parquet.py": "Parquet input",
        "dataloader/sources/hf.py": "saved Hugging Face datasets (Arrow files)",
    },
    "datasets": {},
    "matplotlib": {},  # bench/charts.py only, outside the packages
    "pytest": {"ckptstore/stores/testing.py": "the store contract suite (used by tests only)"},
}

FLOW_RE = re.compile(r"imports\s+flow\s+down", re.IGNORECASE)
ENTRY_TOKEN_RE = re.compile(r"^(?:[A-Za-z_]\w*\.py|[A-Za-z_]\w*/)$")
DYNAMIC_IMPORTERS = {"require", "import_module", "__import__"}


@dataclass(frozen=True)
class Import:
    src: str  # importing module (dotted)
    path: str  # its file, relative to the root
    line: int
    target: str  # imported module (dotted; for third-party packages the top-level name)
    internal: bool  # target is in PACKAGES
    typing_only: bool  # under `if TYPE_CHECKING:`
    local: bool  # inside a function
    dynamic: bool = False  # require("x") and the like


@dataclass
class Module:
    name: str
    path: Path
    rel: str
    is_package: bool
    imports: list[Import] = field(default_factory=list)


@dataclass
class LayerMap:
    levels: dict[str, int]  # entry ("errors.py", "format/") -> level (0 = first)
    lines: dict[str, int]  # entry -> line in __init__.py


# ----------------------------------------------------------------------------- collection


def discover(root: Path, package: str) -> dict[str, Module]:
    """Every module of `package` under `root` (folders without __init__.py count as packages:
    a tree being restructured may have them)."""
    base = root / package
    modules: dict[str, Module] = {}
    if not base.is_dir():
        return modules
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if "__pycache__" in parts or any(not p.isidentifier() for p in parts):
            continue
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules[name] = Module(name, path, path.relative_to(root).as_posix(), is_package)
    # namespace folders (no __init__.py yet) are packages too, for `from pkg import mod`
    for mod in list(modules.values()):
        names = mod.name.split(".")
        for i in range(1, len(names)):
            pkg = ".".join(names[:i])
            if pkg not in modules:
                folder = root.joinpath(*names[:i])
                modules[pkg] = Module(pkg, folder, folder.relative_to(root).as_posix() + "/",
                                      True)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, typing_only: bool = False, local: bool = False
          ) -> Iterator[tuple[ast.AST, bool, bool]]:
    """Every node with (under TYPE_CHECKING, inside a function)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield child, typing_only, local
            for stmt in child.body:
                yield stmt, True, local
                yield from _walk(stmt, True, local)
            for stmt in child.orelse:
                yield stmt, typing_only, local
                yield from _walk(stmt, typing_only, local)
            continue
        yield child, typing_only, local
        inner = local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _walk(child, typing_only, inner)


def parse_imports(mod: Module, modules: dict[str, Module]) -> list[Import]:
    tree = ast.parse(mod.path.read_text(encoding="utf-8"), filename=str(mod.path))
    out: list[Import] = []
    package_parts: list[str] = (mod.name.split(".") if mod.is_package
                                else mod.name.split(".")[:-1])

    def add(target: str, node: ast.AST, typing_only: bool, local: bool,
            dynamic: bool = False) -> None:
        top = target.split(".")[0]
        internal = top in PACKAGES
        out.append(Import(mod.name, mod.rel, getattr(node, "lineno", 1),
                          target if internal else top, internal, typing_only, local, dynamic))

    for node, typing_only, local in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, typing_only, local)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                keep = len(package_parts) - (node.level - 1)
                if keep <= 0:
                    continue  # beyond the top package: Python refuses it anyway
                base = ".".join(package_parts[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] not in PACKAGES:
                add(base, node, typing_only, local)
                continue
            plain = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and sub in modules:
                    add(sub, node, typing_only, local)
                else:
                    plain.append(alias)
            if plain:
                add(base, node, typing_only, local)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.id if isinstance(func, ast.Name) else (
                func.attr if isinstance(func, ast.Attribute) else "")
            arg = node.args[0]
            if (fname in DYNAMIC_IMPORTERS and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str) and arg.value):
                add(arg.value, node, typing_only, local, dynamic=True)
    return out


# ----------------------------------------------------------------------------- layer map


def parse_layer_map(init: Path) -> LayerMap | None:
    """The ordered entries of the layer map in `init`'s docstring, or None if it has none."""
    if not init.is_file():
        return None
    tree = ast.parse(init.read_text(encoding="utf-8"))
    doc_node = tree.body[0] if tree.body else None
    if not (isinstance(doc_node, ast.Expr) and isinstance(doc_node.value, ast.Constant)
            and isinstance(doc_node.value.value, str)):
        return None
    first_line = doc_node.lineno
    lines = doc_node.value.value.splitlines()
    start = next((i for i, line in enumerate(lines) if FLOW_RE.search(line)), None)
    if start is None:
        return None
    levels: dict[str, int] = {}
    where: dict[str, int] = {}
    level = 0
    started = False
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if not line.strip():
            if started:
                # a blank line ends the list unless more entries follow at once
                nxt = next((x for x in lines[i + 1:] if x.strip()), "")
                if not (nxt[:1].isspace() and _entry_names(nxt)):
                    break
            continue
        if not line[:1].isspace():
            if started:
                break
            continue
        names = _entry_names(line)
        if not names:
            continue  # a continuation of the previous entry's description
        started = True
        for name in names:
            levels[name] = level
            where[name] = first_line + i
        level += 1
    return LayerMap(levels, where) if levels else None


def _entry_names(line: str) -> list[str]:
    names = []
    for token in line.split():
        if not ENTRY_TOKEN_RE.match(token):
            break
        names.append(token)
    # an entry line is names then (two spaces or more) a description, or names alone
    if names and not re.match(r"^\s+" + r"\s+".join(map(re.escape, names)) + r"(\s{2,}|$)",
                              line):
        return []
    return names


def entry_of(module: str, modules: dict[str, Module]) -> str:
    """The layer-map entry a module belongs to: `format/` for ckptstore.format.tree and for
    ckptstore.format itself, `errors.py` for ckptstore.errors, `__init__.py` for the root."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    if len(parts) > 2 or modules[module].is_package:
        return parts[1] + "/"
    return parts[1] + ".py"


# ----------------------------------------------------------------------------- checks


def check_layers(root: Path, package: str, modules: dict[str, Module],
                 problems: list[str], notes: list[str]) -> None:
    init = root / package / "__init__.py"
    layer_map = parse_layer_map(init)
    if layer_map is None:
        notes.append(f"{package}/__init__.py has no layer map (\"imports flow down this "
                     f"list\"): layer check of {package}/ skipped")
        return
    n = len(layer_map.levels)
    levels = dict(layer_map.levels)
    extra = EXTRA_LEVELS.get(package, {})
    for name, (where, _reason) in extra.items():
        if name in levels:
            continue  # the docstring wins
        levels[name] = n if where == TOP else layer_map.levels.get(where, n)
    rel_init = f"{package}/__init__.py"
    for entry, line in layer_map.lines.items():
        if not (root / package / entry).exists():
            problems.append(f"{rel_init}:{line}: layer map names `{entry}`, which does not "
                            "exist")
    mine = {m: mod for m, mod in modules.items() if m.split(".")[0] == package}
    unplaced: set[str] = set()
    for name, mod in sorted(mine.items()):
        entry = entry_of(name, modules)
        if entry not in levels and entry not in unplaced:
            unplaced.add(entry)
            problems.append(f"{mod.rel}:1: `{entry}` is not in the layer map of {rel_init} "
                            "(add it to the docstring's list)")
    for name, mod in sorted(mine.items()):
        src_entry = entry_of(name, modules)
        if src_entry not in levels:
            continue
        for imp in mod.imports:
            if not imp.internal or imp.target.split(".")[0] != package:
                continue
            if imp.target not in modules:
                continue  # an import of something that does not exist: not ours to judge
            dst_entry = entry_of(imp.target, modules)
            if dst_entry not in levels or dst_entry == src_entry:
                continue
            if levels[dst_entry] > levels[src_entry]:
                how = " (under TYPE_CHECKING)" if imp.typing_only else (
                    " (inside a function)" if imp.local else "")
                problems.append(
                    f"{imp.path}:{imp.line}: {src_entry} imports {imp.target}{how}, but "
                    f"{dst_entry} is listed below {src_entry} in the layer map "
                    "(imports flow down the list only)")


def check_cycles(modules: dict[str, Module], problems: list[str]) -> None:
    edges: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for mod in modules.values():
        for imp in mod.imports:
            if (imp.internal and not imp.typing_only and imp.target in modules
                    and imp.target != mod.name):
                edges[mod.name].setdefault(imp.target, imp)
    for scc in strongly_connected(edges):
        if len(scc) < 2:
            continue
        cycle = shortest_cycle(min(scc), edges, set(scc))
        steps = []
        for a, b in zip(cycle, cycle[1:]):
            imp = edges[a][b]
            how = " (inside a function)" if imp.local else ""
            steps.append(f"{imp.path}:{imp.line} imports {b}{how}")
        others = "" if len(scc) == len(cycle) - 1 else (
            f"; all {len(scc)} modules of this cycle: " + ", ".join(sorted(scc)))
        problems.append(f"{modules[cycle[0]].rel}:{edges[cycle[0]][cycle[1]].line}: import "
                        f"cycle {' -> '.join(cycle)}: " + "; ".join(steps) + others)


def strongly_connected(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        scc.append(top)
                        if top == node:
                            break
                    out.append(sorted(scc))
    return out


def shortest_cycle(start: str, edges: dict[str, dict[str, Import]], within: set[str]
                   ) -> list[str]:
    """start -> ... -> start, by breadth-first search inside its component."""
    prev: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(edges[node]):
                if nxt not in within:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [
                        start, start]
                if nxt not in seen:
                    seen.add(nxt)
                    prev[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return [start, start]


def check_third_party(root: Path, modules: dict[str, Module], problems: list[str]) -> None:
    for package, allowed in sorted(OPTIONAL_IMPORTS.items()):
        for path in sorted(allowed):
            if not (root / path).is_file() and (root / path).parent.is_dir():
                problems.append(f"{path}:1: .ci/check_layers.py allows {package} in {path}, "
                                "which does not exist (move the rule with the module)")
    for mod in sorted(modules.values(), key=lambda m: m.rel):
        for imp in mod.imports:
            if imp.internal or imp.typing_only or imp.target not in OPTIONAL_IMPORTS:
                continue
            allowed = OPTIONAL_IMPORTS[imp.target]
            if mod.rel in allowed:
                continue
            if not allowed:
                where = "no module of ckptstore/ or dataloader/ may"
            elif len(allowed) <= 2:
                where = "only " + " and ".join(sorted(allowed)) + " may"
            else:
                where = f"only the {len(allowed)} modules listed for it may"
            how = f' (require("{imp.target}"))' if imp.dynamic else ""
            problems.append(f"{imp.path}:{imp.line}: imports {imp.target}{how}; {where} "
                            f"(OPTIONAL_IMPORTS[{imp.target!r}], .ci/check_layers.py)")


def check_cross_package(modules: dict[str, Module], problems: list[str]) -> None:
    for mod in sorted(modules.values(), key=lambda m: m.rel):
        if mod.name.split(".")[0] != "ckptstore":
            continue
        for imp in mod.imports:
            if imp.internal and imp.target.split(".")[0] == "dataloader":
                problems.append(f"{imp.path}:{imp.line}: ckptstore imports {imp.target}: "
                                "dataloader is built on ckptstore, never the reverse")


def check(root: Path) -> tuple[list[str], list[str]]:
    """(violations, notes) for the tree at `root`."""
    modules: dict[str, Module] = {}
    for package in PACKAGES:
        modules.update(discover(root, package))
    problems: list[str] = []
    notes: list[str] = []
    for mod in modules.values():
        if mod.path.is_file():
            try:
                mod.imports = parse_imports(mod, modules)
            except SyntaxError as exc:
                problems.append(f"{mod.rel}:{exc.lineno or 1}: cannot parse: {exc.msg}")
    for package in PACKAGES:
        if (root / package).is_dir():
            check_layers(root, package, modules, problems, notes)
    check_cycles(modules, problems)
    check_third_party(root, modules, problems)
    check_cross_package(modules, problems)
    return problems, notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="repository root (default: this script's repository)")
    args = parser.parse_args(argv)
    problems, notes = check(args.root.resolve())
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for problem in problems:
        print(problem)
    if problems:
        print(f"check_layers: {len(problems)} violation(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
