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
:class:`~django_idempotency.http.drf.IdempotentMixin`. For any other DRF view, a request that
carries a key first goes through the view's own checks, built as DRF builds the view (with the
``as_view()`` arguments of its URL, such as ``authentication_classes`` and
``permission_classes``): content negotiation, versioning, authentication and permissions. The
owner is the user DRF's authenticators find, and a request the view would refuse is left to the
view, which refuses it (401, 403): it never gets a stored response. Throttles, object-level
permissions (``get_object()``) and the handler's own checks still run only in the view, after a
replay would have been sent; the mixin is the safe option (system check
``django_idempotency.W020``).

The view's exception must reach :meth:`IdempotencyMiddleware.process_exception`, so the
middleware must come after (below) every middleware that turns exceptions into responses
(system check ``django_idempotency.W022``).

django-ninja's URLs are left to Ninja: an operation decorated with
:func:`django_idempotency.http.ninja.idempotent` is handled there, after Ninja's authentication
(the owner is what it authenticated), and another operation is not idempotent (system check
``django_idempotency.W024``). Here, before Ninja's authentication, every API-key client would
look anonymous, and a revoked token would still get its stored response.

For a Django view (not DRF, not Ninja) and a request with a key, the CSRF check of the project's
``CsrfViewMiddleware`` runs before a stored response is looked up, as it would before the view:
a request it refuses is left to it (403) and never gets a replay.

