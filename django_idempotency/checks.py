"""System checks: every misconfiguration gets a stable ID and a hint that says what to change.

======================  =====================================================================
ID                      Meaning
======================  =====================================================================
django_idempotency.E001 ``IDEMPOTENCY`` holds a key this app does not know.
django_idempotency.E002 An ``IDEMPOTENCY`` value is invalid (wrong type, TTL of zero or less,
                        a Kafka consumer's duration that is NaN or infinite...).
django_idempotency.E003 ``IDEMPOTENCY`` is not a dict.
django_idempotency.E004 ``IdempotencyMiddleware`` sits before ``AuthenticationMiddleware``.
django_idempotency.E005 ``IDEMPOTENCY["OWNER"]`` cannot be imported, or is not callable.
django_idempotency.E010 On MySQL/MariaDB, a key, owner, event id, consumer or ordering key
                        column does not have a NO PAD binary collation
                        (``manage.py check --database``).
django_idempotency.W011 On PostgreSQL, ``idle_in_transaction_session_timeout`` is 0: a key's
                        lock outlives a client that vanished mid-request for hours
                        (``manage.py check --deploy``).
django_idempotency.I011 W011 could not be checked: the database could not be reached or read
                        (an INFO, which ``--fail-level WARNING`` lets pass).
django_idempotency.W001 ``RECORD_TTL`` is under 24 hours.
django_idempotency.W002 ``EVENT_TTL`` is shorter than ``RECORD_TTL``.
django_idempotency.W020 The middleware handles DRF views before their permission checks.
django_idempotency.E021 A lease-mode method view runs under ``ATOMIC_REQUESTS``.
django_idempotency.W022 A middleware below ``IdempotencyMiddleware`` defines process_exception.
django_idempotency.E030 An ``OUTBOX_TRANSPORTS`` backend cannot be imported.
django_idempotency.E031 An ``OUTBOX_TRANSPORTS`` backend has no ``send`` and ``close`` methods.
django_idempotency.E032 An ``OUTBOX_TRANSPORTS`` backend does not take its ``OPTIONS``, or
                        refuses one of their values (``KafkaTransport``: a
                        ``message.timeout.ms`` longer than its ``timeout``).
django_idempotency.E033 An ``OUTBOX_TRANSPORTS`` backend the project configures needs a library
                        that is not installed (Celery, confluent-kafka): the check names the
                        extra to install.
django_idempotency.E040 ``KAFKA_CONSUMERS`` is set but confluent-kafka is not installed.
django_idempotency.E041 A Kafka consumer's ``HANDLER`` cannot be imported or is not callable.
django_idempotency.E050 ``ENCRYPTION_KEYS`` holds keys but ``cryptography`` is not installed
                        (:mod:`django_idempotency.protection.checks`).
django_idempotency.E051 ``OUTBOX_ENCRYPT`` is on but no encryption key is set.
django_idempotency.E052 ``ENCRYPTION_MODE`` is ``"decrypt-only"`` but no encryption key is set.
django_idempotency.W053 ``OUTBOX_ENCRYPT`` is on in the ``"decrypt-only"`` mode, which wins.
======================  =====================================================================
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_idempotency.conf import OPTIONS, SETTING_NAME, conf
from django_idempotency.extras import EXTRAS
from django_idempotency.kafka.settings import check_consumers as check_kafka_consumers

MIDDLEWARE_PATH = "django_idempotency.http.middleware.IdempotencyMiddleware"
AUTHENTICATION_MIDDLEWARE_PATH = "django.contrib.auth.middleware.AuthenticationMiddleware"
MIN_RECORD_TTL = timedelta(hours=24)
OWNER_ERROR = "django_idempotency.E005"


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    try:
        user = conf.user_settings()
    except ImproperlyConfigured as exc:
        return [
            Error(str(exc), hint=f"Set {SETTING_NAME} = {{...}}.", id="django_idempotency.E003")
        ]
    messages: list[CheckMessage] = []
    # key=repr: a key that is not a string (a stray timedelta, an int) is reported too, and
    # keys of two types cannot be compared.
    for name in sorted(set(user) - set(OPTIONS), key=repr):
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
    messages.extend(check_kafka_consumers(valid.get("KAFKA_CONSUMERS") or {}))
    if valid.get("OWNER"):
        messages.extend(_owner_errors(valid["OWNER"]))
    return messages


def _owner_errors(path: str) -> list[CheckMessage]:
    hint = "Point it at a callable that takes the request and returns a string."
    try:
        owner = import_string(path)
    except ImportError as exc:
        problem = f"cannot be imported: {exc}"
    else:
        if callable(owner) and not inspect.ismodule(owner):
            return []
        problem = f"names a {type(owner).__name__}, which is not callable"
    return [Error(f"{SETTING_NAME}['OWNER'] = {path!r} {problem}.", hint=hint, id=OWNER_ERROR)]


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


@register(Tags.database)
def check_binary_collation(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Run by ``migrate`` and ``manage.py check --database ALIAS``: it queries the database."""
    from django.db import connections

    from django_idempotency.collation import binary_collation, non_binary_columns

    messages: list[CheckMessage] = []
    for alias in databases or ():
        connection = connections[alias]
        for table, column, collation in non_binary_columns(connection):
            wanted = binary_collation(connection)
            messages.append(
                Error(
                    f"{table}.{column} on database {alias!r} has the collation {collation!r}, "
                    "which does not compare byte for byte: two keys or event ids that differ "
                    "only in case or in trailing spaces (a PAD SPACE collation such as "
                    "utf8mb4_bin ignores those) would be taken for one, and a different event "
                    "skipped.",
                    hint=f"Run migrate (0009_nopad_collation), or give it {wanted!r} again: "
                    f"ALTER TABLE {table} MODIFY {column} ... COLLATE {wanted} (keep its type "
                    "and NULL-ness).",
                    id="django_idempotency.E010",
                )
            )
    return messages


