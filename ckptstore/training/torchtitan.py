"""torchtitan integration: a `BaseCheckpointManager` that keeps the trainer's checkpoints in a
ckptstore repository (any URI, or tiers) through `ckptstore.CheckpointManager`.

    from ckptstore.torchtitan import CkptStoreCheckpointManager
    config.checkpoint = CkptStoreCheckpointManager.Config(enable=True, interval=500,
                                                          keep_latest_k=3, async_mode="async")

The trainer builds it (`config.checkpoint.build(dataloader=..., model_parts=...,
optimizers=..., lr_schedulers=..., states={"train_state": trainer}, sd_adapter=...,
base_folder=dump_folder)`) and calls `load(step)`, `save(step, last_step)`,
`maybe_wait_for_staging()` and `close()`, as it does torchtitan's own DCP manager.

What one checkpoint (`step-<N>`) holds:
- `model`: the flattened state dict of every model part (torchtitan's ModelWrapper), DTensors
  of FSDP2 / TP as global tensors (restorable on another mesh or world size);
- `optimizer`: the OptimizersContainer's flat, FQN-keyed state dict; `lr_scheduler`: the
  LRSchedulersContainer's state;
- `dataloader`: each rank's `StatefulDataLoader` state (not the pickle torchtitan's
  ParallelAwareDataloader wraps it in) as a JSON row of a per-rank tensor (rank_rows.py);
- every other entry of `states` (the trainer's `train_state`): per-rank JSON rows when its
  state holds no tensor, else its state dict as is (tensors global, other values rank 0's);
- with `save_rng`: the python, numpy and torch RNG states of every rank (ckptstore.RNGState).

Why one module: one class implementing torchtitan's checkpointer contract (save, load,
staging, close) and its Config; its steps share the state layout it defines.
"""

from __future__ import annotations

import logging
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from ..deps import missing
from ..errors import MissingDependencyError

try:
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchtitan.components.checkpointer.base import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem
except ModuleNotFoundError as _exc:
    if (_exc.name or "").partition(".")[0] in ("torchtitan", "torchdata"):
        raise MissingDependencyError(f"{_exc.name} is not installed (needed for "
                                     "ckptstore.torchtitan): pip install torchtitan") from None
    raise missing(_exc) from None

from ..errors import CheckpointNotFoundError, FormatError, IntegrityError, KeyMismatchError
from ..pipeline.options import SaveInfo
from ..repository import SaveHandle
from . import distributed as cdist
from . import rank_rows
from .manager import CheckpointManager
from .rng import RNGState

log = logging.getLogger(__name__)
#: the checkpoint key of the RNG states (`save_rng`)
RNG = "ckptstore_rng"
_BUILTIN = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER)


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _tensor_keys(top: str, state: dict[str, Any]) -> set[str]:
    """Dotted keys of the tensors of a flat state dict, as the checkpoint names them."""
    return {f"{top}.{k}" for k, v in state.items() if isinstance(v, torch.Tensor)}


class CkptStoreCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]
    """torchtitan checkpointer backed by ckptstore (module docstring). Checkpoints are named
    `step-<N>`; the latest is the newest whole one in commit order (a run that went back to an
    earlier step resumes from what it saved since)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint options plus ckptstore's. `folder` (under the dump folder)
        is the repository unless `tiers` lists its URIs; `keep_latest_k` is ckptstore's
        `keep_last` (0 keeps all). Not supported, refused here: `initial_load_in_hf`,
        `last_save_in_hf` and async_mode "async_with_pinned_mem"."""

        last_save_model_only: bool = False
        """Whether the final checkpoint (`save(..., last_step=True)`) holds only the model,
        cast to `export_dtype`. Such a checkpoint is an artifact: resuming skips it."""

        async_mode: Literal["disabled", "async"] = "disabled"
        """"async": `save` returns once the state is copied to host memory; the write goes
        on beside training (errors are raised by the next save or `close`)."""

        tiers: list[str] = field(default_factory=list)
        """Repository URIs, nearest first (local folders, `s3://bucket/prefix`); empty: the
        one folder `folder` under the dump folder."""

        tier_every: list[int] = field(default_factory=list)
        """Per tier: every k-th save is copied to it in the background (first entry 1)."""

        tier_keep_latest_k: list[int] = field(default_factory=list)
        """Per tier retention, overriding `keep_latest_k` (0 keeps all)."""

        keep_every: int = 0
        """Also keep every checkpoint whose step is divisible by this (0: off)."""

        save_rng: bool = False
        """Also save and restore every rank's python, numpy and torch RNG states."""

        endpoint_url: str | None = None
        """S3 endpoint for `s3://` URIs (MinIO, SeaweedFS); None: AWS."""

        compression: str | None = None
        """Blob compression: None, "zstd", "lz4", "blosc" ("zstd:3" for a level)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.async_mode not in ("disabled", "async"):
                raise ValueError(f"checkpoint.async_mode must be 'disabled' or 'async' with "
                                 f"ckptstore, got {self.async_mode!r} (an async save already "
                                 "stages into a reused host arena)")
            if self.initial_load_in_hf or self.last_save_in_hf:
                raise ValueError("ckptstore.torchtitan does not read or write Hugging Face "
                                 "safetensors checkpoints (initial_load_in_hf, last_save_in_hf); "
                                 "use `ckpt export URI step-N OUT --format safetensors`")
            if self.export_dtype not in TORCH_DTYPE_MAP:
                raise ValueError(f"checkpoint.export_dtype must be one of "
                                 f"{sorted(TORCH_DTYPE_MAP)}, got {self.export_dtype!r}")
            if any(not isinstance(u, str) or not u.strip() for u in self.tiers):
                raise ValueError(f"checkpoint.tiers must be non-empty URIs, got {self.tiers!r}")
            for name in ("tier_every", "tier_keep_latest_k"):
                values = getattr(self, name)
                if values and len(values) != len(self.tiers):
                    raise ValueError(f"checkpoint.{name} needs one value per tier "
                                     f"({len(self.tiers)}), got {values!r}")
                if any(type(v) is not int or v < 0 for v in values):
                    raise ValueError(f"checkpoint.{name} must hold non-negative ints, "
                                     f"got {values!r}")
            if type(self.keep_every) is not int or self.keep_every < 0:
                raise ValueError(f"checkpoint.keep_every must be an int >= 0, "
                                 f"got {self.keep_every!r}")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future: Future[SaveInfo | None] | None = None
        if not self.enable:
            return
        self.config = config
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            LR_SCHEDULER: lr_schedulers})
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        for key, value in self.states.items():
            if key not in (MODEL,) and not (callable(getattr(value, "state_dict", None))
                                            and callable(getattr(value, "load_state_dict", None))):
                raise TypeError(f"checkpoint state {key!r} ({type(value).__name__}) has no "
                                "state_dict()/load_state_dict()")
        if RNG in self.states:
            raise ValueError(f"{RNG!r} is the name ckptstore keeps the RNG states under")
        for key in config.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"checkpoint.exclude_from_loading: {key!r} is not a state "
                                 f"(states: {sorted(self.states)})")
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter
        self.uris = list(config.tiers) or [filesystem.join(base_folder, config.folder)]
        keep: Any = ([k or None for k in config.tier_keep_latest_k] if config.tier_keep_latest_k
                     else config.keep_latest_k or None)
        options: dict[str, Any] = {}
        if config.endpoint_url is not None:
            options["endpoint_url"] = config.endpoint_url
        if config.compression is not None:
            options["compression"] = config.compression
        self._options = options
        self.manager = CheckpointManager(
            self.uris if len(self.uris) > 1 else self.uris[0], keep_last=keep,
            keep_every=config.keep_every or None,
            every=list(config.tier_every) if config.tier_every else 1,
            async_save=config.async_mode == "async", **options)
        self._group = rank_rows.make_group()
        self._handle: SaveHandle | None = None
        self._closed = False
        log.info("ckptstore checkpoints in %s", ", ".join(self.uris))

    # ------------------------------------------------------------------ save
    def _should_save(self, step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or step % self.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Checkpoint step `curr_step` if the interval (or `last_step`) says so; collective.
        A seed checkpoint (step 0, last_step) and, with `last_save_model_only`, the last one
        hold only the model. Returns whether a checkpoint was saved or handed off."""
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        model_only = last_step and (curr_step == 0 or self.config.last_save_model_only)
        state, meta = self._save_state(model_only, cast=model_only and curr_step != 0)
        result = self.manager.save(curr_step, state, metadata=meta)
        if isinstance(result, SaveHandle):
            self._handle = result
            self.save_future = Future()
            if last_step:
                self._wait_for_saving()
        return True

    def _save_state(self, model_only: bool, cast: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        model = self.states[MODEL].state_dict()
        if cast:
            model = {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor)
                     and v.is_floating_point() and v.dtype != self.export_dtype else v
                     for k, v in model.items()}
        state: dict[str, Any] = {MODEL: model}
        widths: dict[str, int] = {}
        if not model_only:
            state[OPTIMIZER] = self.states[OPTIMIZER].state_dict()
            state[LR_SCHEDULER] = self.states[LR_SCHEDULER].state_dict()
            docs: dict[str, bytes] = {}
            for key, value in self.states.items():
                if key == DATALOADER:
                    docs[key] = rank_rows.to_bytes(self._dataloader_doc(value), key)
                elif key not in _BUILTIN:
                    sd = value.state_dict()
                    if _has_tensor(sd):
                        state[key] = sd
                    else:
                        docs[key] = rank_rows.to_bytes(sd, key)
            rows, widths = rank_rows.rows_to_save(docs, self._group)
            state.update(rows)
            if self.config.save_rng:
                state[RNG] = RNGState()
        meta = {"torchtitan": {"model_only": model_only, "rows": widths}}
        return state, meta

    @staticmethod
    def _dataloader_doc(loader: Any) -> dict[str, Any]:
        if isinstance(loader, ParallelAwareDataloader):
            # the StatefulDataLoader state itself, not the pickle torchtitan wraps it in
            return {"dp_rank": loader.dp_rank, "dp_world_size": loader.dp_world_size,
                    "state": StatefulDataLoader.state_dict(loader)}
        return {"state": loader.state_dict()}

    # ------------------------------------------------------------------ load
    def _checkpoints(self, manager: CheckpointManager) -> list[tuple[int, bool]]:
        """(step, model_only) of the readable checkpoints, newest first in commit order."""
        out = []
        for step in reversed(manager.steps()):
            m = manager.repo.find_manifest(manager.name_of(step))
            if m is not None:
                out.append((step, bool(m.metadata.get("torchtitan", {}).get("model_only"))))
        return out

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Restore `step` (-1: the newest full checkpoint; else, the newest model-only one,
        model only; else `initial_load_path`'s latest) into the states in place; collective.
        Returns whether anything was loaded."""
        if type(step) is not int or step < -1:
            raise ValueError(f"checkpoint load step must be an int >= -1, got {step!r}")
        rank, _size = rank_rows.world()
        choice: Any = None
        if rank == 0:
            found = self._checkpoints(self.manager)
            if step != -1:
                chosen = [c for c in found if c[0] == step]
                if not chosen:
                    choice = {"missing": True}
                else:
                    choice = {"order": chosen}
            else:
                full = [c for c in found if not c[1]]
                choice = {"order": full or found[:1]}
        if self._group is not None:
            choice = cdist.broadcast_json(choice, self._group)
        if choice.get("missing"):
            raise CheckpointNotFoundError(f"checkpoint.load_step={step}: no checkpoint "
                                          f"step-{step} in {', '.join(self.uris)}")
        order = [(int(s), bool(mo)) for s, mo in choice["order"]]
        if not order:
            return self._initial_load()
        for i, (s, model_only) in enumerate(order):
            try:
                self._restore(self.manager, s, model_only)
                return True
            except (IntegrityError, FormatError) as exc:
                if step != -1 or self._group is not None or i + 1 == len(order):
                    raise
                warnings.warn(f"checkpoint step {s} is damaged ({exc}); resuming from step "
                              f"{order[i + 1][0]}", RuntimeWarning, stacklevel=2)
        return False  # pragma: no cover - the loop returns or raises

    def _initial_load(self) -> bool:
        path = self.config.initial_load_path
        if not path:
            log.info("no checkpoint in %s: a fresh start", ", ".join(self.uris))
            return False
        initial = CheckpointManager(path, create=False, **self._options)
        try:
            rank, _size = rank_rows.world()
            choice: Any = None
            if rank == 0:
                found = self._checkpoints(initial)
                choice = found[0] if found else None
            if self._group is not None:
                choice = cdist.broadcast_json(choice, self._group)
            if choice is None:
                raise CheckpointNotFoundError(f"checkpoint.initial_load_path {path}: the "
                                              "repository holds no step-<N> checkpoint")
            s, model_only = int(choice[0]), bool(choice[1])
            self._restore(initial, s, model_only or self.config.initial_load_model_only)
        finally:
            initial.close()
        return True

    def _restore(self, manager: CheckpointManager, step: int, model_only: bool) -> None:
        name = manager.name_of(step)
        manifest = manager.repo.manifest(name)
        meta = manifest.metadata
        saved_world = int(meta.get("world_size", 1))
        widths = {str(k): int(v) for k, v in meta.get("torchtitan", {}).get("rows", {}).items()}
        excluded = set(self.config.exclude_from_loading)
        state: dict[str, Any] = {MODEL: self.states[MODEL].state_dict()}
        rows: dict[str, tuple[Any, rank_rows.AllRows | None]] = {}
        if not model_only:
            if OPTIMIZER not in excluded:
                state[OPTIMIZER] = self.states[OPTIMIZER].state_dict()
            if LR_SCHEDULER not in excluded:
                state[LR_SCHEDULER] = dict(self.states[LR_SCHEDULER].state_dict())
            for key, value in self.states.items():
                if key in excluded or key in (MODEL, OPTIMIZER, LR_SCHEDULER):
                    continue
                if key in widths:
                    rows[key] = rank_rows.restore_target(widths[key], saved_world)
                    state[key] = rows[key][0]
                elif key == DATALOADER:
                    raise KeyMismatchError(f"checkpoint step {step} has no dataloader state "
                                           "(add 'dataloader' to exclude_from_loading)")
                elif key in {k.split(".", 1)[0] for k in (t.key for t in manifest.tensors)}:
                    state[key] = value.state_dict()
                else:
                    raise KeyMismatchError(f"checkpoint step {step} has no state {key!r} (add "
                                           f"it to exclude_from_loading to start it afresh)")
            if self.config.save_rng and RNG not in excluded:
                state[RNG] = RNGState()
        stored = {t.key for t in manifest.tensors}
        for key in (MODEL, OPTIMIZER):
            if key in state:
                lost = sorted(_tensor_keys(key, state[key]) - stored)
                if lost:
                    raise KeyMismatchError(f"checkpoint step {step} lacks {len(lost)} tensors "
                                           f"of the {key}: {lost[:5]}")
        manager.restore(state, step=step)
        self.states[MODEL].load_state_dict(state[MODEL])
        if OPTIMIZER in state:
            self.states[OPTIMIZER].load_state_dict(state[OPTIMIZER])
        if LR_SCHEDULER in state:
            self.states[LR_SCHEDULER].load_state_dict(state[LR_SCHEDULER])
        for key, (target, sink) in rows.items():
            self._load_rows(key, rank_rows.rows_restored(target, sink))
        for key, value in state.items():
            if key not in _BUILTIN and key not in rows and key != RNG:
                self.states[key].load_state_dict(value)
        log.info("restored checkpoint step %d%s", step, " (model only)" if model_only else "")

    def _load_rows(self, key: str, saved: list[bytes | None]) -> None:
        """Hand state `key` its saved row: this rank's on the same world size; otherwise the
        one all ranks saved (train state), or a row of the same data-parallel rank
        (ParallelAwareDataloader)."""
        rank, size = rank_rows.world()
        own = saved[rank] if len(saved) == size else None
        value = self.states[key]
        afresh = f"(add {key!r} to exclude_from_loading to start it afresh)"
        if key != DATALOADER:
            value.load_state_dict(rank_rows.from_bytes(own) if own is not None else
                                  rank_rows.same_everywhere(saved, f"state {key!r}"))
            return
        if isinstance(value, ParallelAwareDataloader):
            if own is not None:
                doc = rank_rows.from_bytes(own)
            else:  # another world size: the row of a rank with our data-parallel rank
                docs = [rank_rows.from_bytes(r) for r in saved if r is not None]
                mine = [d for d in docs if d.get("dp_rank") == value.dp_rank]
                if not mine:
                    raise KeyMismatchError(f"no saved dataloader state for data-parallel rank "
                                           f"{value.dp_rank} {afresh}")
                doc = mine[0]
            if doc.get("dp_world_size") != value.dp_world_size:
                raise KeyMismatchError(
                    f"the dataloader state was saved with data-parallel degree "
                    f"{doc.get('dp_world_size')}, this job has {value.dp_world_size}: "
                    f"dataloader resharding is not supported {afresh}")
            StatefulDataLoader.load_state_dict(value, doc["state"])
            return
        if own is None:
            raise KeyMismatchError(f"the dataloader state was saved on {len(saved)} ranks and "
                                   f"this job has {size} {afresh}")
        value.load_state_dict(rank_rows.from_bytes(own)["state"])

    # ------------------------------------------------------------------ lifecycle
    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: an async save has copied the state when `save` returns."""

    def _wait_for_saving(self) -> None:
        """Wait for the async save in flight to commit on the nearest tier (raises its
        error); replication to later tiers goes on."""
        future, self.save_future = self.save_future, None
        handle, self._handle = self._handle, None
        try:
            info = handle.wait() if handle is not None else None
        except BaseException as exc:
            if future is not None:
                future.set_exception(exc)
            raise
        if future is not None:
            future.set_result(info)

    def _close(self) -> None:
        """Wait for the last save (and replication), then release the repository. Once."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            if self.save_future is not None:
                self._wait_for_saving()
        finally:
            try:
                self.manager.close()
            finally:
                if self._group is not None:
                    torch.distributed.destroy_process_group(self._group)
                    self._group = None
