"""Exports that other ecosystems load without ckptstore: Hugging Face-style sharded safetensors
and a plain zarr v3 hierarchy. Both read one bounded piece of the checkpoint at a time (a
shard's tensors; one tensor's row blocks), so memory stays near `max_shard_bytes` or one chunk.

* Sharded safetensors (`write_sharded_safetensors`): OUT is a folder holding
  `model-00001-of-0000N.safetensors` files of at most `max_shard_bytes` tensor bytes each (a
  tensor larger than that gets a shard of its own, as Hugging Face does) and
  `model.safetensors.index.json` = `{"metadata": {"total_size": N}, "weight_map": {key: file}}`.
  Keys are the checkpoint's dotted keys (relative to a chosen prefix, see `strip_keys`); numpy
  arrays become tensors; plain values are left out and reported. Tensors saved tied (the same
  storage, offset, strides and shape: `tied_groups`) are written once, as `save_pretrained`
  does: the others are dropped and listed in the index metadata `ckptstore.tied` (JSON,
  {dropped: kept}), which `ckpt import` reads to tie them again.
* Hugging Face models (`load_hf_model`): a transformers model class built from a config.json
  on the meta device (no memory, no weights, no network, no custom code), whose state_dict
  keys, shapes and tied keys (`all_tied_weights_keys`) the export is checked against the way
  `from_pretrained` matches them (`check_hf_keys`: one `base_model_prefix` stripped or added,
  the class's `_keys_to_ignore_on_load_*` patterns, tied targets optional).
* zarr (`write_zarr`): OUT is a zarr v3 group; each tensor an array named by its dotted key,
  chunked in the checkpoint's row blocks. bfloat16/float8/complex32 hold raw bits (uint16,
  uint8, uint32) with the real dtype in the array's `attributes["ckptstore"]["dtype"]`; the
  group's attributes hold the checkpoint name, its metadata and the plain values that JSON can
  carry (`attributes["ckptstore"]["values"]`).

Every export is checked before anything is read (`check_target`): an existing OUT is refused
unless `overwrite`, a missing parent folder is an error. Output is built in a temporary
sibling, fsynced, and moved into place; files get the mode the process umask allows (the
safetensors library alone would create them 0600).

Why one module: the export formats share the key selection, the tie rule and the Hugging
Face checks; each format is a short function.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..deps import require
from ..errors import FormatError, MissingDependencyError
from ..format.manifest import Manifest
from . import inspection

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TIED_METADATA = "ckptstore.tied"  # index/shard metadata: JSON {dropped key: kept key}
MAX_JSON_BYTES = 64 << 20  # a config.json or index larger than this is refused, not parsed
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


def check_apart(out: Path, repository_folders: Iterable[Path]) -> None:
    """Refuse an OUT that is, holds or lies inside one of the repository's own folders:
    writing there (with --force, replacing what is at OUT) would delete the checkpoints the
    export reads."""
    for root in repository_folders:
        root = Path(root).absolute()
        if out == root or root in out.parents or out in root.parents:
            raise ValueError(f"{out} is {'inside ' if root in out.parents else ''}the folder "
                             f"of the repository being exported ({root}): write the export "
                             "elsewhere")


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


def _sub_byte_dtypes(torch: Any) -> tuple[Any, ...]:
    """torch dtypes that pack two values in a byte (where this torch has them)."""
    return tuple(dt for name in ("float4_e2m1fn_x2",) if (dt := getattr(torch, name, None)))


def torch_of_numpy(a: np.ndarray) -> Any:
    """A torch tensor of numpy array `a`, its shape kept (a 0-d array stays 0-d, which
    np.ascontiguousarray would make 1-d); copied only when not C-contiguous."""
    torch = require("torch")
    return torch.from_numpy(a if a.flags.c_contiguous else a.copy(order="C"))


def as_safetensors_dict(flat: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Flat key -> tensor for safetensors: numpy becomes torch, tensors are made contiguous,
    a tensor sharing memory with an earlier one is copied (safetensors refuses shared memory),
    complex128/complex32 are refused (safetensors lacks them)."""
    torch = require("torch")
    tensors: dict[str, Any] = {}
    seen: set[int] = set()
    for key, value in flat:
        if isinstance(value, np.ndarray):
            value = torch_of_numpy(value)
        if not isinstance(value, torch.Tensor):
            continue
        if value.dtype in (torch.complex128, torch.complex32):
            raise FormatError(f"{key}: safetensors cannot store {value.dtype}; export to a "
                              "torch file or zarr instead")
        if not value.dim() and value.dtype in _sub_byte_dtypes(torch):
            raise FormatError(f"{key}: safetensors cannot store a 0-d {value.dtype} tensor "
                              "(two values per byte); export to a torch file or zarr instead")
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
                              publish: Callable[[Callable[[Path], object]], None],
                              extra_files: dict[str, bytes] | None = None) -> int:
    """Write the shards and the index (and `extra_files`, name -> content, e.g. config.json)
    through `publish(build)` (build(tmp) fills a fresh folder); `load(keys)` yields (key,
    tensor) for one shard's keys. Returns the number of shard files."""
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
        for name, content in (extra_files or {}).items():
            (tmp / name).write_bytes(content)

    publish(build)
    return len(shards)


