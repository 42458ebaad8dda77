"""`StorageReader`: torch.distributed.checkpoint loads from a ckptstore repository.

DCP's call order and what each step does here:

* `reset(checkpoint_id)`: a new load; `checkpoint_id`, if given, names the checkpoint.
* `read_metadata()`: resolves the checkpoint (the name given, else the repository's latest)
  and returns its DCP `Metadata`: the one the save kept in the manifest, rebuilt exactly
  (dcp/metadata.py), or for a checkpoint `CheckpointStore.save` wrote, one derived from its
  state tree by DCP's own flattening rules (every tensor one chunk of its global shape).
* `set_up_storage_reader(metadata, is_coordinator)`: remembers the role.
* `prepare_local_plan(plan)`: records which checkpoint this rank resolved.
* `prepare_global_plan(plans)` (coordinator): every rank must have resolved the same
  checkpoint (a save committed between two ranks' `read_metadata` would make "latest"
  differ): otherwise a clear error instead of a mixed state.
* `read_data(plan, planner)`: every tensor item is a box read in parallel straight into the
  tensor `planner.resolve_tensor` gives (dcp/reads.py), every byte verified against its
  digest, then `commit_tensor`; every non-tensor value is decoded from plain state and
  placed where DCP's default planner would put it (our LoadPlanner's `load_value`; DCP's
  DefaultLoadPlanner when its `load_bytes` is its own), or handed to a planner's own
  `load_bytes` as a plain-value payload. Values another planner serialized itself (stored
  opaquely) go to `planner.load_bytes` as they were stored: if that planner unpickles them,
  it does, not ckptstore; ckptstore's LoadPlanner refuses them.
* `validate_checkpoint_id(id)`: True for a valid checkpoint name.
"""

from __future__ import annotations

import io
import os
import uuid
from dataclasses import replace
from typing import Any

import numpy as np

from ..deps import missing

try:
    from torch.distributed.checkpoint import storage as dcp_storage
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import (
        LoadItemType,
        LoadPlan,
        LoadPlanner,
        ReadItem,
    )
    from torch.futures import Future
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..collector import quiet_collector
from ..errors import CheckpointNotFoundError, CkptStoreError, FormatError, InvalidNameError
from ..format import tree as tree_mod
from ..format.manifest import Manifest, TensorEntry
from ..format.names import validate_name
from ..format.torch_types import TorchMaterializer
from ..pipeline.reader import CheckpointReader, ReadTarget
from ..repository import CheckpointStore
from . import metadata as md_mod
from . import plain
from .commit import node_index
from .location import Location
from .planners import LoadPlanner as CkptLoadPlanner
from .planners import place_value, plain_place
from .reads import TensorReads

PLAN_KEY = "ckptstore"


