"""Exports that other ecosystems load without ckptstore: Hugging Face-style sharded safetensors
and a plain zarr v3 hierarchy. Both read one bounded piece of the checkpoint at a time (a
shard's tensors; one tensor's row blocks), so memory stays near `max_shard_bytes` or one chunk.

* Sharded safetensors (`write_sharded_safetensors`): OUT is a folder holding
  `model-00001-of-0000N.safetensors` files of at most `max_shard_bytes` tensor bytes each (a
  tensor larger than that gets a shard of its own, as Hugging Face does) and
  `model.safetensors.index.json` = `{"metadata": {"total_size": N}, "weight_map": {key: file}}`.
  Keys are the checkpoint's dotted keys; numpy arrays become tensors; plain values are left
  out and reported; tied tensors are written as copies.
* zarr (`write_zarr`): OUT is a zarr v3 group; each tensor an array named by its dotted key,
  chunked in the checkpoint's row blocks. bfloat16/float8/complex32 hold raw bits (uint16,
  uint8, uint32) with the real dtype in the array's `attributes["ckptstore"]["dtype"]`; the
  group's attributes hold the checkpoint name, its metadata and the plain values that JSON can
  carry (`attributes["ckptstore"]["values"]`).

Every export is checked before anything is read (`check_target`): an existing OUT is refused
unless `overwrite`, a missing parent folder is an error. Output is built in a temporary
sibling, fsynced, and moved into place; files get the mode the process umask allows (the
safetensors library alone would create them 0600).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..deps import require
from ..errors import FormatError
from ..format.manifest import Manifest
from . import inspection

INDEX_NAME = "model.safetensors.index.json"
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes in '5GB' (10^9, as Hugging Face reads it), '4GiB' (2^30), '500MB', '1024'."""
    m = _SIZE_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"invalid size {text!r} (use e.g. 5GB, 500MB, 2GiB)")
    n = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "B").upper()]
    if n < 1:
        raise ValueError(f"size {text!r} must be at least one byte")
    return int(n)


def check_target(out: str | os.PathLike[str], overwrite: bool) -> Path:
    """OUT as an absolute path, after refusing what would fail only after a long read: an
    existing OUT without `overwrite`, or a parent folder that does not exist."""
    path = Path(out).absolute()
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise FileExistsError(f"{path} exists (pass --force to replace it)")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"no such folder: {path.parent}")
    return path


def process_umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc), else by the
    classic set-and-restore."""
    try:
        with open("/proc/self/status") as f:
            for text in f:
                if text.startswith("Umask:"):
                    return int(text.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path, *, folder: bool = False) -> None:
    """Give `path` the mode a plain open()/mkdir() would have given it."""
    os.chmod(path, (0o777 if folder else 0o666) & ~process_umask())


def _fsync(path: Path, *, folder: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if folder else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(root: Path) -> None:
    """fsync every file and folder under root, folders after their contents."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder), folder=True)


