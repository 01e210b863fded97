"""``IdempotencyMiddleware``: the decorator's behaviour for every path in ``IDEMPOTENCY["PATHS"]``.

.. code-block:: python

    MIDDLEWARE = [
        ...,
        "django.contrib.auth.middleware.AuthenticationMiddleware",  # before: owner = the user
        "django_idempotency.middleware.IdempotencyMiddleware",
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

Views decorated with ``@idempotent`` are left to their decorator and its options. The
middleware works in both sync and async stacks; it always uses atomic mode.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.urls import Resolver404, resolve

from django_idempotency.conf import conf
from django_idempotency.decorators import OPTIONS_ATTRIBUTE
from django_idempotency.http import Options, ahandle, handle

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
        if not applies(request):
            return self.get_response(request)
        try:
            return handle(request, partial(self._respond, request), MIDDLEWARE_OPTIONS)
        except ViewRaised as raised:
            return raised.response

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        if not applies(request):
            return await self.get_response(request)  # type: ignore[no-any-return,misc]
        try:
            return await ahandle(request, partial(self._arespond, request), MIDDLEWARE_OPTIONS)
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


def applies(request: HttpRequest) -> bool:
    """Whether the middleware handles ``request``: a listed method on a listed path, and a
    view that is not decorated with ``@idempotent`` (the decorator handles those itself)."""
    if (request.method or "").upper() not in conf.METHODS:
        return False
    if not any(pattern.search(request.path_info) for pattern in conf.PATHS):
        return False
    try:
        match = resolve(request.path_info, getattr(request, "urlconf", None))
    except Resolver404:
        return True
    return not hasattr(match.func, OPTIONS_ATTRIBUTE)
