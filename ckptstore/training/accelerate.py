"""Hugging Face accelerate integration: what `Accelerator.save_state` / `load_state` keep,
in a ckptstore repository, with no pickle and no file beside it.

    from ckptstore.accelerate import load_state, save_state
    mgr = ckptstore.CheckpointManager("s3://bucket/run1", keep_last=3, async_save=True)
    step = load_state(accelerator, mgr) or 0     # latest checkpoint; None: a fresh start
    ...
    save_state(accelerator, mgr, step)           # collective under torch.distributed

One checkpoint (`step-<N>`) holds the pieces accelerate's own save_state gathers:
- `model`, `model_1`, ...: every prepared model, unwrapped (DDP, torch.compile), so a
  checkpoint saved under DDP restores on one process and back;
- `optimizer`, ...: the torch optimizer inside each AcceleratedOptimizer; `scheduler`, ...:
  the scheduler inside each AcceleratedScheduler; `scaler`: the GradScaler if any;
- `dataloader`, ...: each prepared dataloader's epoch (`iteration`), its StatefulDataLoader
  state when `DataLoaderConfiguration(use_stateful_dataloader=True)`, and a
  SeedableRandomSampler's seed and epoch, one JSON row per rank (rank_rows.py);
- `rng`: python, numpy and torch (CPU, CUDA) RNG states of every rank;
- `custom_0`, ...: the objects of `register_for_checkpointing`; `accelerator`: its `step`.

Not supported (a clear error): FSDP, DeepSpeed, Megatron-LM and XLA distributed types, and
save/load pre-hooks (they write into a folder there is none of).
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

from ..errors import MissingDependencyError

try:
    import torch
    from accelerate.data_loader import SeedableRandomSampler
    from accelerate.utils import DistributedType
except ModuleNotFoundError as _exc:
    if (_exc.name or "").partition(".")[0] == "accelerate":
        raise MissingDependencyError("accelerate is not installed (needed for "
                                     "ckptstore.accelerate): pip install accelerate") from None
    from ..deps import missing

    raise missing(_exc) from None

from ..errors import FormatError, IntegrityError, KeyMismatchError
from ..pipeline.options import SaveInfo
from ..repository import CheckpointStore, SaveHandle
from . import distributed as cdist
from . import rank_rows
from .manager import CheckpointManager
from .rng import RNGState

_UNSUPPORTED = {DistributedType.FSDP, DistributedType.DEEPSPEED,
                DistributedType.MEGATRON_LM, DistributedType.XLA}
#: one gloo group per manager for the per-rank rows (never the manager's own: its async saves
#: run collectives on it in the background)
_GROUPS: weakref.WeakKeyDictionary[CheckpointManager, Any] = weakref.WeakKeyDictionary()
Checkpoints = CheckpointManager | CheckpointStore | str | os.PathLike[str] | None


def _key(kind: str, i: int) -> str:
    return kind if i == 0 else f"{kind}_{i}"


def _check(accelerator: Any, hooks: str) -> None:
    if accelerator.distributed_type in _UNSUPPORTED:
        raise NotImplementedError(
            f"ckptstore.accelerate does not support {accelerator.distributed_type} (only "
            "single-process and DDP-style runs); save FSDP2 states with "
            "torch.distributed.checkpoint.state_dict.get_state_dict through "
            "ckptstore.CheckpointManager (docs/training.md)")
    if getattr(accelerator, hooks):
        raise ValueError("the Accelerator has save/load state pre-hooks: they write into a "
                         "checkpoint folder, and a ckptstore checkpoint has none; remove them "
                         "(or register the objects with register_for_checkpointing)")


class _Manager:
    """The CheckpointManager to use and whether this call owns it (and must close it)."""

    def __init__(self, accelerator: Any, checkpoints: Checkpoints) -> None:
        self.owned = not isinstance(checkpoints, CheckpointManager)
        if isinstance(checkpoints, CheckpointManager):
            self.mgr = checkpoints
        elif isinstance(checkpoints, CheckpointStore):
            self.mgr = CheckpointManager(checkpoints)
        else:
            config = accelerator.project_configuration
            if checkpoints is None:
                if not config.automatic_checkpoint_naming:
                    raise ValueError("pass a CheckpointManager, a CheckpointStore or a URI, or "
                                     "use ProjectConfiguration(automatic_checkpoint_naming="
                                     "True) for <project_dir>/checkpoints")
                checkpoints = os.path.join(accelerator.project_dir, "checkpoints")
            self.mgr = CheckpointManager(os.fspath(checkpoints), keep_last=config.total_limit)
        self.repo_owned = not isinstance(checkpoints, (CheckpointManager, CheckpointStore))
        if self.mgr not in _GROUPS:
            _GROUPS[self.mgr] = rank_rows.make_group()
        self.group = _GROUPS[self.mgr]

    def finish(self) -> None:
        """Wait for and release what this call created (nothing for a caller's manager)."""
        if not self.owned:
            return
        group = _GROUPS.pop(self.mgr, None)
        try:
            if self.repo_owned:
                self.mgr.close()
            else:  # the caller's CheckpointStore stays open
                self.mgr.wait()
                if self.mgr.group is not None:
                    torch.distributed.destroy_process_group(self.mgr.group)
                    self.mgr.group = None
        finally:
            if group is not None:
                torch.distributed.destroy_process_group(group)


def _dataloader_doc(loader: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"iteration": int(getattr(loader, "iteration", 0)),
                           "stateful": bool(getattr(loader, "use_stateful_dataloader", False))}
    if doc["stateful"]:
        doc["state"] = loader.state_dict()
        if doc["state"].get("_iterator_finished") and _in_its_loop(loader):
            # saved at the last batch: the epoch is over, though `iteration` only advances
            # when the loop asks for the next batch; the next epoch is what resumes (after
            # the loop ended, accelerate has advanced it already)
            doc["iteration"] += 1
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if isinstance(sampler, SeedableRandomSampler):
        doc["sampler"] = {"initial_seed": int(sampler.initial_seed), "epoch": int(sampler.epoch)}
    return doc


def _in_its_loop(loader: Any) -> bool:
    """Whether a `for batch in loader` loop is still running: accelerate registers a
    prepared dataloader with its GradientState when the loop begins and removes it when the
    loop ends, right after advancing `iteration` (a loader without one: assumed running)."""
    state = getattr(loader, "gradient_state", None)
    references = getattr(state, "dataloader_references", None)
    return references is None or any(ref is loader for ref in references)


def _load_dataloader(loader: Any, doc: dict[str, Any], key: str) -> None:
    if doc["stateful"]:
        if not getattr(loader, "use_stateful_dataloader", False):
            raise KeyMismatchError(f"{key} was saved as a stateful dataloader; prepare it with "
                                   "DataLoaderConfiguration(use_stateful_dataloader=True) to "
                                   "resume its position")
        loader.load_state_dict(doc["state"])
        loader.dl_state_dict = doc["state"]  # what state_dict() returns until it iterates
    if hasattr(loader, "iteration"):
        loader.iteration = doc["iteration"]
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if "sampler" in doc and isinstance(sampler, SeedableRandomSampler):
        sampler.initial_seed = doc["sampler"]["initial_seed"]
        sampler.epoch = doc["sampler"]["epoch"]


def _layout(accelerator: Any) -> dict[str, int]:
    return {"models": len(accelerator._models), "optimizers": len(accelerator._optimizers),
            "schedulers": len(accelerator._schedulers),
            "dataloaders": len(accelerator._dataloaders),
            "custom": len(accelerator._custom_objects),
            "scaler": int(accelerator.scaler is not None)}


def _state(accelerator: Any) -> dict[str, Any]:
    """The state (without the dataloaders) in CheckpointManager's terms."""
    state: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models):
        state[_key("model", i)] = accelerator.unwrap_model(model, keep_torch_compile=False)
    for i, opt in enumerate(accelerator._optimizers):
        state[_key("optimizer", i)] = getattr(opt, "optimizer", opt)
    for i, sched in enumerate(accelerator._schedulers):
        state[_key("scheduler", i)] = getattr(sched, "scheduler", sched)
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    state["rng"] = RNGState()
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom_{i}"] = obj
    return state


