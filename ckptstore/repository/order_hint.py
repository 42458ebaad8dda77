"""The commit-order hint: the `created` time of each manifest, saved so that a fresh process
in a repository of many checkpoints need not read every manifest's head.

The catalog orders checkpoints by their manifests' `created`, read from the first bytes of
each manifest once per manifest object: (name, size, mtime) as listed -> created. A process
that had to read many heads saves that map under `catalog/order.json` (sealed canonical
JSON); a later process starts from it and reads only the heads of objects it does not match.
The hint is derived data and never trusted beyond that match: an entry is used only for a
listed manifest of exactly that name, size and modification time (a manifest deleted and
created again is a new object: its head is read), and a hint that is missing, damaged,
malformed or too large is ignored. Writing it is best-effort (a read-only store skips it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from ..errors import CkptStoreError, FormatError, ObjectNotFoundError
from ..format.canonical import canonical_json, check_seal, seal
from ..format.names import validate_name
from ..layout import ORDER_HINT_KEY
from ..stores.base import Store

FORMAT = "ckptstore.order"
#: a hint larger than this is ignored (about 100 bytes per checkpoint)
MAX_HINT_BYTES = 64 << 20
#: a process saves the hint after it had to read more heads than this
WRITE_AFTER_HEADS = 32
log = logging.getLogger("ckptstore")

#: (name, size, mtime) of a listed manifest -> its created
Heads = dict[tuple[str, int, float], float]


def read_hint(store: Store) -> Heads:
    """The hint's entries, or {} if there is none or it cannot be used (logged at debug)."""
    try:
        if store.stat(ORDER_HINT_KEY).size > MAX_HINT_BYTES:
            raise FormatError(f"larger than {MAX_HINT_BYTES} bytes")
        data = store.get(ORDER_HINT_KEY)
        check_seal(data, ORDER_HINT_KEY)
        return _entries(json.loads(data))
    except ObjectNotFoundError:
        return {}
    except (CkptStoreError, ValueError, RecursionError) as exc:
        log.debug("ignoring the commit-order hint of %s: %s", store.uri, exc)
        return {}


def _entries(doc: object) -> Heads:
    if (type(doc) is not dict or doc.get("format") != FORMAT
            or type(rows := doc.get("entries")) is not list):
        raise FormatError("not a commit-order hint")
    out: Heads = {}
    for row in rows:
        if (type(row) is not list or len(row) != 4 or type(row[0]) is not str
                or type(row[1]) is not int or type(row[2]) not in (int, float)
                or type(row[3]) not in (int, float)):
            raise FormatError("an entry is not [name, size, mtime, created]")
        name, size, mtime, created = row
        validate_name(name)
        out[(name, size, float(mtime))] = float(created)
    return out


def write_hint(store: Store, heads: Mapping[tuple[str, int, float], float]) -> None:
    """Save `heads` as the hint (replacing any), best-effort: a failure is logged at debug."""
    rows = sorted([name, size, mtime, created] for (name, size, mtime), created in heads.items())
    try:
        store.put(ORDER_HINT_KEY, seal(canonical_json({"entries": rows, "format": FORMAT})))
    except CkptStoreError as exc:
        log.debug("could not save the commit-order hint of %s: %s", store.uri, exc)
