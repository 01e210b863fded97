from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_idempotency.conf import OPTIONS, conf


def test_defaults() -> None:
    assert conf.RECORD_TTL == timedelta(hours=24)
    assert conf.EVENT_TTL == timedelta(days=7)
    assert conf.HEADER == "Idempotency-Key"
    assert conf.METHODS == frozenset({"POST", "PATCH"})
    assert conf.DATABASE == "default"
    assert conf.MAX_KEY_LENGTH == 255
    assert conf.PATHS == ()
    assert conf.UNSTORED_STATUSES == frozenset({401, 403, 408, 409, 425, 429})
    assert conf.MAX_DELIVERIES == 5


def test_every_option_has_a_typed_property() -> None:
    for name in OPTIONS:
        assert getattr(conf, name) == conf.value(name)


@override_settings(
    IDEMPOTENCY={
        "RECORD_TTL": 3600 * 48,
        "EVENT_TTL": timedelta(days=30),
        "HEADER": "X-Request-Key",
        "METHODS": ["post", "put"],
        "MAX_KEY_LENGTH": 64,
        "PATHS": [r"^/api/"],
    }
)
def test_overrides_are_read_lazily() -> None:
    assert conf.RECORD_TTL == timedelta(hours=48)
    assert conf.EVENT_TTL == timedelta(days=30)
    assert conf.HEADER == "X-Request-Key"
    assert conf.METHODS == frozenset({"POST", "PUT"})
    assert conf.MAX_KEY_LENGTH == 64
    assert [p.pattern for p in conf.PATHS] == [r"^/api/"]


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("RECORD_TTL", 0, "longer than zero"),
        ("RECORD_TTL", timedelta(seconds=-5), "longer than zero"),
        ("EVENT_TTL", "7d", "timedelta or a number of seconds"),
        ("METHODS", ["POST", "GET"], "safe methods are never handled"),
        ("METHODS", "POST", "list or tuple"),
        ("HEADER", "Idempotency Key", "header name"),
        ("MAX_KEY_LENGTH", 300, "at most 255"),
        ("MAX_KEY_LENGTH", True, "positive integer"),
        ("DATABASE", "nope", "not in DATABASES"),
        ("PATHS", ["(unclosed"], "invalid regular expression"),
        ("UNSTORED_STATUSES", [700], "only 4xx"),
        ("UNSTORED_STATUSES", [201], "only 4xx"),
        ("UNSTORED_STATUSES", [409, 500], "only 4xx"),
        ("UNSTORED_STATUSES", [True], "HTTP status codes"),
        ("RECORD_TTL", float("nan"), "finite duration"),
        ("RECORD_TTL", float("inf"), "finite duration"),
        ("RECORD_TTL", 10**20, "finite duration"),
        ("EVENT_TTL", timedelta(days=999_999), "at most 3650 days"),
        ("LEASE", float("-inf"), "finite duration"),
        ("WAIT", float("nan"), "finite number of seconds"),
        ("WAIT", float("inf"), "finite number of seconds"),
        ("PURGE_MAX_SECONDS", float("nan"), "finite number of seconds"),
        ("PURGE_MAX_SECONDS", float("inf"), "finite number of seconds"),
        ("PURGE_MAX_SECONDS", 10**20, "finite number of seconds"),
        ("PURGE_BATCH_SIZE", 99999999999999999999, "at most 1000000"),
        ("OWNER", "not_dotted", "dotted path"),
        ("ROLLBACK_ON_SERVER_ERROR", "yes", "True or False"),
        ("WAIT", -1, "zero or a positive, finite number"),
    ],
)
def test_invalid_values_raise_with_the_key_named(name: str, value: object, message: str) -> None:
    with override_settings(IDEMPOTENCY={name: value}), pytest.raises(ImproperlyConfigured) as exc:
        conf.value(name)
    assert f"IDEMPOTENCY[{name!r}]" in str(exc.value)
    assert message in str(exc.value)


@override_settings(IDEMPOTENCY=["RECORD_TTL"])
def test_setting_must_be_a_dict() -> None:
    with pytest.raises(ImproperlyConfigured, match="must be a dict"):
        _ = conf.RECORD_TTL
