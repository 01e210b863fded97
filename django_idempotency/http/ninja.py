"""django-ninja: ``@idempotent`` on Ninja operations, after Ninja's authentication.

.. code-block:: python

    from django_idempotency.http.ninja import idempotent

    @api.post("/orders", auth=django_auth, response={201: OrderOut})
    @idempotent(required=True)
    def create_order(request, payload: OrderIn): ...

The decorator goes above or below ``@api.post`` (or a router's ``@router.post``), on ``def``
and ``async def`` operations alike, and takes ``@idempotent``'s options.

Where it runs, and why. Ninja offers two places for a decorator (docs/http.md): *view mode*
(``decorate_view``) wraps ``Operation.run``, before authentication, throttling and parsing, and
sees the final ``HttpResponse``; *operation mode* wraps the function itself, after them, and sees
its return value before Ninja serialises it. Neither alone is right: before authentication a
client whose credential was revoked would get a stored 2xx, and the owner would not be known;
the function's return value is not the bytes the client got. So this adapter wraps the function
(after authentication, throttling and validation: a refused or invalid request never reaches the
core, never claims a key and never gets a replay), and inside the core turns its return value
into the final response with the operation's own ``_result_to_response`` (the response schema,
``Status``, the renderer of the API it is mounted on), so that the stored bytes are exactly the
ones Ninja sends. Ninja passes an ``HttpResponse`` through unchanged. A thin view-mode decorator
only tells the function which mounted operation runs it (Ninja clones operations per mount).

The owner comes from ``request.auth`` (:func:`ninja_owner`). Errors are the library's RFC 9457
problem responses (``application/problem+json``). An exception raised by the function rolls the
claim back and goes to Ninja's exception handlers, as it would without the decorator.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable
from datetime import timedelta
from functools import wraps
from typing import Any, TypeVar, overload

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.http.response import HttpResponseBase

from django_idempotency.extras import missing_extra
from django_idempotency.http.handler import (
    OPTIONS_ATTRIBUTE,
    Options,
    ahandle,
    handle,
)
from django_idempotency.http.owner import (
    normalise_authorization,
    principal_owner,
    resolve_owner,
)

try:
    from ninja.decorators import decorate_view
    from ninja.operation import Operation
    from ninja.security import APIKeyCookie, APIKeyHeader, APIKeyQuery, HttpBasicAuth, HttpBearer
    from ninja.security.apikey import APIKeyBase
    from ninja.utils import contribute_operation_callback
except ImportError as error:  # django-ninja is the "ninja" extra
    raise missing_extra("ninja", __name__) from error

__all__ = ["credential_owner", "idempotent", "ninja_owner"]

V = TypeVar("V", bound=Callable[..., Any])

#: The request attribute that names the mounted operation running the request.
OPERATION_ATTRIBUTE = "_idempotency_ninja_operation"


def ninja_owner(request: Any) -> str:
    """The owner scope of a Ninja request: whom ``request.auth`` names.

    ``IDEMPOTENCY["OWNER"]`` wins when set. Otherwise ``request.auth`` goes through
    :func:`~django_idempotency.http.owner.principal_owner`, the one mapping every entry point
    uses (docs/security.md): a user of ``AUTH_USER_MODEL`` is ``user:<pk>``, the same owner as
    under ``@idempotent`` and DRF; an instance of another model (an API key row) is
    ``principal:<app_label>.<model_name>:<pk>``; a string (the token an ``HttpBearer`` or
    ``APIKeyQuery`` returns) is ``auth:`` and a keyed HMAC of it, never the token itself.

    An auth that answers ``True`` (or another value that names no one) says that a credential
    was good, not whose it is: the owner is then the credential itself (:func:`credential_owner`),
    so that two API keys are two owners and never the shared ``anonymous``. Without
    ``request.auth`` (an operation with no auth) the default derivation applies.
    """
    principal = getattr(request, "auth", None)
    if principal is None or _configured_owner():
        return resolve_owner(request)
    owner = principal_owner(principal)
    if owner is not None:
        return owner
    return credential_owner(request, getattr(request, OPERATION_ATTRIBUTE, None), principal)


def credential_owner(request: Any, operation: Any, principal: Any = True) -> str:
    """The owner of a request whose Ninja auth accepted it without naming anyone: ``auth:``
    and a keyed HMAC of every credential the operation's auth classes read from it.

    Ninja does not say which of an operation's auth classes accepted the request, so each one
    reads its credential, as it did: an ``APIKeyHeader``, ``APIKeyQuery`` or ``APIKeyCookie``
    its ``param_name`` (a ``SessionAuth``: the session cookie), an ``HttpBearer`` or
    ``HttpBasicAuth`` its header (``Authorization``, scheme without case). Two clients get one
    owner only when they sent the same credentials. An auth callable or class whose credential
    cannot be read so (a plain function, an overridden ``__call__`` or ``_get_key``) might have
    accepted anything: :class:`~django.core.exceptions.ImproperlyConfigured`, never a shared
    owner. When no auth class found a credential (an auth that accepts requests without one),
    the default derivation applies, as for an operation without auth.
    """
    callbacks = list(getattr(operation, "auth_callbacks", None) or ())
    credentials: list[list[str]] = []
    for callback in callbacks:
        read = _credential_reader(callback)
        if read is None:
            raise ImproperlyConfigured(
                f"django_idempotency cannot tell whose key space request.auth = {principal!r} "
                f"belongs to: the auth {_describe(callback)} answered without naming anyone, and "
                "what it checked cannot be read. Return the principal (a user, a model instance "
                "or the token string) from the Ninja auth, or set IDEMPOTENCY['OWNER'] to a "
                "callable (request) -> str."
            )
        credential = read(request)
        if credential:
            credentials.append(credential)
    if not callbacks:
        raise ImproperlyConfigured(
            f"django_idempotency cannot tell whose key space request.auth = {principal!r} belongs "
            "to: return a user, a model instance or a string from the Ninja auth, or set "
            "IDEMPOTENCY['OWNER'] to a callable (request) -> str."
        )
    if not credentials:
        return resolve_owner(request)
    owner = principal_owner(json.dumps(credentials, ensure_ascii=False))
    assert owner is not None  # a non-empty string always names an owner
    return owner


def _credential_reader(callback: Any) -> Callable[[Any], list[str] | None] | None:
    """How to read, without side effects, the credential that ``callback`` checks."""
    kind = type(callback)
    if isinstance(callback, APIKeyBase) and kind.__call__ is APIKeyBase.__call__:
        name = callback.param_name
        if kind._get_key is APIKeyHeader._get_key:
            return lambda request: _present("header", name.lower(), request.headers.get(name))
        if kind._get_key is APIKeyQuery._get_key:
            return lambda request: _present("query", name, request.GET.get(name))
        if kind._get_key is APIKeyCookie._get_key:  # not _get_key: it checks CSRF again
            return lambda request: _present("cookie", name, request.COOKIES.get(name))
        return None
    if kind.__call__ in (HttpBearer.__call__, HttpBasicAuth.__call__):
        header = callback.header
        return lambda request: _present(
            "header", header.lower(), _normalised(request.headers.get(header))
        )
    return None


def _present(kind: str, name: str, value: str | None) -> list[str] | None:
    return [kind, name, value] if value else None


def _normalised(value: str | None) -> str | None:
    return normalise_authorization(value) if value else None


def _describe(callback: Any) -> str:
    name = getattr(callback, "__qualname__", None) or type(callback).__qualname__
    return f"{getattr(callback, '__module__', type(callback).__module__)}.{name}"


def _configured_owner() -> bool:
    from django_idempotency.conf import conf

    return bool(conf.OWNER)


@overload
def idempotent(view: V, /) -> V: ...


@overload
def idempotent(
    view: None = None,
    /,
    *,
    required: bool = False,
    ttl: timedelta | float | None = None,
    methods: Iterable[str] | None = None,
    atomic: bool = True,
    lease: timedelta | float | None = None,
) -> Callable[[V], V]: ...


def idempotent(
    view: V | None = None,
    /,
    *,
    required: bool = False,
    ttl: timedelta | float | None = None,
    methods: Iterable[str] | None = None,
    atomic: bool = True,
    lease: timedelta | float | None = None,
) -> V | Callable[[V], V]:
    """Make a Ninja operation safe to retry with an ``Idempotency-Key`` header.

    The options are :func:`django_idempotency.idempotent`'s (phased views are not offered
    here). Returns the function unchanged: Ninja's operation is what changes.
    """
    options = Options.build(
        required=required, ttl=ttl, methods=methods, atomic=atomic, lease=lease
    )

    def decorate(func: V) -> V:
        operation = getattr(func, "_ninja_operation", None)
        if operation is not None:  # above @api.post: the operation exists
            _install(operation, options)
        else:  # below @api.post: Ninja calls back when it makes the operation
            contribute_operation_callback(func, lambda op: _install(op, options))
        decorate_view(_bind_operation)(func)
        return func

    return decorate(view) if view is not None else decorate


def _install(operation: Operation, options: Options) -> None:
    if getattr(operation, "stream_format", None):
        raise ImproperlyConfigured(
            f"@idempotent cannot store the streamed response of {operation.view_func.__name__}"
            ": a stream is sent as it is made. Return a whole response instead."
        )
    if hasattr(operation.view_func, OPTIONS_ATTRIBUTE):
        raise ImproperlyConfigured(
            f"{operation.view_func.__name__} is decorated with @idempotent twice."
        )
    func = operation.view_func
    response_arg = operation.signature.response_arg

    def respond(request: HttpRequest, result: Any, values: dict[str, Any]) -> HttpResponseBase:
        mounted: Operation = getattr(request, OPERATION_ATTRIBUTE, operation)
        temporal = values.get(response_arg) if response_arg else None
        if temporal is None:
            temporal = mounted.api.create_temporal_response(request)
        return mounted._result_to_response(request, result, temporal)

    wrapper: Callable[..., Any]
    if iscoroutinefunction(func):  # Operation.is_async is set after the callbacks ran

        @wraps(func)
        async def async_wrapper(request: HttpRequest, *args: Any, **values: Any) -> Any:
            async def view() -> HttpResponseBase:
                return respond(request, await func(request, *args, **values), values)

            return await ahandle(request, view, options, owner_of=ninja_owner)

        wrapper = async_wrapper
    else:

        @wraps(func)
        def sync_wrapper(request: HttpRequest, *args: Any, **values: Any) -> Any:
            def view() -> HttpResponseBase:
                return respond(request, func(request, *args, **values), values)

            return handle(request, view, options, owner_of=ninja_owner)

        wrapper = sync_wrapper
    setattr(wrapper, OPTIONS_ATTRIBUTE, options)
    operation.view_func = wrapper


def _bind_operation(run: Callable[..., Any]) -> Callable[..., Any]:
    """View mode: note on the request which mounted operation (a clone per mount) runs it."""
    mounted = getattr(inspect.unwrap(run), "__self__", None)  # under other view decorators too
    if mounted is None:
        raise ImproperlyConfigured(
            "@idempotent could not find the Ninja operation under a view decorator that does "
            "not use functools.wraps: put @idempotent next to @api.post."
        )
    if iscoroutinefunction(run):

        @wraps(run)
        async def async_run(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            setattr(request, OPERATION_ATTRIBUTE, mounted)
            return await run(request, *args, **kwargs)

        return async_run

    @wraps(run)
    def sync_run(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        setattr(request, OPERATION_ATTRIBUTE, mounted)
        return run(request, *args, **kwargs)

    return sync_run