# --------------------------------------------------------------------------- keys and ties
def under_prefix(key: str, prefix: str) -> bool:
    """True if dotted `key` lies strictly below `prefix` ('model.w' is below 'model')."""
    return key.startswith(prefix + ".")


def strip_keys(keys: Iterable[str], prefix: str | None) -> dict[str, str]:
    """key -> exported key: `prefix.` removed (every key must lie below `prefix`), or the key
    itself when `prefix` is None."""
    if prefix is None:
        return {k: k for k in keys}
    if not prefix or prefix.startswith(".") or prefix.endswith("."):
        raise ValueError(f"invalid prefix {prefix!r}: name a dotted key such as 'model'")
    out: dict[str, str] = {}
    for k in keys:
        if not under_prefix(k, prefix):
            raise ValueError(f"key {k!r} is not below the prefix {prefix!r}")
        out[k] = k[len(prefix) + 1:]
    return out


def subtree_prefix(patterns: list[str], keys: Iterable[str]) -> str | None:
    """The prefix a `--keys` selection is relative to: the one plain pattern (no glob
    characters) when it names a subtree (keys lie below it, none is equal to it); else None
    (globs, several patterns or one leaf keep the full keys)."""
    if len(patterns) != 1 or any(ch in patterns[0] for ch in "*?["):
        return None
    p = patterns[0]
    found = False
    for k in keys:
        if k == p:
            return None
        found = found or under_prefix(k, p)
    return p if found else None


def tied_groups(manifest: Manifest, keys: Iterable[str]) -> list[list[str]]:
    """Groups (in tree order) of the tensor keys among `keys` that are one tensor: saved as the
    same object, or as views of one storage with the same offset, strides, shape and dtype
    (what `model.state_dict()` gives for tied weights). Overlapping but different views are
    not ties (they are written as copies)."""
    chosen = set(keys)
    groups: dict[tuple[Any, ...], list[str]] = {}
    for leaf in inspection.leaves(manifest):
        e = leaf.entry
        if leaf.key not in chosen or e is None or e.kind == "bytes" or e.nbytes == 0:
            continue
        ident: tuple[Any, ...]
        if e.storage is not None:
            ident = ("storage", e.storage.id, e.storage.offset, tuple(e.storage.stride),
                     tuple(e.shape), e.dtype.name)
        else:
            ident = ("entry", id(e))  # an alias leaf carries its first key's entry
        groups.setdefault(ident, []).append(leaf.key)
    return [g for g in groups.values() if len(g) > 1]


# --------------------------------------------------------------------------- Hugging Face
@dataclass
class HFModel:
    """What a transformers model class expects of a checkpoint (see `load_hf_model`)."""

    config_file: Path
    config: dict[str, Any]  # config.json as written into an export (architectures filled in)
    architecture: str
    shapes: dict[str, tuple[int, ...]]  # state_dict key -> shape, in the model's order
    tied: dict[str, str]  # tied target -> source (the source is the one save_pretrained keeps)
    prefix: str  # base_model_prefix ("" if none)
    ignore_missing: re.Pattern[str] | None = None
    ignore_unexpected: re.Pattern[str] | None = None
    extra_files: dict[str, bytes] = field(default_factory=dict)  # generation_config.json

    def files(self) -> dict[str, bytes]:
        """The files an export writes beside the weights: config.json (+ generation config)."""
        text = json.dumps(self.config, indent=2, sort_keys=True) + "\n"
        return {CONFIG_NAME: text.encode(), **self.extra_files}


def _read_json_object(path: Path, what: str) -> dict[str, Any]:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise FileNotFoundError(f"cannot read {what} {path}: {exc.strerror}") from None
    if size > MAX_JSON_BYTES:
        raise FormatError(f"{path}: {size} bytes is too large for {what}")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: {what} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{path}: {what} must be a JSON object")
    return doc


