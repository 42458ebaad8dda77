"""Export checkpoints to, and import them from, other PyTorch formats. Imports torch (and
safetensors) lazily: only these code paths of the CLI pay for it.

Export (OUT is checked first; see also `exports` for Hugging Face-style sharded safetensors
and zarr v3 groups, which read one shard or one block of rows at a time). The single-file
formats load the whole checkpoint, or the keys chosen, into memory:
* `.safetensors`: a flat map of dotted key -> tensor. numpy arrays become tensors; plain values
  (ints, strings, ...) and `bytes` cannot be stored and are reported as skipped; a tensor that
  shares memory with an earlier one (tied weights) is written as its own copy. The file's
  `__metadata__` holds `ckptstore.checkpoint` (the name) and `ckptstore.metadata` (the user
  metadata as JSON). complex128 and complex32 are refused (safetensors lacks them).
* torch file (`.pt`, `.pth`, `.bin`, or `--format torch`): the nested state as `torch.save`
  writes it, loadable with `torch.load(..., weights_only=True)`: numpy arrays become tensors,
  numpy scalars become Python numbers (reported as converted).
Both are written to a temp file beside OUT, fsynced, then moved into place; an existing OUT
is refused unless `overwrite=True`.

Import:
* `.safetensors` (recognised by content, not by name): the flat dict; `ckptstore.metadata`
  written by our export is restored as the checkpoint's metadata.
* a torch file: `torch.load(weights_only=True, mmap=True)` — no arbitrary code runs.
* a `torch.distributed.checkpoint` (DCP) directory (it holds a `.metadata` file): DCP's
  `.metadata` is a Python pickle and its non-tensor values are `torch.load`ed without
  `weights_only`, so reading it can run code chosen by whoever wrote the directory. This
  import therefore TRUSTS ITS SOURCE, and refuses unless `trust_pickle=True`. The directory is
  read through torch.distributed.checkpoint's own reader (in this process, no process group);
  ckptstore itself unpickles nothing. DCP turns int dict keys into strings.
The import holds a save lease (see `leases`) so a concurrent `ckpt gc` cannot break it.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..deps import require
from ..errors import CkptStoreError, FormatError
from ..format.manifest import Manifest
from ..maintenance import leases
from ..repository import REPO_DEFAULT, CheckpointStore, Compression
from . import exports, inspection

FORMATS = ("safetensors", "torch", "dcp")
EXPORT_FORMATS = ("safetensors", "torch", "zarr")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # "5GB", as Hugging Face reads it
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
DCP_METADATA = ".metadata"


class TrustRequiredError(CkptStoreError, PermissionError):
    """The source can only be read by unpickling it; the caller did not say it trusts it."""


@dataclass
class ExportReport:
    name: str
    out: str
    format: str
    tensors: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # keys not representable in the format
    converted: list[str] = field(default_factory=list)  # keys whose type was changed
    files: int = 1  # files written (shards of a sharded safetensors export)
    seconds: float = 0.0


@dataclass
class ImportReport:
    name: str
    source: str
    format: str
    tensors: int = 0
    logical_bytes: int = 0
    written_bytes: int = 0
    reused_bytes: int = 0
    seconds: float = 0.0


# --------------------------------------------------------------------------- formats
def export_format(out: str | os.PathLike[str], fmt: str | None) -> str:
    """The export format: `fmt` if given, else from OUT's suffix."""
    if fmt is not None:
        if fmt not in EXPORT_FORMATS:
            raise ValueError(f"export format must be one of {', '.join(EXPORT_FORMATS)}, "
                             f"not {fmt!r}")
        return fmt
    suffix = Path(out).suffix.lower()
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in TORCH_SUFFIXES:
        return "torch"
    if suffix == ".zarr":
        return "zarr"
    raise ValueError(f"cannot tell the format from {str(out)!r}: name it *.safetensors, *.pt "
                     "or *.zarr, or pass --format (safetensors to a folder: sharded)")


