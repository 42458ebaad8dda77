"""S3 and S3-compatible servers (MinIO, moto). The only module of ckptstore that imports boto3.

Contracts, on top of the ones in `base`:

* Credentials come only from the standard boto3 chain (environment, shared config files,
  instance or container roles). This object never holds them, and no message, log line or
  repr carries them. A URI or endpoint with ``user:password@``, a query or a fragment in it is
  refused (the endpoint botocore takes from its own configuration too); every URI, endpoint
  and botocore text shown goes through `redact.redact_uri`/`redact_text` first.
* Retries: botocore "standard" mode with a bounded ``total_max_attempts`` covers throttling,
  5xx replies and connection errors. botocore does not retry a GET whose *body* breaks off
  part-way, so reads run their own bounded loop around that (resuming a ranged read with
  ``If-Match`` on the first reply's ETag, so a replaced object never yields mixed bytes).
* `put` is a single PutObject below ``multipart_threshold``, else a multipart upload whose
  parts go up in parallel; S3 makes the object visible whole on PutObject or
  CompleteMultipartUpload. A multipart upload that fails for any reason is aborted after
  the parts in flight have finished, so no parts are left behind. An upload left behind
  all the same (its writer killed, or a CreateMultipartUpload retried after its reply was
  lost: the first upload is never known) is aborted by a gc once a day old (`temp_files`).
* `create` sends ``If-None-Match: *``. A 412 (or, after a lost reply, NoSuchUpload) means the
  key exists: the object is read back; identical bytes count as success (a retried commit
  whose first reply was lost), other bytes raise ObjectExistsError and are left untouched.
* S3 acknowledges a write only once it is durable, so `sync` has nothing to do.
* The caller's buffer is read, never copied whole, and must not change until `put`/`create`
  returns. `read_into` fills the caller's buffer in 1 MiB steps (one small copy each).

Why one module: S3's retry, resume, conditional-create and multipart rules
interact (a retried create reads back, a resumed read pins the ETag, a failed multipart
aborts); they are kept in one place on purpose.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import http.client
import io
import logging
import math
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

from ..deps import missing

try:
    import boto3
    import botocore.loaders
    import botocore.session
    import urllib3.exceptions
    from botocore.config import Config
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionClosedError,
        CredentialRetrievalError,
        EndpointConnectionError,
        FlexibleChecksumError,
        IncompleteReadError,
        NoCredentialsError,
        PartialCredentialsError,
        ReadTimeoutError,
        ResponseStreamingError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError
except ModuleNotFoundError as _exc:  # boto3 is the `s3` extra
    raise missing(_exc) from None

from ..errors import (
    BucketNotFoundError,
    InvalidNameError,
    ObjectExistsError,
    ObjectNotFoundError,
    ShortReadError,
    StoreError,
)
from ..format.hashing import new_hasher
from ..format.names import is_valid_key, validate_key, validate_prefix
from ..redact import redact_text, redact_uri
from .base import Buffer, ObjectInfo, Store, check_range, short_read

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
MIN_PART_SIZE = 5 * MiB  # S3's floor for every part but the last
MAX_PARTS = 10_000
#: an incomplete multipart upload begun longer ago than this is abandoned (its writer died,
#: or a CreateMultipartUpload retried after a lost reply left the first one behind): gc
#: aborts it (`temp_files`). A day: far beyond any upload a live writer still runs.
ABANDONED_UPLOAD_AGE = 24 * 3600.0
_UPLOAD_MARK = "#upload="  # `temp_files` names: key + mark + upload id ('#' is in no key)
READ_STEP = 1 * MiB

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IPV4_RE = re.compile(r"\d{1,3}(\.\d{1,3}){3}")

#: A GET body that broke off part-way, or arrived damaged: worth another ranged GET.
_BODY_ERRORS: tuple[type[BaseException], ...] = (
    ResponseStreamingError,
    IncompleteReadError,
    ReadTimeoutError,
    ConnectionClosedError,
    FlexibleChecksumError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
    http.client.IncompleteRead,
    ConnectionError,
    TimeoutError,
)

def _backoff(attempt: int) -> None:
    """Sleep before retry number `attempt` (0-based): full jitter, 50 ms doubling, 2 s cap."""
    time.sleep(min(2.0, 0.05 * 2**attempt) * random.random())


class _Truncated(Exception):
    """Internal: the body ended before the bytes the reply promised."""


_RETRY_BODY: tuple[type[BaseException], ...] = (_Truncated, *_BODY_ERRORS)
#: Raw network and protocol errors that escape botocore (and so its retries): an error reply
#: whose body was cut raises urllib3's ProtocolError, for example. Retried by us.
_ESCAPED: tuple[type[BaseException], ...] = tuple(
    e for e in _BODY_ERRORS if not issubclass(e, BotoCoreError))
#: Everything a client call can raise.
_SDK_ERRORS: tuple[type[BaseException], ...] = (ClientError, BotoCoreError, *_ESCAPED)

_CLIENT_LOCK = threading.Lock()
_LOADER: Any = None  # botocore's model loader, shared: parsing the S3 model costs ~150 ms


def _new_client(endpoint_url: str | None, region_name: str | None, config: Config) -> Any:
    """A client of its own botocore session (credentials resolved afresh through the standard
    chain) that shares only the read-only service-model cache with other stores."""
    global _LOADER
    with _CLIENT_LOCK:  # sessions are not thread-safe; client creation is not a hot path
        if _LOADER is None:
            _LOADER = botocore.loaders.create_loader()
        core = botocore.session.Session()
        core.register_component("data_loader", _LOADER)
        session = boto3.session.Session(botocore_session=core, region_name=region_name)
        return session.client("s3", endpoint_url=endpoint_url, config=config)


_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
#: DeleteObjects answered with one of these: the server does not take batch deletes (or the
#: checksum botocore sends with them); single deletes are used instead
_BATCH_REFUSED_CODES = frozenset({"NotImplemented", "MissingContentMD5", "InvalidRequest",
                                  "MethodNotAllowed", "XNotImplemented", "501", "405"})
DELETE_BATCH = 1000  # S3's most keys per DeleteObjects request
DELETE_THREADS = 8
_EXISTS_CODES = frozenset({"PreconditionFailed", "412"})
_CONFLICT_CODES = frozenset({"ConditionalRequestConflict", "409"})
_DENIED_CODES = frozenset(
    {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
     "InvalidToken", "TokenRefreshRequired"}
)


def validate_bucket(bucket: str) -> str:
    """Return `bucket` if it is a valid S3 bucket name, else raise InvalidNameError."""
    ok = (
        isinstance(bucket, str)
        and _BUCKET_RE.fullmatch(bucket) is not None
        and ".." not in bucket
        and ".-" not in bucket
        and "-." not in bucket
        and _IPV4_RE.fullmatch(bucket) is None
    )
    if not ok:
        raise InvalidNameError(
            f"invalid S3 bucket name {bucket!r}: use 3-63 characters from [a-z0-9.-], starting "
            "and ending with a letter or digit, not shaped like an IP address"
        )
    return bucket


def _shown_endpoint(url: str | None) -> str:
    """The endpoint for messages (redacted)."""
    return redact_uri(url) if url else "the default AWS endpoint"


def check_endpoint(url: str) -> str:
    """Return `url` if it is a usable endpoint, http(s)://host[:port][/path], else raise
    InvalidNameError (showing it redacted). User info is refused (credentials come only from
    the standard chain), and so are a query and a fragment (S3 request URLs are built by
    appending to the endpoint; botocore refuses them, quoting the whole URL)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except (ValueError, TypeError):
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidNameError(
            f"endpoint_url must look like http(s)://host[:port], got {_shown_endpoint(url)!r}"
        )
    if parts.username is not None or parts.password is not None:
        raise InvalidNameError(
            f"endpoint_url {_shown_endpoint(url)!r} must not contain credentials; use the "
            "standard AWS credential chain (environment, ~/.aws, instance role)"
        )
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise InvalidNameError(
            f"endpoint_url {_shown_endpoint(url)!r} must not have a query or fragment"
        )
    return url


