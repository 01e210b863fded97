"""Settings for django-idempotency, read lazily from one ``IDEMPOTENCY`` dict.

Every option is declared once in :data:`OPTIONS`, with its default and the function that
validates a user's value. :data:`conf` reads ``settings.IDEMPOTENCY`` lazily, on first access,
and keeps each parsed value until Django's ``setting_changed`` signal says ``IDEMPOTENCY`` (or
``DATABASES``) changed, so a request does not parse its settings again (a dozen reads a request)
while ``override_settings`` still works in tests. Nothing is read at import time.

.. code-block:: python

    IDEMPOTENCY = {
        "RECORD_TTL": timedelta(hours=48),
        "PATHS": [r"^/api/"],
    }

Why this module is long: it is the one table of every setting (its default, its parser and its
typed accessor), across all the concerns; splitting it by concern would spread the checks that
docs/settings.md is tested against over several files.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from django_idempotency.kafka.settings import ConsumerSettings, parse_consumers

SETTING_NAME = "IDEMPOTENCY"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


def _error(name: str, message: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f"{SETTING_NAME}[{name!r}] {message}")


MAX_DURATION = timedelta(days=3650)
"""The longest TTL or lease: ten years. Beyond it ``now + ttl`` nears the end of the calendar
(a ``datetime`` stops at year 9999) and no retry or redelivery is that late."""

MAX_SECONDS = MAX_DURATION.total_seconds()

MAX_BATCH_SIZE = 1_000_000
"""The largest purge batch: one transaction of this many rows is already long."""


def _duration(name: str, value: Any) -> timedelta:
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise _error(name, f"must be a timedelta or a number of seconds, not {value!r}.")
    if not isinstance(value, timedelta):
        if not math.isfinite(value) or abs(value) > MAX_SECONDS:
            raise _error(
                name, f"must be a finite duration of at most {MAX_DURATION}, not {value!r}."
            )
        value = timedelta(seconds=value)
    if value <= timedelta(0):
        raise _error(name, f"must be longer than zero, not {value}.")
    if value > MAX_DURATION:
        raise _error(name, f"must be at most {MAX_DURATION} (ten years), not {value}.")
    duration: timedelta = value
    return duration


def _seconds(name: str, value: Any) -> float:
    """A non-negative, finite number of seconds (a timedelta is accepted too)."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= MAX_SECONDS
    ):
        raise _error(
            name,
            f"must be zero or a positive, finite number of seconds (at most {MAX_SECONDS:.0f}), "
            f"not {value!r}.",
        )
    return float(value)


