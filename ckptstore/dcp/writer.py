"""`StorageWriter`: torch.distributed.checkpoint saves into a ckptstore repository.

DCP's call order and what each step does here:

* `reset(checkpoint_id)`: a new save; `checkpoint_id`, if given, is the checkpoint's name.
* `set_up_storage_writer(is_coordinator, rank=, use_collectives=)`: remembers the role.
  `use_collectives=False` on several ranks is refused (every rank would commit alone).
* `prepare_local_plan(plan)`: unchanged.
* `prepare_global_plan(plans)` (coordinator): takes the save lease (gc stays away from then
  until the commit), refuses a name that exists (CheckpointExistsError: names are
  create-only, so DCP's `overwrite` has no equivalent here), and fixes every tensor's chunk
  grid (dcp/layout.py), handed to each rank in its plan's `storage_data`.
* `write_data(plan, planner)` (every rank): writes the chunks of its own items from the
  tensors' memory (the ckptstore writer: hashing, deduplication against the repository's
  latest checkpoint, packing of small arrays, compression), makes them durable
  (`store.sync()`), and returns one WriteResult per item carrying its chunk references.
* `finish(metadata, results)` (coordinator): builds one manifest of the global tensors
  (dcp/commit.py), keeps DCP's Metadata in it as JSON (dcp/metadata.py) and commits it
  create-only through the repository's save, which checks names and commit order, writes a
  tiered repository's pending record and queues its replication.
* `storage_meta()`: the checkpoint name and this save's id.
* `validate_checkpoint_id(id)`: True for a valid checkpoint name.

A killed save leaves only unreferenced blobs: the manifest is created last, create-only.
"""

from __future__ import annotations

import io
import os
import time
import uuid
import weakref
from dataclasses import replace
from typing import Any

from ..deps import missing

try:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import storage as dcp_storage
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        SavePlanner,
        WriteItem,
        WriteItemType,
    )
    from torch.futures import Future
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..collector import quiet_collector
from ..errors import (
    CheckpointExistsError,
    CkptStoreError,
    InvalidNameError,
    UnsupportedTypeError,
)
from ..format.canonical import canonical_json
from ..format.names import validate_name
from ..maintenance import leases
from ..pipeline.options import SaveInfo
from ..pipeline.writer import CheckpointWriter, KnownChunks
from . import commit as commit_mod
from . import metadata as md_mod
from . import plain
from .layout import Layout, plan_layouts
from .location import Location, tier0
from .parts import Parts
from .planners import plain_lookup
from .results import OPAQUE, PLAIN, TENSOR, sum_stats

#: the key of the chunk grids in a plan's storage_data
PLAN_KEY = "ckptstore"


