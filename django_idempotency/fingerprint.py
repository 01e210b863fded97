"""The request fingerprint: what makes a retry "the same request".

A fingerprint is the SHA-256 of the method, the path with its query string, and the body. A
JSON body (``Content-Type: application/json`` or any ``+json`` type) is canonicalised first, so
key order and whitespace do not matter: the body is parsed and dumped again with sorted keys,
no whitespace and UTF-8 text. Any other body, or a JSON body that does not parse, is hashed as
the raw bytes it is.
"""

from __future__ import annotations

import hashlib
import json


def is_json(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` header value names a JSON media type."""
    if not content_type:
        return False
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def canonical_json(body: bytes) -> bytes | None:
    """``body`` as canonical JSON bytes, or None when it is not valid UTF-8 JSON."""
    try:
        document = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return json.dumps(
        document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True
    ).encode("utf-8")


def canonical_body(body: bytes, content_type: str | None) -> bytes:
    """The bytes that stand for ``body`` in a fingerprint."""
    if is_json(content_type):
        canonical = canonical_json(body)
        if canonical is not None:
            return canonical
    return body


def fingerprint(method: str, path: str, body: bytes, content_type: str | None = None) -> str:
    """The hex SHA-256 fingerprint of a request.

    ``path`` includes the query string (``request.get_full_path()``). Each part is
    length-prefixed, so no two different requests can hash the same bytes.
    """
    digest = hashlib.sha256()
    for part in (
        method.upper().encode("ascii"),
        path.encode("utf-8"),
        canonical_body(body, content_type),
    ):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()
