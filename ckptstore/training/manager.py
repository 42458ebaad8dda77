"""CheckpointManager: save every N steps and resume, on one process or many.

    mgr = ckptstore.CheckpointManager("runs/exp1", keep_last=3, keep_every=1000, async_save=True)
    mgr.save(step, {"model": model, "optim": optimizer, "data": loader})
    step = mgr.restore({"model": model, "optim": optimizer, "data": loader})  # None if none

Values may be Stateful (`state_dict()` / `load_state_dict()`: modules, optimizers, schedulers,
GradScaler, the dataloader) or plain nested state (dicts of tensors etc., restored in place).
Checkpoints are named `step-<N>`. The latest is the newest whole one in commit order, not the
one with the largest N: a run that went back to step 50 and saved step 51 resumes from 51,
not from the abandoned step 100 (see Retention for what is kept). Under
torch.distributed (initialized, world size > 1) `save` and `restore` are collective: every
rank calls them with its own state (see ckptstore.training.distributed).

With `async_save=True, staging="overlap"` a save returns before copying the state and copies
it in the background within `max_host_bytes` (CheckpointStore.save_async). The manager then
guards every optimizer of the state (its `step()` waits until the save has copied the
parameters and state tensors it changes) and copies at call time what no guard covers: module
buffers, numpy arrays, tensors under `COPY_AT_CALL_BYTES`, and the tensors of other Stateful
objects and plain entries. Module parameters no guarded optimizer steps (frozen layers) are
left to the version check (docs/training.md, "Overlapped async saves").

Retention runs inside the save, after its commit: checkpoints the policy drops are deleted and
exactly the blobs no remaining checkpoint references are removed (a targeted sweep, not an
age-based gc; the next save cannot start before it ends).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ..deps import missing

try:
    import torch
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..errors import CkptStoreError, FormatError, IntegrityError, KeyMismatchError
from ..format.tree import flatten_arrays
from ..layout import blob_key
from ..maintenance import leases
from ..pipeline.commit import Committer, LocalCommitter
from ..pipeline.overlap import check_staging
from ..pipeline.writer import SaveInfo
from ..repository import CheckpointStore, SaveHandle
from . import distributed as cdist
from .retention import Retention
from .rng import RNGState

STEP_NAME = re.compile(r"step-(\d+)")
#: overlapped saves: tensors smaller than this are copied at call time (cheaper than tracking)
COPY_AT_CALL_BYTES = 1 << 20


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None))


class CheckpointManager:
    """Periodic checkpoints of a training job: retention, sync or async, one rank or many."""

    def __init__(self, uri_or_repo: str | CheckpointStore, *, keep_last: int | None = None,
                 keep_every: int | None = None, async_save: bool = False,
                 staging: str = "copy", max_host_bytes: int | None = None,
                 **repo_options: Any) -> None:
        check_staging(staging, max_host_bytes)
        self.repo = (uri_or_repo if isinstance(uri_or_repo, CheckpointStore)
                     else CheckpointStore(uri_or_repo, **repo_options))
        #: async saves only: "copy" stages the whole state at call time (extra host memory =
        #: the state's size); "overlap" copies it in the background within max_host_bytes
        self.staging = staging
        self.max_host_bytes = max_host_bytes
        self.retention = Retention(keep_last, keep_every)
        self.async_save = async_save
        self.distributed = cdist.is_distributed()
        self.group = cdist.checkpoint_group() if self.distributed else None
        self.rank = torch.distributed.get_rank() if self.distributed else 0
        self._last: SaveHandle | None = None

    # ------------------------------------------------------------------ names
    @staticmethod
    def name_of(step: int) -> str:
        return f"step-{step}"

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints this manager's naming recognises, in commit
        order (oldest first; see CheckpointStore.history)."""
        return [int(m.group(1)) for name in self.repo.history()
                if (m := STEP_NAME.fullmatch(name))]

    def latest_step(self, before: int | None = None) -> int | None:
        """The step of the newest whole checkpoint in commit order (a manifest that cannot be
        read is skipped), or None. With `before`: the newest committed before that step's
        checkpoint."""
        steps = self.steps()
        if before is not None:
            steps = steps[: steps.index(before)] if before in steps else []
        for step in reversed(steps):
            if self.repo.find_manifest(self.name_of(step)) is not None:
                return step
        return None

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any],
             metadata: dict[str, Any] | None = None) -> SaveInfo | SaveHandle:
        """Checkpoint `state` as step `step`. Synchronous: returns SaveInfo once committed.
        With async_save: returns a SaveHandle once the state is staged (the trainer may go on
        changing its tensors). Collective under torch.distributed."""
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        meta = dict(metadata or {})
        meta.update(step=step, world_size=torch.distributed.get_world_size()
                    if self.distributed else 1)
        collective = cdist.CollectiveCommitter(self.group, self._retain) if self.distributed \
            else None
        committer: Committer = collective or _RetainingCommitter(self._retain)
        name = self.name_of(step)
        try:
            plain = {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state.items()}
            if self.async_save and self.staging == "overlap":
                handle = self.repo.save_async(name, plain, meta, committer=committer,
                                              staging="overlap",
                                              max_host_bytes=self.max_host_bytes,
                                              copy_keys=_unguarded_keys(state, plain))
                for v in state.values():
                    if isinstance(v, torch.optim.Optimizer):
                        handle.guard(v)
                self._last = handle
                return handle
            if self.async_save:
                self._last = self.repo.save_async(name, plain, meta, committer=committer,
                                                  staging="copy")
                return self._last
            return self.repo.save(name, plain, meta, committer=committer)
        except Exception as exc:
            if collective is not None and not collective.joined:
                # fail on every rank now instead of leaving them waiting in the collective
                cdist.report_failure(self.group, f"rank {self.rank}: {type(exc).__name__}: {exc}")
            raise

    def _retain(self, info: SaveInfo) -> None:
        saved = STEP_NAME.fullmatch(info.name)
        drop = self.retention.to_delete(self.steps(), int(saved.group(1)) if saved else None)
        if not drop:
            return
        doomed: set[str] = set()
        for step in drop:
            name = self.name_of(step)
            try:
                doomed |= self.repo.manifest(name).blob_digests()
                self.repo.delete(name)
            except FileNotFoundError:
                continue
        # The sweep deletes at once (no grace period), so it must not run while another
        # process saves into this store: skip it then; a later `ckpt gc` collects the blobs.
        # (Runs after this save's own lease is released: see CheckpointStore._write.)
        try:
            with leases.gc_lease(self.repo.store, wait=0):
                still_used = self.repo.referenced_blobs()
                for blob in doomed - still_used:
                    self.repo.store.delete(blob_key(blob))
                self.repo.store.sync()
        except leases.LeaseBusyError:
            pass

    # ------------------------------------------------------------------ restore
    def restore(self, state: Mapping[str, Any], step: int | None = None) -> int | None:
        """Load the latest checkpoint (or `step`) into `state` in place and return its step;
        None if there is none. Collective under torch.distributed: rank 0 picks the step.

        The latest is the newest whole checkpoint in commit order. On one process, if it turns
        out damaged while loading (a missing or corrupt blob), a warning names it and the one
        before it is loaded instead (every tensor of `state` is then overwritten again)."""
        self.wait()
        chosen = step is None
        if step is None:
            step = self.latest_step()
        if self.distributed:
            step = cdist.broadcast_json(step, self.group)
        while step is not None:
            try:
                self._load_into(state, step)
                return step
            except (IntegrityError, FormatError) as exc:
                if not chosen or self.distributed:
                    raise
                older = self.latest_step(before=step)
                if older is None:
                    raise
                warnings.warn(f"checkpoint step {step} is damaged ({exc}); resuming from step "
                              f"{older}", RuntimeWarning, stacklevel=2)
                step = older
        return None

    def _load_into(self, state: Mapping[str, Any], step: int) -> None:
        into: dict[str, Any] = {}
        for k, v in state.items():
            if isinstance(v, torch.nn.Module) or not _is_stateful(v):
                into[k] = v.state_dict() if _is_stateful(v) else v
            elif not isinstance(v, RNGState) and _holds_shards(sd := v.state_dict()):
                into[k] = sd  # sharded state (e.g. a sharded optimizer): read only our rows
            # other Stateful objects get fresh tensors, adopted by their load_state_dict
        loaded = self.repo.load(self.name_of(step), into=into, keys=list(state), strict=False)
        missing = [k for k in state if k not in loaded]
        if missing:
            raise KeyMismatchError(f"checkpoint step {step} has no entries {missing}")
        for k, v in state.items():
            if isinstance(v, torch.nn.Module):
                _finish_module(v, into[k], loaded[k])
            elif _is_stateful(v):
                v.load_state_dict(loaded[k])
            else:
                _assign_in_place(v, loaded[k], k)

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> SaveInfo | None:
        """Wait for the save in flight; raises its error. Returns its SaveInfo if any."""
        last, self._last = self._last, None
        self.repo.wait()
        return last.wait() if last is not None else None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.repo.close()
            if self.group is not None:
                torch.distributed.destroy_process_group(self.group)
                self.group = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RetainingCommitter(LocalCommitter):
    """A single-process save whose commit is followed by the manager's retention."""

    def __init__(self, retain: Callable[[SaveInfo], None]) -> None:
        self._retain = retain

    def committed(self, info: SaveInfo) -> None:
        self._retain(info)


