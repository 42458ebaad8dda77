"""A folder of files: every regular file (recursively, sorted by path) is one sample with
fields ``path`` (the path relative to the folder, '/'-separated) and ``data`` (its bytes).
Symbolic links to folders are not followed; hidden files (a name starting with '.') are
skipped."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from .base import Sample, Source


def _walk(root: Path) -> list[Path]:
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_file():
            out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def iter_files(root: Path, files: Sequence[Path]) -> Iterator[Sample]:
    for p in files:
        yield {"path": p.relative_to(root).as_posix(), "data": p.read_bytes()}


def files_source(src: Path) -> Source:
    if not src.is_dir():
        raise ValueError(f"{src}: --format files needs a folder")
    files = _walk(src)
    if not files:
        raise FileNotFoundError(f"{src}: no files in this folder")
    return Source("files", files, lambda: iter_files(src, files), len(files))
