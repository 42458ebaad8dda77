"""PyTorch Lightning integration: a CheckpointIO plugin that stores Lightning's checkpoints in
a ckptstore repository instead of pickled `.ckpt` files.

    from ckptstore.lightning import CkptStoreCheckpointIO
    trainer = Trainer(plugins=[CkptStoreCheckpointIO("s3://bucket/run1")], ...)
    trainer.fit(model, ckpt_path="last")        # or any path the plugin saved under

Lightning chooses file paths; the plugin maps a path to a checkpoint name from the whole
path: `checkpoint_name` is a readable tail (the file name, characters outside [A-Za-z0-9._-]
as '_') and 16 hex digits of the SHA-256 of the normalized absolute path
(`lightning_path`), e.g. 'epoch_1-step_20.ckpt-3f9a0c2b7d4e1a65'. The full path is kept in
the checkpoint's metadata ('lightning_path'), checked on every load and listed by
`checkpoints()`. A save under one path never replaces or deletes a checkpoint saved under
another path. Lightning saves some paths repeatedly ('last.ckpt', a top-k file): ckptstore
never overwrites, so a re-save of the same path is committed as a new version (`NAME.v2`,
...) and that path's older versions are deleted only after it is whole; loading a path takes
its newest version.

At every path it saves under, the plugin also writes a pointer file: a few lines of text (no
pickle, no tensors) naming the path and the checkpoint. Lightning decides with filesystem
calls, not through CheckpointIO, whether a checkpoint exists (`ModelCheckpoint`'s version
counter, which names a clashing file 'epoch=0-step=4-v1.ckpt'), which is the last one
(`ckpt_path="last"` lists the checkpoint folder), and `save_last="link"` makes a symlink to
the newest top-k file: the pointers make all three work as with Lightning's own files. A
save under a path the repository already holds, when no pointer file is there and this
plugin neither saved nor loaded that path (a fresh host, a deleted folder), is refused with
CheckpointExistsError before anything is written: Lightning could not see the checkpoint,
so it would have replaced it; `restore_pointers(dirpath)` writes the pointers back.

Checkpoints written before this naming (the file name alone: 'last.ckpt', 'last.ckpt.v2')
still load from the path recorded in their metadata, and only from it; a re-save of that
path supersedes them.

Lightning's checkpoint holds more than tensors: dict subclasses (AttributeDict) are stored as
plain dicts and `pathlib.Path` values as strings; any other object raises TypeError naming
its key (no pickle). `LightningModule.load_from_checkpoint` unpickles the file at the path,
which the plugin never writes: use `load_from_checkpoint(cls, path, repository)` here.

Why one module: one CheckpointIO and the pointer files that make Lightning's own filesystem
checks work; the naming, the pointers and the loads agree on one path rule.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import uuid
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, Literal, TypeVar, cast

from ..deps import missing

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.pytorch.plugins.io import CheckpointIO
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..errors import CheckpointExistsError, CheckpointNotFoundError, FormatError
from ..repository import CheckpointStore

_BAD = re.compile(r"[^A-Za-z0-9._-]")
_PROTOCOL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.DOTALL)
_TAIL_CHARS = 96  # + '-' + 16 hex digits + '.v' + digits stays under the 128 of a name
_HASH_CHARS = 16
#: The first bytes of every pointer file ('#' is no pickle opcode: torch.load stops there).
POINTER_PREFIX = b"# ckptstore pointer"
_POINTER_FORMAT = "ckptstore-lightning-pointer"
_POINTER_MAX_BYTES = 64 << 10
_Kind = Literal["missing", "pointer", "link", "file", "dir"]
M = TypeVar("M", bound="pl.LightningModule | pl.LightningDataModule")


def lightning_path(path: str | os.PathLike[str]) -> str:
    """The normalized absolute form of a Lightning checkpoint path, the one its checkpoint
    name derives from: local paths are made absolute (relative ones against the current
    directory), '.' and '..' folded, and their folder's symlinks resolved (not the file's:
    a symlink to a checkpoint is a path of its own); URLs ('s3://...', 'memory://...') keep
    their protocol with the rest folded. TypeError or ValueError for anything else."""
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike):
        raise TypeError(f"a Lightning checkpoint path must be a str or os.PathLike, got "
                        f"{type(path).__name__}: {path!r}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"a Lightning checkpoint path must be text, got {text!r}")
    if not text or "\0" in text:
        raise ValueError(f"invalid Lightning checkpoint path {text!r}: empty or holds NUL")
    url = _PROTOCOL.fullmatch(text)
    if url is not None and url.group(1).lower() != "file":
        rest = posixpath.normpath(url.group(2))
        if rest in (".", "/", ""):
            raise ValueError(f"invalid Lightning checkpoint path {text!r}: no file name")
        return f"{url.group(1)}://{rest}"
    if url is not None:
        text = url.group(2)
    head, tail = os.path.split(os.path.abspath(text))
    if not tail:
        raise ValueError(f"invalid Lightning checkpoint path {text!r}: no file name")
    return os.path.join(os.path.realpath(head), tail)


def checkpoint_name(path: str | os.PathLike[str]) -> str:
    """The checkpoint name (first version) a Lightning path maps to: the sanitized file name
    (at most 96 characters, 'ckpt' if none is left) and 16 hex digits of the SHA-256 of
    `lightning_path(path)`. Always a valid ckptstore name; distinct paths get distinct names
    (a collision of the digest is caught by the metadata check on load)."""
    key = lightning_path(path)
    return _name_of(key)


def _name_of(key: str) -> str:
    tail = _BAD.sub("_", posixpath.basename(key.replace(os.sep, "/"))).lstrip("._-")
    tail = tail[:_TAIL_CHARS] or "ckpt"
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()
    return f"{tail}-{digest[:_HASH_CHARS]}"


def _legacy_name(key: str) -> str | None:
    """The name the plugin gave a path before names derived from the whole path."""
    base = _BAD.sub("_", posixpath.basename(key.replace(os.sep, "/")))[:120].lstrip("._-")
    return base or None


def _version_of(name: str, base: str) -> int | None:
    """1 for `base`, N for `base.vN`, None for any other name."""
    if name == base:
        return 1
    rest = name[len(base) + 2:] if name.startswith(base + ".v") else ""
    return int(rest) if rest.isdigit() and not rest.startswith("0") else None


def _is_local(key: str) -> bool:
    return _PROTOCOL.fullmatch(key) is None


def _plain(value: Any, path: str) -> Any:
    if isinstance(value, Mapping) and type(value) is not dict and not hasattr(value, "_metadata"):
        value = dict(value)
    if isinstance(value, dict):
        return type(value)((k, _plain(v, f"{path}.{k}")) for k, v in value.items())
    if isinstance(value, list):
        return [_plain(v, f"{path}.{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_plain(v, f"{path}.{i}") for i, v in enumerate(value))
    if isinstance(value, PurePath):
        return str(value)
    return value


def _parse_pointer(raw: bytes, where: str) -> dict[str, Any]:
    """The fields of a pointer file's last line; FormatError if they are not a pointer's."""
    try:
        fields = json.loads(raw.decode("utf-8").strip().splitlines()[-1])
    except (UnicodeDecodeError, ValueError, IndexError):
        fields = None
    if (not isinstance(fields, dict) or fields.get("format") != _POINTER_FORMAT
            or not isinstance(fields.get("path"), str) or not isinstance(fields.get("name"), str)):
        raise FormatError(f"{where} starts like a ckptstore pointer file but is damaged")
    return fields


class CkptStoreCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO writing to one ckptstore repository (any URI), plus a pointer
    file at each path it saves under (see the module's docstring). Only rank 0 saves and
    removes (Lightning's rule); every rank loads, by path, pointer file or not."""

    def __init__(self, uri: str | CheckpointStore, **repo_options: Any) -> None:
        self.repo = uri if isinstance(uri, CheckpointStore) else CheckpointStore(uri,
                                                                                 **repo_options)
        self._seen: set[str] = set()  # paths this plugin saved or loaded

    # ------------------------------------------------------------------ repository side
    def _path_of(self, name: str) -> str | None:
        """The normalized Lightning path recorded in a checkpoint's metadata, or None."""
        manifest = self.repo.find_manifest(name)
        recorded = None if manifest is None else manifest.metadata.get("lightning_path")
        if not isinstance(recorded, str):
            return None
        try:
            return lightning_path(recorded)
        except ValueError:
            return None

    def _versions(self, key: str, names: list[str]) -> list[tuple[tuple[int, int], str]]:
        """((scheme, version), name) of the checkpoints saved under `key`, oldest first:
        those of the old naming (scheme 0) before those of the current one (scheme 1)."""
        found = []
        for scheme, base in ((1, _name_of(key)), (0, _legacy_name(key))):
            if base is None:
                continue
            for name in names:
                version = _version_of(name, base)
                if version is not None and self._path_of(name) == key:
                    found.append(((scheme, version), name))
        return sorted(found)

    def _next_name(self, key: str, names: list[str]) -> str:
        base = _name_of(key)
        taken = [v for v in (_version_of(n, base) for n in names) if v is not None]
        return base if not taken else f"{base}.v{max(taken) + 1}"

    def checkpoints(self) -> dict[str, str]:
        """{normalized Lightning path: name of its newest checkpoint} for every checkpoint in
        the repository that this plugin (or its old naming) saved, sorted by path. Reads
        every manifest."""
        newest: dict[str, tuple[tuple[int, int], str]] = {}
        for info in self.repo.list():
            key = self._path_of(info.name)
            if key is None:
                continue
            for scheme, base in ((1, _name_of(key)), (0, _legacy_name(key))):
                version = None if base is None else _version_of(info.name, base)
                if version is not None:
                    order = ((scheme, version), info.name)
                    newest[key] = max(newest.get(key, order), order)
                    break
        return {key: newest[key][1] for key in sorted(newest)}

    # ------------------------------------------------------------------ filesystem side
    def _entry(self, key: str, *, strict: bool = True) -> tuple[_Kind, dict[str, Any] | None]:
        """What the filesystem holds at `key`, and the pointer read there (through a
        symlink too). A damaged pointer raises FormatError if `strict`, else reads as a
        pointer without fields (a save may replace it)."""
        if _is_local(key):
            kind: _Kind
            if os.path.islink(key):
                kind = "link"
            elif os.path.isdir(key):
                return "dir", None
            elif os.path.isfile(key):
                kind = "file"
            else:
                return "missing", None
            try:
                with open(key, "rb") as f:
                    raw = f.read(_POINTER_MAX_BYTES + 1)
            except OSError:
                return kind, None  # a dangling symlink, or unreadable
        else:
            fs = get_filesystem(key)
            if not fs.exists(key):
                return "missing", None
            if fs.isdir(key):
                return "dir", None
            kind = "file"
            with fs.open(key, "rb") as f:
                raw = f.read(_POINTER_MAX_BYTES + 1)
        if not raw.startswith(POINTER_PREFIX) or len(raw) > _POINTER_MAX_BYTES:
            return kind, None
        kind = "link" if kind == "link" else "pointer"
        try:
            return kind, _parse_pointer(raw, key)
        except FormatError:
            if strict:
                raise
            return kind, None

    def _write_pointer(self, key: str, name: str, meta: dict[str, Any]) -> None:
        fields = {"format": _POINTER_FORMAT, "version": 1, "path": key, "name": name,
                  "repository": self.repo.uri, "step": meta["step"], "epoch": meta["epoch"]}
        text = (POINTER_PREFIX.decode() + ": this Lightning checkpoint is stored in a ckptstore"
                " repository, not in this file.\n# Load it through ckptstore.lightning"
                " (CkptStoreCheckpointIO, load_from_checkpoint), not with torch.load.\n"
                + json.dumps(fields, sort_keys=True) + "\n")
        if _is_local(key):
            folder = os.path.dirname(key)
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f".{os.path.basename(key)[:64]}.{uuid.uuid4().hex}.tmp")
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, key)  # replaces a symlink itself, never its target
            except BaseException:
                if os.path.lexists(tmp):
                    os.remove(tmp)
                raise
        else:
            fs = get_filesystem(key)
            fs.makedirs(posixpath.dirname(key), exist_ok=True)
            fs.pipe_file(key, text.encode())

    def _remove_entry(self, key: str) -> None:
        if _is_local(key):
            os.remove(key)
        else:
            get_filesystem(key).rm(key)

    # ------------------------------------------------------------------ CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Commit `checkpoint` as the newest version of `path`, write the pointer file at
        `path`, then delete that path's older versions. Refused, before anything is
        written: `storage_options` (TypeError); a directory or a file that is not a pointer
        at `path`, or a checkpoint of `path` in the repository that Lightning could not see
        (CheckpointExistsError); a value that cannot be stored (TypeError naming its key)."""
        if storage_options is not None:
            raise TypeError("CkptStoreCheckpointIO.save_checkpoint takes no storage_options, "
                            f"got {storage_options!r}")
        if not isinstance(checkpoint, dict):
            raise TypeError(f"a Lightning checkpoint is a dict, got {type(checkpoint).__name__}")
        key = lightning_path(path)
        kind, _pointer = self._entry(key, strict=False)
        if kind == "dir":
            raise CheckpointExistsError(f"cannot save a Lightning checkpoint at {key}: it is a "
                                        "directory")
        if kind == "file":
            raise CheckpointExistsError(
                f"cannot save a Lightning checkpoint at {key}: a file that is not a ckptstore "
                "pointer is there (a torch checkpoint?) and the plugin never replaces one; "
                "move it away or save elsewhere")
        names = self.repo.names()
        old = self._versions(key, names)
        if kind == "missing" and old and key not in self._seen:
            raise CheckpointExistsError(
                f"{self.repo.uri} already holds checkpoint {old[-1][1]!r} saved under {key}, "
                "but no pointer file is at that path (a fresh host? a deleted folder?), so "
                "Lightning could not see it: ckpt_path='last' and ModelCheckpoint's check for "
                "an existing file look at the filesystem. This save would replace it: nothing "
                "was written. To resume, call <plugin>.restore_pointers("
                f"{os.path.dirname(key)!r}) and fit with ckpt_path='last' (or the path to "
                "resume from); to start over, use another folder, or delete the old "
                "checkpoint with <plugin>.remove_checkpoint(path)")
        name = self._next_name(key, names)
        meta = {"lightning_path": key,
                "step": int(checkpoint.get("global_step", 0) or 0),
                "epoch": int(checkpoint.get("epoch", 0) or 0)}
        self.repo.save(name, _plain(checkpoint, "<checkpoint>"), metadata=meta)
        self._write_pointer(key, name, meta)
        self._seen.add(key)
        for _order, older in old:  # only after the new version and its pointer are written
            self.repo.delete(older)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The newest checkpoint saved under the path the pointer file at `path` names (a
        `save_last="link"` symlink, or a copy of a pointer, leads to its target's), or under
        `path` when no pointer is there. CheckpointNotFoundError saying what was found
        instead if there is none; FormatError for a damaged pointer. `map_location`: a device
        or its name moves the tensors there; anything else leaves them on the CPU.
        `weights_only` is accepted and needless: nothing is unpickled."""
        key = lightning_path(path)
        kind, pointer = self._entry(key)
        target = lightning_path(pointer["path"]) if pointer is not None else key
        names = self.repo.names()
        versions = self._versions(target, names)
        if not versions:
            raise CheckpointNotFoundError(self._not_found(key, target, kind, pointer, names))
        state = self.repo.load(versions[-1][1])
        self._seen.update((key, target))
        import torch

        device = (torch.device(map_location) if isinstance(map_location, str | torch.device)
                  else None)
        if device is not None and device.type != "cpu":
            state = _to_device(state, device)
        result: dict[str, Any] = state
        return result

    def _not_found(self, key: str, target: str, kind: _Kind, pointer: dict[str, Any] | None,
                   names: list[str]) -> str:
        message = f"no checkpoint saved under {target} in {self.repo.uri}"
        if target != key:
            message += f" (the pointer file at {key} names that path)"
        if pointer is not None and pointer.get("repository") != self.repo.uri:
            message += f"; the pointer file says it was saved to {pointer.get('repository')}"
        if kind == "file":
            message += (f"; {key} is a file but not a ckptstore pointer: the plugin reads only "
                        "its repository and never unpickles a file")
        elif kind == "link" and pointer is None:
            message += f"; {key} is a symlink to a missing file or to one that is no pointer"
        legacy = _legacy_name(target)
        same_file = re.compile(re.escape(_name_of(target).rsplit("-", 1)[0])
                               + rf"-[0-9a-f]{{{_HASH_CHARS}}}(\.v[1-9][0-9]*)?")
        others = sorted({p for n in names
                         if (same_file.fullmatch(n) is not None
                             or (legacy is not None and _version_of(n, legacy) is not None))
                         and (p := self._path_of(n)) is not None and p != target
                         and posixpath.basename(p) == posixpath.basename(target)})
        if others:
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more"
                                             if len(others) > 5 else "")
            message += f"; checkpoints with that file name were saved under {shown}"
        return message

    def remove_checkpoint(self, path: Any) -> None:
        """Delete every version saved under `path` and the pointer or symlink there; never a
        checkpoint saved under another path (a symlink's target stays), nor a file that is
        not a pointer."""
        key = lightning_path(path)
        for _order, name in self._versions(key, self.repo.names()):
            self.repo.delete(name)
        kind, _pointer = self._entry(key, strict=False)
        if kind in ("pointer", "link"):
            self._remove_entry(key)

    def restore_pointers(self, dirpath: str | os.PathLike[str]) -> list[str]:
        """Write the missing pointer files of the checkpoints saved under `dirpath` (the folder
        and below), so that Lightning sees them again (on a fresh host, after the folder was
        deleted): `ckpt_path="last"`, the -v1 file names. Never replaces what exists at a
        path. Returns the paths written, sorted. Lightning takes the "last" checkpoint by
        file modification time: the pointers are written in commit order, and a local one
        gets its checkpoint's creation time as its modification time, so the newest commit
        stays the last whatever the file names (`last-v1.ckpt` sorts before `last.ckpt`)."""
        root = lightning_path(dirpath)
        sep = os.sep if _is_local(root) else "/"
        todo = []
        for key, name in self.checkpoints().items():
            if key != root and not key.startswith(root.rstrip(sep) + sep):
                continue
            if self._entry(key, strict=False)[0] != "missing":
                continue
            todo.append((self.repo.manifest(name), key))
        for manifest, key in sorted(todo, key=lambda mk: (mk[0].created, mk[1])):
            self._write_pointer(key, manifest.name, {"step": manifest.metadata.get("step"),
                                                     "epoch": manifest.metadata.get("epoch")})
            if _is_local(key):
                os.utime(key, (manifest.created, manifest.created))
        return sorted(key for _manifest, key in todo)

    def teardown(self) -> None:
        """Wait for the repository's background work (replication to later tiers)."""
        self.repo.wait()