def _scrub_chain(exc: BaseException) -> None:
    """Redact the URLs in the texts of `exc` and of the exceptions it chains to, in place.
    Our StoreErrors keep the botocore error as their cause (for tracebacks), and its text can
    quote the endpoint or request URL."""
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        node.args = tuple(redact_text(a) if isinstance(a, str) else a for a in node.args)
        node = node.__cause__ or node.__context__


class _BatchRefused(Exception):
    """The server refused a DeleteObjects request as such (not one of its objects)."""


def _error_code(exc: ClientError) -> tuple[str, int | None]:
    response: dict[str, Any] = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, status


def _as_view(data: Buffer) -> memoryview:
    """A flat byte view of `data` without copying (a non-contiguous view is copied once)."""
    view = memoryview(data)
    if not view.contiguous:
        view = memoryview(view.tobytes())
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class _ViewReader(io.RawIOBase):
    """A seekable read-only file over a memoryview, so botocore can send a slice of the
    caller's buffer (it accepts bytes, bytearray or files, not memoryviews) without a
    whole-buffer copy. botocore rewinds it with seek(0) before a retry."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def __len__(self) -> int:
        return len(self._view)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view)
        if size is not None and size >= 0:
            end = min(end, self._pos + size)
        chunk = self._view[self._pos : end].tobytes()
        self._pos = max(self._pos, end)
        return chunk

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def _body(view: memoryview) -> bytes | bytearray | _ViewReader:
    """What to hand botocore as Body: the caller's bytes/bytearray itself when the view covers
    all of it, else a reader over the view. Never a copy of the whole buffer."""
    owner = view.obj
    if isinstance(owner, (bytes, bytearray)) and view.nbytes == len(owner):
        return owner
    if len(view) == 0:
        return b""
    return _ViewReader(view)


def _multipart_etag(parts: list[dict[str, Any]]) -> str:
    """The ETag S3 (and MinIO, moto) gives a completed multipart upload of these parts."""
    digest = hashlib.md5(usedforsecurity=False)
    for part in parts:
        digest.update(bytes.fromhex(part["ETag"].strip('"')))
    return f'"{digest.hexdigest()}-{len(parts)}"'


class S3Store(Store):
    """Objects under ``s3://bucket/prefix``; store key 'a/b' is the S3 key 'prefix/a/b'.

    Thread-safe: one botocore client (thread-safe for requests) is shared by all callers;
    ``max_pool_connections`` should cover every thread that uses the store at once plus
    ``multipart_concurrency`` per concurrent large put.
    """

    #: keys per ListObjectsV2 page (None: the server's default, 1000 on S3); tests lower it
    _list_page_size: int | None = None
    #: whether DeleteObjects may be tried (cleared once the server refused it)
    _batch_deletes: bool = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        max_attempts: int = 5,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 16 * MiB,
        multipart_concurrency: int = 4,
        max_pool_connections: int = 32,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        read_retries: int = 3,
        request_checksum_calculation: str | None = None,
        response_checksum_validation: str | None = None,
        addressing_style: str | None = None,
        in_flight_settle: float = 15.0,
        create: bool = False,
    ) -> None:
        self.bucket = validate_bucket(bucket)
        prefix = prefix.strip("/")
        if prefix and not is_valid_key(prefix):  # never echo the prefix: it may hold a secret
            raise InvalidNameError(
                f"invalid S3 prefix in {redact_uri(f's3://{bucket}/{prefix}')!r}: use "
                "'/'-separated parts of [A-Za-z0-9._-] (no '.' or '..' parts)")
        self.prefix = prefix
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        if endpoint_url is not None:
            check_endpoint(endpoint_url)
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if multipart_chunksize < MIN_PART_SIZE:
            raise ValueError(
                f"multipart_chunksize must be >= {MIN_PART_SIZE} (S3's minimum part size), "
                f"got {multipart_chunksize}"
            )
        if multipart_threshold < 1 or multipart_concurrency < 1 or read_retries < 0:
            raise ValueError("multipart_threshold and multipart_concurrency must be >= 1, "
                             "read_retries >= 0")
        if not in_flight_settle >= 0:  # also refuses NaN
            raise ValueError(f"in_flight_settle must be >= 0 seconds, got {in_flight_settle}")
        self._in_flight_settle = float(in_flight_settle)
        self.multipart_threshold = multipart_threshold
        self.multipart_chunksize = multipart_chunksize
        self.multipart_concurrency = multipart_concurrency
        self.read_retries = read_retries
        self.max_attempts = max_attempts

        config_args: dict[str, Any] = {
            "retries": {"mode": "standard", "total_max_attempts": max_attempts},
            "max_pool_connections": max_pool_connections,
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
            # path style by default on custom endpoints: MinIO and moto expect it
            "s3": {"addressing_style": addressing_style or ("path" if endpoint_url else "auto")},
            "user_agent_extra": "ckptstore",
        }
        if request_checksum_calculation is not None:
            config_args["request_checksum_calculation"] = request_checksum_calculation
        if response_checksum_validation is not None:
            config_args["response_checksum_validation"] = response_checksum_validation
        try:
            self._client = _new_client(endpoint_url, region_name, Config(**config_args))
        except BotoCoreError as exc:
            raise self._error(exc, "open") from exc
        self.endpoint = _shown_endpoint(self._client.meta.endpoint_url)
        self._closed = False
        self._lock = threading.Lock()
        try:
            # also the endpoint botocore found itself ($AWS_ENDPOINT_URL, ~/.aws/config)
            check_endpoint(self._client.meta.endpoint_url)
            self._check_bucket(create)
        except BaseException:
            self._client.close()
            raise

    @property
    def in_flight_settle(self) -> float:
        """A killed client's request can still land: the kernel sends what was queued on its
        socket and the server completes a request it has whole. 15 s by default covers a
        small PUT on a loaded server (see Store.in_flight_settle)."""
        return self._in_flight_settle

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> S3Store:
        """Open ``s3://bucket[/prefix]``. Options are the keyword arguments of the class.

        A missing bucket raises StoreError naming it; ``create=True`` creates it instead (off
        by default: a typo in a bucket name must not create a bucket in your account).
        """
        if not isinstance(uri, str):
            raise InvalidNameError(f"S3 URI must be a string, got {type(uri).__name__}")
        scheme, sep, rest = uri.partition("://")
        if not sep or scheme.lower() != "s3":
            raise InvalidNameError(f"not an S3 URI (s3://bucket/prefix): {redact_uri(uri)!r}")
        bucket, _, prefix = rest.partition("/")
        if "@" in bucket or ":" in bucket:
            # never echo the URI: it may hold a secret
            raise InvalidNameError(
                "S3 URI must be s3://bucket/prefix without user, password or port; "
                "credentials come only from the standard AWS credential chain"
            )
        if "?" in rest or "#" in rest:
            raise InvalidNameError(
                f"S3 URI must not have a query or fragment: {redact_uri(uri)!r}")
        return cls(bucket, prefix, **options)

    # -- plumbing ------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        """The botocore S3 client (for tests that register event handlers, and for tools)."""
        return self._client

    def _key(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _where(self, key: str | None) -> str:
        return f"{self.uri}/{key}" if key is not None else self.uri

    def _error(self, exc: BaseException, action: str, key: str | None = None) -> StoreError:
        """One clear line for a botocore failure. Never includes credentials: only our own
        text, the server's error code and message, and the endpoint, with every URL redacted
        (in `exc` and its chain too, as it becomes our error's cause)."""
        _scrub_chain(exc)
        what = self._where(key)
        if isinstance(exc, ClientError):
            code, status = _error_code(exc)
            if code == "NoSuchBucket":
                return StoreError(
                    f"{action} {what}: bucket {self.bucket!r} does not exist at "
                    f"{getattr(self, 'endpoint', '?')}"
                )
            if code in _NOT_FOUND_CODES or (status == 404 and code not in ("NoSuchUpload",)):
                return ObjectNotFoundError(f"{self.uri}: no object {key!r}")
            message = redact_text(str(exc.response.get("Error", {}).get("Message", ""))
                                  ).splitlines()
            detail = f"{code or status}" + (f" ({message[0]})" if message and message[0] else "")
            if code in _DENIED_CODES or status == 403:
                return StoreError(
                    f"{action} {what}: access denied by {getattr(self, 'endpoint', '?')}: "
                    f"{detail}; check the credentials the standard AWS chain finds"
                )
            return StoreError(f"{action} {what}: S3 error {detail}, HTTP {status}")
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError,
                            CredentialRetrievalError)):
            return StoreError(
                f"{action} {what}: no usable AWS credentials ({type(exc).__name__}); set them "
                "in the environment, ~/.aws/credentials or an instance role"
            )
        if isinstance(exc, (EndpointConnectionError, BotoConnectionError)):
            return StoreError(
                f"{action} {what}: cannot reach S3 endpoint {getattr(self, 'endpoint', '?')} "
                f"({type(exc).__name__}) after {self.max_attempts} attempt(s)"
            )
        if isinstance(exc, (ReadTimeoutError, ConnectionClosedError, ResponseStreamingError)):
            return StoreError(
                f"{action} {what}: connection to {getattr(self, 'endpoint', '?')} failed "
                f"({type(exc).__name__}) after {self.max_attempts} attempt(s)"
            )
        text = redact_text(str(exc))
        first = text.splitlines()[0] if text else ""
        return StoreError(f"{action} {what}: {type(exc).__name__}: {first}")

    def _call(self, action: str, key: str | None, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """One idempotent request (head, delete); network and protocol errors that escape
        botocore (_ESCAPED) are retried here, up to `max_attempts` times with backoff."""
        for attempt in range(self.max_attempts + 1):
            try:
                return fn(Bucket=self.bucket, **kwargs)
            except _ESCAPED as exc:
                if attempt >= self.max_attempts:
                    raise self._error(exc, action, key) from exc
                _backoff(attempt)
            except (ClientError, BotoCoreError) as exc:
                raise self._error(exc, action, key) from exc
        raise AssertionError("unreachable")

    def _check_bucket(self, create: bool) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as exc:
            code, status = _error_code(exc)
            if code in ("403", "AccessDenied") or status == 403:
                return  # may lack s3:ListBucket yet be allowed object access: find out later
            if not (code in ("404", "NoSuchBucket", "NotFound") or status == 404):
                raise self._error(exc, "open") from exc
        except BotoCoreError as exc:
            raise self._error(exc, "open") from exc
        if not create:
            raise BucketNotFoundError(
                f"open {self.uri}: bucket {self.bucket!r} does not exist at {self.endpoint}")
        kwargs: dict[str, Any] = {}
        region = self._client.meta.region_name
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self._client.create_bucket(Bucket=self.bucket, **kwargs)
            logger.info("created bucket %r at %s", self.bucket, self.endpoint)
        except ClientError as exc:
            if _error_code(exc)[0] != "BucketAlreadyOwnedByYou":
                raise self._error(exc, f"create bucket {self.bucket!r} for") from exc
        except BotoCoreError as exc:
            raise self._error(exc, f"create bucket {self.bucket!r} for") from exc

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        data = self._fetch(key, self._key(key), 0, None, None)
        assert data is not None
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        full = self._key(key)
        if length == 0:
            self._check_empty_range(key, full, start)
            return b""
        data = self._fetch(key, full, start, length, None)
        assert data is not None
        return data

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        view = out if out.format == "B" and out.ndim == 1 else out.cast("B")
        check_range(key, start, len(view))
        full = self._key(key)
        if len(view) == 0:
            self._check_empty_range(key, full, start)
            return
        self._fetch(key, full, start, len(view), view)

    def read_into_digest(self, key: str, start: int, out: memoryview) -> str:
        view = out if out.format == "B" and out.ndim == 1 else out.cast("B")
        if len(view) == 0:
            return super().read_into_digest(key, start, view)
        hasher = new_hasher()  # fed each READ_STEP piece as it arrives, while in cache
        check_range(key, start, len(view))
        self._fetch(key, self._key(key), start, len(view), view, hasher)
        return hasher.hexdigest()

    def _check_empty_range(self, key: str, full: str, start: int) -> None:
        """A zero-length read: no impossible 'bytes=a-(a-1)' GET; the key must exist and
        `start` must not lie past its end."""
        size = self._head(key, full)["ContentLength"]
        if start > size:
            raise short_read(key, start, 0, 0)

    def _fetch(
        self, key: str, full: str, start: int, length: int | None, out: memoryview | None,
        hasher: Any = None,
    ) -> bytes | None:
        """GET bytes [start, start+length) (the whole object if length is None).

        Into `out` if given (resuming after a broken body from where it stopped, pinned to the
        first reply's ETag), else returned as bytes. A body that breaks off is retried up to
        `read_retries` times; a reply shorter than asked (range past the end) is a StoreError.
        `hasher` (with `out` only) is updated with exactly the bytes `out` holds when this
        returns, piece by piece as they arrive (reset whenever the read starts over).
        """
        pos = 0  # bytes already in `out`
        etag: str | None = None
        failures = 0
        while True:
            kwargs: dict[str, Any] = {"Key": full}
            if length is not None:
                kwargs["Range"] = f"bytes={start + pos}-{start + length - 1}"
            if etag is not None:
                kwargs["IfMatch"] = etag
            try:
                resp = self._client.get_object(Bucket=self.bucket, **kwargs)
            except ClientError as exc:
                code, status = _error_code(exc)
                if code == "InvalidRange" or status == 416:
                    size = exc.response.get("Error", {}).get("ActualObjectSize")
                    err = short_read(key, start, length or 0, 0)
                    if size is not None:
                        err = ShortReadError(f"{err} (object size {size})")
                    raise err from None
                if etag is not None and (code in _EXISTS_CODES or status == 412):
                    # replaced between our attempts: start over on the new version
                    failures += 1
                    if failures > self.read_retries:
                        _scrub_chain(exc)
                        raise StoreError(
                            f"read {self._where(key)}: object kept changing while being read"
                        ) from exc
                    pos, etag = 0, None
                    if hasher is not None:
                        hasher.reset()
                    continue
                raise self._error(exc, "read", key) from exc
            except BotoCoreError as exc:
                raise self._error(exc, "read", key) from exc
            except _ESCAPED as exc:  # the reply broke before its body: ask again
                failures += 1
                if failures > self.read_retries:
                    raise self._error(exc, "read", key) from exc
                _backoff(failures - 1)
                continue

            body = resp["Body"]
            try:
                want = (length - pos) if length is not None else None
                got_len = resp.get("ContentLength")
                if want is not None and got_len != want:
                    if got_len is not None and got_len < want:
                        raise short_read(key, start, length or 0, pos + got_len)
                    raise StoreError(
                        f"read {self._where(key)}: server sent {got_len} bytes for a "
                        f"{want}-byte range"
                    )
                if length is not None:
                    self._check_content_range(key, resp, start + pos)
                if out is None:
                    data = body.read()  # verifies Content-Length (and checksum when sent)
                    if want is not None and len(data) != want:
                        raise _Truncated()
                    return bytes(data)
                if etag is None:
                    etag = resp.get("ETag")
                while pos < len(out):
                    got = body.readinto(out[pos : pos + min(READ_STEP, len(out) - pos)])
                    if not got:
                        raise _Truncated()
                    if hasher is not None:
                        hasher.update(out[pos : pos + got])
                    pos += got
                if body.read(1):  # also makes botocore verify length and checksum
                    raise StoreError(f"read {self._where(key)}: server sent more than asked")
                return None
            except _RETRY_BODY as exc:
                failures += 1
                if failures > self.read_retries:
                    _scrub_chain(exc)
                    raise StoreError(
                        f"read {self._where(key)}: body broke off {failures} times "
                        f"({type(exc).__name__}); giving up"
                    ) from exc
                logger.debug("retrying broken GET body of %s (%s)", self._where(key),
                             type(exc).__name__)
                if out is None or etag is None:
                    pos = 0
                    if hasher is not None:
                        hasher.reset()
                time.sleep(min(1.0, 0.05 * 2**failures) * random.random())
            finally:
                body.close()

    def _check_content_range(self, key: str, resp: dict[str, Any], first: int) -> None:
        content_range = resp.get("ContentRange")
        if content_range is None:
            if first != 0:
                raise StoreError(f"read {self._where(key)}: server ignored the Range header")
            return
        match = re.match(r"bytes (\d+)-", content_range)
        if match is None or int(match.group(1)) != first:
            raise StoreError(
                f"read {self._where(key)}: server answered range {content_range!r}, "
                f"asked from byte {first}"
            )

    # -- writes --------------------------------------------------------------------------
    def put(self, key: str, data: Buffer) -> None:
        full = self._key(key)
        view = _as_view(data)
        for attempt in range(self.max_attempts + 1):
            try:
                if len(view) >= self.multipart_threshold:
                    self._put_multipart(full, view, conditional=False)
                else:
                    self._client.put_object(Bucket=self.bucket, Key=full, Body=_body(view))
                return
            except _ESCAPED as exc:
                if attempt >= self.max_attempts:
                    raise self._error(exc, "write", key) from exc
                _backoff(attempt)
            except (ClientError, BotoCoreError) as exc:
                raise self._error(exc, "write", key) from exc

    def create(self, key: str, data: Buffer) -> None:
        full = self._key(key)
        view = _as_view(data)
        for attempt in range(self.max_attempts + 1):
            try:
                if len(view) >= self.multipart_threshold:
                    self._put_multipart(full, view, conditional=True)
                else:
                    self._client.put_object(
                        Bucket=self.bucket, Key=full, Body=_body(view), IfNoneMatch="*"
                    )
                return
            except ClientError as exc:
                code, status = _error_code(exc)
                if code in _CONFLICT_CODES or status == 409:
                    # a concurrent conditional write on this key: S3 asks us to try again
                    time.sleep(min(1.0, 0.05 * 2**attempt) * random.random())
                    continue
                if not (code in _EXISTS_CODES or status == 412 or code == "NoSuchUpload"):
                    raise self._error(exc, "create", key) from exc
            except BotoCoreError as exc:
                raise self._error(exc, "create", key) from exc
            except _ESCAPED as exc:
                if attempt >= self.max_attempts:
                    raise self._error(exc, "create", key) from exc
                _backoff(attempt)  # the write may have landed: the next attempt finds out
                continue
            # the key exists: ours from an earlier attempt whose reply was lost, or another's
            same = self._same_content(key, full, view)
            if same is None:
                continue  # deleted in between: try again
            if same:
                return
            raise ObjectExistsError(f"{self.uri}: {key!r} exists with other content")
        raise StoreError(f"create {self._where(key)}: kept conflicting with other writers")

    def _same_content(self, key: str, full: str, view: memoryview) -> bool | None:
        """True if the object holds exactly `view`, False if other bytes, None if missing."""
        try:
            info = self._head(key, full)
        except ObjectNotFoundError:
            return None
        if info["ContentLength"] != len(view):
            return False
        try:
            existing = self.get(key)
        except ObjectNotFoundError:
            return None
        return existing == view

    def _put_multipart(self, full: str, view: memoryview, *, conditional: bool) -> None:
        """Multipart upload of `view`; parts in parallel; aborted on any failure. Raises
        botocore errors untranslated (the caller knows what the operation was)."""
        size = len(view)
        part_size = max(self.multipart_chunksize, math.ceil(size / MAX_PARTS))
        started = self._client.create_multipart_upload(Bucket=self.bucket, Key=full)
        upload_id = started.get("UploadId")
        if not upload_id:
            raise StoreError(f"write {self.uri}: CreateMultipartUpload reply had no UploadId")
        try:
            parts = self._upload_parts(full, upload_id, view, part_size)
            kwargs: dict[str, Any] = {"IfNoneMatch": "*"} if conditional else {}
            try:
                done = self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id,
                    MultipartUpload={"Parts": parts}, **kwargs,
                )
            except ClientError as exc:
                if _error_code(exc)[0] != "NoSuchUpload" or not self._landed(full, parts):
                    raise
                # an earlier attempt of this Complete landed and its reply was lost
                done = {"ETag": _multipart_etag(parts)}
            if not done.get("ETag") and not self._landed(full, parts):
                raise StoreError(
                    f"write {self.uri}: CompleteMultipartUpload reply was empty and the "
                    "object is not there"
                )
        except BaseException:
            self._abort(full, upload_id)
            raise

    def _upload_parts(
        self, full: str, upload_id: str, view: memoryview, part_size: int
    ) -> list[dict[str, Any]]:
        spans = [
            (number, offset, min(offset + part_size, len(view)))
            for number, offset in enumerate(range(0, len(view), part_size), start=1)
        ]

        def send(number: int, lo: int, hi: int) -> dict[str, Any]:
            reply = self._client.upload_part(
                Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number,
                Body=_ViewReader(view[lo:hi]),
            )
            etag = reply.get("ETag")
            if not etag:
                raise StoreError(f"write {self.uri}: UploadPart {number} reply had no ETag")
            return {"ETag": etag, "PartNumber": number}

        workers = min(self.multipart_concurrency, len(spans))
        pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="ckptstore-s3-part")
        try:
            futures = [pool.submit(send, *span) for span in spans]
            done, _ = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
            for future in done:
                failure = future.exception()
                if failure is not None:
                    raise failure
            return [future.result() for future in futures]
        finally:
            # on failure: drop queued parts, wait for those in flight, so the abort is final
            pool.shutdown(wait=True, cancel_futures=True)

    def _landed(self, full: str, parts: list[dict[str, Any]]) -> bool:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=full)
        except _SDK_ERRORS:
            return False
        return bool(head.get("ETag") == _multipart_etag(parts))

    def _abort(self, full: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except ClientError as exc:
            if _error_code(exc)[0] == "NoSuchUpload":
                return
            logger.warning("could not abort multipart upload of s3://%s/%s: %s (a bucket "
                           "lifecycle rule for incomplete uploads would remove it)",
                           self.bucket, full, _error_code(exc)[0])
        except BotoCoreError as exc:
            logger.warning("could not abort multipart upload of s3://%s/%s: %s", self.bucket,
                           full, type(exc).__name__)

    def delete(self, key: str) -> None:
        self._call("delete", key, self._client.delete_object, Key=self._key(key))

    def delete_many(self, keys: Iterable[str]) -> None:
        """Up to DELETE_BATCH keys per DeleteObjects request. A server that refuses that
        request (some S3 servers lack it, or want a checksum botocore does not send them)
        gets single deletes instead, DELETE_THREADS at a time, for the rest of this store's
        life. On an error the others are still tried, then the first error is raised."""
        todo = list(dict.fromkeys(keys))
        first: BaseException | None = None
        for i in range(0, len(todo), DELETE_BATCH):
            batch = todo[i:i + DELETE_BATCH]
            try:
                if self._batch_deletes and len(batch) > 1:
                    try:
                        self._delete_batch(batch)
                        continue
                    except _BatchRefused as exc:
                        logger.info("%s: DeleteObjects refused (%s): deleting one object "
                                    "per request", self.uri, exc)
                        self._batch_deletes = False
                self._delete_each(batch)
            except StoreError as exc:
                first = first or exc
        if first is not None:
            raise first

    def _delete_batch(self, keys: list[str]) -> None:
        """One DeleteObjects request; StoreError naming the keys it did not delete."""
        objects = [{"Key": self._key(k)} for k in keys]
        try:
            reply = self._call("delete", None, self._client.delete_objects,
                               Delete={"Objects": objects, "Quiet": True})
        except StoreError as exc:
            cause = exc.__cause__
            code = _error_code(cause)[0] if isinstance(cause, ClientError) else ""
            if code in _BATCH_REFUSED_CODES:
                raise _BatchRefused(code) from None
            raise
        failed = [e for e in reply.get("Errors", ()) if e.get("Code") not in _NOT_FOUND_CODES]
        if failed:
            base = f"{self.prefix}/" if self.prefix else ""
            e = failed[0]
            key = str(e.get("Key", ""))[len(base):]
            code, message = e.get("Code", "?"), redact_text(str(e.get("Message", "")))
            raise StoreError(f"delete {self._where(key)}: S3 error {code} ({message}); "
                             f"{len(failed)} of {len(keys)} objects of the request were not "
                             "deleted")

    def _delete_each(self, keys: list[str]) -> None:
        """`delete` of every key, DELETE_THREADS at a time; the first error once all ran."""
        with cf.ThreadPoolExecutor(min(DELETE_THREADS, len(keys)) or 1,
                                   thread_name_prefix="ckptstore-delete") as pool:
            errors = [f.exception() for f in [pool.submit(self.delete, k) for k in keys]]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    # -- metadata ------------------------------------------------------------------------
    def _head(self, key: str, full: str) -> dict[str, Any]:
        head: dict[str, Any] = self._call("stat", key, self._client.head_object, Key=full)
        return head

    def exists(self, key: str) -> bool:
        try:
            self._head(key, self._key(key))
        except ObjectNotFoundError:
            return False
        return True

    def stat(self, key: str) -> ObjectInfo:
        head = self._head(key, self._key(key))
        return ObjectInfo(key, int(head["ContentLength"]), head["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        paginator = self._client.get_paginator("list_objects_v2")
        paging = {"PageSize": self._list_page_size} if self._list_page_size else {}
        try:
            pages = paginator.paginate(
                Bucket=self.bucket, Prefix=base + prefix, PaginationConfig=paging
            )
            for page in pages:
                if "IsTruncated" not in page:
                    # a reply cut short parses as an empty success: never trust it
                    raise StoreError(f"list {self.uri}: malformed listing reply from "
                                     f"{self.endpoint}")
                for item in page.get("Contents", ()):
                    key = item["Key"][len(base):]
                    try:
                        validate_key(key)
                    except InvalidNameError:
                        continue  # a foreign object (e.g. a console "folder/") we never wrote
                    yield ObjectInfo(key, int(item["Size"]), item["LastModified"].timestamp())
        except _SDK_ERRORS as exc:
            raise self._error(exc, "list", prefix or None) from exc

    def temp_files(self) -> Iterator[ObjectInfo]:
        """Incomplete multipart uploads under this store's prefix begun more than
        ABANDONED_UPLOAD_AGE ago (this host's clock), for gc: named `<key>#upload=<id>`, size
        0 (a listing of uploads gives none), mtime when begun. Their parts are billed storage
        nothing would ever remove; a failed put aborts its own, these are the rest. (gc runs
        under its lease, while no save of this repository writes; the age guards against
        other writers. moto reports every upload as begun in 2010.)"""
        base = f"{self.prefix}/" if self.prefix else ""
        oldest = time.time() - ABANDONED_UPLOAD_AGE
        paginator = self._client.get_paginator("list_multipart_uploads")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base):
                for upload in page.get("Uploads", ()):
                    key = upload["Key"][len(base):]
                    begun = upload["Initiated"].timestamp()
                    if is_valid_key(key) and begun < oldest:
                        yield ObjectInfo(f"{key}{_UPLOAD_MARK}{upload['UploadId']}", 0, begun)
        except _SDK_ERRORS as exc:
            raise self._error(exc, "list multipart uploads", None) from exc

    def delete_temp(self, name: str) -> None:
        """Abort the upload `name` from `temp_files`."""
        key, mark, upload_id = name.partition(_UPLOAD_MARK)
        if not mark or not upload_id or not is_valid_key(key):
            raise StoreError(f"not an upload of this store: {name!r}")
        self._abort(self._key(key), upload_id)

    def sync(self) -> None:
        """Nothing to do: S3 acknowledges a write once it is durable."""

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()

    def __enter__(self) -> S3Store:
        return self

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r}, endpoint={self.endpoint!r})"
