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
is refused unless `overwrite=True`. `strip_prefix` exports a subtree with keys relative to it
(every format); a safetensors folder is the Hugging Face layout: tied tensors once, and with
`hf_config` the model's config.json beside the shards and every key checked against that
model (`ExportWarning` for what `from_pretrained` would not load).

Import:
* `.safetensors` (recognised by content, not by name): the flat dict; `ckptstore.metadata`
  written by our export is restored as the checkpoint's metadata.
* a Hugging Face folder or its `*.safetensors.index.json`: the shards the index names (in
  its folder, holding exactly the keys it gives them), as one flat checkpoint. Tied keys the
  files leave out are put back, sharing their source's storage as in `model.state_dict()`:
  those our export recorded (`ckptstore.tied`), and those the model of the folder's
  config.json (or `hf_config`) ties, when transformers is installed.
* a torch file: `torch.load(weights_only=True, mmap=True)` — no arbitrary code runs.
* a `torch.distributed.checkpoint` (DCP) directory (it holds a `.metadata` file): DCP's
  `.metadata` is a Python pickle and its non-tensor values are `torch.load`ed without
  `weights_only`, so reading it can run code chosen by whoever wrote the directory. This
  import therefore TRUSTS ITS SOURCE, and refuses unless `trust_pickle=True`. The directory is
  read through torch.distributed.checkpoint's own reader (in this process, no process group);
  ckptstore itself unpickles nothing. DCP turns int dict keys into strings; the integer
  parameter ids of torch optimizer state_dicts are given back (`restore_optimizer_keys`),
  other int keys stay strings.
`prefix` stores an import below a dotted key ('model': {"model": state}).
The import holds a save lease (see `leases`) so a concurrent `ckpt gc` cannot break it.

Why one module: import and export of the foreign formats (torch files, DCP folders,
safetensors, Hugging Face folders) share the key mapping and the trust rule for pickles.
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
from ..errors import (
    CkptStoreError,
    ExportWarning,
    FormatError,
    MissingDependencyError,
    TrustRequiredError,
)
from ..format.manifest import Manifest
from ..format.tree import CONTAINERS, KeyFilter, children, node_kind
from ..maintenance import leases
from ..repository import REPO_DEFAULT, CheckpointStore, Compression
from . import exports, inspection

FORMATS = ("safetensors", "torch", "dcp")
EXPORT_FORMATS = ("safetensors", "torch", "zarr")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # "5GB", as Hugging Face reads it
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
DCP_METADATA = ".metadata"
INDEX_SUFFIX = ".safetensors.index.json"




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
    strip_prefix: str | None = None  # the prefix removed from every exported key
    tied: dict[str, str] = field(default_factory=dict)  # dropped tied key -> the key kept
    warnings: list[str] = field(default_factory=list)  # also raised as ExportWarning
    notes: list[str] = field(default_factory=list)  # hints, not problems


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
    files: int = 1  # safetensors files read (the shards of a Hugging Face folder)
    tied: dict[str, str] = field(default_factory=dict)  # key re-tied -> the key it shares
    restored_int_keys: int = 0  # optimizer states whose int parameter ids were restored
    notes: list[str] = field(default_factory=list)


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


def _hf_weights(folder: Path) -> Path | None:
    """The weights of a Hugging Face-style folder: its one `*.safetensors.index.json`, else its
    one `*.safetensors` file; None if it has neither."""
    indexes = sorted(folder.glob("*" + INDEX_SUFFIX))
    if len(indexes) > 1:
        raise FormatError(f"{folder} holds several indexes ({', '.join(p.name for p in indexes)})"
                          ": import one of them by its path")
    if indexes:
        return indexes[0]
    files = sorted(folder.glob("*.safetensors"))
    if len(files) > 1:
        raise FormatError(f"{folder} holds {len(files)} .safetensors files and no "
                          f"*{INDEX_SUFFIX}: import one file by its path")
    return files[0] if files else None