def load_from_checkpoint(cls: type[M], checkpoint_path: str | os.PathLike[str],
                         repository: str | CheckpointStore | CkptStoreCheckpointIO, *,
                         map_location: Any | None = None, strict: bool | None = None,
                         **kwargs: Any) -> M:
    """`cls.load_from_checkpoint(checkpoint_path, ...)` for a checkpoint the plugin saved:
    loaded from `repository` (a URI, a CheckpointStore or the plugin), then built as
    Lightning builds it (saved hyper-parameters, overridden by `kwargs`; `strict`; the
    module moved to the device of its weights). `hparams_file` is not supported. TypeError
    if `cls` is no LightningModule or LightningDataModule subclass."""
    from lightning.pytorch.core.saving import _load_state
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule | pl.LightningDataModule)):
        raise TypeError(f"load_from_checkpoint needs a LightningModule or LightningDataModule "
                        f"subclass, got {cls!r}")
    io = (repository if isinstance(repository, CkptStoreCheckpointIO)
          else CkptStoreCheckpointIO(repository))
    checkpoint = _pl_migrate_checkpoint(io.load_checkpoint(checkpoint_path,
                                                           map_location=map_location))
    hparams = checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    hparams.update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return cast(M, _load_state(cls, checkpoint, **kwargs))
    model = cast(pl.LightningModule, _load_state(cls, checkpoint, strict=strict, **kwargs))
    import torch

    tensors = [t for t in checkpoint.get("state_dict", {}).values()
               if isinstance(t, torch.Tensor)]
    if tensors:
        model = model.to(tensors[0].device)
    return cast(M, model)


def _to_device(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((k, _to_device(v, device)) for k, v in value.items())
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value
