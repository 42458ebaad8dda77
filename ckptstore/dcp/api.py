"""One-call saves and loads through DCP with ckptstore's storage and planners (no pickle).

    ckptstore.dcp.save(state, location, name)          # dcp.save on every rank
    ckptstore.dcp.load(state, location, name=None)     # dcp.load in place; None: the latest
    ckptstore.dcp.async_save(state, location, name)    # dcp.async_save (thread or process)

DCP wraps any rank's error in a CheckpointException (a BaseException listing every rank's
failure); these helpers raise the ckptstore error behind it instead (CheckpointExistsError,
IntegrityError, ...), the same on every rank. Without a process group they run DCP in this
process alone (DCP's `no_dist`), without DCP's warning about it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from ..deps import missing

try:
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import (
        AsyncCheckpointerType,
        AsyncSaveResponse,
    )
    from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..errors import CkptStoreError
from ..pipeline.options import SaveInfo
from .planners import LoadPlanner, SavePlanner
from .reader import StorageReader
from .writer import StorageWriter

T = TypeVar("T")


def _no_dist(no_dist: bool | None) -> bool:
    if no_dist is not None:
        return no_dist
    return not (dist.is_available() and dist.is_initialized())


def _run(fn: Callable[[], T], no_dist: bool, reader: StorageReader | None = None) -> T:
    try:
        with warnings.catch_warnings():
            if no_dist:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return fn()
    except CheckpointException as exc:
        cause = cause_of(exc, reader)
        if cause is None:
            raise
        raise cause from exc


def cause_of(exc: CheckpointException, reader: StorageReader | None = None
             ) -> BaseException | None:
    """The ckptstore error behind a CheckpointException (its lowest failing rank's), if
    that is one; for a load whose metadata could not be read, the reader's error."""
    if reader is not None and reader._error is not None:
        return reader._error
    for rank in sorted(exc.failures):
        failure = exc.failures[rank]
        err = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(err, CkptStoreError):
            return err
        return None
    return None


def save(state: dict[str, Any], location: Any, name: str, *,
         metadata: dict[str, Any] | None = None, planner: Any = None,
         process_group: Any = None, no_dist: bool | None = None,
         **store_options: Any) -> SaveInfo | None:
    """`dcp.save(state)` as checkpoint `name` of the repository at `location` (a folder,
    `s3://...`, a tier list, or an open CheckpointStore), with ckptstore's SavePlanner unless
    `planner` is given. Returns what the save did on the coordinator (rank 0), None on the
    other ranks."""
    nd = _no_dist(no_dist)
    with StorageWriter(location, name, metadata=metadata, **store_options) as writer:
        _run(lambda: dcp_save(state, storage_writer=writer, planner=planner or SavePlanner(),
                              process_group=process_group, no_dist=nd), nd)
        return writer.last_save


def load(state: dict[str, Any], location: Any, name: str | None = None, *,
         planner: Any = None, process_group: Any = None, no_dist: bool | None = None,
         **store_options: Any) -> str:
    """`dcp.load(state)` in place from checkpoint `name` (None: the latest) of the repository
    at `location`, with ckptstore's LoadPlanner unless `planner` is given (DCP resharding:
    any world size, any placements). Returns the name of the checkpoint loaded."""
    nd = _no_dist(no_dist)
    with StorageReader(location, name, **store_options) as reader:
        _run(lambda: dcp_load(state, storage_reader=reader, planner=planner or LoadPlanner(),
                              process_group=process_group, no_dist=nd), nd, reader)
        assert reader.loaded is not None
        return reader.loaded


def async_save(state: dict[str, Any], location: Any, name: str, *,
               async_checkpointer_type: AsyncCheckpointerType | str = "thread",
               metadata: dict[str, Any] | None = None, planner: Any = None,
               process_group: Any = None, no_dist: bool | None = None,
               **store_options: Any) -> Any:
    """`dcp.async_save(state)` as checkpoint `name`: returns DCP's future (or its
    AsyncSaveResponse), done when the checkpoint is committed. `async_checkpointer_type`:
    "thread" or "process" (the writer travels to DCP's background process by its
    arguments, which then opens the repository itself)."""
    kind = AsyncCheckpointerType(async_checkpointer_type)
    nd = _no_dist(no_dist)
    writer = StorageWriter(location, name, metadata=metadata, **store_options)
    with warnings.catch_warnings():
        if nd:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        result = dcp_async_save(state, storage_writer=writer, planner=planner or SavePlanner(),
                                async_checkpointer_type=kind, process_group=process_group,
                                no_dist=nd)
    done: Future[Any] = (result.upload_completion if isinstance(result, AsyncSaveResponse)
                         else result)
    done.add_done_callback(lambda _f: writer.close())
    return result
