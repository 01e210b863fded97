"""Assertions for the tests of a project that uses django-idempotency (docs/testing.md).

Each makes one line of what a test of an idempotent view checks again and again: that a retry
was a replay of the first answer, and that an error is the problem document it should be. They
work with Django's test client, DRF's ``APIClient``, or any response with ``status_code``,
headers and ``content``, and raise ``AssertionError`` with a message that shows what came back.
They use no private API and touch no database, so they run under any test runner.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Protocol

from django_idempotency.conf import conf
from django_idempotency.exceptions import PROBLEM_CONTENT_TYPE

REPLAYED_HEADER = "Idempotent-Replayed"


class Response(Protocol):
    status_code: int
    content: bytes

    def get(self, header: str, default: str | None = None) -> str | None: ...


class Client(Protocol):
    def generic(self, method: str, path: str, data: Any = ..., **extra: Any) -> Any: ...


def _shown(response: Response) -> str:
    body = response.content[:500].decode("utf-8", "replace")
    return f"{response.status_code} {response.get('Content-Type')!r}: {body}"


def assert_replayed(response: Response, first: Response | None = None) -> None:
    """``response`` is a replay (``Idempotent-Replayed: true``); with ``first``, of that answer:
    the same status and the same body."""
    if response.get(REPLAYED_HEADER) != "true":
        raise AssertionError(f"not a replay (no {REPLAYED_HEADER}: true): {_shown(response)}")
    if first is not None and (first.status_code, first.content) != (
        response.status_code,
        response.content,
    ):
        raise AssertionError(
            f"the replay differs from the first answer:\n  first:  {_shown(first)}\n"
            f"  replay: {_shown(response)}"
        )


def assert_not_replayed(response: Response) -> None:
    """``response`` came from the view itself, not from a stored answer."""
    if response.get(REPLAYED_HEADER) is not None:
        raise AssertionError(f"a replay, where the view should have run: {_shown(response)}")


def assert_problem(response: Response, slug: str, status: int | None = None) -> dict[str, Any]:
    """``response`` is the problem document ``slug`` (``"key-reused"``, ``"in-progress"``...,
    see docs/problems.md), with ``status`` if given; returns its body."""
    content_type = (response.get("Content-Type") or "").split(";")[0].strip()
    if content_type != PROBLEM_CONTENT_TYPE:
        raise AssertionError(f"not {PROBLEM_CONTENT_TYPE}: {_shown(response)}")
    body: dict[str, Any] = json.loads(response.content)
    expected = conf.PROBLEM_TYPE_BASE + slug
    if body.get("type") != expected:
        raise AssertionError(f"type {body.get('type')!r}, not {expected!r}: {_shown(response)}")
    if status is not None and (response.status_code, body.get("status")) != (status, status):
        raise AssertionError(f"status {response.status_code}, not {status}: {_shown(response)}")
    return body


def send_twice(
    client: Client,
    path: str,
    data: Any = None,
    *,
    key: str | None = None,
    method: str = "POST",
    content_type: str = "application/json",
    **extra: Any,
) -> tuple[Any, Any]:
    """Send one request twice with one idempotency key (a new UUID unless ``key``); check that
    the first ran the view and the second replayed its answer; return both responses.

    ``data`` that is not ``str`` or ``bytes`` is sent as JSON. ``extra`` goes to the client as
    it is (``headers={...}``, ``HTTP_AUTHORIZATION=...``).
    """
    key = key if key is not None else str(uuid.uuid4())
    body = data if isinstance(data, (str, bytes)) or data is None else json.dumps(data)
    headers = {**extra.pop("headers", {}), conf.HEADER: key}
    first = client.generic(
        method, path, body or "", content_type=content_type, headers=headers, **extra
    )
    assert_not_replayed(first)
    retry = client.generic(
        method, path, body or "", content_type=content_type, headers=headers, **extra
    )
    assert_replayed(retry, first)
    return first, retry
