"""Whole-repository operations (`list`, `latest`, `ckpt ls`, `ckpt du`, `gc`, `ckpt gc`) hold at
most one parsed manifest at a time: their peak memory (tracemalloc) does not grow with the
number of checkpoints (issue 26).

Two repositories hold 2 and 6 checkpoints of the same state (the first saved, the others its
manifest committed again under later names and times: real manifests over the same blobs, so
everything but the manifests is the same size in both). Each operation runs on a fresh store
object (nothing cached) in each; holding every manifest at once would cost 4 parsed manifests
more in the bigger one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli import main as ckpt_main
from ckptstore.format.hashing import XXH3_128
from ckptstore.format.manifest_parse import parse_manifest
from ckptstore.layout import manifest_key, segments_in

TENSORS = 2000
FEW, MANY = 2, 6


def _repository(path: Path, count: int) -> Path:
    with CheckpointStore(path) as repo:
        repo.save("c0", {f"layers.{i // 100}.w{i % 100}": torch.full((8,), float(i))
                         for i in range(TENSORS)}, parent=None)
        first = repo.manifest("c0")
        for i in range(1, count):
            copy = dataclasses.replace(first, name=f"c{i}", created=first.created + i,
                                       parent=f"c{i - 1}")
            repo.store.create(manifest_key(copy.name), copy.to_bytes())
    return path


def _peak(fn: Callable[[], Any]) -> int:
    """Peak traced bytes while `fn` runs (its result dropped before the next measure)."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _held_by_one_manifest(path: Path) -> int:
    """What one parsed manifest holds once all of it is used (a version-3 root, its tree and
    its index segments)."""
    raw = (path / "checkpoints" / "c0.json").read_bytes()
    source = segments_in([CheckpointStore(path, create=False).store], XXH3_128)
    gc.collect()
    tracemalloc.start()
    try:
        manifest = parse_manifest(raw, "c0", XXH3_128, source)
        assert manifest.tree is not None and len(list(manifest.tensors)) == TENSORS
        held = tracemalloc.get_traced_memory()[0]
        del manifest
        return held
    finally:
        tracemalloc.stop()


def _ckpt(*argv: str) -> Callable[[], Any]:
    def run() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            assert ckpt_main([*argv, "--json"]) == 0

    return run


OPERATIONS: dict[str, Callable[[Path], Callable[[], Any]]] = {
    "list": lambda p: lambda: CheckpointStore(p, create=False).list(),
    "latest": lambda p: lambda: CheckpointStore(p, create=False).latest(),
    "gc (dry run)": lambda p: lambda: CheckpointStore(p, create=False).gc(dry_run=True),
    "gc": lambda p: lambda: CheckpointStore(p, create=False).gc(grace_seconds=0),
    "ckpt ls": lambda p: _ckpt("ls", str(p)),
    "ckpt du": lambda p: _ckpt("du", str(p)),
    "ckpt gc --dry-run": lambda p: _ckpt("gc", str(p), "--dry-run"),
}


@pytest.fixture(scope="module")
def repositories(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    root = tmp_path_factory.mktemp("bounded")
    few = _repository(root / "few", FEW)
    many = _repository(root / "many", MANY)
    return few, many, _held_by_one_manifest(few)


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_peak_memory_does_not_grow_with_the_number_of_checkpoints(repositories, operation):
    few, many, one = repositories
    make = OPERATIONS[operation]
    make(few)()  # warm: imports and first-use caches are not what is measured
    small, big = _peak(make(few)), _peak(make(many))
    grown = big - small
    # holding every manifest would add (MANY - FEW) manifests; allow half of one for the
    # rows the results do hold per checkpoint (names, metadata, a set of blob digests)
    assert grown < one / 2, (
        f"{operation}: peak {small / 2**20:.1f} MiB with {FEW} checkpoints, "
        f"{big / 2**20:.1f} MiB with {MANY} (+{grown / 2**20:.1f} MiB; one parsed manifest "
        f"holds {one / 2**20:.1f} MiB)")


def test_results_are_those_of_every_manifest(repositories):
    _few, many, _one = repositories
    repo = CheckpointStore(many, create=False)
    infos = repo.list()
    assert [i.name for i in infos] == [f"c{i}" for i in range(MANY)]
    assert all(i.tensors == TENSORS for i in infos)
    assert repo.latest() == f"c{MANY - 1}"
    assert repo.catalog._manifests.keys() == {f"c{MANY - 1}"}  # list() cached none
    assert repo.gc(dry_run=True).deleted_blobs == 0
