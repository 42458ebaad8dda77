"""The tier list of a tiered repository: nearest (fastest) first, each an ordinary repository.

`CheckpointStore("runs/x")` is one tier; `CheckpointStore(["/nvme/x", "s3://b/x"])` two.
Options are given once and each tier takes those that fit it: S3 options (`endpoint_url`,
`region_name`, ...) only reach S3 tiers, `create` reaches every tier.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidNameError
from ..redact import redact_uri
from ..stores.base import Store

TierURI = str | os.PathLike[str] | Store
#: options every backend accepts; everything else is for S3 tiers only
COMMON_OPTIONS = frozenset({"create"})
_PLACEHOLDER = re.compile(r"\{(rank|node|local_rank)\}")


def tier_uris(uri: TierURI | Sequence[TierURI]) -> list[TierURI]:
    """The tiers a `CheckpointStore(uri)` argument names, nearest first. A string, path or
    Store is one tier; a list or tuple is several (at least one, no duplicates)."""
    if isinstance(uri, (str, os.PathLike, Store)):
        return [uri]
    if not isinstance(uri, (list, tuple)):
        raise InvalidNameError("a repository is a URI, a path, a Store, or a list of them "
                               f"(tiers, nearest first); got {type(uri).__name__}")
    tiers = list(uri)
    if not tiers:
        raise InvalidNameError("a tiered repository needs at least one tier URI")
    seen: set[str] = set()
    for t in tiers:
        if not isinstance(t, (str, os.PathLike, Store)):
            raise InvalidNameError(f"tier URIs must be strings, paths or Stores, got "
                                   f"{type(t).__name__}")
        key = t.uri if isinstance(t, Store) else os.fspath(t)
        if key in seen:
            raise InvalidNameError(f"tier {redact_uri(key)!r} is listed twice")
        seen.add(key)
    return tiers


def is_s3(uri: TierURI) -> bool:
    if isinstance(uri, Store):
        return type(uri).__name__ == "S3Store"
    return isinstance(uri, str) and uri.lower().startswith("s3://")


def options_for(uri: TierURI, options: dict[str, Any]) -> dict[str, Any]:
    """The subset of store `options` that tier `uri` takes."""
    if is_s3(uri):
        return dict(options)
    return {k: v for k, v in options.items() if k in COMMON_OPTIONS}


def expand(uri: TierURI, *, rank: int, node: int | str, local_rank: int = 0) -> TierURI:
    """Fill the `{rank}`, `{node}` and `{local_rank}` placeholders of a tier URI (each rank
    or node its own folder); other braces are left alone. Stores are returned unchanged."""
    if isinstance(uri, Store):
        return uri
    values = {"rank": str(rank), "node": str(node), "local_rank": str(local_rank)}
    text = os.fspath(uri)
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def has_placeholders(uri: TierURI) -> bool:
    return not isinstance(uri, Store) and bool(_PLACEHOLDER.search(os.fspath(uri)))


def check_filled(uris: Sequence[TierURI]) -> None:
    """InvalidNameError if a tier URI still holds a {rank}/{node}/{local_rank} placeholder."""
    if any(has_placeholders(u) for u in uris):
        raise InvalidNameError("tier URIs with {rank}/{node}/{local_rank} must be filled in "
                               "first (CheckpointManager does it; or tiers.config.expand)")
