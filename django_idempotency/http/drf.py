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
builds the view as DRF does (with the ``as_view()`` arguments of its URL, such as
``authentication_classes`` and ``permission_classes``) and runs its checks before the view:
content negotiation, versioning, authentication and permissions (``initial()`` without the
throttles, which would count the request twice). The owner is then DRF's user, and a request the
view would refuse is left to the view, which refuses it: it never gets a stored response.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from datetime import timedelta
from typing import Any, ClassVar

from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest
from django.http.request import RawPostDataException
from django.http.response import HttpResponseBase

from django_idempotency.extras import missing_extra
from django_idempotency.http.fingerprint import is_form
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
        # Lease mode commits its claim before the handler runs; in atomic mode the handler's
        # handle() opens the request's transaction, where an unreachable database is a 503
        # (handler.request_transaction).
        mark_non_atomic(view)
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


def authenticated_request(
    request: HttpRequest,
    view_class: type[APIView],
    initkwargs: Mapping[str, Any] | None = None,
    *,
    actions: Mapping[str, str] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> Request | None:
    """``request`` as the DRF view will see it, after the view's own checks, or None.

    The view is built as ``view_class.as_view(**initkwargs)`` (``as_view(actions, **initkwargs)``
    for a ViewSet) builds it for each request, and its ``initial()`` runs: content negotiation,
    versioning, authentication (with the view's authenticators, the ones given to ``as_view()``
    included) and permissions. Throttles are left to the view: checking them here too would
    count each request twice. Returns None when the view would refuse the request (any DRF
    ``APIException``, ``Http404`` or Django's ``PermissionDenied``): the middleware then leaves
    it to the view, which answers 401, 403 or whatever its own refusal is, and it never gets a
    stored response. Another exception (a bug in an authenticator) propagates, as it would
    from the view. The Django request's ``user`` and ``auth`` are left as they were (DRF sets
    them again inside the view).
    """
    view = view_class(**(initkwargs or {}))
    kwargs = dict(kwargs or {})
    if actions is not None:  # what ViewSetMixin.as_view()'s view does before dispatch()
        view.action_map = dict(actions)
        for method, action in actions.items():
            handler = getattr(view, action, None)
            if handler is not None:
                setattr(view, method, handler)
        view.request, view.args, view.kwargs = request, tuple(args), kwargs
    else:
        view.setup(request, *args, **kwargs)
    # DRF's setters also set request.user and request.auth on the Django request: undo that.
    saved = {name: request.__dict__[name] for name in _SET_BY_DRF if name in request.__dict__}
    _keep_body_readable(request)
    try:
        view.args, view.kwargs = tuple(args), kwargs
        drf_request = view.initialize_request(request, *args, **kwargs)
        view.request = drf_request
        view.headers = view.default_response_headers
        view.check_throttles = _no_throttles  # the view checks (and counts) them once
        view.initial(drf_request, *args, **kwargs)
    except (APIException, Http404, PermissionDenied):
        return None
    finally:
        for name in _SET_BY_DRF:
            request.__dict__.pop(name, None)
        request.__dict__.update(saved)
    return drf_request


def _keep_body_readable(request: HttpRequest) -> None:
    """Read a non-form body into ``request.body`` before a permission class may parse it.

    The view parses the body again, with a DRF ``Request`` of its own. Had a check here read it
    from the stream, DRF before 3.15.2 could not read it a second time (``RawPostDataException``,
    a 500). The fingerprint reads ``request.body`` anyway, under the same size limit. A form is
    left alone: DRF reuses the parsed ``request.POST`` and ``request.FILES``, and reading a
    multipart upload whole would put its files into memory.
    """
    if is_form(request.META.get("CONTENT_TYPE")):
        return
    # Already read as a stream before the middleware: the view meets that as it would anyway.
    with suppress(RawPostDataException):
        request.body  # noqa: B018 - cached on the request for every later reader


def _no_throttles(request: Request) -> None:
    return None


_SET_BY_DRF = ("user", "auth")