IDLE_IN_TRANSACTION = "django_idempotency.W011"
IDLE_IN_TRANSACTION_UNCHECKED = "django_idempotency.I011"
CHECK_CONNECT_TIMEOUT = 5
"""Seconds W011's check waits for a connection it opens itself (``connect_timeout``): a
database that never answers (a firewall that drops packets) would otherwise hold
``check --deploy`` for as long as the operating system waits."""


# Registered without Tags.database: since Django 6.1 a check with that tag runs only when
# ``check`` is given ``--database``, and this one must run on a plain ``check --deploy``. Being a
# deployment check already keeps it (and its query) out of ``runserver`` and the test runner.
@register(deploy=True)
def check_idle_in_transaction_timeout(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """``manage.py check --deploy``: warn when PostgreSQL never ends an idle transaction.

    A request in atomic mode holds its key's advisory lock (and its rows' locks) until its
    transaction ends. If the app server vanishes without closing its connection (a half-open
    TCP connection: a host that died, a cut network), PostgreSQL keeps the transaction until it
    notices, about two hours with the default TCP keepalives, and every retry of the key gets
    409 meanwhile. ``idle_in_transaction_session_timeout`` ends such a session sooner.

    It reads the setting as the library's sessions get it (server, database and role
    defaults): on ``IDEMPOTENCY["DATABASE"]``, or on the aliases given with ``--database``.
    ``check --deploy`` often runs where the database is not (an image build, CI): a database
    that cannot be reached, or cannot be read, is an INFO (I011) that says it was not checked,
    never a warning that fails ``--fail-level WARNING``.
    """
    from django.db import DatabaseError, connections

    from django_idempotency.outages import describe

    messages: list[CheckMessage] = []
    # Django 6.1 passes every alias when none was named: read that as "none named".
    named = databases and sorted(databases) != sorted(connections)
    for alias in databases if named else [conf.DATABASE]:
        if connections[alias].vendor != "postgresql":
            continue
        try:
            setting, reached = _idle_in_transaction_timeout(alias)
        except DatabaseError as exc:
            setting, reached = describe(exc), False
        if not reached:
            messages.append(
                Info(
                    f"idle_in_transaction_session_timeout was not checked on database {alias!r}: "
                    f"the database could not be reached or read ({setting}).",
                    hint="Run check --deploy where the database answers, or check that it is "
                    "not 0 there: SHOW idle_in_transaction_session_timeout;",
                    id=IDLE_IN_TRANSACTION_UNCHECKED,
                )
            )
        elif setting == "0":
            messages.append(
                Warning(
                    f"idle_in_transaction_session_timeout is 0 on database {alias!r}: a "
                    "request whose client vanished (a half-open connection) keeps its "
                    "idempotency key locked until PostgreSQL notices, about two hours with the "
                    "default TCP keepalives, and every retry of that key gets 409 meanwhile.",
                    hint="Set it longer than your slowest request, e.g. ALTER ROLE <app role> "
                    "SET idle_in_transaction_session_timeout = '5min', and lower the "
                    "tcp_keepalives_* settings; see docs/operations.md, Half-open connections.",
                    id=IDLE_IN_TRANSACTION,
                )
            )
    return messages


def _idle_in_transaction_timeout(alias: str) -> tuple[str, bool]:
    """``(setting, True)`` as a session of ``alias`` gets it, or ``(what failed, False)``.

    On the alias's connection when it is open; else on a connection of its own, opened with
    ``connect_timeout`` at most :data:`CHECK_CONNECT_TIMEOUT` and closed afterwards (the alias's
    settings are not changed). A connection pool (``OPTIONS["pool"]``) is used as it is.
    """
    import copy

    from django.db import connections

    connection = connections[alias]
    own = None
    if connection.connection is None and "pool" not in connection.settings_dict["OPTIONS"]:
        settings_dict = copy.deepcopy(connection.settings_dict)
        options = settings_dict["OPTIONS"]
        timeout = options.get("connect_timeout")
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= CHECK_CONNECT_TIMEOUT:
            options["connect_timeout"] = CHECK_CONNECT_TIMEOUT
        own = connection = type(connection)(settings_dict, alias)
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT setting FROM pg_settings "
                "WHERE name = 'idle_in_transaction_session_timeout'"
            )
            row = cursor.fetchone()
    finally:
        if own is not None:
            own.close()
    if row is None:
        return "no such setting", False
    return str(row[0]), True