def detect_format(source: str | os.PathLike[str]) -> str:
    """'dcp' for a directory with a .metadata file; 'safetensors' for a safetensors file, a
    `*.safetensors.index.json` (a sharded Hugging Face checkpoint) or a folder holding one
    (or one .safetensors file); 'torch' for any other file."""
    path = Path(source)
    if path.is_dir():
        if (path / DCP_METADATA).is_file():
            return "dcp"
        if _hf_weights(path) is not None:
            return "safetensors"
        raise FormatError(f"{path} is a directory without {DCP_METADATA}, *{INDEX_SUFFIX} or "
                          ".safetensors file: not a torch.distributed.checkpoint directory or "
                          "a Hugging Face model folder")
    if not path.exists():
        raise FileNotFoundError(f"no such file or directory: {path}")
    if path.name.endswith(INDEX_SUFFIX) or _looks_like_safetensors(path):
        return "safetensors"
    return "torch"


# --------------------------------------------------------------------------- export
def _write_atomic(out: Path, overwrite: bool, write: Any) -> None:
    """Call write(tmp_path), fsync it, move it to `out` (create-only unless overwrite)."""
    out = exports.check_target(out, overwrite)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        try:
            write(str(tmp))
        except (OSError, CkptStoreError):
            raise
        except Exception as exc:  # torch's and safetensors' own errors: name the file
            raise OSError(f"cannot write {out}: {type(exc).__name__}: "
                          f"{_first_line(exc)}") from exc
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


def _subtree(state: Any, prefix: str) -> Any:
    """The node of the nested `state` at dotted `prefix` (a torch export relative to it). A
    dict key may itself hold dots, so each level matches the key that the prefix continues."""
    node, rest = state, prefix
    while True:
        children: list[tuple[str, Any]]
        if isinstance(node, dict):
            children = [(str(k), v) for k, v in node.items()]
        elif isinstance(node, (list, tuple)):
            children = [(str(i), v) for i, v in enumerate(node)]
        else:
            children = []
        for name, child in children:
            if rest == name:
                return child
            if rest.startswith(name + "."):
                node, rest = child, rest[len(name) + 1:]
                break
        else:
            raise FormatError(f"{prefix!r} is not a node of the state tree (part of it lies "
                              "inside one dict key, or inside a list): a torch export keeps "
                              "the nesting, so strip a prefix that ends at a dict key")


def _hf_notes(exported: list[str]) -> list[str]:
    """A hint when a Hugging Face-style folder holds keys that all start with one name (a
    wrapper such as the `model` of {"model": model.state_dict()}) and no model was named."""
    first = {k.split(".", 1)[0] for k in exported}
    if len(exported) > 1 and len(first) == 1 and all("." in k for k in exported):
        p = first.pop()
        return [f"every exported key starts with {p + '.'!r}; from_pretrained expects the "
                f"model's own keys: export with --keys {p} (keys relative to it), and pass "
                "--hf-config to check them against the model"]
    return []