class StorageReader(dcp_storage.StorageReader):
    """Loads DCP state dicts from ckptstore checkpoints (module docstring). `location` as
    for StorageWriter (a location that is not a repository is RepositoryNotFoundError, never
    created); `name`: the checkpoint (None: the latest whole one, resolved by
    `read_metadata`; `loaded` then tells which)."""

    def __init__(self, location: Any, name: str | None = None, **store_options: Any) -> None:
        super().__init__()
        if not isinstance(location, CheckpointStore):
            store_options.setdefault("create", False)  # reading never makes a repository
        self._location = Location(location, store_options)
        self.name = None if name in (None, "latest") else validate_name(name)
        self.load_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.rank = 0
        self.loaded: str | None = None
        self._manifest: Manifest | None = None
        self._metadata: Metadata | None = None
        self._error: BaseException | None = None
        self._nodes: dict[tuple[str | int, ...], Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        location, options = self._location.spec()
        return {"location": location, "options": options, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["location"], state["name"],  # type: ignore[misc]
                      **state["options"])

    # ------------------------------------------------------------------ DCP's API
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            cid = os.fspath(checkpoint_id)
            self.name = None if cid == "latest" else validate_name(cid)
        self.load_id = str(uuid.uuid4())
        self.loaded = None
        self._manifest = self._metadata = self._error = None
        self._nodes = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._error is not None and kwargs.get("rank") is not None:
            raise self._error  # DCP's retry for per-rank metadata: there is none
        try:
            repo = self._location.repo()
            name = self.name or repo.latest()
            if name is None:
                raise CheckpointNotFoundError(f"no checkpoints in {repo.uri}")
            manifest = repo.manifest(name)
            metadata = md_mod.of_manifest(manifest)
        except CkptStoreError as exc:
            self._error = exc
            raise
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta(checkpoint_id=manifest.name)
        metadata.storage_meta.load_id = self.load_id
        self._manifest, self._metadata, self.loaded = manifest, metadata, manifest.name
        self._nodes = None
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if self._manifest is None:
            raise CkptStoreError("set_up_storage_reader before read_metadata")
        self.is_coordinator = bool(is_coordinator)
        self.rank = int(kwargs.get("rank") or 0)
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return replace(plan, storage_data={PLAN_KEY: self.loaded})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        names = {p.storage_data.get(PLAN_KEY) for p in plans if isinstance(p.storage_data, dict)}
        if len(names) > 1:
            raise CkptStoreError(f"the ranks resolved different checkpoints "
                                 f"{sorted(map(str, names))} (one was committed while they "
                                 "read): name the checkpoint")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with quiet_collector():
            self._read(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            validate_name(os.fspath(checkpoint_id), allow_reserved=True)
        except (InvalidNameError, TypeError):
            return False
        return True

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the repository this reader opened."""
        self._location.close()

    def __enter__(self) -> StorageReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the work
    def _reader(self, repo: CheckpointStore) -> CheckpointReader:
        stores = [t.store for t in repo.tiers]
        return CheckpointReader(stores[0], repo.load_options, fallbacks=stores[1:])

    def _node(self, fqn: str) -> Any:
        manifest, metadata = self._manifest, self._metadata
        assert manifest is not None and metadata is not None
        if self._nodes is None:
            self._nodes = node_index(manifest.tree)
        mappings = metadata.planner_data
        path = mappings.get(fqn) if isinstance(mappings, dict) else None
        node = None
        if isinstance(path, (tuple, list)) and path:
            node = self._nodes.get(tuple(path))
        if node is None:
            node = self._nodes.get((fqn,))
        if node is None:
            raise FormatError(f"checkpoint {manifest.name!r} has no value at the DCP key "
                              f"{fqn!r}")
        return node

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        manifest = self._manifest
        assert manifest is not None and self._metadata is not None
        reader = self._reader(self._location.repo())
        reads = TensorReads(reader)
        tensors: list[tuple[ReadItem, Any]] = []
        values: list[ReadItem] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                values.append(item)
                continue
            fqn = item.storage_index.fqn
            kind, index = tree_mod.node_kind(self._node(fqn))
            if kind != "tensor":
                raise FormatError(f"checkpoint {manifest.name!r}: {fqn!r} is not a tensor")
            entry = manifest.tensors[index]
            base = item.storage_index.offset
            offsets = tuple(int(n) for n in base) if base is not None else (0,) * len(
                entry.shape)
            start = tuple(o + int(s) for o, s in zip(offsets, item.storage_offsets))
            lengths = tuple(int(n) for n in item.lengths)
            dest = planner.resolve_tensor(item)
            reads.add(entry, start, lengths, dest)
            tensors.append((item, dest))
        reads.run()
        for item, dest in tensors:
            planner.commit_tensor(item, dest)
        if values:
            self._read_values(values, planner, reader)

    def _read_values(self, items: list[ReadItem], planner: LoadPlanner,
                     reader: CheckpointReader) -> None:
        manifest, metadata = self._manifest, self._metadata
        assert manifest is not None and metadata is not None
        kinds = md_mod.value_kinds(metadata)
        nodes = [(item, self._node(item.storage_index.fqn)) for item in items]
        objects = _load_leaves(manifest, sorted({i for _item, node in nodes
                                                 for i in plain.leaf_indexes(node)}), reader)
        place = plain_place(planner)
        for item, node in nodes:
            fqn = item.storage_index.fqn
            if kinds.get(fqn, md_mod.PLAIN) == md_mod.OPAQUE:
                kind, index = tree_mod.node_kind(node)
                if kind != "bytes":
                    raise FormatError(f"checkpoint {manifest.name!r}: the serialized value "
                                      f"{fqn!r} is not stored as bytes")
                planner.load_bytes(item, io.BytesIO(objects[index]))
                continue
            value = tree_mod.decode(node, objects.__getitem__)
            if isinstance(planner, CkptLoadPlanner):
                planner.load_value(item, value)
            elif place:
                place_value(planner, item, value)  # type: ignore[arg-type]
            else:
                planner.load_bytes(item, io.BytesIO(plain.payload(value, fqn)))


def _load_leaves(manifest: Manifest, indexes: list[int], reader: CheckpointReader
                 ) -> dict[int, Any]:
    """{tensor index: loaded object} of the arrays and bytes inside non-tensor values."""
    objects: dict[int, Any] = {}
    targets: list[ReadTarget] = []
    finishers = []
    mat: TorchMaterializer | None = None
    for i in indexes:
        entry: TensorEntry = manifest.tensors[i]
        if entry.kind == "torch":
            mat = mat or TorchMaterializer()
            value, buf, fin = mat.new(entry)
            if fin is not None:
                finishers.append(fin)
        else:
            value = np.empty(entry.shape, dtype=entry.dtype.numpy_dtype)
            buf = value.reshape(-1).view(np.uint8)
        objects[i] = value
        if buf.nbytes:
            targets.append(ReadTarget(entry, buf))
    if targets:
        reader.read_tensors(targets)
    for fin in finishers:
        fin()
    for i in indexes:
        if manifest.tensors[i].kind == "bytes":
            objects[i] = objects[i].tobytes()
    return objects
