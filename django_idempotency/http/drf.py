"""Django REST framework: a stored response is reached only after DRF's own checks.

:class:`IdempotentMixin` runs the core inside ``APIView.initial()``, after DRF has
authenticated the request, checked its permissions and throttled it. A client whose token was
revoked, or who lost a permission, gets DRF's 401 or 403, never a stored 2xx; and the owner is
DRF's ``request.user``, whichever authentication class found it. This is the recommended set-up
for DRF APIs (see docs/security.md):

.. code-block:: python

    from django_idempotency.http.drf import IdempotentMixin

    class OrderViewSet(IdempotentMixin, viewsets.ModelViewSet):
        idempotency_required = True
        ...

The options are class attributes named after ``@idempotent``'s: ``idempotency_required``,
``idempotency_ttl``, ``idempotency_methods``, ``idempotency_atomic`` and ``idempotency_lease``.
A handler method decorated with ``@idempotent`` keeps its own options. The middleware leaves
these views to the mixin.

:func:`authenticated_request` is what the middleware uses for a DRF view without the mixin: it
runs the view's authenticators before the view, so that the owner is DRF's user there too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, ClassVar

from django.http import HttpRequest
from django.http.response import HttpResponseBase

from django_idempotency.extras import missing_extra
from django_idempotency.http.handler import OPTIONS_ATTRIBUTE, Options, handle, mark_non_atomic

try:
    from rest_framework.exceptions import APIException  # type: ignore[import-untyped]
    from rest_framework.request import Request  # type: ignore[import-untyped]
    from rest_framework.views import APIView  # type: ignore[import-untyped]
except ImportError as error:  # Django REST framework is the "drf" extra
    raise missing_extra("drf", __name__) from error

__all__ = ["IdempotentMixin", "authenticated_request", "is_drf_view"]


class IdempotentMixin:
    """Make a DRF ``APIView`` or ``ViewSet`` idempotent, after authentication and permissions.

    Put it before the view class: ``class Orders(IdempotentMixin, APIView)``.
    """

    idempotency_required: ClassVar[bool] = False
    idempotency_ttl: ClassVar[timedelta | float | None] = None
    idempotency_methods: ClassVar[Iterable[str] | None] = None
    idempotency_atomic: ClassVar[bool] = True
    idempotency_lease: ClassVar[timedelta | float | None] = None
    idempotency_options: ClassVar[Options] = Options()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Checked when the class is defined, like @idempotent's arguments.
        cls.idempotency_options = Options.build(
            required=cls.idempotency_required,
            ttl=cls.idempotency_ttl,
            methods=cls.idempotency_methods,
            atomic=cls.idempotency_atomic,
            lease=cls.idempotency_lease,
        )

    @classmethod
    def as_view(cls, *args: Any, **kwargs: Any) -> Callable[..., HttpResponseBase]:
        view: Callable[..., HttpResponseBase] = super().as_view(*args, **kwargs)  # type: ignore[misc]
        if not cls.idempotency_options.atomic:
            mark_non_atomic(view)  # lease mode commits its claim before the handler runs
        return view

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        """DRF's checks first (authentication, permissions, throttles), then the core.

        The handler DRF is about to call is replaced, on this view instance only (DRF makes
        one per request), by one that runs it under the core.
        """
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        name = (request.method or "").lower()
        handler = getattr(self, name, None)
        if handler is None or hasattr(handler, OPTIONS_ATTRIBUTE):
            return  # not allowed (DRF answers 405), or @idempotent handles it itself
        options = self.idempotency_options

        def idempotent_handler(request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
            return handle(request, lambda: handler(request, *args, **kwargs), options, self)

        setattr(self, name, idempotent_handler)


def is_drf_view(view_class: type | None) -> bool:
    return isinstance(view_class, type) and issubclass(view_class, APIView)


def authenticated_request(request: HttpRequest, view_class: type[APIView]) -> Request | None:
    """``request`` as DRF will see it, with ``user`` found by the view's authenticators.

    Returns None when DRF would refuse the credentials: the middleware then leaves the request
    to the view, which answers 401 or 403, so a revoked credential never gets a stored response.
    The Django request's ``user`` is left as it was (DRF sets it again inside the view).
    """
    view = view_class()
    drf_request = Request(request, authenticators=view.get_authenticators())
    # DRF's setters also set request.user and request.auth on the Django request: undo that.
    saved = {name: request.__dict__[name] for name in _SET_BY_DRF if name in request.__dict__}
    try:
        drf_request.user  # noqa: B018 - runs the authenticators
    except APIException:
        return None
    finally:
        for name in _SET_BY_DRF:
            request.__dict__.pop(name, None)
        request.__dict__.update(saved)
    return drf_request


_SET_BY_DRF = ("user", "auth")