def hf_config_file(path: str | os.PathLike[str]) -> Path:
    """config.json itself, or the one inside the folder `path`."""
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG_NAME
    if not p.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {p} (give a config.json or the "
                                "folder holding it)")
    return p


@contextlib.contextmanager
def _quiet_transformers(transformers: Any) -> Iterator[None]:
    """transformers' own log lines (config validation, init notes) silenced meanwhile."""
    log = transformers.logging
    level = log.get_verbosity()
    log.set_verbosity_error()
    try:
        yield
    finally:
        log.set_verbosity(level)


def load_hf_model(path: str | os.PathLike[str], model_class: str | None = None) -> HFModel:
    """Build the model of a Hugging Face config.json (a file, or a folder holding it) on the
    meta device and read what it expects: the class is `model_class` (a class name of
    transformers, e.g. 'GPT2LMHeadModel') or else the config's first `architectures` entry.
    Only classes that transformers itself defines are used: no custom (remote) code runs, and
    nothing is downloaded."""
    config_file = hf_config_file(path)
    raw = _read_json_object(config_file, "a Hugging Face config")
    if not isinstance(raw.get("model_type"), str):
        raise FormatError(f"{config_file}: not a Hugging Face model config (no model_type)")
    try:
        transformers = require("transformers")
    except ModuleNotFoundError:
        raise MissingDependencyError("transformers is not installed (needed to check keys "
                                     "against a Hugging Face config): pip install "
                                     "transformers") from None
    torch = require("torch")
    archs = raw.get("architectures")
    name = model_class or (archs[0] if isinstance(archs, list) and archs
                           and isinstance(archs[0], str) else None)
    if name is None:
        raise FormatError(f"{config_file} names no architectures: pass the model class, e.g. "
                          "--hf-model GPT2LMHeadModel")
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise FormatError(f"{name!r} is not a model class of transformers "
                          f"{transformers.__version__} (custom model code is never run)")
    with _quiet_transformers(transformers):
        try:
            config = transformers.AutoConfig.from_pretrained(
                str(config_file), local_files_only=True, trust_remote_code=False)
            with torch.device("meta"):
                model = cls(config)
        except Exception as exc:  # transformers raises many types for a bad config
            text = str(exc).strip().splitlines()
            raise FormatError(f"cannot build {name} from {config_file}: "
                              f"{text[0][:300] if text else type(exc).__name__}") from None
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied_map = getattr(model, "all_tied_weights_keys", None)
    tied = {str(t): str(s) for t, s in tied_map.items()} if isinstance(tied_map, dict) else {}
    buffers = [b for b, _ in model.named_buffers()]
    missing_pats = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    unexpected_pats = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):  # as from_pretrained does
        unexpected_pats.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        unexpected_pats.add(r"(^|\.)position_ids$")

    def regex(pats: set[str]) -> re.Pattern[str] | None:
        return re.compile("|".join(f"({p})" for p in sorted(pats))) if pats else None

    written = dict(raw)
    written["architectures"] = [name] if model_class else archs
    extra: dict[str, bytes] = {}
    gen = config_file.parent / GENERATION_CONFIG_NAME
    if gen.is_file():
        extra[GENERATION_CONFIG_NAME] = gen.read_bytes()
    return HFModel(config_file=config_file, config=written, architecture=name, shapes=shapes,
                   tied=tied, prefix=str(getattr(cls, "base_model_prefix", "") or ""),
                   ignore_missing=regex(missing_pats), ignore_unexpected=regex(unexpected_pats),
                   extra_files=extra)


def hf_key(key: str, model: HFModel) -> str | None:
    """The model key `from_pretrained` loads checkpoint key `key` into (None: none): the key
    with its `base_model_prefix` stripped, with it added, or as it is (that order)."""
    p = model.prefix
    if p and key.startswith(p + ".") and key[len(p) + 1:] in model.shapes:
        return key[len(p) + 1:]
    if p and f"{p}.{key}" in model.shapes:
        return f"{p}.{key}"
    return key if key in model.shapes else None


