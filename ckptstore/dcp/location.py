"""Where a DCP writer or reader works: a repository it opens itself, lazily and once, from the
location it was given (a folder, `s3://...`, a tier list, with store options), or an open
`CheckpointStore` the caller owns.

A writer must survive being pickled into DCP's background process (`dcp.async_save` with
the process executor): what travels is the location's *spec* (the constructor's arguments,
plain values), never an open store; the process opens its own. An open CheckpointStore
travels as the URIs of its tiers plus its chunking options, which is exact only for local
folders (an S3 store's client options cannot be recovered from the object, and a memory
store lives in this process): anything else is refused with a TypeError saying to pass the
location instead.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..errors import CkptStoreError
from ..repository import CheckpointStore
from ..stores import Store, is_local_uri

Spec = tuple[Any, dict[str, Any]]


def _plain_location(location: Any) -> bool:
    if isinstance(location, (str, os.PathLike)):
        return True
    return isinstance(location, (list, tuple)) and bool(location) and all(
        isinstance(t, (str, os.PathLike)) for t in location)


class Location:
    """The repository of a writer or reader (module docstring). Thread-safe."""

    def __init__(self, location: Any, options: dict[str, Any]) -> None:
        if isinstance(location, CheckpointStore):
            if options:
                raise TypeError("store options cannot be given with an open CheckpointStore "
                                f"(got {sorted(options)}): it has its own")
            self._given: CheckpointStore | None = location
            self._spec: Spec | None = None
        elif _plain_location(location) or isinstance(location, Store):
            self._given = None
            self._spec = (location, dict(options))
        else:
            raise TypeError("location must be a path, a URI, a list of them (tiers, nearest "
                            "first), a Store or an open CheckpointStore; got "
                            f"{type(location).__name__}")
        self._opened: CheckpointStore | None = None
        self._lock = threading.Lock()

    def repo(self) -> CheckpointStore:
        """The repository, opened on first use (a given one is returned as it is)."""
        if self._given is not None:
            return self._given
        with self._lock:
            if self._opened is None:
                assert self._spec is not None
                location, options = self._spec
                self._opened = CheckpointStore(location, **options)
            return self._opened

    def close(self) -> None:
        """Close the repository this object opened (a given one stays open: its owner
        closes it). For tiers, this waits for replications it started."""
        with self._lock:
            opened, self._opened = self._opened, None
        if opened is not None:
            opened.close()

    def spec(self) -> Spec:
        """What reopens this location in another process (module docstring)."""
        if self._spec is not None:
            location, options = self._spec
            if isinstance(location, Store):
                if not is_local_uri(location):
                    raise TypeError(f"a writer over the store {location.uri} cannot be sent to "
                                    "another process; pass its URI and options instead")
                return location.uri, options
            return location, options
        repo = self._given
        assert repo is not None
        uris = [t.uri for t in repo.tiers]
        if not all(isinstance(u, str) and is_local_uri(u) for u in uris):
            raise TypeError(
                "a writer over an open CheckpointStore of non-local tiers cannot be sent to "
                "another process (dcp.async_save with the process executor): pass the "
                "location and its options (ckptstore.dcp.StorageWriter(uri, name, "
                "endpoint_url=...)) instead of the open store")
        o = repo.save_options
        options = {"create": False, "chunk_bytes": o.chunk_bytes, "compression": o.compression,
                   "workers": o.workers, "max_inflight_bytes": o.max_inflight_bytes}
        return (uris[0] if len(uris) == 1 else uris), options

    def describe(self) -> str:
        if self._given is not None:
            return self._given.uri
        assert self._spec is not None
        location = self._spec[0]
        if isinstance(location, Store):
            return location.uri
        if isinstance(location, (list, tuple)):
            return ", ".join(os.fspath(t) for t in location)
        return os.fspath(location)


def tier0(repo: CheckpointStore) -> CheckpointStore:
    """The single-store repository that writes: tier 0 (the repository itself for one)."""
    first = repo.tiers[0]
    if first.tiers != [first]:
        raise CkptStoreError("tier 0 of a tiered repository must be a single store")
    return first
