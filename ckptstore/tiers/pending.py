"""Pending-replication records: how a tiered store remembers, across crashes, which
checkpoints still have to reach later tiers.

A save to a tiered store writes `replication/<name>.json` on tier 0 (`{"name", "tiers",
"created"}`; `tiers` = the indexes of the later tiers it is meant for) *before* its manifest
is committed there, and the replicator removes the record once the checkpoint is committed on
every one of them. So after a kill -9 at any instant:

* record, no tier-0 manifest: the save never committed; the record is dropped on reopen once
  older than ORPHAN_AGE (younger ones may belong to a save still running in another process);
* record and tier-0 manifest: replication was not finished; reopening resumes it (each step
  is idempotent: blobs already on the target are not sent again, an identical manifest is
  skipped);
* no record: nothing to do (replication finished, or the checkpoint was never meant to move).

Retention reads the same records: a checkpoint with a record is never deleted from tier 0.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ..errors import CkptStoreError, ObjectNotFoundError
from ..format.canonical import canonical_json
from ..layout import REPLICATION_PREFIX, name_of_replication_key, replication_key
from ..stores.base import Store

#: a record without a manifest older than this (store clock, seconds) is an aborted save's
ORPHAN_AGE = 3600.0


@dataclass(frozen=True)
class PendingRecord:
    name: str
    tiers: tuple[int, ...]  # indexes of the later tiers the checkpoint is meant for
    mtime: float  # store clock when the record was written


def write_record(store: Store, name: str, tiers: tuple[int, ...]) -> None:
    """Record (durably) that `name` must reach `tiers`; replaces an older record."""
    store.put(replication_key(name), canonical_json(
        {"name": name, "tiers": list(tiers), "created": time.time()}))
    store.sync()


def clear_record(store: Store, name: str) -> None:
    store.delete(replication_key(name))


def has_record(store: Store, name: str) -> bool:
    return store.exists(replication_key(name))


def read_records(store: Store) -> list[PendingRecord]:
    """Every readable record, oldest first. Unreadable ones are skipped (a record is only a
    hint: deleting it never loses data, it only stops an automatic replication)."""
    out = []
    for info in store.list(REPLICATION_PREFIX):
        name = name_of_replication_key(info.key)
        if name is None:
            continue
        try:
            doc = json.loads(store.get(info.key))
            tiers = tuple(int(t) for t in doc["tiers"])
            if doc.get("name") != name or any(t < 1 for t in tiers):
                continue
        except ObjectNotFoundError:
            continue
        except (CkptStoreError, ValueError, KeyError, TypeError):
            continue
        out.append(PendingRecord(name, tiers, info.mtime))
    return sorted(out, key=lambda r: (r.mtime, r.name))


def read_record(store: Store, name: str) -> PendingRecord | None:
    for rec in read_records(store):
        if rec.name == name:
            return rec
    return None


def drop_tier(store: Store, name: str, tier: int) -> None:
    """Remove tier `tier` from `name`'s record (the record goes when no tier is left)."""
    try:
        doc = json.loads(store.get(replication_key(name)))
        tiers = tuple(int(t) for t in doc["tiers"] if int(t) != tier)
    except ObjectNotFoundError:
        return
    except (CkptStoreError, ValueError, KeyError, TypeError):
        clear_record(store, name)
        return
    if tiers:
        write_record(store, name, tiers)
    else:
        clear_record(store, name)
