"""Parse and validate the ``Idempotency-Key`` request header.

The IETF draft (draft-ietf-httpapi-idempotency-key-header) defines the header as an RFC 8941
structured-field string, ``Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"``. Older
clients send a bare token, ``Idempotency-Key: 8e03978e-...``. Both spellings are accepted and
mean the same key.

A key is valid when it is not empty, is at most ``MAX_KEY_LENGTH`` characters long, and holds
only visible ASCII characters (``!`` to ``~``; no spaces, no control characters, nothing
outside ASCII) other than a comma. Anything else raises
:class:`~django_idempotency.exceptions.MalformedKey`.

A bare key may not contain a comma: servers join a repeated header with commas (gunicorn and
Django's ASGI handler do), so ``same`` sent twice arrives as ``same,same``. Taking that for a new
key would run the command again, so it is malformed, as the quoted form ``"a", "b"`` already is.
A quoted key may hold a comma (``"a,b"``), since the quotes show where it ends.
"""

from __future__ import annotations

import re

from django_idempotency.exceptions import MalformedKey

VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")
# RFC 8941 section 3.3.3: a string is DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE,
# where unescaped is any printable ASCII character (space included) except DQUOTE and "\".
SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
SF_ESCAPE = re.compile(r'\\(["\\])')


def parse_key(value: str, max_length: int) -> str:
    """Return the key carried by a header value, or raise :class:`MalformedKey`.

    ``value`` is the raw header value; surrounding spaces and tabs are ignored, as HTTP does.
    """
    value = value.strip(" \t")
    if value.startswith('"'):
        match = SF_STRING.fullmatch(value)
        if match is None:
            raise MalformedKey(
                "The idempotency key starts with a double quote but is not a valid structured-"
                'field string: use "..." with only \\" and \\\\ as escapes.'
            )
        key = SF_ESCAPE.sub(r"\1", match.group(1))
    else:
        if "," in value:
            raise MalformedKey(
                "The idempotency key holds a comma: the header was sent more than once (servers "
                "join repeated headers with commas) or the key is not quoted. Send exactly one "
                'Idempotency-Key header; quote a key that contains a comma ("a,b").'
            )
        key = value
    if not key:
        raise MalformedKey("The idempotency key is empty.")
    if len(key) > max_length:
        raise MalformedKey(f"The idempotency key is longer than {max_length} characters.")
    if not VISIBLE_ASCII.fullmatch(key):
        raise MalformedKey(
            "The idempotency key may only contain visible ASCII characters (no spaces, control "
            "characters or non-ASCII letters). A UUID is a good key."
        )
    return key


def serialize_key(key: str) -> str:
    """The structured-field string form of ``key``, as a client following the draft sends it."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
