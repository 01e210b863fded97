"""System checks of the HTTP set-up: the views that the middleware and the decorator meet.

======================  =====================================================================
ID                      Meaning
======================  =====================================================================
django_idempotency.W020 The middleware replays DRF views before their throttles and object checks.
django_idempotency.E021 A lease-mode method view runs under ``ATOMIC_REQUESTS``.
django_idempotency.W022 A middleware below ``IdempotencyMiddleware`` defines process_exception.
django_idempotency.W023 A middleware below ``IdempotencyMiddleware`` changes which view a path is.
django_idempotency.W024 Django-ninja operations under ``PATHS`` without Ninja's ``idempotent``.
======================  =====================================================================

IDs E020-E029 / W020-W029 belong to the HTTP adapters. ``AppConfig.ready()`` imports this
module, which registers them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_idempotency.checks import MIDDLEWARE_PATH
from django_idempotency.conf import conf

#: How many views a check message names before "and N more".
LISTED_VIEWS = 5


def url_views() -> list[tuple[str, Any]]:
    """Every ``(path, view function)`` of the root URLconf. A path keeps its converters
    (``/api/orders/<int:pk>/``); a regex route loses its ``^`` and ``$``.

    A project without ``ROOT_URLCONF`` (a settings module for Celery workers, the relay or the
    Kafka runner) has no views: none are listed, as Django's own URL checks skip it. Asking
    ``get_resolver()`` there raised ``AttributeError`` from every command that runs checks."""
    from django.urls import URLResolver, get_resolver

    if not getattr(settings, "ROOT_URLCONF", None):
        return []

    found: list[tuple[str, Any]] = []

    def walk(resolver: Any, prefix: str) -> None:
        for entry in resolver.url_patterns:
            route = prefix + str(entry.pattern).lstrip("^").rstrip("$").replace("\\/", "/")
            if isinstance(entry, URLResolver):
                walk(entry, route)
            else:
                found.append(("/" + route, entry.callback))

    walk(get_resolver(), "")
    return found


def _named(paths: list[str]) -> str:
    shown = ", ".join(paths[:LISTED_VIEWS])
    return shown + (f" and {len(paths) - LISTED_VIEWS} more" if len(paths) > LISTED_VIEWS else "")


@register(Tags.urls)
def check_http_views(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W020-W024: set-ups in which a view would get a stored response it should not."""
    messages: list[CheckMessage] = []
    try:
        paths = conf.PATHS
        database = conf.DATABASE
    except ImproperlyConfigured:
        return []  # check_settings reports it (E002)
    views = url_views()
    middleware = list(getattr(settings, "MIDDLEWARE", None) or [])
    if MIDDLEWARE_PATH in middleware:
        messages.extend(_drf_views_under_the_middleware(views, paths))
        messages.extend(_exception_middleware_below(middleware))
        messages.extend(_urlconf_middleware_below(middleware))
        messages.extend(_ninja_operations_under_the_middleware(views, paths))
    messages.extend(_lease_views_in_atomic_requests(views, database))
    return messages


def _drf_views_under_the_middleware(views: list[tuple[str, Any]], paths: Any) -> list[Warning]:
    from django_idempotency.http.middleware import (
        drf_installed,
        handler_of,
        handles_itself,
        view_class_of,
    )

    if not drf_installed():
        return []
    from django_idempotency.http.drf import is_drf_view

    def exposed_view(func: Any) -> bool:
        view_class = view_class_of(func)
        if not is_drf_view(view_class):
            return False
        answered = [m for m in conf.METHODS if handler_of(func, view_class, m) is not None]
        return not all(handles_itself(func, view_class, method) for method in answered)

    exposed = [
        path
        for path, func in views
        if any(pattern.search(path) for pattern in paths) and exposed_view(func)
    ]
    if not exposed:
        return []
    return [
        Warning(
            f"IdempotencyMiddleware replays to DRF views before their throttles and their "
            f"object-level permissions run: {_named(exposed)}. It runs their authentication "
            "and permission classes first, but a client that lost access to the object, or "
            "is over its rate, still gets its own stored response replayed.",
            hint="Add django_idempotency.http.drf.IdempotentMixin to these views (first among the "
            "bases): the stored response is then reached only after DRF's authentication, "
            "permission and throttle checks. See docs/security.md.",
            id="django_idempotency.W020",
        )
    ]


