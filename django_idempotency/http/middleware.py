"""``IdempotencyMiddleware``: the decorator's behaviour for every path in ``IDEMPOTENCY["PATHS"]``.

.. code-block:: python

    MIDDLEWARE = [
        ...,
        "django.contrib.auth.middleware.AuthenticationMiddleware",  # before: owner = the user
        "django_idempotency.http.middleware.IdempotencyMiddleware",
        ...,
    ]
    IDEMPOTENCY = {"PATHS": [r"^/api/"]}

Why it wraps ``get_response`` rather than using ``process_view``: the claim, the view and the
stored response must share one transaction, and the response must be complete (rendered, with
its status) when it is stored. A ``process_view`` hook could only run the view itself and
return its response, which would skip later middlewares' ``process_view``, the
``ATOMIC_REQUESTS`` wrapper, and the handler's template-response rendering. Wrapping
``get_response`` opens the transaction around everything below this middleware (the URL
resolution, the inner middlewares, ``ATOMIC_REQUESTS`` as a savepoint, the view, the rendering)
and sees the final response.

Django turns an exception raised by the view into a 500 response before it reaches this
middleware, so :meth:`IdempotencyMiddleware.process_exception` notes the exception and the
request is then rolled back as if the view had raised, whatever ``ROLLBACK_ON_SERVER_ERROR``
says.

Views decorated with ``@idempotent`` are left to their decorator and its options: a decorated
function, a class-based view whose handler method is decorated (``method_decorator(...,
name="post")``), a DRF action, and a DRF view with
:class:`~django_idempotency.http.drf.IdempotentMixin`. For any other DRF view, the owner is the
user
DRF's authenticators find (they run here, before the view), and a request they refuse is left to
the view, which answers 401 or 403: a revoked credential never gets a stored response. DRF's
permission checks still run only in the view, after a replay would have been sent; the mixin is
the safe option (system check ``django_idempotency.W020``).

The view's exception must reach :meth:`IdempotencyMiddleware.process_exception`, so the
middleware must come after (below) every middleware that turns exceptions into responses
(system check ``django_idempotency.W022``).

The middleware works in both sync and async stacks; it always uses atomic mode.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable
from functools import lru_cache, partial
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.urls import Resolver404, resolve

from django_idempotency.conf import conf
from django_idempotency.http.handler import OPTIONS_ATTRIBUTE, Options, ahandle, handle

RAISED = "_idempotency_view_raised"
MIDDLEWARE_OPTIONS = Options()


class ViewRaised(Exception):
    """Internal: the view raised and Django already turned the exception into ``response``."""

    def __init__(self, response: HttpResponseBase) -> None:
        super().__init__("the view raised")
        self.response = response


class IdempotencyMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(
        self,
        get_response: Callable[[HttpRequest], HttpResponseBase]
        | Callable[[HttpRequest], Awaitable[HttpResponseBase]],
    ) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        scoped = handled_request(request)
        if scoped is None:
            return self.get_response(request)
        try:
            return handle(scoped, partial(self._respond, request), MIDDLEWARE_OPTIONS)
        except ViewRaised as raised:
            return raised.response

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        scoped = None
        if listed(request):  # DRF's authenticators may query the database: not on the loop
            scoped = await sync_to_async(handled_request, thread_sensitive=True)(request)
        if scoped is None:
            return await self.get_response(request)  # type: ignore[no-any-return,misc]
        try:
            return await ahandle(scoped, partial(self._arespond, request), MIDDLEWARE_OPTIONS)
        except ViewRaised as raised:
            return raised.response

    def process_exception(self, request: HttpRequest, exception: Exception) -> None:
        setattr(request, RAISED, True)

    def _respond(self, request: HttpRequest) -> HttpResponseBase:
        response: HttpResponseBase = self.get_response(request)  # type: ignore[assignment]
        if getattr(request, RAISED, False):
            raise ViewRaised(response)
        return response

    async def _arespond(self, request: HttpRequest) -> HttpResponseBase:
        response: HttpResponseBase = await self.get_response(request)  # type: ignore[misc]
        if getattr(request, RAISED, False):
            raise ViewRaised(response)
        return response


def handled_request(request: HttpRequest) -> Any:
    """The request the middleware handles, or None when it leaves ``request`` alone.

    None for a method or path not listed, for a view that handles itself (decorated with
    ``@idempotent``, on the function or on the handler method of its class or DRF action, or a
    DRF view with :class:`~django_idempotency.http.drf.IdempotentMixin`), and for a DRF view whose
    authenticators refuse the credentials (the view answers 401/403 itself). For another DRF
    view, the DRF ``Request`` its authenticators see, so that the owner is DRF's user.
    """
    if not listed(request):
        return None
    method = (request.method or "").upper()
    try:
        match = resolve(request.path_info, getattr(request, "urlconf", None))
    except Resolver404:
        return request
    view_class = view_class_of(match.func)
    if handles_itself(match.func, view_class, method):
        return None
    if drf_installed() and _drf().is_drf_view(view_class):
        return _drf().authenticated_request(request, view_class)
    return request


def listed(request: HttpRequest) -> bool:
    """Whether ``request`` has a method in ``METHODS`` and a path in ``PATHS``."""
    if (request.method or "").upper() not in conf.METHODS:
        return False
    return any(pattern.search(request.path_info) for pattern in conf.PATHS)


def view_class_of(func: Any) -> type | None:
    """The class behind a view function: Django's ``view_class``, DRF's ``cls`` for a ViewSet."""
    view_class = getattr(func, "view_class", None) or getattr(func, "cls", None)
    return view_class if isinstance(view_class, type) else None


def handler_of(func: Any, view_class: type | None, method: str) -> Any:
    """The class method that answers ``method``: the DRF action of a ViewSet, else ``post``..."""
    if view_class is None:
        return None
    actions = getattr(func, "actions", None) or {}
    return getattr(view_class, actions.get(method.lower(), method.lower()), None)


def handles_itself(func: Any, view_class: type | None, method: str) -> bool:
    """Whether the view brings its own idempotency, and its own options, for ``method``."""
    if hasattr(func, OPTIONS_ATTRIBUTE):
        return True
    if view_class is None:
        return False
    if drf_installed() and issubclass(view_class, _drf().IdempotentMixin):
        return True
    return hasattr(handler_of(func, view_class, method), OPTIONS_ATTRIBUTE)


@lru_cache(maxsize=1)
def drf_installed() -> bool:
    return importlib.util.find_spec("rest_framework") is not None


def _drf() -> Any:
    from django_idempotency.http import drf

    return drf