@torch.no_grad()
def save_state(accelerator: Any, checkpoints: Checkpoints = None, step: int | None = None, *,
               metadata: dict[str, Any] | None = None) -> SaveInfo | SaveHandle:
    """Checkpoint the Accelerator's state as step `step` (None: its `save_iteration`, then
    advanced by one as accelerate's save_state advances it). `checkpoints`: a
    CheckpointManager (async, retention, tiers are its options), a CheckpointStore, a URI, or
    None for `<project_dir>/checkpoints` with automatic checkpoint naming. Returns the
    manager's SaveInfo or, for an async manager, its SaveHandle. Collective."""
    _check(accelerator, "_save_model_state_pre_hook")
    target = _Manager(accelerator, checkpoints)
    try:
        automatic = step is None
        if step is None:
            step = int(accelerator.save_iteration)
        state = _state(accelerator)
        docs = {_key("dataloader", i): rank_rows.to_bytes(_dataloader_doc(dl),
                                                          _key("dataloader", i))
                for i, dl in enumerate(accelerator._dataloaders)}
        rows, widths = rank_rows.rows_to_save(docs, target.group)
        state.update(rows)
        state["accelerator"] = {"step": int(accelerator.step)}
        meta = dict(metadata or {})
        meta["accelerate"] = {**_layout(accelerator), "rows": widths}
        result = target.mgr.save(step, state, metadata=meta)
        if automatic:
            accelerator.project_configuration.iteration = step + 1
        return result
    finally:
        target.finish()