def choose_tied(groups: list[list[str]], model: HFModel | None) -> tuple[dict[str, str],
                                                                          list[str]]:
    """({dropped key: kept key}, warnings) for groups of exported keys that are one tensor.
    Without a model the first key of each group is kept. With one, the keys the model
    declares tied targets of another key of the group are dropped (save_pretrained keeps the
    source); keys it does not tie are written as copies, with a warning. A group with keys
    that are not the model's is treated as without a model."""
    drop: dict[str, str] = {}
    warns: list[str] = []
    for group in groups:
        mk = {k: hf_key(k, model) for k in group} if model is not None else {}
        if model is None or None in mk.values():  # not the model's keys (warned about apart)
            drop.update(dict.fromkeys(group[1:], group[0]))
            continue
        targets = [k for k in group
                   if model.tied.get(mk[k] or "") in {mk[j] for j in group if j != k}]
        kept = [k for k in group if k not in targets] or group[:1]
        drop.update({k: kept[0] for k in targets if k not in kept})
        if len(kept) > 1:
            warns.append(f"{', '.join(kept)} are one tensor in the checkpoint, but "
                         f"{model.architecture} does not tie them (tie_word_embeddings?): "
                         "they are written as separate copies")
    return drop, warns


def _examples(keys: Iterable[str], limit: int = 3) -> str:
    items = sorted(keys)
    more = f", ... ({len(items)} in all)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_hf_keys(shapes: dict[str, tuple[int, ...]], model: HFModel) -> list[str]:
    """Why `from_pretrained` of the model would not load exported tensors `shapes` (key ->
    shape) as they are: weights it expects but does not find (it would initialise them at
    random), keys it would ignore, shapes that differ. Empty when every weight matches."""
    warns: list[str] = []
    mapped: dict[str, str] = {}
    unexpected: list[str] = []
    for key in shapes:
        mk = hf_key(key, model)
        if mk is not None:
            mapped[key] = mk
        elif model.ignore_unexpected is None or model.ignore_unexpected.search(key) is None:
            unexpected.append(key)
    present = set(mapped.values())
    sources_present = {s for t, s in model.tied.items() if t in present}
    missing = [k for k in model.shapes
               if k not in present
               and not (k in model.tied and model.tied[k] in present)
               and k not in sources_present
               and (model.ignore_missing is None or model.ignore_missing.search(k) is None)]
    arch = model.architecture
    if missing:
        warns.append(f"{len(missing)} of the {len(model.shapes)} weights {arch} expects are not "
                     f"in the export ({_examples(missing)}): from_pretrained would initialise "
                     "them at random")
    if unexpected:
        hint = ""
        first = {k.split(".", 1)[0] for k in unexpected}
        if len(first) == 1:
            p = first.pop()
            if any(hf_key(k[len(p) + 1:], model) for k in unexpected if under_prefix(k, p)):
                hint = (f" (they start with {p + '.'!r}: export with --keys {p} or "
                        f"--strip-prefix {p})")
        warns.append(f"{len(unexpected)} exported key(s) are not weights of {arch} "
                     f"({_examples(unexpected)}): from_pretrained would ignore them{hint}")
    wrong = {k: (s, model.shapes[mapped[k]]) for k, s in shapes.items()
             if k in mapped and tuple(s) != model.shapes[mapped[k]]}
    if wrong:
        k0 = sorted(wrong)[0]
        got, want = wrong[k0]
        warns.append(f"{len(wrong)} weight(s) have other shapes than {arch} expects (e.g. {k0}: "
                     f"{'x'.join(map(str, got)) or 'scalar'} in the checkpoint, "
                     f"{'x'.join(map(str, want)) or 'scalar'} in the model): is "
                     f"{model.config_file} this model's config?")
    return warns


def hf_ties_to_restore(keys: Iterable[str], model: HFModel) -> dict[str, str]:
    """{missing key: key to tie it to} for the keys of an imported Hugging Face checkpoint
    (keys as the files name them): each tied target of the model whose source is present and
    which is itself absent, named in the files' own convention (with or without the
    `base_model_prefix`)."""
    have = set(keys)
    to_file = {}
    for k in have:
        mk = hf_key(k, model)
        if mk is not None:
            to_file[mk] = k
    out: dict[str, str] = {}
    for target, source in model.tied.items():
        if target in to_file or source not in to_file:
            continue
        src_file = to_file[source]
        # name the target as the files name the source (prefix stripped, added or as is)
        if src_file == source:
            name = target
        elif src_file == f"{model.prefix}.{source}":
            name = f"{model.prefix}.{target}"
        else:
            name = target[len(model.prefix) + 1:] if under_prefix(target, model.prefix) \
                else target
        if name not in have:
            out[name] = src_file
    return out


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