def _positive_int(maximum: int | None = None) -> Callable[[str, Any], int]:
    def parse(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _error(name, f"must be a positive integer, not {value!r}.")
        if maximum is not None and value > maximum:
            raise _error(name, f"must be at most {maximum}, not {value}.")
        return int(value)

    return parse


def _strings(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise _error(name, f"must be a list or tuple of strings, not {value!r}.")
    items = tuple(value)
    if not all(isinstance(item, str) for item in items):
        raise _error(name, f"must contain only strings, not {items!r}.")
    return items


def _methods(name: str, value: Any) -> frozenset[str]:
    methods = frozenset(method.upper() for method in _strings(name, value))
    unsafe = methods & SAFE_METHODS
    if unsafe:
        raise _error(
            name,
            f"lists {', '.join(sorted(unsafe))}: safe methods are never handled. "
            "List only POST, PUT, PATCH or DELETE.",
        )
    return methods


def _header(name: str, value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9-]+", value):
        raise _error(name, f"must be a header name such as 'Idempotency-Key', not {value!r}.")
    return value


def _patterns(name: str, value: Any) -> tuple[re.Pattern[str], ...]:
    compiled = []
    for pattern in _strings(name, value):
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise _error(name, f"holds an invalid regular expression {pattern!r}: {exc}.") from exc
    return tuple(compiled)


def _client_error_statuses(name: str, value: Any) -> frozenset[int]:
    """4xx statuses only: a 2xx or 3xx answer has taken effect, and must be stored and replayed
    (releasing its record would let every retry run the command again); a 5xx is never stored."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _error(name, f"must be a list of HTTP status codes, not {value!r}.")
    codes = tuple(value)
    if not all(isinstance(code, int) and not isinstance(code, bool) for code in codes):
        raise _error(name, f"must contain only HTTP status codes, not {codes!r}.")
    others = sorted(code for code in codes if not 400 <= code <= 499)
    if others:
        raise _error(
            name,
            f"may list only 4xx statuses, not {', '.join(map(str, others))}: a response that "
            "took effect must be stored, or every retry would run the command again.",
        )
    return frozenset(codes)


def _database(name: str, value: Any) -> str:
    if not isinstance(value, str) or value not in settings.DATABASES:
        raise _error(
            name,
            f"names the database alias {value!r}, which is not in DATABASES "
            f"({', '.join(settings.DATABASES)}).",
        )
    return value


def _optional_dotted_path(name: str, value: Any) -> str | None:
    if value is None:
        return None
    # Every part a Python name: import_string() raises ValueError or TypeError, not
    # ImportError, for a relative path such as ".owners.by_tenant".
    if (
        not isinstance(value, str)
        or "." not in value
        or not all(part.isidentifier() for part in value.split("."))
    ):
        raise _error(name, f"must be a dotted path to a callable, or None, not {value!r}.")
    return value


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _error(name, f"must be True or False, not {value!r}.")
    return value


def _kafka_consumers(name: str, value: Any) -> Any:
    return parse_consumers(name, value)


PARTITION_INTERVALS = ("day", "month")


def _partition_interval(name: str, value: Any) -> str | None:
    """None (a plain table) or the range of one ``ProcessedEvent`` partition; PostgreSQL only."""
    if value is None:
        return None
    if value not in PARTITION_INTERVALS:
        raise _error(name, f"must be None, 'day' or 'month', not {value!r}.")
    from django.db import connections

    alias = IdempotencySettings.user_settings().get("DATABASE", "default")
    # A DATABASE that is not an alias (a list of them, say) is DATABASE's own error; it must
    # not make this one raise TypeError (unhashable) instead.
    known = isinstance(alias, str) and alias in settings.DATABASES
    if known and connections[alias].vendor != "postgresql":
        raise _error(
            name,
            f"asks for partitioned events, which need PostgreSQL; the database {alias!r} is "
            f"{connections[alias].vendor}. Remove the key: the plain table and the batched "
            "purge (idempotency_purge) work on every database.",
        )
    return str(value)


def _outbox_transports(name: str, value: Any) -> dict[str, dict[str, Any]]:
    """``{name: {"BACKEND": dotted path, "OPTIONS": {...}}}``, with a ``"default"`` entry."""
    if not isinstance(value, dict) or not value:
        raise _error(name, f"must be a non-empty dict of transport names, not {value!r}.")
    parsed: dict[str, dict[str, Any]] = {}
    for transport, entry in value.items():
        if not isinstance(transport, str) or not transport or len(transport) > 100:
            raise _error(name, f"has the transport name {transport!r}: use a short string.")
        if not isinstance(entry, dict) or set(entry) - {"BACKEND", "OPTIONS"}:
            raise _error(
                name, f"[{transport!r}] must be a dict with BACKEND and OPTIONS, not {entry!r}."
            )
        backend, options = entry.get("BACKEND"), entry.get("OPTIONS", {})
        if not isinstance(backend, str) or "." not in backend:
            raise _error(
                name, f"[{transport!r}]['BACKEND'] must be a dotted path, not {backend!r}."
            )
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            raise _error(name, f"[{transport!r}]['OPTIONS'] must be a dict, not {options!r}.")
        parsed[transport] = {"BACKEND": backend, "OPTIONS": options}
    if "default" not in parsed:
        raise _error(name, "must have a 'default' transport, the one messages use unless named.")
    return parsed


def _type_base(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise _error(name, f"must be a non-empty URI prefix without spaces, not {value!r}.")
    return value


ENCRYPTION_KEYS_ENV = "IDEMPOTENCY_ENCRYPTION_KEYS"
"""The environment variable ``ENCRYPTION_KEYS`` is read from when the setting is not given."""

ENCRYPTION_KEY_BYTES = 32
"""The length of an encryption key: AES-256-GCM's."""

_BASE64 = re.compile(r"^[A-Za-z0-9_+/-]+={0,2}$")


def _encryption_keys(name: str, value: Any) -> tuple[bytes, ...]:
    """Encryption keys, newest first: 32 bytes each, written in base64 (Fernet's key format,
    ``Fernet.generate_key()``). A list, or one string of keys separated by commas (what an
    environment variable holds). None (the default) reads ``IDEMPOTENCY_ENCRYPTION_KEYS``;
    empty: no encryption. No message ever shows a key."""
    where = f"{SETTING_NAME}[{name!r}]"
    if value is None:
        value = os.environ.get(ENCRYPTION_KEYS_ENV, "")
        where = f"The environment variable {ENCRYPTION_KEYS_ENV}"
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if isinstance(value, (dict, set, frozenset)) or not isinstance(value, Iterable):
        raise ImproperlyConfigured(
            f"{where} must be a list of base64 keys (newest first), or one string of them "
            f"separated by commas, not a {type(value).__name__}."
        )
    keys: list[bytes] = []
    for index, item in enumerate(value):
        text = item.decode("ascii", "replace") if isinstance(item, bytes) else item
        if not isinstance(text, str):
            raise ImproperlyConfigured(
                f"{where}: key {index} is a {type(item).__name__}, not a base64 string."
            )
        text = text.strip()
        try:
            if not _BASE64.match(text):
                raise ValueError
            raw = base64.urlsafe_b64decode(
                text.replace("+", "-").replace("/", "_") + "=" * (-len(text) % 4)
            )
        except (ValueError, binascii.Error):
            raise ImproperlyConfigured(
                f"{where}: key {index} is not base64 ({len(text)} characters). Generate a key "
                "with: python manage.py idempotency_rotate_keys --generate-key"
            ) from None
        if len(raw) != ENCRYPTION_KEY_BYTES:
            shorter = "shorter than" if len(raw) < ENCRYPTION_KEY_BYTES else "longer than"
            raise ImproperlyConfigured(
                f"{where}: key {index} is {len(raw)} bytes, {shorter} the "
                f"{ENCRYPTION_KEY_BYTES} bytes (44 base64 characters) AES-256-GCM needs. "
                "Generate a key with: python manage.py idempotency_rotate_keys --generate-key"
            )
        if raw in keys:
            raise ImproperlyConfigured(
                f"{where}: key {index} is listed twice (also as key {keys.index(raw)})."
            )
        keys.append(raw)
    return tuple(keys)


ENCRYPT = "encrypt"
DECRYPT_ONLY = "decrypt-only"
ENCRYPTION_MODES = (ENCRYPT, DECRYPT_ONLY)
"""``ENCRYPTION_MODE``: seal new values (the default), or store them in plaintext and only open
sealed ones (the way out of encryption, docs/security.md#turning-encryption-off)."""


def _encryption_mode(name: str, value: Any) -> str:
    if not isinstance(value, str) or value not in ENCRYPTION_MODES:
        raise _error(
            name,
            f"must be {ENCRYPT!r} (seal new values) or {DECRYPT_ONLY!r} (store new values in "
            f"plaintext, still open sealed ones with ENCRYPTION_KEYS), not {value!r}.",
        )
    return value


@dataclass(frozen=True)
class Option:
    default: Any
    parse: Callable[[str, Any], Any]
    doc: str


OPTIONS: dict[str, Option] = {
    "RECORD_TTL": Option(
        timedelta(hours=24), _duration, "How long an HTTP idempotency record is kept."
    ),
    "EVENT_TTL": Option(timedelta(days=7), _duration, "How long a processed-event row is kept."),
    "HEADER": Option("Idempotency-Key", _header, "The request header that carries the key."),
    "METHODS": Option(("POST", "PATCH"), _methods, "The HTTP methods that are handled."),
    "DATABASE": Option(
        "default", _database, "The database alias that holds records; the business data's own."
    ),
    "MAX_KEY_LENGTH": Option(255, _positive_int(255), "The longest key accepted, in characters."),
    "PATHS": Option((), _patterns, "Regexes of paths the middleware handles (empty: none)."),
    "WAIT": Option(
        0, _seconds, "Seconds a concurrent duplicate waits for the first request to finish."
    ),
    "RETRY_AFTER": Option(1, _positive_int(), "Retry-After seconds sent with a 409."),
    "REPLAY_HEADERS": Option(
        (), _strings, "Response headers replayed besides Content-Type and Location."
    ),
    "UNSTORED_STATUSES": Option(
        (401, 403, 408, 409, 425, 429),
        _client_error_statuses,
        "4xx statuses that depend on time or credentials and are never stored.",
    ),
    "ROLLBACK_ON_SERVER_ERROR": Option(
        True, _boolean, "Roll the transaction back when the view returns a 5xx response."
    ),
    "MAX_RESPONSE_BYTES": Option(
        1024 * 1024, _positive_int(), "The largest response body stored for replay."
    ),
    "OWNER": Option(
        None,
        _optional_dotted_path,
        "Dotted path to a callable(request) -> str that scopes keys (default: the user).",
    ),
    "LEASE": Option(
        timedelta(seconds=60), _duration, "How long a lease-mode claim is held before takeover."
    ),
    "MAX_DELIVERIES": Option(
        5, _positive_int(), "Deliveries of one event before a consumer parks it."
    ),
    "KAFKA_CONSUMERS": Option(
        {},
        _kafka_consumers,
        "Kafka consumers run by idempotency_consume: {name: {HANDLER, TOPICS, GROUP, CONFIG}}.",
    ),
    "ASYNC_DELIVERY_COUNT": Option(
        False,
        _boolean,
        "PostgreSQL: a consumer's delivery count commits without waiting on its WAL flush "
        "(a database crash can lose the latest increment; see docs/consumers.md).",
    ),
    "PURGE_BATCH_SIZE": Option(
        1000, _positive_int(MAX_BATCH_SIZE), "Rows deleted per purge transaction."
    ),
    "PURGE_MAX_SECONDS": Option(
        300, _seconds, "Wall-clock budget of one purge run (0: no limit)."
    ),
    "EVENT_PARTITIONS": Option(
        None,
        _partition_interval,
        "None, or 'day'/'month': ProcessedEvent is range-partitioned by event time "
        "(PostgreSQL; see idempotency_partitions).",
    ),
    "PROBLEM_TYPE_BASE": Option(
        "https://django-idempotency.readthedocs.io/en/latest/problems/#",
        _type_base,
        "The prefix of every problem's type URI; the problem's slug follows it.",
    ),
    # --- The transactional outbox ---
    "OUTBOX_TTL": Option(
        timedelta(days=7), _duration, "How long a sent outbox message is kept before the purge."
    ),
    "OUTBOX_TRANSPORTS": Option(
        {"default": {"BACKEND": "django_idempotency.outbox.transports.CeleryTransport"}},
        _outbox_transports,
        "Named transports the outbox relay sends through: {name: {BACKEND, OPTIONS}}.",
    ),
    "OUTBOX_MAX_ATTEMPTS": Option(
        20, _positive_int(), "Send attempts of one outbox message before it is parked."
    ),
    "OUTBOX_MAX_PAYLOAD_BYTES": Option(
        1024 * 1024,
        _positive_int(),
        "The largest outbox message (payload and headers as UTF-8 JSON) send() accepts.",
    ),
    "OUTBOX_NOTIFY": Option(
        True, _boolean, "On PostgreSQL, wake the relay with NOTIFY when a message commits."
    ),
    # --- Data protection ---
    "ENCRYPTION_KEYS": Option(
        None,
        _encryption_keys,
        "Base64 AES-256 keys, newest first, that encrypt stored responses and phased requests "
        "(None: the environment variable IDEMPOTENCY_ENCRYPTION_KEYS; empty: no encryption).",
    ),
    "OUTBOX_ENCRYPT": Option(
        False,
        _boolean,
        "Encrypt outbox payloads with ENCRYPTION_KEYS too; the relay decrypts before it sends.",
    ),
    "ENCRYPTION_MODE": Option(
        ENCRYPT,
        _encryption_mode,
        "'encrypt': seal new values with the newest key; 'decrypt-only': store new values in "
        "plaintext and still open sealed ones with ENCRYPTION_KEYS (turning encryption off).",
    ),
    # --- Operations ---
    "TELEMETRY": Option(
        True,
        _boolean,
        "OpenTelemetry metrics and spans, when opentelemetry-api is installed (the otel extra).",
    ),
}


class IdempotencySettings:
    """Typed, lazy access to ``settings.IDEMPOTENCY``; a value is parsed and validated on its
    first read, then cached until the setting changes (:meth:`clear`)."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def clear(self) -> None:
        """Forget every parsed value; the next read parses the setting again."""
        self._cache.clear()

    @staticmethod
    def user_settings() -> dict[str, Any]:
        value = getattr(settings, SETTING_NAME, {})
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ImproperlyConfigured(
                f"The {SETTING_NAME} setting must be a dict, not {type(value).__name__}."
            )
        return value

    def value(self, name: str) -> Any:
        try:
            return self._cache[name]
        except KeyError:
            pass
        option = OPTIONS[name]
        user = self.user_settings()
        parsed = (
            option.parse(name, user[name]) if name in user else option.parse(name, option.default)
        )
        self._cache[name] = parsed  # only a valid value is kept; an error is raised every time
        return parsed

    @property
    def RECORD_TTL(self) -> timedelta:
        return self.value("RECORD_TTL")  # type: ignore[no-any-return]

    @property
    def EVENT_TTL(self) -> timedelta:
        return self.value("EVENT_TTL")  # type: ignore[no-any-return]

    @property
    def HEADER(self) -> str:
        return self.value("HEADER")  # type: ignore[no-any-return]

    @property
    def METHODS(self) -> frozenset[str]:
        return self.value("METHODS")  # type: ignore[no-any-return]

    @property
    def DATABASE(self) -> str:
        return self.value("DATABASE")  # type: ignore[no-any-return]

    @property
    def MAX_KEY_LENGTH(self) -> int:
        return self.value("MAX_KEY_LENGTH")  # type: ignore[no-any-return]

    @property
    def PATHS(self) -> tuple[re.Pattern[str], ...]:
        return self.value("PATHS")  # type: ignore[no-any-return]

    @property
    def WAIT(self) -> float:
        return self.value("WAIT")  # type: ignore[no-any-return]

    @property
    def RETRY_AFTER(self) -> int:
        return self.value("RETRY_AFTER")  # type: ignore[no-any-return]

    @property
    def REPLAY_HEADERS(self) -> tuple[str, ...]:
        return self.value("REPLAY_HEADERS")  # type: ignore[no-any-return]

    @property
    def UNSTORED_STATUSES(self) -> frozenset[int]:
        return self.value("UNSTORED_STATUSES")  # type: ignore[no-any-return]

    @property
    def ROLLBACK_ON_SERVER_ERROR(self) -> bool:
        return self.value("ROLLBACK_ON_SERVER_ERROR")  # type: ignore[no-any-return]

    @property
    def MAX_RESPONSE_BYTES(self) -> int:
        return self.value("MAX_RESPONSE_BYTES")  # type: ignore[no-any-return]

    @property
    def OWNER(self) -> str | None:
        return self.value("OWNER")  # type: ignore[no-any-return]

    @property
    def LEASE(self) -> timedelta:
        return self.value("LEASE")  # type: ignore[no-any-return]

    @property
    def MAX_DELIVERIES(self) -> int:
        return self.value("MAX_DELIVERIES")  # type: ignore[no-any-return]

    @property
    def KAFKA_CONSUMERS(self) -> dict[str, ConsumerSettings]:
        return self.value("KAFKA_CONSUMERS")  # type: ignore[no-any-return]

    @property
    def ASYNC_DELIVERY_COUNT(self) -> bool:
        return self.value("ASYNC_DELIVERY_COUNT")  # type: ignore[no-any-return]

    @property
    def PURGE_BATCH_SIZE(self) -> int:
        return self.value("PURGE_BATCH_SIZE")  # type: ignore[no-any-return]

    @property
    def PURGE_MAX_SECONDS(self) -> float:
        return self.value("PURGE_MAX_SECONDS")  # type: ignore[no-any-return]

    @property
    def EVENT_PARTITIONS(self) -> str | None:
        return self.value("EVENT_PARTITIONS")  # type: ignore[no-any-return]

    @property
    def PROBLEM_TYPE_BASE(self) -> str:
        return self.value("PROBLEM_TYPE_BASE")  # type: ignore[no-any-return]

    @property
    def OUTBOX_TTL(self) -> timedelta:
        return self.value("OUTBOX_TTL")  # type: ignore[no-any-return]

    @property
    def OUTBOX_TRANSPORTS(self) -> dict[str, dict[str, Any]]:
        return self.value("OUTBOX_TRANSPORTS")  # type: ignore[no-any-return]

    @property
    def OUTBOX_MAX_ATTEMPTS(self) -> int:
        return self.value("OUTBOX_MAX_ATTEMPTS")  # type: ignore[no-any-return]

    @property
    def OUTBOX_MAX_PAYLOAD_BYTES(self) -> int:
        return self.value("OUTBOX_MAX_PAYLOAD_BYTES")  # type: ignore[no-any-return]

    @property
    def OUTBOX_NOTIFY(self) -> bool:
        return self.value("OUTBOX_NOTIFY")  # type: ignore[no-any-return]

    @property
    def ENCRYPTION_KEYS(self) -> tuple[bytes, ...]:
        return self.value("ENCRYPTION_KEYS")  # type: ignore[no-any-return]

    @property
    def OUTBOX_ENCRYPT(self) -> bool:
        return self.value("OUTBOX_ENCRYPT")  # type: ignore[no-any-return]

    @property
    def ENCRYPTION_MODE(self) -> str:
        return self.value("ENCRYPTION_MODE")  # type: ignore[no-any-return]

    @property
    def TELEMETRY(self) -> bool:
        return self.value("TELEMETRY")  # type: ignore[no-any-return]


conf = IdempotencySettings()

#: Settings whose change invalidates the cache: ``DATABASE`` is checked against ``DATABASES``.
WATCHED_SETTINGS = frozenset({SETTING_NAME, "DATABASES"})


def _setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in WATCHED_SETTINGS:
        conf.clear()


setting_changed.connect(_setting_changed, dispatch_uid="django_idempotency.conf")


def consumer_settings(name: str) -> ConsumerSettings:
    """The settings of the consumer ``name``; ImproperlyConfigured if there is none."""
    consumers = conf.KAFKA_CONSUMERS
    if name not in consumers:
        known = ", ".join(map(repr, consumers)) or "none"
        raise ImproperlyConfigured(
            f"No Kafka consumer named {name!r}: IDEMPOTENCY['KAFKA_CONSUMERS'] has {known}."
        )
    return consumers[name]