def publish_folder(build: Callable[[Path], object], out: Path, overwrite: bool) -> None:
    """Run build(tmp) on a fresh folder beside OUT, make it durable, then move it to OUT
    (replacing an existing OUT only when `overwrite`). A failed build leaves OUT untouched."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        build(tmp)
        for folder, dirs, files in os.walk(tmp):
            for name in files:
                apply_umask(Path(folder) / name)
            for name in dirs:
                apply_umask(Path(folder) / name, folder=True)
        apply_umask(tmp, folder=True)
        _sync_tree(tmp)
        if out.exists() or out.is_symlink():
            if not overwrite:
                raise FileExistsError(f"{out} appeared during the export; left untouched")
            os.rename(out, old)
        os.rename(tmp, out)
        _fsync(out.parent, folder=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists():
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


# --------------------------------------------------------------------------- safetensors
def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Keys grouped in order into shards of at most `max_shard_bytes` (a bigger tensor alone)."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for key, nbytes in sizes:
        if current and used + nbytes > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(key)
        used += nbytes
    if current:
        shards.append(current)
    return shards


def alias_targets(manifest: Manifest) -> dict[str, str]:
    """key -> the earlier key it shares storage with (tied tensors)."""
    return {leaf.key: leaf.alias_of for leaf in inspection.leaves(manifest)
            if leaf.alias_of is not None}


def tensor_leaves(manifest: Manifest, keys: list[str] | None) -> tuple[list[tuple[str, int]],
                                                                          list[str]]:
    """([(key, bytes)] of the tensors to export, [keys of plain values left out])."""
    chosen = None if keys is None else set(keys)
    tensors: list[tuple[str, int]] = []
    skipped: list[str] = []
    for leaf in inspection.leaves(manifest):
        if chosen is not None and leaf.key not in chosen:
            continue
        if leaf.entry is not None and leaf.entry.kind != "bytes":
            tensors.append((leaf.key, leaf.entry.nbytes))
        else:
            skipped.append(leaf.key)
    return tensors, skipped


def as_safetensors_dict(flat: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Flat key -> tensor for safetensors: numpy becomes torch, tensors are made contiguous,
    a tensor sharing memory with an earlier one is copied (safetensors refuses shared memory),
    complex128/complex32 are refused (safetensors lacks them)."""
    torch = require("torch")
    tensors: dict[str, Any] = {}
    seen: set[int] = set()
    for key, value in flat:
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        if not isinstance(value, torch.Tensor):
            continue
        if value.dtype in (torch.complex128, torch.complex32):
            raise FormatError(f"{key}: safetensors cannot store {value.dtype}; export to a "
                              "torch file or zarr instead")
        t = value.detach().contiguous()
        if t.numel():
            if t.untyped_storage().data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
        tensors[key] = t
    return tensors


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def write_sharded_safetensors(load: Callable[[list[str]], Iterable[tuple[str, Any]]],
                              tensors: list[tuple[str, int]], folder: Path,
                              max_shard_bytes: int, file_metadata: dict[str, str], *,
                              publish: Callable[[Callable[[Path], object]], None]) -> int:
    """Write the shards and the index through `publish(build)` (build(tmp) fills a fresh
    folder); `load(keys)` yields (key, tensor) for one shard's keys. Returns the number of
    shard files."""
    save_file = require("safetensors.torch").save_file
    shards = plan_shards(tensors, max_shard_bytes)
    sizes = dict(tensors)

    def build(tmp: Path) -> None:
        weight_map: dict[str, str] = {}
        for i, keys in enumerate(shards, 1):
            name = shard_name(i, len(shards))
            save_file(as_safetensors_dict(load(keys)), str(tmp / name), metadata=file_metadata)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": sum(sizes.values()), **file_metadata},
                 "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    publish(build)
    return len(shards)


# --------------------------------------------------------------------------- zarr
def write_zarr(source: Any, folder: Path, values: dict[str, Any],
               group_attributes: dict[str, Any], *, max_block_bytes: int = 64 << 20) -> int:
    """Copy every array of the zarr group `source` (the checkpoint's zarr view) into a new
    zarr v3 group at `folder`, with the same dtypes, shapes, chunks and attributes, copying
    at most about `max_block_bytes` per step. Returns the number of arrays."""
    import zarr

    out = zarr.open_group(str(folder), mode="w", zarr_format=3)
    out.attrs.update({"ckptstore": {**group_attributes, "values": values}})
    count = 0
    for name, src in source.arrays():
        dst = out.create_array(name, shape=src.shape, dtype=src.dtype, chunks=src.chunks,
                               attributes=dict(src.attrs), fill_value=0)
        if src.ndim == 0:
            dst[...] = src[...]
        elif src.size:
            row_bytes = max(1, src.nbytes // max(1, src.shape[0]))
            step = max(src.chunks[0], (max_block_bytes // row_bytes) // src.chunks[0]
                       * src.chunks[0])
            for start in range(0, src.shape[0], step):
                dst[start:start + step] = src[start:start + step]
        count += 1
    return count
