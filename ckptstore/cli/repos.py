"""Opening a repository for a command (every command opens them the same way)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import BucketNotFoundError, ObjectNotFoundError, RepositoryNotFoundError
from ..redact import redact_uri
from ..repository import CheckpointStore
from ..stores import open_store


def scheme_of(uri: str) -> str:
    return uri.partition("://")[0].lower() if "://" in uri else ""


def open_repo(uri: str, args: argparse.Namespace, *, create: bool = False,
              endpoint_url: str | None = None, workers: int = 8) -> CheckpointStore:
    """Open the repository at `uri`. Read commands pass create=False: a typo is an error, and
    nothing (folder, bucket, marker) is created. Buckets are never created by the CLI."""
    scheme = scheme_of(uri)
    opts: dict[str, Any] = {}
    if scheme == "s3":
        endpoint = (endpoint_url or getattr(args, "endpoint_url", None)
                    or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
        if endpoint:
            opts["endpoint_url"] = endpoint
        if getattr(args, "region", None):
            opts["region_name"] = args.region
        if getattr(args, "max_attempts", None):
            opts["max_attempts"] = args.max_attempts
        opts["create"] = False
    elif scheme != "memory":
        opts["create"] = create
    try:
        store = open_store(uri, **opts)
    except BucketNotFoundError as exc:
        raise BucketNotFoundError(f"{exc}; create the bucket first (ckpt never creates "
                                  "buckets)") from None
    except ObjectNotFoundError:
        path = uri[len("file://"):] if scheme == "file" else uri
        what = "not a folder" if os.path.exists(path) else "no such folder"
        raise RepositoryNotFoundError(
            f"no ckptstore repository at {redact_uri(uri)} ({what})") from None
    try:
        return CheckpointStore(store, create=create, workers=workers)
    except BaseException:
        store.close()
        raise