#: The library each built-in transport imports when it sends, and the extra that installs it.
TRANSPORT_LIBRARIES = {
    "django_idempotency.outbox.transports.CeleryTransport": ("celery", "celery"),
    "django_idempotency.kafka.transport.KafkaTransport": ("confluent_kafka", "kafka"),
    "django_idempotency.outbox.dramatiq.DramatiqTransport": ("dramatiq", "dramatiq"),
}


#: An ImportError raised by :func:`django_idempotency.extras.missing_extra` names its extra.
NAMES_AN_EXTRA = re.compile(r"pip install 'django-idempotency\[([a-z]+)\]'")


def _extra_named_by(error: ImportError) -> tuple[str, str] | None:
    """(library, extra) when importing a backend failed because an extra is not installed: a
    built-in transport's module (``KafkaTransport``'s imports confluent-kafka at its top), or a
    project's subclass of one, raises :func:`~django_idempotency.extras.missing_extra`'s error."""
    named = NAMES_AN_EXTRA.search(str(error))
    if named is None or named.group(1) not in EXTRAS:
        return None
    extra = named.group(1)
    libraries = {wanted: module for module, wanted in TRANSPORT_LIBRARIES.values()}
    return libraries.get(extra, EXTRAS[extra]), extra


def _missing_library_error(name: str, backend: str, module: str, extra: str) -> Error:
    return Error(
        f"{SETTING_NAME}['OUTBOX_TRANSPORTS'][{name!r}]['BACKEND'] = {backend!r} "
        f"needs {module}, which is not installed.",
        hint=f"pip install 'django-idempotency[{extra}]'. Without it the relay "
        "fails every message of this transport until each is parked.",
        id="django_idempotency.E033",
    )


