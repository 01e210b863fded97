"""The request fingerprint: what makes a retry "the same request".

A fingerprint is the SHA-256 of the method, the path with its query string, and the body. A
JSON body (``Content-Type: application/json`` or any ``+json`` type) is canonicalised first, so
key order and whitespace do not matter: the body is parsed and dumped again with sorted keys,
no whitespace and UTF-8 text. A JSON body that does not parse, or cannot be dumped again (a lone
surrogate such as ``"\\ud800"`` is kept as it is; 100,000 nested ``[`` exceed the recursion
limit), is hashed as the raw bytes it is, as is any other body.

A form (``application/x-www-form-urlencoded``) or multipart (``multipart/form-data``) POST is
fingerprinted from its parsed fields and files, :func:`canonical_form`: CSRF protection or DRF's
``SessionAuthentication`` has often read ``request.POST`` already, and the raw body is then gone.
The fields are taken in name order (``a=1&b=2`` and ``b=2&a=1`` are the same request), and each
file stands for its field name, file name, size and SHA-256, so that a retry with a new multipart
boundary, as browsers send, is the same request.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

FORM_MEDIA_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data"})
#: Prefixes a canonical form, so that no raw body can stand for the same bytes.
FORM_TAG = b"form\x00"
#: Prefixes a body DRF parsed before the fingerprint could read it.
PARSED_TAG = b"parsed\x00"
#: Fields left out of a form's fingerprint: Django's CSRF token is masked afresh on every page
#: render, so a resubmitted form carries a new one for the same command.
IGNORED_FIELDS = frozenset({"csrfmiddlewaretoken"})
_CHUNK = 64 * 1024


class UploadedFile(Protocol):
    name: str | None
    size: int | None

    def chunks(self, chunk_size: int | None = None) -> Iterable[bytes]: ...

    def seek(self, offset: int, whence: int = 0) -> Any: ...


def is_json(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` header value names a JSON media type."""
    if not content_type:
        return False
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def is_form(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` header value names a form or multipart media type."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() in FORM_MEDIA_TYPES


def canonical_json(body: bytes) -> bytes | None:
    """``body`` as canonical JSON bytes, or None when it is not valid UTF-8 JSON or cannot be
    written again (nested too deep for the recursion limit)."""
    try:
        document = json.loads(body.decode("utf-8"))
        text = json.dumps(
            document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True
        )
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    # "surrogatepass": a lone surrogate ("\ud800") is valid JSON but not encodable UTF-8.
    return text.encode("utf-8", "surrogatepass")


def canonical_form(fields: Mapping[str, Any], files: Mapping[str, Any] | None = None) -> bytes:
    """The bytes that stand for a parsed form: fields and files, each in name order.

    ``fields`` and ``files`` are Django ``QueryDict``/``MultiValueDict`` objects (or plain dicts
    of lists). Values of one name keep their order, since ``getlist()`` sees it. Files are read
    in chunks for their SHA-256 and rewound for the view. Django's CSRF token field
    (:data:`IGNORED_FIELDS`) is left out: it changes with every page render.
    """
    described: dict[str, list[Any]] = {"fields": [], "files": []}
    for name in sorted(set(fields) - IGNORED_FIELDS):
        described["fields"].append([name, _values(fields, name)])
    for name in sorted(files or {}):
        uploads = [_describe_file(upload) for upload in _values(files or {}, name)]
        described["files"].append([name, uploads])
    text = json.dumps(described, separators=(",", ":"), ensure_ascii=True, default=str)
    return FORM_TAG + text.encode("ascii")


def canonical_data(data: Any, files: Mapping[str, Any] | None = None) -> bytes:
    """The bytes that stand for a body DRF has already parsed (its parser read the stream, so
    the raw body is gone): a form as :func:`canonical_form`, anything else as sorted JSON."""
    if hasattr(data, "getlist"):
        return canonical_form(data, files)
    try:
        text = json.dumps(
            data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str
        )
    except (TypeError, ValueError, RecursionError):
        text = repr(data)
    return PARSED_TAG + text.encode("utf-8", "surrogatepass")


def _values(mapping: Mapping[str, Any], name: str) -> list[Any]:
    getlist = getattr(mapping, "getlist", None)
    values = getlist(name) if getlist is not None else mapping[name]
    return list(values) if isinstance(values, (list, tuple)) else [values]


def _describe_file(upload: UploadedFile) -> list[Any]:
    digest = hashlib.sha256()
    size = 0
    upload.seek(0)
    for chunk in upload.chunks(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    upload.seek(0)
    return [upload.name or "", size, digest.hexdigest()]


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
        method.upper().encode("ascii", "replace"),
        path.encode("utf-8", "surrogatepass"),
        canonical_body(body, content_type),
    ):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()
