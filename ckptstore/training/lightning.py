"""PyTorch Lightning integration: a CheckpointIO plugin that stores Lightning's checkpoints in
a ckptstore repository instead of pickled `.ckpt` files.

    from ckptstore.lightning import CkptStoreCheckpointIO
    trainer = Trainer(plugins=[CkptStoreCheckpointIO("s3://bucket/run1")], ...)
    trainer.fit(model, ckpt_path="/any/dir/last.ckpt")   # resumes from the repository

Lightning still chooses file paths; the plugin maps a path to a checkpoint name by its file
name (characters outside [A-Za-z0-9._-] become '_', so 'epoch=1-step=20.ckpt' is
'epoch_1-step_20.ckpt'). Lightning saves some names repeatedly ('last.ckpt'): ckptstore never
overwrites, so a re-save is committed as a new version (`last.ckpt.v2`, ...) and older versions
are deleted only after it is whole; loading a path takes its newest version.

Lightning's checkpoint holds more than tensors: dict subclasses (AttributeDict) are stored as
plain dicts and `pathlib.Path` values as strings; any other object raises TypeError naming
its key (no pickle).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from ..deps import missing

try:
    from lightning.pytorch.plugins.io import CheckpointIO
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..errors import CheckpointNotFoundError, UnsupportedTypeError
from ..repository import CheckpointStore

_BAD = re.compile(r"[^A-Za-z0-9._-]")
_VERSION = re.compile(r"(.+)\.v(\d+)")


def checkpoint_name(path: str | os.PathLike[str]) -> str:
    """The checkpoint name a Lightning path maps to."""
    base = _BAD.sub("_", PurePath(os.fspath(path)).name)[:120].lstrip("._-")
    if not base:
        raise UnsupportedTypeError(f"cannot derive a checkpoint name from {path!r}")
    return base


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


class CkptStoreCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO writing to one ckptstore repository (any URI)."""

    def __init__(self, uri: str | CheckpointStore, **repo_options: Any) -> None:
        self.repo = uri if isinstance(uri, CheckpointStore) else CheckpointStore(uri,
                                                                                 **repo_options)

    def _versions(self, base: str) -> list[tuple[int, str]]:
        found = []
        for name in self.repo.names():
            if name == base:
                found.append((1, name))
            else:
                m = _VERSION.fullmatch(name)
                if m and m.group(1) == base:
                    found.append((int(m.group(2)), name))
        return sorted(found)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        base = checkpoint_name(path)
        old = self._versions(base)
        name = base if not old else f"{base}.v{old[-1][0] + 1}"
        meta = {"lightning_path": os.fspath(path),
                "step": int(checkpoint.get("global_step", 0) or 0),
                "epoch": int(checkpoint.get("epoch", 0) or 0)}
        self.repo.save(name, _plain(checkpoint, "<checkpoint>"), metadata=meta)
        for _v, older in old:  # only after the new version is committed
            self.repo.delete(older)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        versions = self._versions(checkpoint_name(path))
        if not versions:
            raise CheckpointNotFoundError(f"no checkpoint for {os.fspath(path)!r} in "
                                          f"{self.repo.uri}")
        state = self.repo.load(versions[-1][1])
        if map_location is not None and not callable(map_location):
            import torch

            device = torch.device(map_location) if isinstance(map_location, str) else None
            if device is not None and device.type != "cpu":
                state = _to_device(state, device)
        result: dict[str, Any] = state
        return result

    def remove_checkpoint(self, path: Any) -> None:
        for _v, name in self._versions(checkpoint_name(path)):
            self.repo.delete(name)

    def teardown(self) -> None:
        self.repo.wait()


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