def export_checkpoint(repo: CheckpointStore, name: str, out: str | os.PathLike[str], *,
                      fmt: str | None = None, keys: list[str] | None = None,
                      overwrite: bool = False,
                      max_shard_bytes: int | None = None,
                      strip_prefix: str | None = None,
                      hf_config: str | os.PathLike[str] | None = None,
                      hf_model: str | None = None,
                      keep_tied: bool = False) -> ExportReport:
    """Write checkpoint `name` (or the keys `keys`) to OUT; see the module docstring. OUT is
    checked before anything is read (an existing OUT needs `overwrite`).

    `strip_prefix`: export only the keys below that dotted prefix, named relative to it
    ('model.transformer.wte.weight' -> 'transformer.wte.weight'; a torch export writes that
    node of the tree). `hf_config` (a config.json or its folder; a safetensors folder export
    only): the folder gets that config.json (and generation_config.json beside it), and the
    keys are checked against the transformers model class it names (`hf_model` overrides or
    completes its `architectures`); what would not load is warned about (`ExportWarning`, and
    `report.warnings`). A safetensors folder holds each tied tensor once (as save_pretrained);
    `keep_tied` writes copies instead."""
    fmt = export_format(out, fmt)
    folder_export = fmt == "safetensors" and not single_safetensors_file(out)
    if (hf_config is not None or hf_model is not None) and not folder_export:
        raise ValueError("a Hugging Face config applies to a safetensors export to a folder "
                         "(OUT not ending in .safetensors, with --format safetensors)")
    if hf_model is not None and hf_config is None:
        raise ValueError("--hf-model needs --hf-config (the model's config.json)")
    if keep_tied and not folder_export:
        raise ValueError("--keep-tied applies to a safetensors export to a folder (the other "
                         "formats always write tied tensors as copies)")
    exports.check_apart(exports.check_target(out, overwrite),
                        [root for t in repo.tiers
                         if (root := getattr(t.store, "root", None)) is not None])
    model = exports.load_hf_model(hf_config, hf_model) if hf_config is not None else None
    t0 = time.perf_counter()
    manifest = repo.manifest(name)
    if strip_prefix is not None:
        exports.strip_keys([], strip_prefix)  # the prefix itself is valid
        pool = keys if keys is not None else [leaf.key for leaf in inspection.leaves(manifest)]
        keys = [k for k in pool if exports.under_prefix(k, strip_prefix)]
        if not keys:
            raise FormatError(f"checkpoint {manifest.name!r} has no keys below "
                              f"{strip_prefix!r}")
    report = ExportReport(manifest.name, str(out), fmt, strip_prefix=strip_prefix)
    tensors, skipped = exports.tensor_leaves(manifest, keys)
    rename = exports.strip_keys([k for k, _n in tensors] + skipped, strip_prefix)
    if folder_export and model is None:  # before tied keys are dropped (Llama's lm_head)
        report.notes += _hf_notes([rename[k] for k, _n in tensors])
    if folder_export and not keep_tied:
        drop, warns = exports.choose_tied(
            [[rename[k] for k in g] for g in
             exports.tied_groups(manifest, [k for k, _n in tensors])], model)
        report.tied = drop
        report.warnings += warns
        tensors = [(k, n) for k, n in tensors if rename[k] not in drop]
    report.tensors = len(tensors)
    report.bytes = sum(n for _k, n in tensors)
    meta = {"format": "pt", "ckptstore.checkpoint": manifest.name,
            "ckptstore.metadata": json.dumps(manifest.metadata, sort_keys=True)}
    if report.tied:
        meta[exports.TIED_METADATA] = json.dumps(report.tied, sort_keys=True)
    if folder_export:
        entries = {leaf.key: leaf.entry for leaf in inspection.leaves(manifest)}
        shapes = {rename[k]: tuple(e.shape) for k, _n in tensors
                  if (e := entries.get(k)) is not None}
        if model is not None:
            report.warnings += exports.check_hf_keys(shapes, model)
    for text in report.warnings:
        warnings.warn(text, ExportWarning, stacklevel=2)
    if fmt == "safetensors":
        report.skipped = [rename[k] for k in skipped]
        if single_safetensors_file(out):
            if max_shard_bytes is not None and report.bytes > max_shard_bytes:
                raise ValueError(f"{report.bytes} bytes of tensors do not fit in one file of at "
                                 f"most {max_shard_bytes} bytes: give a folder as OUT to "
                                 "write shards")
            data = exports.as_safetensors_dict(
                (rename[k], v) for k, v in _load_flat(repo, manifest, [k for k, _n in tensors]))
            save_file = require("safetensors.torch").save_file
            _write_atomic(Path(out), overwrite, lambda p: save_file(data, p, metadata=meta))
        else:
            source = {rename[k]: k for k, _n in tensors}

            def load(chunk: list[str]) -> list[tuple[str, Any]]:
                return [(rename[k], v)
                        for k, v in _load_flat(repo, manifest, [source[c] for c in chunk])]

            report.files = exports.write_sharded_safetensors(
                load, [(rename[k], n) for k, n in tensors], Path(out),
                max_shard_bytes or DEFAULT_MAX_SHARD_BYTES, meta,
                publish=lambda build: exports.publish_folder(build, Path(out).absolute(),
                                                             overwrite),
                extra_files=model.files() if model is not None else None)
        report.seconds = time.perf_counter() - t0
        return report
    if fmt == "zarr":
        values = _plain_values(manifest)
        report.skipped = [rename[k] for k in skipped if k not in values]
        _export_zarr(repo, manifest, Path(out), {k: rename[k] for k, _n in tensors},
                     {rename[k]: v for k, v in values.items() if k in skipped}, overwrite)
        report.seconds = time.perf_counter() - t0
        return report
    torch = require("torch")
    if keys is not None:
        split = _lists_split_by(manifest.tree, keys)
        if split:
            raise ValueError(f"keys select only some elements of the list at {split[0]!r}: a "
                             "torch file would renumber them (the value of 'x.2' would be "
                             "'x.0'); select the whole list, or export to safetensors, which "
                             "keeps the keys")
    state = repo.load(manifest.name, keys=keys)
    if strip_prefix is not None:
        state = _subtree(state, strip_prefix)
    report.tensors = 0
    report.bytes = 0
    base: tuple[Any, ...] = () if strip_prefix is None else (strip_prefix,)

    def convert(obj: Any, path: tuple[Any, ...]) -> Any:
        key = ".".join(str(p) for p in path[len(base):])
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
            obj = exports.torch_of_numpy(obj)
        if isinstance(obj, np.generic):
            report.converted.append(key)
            return obj.item()
        if isinstance(obj, torch.Tensor):
            report.tensors += 1
            report.bytes += obj.numel() * obj.element_size()
        return obj

    converted = convert(state, base)
    _write_atomic(Path(out), overwrite, lambda p: torch.save(converted, p))
    report.seconds = time.perf_counter() - t0
    return report


