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

Two placements are refused with :class:`~django.core.exceptions.ImproperlyConfigured`, because
the decorator would run before the framework authenticates the request, and a token client's
owner would be ``anonymous`` or a hash of its header, whatever DRF or Ninja later decides: a
whole DRF view (``idempotent(Orders.as_view())``, ``@idempotent`` above ``@api_view``, or
``method_decorator(idempotent, name="dispatch")`` on an ``APIView``), and a django-ninja
operation (``django_idempotency.http.ninja.idempotent`` is its decorator).

``async def`` views are supported as well. A lease-mode function view is marked non-atomic on
``IDEMPOTENCY["DATABASE"]`` itself, as ``@transaction.non_atomic_requests`` would mark it, so it
works under ``ATOMIC_REQUESTS = True``. A method (``method_decorator`` or a DRF method) cannot be
marked so; system check ``django_idempotency.E021`` names such views at start-up. A synchronous
atomic-mode view is marked too, and :func:`~django_idempotency.http.handler.handle` opens the
request's transaction in Django's place, so that a database that cannot be reached there is
answered 503, not Django's 500 (:func:`~django_idempotency.http.handler.request_transaction`).
"""

from __future__ import annotations

import inspect
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
        _refuse_framework_views(func)
        if phases:
            flow = flow_view(func, options, name)
            _refuse_as_ninja_operation(flow)
            return flow  # type: ignore[return-value]
        if iscoroutinefunction(func):

            @wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                request, view_self = _request_of(args)
                return await ahandle(request, lambda: func(*args, **kwargs), options, view_self)

            setattr(async_wrapper, OPTIONS_ATTRIBUTE, options)
            if not options.atomic:
                mark_non_atomic(async_wrapper)
            _refuse_as_ninja_operation(async_wrapper)
            return async_wrapper  # type: ignore[return-value]

        @wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            request, view_self = _request_of(args)
            return handle(request, lambda: func(*args, **kwargs), options, view_self)

        setattr(wrapper, OPTIONS_ATTRIBUTE, options)
        # Atomic mode too: the request's transaction is then opened by handle(), where a
        # database that cannot be reached is answered 503 (handler.request_transaction).
        mark_non_atomic(wrapper)
        _refuse_as_ninja_operation(wrapper)
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


DRF_API_VIEW = "rest_framework.views.APIView"
#: How ``Operation.__init__`` lets third-party code see the operation it makes of a function.
NINJA_CALLBACKS = "_ninja_contribute_to_operation"
WHOLE_DRF_VIEW = (
    "@idempotent cannot wrap the whole DRF view {name}: it would run before DRF authenticates "
    "the request, so a token or API-key client would be scoped as anonymous (or by a hash of "
    "its header), and a client DRF refuses could be answered with a stored response. Use "
    "django_idempotency.http.drf.IdempotentMixin (class Orders(IdempotentMixin, APIView)), "
    "decorate the handler method (@idempotent on post()), or put @idempotent under @api_view "
    "(@api_view([...]) above @idempotent above the function)."
)
NINJA_OPERATION = (
    "django_idempotency.idempotent cannot decorate the django-ninja operation {name}: it does "
    "not see what Ninja authenticated (request.auth) nor the bytes Ninja sends. Use "
    "django_idempotency.http.ninja.idempotent instead (from django_idempotency.http.ninja "
    "import idempotent)."
)


def _is_drf_view_class(value: Any) -> bool:
    """Whether ``value`` is a DRF ``APIView`` subclass (by name: DRF need not be installed)."""
    if not isinstance(value, type):
        return False
    return any(f"{base.__module__}.{base.__qualname__}" == DRF_API_VIEW for base in value.__mro__)


def _is_ninja(value: Any) -> bool:
    return type(value).__module__.startswith(("ninja.", "ninja_extra."))


def _refuse_framework_views(func: Any) -> None:
    """Refuse the placements where the decorator would run before DRF's or Ninja's auth."""
    name = getattr(func, "__qualname__", None) or repr(func)
    # as_view() of an APIView (an @api_view function too), under functools.wraps decorators.
    view_class = getattr(func, "view_class", None) or getattr(func, "cls", None)
    if isinstance(view_class, type) and _is_drf_view_class(view_class):
        raise ImproperlyConfigured(WHOLE_DRF_VIEW.format(name=view_class.__qualname__))
    # method_decorator(idempotent, name="dispatch") on an APIView: the bound dispatch, in a
    # partial, is decorated for each request; dispatch gets Django's request, before DRF's.
    bound = getattr(func, "func", func)
    owner = getattr(bound, "__self__", None)
    method = getattr(bound, "__name__", "")
    if _is_drf_view_class(type(owner)) and method == "dispatch":
        raise ImproperlyConfigured(WHOLE_DRF_VIEW.format(name=type(owner).__qualname__))
    # Above @api.post: the function is already an operation's. As a view decorator of one
    # (decorate_view, add_decorator(mode="view")): the operation's bound run().
    if hasattr(func, "_ninja_operation") or _is_ninja(
        getattr(inspect.unwrap(func), "__self__", None)
    ):
        raise ImproperlyConfigured(NINJA_OPERATION.format(name=name))


def _refuse_as_ninja_operation(wrapper: Any) -> None:
    """Below @api.post: Ninja calls this back when it makes an operation of the function."""

    def refuse(operation: Any) -> None:
        raise ImproperlyConfigured(NINJA_OPERATION.format(name=wrapper.__qualname__))

    # functools.wraps shared the wrapped function's list: this one is the wrapper's own.
    setattr(wrapper, NINJA_CALLBACKS, [*getattr(wrapper, NINJA_CALLBACKS, ()), refuse])
