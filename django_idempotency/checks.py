"""System checks: every misconfiguration gets a stable ID and a hint that says what to change.

======================  =====================================================================
ID                      Meaning
======================  =====================================================================
django_idempotency.E001 ``IDEMPOTENCY`` holds a key this app does not know.
django_idempotency.E002 An ``IDEMPOTENCY`` value is invalid (wrong type, TTL of zero or less...).
django_idempotency.E003 ``IDEMPOTENCY`` is not a dict.
django_idempotency.E004 ``IdempotencyMiddleware`` sits before ``AuthenticationMiddleware``.
django_idempotency.E005 ``IDEMPOTENCY["OWNER"]`` cannot be imported.
django_idempotency.W001 ``RECORD_TTL`` is under 24 hours.
django_idempotency.W002 ``EVENT_TTL`` is shorter than ``RECORD_TTL``.
django_idempotency.W020 The middleware handles DRF views before their permission checks.
django_idempotency.E021 A lease-mode method view runs under ``ATOMIC_REQUESTS``.
django_idempotency.W022 A middleware below ``IdempotencyMiddleware`` defines process_exception.
======================  =====================================================================
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_idempotency.conf import OPTIONS, SETTING_NAME, conf

MIDDLEWARE_PATH = "django_idempotency.middleware.IdempotencyMiddleware"
AUTHENTICATION_MIDDLEWARE_PATH = "django.contrib.auth.middleware.AuthenticationMiddleware"
MIN_RECORD_TTL = timedelta(hours=24)


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    try:
        user = conf.user_settings()
    except ImproperlyConfigured as exc:
        return [
            Error(str(exc), hint=f"Set {SETTING_NAME} = {{...}}.", id="django_idempotency.E003")
        ]
    messages: list[CheckMessage] = []
    for name in sorted(set(user) - set(OPTIONS)):
        messages.append(
            Error(
                f"{SETTING_NAME}[{name!r}] is not a django-idempotency setting.",
                hint=f"Remove it or correct the spelling. Known keys: {', '.join(OPTIONS)}.",
                id="django_idempotency.E001",
            )
        )
    valid: dict[str, Any] = {}
    for name in OPTIONS:
        try:
            valid[name] = conf.value(name)
        except ImproperlyConfigured as exc:
            messages.append(
                Error(
                    str(exc),
                    hint=f"Default: {OPTIONS[name].default!r}. {OPTIONS[name].doc}",
                    id="django_idempotency.E002",
                )
            )
    messages.extend(_ttl_warnings(valid))
    if valid.get("OWNER"):
        try:
            import_string(valid["OWNER"])
        except ImportError as exc:
            messages.append(
                Error(
                    f"{SETTING_NAME}['OWNER'] = {valid['OWNER']!r} cannot be imported: {exc}.",
                    hint="Point it at a callable that takes the request and returns a string.",
                    id="django_idempotency.E005",
                )
            )
    return messages


def _ttl_warnings(valid: dict[str, Any]) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    record_ttl = valid.get("RECORD_TTL")
    event_ttl = valid.get("EVENT_TTL")
    if record_ttl is not None and record_ttl < MIN_RECORD_TTL:
        messages.append(
            Warning(
                f"{SETTING_NAME}['RECORD_TTL'] is {record_ttl}, under 24 hours.",
                hint="A client that retries after an outage would no longer be recognised and "
                "its request would run twice. Keep at least timedelta(hours=24).",
                id="django_idempotency.W001",
            )
        )
    if record_ttl is not None and event_ttl is not None and event_ttl < record_ttl:
        messages.append(
            Warning(
                f"{SETTING_NAME}['EVENT_TTL'] ({event_ttl}) is shorter than "
                f"RECORD_TTL ({record_ttl}).",
                hint="Events are redelivered later than HTTP retries arrive; "
                "raise EVENT_TTL to at least RECORD_TTL.",
                id="django_idempotency.W002",
            )
        )
    return messages


@register(Tags.compatibility)
def check_middleware_order(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    middleware = list(getattr(settings, "MIDDLEWARE", None) or [])
    if MIDDLEWARE_PATH not in middleware or AUTHENTICATION_MIDDLEWARE_PATH not in middleware:
        return []
    if middleware.index(MIDDLEWARE_PATH) < middleware.index(AUTHENTICATION_MIDDLEWARE_PATH):
        return [
            Error(
                "IdempotencyMiddleware is placed before AuthenticationMiddleware, so every key "
                "would be scoped to an anonymous owner.",
                hint=f"Move {MIDDLEWARE_PATH!r} after {AUTHENTICATION_MIDDLEWARE_PATH!r} "
                "in MIDDLEWARE.",
                id="django_idempotency.E004",
            )
        ]
    return []


# --- HTTP set-up checks: the views the middleware and the decorator meet -----------------------
# IDs E020-E029 / W020-W029 belong to the HTTP adapters (django_idempotency.http, .middleware,
# .decorators, .drf).

#: How many views a check message names before "and N more".
LISTED_VIEWS = 5


def url_views() -> list[tuple[str, Any]]:
    """Every ``(path, view function)`` of the root URLconf. A path keeps its converters
    (``/api/orders/<int:pk>/``); a regex route loses its ``^`` and ``$``."""
    from django.urls import URLResolver, get_resolver

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
    """W020, E021, W022: set-ups in which a view would get a stored response it should not."""
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
    messages.extend(_lease_views_in_atomic_requests(views, database))
    return messages


def _drf_views_under_the_middleware(views: list[tuple[str, Any]], paths: Any) -> list[Warning]:
    from django_idempotency.middleware import (
        drf_installed,
        handler_of,
        handles_itself,
        view_class_of,
    )

    if not drf_installed():
        return []
    from django_idempotency.drf import is_drf_view

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
            f"IdempotencyMiddleware handles DRF views before DRF checks their permissions: "
            f"{_named(exposed)}. A client that lost a permission still gets the stored "
            "response replayed.",
            hint="Add django_idempotency.drf.IdempotentMixin to these views (first among the "
            "bases): the stored response is then reached only after DRF's authentication, "
            "permission and throttle checks. See docs/security.md.",
            id="django_idempotency.W020",
        )
    ]


def _lease_views_in_atomic_requests(views: list[tuple[str, Any]], database: str) -> list[Error]:
    from django.db import connections

    from django_idempotency.decorators import OPTIONS_ATTRIBUTE
    from django_idempotency.middleware import view_class_of

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
            hint="Use django_idempotency.drf.IdempotentMixin with idempotency_atomic = False for "
            "a DRF view, or add @method_decorator(transaction.non_atomic_requests("
            f"using={database!r}), name='dispatch') to the class.",
            id="django_idempotency.E021",
        )
    ]


def _exception_middleware_below(middleware: list[str]) -> list[Warning]:
    below = []
    for path in middleware[middleware.index(MIDDLEWARE_PATH) + 1 :]:
        try:
            middleware_class = import_string(path)
        except ImportError:
            continue  # Django reports it
        if hasattr(middleware_class, "process_exception"):
            below.append(path)
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
