"""Errors raised by django-idempotency.

HTTP-facing errors derive from :class:`ProblemError`. Each carries its status and renders as an
``application/problem+json`` body (RFC 9457).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from django.conf import settings
from django.http import HttpResponse

PROBLEM_CONTENT_TYPE = "application/problem+json"
#: The default of ``IDEMPOTENCY["PROBLEM_TYPE_BASE"]``: the problem types' page of the docs.
PROBLEM_TYPE_BASE = "https://django-idempotency.readthedocs.io/en/latest/problems/#"


def problem_type_base() -> str:
    """``IDEMPOTENCY["PROBLEM_TYPE_BASE"]``, read here rather than through ``conf``: this module
    sits below ``conf`` (``conf`` validates the value and the system checks report a bad one),
    and a problem is rare enough that reading the setting each time costs nothing."""
    configured = getattr(settings, "IDEMPOTENCY", None) or {}
    value = configured.get("PROBLEM_TYPE_BASE", PROBLEM_TYPE_BASE)
    return value if isinstance(value, str) else PROBLEM_TYPE_BASE


class IdempotencyError(Exception):
    """Base class of every error this app raises."""


class ProblemError(IdempotencyError):
    """An error answered to the client as ``application/problem+json``."""

    status: ClassVar[int] = 400
    slug: ClassVar[str] = "bad-request"
    title: ClassVar[str] = "Bad request"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra

    @property
    def type(self) -> str:
        return problem_type_base() + self.slug

    def headers(self) -> dict[str, str]:
        return {}

    def as_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": self.type,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        body.update(self.extra)
        return body

    def as_response(self) -> HttpResponse:
        response = HttpResponse(
            json.dumps(self.as_dict()),
            status=self.status,
            content_type=PROBLEM_CONTENT_TYPE,
        )
        for name, value in self.headers().items():
            response[name] = value
        return response


class MissingKey(ProblemError):
    status = 400
    slug = "missing-key"
    title = "Idempotency key required"


class MalformedKey(ProblemError):
    status = 400
    slug = "malformed-key"
    title = "Malformed idempotency key"


class KeyReused(ProblemError):
    status = 422
    slug = "key-reused"
    title = "Idempotency key reused for a different request"


class RequestInProgress(ProblemError):
    status = 409
    slug = "in-progress"
    title = "A request with this idempotency key is in progress"

    def __init__(self, detail: str, *, retry_after: int, **extra: Any) -> None:
        super().__init__(detail, **extra)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class DatabaseUnavailable(ProblemError):
    """The database could not be reached (or, on MariaDB, stayed busy) when the key was claimed.

    503 with ``Retry-After``: nothing ran and nothing was recorded, so a retry with the same key
    is safe and, once the database answers again, runs the request or replays its answer.
    """

    status = 503
    slug = "database-unavailable"
    title = "The database is unavailable"

    def __init__(self, detail: str, *, retry_after: int, **extra: Any) -> None:
        super().__init__(detail, **extra)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class ResponseNotStored(ProblemError):
    """The first request ran, but its response could not be stored for replay.

    422, not 409: clients and SDKs (Stripe's, for one) retry every 409 with backoff, and a retry
    can never succeed here. 409 stays reserved for :class:`RequestInProgress`.
    """

    status = 422
    slug = "response-not-stored"
    title = "The request was already processed; its response was not stored"


class ResponseUndecryptable(ProblemError):
    """The first request ran and its response was stored encrypted, but no key in
    ``ENCRYPTION_KEYS`` opens it (its key was removed): it cannot be replayed, and the view does
    not run again. One ``ERROR`` line names the record and the key id.

    422, as :class:`ResponseNotStored`: the effect is done and no retry can change the answer.
    """

    status = 422
    slug = "response-undecryptable"
    title = "The request was already processed; its stored response cannot be decrypted"


class ResponseErased(ProblemError):
    """The first request ran, and its stored response was erased since (an erasure request,
    ``idempotency_erase``). The key stays taken until the record expires: the view does not run
    again."""

    status = 410
    slug = "response-erased"
    title = "The request was already processed; its stored response was erased"


class StaleClaim(IdempotencyError):
    """A holder tried to complete or release a record it no longer owns."""


class MissingEventId(IdempotencyError, ValueError):
    """A message reached a consumer without an event id."""


class InvalidEventId(MissingEventId, TypeError):
    """A message carries an event id that cannot be stored: not a str, UUID or int, blank,
    longer than the column, or with a NUL or a lone surrogate (which no database driver sends).

    A :class:`MissingEventId`, so every consumer loop handles it as a message without an id:
    parked or dead-lettered, never retried, since no retry can store it. Also a
    :exc:`TypeError`, which :func:`~django_idempotency.events.ids.normalize_event_id` raised for
    an id of the wrong type before this class existed.
    """


class EventParked(IdempotencyError):
    """An event was delivered more than ``MAX_DELIVERIES`` times and was parked."""


class OnCommitFailed(IdempotencyError):
    """A consumer's transaction committed, then one of its ``on_commit`` callbacks raised.

    The event is applied and recorded, so a redelivery is skipped as a duplicate: the callback's
    work is not retried by redelivering. The original error is the ``__cause__``.
    """


ERROR_TEXT_CHARS = 2000
"""The most characters of an error that a ``last_error`` column keeps."""


def error_text(error: BaseException, limit: int = ERROR_TEXT_CHARS) -> str:
    """``error`` as a ``last_error`` column keeps it (a counter, an outbox message, a flow run):
    ``"Type: message"``, cut to ``limit`` characters, in text every database stores. A NUL
    (which PostgreSQL's text columns refuse) and a lone surrogate (which is not UTF-8, so no
    driver can send it) are written as backslash escapes. Left in, they made the write that
    keeps the error fail, and with it the transaction around it."""
    text = f"{type(error).__name__}: {error}".replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")[:limit]


_CONTROL = {code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F)} | {
    0x85: "\\x85",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def log_text(value: object, limit: int = 500) -> str:
    """``value`` (a path, an event id, a key, a destination: anything from outside) as a log
    line may carry it: control characters (a newline, a carriage return, ESC, a NUL) and lone
    surrogates are written as backslash escapes, and the text is cut to ``limit`` characters.
    Logged raw, ``%0A`` in a path or an ESC sequence in an event id would forge log lines or
    rewrite a terminal, as in Django's own request logging before CVE-2025-48432."""
    text = (
        value
        if isinstance(value, str)
        else repr(value)
        if isinstance(value, bytes)
        else str(value)
    )
    text = text[:limit].translate(_CONTROL)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
