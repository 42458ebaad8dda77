"""Canonical JSON and self-digests ("seals") for the documents ckptstore commits.

Canonical JSON: sorted keys, no spaces, UTF-8 (no ASCII escaping), no NaN or infinities, so
equal documents give equal bytes.

A sealed document is the canonical JSON `B` of the document without its seal, with
``,"self_digest":"<xxh3-128 hex of B>"`` inserted before the final ``}``. The seal is the last
field by construction (not by sorting), so a reader checks it on the raw bytes, before and
independently of parsing: cut the field off, put the ``}`` back, hash, compare. One bit flipped
anywhere in the document then fails the check instead of loading other values.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from ..errors import FormatError
from .hashing import digest

SEAL_FIELD = "self_digest"
_SEAL_TAIL = re.compile(rb',"self_digest":"([0-9a-f]{32})"\}\Z')


def canonical_str(doc: Any) -> str:
    """`canonical_json` before UTF-8 encoding."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def reject_constant(name: str) -> Any:
    """`json.loads(..., parse_constant=reject_constant)`: NaN and the infinities are no JSON
    a manifest may hold (ValueError)."""
    raise ValueError(f"{name} is not allowed in a manifest")


def canonical_json(doc: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8, no NaN: equal documents give equal bytes."""
    return canonical_str(doc).encode("utf-8")


Digest = Callable[[bytes], str]


def seal(body: bytes, digest_of: Digest = digest) -> bytes:
    """`body` (the canonical JSON of a non-empty object) with its self-digest appended as the
    last field (xxh3-128, or the repository's hash algorithm for manifests)."""
    if len(body) < 3 or not body.startswith(b"{") or not body.endswith(b"}"):
        raise ValueError("only a non-empty JSON object can be sealed")
    return b"%s,\"%s\":\"%s\"}" % (body[:-1], SEAL_FIELD.encode(), digest_of(body).encode())


def is_sealed(data: bytes) -> bool:
    """True if `data` ends with a seal field of the right form (its digest is not checked)."""
    return _SEAL_TAIL.search(data[-64:]) is not None


def check_seal(data: bytes, what: str, digest_of: Digest = digest) -> None:
    """Raise FormatError unless `data` ends with a seal that matches the rest of it."""
    match = _SEAL_TAIL.search(data, max(0, len(data) - 64))
    if match is None:
        raise FormatError(f"{what} has no valid {SEAL_FIELD} field at its end")
    body = data[: match.start()] + b"}"
    if digest_of(body) != match.group(1).decode():
        raise FormatError(f"{what} is corrupt: its content does not match its {SEAL_FIELD}")
