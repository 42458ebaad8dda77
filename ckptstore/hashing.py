"""Content digests: xxh3-128, hex encoded (32 lower-case hex characters). xxhash releases the
GIL, so hashing in worker threads runs in parallel."""

from __future__ import annotations

import re

import xxhash

from .errors import FormatError

HASH_NAME = "xxh3-128"
_DIGEST_RE = re.compile(r"[0-9a-f]{32}")


def digest(data: bytes | bytearray | memoryview) -> str:
    """Return the xxh3-128 hex digest of `data` (any buffer; no copy is made)."""
    return xxhash.xxh3_128_hexdigest(data)


def new_hasher() -> xxhash.xxh3_128:
    """A streaming hasher: `update()` it with consecutive pieces; its `hexdigest()` equals
    `digest()` of the pieces joined."""
    return xxhash.xxh3_128()


def is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST_RE.fullmatch(value) is not None


def check_digest(value: object, where: str) -> str:
    if not is_digest(value):
        raise FormatError(f"{where}: {value!r} is not an {HASH_NAME} hex digest")
    assert isinstance(value, str)
    return value


def blob_key(hex_digest: str) -> str:
    """Store key of the blob with this digest: blobs/ab/ab12...ef."""
    check_digest(hex_digest, "blob key")
    return f"blobs/{hex_digest[:2]}/{hex_digest}"
