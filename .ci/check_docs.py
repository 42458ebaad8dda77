#!/usr/bin/env python3
"""Every code name a document cites in backticks must exist (static: `ast`, nothing imported).

    python .ci/check_docs.py [--root DIR] [FILE.md ...]   exit 0: clean; 1: stale references

Documents: README.md, CONTRIBUTING.md and docs/*.md (CHANGELOG.md is history and may name
what no longer exists). Inline code spans only: fenced blocks are examples, not citations.
What is checked (anything else in backticks is left alone, to keep false alarms near zero):

* paths: `ckptstore/tiers/far.py`, `tests/campaigns/test_crash.py`, `docs/format.md`,
  `.ci/run` (first component a top-level entry of the repository); `pipeline/commit.py`,
  `format/torch_types` (first component a folder of ckptstore/ or dataloader/; `.py` may be
  left out);
  `format/manifest.entry_problem` (a module path, then names in it); bare `name.py` /
  `name.md` (some file of the repository has that name). In a command (`python
  bench/x.py --flag`, `bench/x.py --flag`) only the script is checked.
* dotted names starting with `ckptstore.` or `dataloader.`: the longest prefix that is a
  module, then attributes of it (`ckptstore.training.manager`, `ckptstore.zarr_store(...)`,
  `dataloader.order.MAX_WORLD_SIZE`). A name that is none of these but is a string literal of
  the code (a metadata key such as `ckptstore.tied`) is accepted.
* `Class.attr`, where Class is a class defined in ckptstore/ or dataloader/ (methods,
  class attributes, dataclass fields, `self.x` set in a method, nested classes; inherited
  from our own bases; a class with a base from elsewhere accepts any attribute), and the
  same through the instance names the documents use: `repo.`, `mgr.`, `store.`, ...
  (INSTANCE_NAMES).
* `module.attr`, where module is the last component of one of our modules
  (`manifest.gc_paused`, `concurrency.Turns`).

Exceptions that are not code (a torch DataLoader named `dataloader` in prose, ...) are listed
in .ci/check_docs_ignore.txt as `path: name  # why`.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("ckptstore", "dataloader")
IGNORE_FILE = ".ci/check_docs_ignore.txt"
#: instance names the documents use for objects of our classes (README, docs/*.md)
INSTANCE_NAMES: dict[str, tuple[str, ...]] = {
    "repo": ("CheckpointStore",),
    "mgr": ("CheckpointManager",),
    "store": ("Store",),
    "handle": ("SaveHandle",),
    "ds": ("StreamingDataset", "TokenDataset"),
    "loader": ("StreamingLoader", "MixedLoader"),
}
#: bases that add no attributes worth accepting blindly
TRANSPARENT_BASES = {"object", "ABC", "Protocol", "Generic", "abc.ABC", "typing.Protocol",
                     "typing.Generic"}
#: endings of data file names (`ckptstore.json`, `model.safetensors`): not code
DATA_SUFFIXES = {"json", "jsonl", "ndjson", "toml", "txt", "yml", "yaml", "cfg", "ini", "csv",
                 "safetensors", "zarr", "npy", "npz", "pt", "pth", "bin", "ckpt", "parquet",
                 "arrow", "tar", "gz", "tgz", "png", "svg", "md", "py", "sh", "lock", "tmp",
                 "log", "html", "whl"}
SKIP_DIRS = {".git", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".venv",
             "venv", "node_modules", ".hypothesis"}
TOP_SKIP_DIRS = {"build", "dist", "runs"}  # only at the root (bench/dist/ is code)
PLACEHOLDER = re.compile(r"[<>{}*?$~|;=,'\"\\!@#%^&+]|://|\.\.\.")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
CALLED = re.compile(r"^([A-Za-z_][\w.]*[\w])(?:\(|\[)")
PATHLIKE = re.compile(r"^[\w.\-/]+$")


@dataclass(frozen=True)
class Citation:
    path: str  # document, relative to the root
    line: int
    text: str  # the span as written


# ----------------------------------------------------------------------------- documents


def documents(root: Path) -> list[Path]:
    docs = [root / "README.md", root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md"))]
    return [d for d in docs if d.is_file()]


def citations(root: Path, doc: Path) -> Iterator[Citation]:
    """Inline code spans of `doc` (they may wrap onto the next line of their paragraph)."""
    rel = doc.relative_to(root).as_posix()
    lines = doc.read_text(encoding="utf-8").splitlines()
    para: list[tuple[int, str]] = []
    fence: str | None = None

    def flush() -> Iterator[Citation]:
        if not para:
            return
        text = "\n".join(line for _, line in para)
        starts = []
        pos = 0
        for number, line in para:
            starts.append((pos, number))
            pos += len(line) + 1
        for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.DOTALL):
            offset = m.start()
            number = max(n for p, n in starts if p <= offset)
            yield Citation(rel, number, " ".join(m.group(2).split()))
        para.clear()

    for number, line in enumerate(lines, 1):
        stripped = line.lstrip()
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            continue
        if stripped.startswith(("```", "~~~")):
            yield from flush()
            fence = stripped[:3]
            continue
        if not stripped:
            yield from flush()
            continue
        para.append((number, line))
    yield from flush()


# ----------------------------------------------------------------------------- static index


class Index:
    """The modules of the packages, what each binds at module level, and their classes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: dict[str, Path | None] = {}  # None: a folder without __init__.py
        for package in PACKAGES:
            base = root / package
            if not base.is_dir():
                continue
            for path in sorted(base.rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                if "__pycache__" in parts or any(not p.isidentifier() for p in parts):
                    continue
                if parts[-1] == "__init__":
                    self.modules[".".join(parts[:-1])] = path
                else:
                    self.modules[".".join(parts)] = path
                for i in range(1, len(parts)):
                    self.modules.setdefault(".".join(parts[:i]), None)
        self._trees: dict[str, ast.Module | None] = {}
        self.classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
        self.basenames: dict[str, list[str]] = {}
        self.strings: set[str] = set()
        for name in self.modules:
            tree = self.tree(name)
            self.basenames.setdefault(name.rsplit(".", 1)[-1], []).append(name)
            if tree is None:
                continue
            for stmt in tree.body:
                if isinstance(stmt, ast.ClassDef) and not stmt.name.startswith("_"):
                    self.classes.setdefault(stmt.name, []).append((name, stmt))
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    self.strings.add(node.value)

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.modules.get(module)
            try:
                self._trees[module] = (ast.parse(path.read_text(encoding="utf-8"))
                                       if path is not None else None)
            except (OSError, SyntaxError, ValueError):
                self._trees[module] = None
        return self._trees[module]

    def package_of(self, module: str) -> list[str]:
        path = self.modules.get(module)
        parts = module.split(".")
        return parts if path is None or path.name == "__init__.py" else parts[:-1]

    # --- resolution: True = exists (or cannot be known), False = missing
    def module_attr(self, module: str, names: list[str], depth: int = 0) -> bool:
        if not names:
            return True
        if depth > 20:
            return True
        first, rest = names[0], names[1:]
        if f"{module}.{first}" in self.modules:
            return self.module_attr(f"{module}.{first}", rest, depth + 1)
        tree = self.tree(module)
        if tree is None:  # a folder without __init__.py has only its modules; a file that
            return self.modules.get(module) is not None  # does not parse: cannot know
        found = self._binding(module, tree, first)
        if found is None:
            return False
        kind, value = found
        if kind == "any":
            return True
        if kind == "class":
            assert isinstance(value, ast.ClassDef)
            return self.class_attr(module, value, rest, depth + 1)
        if kind == "import":  # value: (module, name or None)
            assert isinstance(value, tuple)
            src, orig = value
            if src not in self.modules:
                return src.split(".")[0] not in PACKAGES  # third-party: anything goes
            return self.module_attr(src, ([orig] if orig else []) + rest, depth + 1)
        return True

    def _binding(self, module: str, tree: ast.Module, name: str
                 ) -> tuple[str, object] | None:
        getattr_def: ast.FunctionDef | None = None
        star_sources: list[str] = []
        for node in _module_level(tree.body):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return "class", node
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node.name == name:
                    return "any", None
                if node.name == "__getattr__" and isinstance(node, ast.FunctionDef):
                    getattr_def = node
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(name in _target_names(t) for t in targets):
                    return "any", None
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    if bound == name:
                        target = alias.name if alias.asname else alias.name.split(".")[0]
                        return "import", (target, None)
            elif isinstance(node, ast.ImportFrom):
                src = self._from_module(module, node)
                for alias in node.names:
                    if alias.name == "*":
                        star_sources.append(src)
                    elif (alias.asname or alias.name) == name:
                        if f"{src}.{alias.name}" in self.modules:
                            return "import", (f"{src}.{alias.name}", None)
                        return "import", (src, alias.name)
        if getattr_def is not None:
            lazy = _lazy_names(getattr_def)
            if name in lazy:
                lazy_import = lazy[name]
                if lazy_import is None:
                    return "any", None
                return "import", (self._from_module(module, lazy_import), name)
            if not _raises_attribute_error(getattr_def):
                return "any", None
        for src in star_sources:
            if src.split(".")[0] not in PACKAGES:
                return "any", None
            if self.module_attr(src, [name], 19):
                return "import", (src, name)
        return None

    def _from_module(self, module: str, node: ast.ImportFrom | None) -> str:
        if node is None:
            return ""
        if not node.level:
            return node.module or ""
        parts = self.package_of(module)
        parts = parts[:len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def class_attr(self, module: str, cls: ast.ClassDef, names: list[str], depth: int = 0
                   ) -> bool:
        if not names or depth > 20:
            return True
        first, rest = names[0], names[1:]
        if first.startswith("__") and first.endswith("__"):
            return True
        members = _class_members(cls)
        if first in members:
            node = members[first]
            if isinstance(node, ast.ClassDef):
                return self.class_attr(module, node, rest, depth + 1)
            return True
        tree = self.tree(module)
        for base in cls.bases:
            expr = base.value if isinstance(base, ast.Subscript) else base
            text = ast.unparse(expr)
            if text in TRANSPARENT_BASES:
                continue
            resolved = self._class_of(module, tree, text, depth) if tree is not None else None
            if resolved is None:
                return True  # a base from elsewhere: cannot know its attributes
            if self.class_attr(resolved[0], resolved[1], names, depth + 1):
                return True
        return False

    def _class_of(self, module: str, tree: ast.Module, dotted: str, depth: int
                  ) -> tuple[str, ast.ClassDef] | None:
        """The class `dotted` names in `module`, if it is one of ours."""
        head, _, tail = dotted.partition(".")
        found = self._binding(module, tree, head)
        for _ in range(20):
            if found is None:
                return None
            kind, value = found
            if kind == "class" and not tail:
                assert isinstance(value, ast.ClassDef)
                return module, value
            if kind != "import":
                return None
            assert isinstance(value, tuple)
            src, orig = value
            if src not in self.modules or self.tree(src) is None:
                return None
            src_tree = self.tree(src)
            assert src_tree is not None
            if orig is None:  # a module: the rest of the dotted name is in it
                if not tail:
                    return None
                head, _, tail = tail.partition(".")
                module, found = src, self._binding(src, src_tree, head)
            else:
                module, found = src, self._binding(src, src_tree, orig)
        return None


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that bind module-level names (descending into if/try/with blocks)."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.With | ast.For | ast.While):
            yield from _module_level(node.body)
            yield from _module_level(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            yield from _module_level(node.body)
            for handler in node.handlers:
                yield from _module_level(handler.body)
            yield from _module_level(node.orelse)
            yield from _module_level(node.finalbody)


def _target_names(target: ast.expr) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Tuple | ast.List):
        return set().union(*(_target_names(e) for e in target.elts))
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return set()


def _lazy_names(func: ast.FunctionDef) -> dict[str, ast.ImportFrom | None]:
    """Names a module's `__getattr__` answers: `if name == "X": from .m import X ...`."""
    out: dict[str, ast.ImportFrom | None] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Compare) and len(node.comparators) == 1:
            right = node.comparators[0]
            values: list[str] = []
            if isinstance(right, ast.Constant) and isinstance(right.value, str):
                values = [right.value]
            elif isinstance(right, ast.Tuple | ast.List | ast.Set):
                values = [e.value for e in right.elts
                          if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            for value in values:
                out.setdefault(value, None)
    for node in ast.walk(func):
        if isinstance(node, ast.If):
            names = _lazy_names_of_test(node.test)
            for stmt in ast.walk(ast.Module(body=node.body, type_ignores=[])):
                if isinstance(stmt, ast.ImportFrom):
                    for alias in stmt.names:
                        if alias.name in names:
                            out[alias.name] = stmt
    return out


def _lazy_names_of_test(test: ast.expr) -> set[str]:
    return {n.value for n in ast.walk(test)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _raises_attribute_error(func: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Raise) and n.exc is not None
               and "AttributeError" in ast.unparse(n.exc) for n in ast.walk(func))


def _class_members(cls: ast.ClassDef) -> dict[str, ast.AST]:
    members: dict[str, ast.AST] = {}
    for node in _module_level(cls.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in _target_names(target):
                    members[name] = node
                if (isinstance(target, ast.Name) and target.id == "__slots__"
                        and node.value is not None):
                    for elt in ast.walk(node.value):
                        if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                            members[elt.value] = node
    for any_node in ast.walk(cls):  # self.x = ... / self.x: T = ... in any method
        assigned: list[ast.expr] = []
        if isinstance(any_node, ast.Assign):
            assigned = any_node.targets
        elif isinstance(any_node, ast.AnnAssign | ast.AugAssign):
            assigned = [any_node.target]
        for target in assigned:
            for t in ast.walk(target):
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                        and t.value.id in ("self", "cls")):
                    members.setdefault(t.attr, any_node)
    return members


# ----------------------------------------------------------------------------- the rules


class Checker:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.index = Index(root)
        self.top = {p.name for p in root.iterdir()} if root.is_dir() else set()
        self._basenames: set[str] | None = None
        self.outputs = ignored_folders(root)

    def file_basenames(self) -> set[str]:
        if self._basenames is None:
            names: set[str] = set()
            stack = [self.root]
            while stack:
                folder = stack.pop()
                for entry in folder.iterdir():
                    if entry.is_dir():
                        if (entry.name in SKIP_DIRS or entry.name.endswith(".egg-info")
                                or (folder == self.root and entry.name in TOP_SKIP_DIRS)):
                            continue
                        stack.append(entry)
                    else:
                        names.add(entry.name)
            self._basenames = names
        return self._basenames

    def problem(self, span: str) -> str | None:
        """None if `span` is fine (or not checked); else the name that was not found."""
        called = CALLED.match(span)
        if called:
            name = called.group(1)
            return self.name(name) if DOTTED.match(name) else None
        tokens = span.split()
        if len(tokens) > 1:
            return self.command(tokens)
        token = span.strip().rstrip(".:")
        if token.startswith("./"):
            token = token[2:]
        if "/" in token:
            return self.path(token)
        if DOTTED.match(token) and not DATA_SUFFIXES.intersection(token.split(".")[1:]):
            return self.name(token)
        if re.fullmatch(r"[\w.\-]+\.(py|md)", token):
            return None if token in self.file_basenames() else token
        return None

    def command(self, tokens: list[str]) -> str | None:
        if tokens[0] in ("python", "python3"):
            rest = tokens[1:]
            if rest[:1] == ["-m"]:
                return None  # a module run: packages are checked as names elsewhere
            script = next((t for t in rest if not t.startswith("-")), None)
            if script and (script.endswith(".py") or "/" in script):
                return self.path(script) if "/" in script else (
                    None if script in self.file_basenames() else script)
            return None
        first = tokens[0]
        if first.endswith(".py") and "/" in first:
            return self.path(first)
        return None

    def path(self, token: str) -> str | None:
        if (token.startswith(("/", "~", "..")) or PLACEHOLDER.search(token)
                or not PATHLIKE.match(token)):
            return None
        if any(token.startswith(prefix) for prefix in self.outputs):
            return None  # written by a run (bench/results/...): not kept in the repository
        parts = token.rstrip("/").split("/")
        if parts[0] in self.top or parts[0] in PACKAGES:
            bases = [self.root]
        else:
            bases = [self.root / pkg for pkg in PACKAGES
                     if (self.root / pkg / parts[0]).is_dir()
                     or (self.root / pkg / f"{parts[0]}.py").is_file()]
            if not bases:
                return None  # not a path of this repository (a store key, a user's folder)
        for base in bases:
            if self._path_exists(base, parts):
                return None
        return token

    def _path_exists(self, base: Path, parts: list[str]) -> bool:
        target = base.joinpath(*parts)
        if target.exists() or target.with_name(target.name + ".py").is_file():
            return True
        stem, dot, attrs = parts[-1].partition(".")
        if not dot or attrs in DATA_SUFFIXES:
            return False
        module_file = base.joinpath(*parts[:-1], f"{stem}.py")
        if not module_file.is_file():
            return False
        try:
            rel = module_file.relative_to(self.root).with_suffix("").parts
        except ValueError:
            return False
        module = ".".join(rel)
        if module not in self.index.modules:
            return True  # a script outside the packages: its names are not indexed
        return self.index.module_attr(module, attrs.split("."))

    def name(self, dotted: str) -> str | None:
        parts = dotted.split(".")
        head = parts[0]
        if DATA_SUFFIXES.intersection(parts[1:]):
            return None  # a file name (`dataset.json`), or a field of one
        if head in PACKAGES:
            if head not in self.index.modules:
                return None  # a tree without that package: nothing to check against
            k = len(parts)
            while k > 1 and ".".join(parts[:k]) not in self.index.modules:
                k -= 1
            if self.index.module_attr(".".join(parts[:k]), parts[k:]):
                return None
            return None if dotted in self.index.strings else dotted
        candidates: list[bool] = []
        for cls_name in (head, *INSTANCE_NAMES.get(head, ())):
            if cls_name[:1].isupper():
                for module, cls in self.index.classes.get(cls_name, []):
                    candidates.append(self.index.class_attr(module, cls, parts[1:]))
        for module in self.index.basenames.get(head, []):
            if module in PACKAGES:
                continue
            candidates.append(self.index.module_attr(module, parts[1:]))
        if not candidates or any(candidates):
            return None
        return None if dotted in self.index.strings else dotted


def ignored_folders(root: Path) -> list[str]:
    """Anchored folders of the root .gitignore (`/bench/results/`): where runs write."""
    path = root / ".gitignore"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("/") and line.endswith("/") and not PLACEHOLDER.search(line):
            out.append(line[1:])
    return out


def load_ignores(root: Path) -> set[tuple[str, str]]:
    path = root / IGNORE_FILE
    out: set[tuple[str, str]] = set()
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        doc, _, name = line.partition(":")
        out.add((doc.strip(), name.strip().strip("`")))
    return out


def check(root: Path, docs: Sequence[Path] | None = None) -> list[str]:
    """`file:line: `name` not found` for every stale citation under `root`."""
    checker = Checker(root)
    ignores = load_ignores(root)
    problems: list[str] = []
    for doc in docs if docs is not None else documents(root):
        for cite in citations(root, doc):
            missing = checker.problem(cite.text)
            if missing is None or (cite.path, missing) in ignores or (
                    cite.path, cite.text) in ignores:
                continue
            problems.append(f"{cite.path}:{cite.line}: `{missing}` not found")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="repository root (default: this script's repository)")
    parser.add_argument("docs", nargs="*", type=Path, help="documents (default: all)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    docs = [d.resolve() for d in args.docs] or None
    problems = check(root, docs)
    for problem in problems:
        print(problem)
    if problems:
        print(f"check_docs: {len(problems)} stale reference(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
