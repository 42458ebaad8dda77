"""Redaction of secrets from URIs before they are shown (messages, reprs, CLI output, logs).

One rule, `redact_uri`: in ``scheme://[userinfo@]host[:port]/path[?query][#fragment]`` the user
info becomes ``***@``, a query string ``?<redacted>`` and a fragment ``#<redacted>`` (presigned
URLs and SAS tokens carry their signature there); scheme, host, port and path are kept. A
string without ``://`` is a file system path and is returned unchanged. `redact_text`
applies the same rule to every URL inside a longer text (e.g. a botocore message).
"""

from __future__ import annotations

import os
import re

_SCHEME_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
# a URL inside free text: the whole token around '://' (up to whitespace, a quote or an angle
# or back quote), so text glued before the scheme is redacted too; a marker of ours is taken
# with it, so that redacting twice changes nothing
_URL_IN_TEXT_RE = re.compile(r"[^\s'\"`<>]*://[^\s'\"`<>]*(?:<redacted>)?")


def has_scheme(uri: str) -> bool:
    """True if `uri` starts with a valid ``scheme://`` (a URL rather than a file path)."""
    scheme, sep, _ = uri.partition("://")
    return bool(sep) and _SCHEME_NAME_RE.fullmatch(scheme) is not None


def redact_uri(uri: object) -> str:
    """`uri` fit to show: user info, query and fragment redacted (see the module doc).

    The user info ends at the last '@' before the query, so a password holding a raw '/' or
    ':' is still hidden (a path containing '@' is over-redacted, which is safe). Text before a
    '://' that is not a valid scheme is shown as '***'. Anything that is not a str or path is
    shown only by its type name.
    """
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str):
        return f"<{type(uri).__name__}>"
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    if _SCHEME_NAME_RE.fullmatch(scheme) is None:
        scheme = "***"
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    head, tail = rest[:cut], rest[cut:]
    if "@" in head:
        head = "***@" + head.rpartition("@")[2]
    if tail:
        tail = "?<redacted>" if tail.startswith("?") else "#<redacted>"
    return f"{scheme}://{head}{tail}"


def redact_text(text: str) -> str:
    """`text` with every URL in it passed through `redact_uri`."""
    return _URL_IN_TEXT_RE.sub(lambda m: redact_uri(m.group()), text)