def single_safetensors_file(out: str | os.PathLike[str]) -> bool:
    """A safetensors export to OUT ending in .safetensors is one file; to anything else, a
    folder of Hugging Face-style shards with an index."""
    return Path(out).suffix.lower() == ".safetensors"


def _looks_like_safetensors(path: Path) -> bool:
    """safetensors: u64 little-endian header length, then a JSON object."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 8 + n <= size


def detect_format(source: str | os.PathLike[str]) -> str:
    """'dcp' for a directory with a .metadata file, 'safetensors' or 'torch' for a file."""
    path = Path(source)
    if path.is_dir():
        if (path / DCP_METADATA).is_file():
            return "dcp"
        raise FormatError(f"{path} is a directory without {DCP_METADATA}: not a "
                          "torch.distributed.checkpoint directory")
    if not path.exists():
        raise FileNotFoundError(f"no such file or directory: {path}")
    if _looks_like_safetensors(path):
        return "safetensors"
    return "torch"


# --------------------------------------------------------------------------- export
def _write_atomic(out: Path, overwrite: bool, write: Any) -> None:
    """Call write(tmp_path), fsync it, move it to `out` (create-only unless overwrite)."""
    out = exports.check_target(out, overwrite)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        exports.apply_umask(tmp)  # the safetensors library creates its files 0600
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, out)
        else:
            os.link(tmp, out)  # fails if OUT appeared meanwhile
        dfd = os.open(out.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        tmp.unlink(missing_ok=True)


def _flat_items(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _flat_items(v, (*path, k))]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in _flat_items(v, (*path, i))]
    return [(".".join(str(p) for p in path), obj)]


def export_checkpoint(repo: CheckpointStore, name: str, out: str | os.PathLike[str], *,
                      fmt: str | None = None, keys: list[str] | None = None,
                      overwrite: bool = False,
                      max_shard_bytes: int | None = None) -> ExportReport:
    """Write checkpoint `name` (or the keys `keys`) to OUT; see the module docstring. OUT is
    checked before anything is read (an existing OUT needs `overwrite`)."""
    fmt = export_format(out, fmt)
    exports.check_target(out, overwrite)
    t0 = time.perf_counter()
    manifest = repo.manifest(name)
    report = ExportReport(manifest.name, str(out), fmt)
    tensors, skipped = exports.tensor_leaves(manifest, keys)
    report.tensors = len(tensors)
    report.bytes = sum(n for _k, n in tensors)
    meta = {"format": "pt", "ckptstore.checkpoint": manifest.name,
            "ckptstore.metadata": json.dumps(manifest.metadata, sort_keys=True)}
    if fmt == "safetensors":
        report.skipped = skipped
        if single_safetensors_file(out):
            if max_shard_bytes is not None and report.bytes > max_shard_bytes:
                raise ValueError(f"{report.bytes} bytes of tensors do not fit in one file of at "
                                 f"most {max_shard_bytes} bytes: give a folder as OUT to "
                                 "write shards")
            data = exports.as_safetensors_dict(
                _load_flat(repo, manifest, [k for k, _n in tensors]))
            save_file = require("safetensors.torch").save_file
            _write_atomic(Path(out), overwrite, lambda p: save_file(data, p, metadata=meta))
        else:
            def load(chunk: list[str]) -> list[tuple[str, Any]]:
                return _load_flat(repo, manifest, chunk)

            report.files = exports.write_sharded_safetensors(
                load, tensors, Path(out), max_shard_bytes or DEFAULT_MAX_SHARD_BYTES, meta,
                publish=lambda build: exports.publish_folder(build, Path(out).absolute(),
                                                             overwrite))
        report.seconds = time.perf_counter() - t0
        return report
    if fmt == "zarr":
        values = _plain_values(manifest)
        report.skipped = [k for k in skipped if k not in values]
        _export_zarr(repo, manifest, Path(out), [k for k, _n in tensors],
                     {k: v for k, v in values.items() if k in skipped}, overwrite)
        report.seconds = time.perf_counter() - t0
        return report
    torch = require("torch")
    state = repo.load(manifest.name, keys=keys)
    report.tensors = 0
    report.bytes = 0

    def convert(obj: Any, path: tuple[Any, ...]) -> Any:
        key = ".".join(str(p) for p in path)
        if isinstance(obj, OrderedDict):
            new = OrderedDict((k, convert(v, (*path, k))) for k, v in obj.items())
            meta = getattr(obj, "_metadata", None)
            if meta is not None:
                new._metadata = meta  # type: ignore[attr-defined]
            return new
        if isinstance(obj, dict):
            return {k: convert(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [convert(v, (*path, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(convert(v, (*path, i)) for i, v in enumerate(obj))
        if isinstance(obj, np.ndarray):
            report.converted.append(key)
            obj = torch.from_numpy(np.ascontiguousarray(obj))
        if isinstance(obj, np.generic):
            report.converted.append(key)
            return obj.item()
        if isinstance(obj, torch.Tensor):
            report.tensors += 1
            report.bytes += obj.numel() * obj.element_size()
        return obj

    converted = convert(state, ())
    _write_atomic(Path(out), overwrite, lambda p: torch.save(converted, p))
    report.seconds = time.perf_counter() - t0
    return report


def _load_flat(repo: CheckpointStore, manifest: Manifest,
               keys: list[str]) -> list[tuple[str, Any]]:
    """(key, value) of the tensor leaves `keys`, read in one partial load. A partial load
    keeps tree order but closes up lists, so values are matched to keys by that order; a tied
    tensor is read with the key it shares storage with (the loader needs both)."""
    aliases = exports.alias_targets(manifest)
    wanted = set(keys) | {aliases[k] for k in keys if k in aliases}
    ordered = [leaf.key for leaf in inspection.leaves(manifest) if leaf.key in wanted]
    values = [v for _k, v in _flat_items(repo.load(manifest.name, keys=ordered))]
    if len(values) != len(ordered):
        raise FormatError(f"checkpoint {manifest.name!r}: a partial load returned "
                          f"{len(values)} values for {len(ordered)} keys")
    chosen = set(keys)
    return [(k, v) for k, v in zip(ordered, values) if k in chosen]


def _plain_values(manifest: Manifest) -> dict[str, Any]:
    """key -> value of the checkpoint's plain values that JSON carries (bytes are left out)."""
    out: dict[str, Any] = {}
    for leaf in inspection.leaves(manifest):
        if leaf.entry is None:
            typ, value = inspection.value_of(leaf.node)
            if typ not in ("bytes",):
                out[leaf.key] = value
    return out


