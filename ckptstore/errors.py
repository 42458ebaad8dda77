"""Error types. Every error ckptstore raises derives from CkptStoreError and, where one fits,
from the matching builtin, so callers can catch either."""

from __future__ import annotations


class CkptStoreError(Exception):
    """Base class of every ckptstore error."""


class StoreError(CkptStoreError, OSError):
    """A storage backend failed (I/O error, unreachable endpoint, refused request)."""


class SourceChangedError(CkptStoreError):
    """A tensor of an overlapped async save was changed in place before the save had copied
    all of it: the checkpoint would have mixed values from before and after the call, so
    nothing was committed."""

    def __init__(self, key: str, before: int, now: int) -> None:
        super().__init__(
            f"{key}: tensor changed in place (version {before} -> {now}) before the "
            "overlapped async save had copied it; nothing was committed. Guard the optimizer "
            "(handle.guard(opt)), wait() before changing it, or use staging='copy'")
        self.key = key


class BucketNotFoundError(StoreError):
    """An S3 bucket does not exist (and the store was opened with create=False)."""


class ShortReadError(StoreError):
    """An object holds fewer bytes than were asked for (a range past its end)."""


class StoreAccessError(StoreError, PermissionError):
    """The store's location cannot be created or written: no permission, or a read-only file
    system. The message names the path and what failed; `errno` is the system's code."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """A store key that should exist does not."""


class ObjectExistsError(StoreError, FileExistsError):
    """A create-only write found the key already present with other content."""


class DurabilityError(StoreError):
    """A write could not be made durable (for example fsync failed). Fatal for that save."""


class CheckpointNotFoundError(CkptStoreError, FileNotFoundError, KeyError):
    """No checkpoint of that name exists in the repository."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else "checkpoint not found"


class CheckpointExistsError(CkptStoreError, FileExistsError):
    """A checkpoint of that name exists already; it was not touched."""


class DeviceCopyError(CkptStoreError, RuntimeError):
    """A copy between a device and host memory failed (a device error). A save fails with it
    and commits nothing; a load fails with it and its `into=` tensors may be partly filled."""


class IntegrityError(CkptStoreError, ValueError):
    """Bytes read back do not match their recorded digest or size."""


class FormatError(CkptStoreError, ValueError):
    """A manifest, marker or other stored document is malformed or of an unknown version."""


class InvalidNameError(CkptStoreError, ValueError):
    """A checkpoint name or store key fails validation."""


class UnsupportedTypeError(CkptStoreError, TypeError):
    """A value in the state cannot be stored; the message names its key path."""


class RepositoryNotFoundError(CkptStoreError, FileNotFoundError):
    """The location holds no ckptstore repository (and create=False was asked)."""


class UnrestorableCheckpointError(CkptStoreError):
    """Checkpoints exist, but none can be restored as asked: not whole on every rank, saved
    by another number of ranks, or a rank left the restore. Nothing usable was loaded, and
    every rank raises it (with the same message where the ranks could still agree). Starting
    over instead is a decision: `CheckpointManager.restore(..., fresh_ok=True)`."""


class PeerExchangeError(CkptStoreError):
    """The copy of a save to its peer replicas could not complete: a rank left or did not
    answer within `peer_timeout`. The rank's own checkpoint is committed; only its peer
    copies may be missing (the next save sends them again)."""


class KeyMismatchError(CkptStoreError, KeyError):
    """Requested keys are not in the checkpoint, or an `into=` destination does not fit."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "key mismatch"


class MissingDependencyError(CkptStoreError, ImportError):
    """An optional package a feature needs is not installed; the message is one line naming
    the extra to install (`pip install 'ckptstore[s3]'`). Raised by `ckptstore.deps.require`."""


class TierUnreachableError(StoreError):
    """A far tier cannot be reached now (not opened yet, or down since a recent failure);
    transient: retried by the replicator (ckptstore/tiers/far.py)."""


class ReplicationError(CkptStoreError):
    """A checkpoint could not be replicated to a tier (after retries); its copy on the nearer
    tiers is intact and its pending record stays, so reopening the store tries again."""

    def __init__(self, name: str, target: str, cause: BaseException, attempts: int) -> None:
        super().__init__(f"replication of checkpoint {name!r} to {target} gave up after "
                         f"{attempts} attempt(s): {type(cause).__name__}: {cause}")
        self.name = name
        self.target = target
        self.cause = cause


class ReusedBlobsMissingError(StoreError):
    """Blobs a save meant to reuse from earlier checkpoints, or had written itself before it
    was suspended past its lease's bound, were deleted meanwhile (a gc ran beside the save);
    the manifest was not committed."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__(f"{len(missing)} blob(s) this save names were deleted before its "
                         f"commit (first: {missing[0]}); nothing was committed")
        self.missing = missing


class CollectiveError(CkptStoreError):
    """An exchange between the ranks of a collective save or restore failed: a rank died,
    left the group or timed out."""


class LeaseBusyError(CkptStoreError):
    """The operation could not start because a conflicting lease is live (try again later)."""


class TrustRequiredError(CkptStoreError, PermissionError):
    """The source can only be read by unpickling it; the caller did not say it trusts it."""


class ExportWarning(UserWarning):
    """An export that will not load as the user means it to: keys the named Hugging Face model
    does not expect, weights it would not find, tied tensors it does not tie."""
