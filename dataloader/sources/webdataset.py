"""WebDataset tar shards (``.tar``, ``.tar.gz``, ``.tgz``; one file or a folder of them, sorted
by path). As in WebDataset, consecutive members with the same key form one sample; a member's
key is its path up to the first '.' of its file name and its extension the rest
(``a/x01.seg.png`` -> key ``a/x01``, extension ``seg.png``). Each extension becomes a bytes
field (dots turned into '_': ``seg_png``) and the key a str field ``key``. Every sample must
have the same extensions as the first; folders, links and other non-file members are skipped."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..format.spec import validate_field_name
from .base import Sample, Source, files_with

_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def _split_name(name: str) -> tuple[str, str]:
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (ext if dot else "")


def _field(ext: str, where: str) -> str:
    name = ext.replace(".", "_")
    try:
        return validate_field_name(name)
    except ValueError as exc:
        raise ValueError(f"{where}: extension {ext!r} is not usable as a field ({exc})") from None


def _members(path: Path) -> Iterator[tuple[str, str, bytes]]:
    """(key, extension, bytes) of each file member, in tar order."""
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key, ext = _split_name(m.name)
                f = tar.extractfile(m)
                assert f is not None
                yield key, ext, f.read()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ValueError(f"{path}: not a readable tar file ({exc})") from None


def _grouped(path: Path) -> Iterator[tuple[str, Sample]]:
    """(where, sample) of each group of consecutive members with one key."""
    key: str | None = None
    sample: Sample = {}
    for k, ext, data in _members(path):
        where = f"{path}, member {k}.{ext}"
        if not ext:
            raise ValueError(f"{where}: a member without an extension")
        if k != key:
            if key is not None:
                yield f"{path}, sample {key!r}", sample
            key, sample = k, {"key": k}
        name = _field(ext, where)
        if name in sample:
            raise ValueError(f"{where}: extension {ext!r} appears twice for key {k!r}")
        sample[name] = data
    if key is not None:
        yield f"{path}, sample {key!r}", sample


def iter_webdataset(files: Sequence[Path]) -> Iterator[Sample]:
    expected: set[str] | None = None
    for path in files:
        for where, sample in _grouped(path):
            fields = set(sample) - {"key"}
            if expected is None:
                expected = fields
            elif fields != expected:
                raise ValueError(
                    f"{where}: extensions {sorted(fields)}, the first sample had"
                    f" {sorted(expected)} (every sample needs the same ones)"
                )
            yield sample


def webdataset_source(src: Path) -> Source:
    files = files_with(src, _SUFFIXES, "tar")
    return Source("webdataset", files, lambda: iter_webdataset(files),
                  file_samples=lambda i: iter_webdataset(files[i : i + 1]))