def _export_zarr(repo: CheckpointStore, manifest: Manifest, out: Path, tensor_keys: list[str],
                 values: dict[str, Any], overwrite: bool) -> None:
    """The arrays `tensor_keys` of the checkpoint's zarr view, copied into a new zarr group at
    OUT, with the plain `values` in its attributes."""
    import zarr

    from .zarr_view import node_name, zarr_store

    view = zarr.open_group(store=zarr_store(repo, manifest.name), mode="r")
    wanted = {node_name(k) for k in tensor_keys}

    class _Chosen:  # the view's arrays, restricted to the chosen tensors
        @staticmethod
        def arrays() -> Iterator[tuple[str, Any]]:
            for name, arr in view.arrays():
                if name in wanted:
                    yield name, arr

    attrs = {"checkpoint": manifest.name, "metadata": manifest.metadata}
    exports.publish_folder(lambda tmp: exports.write_zarr(_Chosen, tmp, values, attrs),
                           out.absolute(), overwrite)


# --------------------------------------------------------------------------- import
def read_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """(flat state, the file's __metadata__). No code runs: safetensors is data only."""
    safetensors = require("safetensors")
    SafetensorError, safe_open = safetensors.SafetensorError, safetensors.safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except SafetensorError as exc:
        raise FormatError(f"{path}: not a valid safetensors file: {_first_line(exc)}") from None
    return state, meta


