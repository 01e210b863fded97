"""The benchmark's own middleware: a statement counter and a fixed, already-loaded user."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AnonymousUser
from django.db import connections
from django.http import HttpRequest, HttpResponse
from rest_framework.authentication import BaseAuthentication
from rest_framework.request import Request

STATEMENTS_HEADER = "X-Bench-Statements"
BENCH_USERNAME = "bench"
BENCH_AUTHORIZATION = "Bearer bench"


class StatementCounter:
    """Counts the statements sent through Django's cursors, and the commits.

    It is an ``execute_wrapper``. ``BEGIN`` is not a statement here (the driver sends it before
    the first statement of a transaction), and ``COMMIT`` is counted apart, in ``commits``: a
    transaction costs those two round trips on top of its statements. Savepoints are
    statements, since Django executes them through a cursor.
    """

    def __init__(self) -> None:
        self.count = 0
        self.commits = 0

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        self.count += 1
        return execute(sql, params, many, context)

    @contextmanager
    def counting(self, alias: str = "default") -> Iterator[StatementCounter]:
        connection = connections[alias]
        commit = connection.commit

        def counted_commit() -> None:
            self.commits += 1
            commit()

        connection.commit = counted_commit  # type: ignore[method-assign]
        try:
            with connection.execute_wrapper(self):
                yield self
        finally:
            del connection.commit

    @property
    def header(self) -> str:
        return f"{self.count}/{self.commits}"


class StatementCountMiddleware:
    """Reports ``statements/commits`` of each request in ``X-Bench-Statements``."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        with StatementCounter().counting() as counter:
            response = self.get_response(request)
        response[STATEMENTS_HEADER] = counter.header
        return response


_user: Any = None


def bench_user() -> Any:
    """The benchmark user, loaded once per process (an authenticated user costs no query)."""
    global _user
    if _user is None:
        _user = get_user_model().objects.get(username=BENCH_USERNAME)
    return _user


class BenchUserMiddleware:
    """Stands in for authentication: ``Authorization: Bearer bench`` is the benchmark user.

    Real authentication (a session or token lookup) costs the same for every variant, so the
    benchmark leaves it out. drf-idempotencykey only protects authenticated requests, and the
    app scopes keys by user, so every request is authenticated.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.META.get("HTTP_AUTHORIZATION") == BENCH_AUTHORIZATION:
            request.user = bench_user()
        else:
            request.user = AnonymousUser()
        return self.get_response(request)


class BenchAuthentication(BaseAuthentication):
    """DRF's view of the same user (SessionAuthentication would also enforce CSRF)."""

    def authenticate(self, request: Request) -> tuple[Any, None] | None:
        user = getattr(request._request, "user", None)
        if user is not None and user.is_authenticated:
            return (user, None)
        return None
