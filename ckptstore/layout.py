"""Where everything lives in a repository: the one map from object kind to key (restic's
layout idea). Every other module builds keys through here; docs/format.md is its spec.

    ckptstore.json                 the repository marker (format version, hash algorithm)
    blobs/<d[0:2]>/<d>             immutable chunk data, named by the digest d of its bytes
    checkpoints/<name>.json        the manifest of checkpoint <name>: the commit record
    locks/save-<32 hex>.json       a save in progress (see maintenance/leases.py)
    locks/gc-<32 hex>.json         a gc in progress
    locks/sweep.json               the last gc's state ("deleting" / "done")
    locks/clock-<32 hex>.json      a probe written and deleted to read the store's clock
    replication/<name>.json        tiered stores, tier 0 only: checkpoint <name> still has to
                                   reach later tiers (see ckptstore/tiers/pending.py)
"""

from __future__ import annotations

import concurrent.futures as cf
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from .errors import FormatError, ObjectNotFoundError, StoreError
from .format.hashing import HashAlgorithm, check_digest, is_digest
from .format.names import validate_name
from .format.segment_encoding import IndexBlob
from .format.segments import SegmentSource

MARKER_KEY = "ckptstore.json"
BLOB_PREFIX = "blobs/"
MANIFEST_PREFIX = "checkpoints/"
MANIFEST_SUFFIX = ".json"
LOCK_PREFIX = "locks/"
SWEEP_KEY = f"{LOCK_PREFIX}sweep.json"
LEASE_KINDS = ("save", "gc")
REPLICATION_PREFIX = "replication/"
#: a hint of the commit order (repository/order_hint.py): derived data, never authoritative
ORDER_HINT_KEY = "catalog/order.json"


def blob_key(hex_digest: str) -> str:
    """Key of the blob with this digest: blobs/ab/ab12...ef."""
    check_digest(hex_digest, "blob key")
    return f"{BLOB_PREFIX}{hex_digest[:2]}/{hex_digest}"


def blob_of_key(key: str) -> str | None:
    """The digest a key names if it is exactly a blob key, else None (foreign objects)."""
    digest = key.rsplit("/", 1)[-1]
    return digest if is_digest(digest) and key == blob_key(digest) else None


class _Gets(Protocol):
    uri: str

    def get(self, key: str) -> bytes: ...


class _Has(Protocol):
    def exists(self, key: str) -> bool: ...


def missing_blobs(store: _Has, blobs: Iterable[str], workers: int = 8) -> list[str]:
    """The blobs among `blobs` that `store` lacks, sorted: one `exists` each (a HEAD on
    S3), `workers` at a time. The one check before a commit that names blobs it did not
    just write (reused ones after a gc's sweep, other ranks', a DCP save's)."""
    wanted = sorted(set(blobs))
    if not wanted:
        return []
    with cf.ThreadPoolExecutor(min(workers, len(wanted))) as pool:
        present = list(pool.map(lambda b: store.exists(blob_key(b)), wanted))
    return [b for b, ok in zip(wanted, present) if not ok]


def segments_in(stores: Sequence[_Gets], algorithm: HashAlgorithm,
                written: Mapping[str, bytes] | None = None) -> SegmentSource:
    """The index blobs (segments, state tree) of version-3 manifests, read as the blobs they
    are from the first of `stores` (the manifest's own store, then the tiers after it) whose
    copy matches its digest; one served by a later store is reported with a RuntimeWarning.
    If none is good: FormatError naming every copy's problem when each is missing or
    damaged (the checkpoint is damaged), StoreError when a store failed to answer (an
    outage is not damage: a caller must not fall back to an older checkpoint for it).
    `written`: index blobs this process wrote itself (digest -> bytes, made from those
    bytes), served from memory."""
    def fetch(ref: IndexBlob) -> bytes:
        own = None if written is None else written.get(ref.digest)
        if own is not None and len(own) == ref.size:
            return own
        problems = []
        failed: StoreError | None = None  # a store that could not tell what it holds
        for i, store in enumerate(stores):
            try:
                data = store.get(blob_key(ref.digest))
            except ObjectNotFoundError:
                problems.append(f"missing from {store.uri}")
                continue
            except StoreError as exc:
                problems.append(f"unreadable in {store.uri} ({exc})")
                failed = exc
                continue
            if len(data) != ref.size or algorithm.digest(data) != ref.digest:
                problems.append(f"corrupt in {store.uri} (its content does not match its "
                                "digest)")
                continue
            if i:
                warnings.warn(f"index blob {ref.digest}: {'; '.join(problems)}; read from "
                              f"{store.uri}", RuntimeWarning, stacklevel=2)
            return data
        if failed is not None:  # not known to be damaged: its copy there may be good
            raise StoreError(f"index blob {ref.digest} could not be read: "
                             f"{'; '.join(problems)}") from failed
        raise FormatError(f"index blob {ref.digest} has no good copy: {'; '.join(problems)}")
    return fetch


def manifest_key(name: str) -> str:
    """Key of the manifest of checkpoint `name` (validated: InvalidNameError otherwise)."""
    return f"{MANIFEST_PREFIX}{validate_name(name)}{MANIFEST_SUFFIX}"


def _name_under(prefix: str, key: str) -> str | None:
    """The checkpoint name in `key` = prefix + name + ".json", or None if it cannot be one."""
    rest = key[len(prefix):] if key.startswith(prefix) else ""
    if not rest.endswith(MANIFEST_SUFFIX):
        return None
    try:
        return validate_name(rest[: -len(MANIFEST_SUFFIX)])
    except ValueError:
        return None


def name_of_manifest_key(key: str) -> str | None:
    """The checkpoint name a key under checkpoints/ would have, or None if it cannot be one."""
    return _name_under(MANIFEST_PREFIX, key)


def lease_key(kind: str, token: str) -> str:
    """Key of a lease of `kind` ("save" or "gc") with a random 32-hex `token`."""
    return f"{LOCK_PREFIX}{kind}-{token}.json"


def lease_kind(key: str) -> str | None:
    """The kind of lease a key under locks/ holds, or None if it is not a lease."""
    kind, sep, rest = key[len(LOCK_PREFIX):].partition("-")
    if not key.startswith(LOCK_PREFIX) or not sep or kind not in LEASE_KINDS:
        return None
    return kind if rest.endswith(".json") and "/" not in rest else None


def clock_probe_key(token: str) -> str:
    return f"{LOCK_PREFIX}clock-{token}.json"


def replication_key(name: str) -> str:
    """Key of the pending-replication record of checkpoint `name` (validated)."""
    return f"{REPLICATION_PREFIX}{validate_name(name)}{MANIFEST_SUFFIX}"


def name_of_replication_key(key: str) -> str | None:
    """The checkpoint name of a pending-replication record key, or None."""
    return _name_under(REPLICATION_PREFIX, key)