def read_torch(path: str | os.PathLike[str]) -> Any:
    """`torch.load(path, weights_only=True)` on the CPU (memory-mapped when the file allows).
    torch's weights-only unpickler refuses anything but tensors and plain containers, so no
    code from the file runs."""
    torch = require("torch")

    def load(mmap: bool) -> Any:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            return load(True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return load(False)  # legacy (non-zip) files cannot be memory-mapped
    except Exception as exc:  # torch raises many types for a bad file
        raise FormatError(_not_loadable(path, exc)) from None


def _not_loadable(path: str | os.PathLike[str], exc: BaseException) -> str:
    """Why a torch file was refused, without repeating torch's advice to unpickle it."""
    text = str(exc)
    found = re.search(r"(?i)unsupported (?:global: )?GLOBAL ([\w.]+)", text)
    if found is not None:
        return (f"{path}: a torch file that needs {found.group(1)} to load; ckptstore "
                "imports only tensors, numbers, strings and plain containers, and never "
                "unpickles other objects")
    return f"{path}: not a safetensors, torch or DCP checkpoint"


def read_dcp(path: str | os.PathLike[str], *, trust_pickle: bool) -> Any:
    """Load a whole torch.distributed.checkpoint directory into this process through DCP's own
    FileSystemReader. Unpickles `.metadata` (inside torch), hence `trust_pickle`."""
    if not trust_pickle:
        raise TrustRequiredError(
            f"{path} is a torch.distributed.checkpoint directory: its .metadata is a pickle, so "
            "reading it can run code chosen by whoever wrote it; pass --trust-pickle if you "
            "trust its source")
    dcp = require("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            reader = dcp.filesystem.FileSystemReader(str(path))
            return _load_state_dict_from_keys(storage_reader=reader)
    except Exception as exc:  # DCP wraps everything in CheckpointException and friends
        raise FormatError(f"{path}: cannot read the DCP checkpoint: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line[:300]


def import_checkpoint(repo: CheckpointStore, name: str, source: str | os.PathLike[str], *,
                      fmt: str | None = None, metadata: dict[str, Any] | None = None,
                      trust_pickle: bool = False,
                      compression: Compression = REPO_DEFAULT,
                      lease_wait: float | None = None) -> ImportReport:
    """Save the contents of SOURCE as checkpoint `name` (see the module docstring)."""
    t0 = time.perf_counter()
    fmt = fmt or detect_format(source)
    if fmt not in FORMATS:
        raise ValueError(f"import format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    meta: dict[str, Any] = {}
    if fmt == "safetensors":
        state, file_meta = read_safetensors(source)
        try:
            restored = json.loads(file_meta.get("ckptstore.metadata", "{}"))
        except ValueError:
            restored = None
        if isinstance(restored, dict):
            meta.update(restored)
        other = {k: v for k, v in file_meta.items()
                 if k not in ("format", "ckptstore.checkpoint", "ckptstore.metadata")}
        if other:
            meta["safetensors_metadata"] = other
    elif fmt == "torch":
        state = read_torch(source)
    else:
        state = read_dcp(source, trust_pickle=trust_pickle)
    meta["imported_from"] = {"format": fmt, "path": os.path.basename(os.path.abspath(source))}
    meta.update(metadata or {})
    with leases.save_lease(repo.store, wait=lease_wait):
        info = repo.save(name, state, meta, compression=compression)
    return ImportReport(name=name, source=str(source), format=fmt, tensors=info.tensors,
                        logical_bytes=info.logical_bytes, written_bytes=info.written_bytes,
                        reused_bytes=info.reused_bytes, seconds=time.perf_counter() - t0)