@torch.no_grad()
def load_state(accelerator: Any, checkpoints: Checkpoints = None,
               step: int | None = None) -> int | None:
    """Restore the checkpoint of `step` (None: the latest in commit order) into the
    Accelerator's prepared objects in place and return its step; None when there is none.
    The Accelerator must hold what the saving one held (the same number of prepared models,
    optimizers, schedulers, dataloaders and registered objects). Collective."""
    _check(accelerator, "_load_model_state_pre_hook")
    target = _Manager(accelerator, checkpoints)
    mgr = target.mgr
    try:
        chosen = step is None
        if step is None:
            rank, _size = rank_rows.world()
            step = mgr.latest_step() if rank == 0 else None
            if target.group is not None:
                step = cdist.broadcast_json(step, target.group)
        while step is not None:
            try:
                _restore(accelerator, mgr, step)
                break
            except (IntegrityError, FormatError) as exc:
                older = mgr.latest_step(before=step)
                if not chosen or target.group is not None or older is None:
                    raise
                warnings.warn(f"checkpoint step {step} is damaged ({exc}); resuming from step "
                              f"{older}", RuntimeWarning, stacklevel=2)
                step = older
        if step is not None and accelerator.project_configuration.automatic_checkpoint_naming:
            accelerator.project_configuration.iteration = step + 1
        return step
    finally:
        target.finish()


def _restore(accelerator: Any, mgr: CheckpointManager, step: int) -> None:
    meta = mgr.repo.manifest(mgr.name_of(step)).metadata
    saved = meta.get("accelerate")
    if not isinstance(saved, dict):
        raise KeyMismatchError(f"checkpoint step {step} was not saved by "
                               "ckptstore.accelerate.save_state")
    layout = _layout(accelerator)
    differ = {k: (saved.get(k), v) for k, v in layout.items() if saved.get(k) != v}
    if differ:
        raise KeyMismatchError(f"checkpoint step {step} does not match this Accelerator "
                               f"(saved, here): {differ}")
    saved_world = int(meta.get("world_size", 1))
    state = _state(accelerator)
    targets = {}
    for key, width in meta["accelerate"]["rows"].items():
        targets[key] = rank_rows.restore_target(int(width), saved_world)
        state[key] = targets[key][0]
    state["accelerator"] = {"step": 0}
    mgr.restore(state, step=step)
    rank, size = rank_rows.world()
    for i, loader in enumerate(accelerator._dataloaders):
        key = _key("dataloader", i)
        rows = rank_rows.rows_restored(*targets[key])
        row = rows[rank] if len(rows) == size else None
        doc = (rank_rows.from_bytes(row) if row is not None
               else rank_rows.same_everywhere(rows, f"the state of {key}"))
        _load_dataloader(loader, doc, key)
    accelerator.step = int(state["accelerator"]["step"])