def _lease_views_in_atomic_requests(views: list[tuple[str, Any]], database: str) -> list[Error]:
    from django.db import connections

    from django_idempotency.http.handler import OPTIONS_ATTRIBUTE
    from django_idempotency.http.middleware import view_class_of

    if not connections.settings.get(database, {}).get("ATOMIC_REQUESTS"):
        return []
    stuck = []
    for path, func in views:
        if database in getattr(func, "_non_atomic_requests", ()):
            continue
        view_class = view_class_of(func)
        actions = getattr(func, "actions", None) or {}  # a DRF ViewSet: method -> action
        names = set(actions.values()) or set(getattr(view_class, "http_method_names", ()))
        handlers = [getattr(view_class, name, None) for name in names] if view_class else []
        options = [getattr(h, OPTIONS_ATTRIBUTE, None) for h in handlers]
        if any(option is not None and not option.atomic for option in options):
            stuck.append(path)
    if not stuck:
        return []
    return [
        Error(
            f"Lease-mode views run under ATOMIC_REQUESTS on database {database!r}: "
            f"{_named(stuck)}. @idempotent(atomic=False) on a method cannot mark the view "
            "non-atomic, so every request would fail.",
            hint="Use django_idempotency.http.drf.IdempotentMixin with idempotency_atomic = False "
            "for "
            "a DRF view, or add @method_decorator(transaction.non_atomic_requests("
            f"using={database!r}), name='dispatch') to the class.",
            id="django_idempotency.E021",
        )
    ]


def _middleware_below(middleware: list[str]) -> Iterator[tuple[str, Any]]:
    """Each middleware after IdempotencyMiddleware in MIDDLEWARE: its path and what it names
    (one that cannot be imported is left out: Django reports it)."""
    for path in middleware[middleware.index(MIDDLEWARE_PATH) + 1 :]:
        try:
            middleware_class = import_string(path)
        except ImportError:
            continue  # Django reports it
        yield path, middleware_class


def _exception_middleware_below(middleware: list[str]) -> list[Warning]:
    below = [
        path
        for path, middleware_class in _middleware_below(middleware)
        if hasattr(middleware_class, "process_exception")
    ]
    if not below:
        return []
    return [
        Warning(
            f"{', '.join(below)} come after IdempotencyMiddleware and define process_exception. "
            "If one turns a view's exception into a response, IdempotencyMiddleware never "
            "learns that the view raised: the view's partial writes commit and that response "
            "is stored and replayed.",
            hint=f"Move {MIDDLEWARE_PATH!r} after them in MIDDLEWARE, so that it sees the "
            "exception first (process_exception runs from the last middleware to the first).",
            id="django_idempotency.W022",
        )
    ]


#: Middlewares known to set ``request.urlconf`` (per-host URLs).
URLCONF_MIDDLEWARE = ("django_hosts.middleware.HostsRequestMiddleware",)


def _urlconf_middleware_below(middleware: list[str]) -> list[Warning]:
    """W023: a middleware below ours that makes Django resolve a path to another view."""
    from django.conf.urls.i18n import is_language_prefix_patterns_used
    from django.middleware.locale import LocaleMiddleware
    from django.urls import Resolver404

    below = []
    for path, middleware_class in _middleware_below(middleware):
        if path in URLCONF_MIDDLEWARE:
            below.append(path)
        elif isinstance(middleware_class, type) and issubclass(middleware_class, LocaleMiddleware):
            root = getattr(settings, "ROOT_URLCONF", None)
            try:
                prefixed = bool(root) and is_language_prefix_patterns_used(str(root))[0]
            except (ImportError, Resolver404):  # pragma: no cover - Django's URL checks say why
                prefixed = False
            if prefixed:
                below.append(path)
    if not below:
        return []
    return [
        Warning(
            f"{', '.join(below)} come after IdempotencyMiddleware and change which view a path "
            "is (request.urlconf, or the language prefix of i18n_patterns). IdempotencyMiddleware "
            "decides the owner for the view it resolves before they run: each request whose "
            "view then differs is refused with ImproperlyConfigured.",
            hint=f"Move {MIDDLEWARE_PATH!r} after them in MIDDLEWARE.",
            id="django_idempotency.W023",
        )
    ]


def _ninja_operations_under_the_middleware(
    views: list[tuple[str, Any]], paths: Any
) -> list[Warning]:
    """W024: Ninja operations under PATHS that only Ninja's own decorator makes idempotent."""
    from django_idempotency.http.handler import OPTIONS_ATTRIBUTE
    from django_idempotency.http.middleware import is_ninja_view

    bare = []
    for path, func in views:
        if not any(pattern.search(path) for pattern in paths) or not is_ninja_view(func):
            continue
        for operation in _ninja_operations(func):
            methods = set(getattr(operation, "methods", ())) & set(conf.METHODS)
            if methods and not hasattr(operation.view_func, OPTIONS_ATTRIBUTE):
                bare.append(f"{'/'.join(sorted(methods))} {path}")
    if not bare:
        return []
    return [
        Warning(
            f"IdempotencyMiddleware leaves django-ninja operations to Ninja, and these under "
            f"PATHS are not idempotent: {_named(bare)}. The middleware runs before Ninja's "
            "authentication, so it cannot tell whose key a request is.",
            hint="Decorate them with django_idempotency.http.ninja.idempotent (it runs after "
            "Ninja's authentication), or take their paths out of IDEMPOTENCY['PATHS'].",
            id="django_idempotency.W024",
        )
    ]


def _ninja_operations(func: Any) -> list[Any]:
    """The operations of a django-ninja URL view: its ``PathView``'s, found in its closure."""
    import inspect

    operations: list[Any] = []
    for cell in getattr(inspect.unwrap(func), "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        operations.extend(getattr(value, "operations", None) or ())
    return operations
