"""Settings are parsed once and cached until Django's setting_changed signal."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_idempotency import conf as conf_module
from django_idempotency.conf import conf


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names whose value was parsed (not served from the cache)."""
    seen: list[str] = []
    option = conf_module.OPTIONS["RECORD_TTL"]
    original = option.parse

    def counting(name: str, value: Any) -> Any:
        seen.append(name)
        return original(name, value)

    monkeypatch.setitem(
        conf_module.OPTIONS, "RECORD_TTL", conf_module.Option(option.default, counting, option.doc)
    )
    conf.clear()
    yield seen
    conf.clear()


def test_a_value_is_parsed_once(parses: list[str]) -> None:
    assert conf.RECORD_TTL == conf.RECORD_TTL == timedelta(hours=24)
    assert parses == ["RECORD_TTL"]


def test_override_settings_is_seen_and_undone(parses: list[str]) -> None:
    assert conf.RECORD_TTL == timedelta(hours=24)
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "RECORD_TTL": 60}):
        assert conf.RECORD_TTL == timedelta(seconds=60)
    assert conf.RECORD_TTL == timedelta(hours=24)
    assert parses == ["RECORD_TTL"] * 3


def test_an_invalid_value_is_never_cached() -> None:
    with override_settings(IDEMPOTENCY={"RECORD_TTL": "soon"}):
        for _ in range(2):
            with pytest.raises(Exception, match="RECORD_TTL"):
                conf.RECORD_TTL  # noqa: B018