The view is resolved with ``request.urlconf`` as the middlewares above this one left it. A
middleware below it that changes ``request.urlconf`` or the path, or ``LocaleMiddleware`` below
it with ``i18n_patterns``, would make Django run another view than the one the owner was decided
for: :meth:`IdempotencyMiddleware.process_view` compares the two and refuses the request
(:class:`~django.core.exceptions.ImproperlyConfigured`, the claim rolled back) rather than scope
it wrongly. System check ``django_idempotency.W023`` names such middlewares. Likewise an
authentication middleware below this one: one that replaces ``request.user`` is refused in
:meth:`~IdempotencyMiddleware.process_view` (before the view runs; one that does so in its
own ``process_view``, which runs later, after the view unless ``login()`` or ``logout()`` did),
one that sets ``request.auth`` after the view (system check ``django_idempotency.E004`` names
Django's own ``AuthenticationMiddleware``).

The middleware works in both sync and async stacks; it always uses atomic mode.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Awaitable, Callable
from functools import lru_cache, partial
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.contrib.auth.signals import user_logged_in, user_logged_out
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.middleware.csrf import CsrfViewMiddleware
from django.urls import Resolver404, resolve
from django.utils.module_loading import import_string

from django_idempotency.conf import conf
from django_idempotency.http.handler import (
    HANDLED,
    OPTIONS_ATTRIBUTE,
    Options,
    ahandle,
    handle,
    request_header,
)

RAISED = "_idempotency_view_raised"
#: ``request.user`` as it was when the middleware decided the owner of a request it handles;
#: :meth:`IdempotencyMiddleware.process_view` refuses a request whose ``user`` was replaced since.
USER_AT_CLAIM = "_idempotency_user_at_claim"
_NO_USER = object()
#: Set on a claimed request that ``login()`` or ``logout()`` changed the user of.
LOGGED_IN_OR_OUT = "_idempotency_logged_in_or_out"
#: The view the middleware resolved a request it handles to (None: no view), which
#: :meth:`IdempotencyMiddleware.process_view` compares with the one Django runs.
RESOLVED = "_idempotency_resolved_view"
#: The modules whose views are django-ninja's (and django-ninja-extra's): left to Ninja.
NINJA_MODULES = ("ninja.", "ninja_extra.")
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
        _note_user(request)
        respond = partial(self._respond, request, watch=_watches_auth(request, scoped))
        try:
            return handle(scoped, respond, MIDDLEWARE_OPTIONS)
        except ViewRaised as raised:
            return raised.response

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        scoped = None
        if listed(request):  # DRF's authenticators may query the database: not on the loop
            scoped = await sync_to_async(handled_request, thread_sensitive=True)(request)
        if scoped is None:
            return await self.get_response(request)  # type: ignore[no-any-return,misc]
        _note_user(request)
        respond = partial(self._arespond, request, watch=_watches_auth(request, scoped))
        try:
            return await ahandle(scoped, respond, MIDDLEWARE_OPTIONS)
        except ViewRaised as raised:
            return raised.response

    def process_exception(self, request: HttpRequest, exception: Exception) -> None:
        setattr(request, RAISED, True)

    def process_view(
        self, request: HttpRequest, view_func: Any, view_args: Any, view_kwargs: Any
    ) -> None:
        """Refuse a request whose view is not the one the middleware decided for.

        The owner, the DRF checks and the CSRF check were chosen for the view this middleware
        resolved. A middleware below it that changed ``request.urlconf``, the path or the
        active language made Django resolve another one: the request fails (its claim rolls
        back, nothing is stored), rather than be stored under an owner the view's own
        authentication never saw.
        """
        if not hasattr(request, RESOLVED):
            return
        _refuse_replaced_user(request)
        resolved = getattr(request, RESOLVED)
        if view_func is resolved:
            return
        setattr(request, RAISED, True)  # roll the claim back
        raise ImproperlyConfigured(
            f"IdempotencyMiddleware resolved {request.path_info!r} to {_name(resolved)}, but "
            f"Django runs {_name(view_func)}: a middleware below it changed request.urlconf, "
            "the path or the active language (LocaleMiddleware with i18n_patterns), and the "
            "owner would be decided for the wrong view. Move "
            "'django_idempotency.http.middleware.IdempotencyMiddleware' below that middleware "
            "in MIDDLEWARE (system check django_idempotency.W023)."
        )

    def _respond(self, request: HttpRequest, watch: bool = False) -> HttpResponseBase:
        response: HttpResponseBase = self.get_response(request)  # type: ignore[assignment]
        if getattr(request, RAISED, False):
            raise ViewRaised(response)
        if watch:  # the owner is the user the middlewares above found (no DRF view)
            _refuse_late_authentication(request)
            _refuse_user_replaced_below(request)
        return response

    async def _arespond(self, request: HttpRequest, watch: bool = False) -> HttpResponseBase:
        response: HttpResponseBase = await self.get_response(request)  # type: ignore[misc]
        if getattr(request, RAISED, False):
            raise ViewRaised(response)
        if watch:  # the owner is the user the middlewares above found (no DRF view)
            _refuse_late_authentication(request)
            if request.__dict__.get("user", _NO_USER) is not getattr(request, USER_AT_CLAIM, None):
                # Who the user is may need the database (a lazy user): not on the event loop.
                await sync_to_async(_refuse_user_replaced_below, thread_sensitive=True)(request)
        return response


def _note_user(request: HttpRequest) -> None:
    """Remember ``request.user`` as the owner was decided (after a DRF view's checks, which set
    it): the object itself, not who it is, so that nothing is evaluated here."""
    setattr(request, USER_AT_CLAIM, request.__dict__.get("user", _NO_USER))


def _refuse_replaced_user(request: HttpRequest) -> None:
    """Refuse a claimed request whose ``request.user`` a middleware below this one replaced.

    The owner was decided from the user the middlewares above found (anonymous, or the session's
    user); a middleware below that authenticates (a token or remote-user middleware placed after
    ``IdempotencyMiddleware``) would make the view answer for another principal, and its
    response would be stored, and replayed, under the first owner. ``process_view`` runs after
    every middleware's ``__call__`` and before the view, so a view that logs a user in
    (``django.contrib.auth.login()``) is not affected.
    """
    if not getattr(request, HANDLED, False) or not hasattr(request, USER_AT_CLAIM):
        return
    noted = getattr(request, USER_AT_CLAIM)
    current = request.__dict__.get("user", _NO_USER)
    if current is noted or _principal(current) == _principal(noted):
        return  # untouched, or the same user in another object (django-otp's wrapper)
    setattr(request, RAISED, True)  # roll the claim back
    raise ImproperlyConfigured(
        f"A middleware below IdempotencyMiddleware replaced request.user of {request.path_info!r} "
        "after IdempotencyMiddleware had decided the request's owner from the user the "
        "middlewares above it found: its stored response would be replayed to clients that "
        "authentication never checked. Move "
        "'django_idempotency.http.middleware.IdempotencyMiddleware' below every middleware "
        "that authenticates in MIDDLEWARE, or make the view idempotent itself (@idempotent)."
    )


def _refuse_user_replaced_below(request: HttpRequest) -> None:
    """After the view: refuse a claimed request that another principal's ``request.user`` ran
    as, unless ``login()`` or ``logout()`` made it so (a sign-up or log-out view).

    A middleware below this one that authenticates in its own ``process_view`` runs after
    :meth:`IdempotencyMiddleware.process_view`, so only the view's end sees it. Who the user
    is (its class and primary key) is compared, not the object: a DRF view authenticates
    again, and gets the same principal as another object."""
    if not getattr(request, HANDLED, False) or not hasattr(request, USER_AT_CLAIM):
        return
    noted = getattr(request, USER_AT_CLAIM)
    current = request.__dict__.get("user", _NO_USER)
    if current is noted or getattr(request, LOGGED_IN_OR_OUT, False):
        return
    if _principal(current) == _principal(noted):
        return
    raise ImproperlyConfigured(
        f"request.user of {request.path_info!r} is another principal after the view than "
        "when IdempotencyMiddleware decided the request's owner: a middleware below it "
        "authenticated the request (in its process_view). Its stored response would be "
        "replayed to clients that authentication never checked. Move "
        "'django_idempotency.http.middleware.IdempotencyMiddleware' below every middleware "
        "that authenticates in MIDDLEWARE, or make the view idempotent itself (@idempotent)."
    )


def _principal(user: Any) -> Any:
    if user is _NO_USER or user is None:
        return None
    if not getattr(user, "is_authenticated", False):
        return "anonymous"
    return (user.__class__, getattr(user, "pk", id(user)))


def _note_login(sender: Any, request: Any = None, **kwargs: Any) -> None:
    request = getattr(request, "_request", request)  # a DRF Request: Django's
    if request is not None and hasattr(request, USER_AT_CLAIM):
        setattr(request, LOGGED_IN_OR_OUT, True)


user_logged_in.connect(_note_login, dispatch_uid="django_idempotency.middleware.login")
user_logged_out.connect(_note_login, dispatch_uid="django_idempotency.middleware.logout")


def _watches_auth(request: HttpRequest, scoped: Any) -> bool:
    """Whether to check, after the view, that nothing below authenticated ``request``.

    On the plain path (no DRF view found), the owner is decided from what Django's middlewares
    above found. DRF and django-ninja set ``request.auth`` on Django's request when they
    authenticate it: a DRF or Ninja view the middleware could not see (behind a decorator that
    does not use ``functools.wraps``), or an authentication middleware below this one, shows
    up as an ``auth`` that was not there before.
    """
    return scoped is request and "auth" not in request.__dict__


def _refuse_late_authentication(request: HttpRequest) -> None:
    if "auth" not in request.__dict__ or not getattr(request, HANDLED, False):
        return  # nothing authenticated it below, or no key was claimed
    raise ImproperlyConfigured(
        f"The view of {request.path_info!r} authenticated the request (request.auth was set) "
        "after IdempotencyMiddleware had decided its owner: a DRF or django-ninja view hidden "
        "behind a decorator that does not use functools.wraps, or an authentication "
        "middleware placed below IdempotencyMiddleware. Its stored response would be replayed "
        "to clients that authentication never checked. Use functools.wraps in the decorator, "
        "move the authentication middleware above IdempotencyMiddleware, or make the view "
        "idempotent itself (IdempotentMixin, django_idempotency.http.ninja.idempotent)."
    )


def handled_request(request: HttpRequest) -> Any:
    """The request the middleware handles, or None when it leaves ``request`` alone.

    None for a method or path not listed, for a view that handles itself (decorated with
    ``@idempotent``, on the function or on the handler method of its class or DRF action, or a
    DRF view with :class:`~django_idempotency.http.drf.IdempotentMixin`), and for a DRF view whose
    own checks (authentication, permissions, built with its URL's ``as_view()`` arguments)
    refuse the request: the view answers with its own refusal. For another DRF view and a
    request with a key, the DRF ``Request`` the view's checks passed, so that the owner is DRF's
    user.
    """
    if not listed(request):
        return None
    method = (request.method or "").upper()
    try:
        match = resolve(request.path_info, getattr(request, "urlconf", None))
    except Resolver404:
        setattr(request, RESOLVED, None)
        return request
    view_class = view_class_of(match.func)
    if handles_itself(match.func, view_class, method) or is_ninja_view(match.func):
        return None
    setattr(request, RESOLVED, match.func)
    if request_header(request, conf.HEADER) is None:
        return request  # no key: nothing to replay, the view runs as it would (its checks)
    if drf_installed() and _drf().is_drf_view(view_class):
        return _drf().authenticated_request(
            request,
            view_class,
            getattr(match.func, "initkwargs", None),
            actions=getattr(match.func, "actions", None),
            args=match.args,
            kwargs=match.kwargs,
        )
    if csrf_refuses(request, match.func, match.args, match.kwargs):
        return None  # CsrfViewMiddleware answers 403, as it would without a key
    return request


def listed(request: HttpRequest) -> bool:
    """Whether ``request`` has a method in ``METHODS`` and a path in ``PATHS``."""
    if (request.method or "").upper() not in conf.METHODS:
        return False
    return any(pattern.search(request.path_info) for pattern in conf.PATHS)


def is_ninja_view(func: Any) -> bool:
    """Whether ``func`` is a django-ninja URL view (its ``PathView``'s, made in
    ``ninja.operation``), under any ``functools.wraps`` decorator."""
    module = getattr(inspect.unwrap(func), "__module__", None) or ""
    return module.startswith(NINJA_MODULES)


class _CsrfCheck(CsrfViewMiddleware):
    """Marks a refusal instead of logging it and answering 403: the project's own CSRF
    middleware does that when the request reaches it (DRF's ``CSRFCheck`` does the same)."""

    def _reject(self, request: HttpRequest, reason: str) -> Any:
        return reason


@lru_cache(maxsize=8)
def _csrf_check_class(middleware: tuple[str, ...]) -> type[CsrfViewMiddleware] | None:
    """The project's first ``CsrfViewMiddleware`` (or subclass) in ``middleware``, made quiet.

    The class is cached; an instance is made per check, since ``CsrfViewMiddleware`` caches
    settings (``CSRF_TRUSTED_ORIGINS``) on its instance."""
    for path in middleware:
        try:
            middleware_class = import_string(path)
        except ImportError:
            continue  # Django reports it
        if isinstance(middleware_class, type) and issubclass(middleware_class, CsrfViewMiddleware):
            return type("CsrfCheck", (_CsrfCheck, middleware_class), {})
    return None


def _no_response(request: HttpRequest) -> HttpResponseBase:
    raise AssertionError("a CSRF check never calls the view")


def csrf_refuses(request: HttpRequest, func: Any, args: Any, kwargs: Any) -> bool:
    """Whether the project's ``CsrfViewMiddleware`` would refuse ``request`` for ``func``.

    Django checks CSRF in ``process_view``, after every middleware's ``__call__``: after a
    replay. The check is run here first, as the middleware will run it (a view marked
    ``csrf_exempt`` passes); an accepted request is marked ``csrf_processing_done``, so the
    middleware does not check it twice.
    """
    check = _csrf_check_class(tuple(getattr(settings, "MIDDLEWARE", None) or ()))
    if check is None:
        return False
    return check(_no_response).process_view(request, func, args, kwargs) is not None


def _name(view: Any) -> str:
    if view is None:
        return "no view"
    module = getattr(view, "__module__", "?")
    return f"{module}.{getattr(view, '__qualname__', type(view).__qualname__)}"


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
