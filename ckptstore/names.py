"""Validation of checkpoint names and store keys. Keys are built only from validated names and
hex digests, never from tensor names."""

from __future__ import annotations

import re

from .errors import InvalidNameError

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_KEY_PART_RE = re.compile(r"[A-Za-z0-9._-]+")


def validate_name(name: object) -> str:
    """Return `name` if it is a valid checkpoint name, else raise InvalidNameError."""
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise InvalidNameError(
            f"invalid checkpoint name {name!r}: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return name


def validate_key(key: str) -> str:
    """Return `key` if it is a safe relative store key ('a/b/c' of [A-Za-z0-9._-] parts, no
    '.' or '..' parts, no leading slash), else raise InvalidNameError."""
    if not isinstance(key, str) or not key:
        raise InvalidNameError(f"invalid store key {key!r}")
    for part in key.split("/"):
        if part in ("", ".", "..") or _KEY_PART_RE.fullmatch(part) is None:
            raise InvalidNameError(f"invalid store key {key!r}")
    return key


def validate_prefix(prefix: str) -> str:
    """Validate a listing prefix: empty, or a key optionally ending in '/'."""
    if prefix == "":
        return prefix
    validate_key(prefix.rstrip("/"))
    return prefix
