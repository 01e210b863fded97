from datetime import timedelta

import pytest
from django.core.checks import CheckMessage
from django.test import override_settings

from django_idempotency.checks import check_middleware_order, check_settings

AUTH = "django.contrib.auth.middleware.AuthenticationMiddleware"
IDEM = "django_idempotency.http.middleware.IdempotencyMiddleware"


def ids(messages: list[CheckMessage]) -> list[str | None]:
    return [message.id for message in messages]


def test_default_configuration_is_clean() -> None:
    assert check_settings() == []
    assert check_middleware_order() == []


@override_settings(IDEMPOTENCY={"RECORD_TLL": 3600})
def test_unknown_key_is_e001_and_named() -> None:
    messages = check_settings()
    assert ids(messages) == ["django_idempotency.E001"]
    assert "RECORD_TLL" in messages[0].msg
    assert "RECORD_TTL" in (messages[0].hint or "")


def test_unknown_keys_that_are_not_strings_are_e001_too() -> None:
    """Keys of two types once crashed `manage.py check` (sorting them raised TypeError)."""
    misplaced = timedelta(hours=48)  # the value written where the key belongs
    with override_settings(IDEMPOTENCY={"RECORD_TLL": 3600, misplaced: "RECORD_TTL", 7: 1}):
        messages = check_settings()
    assert ids(messages) == ["django_idempotency.E001"] * 3
    assert {message.msg.split("]")[0] for message in messages} == {
        "IDEMPOTENCY['RECORD_TLL'",
        f"IDEMPOTENCY[{misplaced!r}",
        "IDEMPOTENCY[7",
    }
    assert all("Known keys: RECORD_TTL" in (message.hint or "") for message in messages)


@override_settings(IDEMPOTENCY={"RECORD_TTL": 0})
def test_zero_ttl_is_e002() -> None:
    messages = check_settings()
    assert ids(messages) == ["django_idempotency.E002"]
    assert "RECORD_TTL" in messages[0].msg


@override_settings(IDEMPOTENCY={"EVENT_TTL": -1})
def test_negative_event_ttl_is_e002() -> None:
    assert ids(check_settings()) == ["django_idempotency.E002"]


@override_settings(IDEMPOTENCY="nope")
def test_not_a_dict_is_e003() -> None:
    assert ids(check_settings()) == ["django_idempotency.E003"]


@pytest.mark.parametrize(
    "middleware",
    [[IDEM, AUTH], ["django.contrib.sessions.middleware.SessionMiddleware", IDEM, AUTH]],
)
def test_middleware_before_authentication_is_e004(middleware: list[str]) -> None:
    with override_settings(MIDDLEWARE=middleware):
        messages = check_middleware_order()
    assert ids(messages) == ["django_idempotency.E004"]
    assert AUTH in (messages[0].hint or "")


@override_settings(MIDDLEWARE=[AUTH, IDEM])
def test_middleware_after_authentication_is_fine() -> None:
    assert check_middleware_order() == []


@override_settings(IDEMPOTENCY={"OWNER": "testproject.nowhere.owner"})
def test_unimportable_owner_is_e005() -> None:
    assert ids(check_settings()) == ["django_idempotency.E005"]


@pytest.mark.parametrize("path", ["os.path", "django_idempotency.conf.MAX_BATCH_SIZE"])
def test_an_owner_that_is_not_callable_is_e005(path: str) -> None:
    with override_settings(IDEMPOTENCY={"OWNER": path}):
        messages = check_settings()
    assert ids(messages) == ["django_idempotency.E005"]
    assert "not callable" in messages[0].msg


@pytest.mark.parametrize("path", [".owners.by_tenant", "..owners.by_tenant"])
def test_a_relative_owner_path_is_e002_not_a_crash(path: str) -> None:
    """import_string() raises ValueError or TypeError for these, which once escaped the check
    (and every request) instead of naming the setting."""
    with override_settings(IDEMPOTENCY={"OWNER": path}):
        messages = check_settings()
    assert ids(messages) == ["django_idempotency.E002"]
    assert f"IDEMPOTENCY['OWNER'] must be a dotted path to a callable, or None, not {path!r}" in (
        messages[0].msg
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("RECORD_TTL", float("nan")),
        ("RECORD_TTL", float("inf")),
        ("RECORD_TTL", 10**20),
        ("WAIT", float("nan")),
        ("PURGE_MAX_SECONDS", float("inf")),
        ("UNSTORED_STATUSES", [201]),
    ],
)
def test_values_that_used_to_fail_later_are_e002(name: str, value: object) -> None:
    """Each once passed or crashed `manage.py check`, then failed every request or purge."""
    with override_settings(IDEMPOTENCY={name: value}):
        messages = check_settings()
    assert ids(messages) == ["django_idempotency.E002"]
    assert name in messages[0].msg


@pytest.mark.parametrize("database", [["default", "other"], {"default": "other"}])
def test_a_database_that_is_not_an_alias_is_e002_with_event_partitions_set(
    database: object,
) -> None:
    """A list of aliases in DATABASE once made the EVENT_PARTITIONS check raise TypeError
    (unhashable), which crashed `manage.py check` and every reservation."""
    with override_settings(IDEMPOTENCY={"DATABASE": database, "EVENT_PARTITIONS": "day"}):
        messages = check_settings()
    assert ids(messages) == ["django_idempotency.E002"]
    assert "IDEMPOTENCY['DATABASE']" in messages[0].msg
    assert "not in DATABASES" in messages[0].msg


@override_settings(IDEMPOTENCY={"RECORD_TTL": timedelta(hours=1)})
def test_short_record_ttl_is_w001() -> None:
    assert ids(check_settings()) == ["django_idempotency.W001"]


@override_settings(IDEMPOTENCY={"RECORD_TTL": timedelta(days=3), "EVENT_TTL": timedelta(days=2)})
def test_event_ttl_under_record_ttl_is_w002() -> None:
    assert ids(check_settings()) == ["django_idempotency.W002"]


def test_checks_are_registered_with_django() -> None:
    from django.core import checks

    with override_settings(IDEMPOTENCY={"BOGUS": 1}):
        messages = checks.run_checks()
    assert "django_idempotency.E001" in ids(messages)
