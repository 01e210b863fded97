"""The Django side of the core, shared by :func:`~django_idempotency.idempotent` and
:class:`~django_idempotency.http.middleware.IdempotencyMiddleware`.

It turns an ``HttpRequest`` (or a DRF ``Request``) into a :class:`~django_idempotency.http.core.
Command`, a view's ``HttpResponse`` into a :class:`~django_idempotency.http.core.Captured`, and a
:class:`~django_idempotency.http.core.Replay` back into an ``HttpResponse``. All decisions are the
core's.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache, partial
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.http import HttpRequest, HttpResponse
from django.http.request import HttpHeaders, RawPostDataException
from django.http.response import HttpResponseBase
from django.template.response import SimpleTemplateResponse

from django_idempotency import telemetry
from django_idempotency.conf import MAX_DURATION, MAX_SECONDS, SAFE_METHODS, conf
from django_idempotency.exceptions import MissingKey, ProblemError
from django_idempotency.http.core import Captured, Command, Idempotency, Policy, Replay
from django_idempotency.http.fingerprint import (
    canonical_data,
    canonical_form,
    fingerprint,
    is_form,
)
from django_idempotency.http.keys import parse_key
from django_idempotency.http.owner import resolve_owner

#: The attribute set on decorated views; the middleware leaves such views to the decorator.
OPTIONS_ATTRIBUTE = "idempotent_options"
#: Set on the ``HttpRequest`` once a request has been handled, so that the decorator does not
#: handle it a second time inside the middleware.
HANDLED = "_idempotency_handled"
#: Headers replayed for every response; ``REPLAY_HEADERS`` adds to these. They describe the
#: stored bytes (a gzip body without ``Content-Encoding`` is corrupt for the client), how they
#: are shown or saved, and how they may be cached: without ``Cache-Control: no-store`` a replay
#: that carries personal data could be kept by a shared cache. ``Allow`` belongs to a stored
#: ``405``, which must carry it (RFC 9110, section 15.5.6).
ALWAYS_REPLAYED = (
    "Content-Type",
    "Location",
    "Allow",
    "Content-Encoding",
    "Content-Language",
    "Content-Disposition",
    "Content-Location",
    "Content-Range",
    "Cache-Control",
    "Expires",
    "Pragma",
    "Vary",
)
#: Headers never replayed, even when listed in ``REPLAY_HEADERS``: cookies belong to the client
#: that received them, and hop-by-hop or length headers describe one transfer.
NEVER_REPLAYED = frozenset(
    {
        "set-cookie",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "idempotent-replayed",
    }
)


@dataclass(frozen=True)
class Options:
    """What ``@idempotent(...)`` was given. Settings are read per request, never here."""

    required: bool = False
    ttl: timedelta | None = None
    methods: frozenset[str] | None = None
    atomic: bool = True
    lease: timedelta | None = None

    @classmethod
    def build(
        cls,
        *,
        required: bool = False,
        ttl: timedelta | float | None = None,
        methods: Iterable[str] | None = None,
        atomic: bool = True,
        lease: timedelta | float | None = None,
    ) -> Options:
        if lease is not None and atomic:
            raise ImproperlyConfigured(
                "@idempotent(lease=...) only applies in lease mode: pass atomic=False too."
            )
        method_set = None
        if methods is not None:
            if isinstance(methods, str):
                raise ImproperlyConfigured(
                    f"@idempotent(methods=...) takes a list of methods, not {methods!r}."
                )
            listed = tuple(methods)
            if not listed or not all(isinstance(method, str) and method for method in listed):
                # An empty list fell back to METHODS, and b"POST" matched no request: both
                # protected something other than what they said.
                raise ImproperlyConfigured(
                    f"@idempotent(methods=...) takes a list of method names such as ['POST'], "
                    f"not {listed!r}. Leave it out to handle IDEMPOTENCY['METHODS']."
                )
            method_set = frozenset(method.upper() for method in listed)
            unsafe = ", ".join(sorted(method_set & SAFE_METHODS))
            if unsafe:
                raise ImproperlyConfigured(
                    f"@idempotent(methods=...) lists {unsafe}: safe methods are never handled. "
                    "List only POST, PUT, PATCH or DELETE."
                )
        return cls(
            required=bool(required),
            ttl=_duration("ttl", ttl),
            methods=method_set,
            atomic=bool(atomic),
            lease=_duration("lease", lease),
        )


class LeaseDatabases(set[str]):
    """The ``_non_atomic_requests`` of a view the library handles, as
    ``transaction.non_atomic_requests`` sets it: ``ATOMIC_REQUESTS`` then leaves the view out of
    a transaction on ``IDEMPOTENCY["DATABASE"]`` (read per request, so ``override_settings``
    works). Aliases added by ``non_atomic_requests`` count too, and are its members.

    In lease mode the claim must commit before the view runs. In atomic mode the library opens
    the request's transaction itself (:func:`request_transaction`), so that a database that
    cannot be reached when it opens gets the claim's 503, not Django's 500.
    """

    def __contains__(self, alias: object) -> bool:
        return alias == conf.DATABASE or super().__contains__(alias)


def mark_non_atomic(view: Any) -> None:
    """Leave ``view`` out of ``ATOMIC_REQUESTS`` on ``IDEMPOTENCY["DATABASE"]`` (see
    :class:`LeaseDatabases`)."""
    view._non_atomic_requests = LeaseDatabases(getattr(view, "_non_atomic_requests", ()))


def request_transaction(request: Any, options: Options) -> bool:
    """Whether the library opens the request's transaction on ``IDEMPOTENCY["DATABASE"]``:
    the alias has ``ATOMIC_REQUESTS``, and Django left the view out of it only because the
    library marked the view (:func:`mark_non_atomic`, atomic mode), not because the project did
    (``transaction.non_atomic_requests``, an explicit member of the set).

    Django opens that transaction before the view, so before a decorated view's claim: a
    database that could not be reached failed there, with Django's 500. Opened here, with the
    view, the claim and the stored response inside it as before, it is answered 503 with
    ``Retry-After`` (:meth:`Idempotency.request_transaction`).
    """
    if not options.atomic:
        return False
    alias = conf.DATABASE
    if not connections.settings.get(alias, {}).get("ATOMIC_REQUESTS"):
        return False
    match = getattr(django_request(request), "resolver_match", None)
    marked = getattr(getattr(match, "func", None), "_non_atomic_requests", None)
    return isinstance(marked, LeaseDatabases) and alias not in set(marked)


def _duration(name: str, value: timedelta | float | None) -> timedelta | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise ImproperlyConfigured(
            f"@idempotent({name}=...) must be a timedelta or a number of seconds, not {value!r}."
        )
    if not isinstance(value, timedelta) and not (
        math.isfinite(value) and abs(value) <= MAX_SECONDS
    ):
        raise ImproperlyConfigured(
            f"@idempotent({name}=...) must be a finite duration of at most {MAX_DURATION} (ten "
            f"years), not {value!r}."
        )
    duration = value if isinstance(value, timedelta) else timedelta(seconds=value)
    if duration <= timedelta(0):
        raise ImproperlyConfigured(f"@idempotent({name}=...) must be longer than zero.")
    if duration > MAX_DURATION:
        # As for RECORD_TTL and LEASE: beyond it ``now + ttl`` nears year 9999, and the claim
        # fails (MariaDB, SQLite) or writes a record Python cannot read back (PostgreSQL).
        raise ImproperlyConfigured(
            f"@idempotent({name}=...) must be at most {MAX_DURATION} (ten years), not {duration}."
        )
    return duration


def django_request(request: Any) -> HttpRequest:
    """The ``HttpRequest`` under a DRF ``Request`` (or ``request`` itself)."""
    inner = getattr(request, "_request", request)
    if not isinstance(inner, HttpRequest):
        raise TypeError(f"Expected an HttpRequest or a DRF Request, got {type(request).__name__}.")
    return inner


@lru_cache(maxsize=64)
def _meta_key(name: str) -> str:
    """The ``request.META`` key of a header, as ``HttpHeaders`` maps it the other way."""
    key = name.upper().replace("-", "_")
    return key if key in HttpHeaders.UNPREFIXED_HEADERS else f"{HttpHeaders.HTTP_PREFIX}{key}"


def request_header(request: HttpRequest, name: str) -> str | None:
    """The value of header ``name``, read from ``request.META``.

    ``request.headers`` builds a dictionary of every header on first use, about 20 µs, which a
    replay (the view never runs) would spend for the two headers read here.
    """
    value: str | None = request.META.get(_meta_key(name))
    return value


def prepare(
    request: Any, options: Options, owner_of: Callable[[Any], str] = resolve_owner
) -> Command | HttpResponse | None:
    """Describe ``request`` for the core.

    ``owner_of`` finds the owner scope; an adapter whose framework authenticates in its own way
    (django-ninja's ``request.auth``) passes its own. Returns None when the request is not
    handled (method not listed, no key on an optional endpoint, or already handled by the
    middleware), or a problem response for a missing or malformed key.
    """
    http_request = django_request(request)
    if getattr(http_request, HANDLED, False):
        return None
    method = (http_request.method or "").upper()
    if method in SAFE_METHODS or method not in (options.methods or conf.METHODS):
        return None
    header = request_header(http_request, conf.HEADER)
    try:
        if header is None:
            if not options.required:
                return None
            raise MissingKey(
                f"This endpoint requires an {conf.HEADER} header: send a fresh UUID with each "
                "new request, and the same one when you retry it."
            )
        key = parse_key(header, conf.MAX_KEY_LENGTH)
    except ProblemError as exc:
        setattr(http_request, HANDLED, True)
        telemetry.http_outcome("malformed_key" if header is not None else "missing_key")
        return exc.as_response()
    setattr(http_request, HANDLED, True)
    return Command(
        owner=owner_of(request),
        key=key,
        method=method,
        # The record and the logs keep the path without its query string, which may carry
        # secrets; the fingerprint covers the query string.
        path=http_request.path,
        fingerprint=request_fingerprint(request, method),
    )


def request_fingerprint(request: Any, method: str) -> str:
    """The fingerprint of ``request`` (an ``HttpRequest`` or a DRF ``Request``).

    A form POST is fingerprinted from its parsed fields and files: the raw body may be gone,
    since CSRF or DRF's ``SessionAuthentication`` read ``request.POST``. Any other request from
    its body; if a DRF parser already consumed it (a permission class that reads
    ``request.data``), from what DRF parsed.
    """
    http_request = django_request(request)
    path = http_request.get_full_path()
    content_type = request_header(http_request, "Content-Type")
    if method == "POST" and is_form(content_type):
        return fingerprint(method, path, canonical_form(http_request.POST, http_request.FILES))
    try:
        body = http_request.body
    except RawPostDataException:
        if not hasattr(request, "_full_data"):  # not a DRF request that parsed the body
            raise
        parsed = request.POST if is_form(content_type) else request.data  # files apart
        return fingerprint(method, path, canonical_data(parsed, request.FILES))
    return fingerprint(method, path, body, content_type)


def handle(
    request: Any,
    view: Callable[[], HttpResponseBase],
    options: Options,
    view_self: Any = None,
    owner_of: Callable[[Any], str] = resolve_owner,
) -> HttpResponseBase:
    """Run ``view`` for ``request`` under the core, synchronously."""
    prepared = prepare(request, options, owner_of)
    opens = request_transaction(request, options)
    if prepared is None:
        if opens:  # what ATOMIC_REQUESTS would have done
            with transaction.atomic(using=conf.DATABASE):
                return view()
        return view()
    if isinstance(prepared, HttpResponse):
        return prepared
    core = Idempotency(policy(options), request=request)
    try:
        with ExitStack() as stack:
            if opens:
                stack.enter_context(core.request_transaction(prepared))
            with telemetry.span("idempotency.request", {"http.request.method": prepared.method}):
                result = core.run(
                    prepared, view, partial(capture, request=request, view_self=view_self)
                )
    except ProblemError as exc:
        return exc.as_response()
    return replay_response(result) if isinstance(result, Replay) else result


async def ahandle(
    request: Any,
    view: Callable[[], Awaitable[HttpResponseBase]],
    options: Options,
    view_self: Any = None,
    owner_of: Callable[[Any], str] = resolve_owner,
) -> HttpResponseBase:
    """Run the ``async`` ``view`` for ``request`` under the core."""
    prepared = await sync_to_async(prepare, thread_sensitive=True)(request, options, owner_of)
    if prepared is None:
        return await view()
    if isinstance(prepared, HttpResponse):
        return prepared
    core = Idempotency(policy(options), request=request)
    try:
        with telemetry.span("idempotency.request", {"http.request.method": prepared.method}):
            result = await core.arun(
                prepared, view, partial(capture, request=request, view_self=view_self)
            )
    except ProblemError as exc:
        return exc.as_response()
    return replay_response(result) if isinstance(result, Replay) else result


def policy(options: Options) -> Policy:
    return Policy.from_settings(ttl=options.ttl, atomic=options.atomic, lease=options.lease)


def capture(response: HttpResponseBase, *, request: Any = None, view_self: Any = None) -> Captured:
    """Describe a view's response for the core; renders a template or DRF response first."""
    if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
        if view_self is None:  # e.g. method_decorator on an APIView: DRF knows the view
            view_self = (getattr(request, "parser_context", None) or {}).get("view")
        finalize = getattr(view_self, "finalize_response", None)
        if getattr(response, "accepted_renderer", None) is None and finalize is not None:
            # A DRF Response returned by a decorated APIView/ViewSet method, before DRF's
            # dispatch() negotiated its renderer. DRF finalizes it again afterwards; harmless.
            finalize(request, response)
        response.render()
    headers = safe_headers(response)
    if response.streaming:
        return Captured(response.status_code, headers, None, "streaming response")
    if not isinstance(response, HttpResponse):
        return Captured(response.status_code, headers, None, "response without a stored body")
    content = response.content
    if len(content) > conf.MAX_RESPONSE_BYTES:
        return Captured(
            response.status_code,
            headers,
            None,
            f"body of {len(content)} bytes is larger than MAX_RESPONSE_BYTES",
        )
    return Captured(response.status_code, headers, content)


def safe_headers(response: HttpResponseBase) -> dict[str, str]:
    """The headers of ``response`` that may be replayed to a retry."""
    wanted = {name.lower() for name in (*ALWAYS_REPLAYED, *conf.REPLAY_HEADERS)}
    wanted -= NEVER_REPLAYED
    return {name: value for name, value in response.items() if name.lower() in wanted}


def replay_response(replay: Replay) -> HttpResponse:
    """An ``HttpResponse`` that replays a stored response."""
    response = HttpResponse(replay.body, status=replay.status)
    del response["Content-Type"]
    for name, value in replay.headers.items():
        response[name] = value
    return response
