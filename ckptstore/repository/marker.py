"""The repository marker `ckptstore.json` (docs/format.md): format, version, hash algorithm.
Written create-only when a repository is made; read (and checked) on every open."""

from __future__ import annotations

import json

from ..errors import FormatError, ObjectExistsError, ObjectNotFoundError, RepositoryNotFoundError
from ..format.canonical import canonical_json
from ..format.hashing import HASH_NAME, HashAlgorithm, hash_algorithm
from ..layout import MARKER_KEY
from ..stores.base import Store

REPO_FORMAT = "ckptstore"
REPO_VERSION = 1
MARKER = {"format": REPO_FORMAT, "version": REPO_VERSION, "hash": HASH_NAME}


def check_marker(store: Store, create: bool, algorithm: HashAlgorithm) -> HashAlgorithm:
    """Read (or, with `create`, write) the repository marker of `store`; returns its hash
    algorithm. RepositoryNotFoundError without a marker and `create`; FormatError for a
    marker that is not ckptstore's or of another version."""
    try:
        raw = store.get(MARKER_KEY)
    except ObjectNotFoundError:
        if not create:
            raise RepositoryNotFoundError(
                f"no ckptstore repository at {store.uri} (missing {MARKER_KEY})") from None
        try:
            store.create(MARKER_KEY, canonical_json({**MARKER, "hash": algorithm.name}))
            return algorithm
        except ObjectExistsError:
            raw = store.get(MARKER_KEY)
    try:
        doc = json.loads(raw)
    except ValueError:
        raise FormatError(f"{store.uri}/{MARKER_KEY} is not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != REPO_FORMAT:
        raise FormatError(f"{store.uri}/{MARKER_KEY} is not a ckptstore marker")
    if doc.get("version") != REPO_VERSION:
        raise FormatError(f"repository {store.uri} has format version {doc.get('version')!r};"
                          f" this ckptstore reads version {REPO_VERSION}")
    try:
        return hash_algorithm(doc.get("hash"))
    except FormatError as exc:
        raise FormatError(f"repository {store.uri}: {exc}") from None
