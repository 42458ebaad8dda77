"""Validation of checkpoint names and store keys. Keys are built only from validated names and
hex digests, never from tensor names."""

from __future__ import annotations

import re

from ..errors import InvalidNameError

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_KEY_PART_RE = re.compile(r"[A-Za-z0-9._-]+")
#: Names no checkpoint may take: "latest" means the newest checkpoint (load, show, rm, cp).
#: Exactly this spelling: "Latest" or "latest-1" are ordinary names.
RESERVED_NAMES = frozenset({"latest"})


def validate_name(name: object, *, allow_reserved: bool = False) -> str:
    """Return `name` if it is a valid checkpoint name, else raise InvalidNameError. A reserved
    name (RESERVED_NAMES) is refused too, unless `allow_reserved`: for reading what was
    written before it was reserved (e.g. an old manifest's `parent`)."""
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise InvalidNameError(
            f"invalid checkpoint name {name!r}: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    if name in RESERVED_NAMES and not allow_reserved:
        raise InvalidNameError(
            f"invalid checkpoint name {name!r}: {name!r} is reserved: it means the newest "
            "checkpoint"
        )
    return name


def is_valid_key(key: object) -> bool:
    """True if `key` is a safe relative store key ('a/b/c' of [A-Za-z0-9._-] parts, no '.' or
    '..' parts, no leading slash)."""
    return isinstance(key, str) and bool(key) and all(
        part not in ("", ".", "..") and _KEY_PART_RE.fullmatch(part) is not None
        for part in key.split("/"))


def validate_key(key: str) -> str:
    """Return `key` if it is a safe relative store key (`is_valid_key`), else raise
    InvalidNameError."""
    if not is_valid_key(key):
        raise InvalidNameError(f"invalid store key {key!r}")
    return key


def validate_prefix(prefix: str) -> str:
    """Validate a listing prefix: empty, or a key optionally ending in '/'."""
    if prefix == "":
        return prefix
    validate_key(prefix.rstrip("/"))
    return prefix
