"""The behaviour table of the HTTP guide, row by row, through a decorated function view."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.dispatch import Signal
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.test import Client, RequestFactory, override_settings
from django.utils import timezone
from django.views.decorators.http import require_POST

from django_idempotency import idempotent, signals
from django_idempotency.models import IdempotencyRecord
from testproject.shop.probe_views import ProbeError
from tests.probes import body, effects, post, problem

pytestmark = pytest.mark.django_db

URL = "/probe/effect/"


def record(key: str = "k") -> IdempotencyRecord:
    return IdempotencyRecord.objects.get(key=key)


# -- requests that are not handled ----------------------------------------------------------


@pytest.mark.parametrize("method", ["get", "head", "options"])
def test_safe_methods_are_untouched(client: Client, method: str) -> None:
    for _ in range(2):
        response = getattr(client, method)(URL, headers={"Idempotency-Key": "k"})
        assert response.status_code == 201
    assert effects() == 2
    assert not IdempotencyRecord.objects.exists()


def test_method_not_in_methods_is_untouched(client: Client) -> None:
    for _ in range(2):
        assert post(client, URL, "k", method="put").status_code == 201
    assert effects() == 2
    assert not IdempotencyRecord.objects.exists()


def test_patch_is_handled_by_default(client: Client) -> None:
    first = post(client, URL, "k", method="patch")
    again = post(client, URL, "k", method="patch")
    assert again.content == first.content
    assert effects() == 1


@override_settings(IDEMPOTENCY={"METHODS": ["POST", "VERSION-CONTROL", "VERSION-CONTROLS"]})
def test_a_method_longer_than_the_record_column_is_handled(client: Client) -> None:
    """A listed method longer than ``IdempotencyRecord.method`` (10 characters) answered 500 on
    PostgreSQL and MariaDB, which refused the value. The record keeps it cut; the fingerprint
    keeps it whole, so another method of the same first 10 characters is another request."""

    def send(method: str) -> Any:
        headers = {"Idempotency-Key": "k"}
        return client.generic(method, URL, b"{}", "application/json", headers=headers)

    first = send("VERSION-CONTROL")
    assert first.status_code == 201
    again = send("VERSION-CONTROL")
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    problem(send("VERSION-CONTROLS"), 422)
    assert effects() == 1
    assert record().method == "VERSION-CO"


def test_no_key_on_an_optional_endpoint_runs_and_stores_nothing(client: Client) -> None:
    first, second = post(client, URL), post(client, URL)
    assert first.status_code == second.status_code == 201
    assert body(first)["nonce"] != body(second)["nonce"]
    assert effects() == 2
    assert not IdempotencyRecord.objects.exists()


def test_no_key_on_a_required_endpoint_is_400_and_the_view_does_not_run(client: Client) -> None:
    details = problem(post(client, "/probe/required/"), 400)
    assert details["type"].endswith("#missing-key")
    assert "Idempotency-Key" in details["detail"]
    assert effects() == 0


@override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key"})
def test_the_header_name_is_a_setting(client: Client) -> None:
    problem(post(client, "/probe/required/", "k"), 400)
    first = post(client, URL, headers={"X-Request-Key": "k"})
    again = post(client, URL, headers={"X-Request-Key": "k"})
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content


# -- keys -------------------------------------------------------------------------------------


def test_structured_field_string_and_bare_token_are_the_same_key(client: Client) -> None:
    first = post(client, URL, '"8e03978e-40d5-43e8-bc93-6894a57f9324"')
    again = post(client, URL, "8e03978e-40d5-43e8-bc93-6894a57f9324")
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert record("8e03978e-40d5-43e8-bc93-6894a57f9324")
    assert effects() == 1


@pytest.mark.parametrize(
    "key",
    ["", '""', "x" * 256, "has space", "caf\u00e9", '"unterminated', '"a" "b"'],
    ids=["empty", "empty-string", "too-long", "space", "non-ascii", "unterminated", "two"],
)
def test_malformed_key_is_400_and_the_view_does_not_run(client: Client, key: str) -> None:
    details = problem(post(client, URL, key), 400)
    assert details["type"].endswith("#malformed-key")
    assert effects() == 0
    assert not IdempotencyRecord.objects.exists()


@override_settings(IDEMPOTENCY={"MAX_KEY_LENGTH": 8})
def test_max_key_length_is_a_setting(client: Client) -> None:
    assert post(client, URL, "12345678").status_code == 201
    problem(post(client, URL, "123456789"), 400)


# -- first execution and replay --------------------------------------------------------------


def test_first_request_stores_the_response(client: Client) -> None:
    response = post(client, URL + "?access_token=s3cret", "k", {"amount": 10})
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    stored = record()
    assert stored.state == IdempotencyRecord.State.COMPLETED
    assert stored.owner == "anonymous"
    # The path is kept without its query string (the fingerprint covers it).
    assert (stored.method, stored.path) == ("POST", URL)
    assert "s3cret" not in str(IdempotencyRecord.objects.values().get())
    assert stored.response_status == 201
    assert bytes(stored.response_body or b"") == response.content
    assert stored.response_headers == {
        "Content-Type": "application/json",
        "Location": response["Location"],
        "Cache-Control": "no-store",
    }
    assert stored.completed_at is not None
    assert stored.expires_at - stored.created_at == timedelta(hours=24)
    assert effects() == 1


def test_replay_returns_status_body_bytes_and_safe_headers(client: Client) -> None:
    first = post(client, URL, "k", {"amount": 10})
    for _ in range(3):
        again = post(client, URL, "k", {"amount": 10})
        assert again.status_code == 201
        assert again.content == first.content
        assert again["Content-Type"] == first["Content-Type"]
        assert again["Location"] == first["Location"]
        assert again["Idempotent-Replayed"] == "true"
        assert "X-Probe" not in again
        assert again["Cache-Control"] == "no-store"  # a shared cache must not keep a replay
        assert not again.cookies
    assert first.cookies["probe_session"].value == "secret-cookie"
    assert effects() == 1


@override_settings(IDEMPOTENCY={"REPLAY_HEADERS": ["X-Probe", "Cache-Control", "Set-Cookie"]})
def test_replay_headers_setting_adds_headers_but_never_set_cookie(client: Client) -> None:
    post(client, URL, "k")
    again = post(client, URL, "k")
    assert again["X-Probe"] == "probe"
    assert again["Cache-Control"] == "no-store"
    assert not again.cookies
    assert "Set-Cookie" not in again
    assert "secret-cookie" not in str(record().response_headers)


def test_representation_headers_are_replayed(client: Client) -> None:
    """A gzip body replayed without Content-Encoding is corrupt; no-store must survive too."""
    first = post(client, f"{URL}?gzip=1", "k")
    again = post(client, f"{URL}?gzip=1", "k")
    assert again["Idempotent-Replayed"] == "true"
    for name in ("Content-Encoding", "Content-Language", "Content-Disposition", "Cache-Control"):
        assert again[name] == first[name], name
    assert again["Content-Encoding"] == "gzip"
    assert again["Cache-Control"] == "no-store"


@override_settings(IDEMPOTENCY={"REPLAY_HEADERS": ["Set-Cookie"]})
def test_a_raw_set_cookie_header_is_neither_stored_nor_replayed(client: Client) -> None:
    """``response["Set-Cookie"] = ...`` reaches the headers that set_cookie() never does."""
    first = post(client, f"{URL}?raw_cookie=1", "k")
    assert "secret-raw-cookie" in first["Set-Cookie"]
    again = post(client, f"{URL}?raw_cookie=1", "k")
    assert again["Idempotent-Replayed"] == "true"
    assert "Set-Cookie" not in again
    assert not again.cookies
    assert "secret-raw-cookie" not in str(record().response_headers)


def test_a_stored_405_is_replayed_with_its_allow_header() -> None:
    """A ``405`` must carry ``Allow`` (RFC 9110, section 15.5.6); a stored one was replayed
    without it."""

    @idempotent
    @require_POST
    def view(request: HttpRequest) -> HttpResponse:
        return HttpResponse(status=201)

    def patch() -> HttpResponseBase:
        request = RequestFactory().patch(URL, b"{}", "application/json", HTTP_IDEMPOTENCY_KEY="k")
        return view(request)

    first, again = patch(), patch()
    assert first.status_code == again.status_code == 405
    assert again["Idempotent-Replayed"] == "true"
    assert again["Allow"] == first["Allow"] == "POST"


def test_json_key_order_and_whitespace_do_not_make_a_different_request(client: Client) -> None:
    first = post(client, URL, "k", raw=b'{"a": 1, "b": [1, 2]}')
    again = post(client, URL, "k", raw=b'{ "b":[1,2],\n"a":1 }')
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content


# -- mismatch ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "method", "data"),
    [
        (URL, "post", {"amount": 11}),
        (URL + "?coupon=1", "post", {"amount": 10}),
        (URL, "patch", {"amount": 10}),
        ("/probe/required/", "post", {"amount": 10}),
    ],
    ids=["body", "query", "method", "path"],
)
def test_same_key_for_a_different_request_is_422(
    client: Client, url: str, method: str, data: dict[str, int]
) -> None:
    post(client, URL, "k", {"amount": 10})
    details = problem(post(client, url, "k", data, method=method), 422)
    assert details["type"].endswith("#key-reused")
    assert effects() == 1
    assert record().response_status == 201


def test_raw_bodies_are_compared_byte_for_byte(client: Client) -> None:
    post(client, URL, "k", raw=b"a=1&b=2", content_type="text/plain")
    problem(post(client, URL, "k", raw=b"b=2&a=1", content_type="text/plain"), 422)


def test_a_form_is_compared_by_its_fields_not_their_order(client: Client) -> None:
    form = "application/x-www-form-urlencoded"
    post(client, URL, "k", raw=b"a=1&b=2", content_type=form)
    assert post(client, URL, "k", raw=b"b=2&a=1", content_type=form)["Idempotent-Replayed"]
    problem(post(client, URL, "k", raw=b"b=3&a=1", content_type=form), 422)


# -- failures ---------------------------------------------------------------------------------


def test_a_raising_view_rolls_everything_back_and_the_exception_propagates(
    client: Client,
) -> None:
    with pytest.raises(ProbeError):
        post(client, "/probe/raise/", "k")
    assert effects() == 0
    assert not IdempotencyRecord.objects.exists()
    # Nothing stayed behind: the key is free for a retry, even of a different request.
    assert post(client, URL, "k").status_code == 201
    assert effects() == 1


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_5xx_is_not_stored_and_rolled_back(client: Client, status: int) -> None:
    first = post(client, f"{URL}?status={status}", "k")
    assert first.status_code == status
    assert effects() == 0
    assert not IdempotencyRecord.objects.exists()
    again = post(client, f"{URL}?status={status}", "k")
    assert again.status_code == status
    assert "Idempotent-Replayed" not in again
    assert body(again)["nonce"] != body(first)["nonce"]


@override_settings(IDEMPOTENCY={"ROLLBACK_ON_SERVER_ERROR": False})
def test_a_5xx_keeps_its_changes_when_rollback_is_disabled(client: Client) -> None:
    post(client, f"{URL}?status=500", "k")
    assert effects() == 1
    assert not IdempotencyRecord.objects.exists()
    post(client, f"{URL}?status=500", "k")
    assert effects() == 2


@pytest.mark.parametrize("status", [401, 403, 408, 409, 425, 429])
def test_time_or_credential_dependent_4xx_are_not_stored(client: Client, status: int) -> None:
    first = post(client, f"{URL}?status={status}", "k")
    assert first.status_code == status
    assert not IdempotencyRecord.objects.exists()
    again = post(client, f"{URL}?status={status}", "k")
    assert "Idempotent-Replayed" not in again
    assert body(again)["nonce"] != body(first)["nonce"]
    # The view's own changes stay: it decided not to act, the record is what is dropped.
    assert effects() == 2


@pytest.mark.parametrize("status", [200, 202, 400, 404, 410, 422])
def test_other_answers_are_stored_and_replayed(client: Client, status: int) -> None:
    first = post(client, f"{URL}?status={status}", "k")
    again = post(client, f"{URL}?status={status}", "k")
    assert again.status_code == status
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert effects() == 1


@override_settings(IDEMPOTENCY={"UNSTORED_STATUSES": [404]})
def test_unstored_statuses_is_a_setting(client: Client) -> None:
    post(client, f"{URL}?status=404", "k404")
    post(client, f"{URL}?status=429", "k429")
    assert not IdempotencyRecord.objects.filter(key="k404").exists()
    assert record("k429").response_status == 429


# -- responses that cannot be stored ----------------------------------------------------------


def test_a_streaming_response_counts_as_done_but_is_not_replayed(client: Client) -> None:
    first = post(client, "/probe/stream/", "k")
    assert first.status_code == 201
    assert b"".join(first.streaming_content) == b"streamed body"  # type: ignore[attr-defined]
    stored = record()
    assert stored.state == IdempotencyRecord.State.COMPLETED
    assert stored.response_body is None
    assert stored.response_headers["@not-replayable"] == "streaming response"
    retry = post(client, "/probe/stream/", "k")
    # 422, not 409: SDKs retry every 409 with backoff, and this one can never succeed.
    details = problem(retry, 422)
    assert details["type"].endswith("#response-not-stored")
    assert details["original_status"] == 201
    assert "Retry-After" not in retry  # retrying will not help
    assert effects() == 1


@override_settings(IDEMPOTENCY={"MAX_RESPONSE_BYTES": 100})
def test_a_response_over_max_response_bytes_counts_as_done_but_is_not_replayed(
    client: Client,
) -> None:
    assert post(client, "/probe/big/?size=100", "fits").content == b"x" * 100
    assert post(client, "/probe/big/?size=100", "fits")["Idempotent-Replayed"] == "true"
    assert post(client, "/probe/big/?size=101", "big").content == b"x" * 101
    assert record("big").response_body is None
    details = problem(post(client, "/probe/big/?size=101", "big"), 422)
    assert "MAX_RESPONSE_BYTES" in details["detail"]
    assert effects("big") == 2


# -- expiry ----------------------------------------------------------------------------------


def test_an_expired_record_is_treated_as_a_new_key(client: Client) -> None:
    first = post(client, URL, "k", {"amount": 1})
    old = record()
    IdempotencyRecord.objects.filter(pk=old.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    # A new request, even a different one, may now use the key.
    again = post(client, URL, "k", {"amount": 2})
    assert again.status_code == 201
    assert "Idempotent-Replayed" not in again
    assert body(again)["nonce"] != body(first)["nonce"]
    renewed = record()
    assert renewed.pk == old.pk
    assert renewed.token != old.token
    assert renewed.fingerprint != old.fingerprint
    assert renewed.expires_at > timezone.now()
    assert bytes(renewed.response_body or b"") == again.content
    assert effects() == 2
    assert post(client, URL, "k", {"amount": 2}).content == again.content


# -- logging and signals ---------------------------------------------------------------------


@pytest.fixture
def received() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    calls: list[tuple[str, dict[str, Any]]] = []
    connected: list[tuple[Signal, Any]] = []
    for name in ("record_stored", "record_replayed", "record_mismatch", "record_conflict"):
        signal = getattr(signals, name)

        def receiver(sender: Any, _name: str = name, **kwargs: Any) -> None:
            calls.append((_name, kwargs))

        signal.connect(receiver, weak=False)
        connected.append((signal, receiver))
    yield calls
    for signal, receiver in connected:
        signal.disconnect(receiver)


def test_every_outcome_is_logged_and_signalled(
    client: Client, caplog: pytest.LogCaptureFixture, received: list[tuple[str, dict[str, Any]]]
) -> None:
    caplog.set_level(logging.INFO, logger="django_idempotency")
    post(client, URL, "k", {"a": 1})
    post(client, URL, "k", {"a": 1})
    post(client, URL, "k", {"a": 2})
    post(client, f"{URL}?status=503", "k5")
    post(client, f"{URL}?status=429", "k4")
    with pytest.raises(ProbeError):
        post(client, "/probe/raise/", "kr")
    outcomes = [
        (r.idempotency_outcome, r.idempotency_key, r.idempotency_owner)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "django_idempotency"
    ]
    assert outcomes == [
        ("stored", "k", "anonymous"),
        ("replayed", "k", "anonymous"),
        ("mismatch", "k", "anonymous"),
        ("rolled_back", "k5", "anonymous"),
        ("released", "k4", "anonymous"),
        ("raised", "kr", "anonymous"),
    ]
    assert "idempotency stored key=k owner=anonymous" in caplog.records[0].getMessage()
    assert [name for name, _ in received] == [
        "record_stored",
        "record_replayed",
        "record_mismatch",
    ]
    for _, kwargs in received:
        assert kwargs["key"] == "k"
        assert kwargs["owner"] == "anonymous"
        assert kwargs["request"].path == URL
