"""Content digests, hex encoded (32 lower-case hex characters = 128 bits).

A repository names its chunks with one hash algorithm, chosen when it is created and kept in
its marker: xxh3-128 by default (about 30 GB/s per core; detects accidents: flipped bits,
torn or mixed-up writes) or sha256-128, the first 128 bits of SHA-256 (about 1 GB/s per core
with the CPU's SHA instructions; a hostile writer cannot find other bytes with the same
digest). Both release the GIL, so hashing in worker threads runs in parallel. `digest()` and
`new_hasher()` are xxh3-128: seals of ckptstore's own documents and stores' fused
read-and-hash use it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import FormatError

HASH_NAME = "xxh3-128"
_DIGEST_RE = re.compile(r"[0-9a-f]{32}")
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class HashAlgorithm:
    """How a repository names chunks: `digest(data)` gives 32 lower-case hex characters."""

    name: str
    digest: Callable[[Buffer], str]
    cryptographic: bool

    def __repr__(self) -> str:
        return f"HashAlgorithm({self.name!r})"


def _sha256_128(data: Buffer) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


XXH3_128 = HashAlgorithm(HASH_NAME, xxhash.xxh3_128_hexdigest, cryptographic=False)
SHA256_128 = HashAlgorithm("sha256-128", _sha256_128, cryptographic=True)
ALGORITHMS = {a.name: a for a in (XXH3_128, SHA256_128)}


def hash_algorithm(name: Any) -> HashAlgorithm:
    """The algorithm called `name`; FormatError for an unknown one."""
    found = ALGORITHMS.get(name) if isinstance(name, str) else None
    if found is None:
        raise FormatError(f"unknown hash algorithm {name!r:.40}; known: {sorted(ALGORITHMS)}")
    return found


def digest(data: bytes | bytearray | memoryview) -> str:
    """Return the xxh3-128 hex digest of `data` (any buffer; no copy is made)."""
    return xxhash.xxh3_128_hexdigest(data)


def new_hasher() -> xxhash.xxh3_128:
    """A streaming hasher: `update()` it with consecutive pieces; its `hexdigest()` equals
    `digest()` of the pieces joined."""
    return xxhash.xxh3_128()


class StreamingDigest:
    """`algorithm`'s digest fed piece by piece: `update()` with consecutive pieces, then
    `digest()` equals `algorithm.digest` of the pieces joined."""

    def __init__(self, algorithm: HashAlgorithm) -> None:
        self._truncate = algorithm.name == SHA256_128.name
        if not self._truncate and algorithm.name != XXH3_128.name:
            raise FormatError(f"no streaming form of {algorithm.name!r}")
        self._h: Any = hashlib.sha256() if self._truncate else xxhash.xxh3_128()

    def update(self, data: Buffer) -> None:
        self._h.update(data)

    def digest(self) -> str:
        out: str = self._h.hexdigest()
        return out[:32] if self._truncate else out


def is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST_RE.fullmatch(value) is not None


def check_digest(value: object, where: str) -> str:
    if not is_digest(value):
        raise FormatError(f"{where}: {value!r} is not an {HASH_NAME} hex digest")
    assert isinstance(value, str)
    return value