def _unguarded_keys(state: Mapping[str, Any], plain: Mapping[str, Any]) -> set[str]:
    """Dotted keys of the tensors an overlapped save copies at call time: what no optimizer
    guard covers (module buffers, other Stateful objects, plain entries) and every tensor
    under COPY_AT_CALL_BYTES. Module parameters and optimizer states are not among them."""
    keys: set[str] = set()
    for k, v in state.items():
        arrays = flatten_arrays(plain[k], (k,))
        if isinstance(v, torch.nn.Module):
            buffers = {f"{k}.{name}" for name, _b in v.named_buffers()}
            keys |= buffers & set(arrays)
        elif not isinstance(v, torch.optim.Optimizer):
            keys |= set(arrays)
        keys |= {key for key, a in arrays.items()
                 if getattr(a, "nbytes", 0) < COPY_AT_CALL_BYTES}
    return keys


def _holds_shards(state: Any) -> bool:
    from ..pipeline.loading import local_part

    arrays = flatten_arrays(state)
    return any(local_part(v, k)[1] is not None for k, v in arrays.items())


def _finish_module(module: torch.nn.Module, dest: Mapping[str, Any], loaded: Any) -> None:
    """Tensors were filled in place; hand anything else (extra state) to load_state_dict."""
    if set(dest) != set(loaded):
        missing = sorted(set(dest) - set(loaded))
        unexpected = sorted(set(loaded) - set(dest))
        raise KeyMismatchError(f"module state mismatch: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
    if any(not isinstance(v, torch.Tensor) for v in dest.values()):
        module.load_state_dict(loaded)


def _assign_in_place(dest: Any, loaded: Any, path: str) -> None:
    """Copy non-tensor values of a plain state back into the caller's containers (tensors
    were already filled in place)."""
    if isinstance(dest, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            if k in dest and isinstance(dest[k], (dict, list)):
                _assign_in_place(dest[k], v, f"{path}.{k}")
            elif k not in dest or dest[k] is not v:
                dest[k] = v
    elif isinstance(dest, list) and isinstance(loaded, list):
        if len(dest) != len(loaded):
            dest[:] = loaded
            return
        for i, v in enumerate(loaded):
            if isinstance(dest[i], (dict, list)):
                _assign_in_place(dest[i], v, f"{path}.{i}")
            elif dest[i] is not v:
                dest[i] = v
    elif dest is not loaded:
        raise CkptStoreError(f"{path}: cannot restore a {type(dest).__name__} in place; pass "
                             "a dict, a list or a Stateful object")
