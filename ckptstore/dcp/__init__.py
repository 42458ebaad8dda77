"""ckptstore as a torch.distributed.checkpoint (DCP) storage backend: `dcp.save`, `dcp.load`
and `dcp.async_save` (thread and process executors) into and from a ckptstore repository,
on one process or many ranks, with DCP's own planning and resharding. See docs/dcp.md.

    StorageWriter(location, name, **store_options)    DCP's StorageWriter
    StorageReader(location, name=None)                DCP's StorageReader (None: the latest)
    SavePlanner, LoadPlanner                          DCP's default planners without pickle
    save, load, async_save                            the one-call forms (ckptstore planners)

A DCP checkpoint is an ordinary ckptstore checkpoint: one manifest of the global tensors,
chunked, deduplicated against the repository's latest checkpoint and committed create-only
by the coordinator; DCP's Metadata rides along as JSON. Modules, imports flowing down:

    plain.py      non-tensor values as ckptstore plain state (tree nodes, payloads)
    metadata.py   DCP Metadata <-> JSON; the Metadata of a checkpoint CheckpointStore saved
    layout.py     the chunk grid of every tensor, from DCP's write items
    results.py    what ranks report to the coordinator (chunk references, stats)
    location.py   the repository of a writer or reader, opened lazily; pickling
    commit.py     the manifest of a save (entries, tree) and its committer
    planners.py   SavePlanner, LoadPlanner
    reads.py      boxes read straight into the tensors DCP's planner resolves
    parts.py      the chunks and values one rank writes
    writer.py     StorageWriter
    reader.py     StorageReader
    api.py        save, load, async_save
"""

from __future__ import annotations

from .api import async_save, load, save
from .planners import LoadPlanner, SavePlanner
from .reader import StorageReader
from .writer import StorageWriter

__all__ = ["LoadPlanner", "SavePlanner", "StorageReader", "StorageWriter", "async_save", "load",
           "save"]