def _lists_split_by(tree: Any, keys: list[str]) -> list[str]:
    """Dotted keys of the lists and tuples of which `keys` select some elements but not all
    (a partial load closes such a list up)."""
    keep = KeyFilter(keys)
    out: list[str] = []

    def walk(node: Any, key: str) -> None:
        kind, value = node_kind(node)
        if kind not in CONTAINERS or (key and not (keep(key) or keep.reaches(key))):
            return
        items = [(f"{key}.{name}" if key else str(name), child)
                 for name, child in children(kind, value)]
        if kind in ("list", "tuple") and key and not keep(key):
            chosen = sum(1 for k, _c in items if keep(k) or keep.reaches(k))
            if 0 < chosen < len(items):
                out.append(key)
        for k, child in items:
            walk(child, k)

    walk(tree, "")
    return out


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


def _export_zarr(repo: CheckpointStore, manifest: Manifest, out: Path,
                 tensor_keys: dict[str, str], values: dict[str, Any], overwrite: bool) -> None:
    """The arrays `tensor_keys` (checkpoint key -> exported key) of the checkpoint's zarr
    view, copied into a new zarr group at OUT under their exported names, with the plain
    `values` in its attributes."""
    import zarr

    from .zarr_view import node_name, zarr_store

    view = zarr.open_group(store=zarr_store(repo, manifest.name), mode="r")
    wanted = {node_name(k): node_name(v) for k, v in tensor_keys.items()}

    class _Chosen:  # the view's arrays, restricted to the chosen tensors, renamed
        @staticmethod
        def arrays() -> Iterator[tuple[str, Any]]:
            for name, arr in view.arrays():
                if name in wanted:
                    yield wanted[name], arr

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


def read_safetensors_index(index: str | os.PathLike[str]) -> tuple[dict[str, Any],
                                                                  dict[str, str], int]:
    """(flat state, metadata, number of shard files) of a sharded Hugging Face checkpoint:
    its `*.safetensors.index.json` and the shards its `weight_map` names, which must lie in
    the index's folder and hold exactly the keys the index gives them."""
    path = Path(index)
    doc = exports._read_json_object(path, "a safetensors index")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise FormatError(f"{path}: not a safetensors index (no weight_map of key -> file)")
    by_file: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        if Path(file).name != file or file in ("", ".", ".."):
            raise FormatError(f"{path}: weight_map names {file!r}, not a file in the index's "
                              "folder")
        by_file.setdefault(file, []).append(key)
    meta: dict[str, str] = {}
    raw_meta = doc.get("metadata")
    if isinstance(raw_meta, dict):
        meta.update({k: v for k, v in raw_meta.items() if isinstance(v, str)})
    state: dict[str, Any] = {}
    for file, keys in by_file.items():
        shard = path.parent / file
        if not shard.is_file():
            raise FileNotFoundError(f"{path}: shard {file} is missing")
        tensors, file_meta = read_safetensors(shard)
        for k, v in file_meta.items():
            meta.setdefault(k, v)
        absent = [k for k in keys if k not in tensors]
        if absent:
            raise FormatError(f"{shard}: the index puts {_list(absent)} in this shard, which "
                              "does not hold them")
        extra = [k for k in tensors if weight_map.get(k) != file]
        if extra:
            raise FormatError(f"{shard} holds {_list(extra)}, which the index does not give "
                              "this shard")
        state.update((k, tensors[k]) for k in keys)
    return {k: state[k] for k in weight_map}, meta, len(by_file)