def _missing_library(cls: Any) -> tuple[str, str] | None:
    """(module, extra) when ``cls`` is, or extends, a built-in transport whose library is not
    installed. The transports import it only when they send, so importing ``cls`` says
    nothing."""
    for klass in getattr(cls, "__mro__", ()):
        needed = TRANSPORT_LIBRARIES.get(f"{klass.__module__}.{klass.__qualname__}")
        if needed is not None:
            try:
                found = importlib.util.find_spec(needed[0]) is not None
            except (ImportError, ValueError):
                found = False
            return None if found else needed
    return None


@register(Tags.compatibility)
def check_outbox_transports(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Each configured outbox transport's BACKEND imports and looks like a transport."""
    try:
        transports = conf.OUTBOX_TRANSPORTS
    except ImproperlyConfigured:
        return []  # E002 already says what is wrong with the setting
    messages: list[CheckMessage] = []
    user_settings = getattr(settings, SETTING_NAME, None)
    configured = isinstance(user_settings, dict) and "OUTBOX_TRANSPORTS" in user_settings
    for name, entry in transports.items():
        backend = entry["BACKEND"]
        try:
            cls = import_string(backend)
        except ImportError as exc:
            missing = _extra_named_by(exc)
            if missing is not None:
                # E033, not E030: the backend is right, the library it needs is not installed.
                if configured:
                    messages.append(_missing_library_error(name, backend, *missing))
                continue
            messages.append(
                Error(
                    f"{SETTING_NAME}['OUTBOX_TRANSPORTS'][{name!r}]['BACKEND'] = {backend!r} "
                    f"cannot be imported: {exc}.",
                    hint="Point it at a transport class, such as "
                    "'django_idempotency.outbox.transports.CeleryTransport', and install its "
                    "dependencies.",
                    id="django_idempotency.E030",
                )
            )
            continue
        if not all(callable(getattr(cls, method, None)) for method in ("send", "close")):
            messages.append(
                Error(
                    f"{SETTING_NAME}['OUTBOX_TRANSPORTS'][{name!r}]['BACKEND'] = {backend!r} "
                    "is not an outbox transport: it lacks send(messages) or close().",
                    hint="See django_idempotency.outbox.transports.Transport for the interface.",
                    id="django_idempotency.E031",
                )
            )
            continue
        missing = _missing_library(cls)
        # Only for transports the project names: a bare install that never writes to the outbox
        # keeps the default (Celery) transport without Celery, and must pass its checks.
        if missing is not None and configured:
            messages.append(_missing_library_error(name, backend, *missing))
            continue
        options = entry.get("OPTIONS", {})
        try:
            # Checked without building the transport (which may connect to a broker).
            inspect.signature(cls).bind(**options)
        except TypeError as exc:
            messages.append(
                Error(
                    f"{SETTING_NAME}['OUTBOX_TRANSPORTS'][{name!r}]['OPTIONS'] = {options!r} "
                    f"does not fit {backend}: {exc}.",
                    hint="Name only the options its __init__ takes; a misspelt one would fail "
                    "every message at send time, until each is parked.",
                    id="django_idempotency.E032",
                )
            )
            continue
        except ValueError:
            continue  # no signature to read (a builtin): the relay will say at send time
        # A transport may refuse option values too (KafkaTransport: a message.timeout.ms that
        # outlives its timeout), through a static check_options(**OPTIONS), without a broker.
        check_options = getattr(cls, "check_options", None)
        if callable(check_options):
            try:
                check_options(**options)
            except ImproperlyConfigured as exc:
                messages.append(
                    Error(
                        f"{SETTING_NAME}['OUTBOX_TRANSPORTS'][{name!r}]['OPTIONS'] does not fit "
                        f"{backend}: {exc}",
                        hint="Change the option the message names: the relay cannot build "
                        "this transport, so every message of it would fail until each is parked.",
                        id="django_idempotency.E032",
                    )
                )
    return messages
