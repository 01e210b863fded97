"""The TTL system checks of the retention issue, at their boundaries.

``RECORD_TTL`` under 24 hours warns (W001), ``EVENT_TTL`` under ``RECORD_TTL`` warns (W002), and a
TTL of zero or less is an error (E002) that names the key.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.checks import ERROR, WARNING
from django.test import override_settings

from django_idempotency.checks import check_settings

DAY = timedelta(hours=24)


def messages_for(**idempotency: Any) -> list[tuple[str | None, int]]:
    with override_settings(IDEMPOTENCY=idempotency):
        return [(m.id, m.level) for m in check_settings()]


@pytest.mark.parametrize(
    "record_ttl", [DAY, 86400, 86400.0, timedelta(days=30)], ids=["24h", "int", "float", "30d"]
)
def test_record_ttl_of_a_day_or_more_is_clean(record_ttl: Any) -> None:
    assert messages_for(RECORD_TTL=record_ttl, EVENT_TTL=timedelta(days=30)) == []


@pytest.mark.parametrize("record_ttl", [DAY - timedelta(seconds=1), 3600, timedelta(minutes=5)])
def test_record_ttl_under_a_day_warns_w001(record_ttl: Any) -> None:
    assert messages_for(RECORD_TTL=record_ttl) == [("django_idempotency.W001", WARNING)]


def test_w001_says_why_and_what_to_do() -> None:
    with override_settings(IDEMPOTENCY={"RECORD_TTL": timedelta(hours=2)}):
        (message,) = check_settings()
    assert "RECORD_TTL" in message.msg and "2:00:00" in message.msg
    assert "retries after an outage" in (message.hint or "")
    assert "timedelta(hours=24)" in (message.hint or "")


def test_event_ttl_equal_to_record_ttl_is_clean() -> None:
    assert messages_for(RECORD_TTL=timedelta(days=3), EVENT_TTL=timedelta(days=3)) == []


def test_event_ttl_under_record_ttl_warns_w002_with_both_values() -> None:
    with override_settings(
        IDEMPOTENCY={"RECORD_TTL": timedelta(days=3), "EVENT_TTL": timedelta(days=3) - DAY}
    ):
        (message,) = check_settings()
    assert message.id == "django_idempotency.W002"
    assert "2 days" in message.msg and "3 days" in message.msg
    assert "EVENT_TTL" in (message.hint or "")


def test_default_event_ttl_against_a_long_record_ttl_warns_w002() -> None:
    # EVENT_TTL defaults to 7 days.
    assert messages_for(RECORD_TTL=timedelta(days=8)) == [("django_idempotency.W002", WARNING)]


def test_both_warnings_at_once() -> None:
    assert messages_for(RECORD_TTL=timedelta(hours=12), EVENT_TTL=timedelta(hours=1)) == [
        ("django_idempotency.W001", WARNING),
        ("django_idempotency.W002", WARNING),
    ]


@pytest.mark.parametrize("key", ["RECORD_TTL", "EVENT_TTL"])
@pytest.mark.parametrize("value", [0, 0.0, -1, timedelta(0), timedelta(seconds=-1)], ids=str)
def test_ttl_of_zero_or_less_is_e002_naming_the_key(key: str, value: Any) -> None:
    with override_settings(IDEMPOTENCY={key: value}):
        messages = check_settings()
    # An invalid TTL is an error and nothing else: no W001/W002 computed from it.
    assert [(m.id, m.level) for m in messages] == [("django_idempotency.E002", ERROR)]
    assert key in messages[0].msg
    assert "longer than zero" in messages[0].msg


@pytest.mark.parametrize("value", ["24h", None, True, [1]])
def test_ttl_of_the_wrong_type_is_e002(value: Any) -> None:
    assert messages_for(RECORD_TTL=value) == [("django_idempotency.E002", ERROR)]


@pytest.mark.parametrize(
    ("key", "value"),
    [("PURGE_BATCH_SIZE", 0), ("PURGE_BATCH_SIZE", 1.5), ("PURGE_MAX_SECONDS", -1)],
)
def test_purge_settings_are_validated(key: str, value: Any) -> None:
    assert messages_for(**{key: value}) == [("django_idempotency.E002", ERROR)]
