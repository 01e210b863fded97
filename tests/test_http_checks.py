"""System checks of the HTTP set-up (W020, E021, W022), and the middleware and the decorator
agreeing when a middleware turns a view's exception into a response."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db import connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client, override_settings

from django_idempotency.http.checks import check_http_views
from django_idempotency.models import IdempotencyRecord
from testproject.shop.probe_views import ProbeError
from tests.probes import effects, post
from tests.test_middleware import MIDDLEWARE_PATH, with_middleware

CONVERTER = "tests.test_http_checks.ConvertingMiddleware"
MW_PATHS = {"PATHS": [r"^/probe/mw/"]}


class ConvertingMiddleware:
    """Turns the probe views' exception into a 400 answer, as error-page middlewares do."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if isinstance(exception, ProbeError):
            return JsonResponse({"error": "converted"}, status=400)
        return None


def ids() -> list[str]:
    return [message.id or "" for message in check_http_views()]


def message(check_id: str) -> str:
    (found,) = [m for m in check_http_views() if m.id == check_id]
    return found.msg + " " + (found.hint or "")


# -- W020: DRF views that the middleware answers before their permission checks ---------------


def test_w020_names_drf_views_without_the_mixin_under_the_middleware() -> None:
    assert "django_idempotency.W020" not in ids()  # the middleware is not installed
    with override_settings(MIDDLEWARE=with_middleware(), IDEMPOTENCY=MW_PATHS):
        text = message("django_idempotency.W020")
    assert "/probe/mw/drf/plain/" in text
    assert "/probe/mw/drf/safe/" not in text  # the mixin
    assert "/probe/mw/drf/viewset-lease/" not in text  # its action is decorated
    assert "IdempotentMixin" in text


def test_w020_is_silent_when_paths_do_not_cover_drf_views() -> None:
    with override_settings(MIDDLEWARE=with_middleware(), IDEMPOTENCY={"PATHS": [r"^/api/"]}):
        assert "django_idempotency.W020" not in ids()


# -- E021: lease-mode methods under ATOMIC_REQUESTS --------------------------------------------


def test_e021_names_lease_methods_that_cannot_be_marked_non_atomic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "django_idempotency.E021" not in ids()
    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)
    text = message("django_idempotency.E021")
    assert "/probe/mw/cbv-lease/" in text
    assert "/probe/mw/drf/viewset-lease/" in text
    for marked in ("/probe/lease/", "/probe/mw/drf/lease/"):  # the decorator, the mixin
        assert f"{marked}," not in text and not text.startswith(marked)
    assert "non_atomic_requests" in text


# -- W022 and the two paths agreeing on a converted exception ----------------------------------


def with_converter(*, below: bool) -> list[str]:
    middleware = with_middleware()
    position = middleware.index(MIDDLEWARE_PATH) + (1 if below else 0)
    middleware.insert(position, CONVERTER)
    return middleware


def test_w022_names_exception_middlewares_below_the_middleware() -> None:
    with override_settings(MIDDLEWARE=with_converter(below=True)):
        assert CONVERTER in message("django_idempotency.W022")
    with override_settings(MIDDLEWARE=with_converter(below=False)):
        assert "django_idempotency.W022" not in ids()


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/probe/raise/", "/probe/mw/raise/"])
def test_a_converted_exception_rolls_back_and_is_not_stored_on_both_paths(url: str) -> None:
    """With the middleware above the converter (as W022 asks), it sees the exception first."""
    with override_settings(MIDDLEWARE=with_converter(below=False), IDEMPOTENCY=MW_PATHS):
        client = Client()
        answer = post(client, url, "k")
        assert answer.status_code == 400
        assert effects() == 0  # the view's write rolled back
        assert not IdempotencyRecord.objects.exists()  # the converted answer is not stored
        assert "Idempotent-Replayed" not in post(client, url, "k")


def test_an_invalid_setting_is_left_to_the_settings_check() -> None:
    with override_settings(MIDDLEWARE=with_middleware(), IDEMPOTENCY={"PATHS": 5}):
        assert check_http_views() == []
