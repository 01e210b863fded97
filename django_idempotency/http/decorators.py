"""``@idempotent``: the view decorator, a thin adapter over :mod:`django_idempotency.http.core`.

.. code-block:: python

    @idempotent
    def create_order(request): ...

    @idempotent(required=True, ttl=timedelta(hours=48), methods=["POST"])
    def pay(request): ...

    class Orders(APIView):                  # DRF: decorate the method directly
        @idempotent(required=True)
        def post(self, request): ...

    @method_decorator(idempotent, name="post")   # a Django class-based view
    class Checkout(View): ...

    @idempotent(atomic=False, lease=timedelta(seconds=30))   # lease mode
    def charge(request): ...

    @idempotent(phases=True, lease=timedelta(seconds=30))    # phases: see flows.py
    def checkout(request, flow): ...

``async def`` views are supported as well. A lease-mode function view is marked non-atomic on
``IDEMPOTENCY["DATABASE"]`` itself, as ``@transaction.non_atomic_requests`` would mark it, so it
works under ``ATOMIC_REQUESTS = True``. A method (``method_decorator`` or a DRF method) cannot be
marked so; system check ``django_idempotency.E021`` names such views at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from functools import wraps
from typing import Any, TypeVar, overload

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured

from django_idempotency.flows.phases import flow_view
from django_idempotency.http.handler import (
    OPTIONS_ATTRIBUTE,
    Options,
    ahandle,
    handle,
    mark_non_atomic,
)

V = TypeVar("V", bound=Callable[..., Any])


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
    phases: bool = False,
    name: str | None = None,
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
    phases: bool = False,
    name: str | None = None,
) -> V | Callable[[V], V]:
    """Make a view safe to retry with an ``Idempotency-Key`` header.

    :param required: answer 400 when the header is missing (default: run the view normally).
    :param ttl: how long the record is kept; default ``IDEMPOTENCY["RECORD_TTL"]``.
    :param methods: the methods handled; default ``IDEMPOTENCY["METHODS"]`` (POST, PATCH).
        Safe methods (GET, HEAD, OPTIONS, TRACE) are never handled.
    :param atomic: True (default) runs the claim, the view and the stored response in one
        transaction. False selects lease mode, for views that call other systems.
    :param lease: lease mode only: how long a claim is held before a retry may take it over;
        default ``IDEMPOTENCY["LEASE"]``.
    :param phases: lease mode split into atomic phases with recovery points: the view takes
        ``(request, flow)``; see :mod:`django_idempotency.flows.phases`. Implies ``atomic=False``.
    :param name: phases only: the name the completer finds the view by, stored on its runs as
        ``module:name`` (default ``module:qualname``). Two phased views of one name are
        refused, so views made by one factory each need their own.

    The view may be a function, an ``async def`` function, or a method whose first argument is
    ``self`` and second the request (DRF ``APIView`` and ``ViewSet`` methods).
    """
    options = Options.build(
        required=required, ttl=ttl, methods=methods, atomic=atomic and not phases, lease=lease
    )

    if name is not None and not phases:
        raise ImproperlyConfigured(
            "@idempotent(name=...) names a phased view for the completer: pass phases=True too."
        )

    def decorate(func: V) -> V:
        if phases:
            return flow_view(func, options, name)  # type: ignore[return-value]
        if iscoroutinefunction(func):

            @wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                request, view_self = _request_of(args)
                return await ahandle(request, lambda: func(*args, **kwargs), options, view_self)

            setattr(async_wrapper, OPTIONS_ATTRIBUTE, options)
            if not options.atomic:
                mark_non_atomic(async_wrapper)
            return async_wrapper  # type: ignore[return-value]

        @wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            request, view_self = _request_of(args)
            return handle(request, lambda: func(*args, **kwargs), options, view_self)

        setattr(wrapper, OPTIONS_ATTRIBUTE, options)
        if not options.atomic:
            mark_non_atomic(wrapper)
        return wrapper  # type: ignore[return-value]

    return decorate(view) if view is not None else decorate


def _is_request(value: Any) -> bool:
    return hasattr(value, "META") and hasattr(value, "method")


def _request_of(args: tuple[Any, ...]) -> tuple[Any, Any]:
    """The request among a view's positional arguments, and ``self`` when it is a method."""
    if args and _is_request(args[0]):
        return args[0], None
    if len(args) > 1 and _is_request(args[1]):
        return args[1], args[0]
    raise TypeError(
        "@idempotent could not find the request: decorate a view function (request, ...) or a "
        "view method (self, request, ...)."
    )