def checked_metadata(metadata: Any) -> dict[str, Any]:
    """A user's checkpoint metadata: a dict of JSON values without the reserved "dcp" key."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise UnsupportedTypeError("metadata must be a dict of JSON values")
    if "dcp" in metadata:
        raise UnsupportedTypeError('metadata key "dcp" is reserved (it holds DCP\'s Metadata)')
    try:
        canonical_json(metadata)
    except (TypeError, ValueError) as exc:
        raise UnsupportedTypeError(f"metadata must be JSON-serializable: {exc}") from None
    return dict(metadata)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class StorageWriter(dcp_storage.StorageWriter):
    """Saves DCP checkpoints as ckptstore checkpoints (module docstring).

    `location`: anything `CheckpointStore` accepts (a folder, `s3://bucket/prefix`, a list
    of tiers nearest first) with its `store_options`, or an open CheckpointStore (left open:
    its owner closes it). `name`: the checkpoint name (or DCP's `checkpoint_id`).
    `metadata`: JSON values kept in the manifest beside DCP's metadata (`ckpt show`).

    The writer opens its repository on first use and keeps it for later saves; `close()`
    releases it (for tiers: after replications finish). It pickles as its arguments only, so
    `dcp.async_save(..., async_checkpointer_type=PROCESS)` can send it to DCP's background
    process, which opens its own repository. After a save, `last_save` (on the coordinator)
    tells what it did: bytes written and reused summed over all ranks."""

    def __init__(self, location: Any, name: str | None = None, *,
                 metadata: dict[str, Any] | None = None, **store_options: Any) -> None:
        super().__init__()
        self._location = Location(location, store_options)
        self.name = None if name is None else validate_name(name)
        self.user_metadata = checked_metadata(metadata)
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.rank = 0
        self.use_collectives = True
        self.last_save: SaveInfo | None = None
        self._lease: leases.Lease | None = None
        self._release_at_gc: weakref.finalize[Any, Any] | None = None
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        location, options = self._location.spec()
        return {"location": location, "options": options, "name": self.name,
                "metadata": self.user_metadata}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["location"], state["name"],  # type: ignore[misc]
                      metadata=state["metadata"], **state["options"])

    # ------------------------------------------------------------------ DCP's API
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._release_lease()
        if checkpoint_id is not None:
            self.name = validate_name(os.fspath(checkpoint_id))
        self.save_id = str(uuid.uuid4())
        self.last_save = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = bool(is_coordinator)
        self.rank = int(kwargs.get("rank") or 0)
        self.use_collectives = bool(kwargs.get("use_collectives", True))
        if not self.use_collectives and _world_size() > 1:
            raise CkptStoreError("ckptstore.dcp.StorageWriter needs use_collectives=True on "
                                 "several ranks: without them every rank would commit a "
                                 "checkpoint of its own part")
        if self.name is None:
            raise InvalidNameError("no checkpoint name: pass StorageWriter(location, name) or "
                                   "dcp.save(..., checkpoint_id=name)")
        self._t0 = time.perf_counter()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        usable = [getattr(p, "usable", True) for p in plans]
        if any(usable) and not all(usable):
            raise CkptStoreError("DCP plan caching changed the plans of some ranks only; "
                                 "ckptstore.dcp.StorageWriter needs every plan (save without "
                                 "enable_plan_caching, or with unchanged plans)")
        assert self.name is not None
        repo = tier0(self._location.repo())
        self._release_lease()
        lease = leases.acquire_save(repo.store)
        self._lease = lease
        self._release_at_gc = weakref.finalize(self, lease.release)
        try:
            if repo.exists(self.name):
                raise CheckpointExistsError(
                    f"checkpoint {self.name!r} already exists in {repo.uri}; it was not "
                    "touched (checkpoint names are create-only: DCP's overwrite has no "
                    "equivalent here)")
            if not any(usable):  # cached plans, unchanged: their grids still hold
                return plans
            layouts = plan_layouts(plans, repo.save_options)
            out = []
            for p in plans:
                mine = sorted({item.index.fqn for item in p.items
                               if item.tensor_data is not None})
                out.append(replace(p, storage_data={
                    PLAN_KEY: {fqn: layouts[fqn].to_wire() for fqn in mine}}))
            return out
        except BaseException:
            self._release_lease()
            raise

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[
            list[dcp_storage.WriteResult]]:
        try:
            with quiet_collector():
                results = self._write(plan, planner)
        except BaseException:
            if self.is_coordinator:
                self._release_lease()
            raise
        fut: Future[list[dcp_storage.WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[dcp_storage.WriteResult]]) -> None:
        try:
            with quiet_collector():
                self._finish(metadata, results)
        finally:
            self._release_lease()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.name, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            validate_name(os.fspath(checkpoint_id))
        except (InvalidNameError, TypeError):
            return False
        return True

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the repository this writer opened (and any lease a failed save left)."""
        self._release_lease()
        self._location.close()

    def __enter__(self) -> StorageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release_lease(self) -> None:
        lease, self._lease = self._lease, None
        if self._release_at_gc is not None:
            self._release_at_gc.detach()
            self._release_at_gc = None
        if lease is not None:
            lease.release()

    # ------------------------------------------------------------------ the work
    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[dcp_storage.WriteResult]:
        repo = tier0(self._location.repo())
        options = repo.save_options
        known = KnownChunks()
        parent = repo.latest()
        if parent is not None:
            known.add_manifest(repo.manifest(parent))
        writer = CheckpointWriter(repo.store, options, known)
        sd = plan.storage_data if isinstance(plan.storage_data, dict) else {}
        layouts = sd.get(PLAN_KEY)
        if not isinstance(layouts, dict):
            layouts = {}
        codec = None if options.compression is None else options.compression.to_json()
        batch = Parts(writer)
        docs: list[dict[str, Any]] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                docs.append(batch.add_value(item, *self._value_of(item, planner)))
                continue
            fqn = item.index.fqn
            wire = layouts.get(fqn)
            if wire is None:
                raise CkptStoreError(f"{fqn}: the save plan carries no chunk grid for it (was "
                                     "the global plan made by ckptstore's StorageWriter?)")
            layout = Layout.from_wire(wire)
            doc = {"kind": TENSOR, "layout": wire,
                   "codec": None if layout.packed or layout.small else codec, "chunks": []}
            batch.add_tensor(item, planner, layout, doc)
            docs.append(doc)
        batch.flush()
        repo.store.sync()  # this rank's chunks are durable before its results go out
        s = writer.stats
        results = []
        for item, doc in zip(plan.items, docs):
            batch.finish_doc(doc)
            results.append(dcp_storage.WriteResult(index=item.index,
                                                   size_in_bytes=doc.pop("_nbytes", 0),
                                                   storage_data=doc))
        if results:
            results[0].storage_data["stats"] = {
                "written": s.written, "reused": s.reused, "chunks_written": s.chunks_written,
                "chunks_reused": s.chunks_reused}
        return results

    def _value_of(self, item: WriteItem, planner: SavePlanner) -> tuple[str, Any]:
        """("plain", the value) or ("opaque", the bytes a planner serialized it to)."""
        if plain_lookup(planner):
            return PLAIN, planner.lookup_object(item.index)  # type: ignore[attr-defined]
        data = planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            raise UnsupportedTypeError(f"{item.index.fqn}: the planner resolved a bytes item "
                                       "to a tensor")
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data.read())
        if plain.is_payload(raw):
            return PLAIN, plain.from_payload(raw, item.index.fqn)
        return OPAQUE, raw

    def _finish(self, metadata: Metadata, results: list[list[dcp_storage.WriteResult]]
                ) -> None:
        assert self.name is not None
        tree, entries, values = commit_mod.build(metadata, results)
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = md_mod.storage_data(values)
        metadata.storage_meta = self.storage_meta()
        meta = {**self.user_metadata, "dcp": md_mod.to_json(metadata)}
        committer = commit_mod.DcpCommitter(tree, entries, self._lease,
                                            commit_mod.shared_probes(results))
        repo = self._location.repo()
        info = repo.save(self.name, {}, meta, committer=committer)
        stats = sum_stats(results)
        self.last_save = replace(
            info, tensors=len(entries), written_bytes=stats["written"],
            reused_bytes=stats["reused"], chunks_written=stats["chunks_written"],
            chunks_reused=stats["chunks_reused"], seconds=time.perf_counter() - self._t0,
            blocked_seconds=time.perf_counter() - self._t0)
