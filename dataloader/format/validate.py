"""Checks of untrusted JSON: strict parsing, exact types, bounded reads, short error text.

Everything a dataset index (or a loader state) holds is read through these: `parse_json`
refuses non-UTF-8 text and non-finite numbers, `check_int` takes exact ints only (never a
bool, a float or a numeric string), `check_keys` wants exact key sets, `read_capped` refuses an
object over its limit from its size alone, and `short_repr` keeps any hostile value short in
the FormatError (or StateMismatchError) that names the field. Nothing here knows the layout.
"""

from __future__ import annotations

import json
import math
import reprlib
from typing import Any, TypeGuard

import numpy as np

from ckptstore.errors import FormatError
from ckptstore.stores import Store
from ckptstore.toolkit import HASH_NAME, is_digest

INT64_MAX = 2**63 - 1

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 3, 40, 40, 40
_repr.maxlist = _repr.maxtuple = _repr.maxdict = 6


def short_repr(value: object) -> str:
    """repr() cut to a few dozen characters and three levels: safe for any hostile value."""
    return _repr.repr(value)


def is_int(value: object) -> TypeGuard[int | np.integer[Any]]:
    """An exact integer (int or numpy integer): never a bool, a float or a numeric string."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_int(
    value: object,
    where: str,
    lo: int = 0,
    hi: int | None = INT64_MAX,
    error: type[Exception] = FormatError,
) -> int:
    """`value` as an int if it is an exact int in [lo, hi] (hi None: unbounded), else
    raise `error` naming `where`."""
    if is_int(value):
        v = int(value)
        if lo <= v and (hi is None or v <= hi):
            return v
    span = f">= {lo}" if hi is None else f"in [{lo}, {'2**63-1' if hi == INT64_MAX else hi}]"
    raise error(f"{where}: expected an int {span}, got {short_repr(value)}")


def json_depth(value: object, limit: int) -> int:
    """Nesting depth of a parsed JSON value (0 for a scalar, 1 for a flat list or object),
    measured level by level without recursion; stops counting past `limit`."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            break
        depth += 1
        level = [x for c in containers for x in (c.values() if isinstance(c, dict) else c)]
    return depth


def parse_json(raw: bytes | bytearray | memoryview, where: str) -> Any:
    """Parse untrusted JSON bytes (UTF-8, finite numbers only); FormatError on anything
    malformed, nested too deeply for the parser included."""
    try:
        text = str(raw, "utf-8")
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise FormatError(f"{where}: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{where}: not valid JSON ({str(exc)[:200]})") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is not a finite number")
    return value


def read_capped(store: Store, key: str, limit: int, where: str) -> bytearray:
    """The whole object `key`, refused with FormatError from its size (`stat`) alone if it
    is over `limit` bytes; the read is bounded by that size even if the object grows."""
    size = store.stat(key).size
    if size > limit:
        raise FormatError(
            f"{where}: object of {size:,} bytes, larger than the {limit:,}-byte limit "
            "(refused without reading it)"
        )
    buf = bytearray(size)
    if size:
        store.read_into(key, 0, memoryview(buf))
    return buf


# -- small JSON validation helpers -------------------------------------------------------
def need_type(value: Any, typ: type, where: str) -> None:
    if not isinstance(value, typ):
        raise FormatError(f"{where}: expected {typ.__name__}, got {type(value).__name__}")


def check_keys(
    d: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> None:
    """`d` is a JSON object with every `required` key and nothing outside `optional`."""
    need_type(d, dict, where)
    for key in required:
        if key not in d:
            raise FormatError(f"{where}: missing {key!r}")
    unknown = [k for k in d if k not in required and k not in optional]
    if unknown:
        raise FormatError(f"{where}: unknown key {short_repr(unknown[0])}")


def get_typed(d: dict[str, Any], key: str, typ: type, where: str) -> Any:
    if key not in d:
        raise FormatError(f"{where}: missing {key!r}")
    need_type(d[key], typ, f"{where}.{key}")
    return d[key]


def get_int(d: dict[str, Any], key: str, where: str) -> int:
    return check_int(d.get(key), f"{where}.{key}")


def get_ints(
    d: dict[str, Any], key: str, where: str, lo: int, min_len: int, max_len: int | None = None
) -> list[int]:
    """d[key]: a list of exact ints >= lo (each at most 2**63-1), of length in range."""
    v = get_typed(d, key, list, where)
    if len(v) < min_len or (max_len is not None and len(v) > max_len):
        span = f"{min_len}..{max_len}" if max_len is not None else f">= {min_len}"
        raise FormatError(f"{where}.{key}: expected {span} entries, got {len(v)}")
    if not all(is_int(x) and lo <= x <= INT64_MAX for x in v):
        bad = next(x for x in v if not (is_int(x) and lo <= x <= INT64_MAX))
        raise FormatError(f"{where}.{key}: expected ints >= {lo}, got {short_repr(bad)}")
    return [int(x) for x in v]


def check_digest(v: Any, where: str) -> str:
    if not is_digest(v):
        raise FormatError(f"{where}: {short_repr(v)} is not an {HASH_NAME} hex digest")
    return str(v)


def same_json(a: Any, b: Any) -> bool:
    """Equality of JSON values that also tells bool from int and int from float."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    return bool(a == b)