def _list(keys: list[str], limit: int = 3) -> str:
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def restore_optimizer_keys(state: Any, path: str = "") -> int:
    """DCP stores every dict key as a string, so the parameter ids of a torch optimizer
    state_dict ({"state": {0: ...}, "param_groups": [{"params": [0, ...]}]}) come back as
    "0", ...; `load_state_dict` accepts them and then finds no state for any parameter. In
    place, give every optimizer state_dict found in `state` its int keys back (and its empty
    "state", which DCP does not store), and return how many were changed. Keys that are not
    the ids its param groups list are refused (FormatError), never guessed."""
    count = 0
    if isinstance(state, dict):
        groups = state.get("param_groups")
        if (set(state) <= {"state", "param_groups"} and isinstance(groups, list) and groups
                and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                        for g in groups)):
            ids = [p for g in groups for p in g["params"]]
            where = path or "the checkpoint"
            opt_state = state.get("state", {})
            if ids and all(isinstance(p, int) and not isinstance(p, bool) for p in ids) \
                    and isinstance(opt_state, dict):
                fixed: dict[Any, Any] = {}
                for k, v in opt_state.items():
                    if isinstance(k, str):
                        if not (k.isascii() and k.isdigit()) or int(k) not in ids:
                            raise FormatError(
                                f"{where}: optimizer state for {k!r}, which is not one of the "
                                f"parameter ids {_list([str(i) for i in ids])} its param "
                                "groups list; not importing it as an optimizer state")
                        fixed[int(k)] = v
                    else:
                        fixed[k] = v
                changed = "state" not in state or list(fixed) != list(opt_state)
                if changed:
                    rest = {k: v for k, v in state.items() if k != "state"}
                    state.clear()
                    state["state"] = fixed
                    state.update(rest)
                    count += 1
            return count
        for k, v in state.items():
            count += restore_optimizer_keys(v, f"{path}.{k}" if path else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            count += restore_optimizer_keys(v, f"{path}.{i}" if path else str(i))
    return count


def _nest(state: Any, prefix: str | None) -> Any:
    """`state` under the dotted `prefix` ('model' -> {"model": state})."""
    if prefix is None:
        return state
    parts = prefix.split(".")
    if not all(parts):
        raise ValueError(f"invalid prefix {prefix!r}: name a dotted key such as 'model'")
    for part in reversed(parts):
        state = {part: state}
    return state


def import_checkpoint(repo: CheckpointStore, name: str, source: str | os.PathLike[str], *,
                      fmt: str | None = None, metadata: dict[str, Any] | None = None,
                      trust_pickle: bool = False,
                      compression: Compression = REPO_DEFAULT,
                      lease_wait: float | None = None,
                      prefix: str | None = None,
                      hf_config: str | os.PathLike[str] | None = None,
                      hf_model: str | None = None) -> ImportReport:
    """Save the contents of SOURCE as checkpoint `name` (see the module docstring). `prefix`
    puts everything below that dotted key ('model': {"model": state}). `hf_config` (a
    config.json or its folder; default: the config.json of a Hugging Face folder or index
    being imported, when transformers is installed) names the model whose tied weights that
    the files leave out are tied again (`report.tied`)."""
    t0 = time.perf_counter()
    fmt = fmt or detect_format(source)
    if fmt not in FORMATS:
        raise ValueError(f"import format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if (hf_config is not None or hf_model is not None) and fmt != "safetensors":
        raise ValueError("a Hugging Face config applies to safetensors imports only")
    if hf_model is not None and hf_config is None:
        raise ValueError("--hf-model needs --hf-config (the model's config.json)")
    _nest(None, prefix)  # a bad prefix fails before anything is read
    meta: dict[str, Any] = {}
    notes: list[str] = []
    tied: dict[str, str] = {}
    files = 1
    restored_ints = 0
    if fmt == "safetensors":
        path = Path(source)
        hf_folder: Path | None = None
        if path.is_dir():
            weights = _hf_weights(path)
            if weights is None:
                raise FormatError(f"{path}: no *{INDEX_SUFFIX} or .safetensors file in it")
            hf_folder, path = path, weights
        if path.name.endswith(INDEX_SUFFIX):
            hf_folder = path.parent
            state, file_meta, files = read_safetensors_index(path)
        else:
            state, file_meta = read_safetensors(path)
        try:
            restored = json.loads(file_meta.get("ckptstore.metadata", "{}"))
        except ValueError:
            restored = None
        if isinstance(restored, dict):
            meta.update(restored)
        other = {k: v for k, v in file_meta.items()
                 if k not in ("format", "total_size", "ckptstore.checkpoint",
                              "ckptstore.metadata", exports.TIED_METADATA)}
        if other:
            meta["safetensors_metadata"] = other
        tied = _restore_ties(state, file_meta, hf_config, hf_model, hf_folder, notes)
    elif fmt == "torch":
        state = read_torch(source)
    else:
        state = read_dcp(source, trust_pickle=trust_pickle)
        restored_ints = restore_optimizer_keys(state)
        if restored_ints:
            notes.append(f"gave {restored_ints} optimizer state(s) their integer parameter ids "
                         "back (DCP stores dict keys as strings)")
    meta["imported_from"] = {"format": fmt, "path": os.path.basename(os.path.abspath(source))}
    meta.update(metadata or {})
    with leases.save_lease(repo.store, wait=lease_wait):
        info = repo.save(name, _nest(state, prefix), meta, compression=compression)
    return ImportReport(name=name, source=str(source), format=fmt, tensors=info.tensors,
                        logical_bytes=info.logical_bytes, written_bytes=info.written_bytes,
                        reused_bytes=info.reused_bytes, seconds=time.perf_counter() - t0,
                        files=files, tied=tied, restored_int_keys=restored_ints, notes=notes)


def _restore_ties(state: dict[str, Any], file_meta: dict[str, str],
                  hf_config: str | os.PathLike[str] | None, hf_model: str | None,
                  hf_folder: Path | None, notes: list[str]) -> dict[str, str]:
    """In place, put back the tied keys a safetensors checkpoint leaves out, sharing the
    storage of the key they are tied to: those our export recorded (`ckptstore.tied`), and
    those the Hugging Face model ties (the explicit `hf_config`, or the config.json of the
    folder imported). Returns {key added: key it shares}."""
    tied: dict[str, str] = {}
    recorded: Any = None
    if exports.TIED_METADATA in file_meta:
        try:
            recorded = json.loads(file_meta[exports.TIED_METADATA])
        except ValueError:
            recorded = None
        if not (isinstance(recorded, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in recorded.items())):
            raise FormatError(f"{exports.TIED_METADATA} in the file's metadata is not a JSON "
                              "object of key -> key")
        for dropped, kept in recorded.items():
            if dropped not in state and kept in state:
                tied[dropped] = kept
    config = hf_config
    if config is None and hf_folder is not None and (hf_folder / exports.CONFIG_NAME).is_file():
        config = hf_folder / exports.CONFIG_NAME
    if config is not None:
        try:
            model = exports.load_hf_model(config, hf_model)
        except (FormatError, MissingDependencyError) as exc:
            if hf_config is not None:
                raise
            notes.append(f"tied weights not restored from {config}: {exc}")
        else:
            for target, src in exports.hf_ties_to_restore(state, model).items():
                tied.setdefault(target, src)
    for target, src in tied.items():
        # a view of the same storage, as model.state_dict() gives tied weights (not the same
        # object twice, which load(into=...) does not match key by key)
        value = state[src]
        state[target] = value.detach() if hasattr(value, "detach") else value
    return tied
