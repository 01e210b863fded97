"""IdempotencyMiddleware: the decorator's behaviour for every path in IDEMPOTENCY["PATHS"]."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import connection
from django.test import AsyncClient, Client, override_settings

from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Effect
from testproject.shop.probe_views import ProbeError
from tests.probes import body, effects, post, problem

AUTH = "django.contrib.auth.middleware.AuthenticationMiddleware"
MIDDLEWARE_PATH = "django_idempotency.http.middleware.IdempotencyMiddleware"
URL = "/probe/mw/effect/"


def with_middleware() -> list[str]:
    middleware = list(settings.MIDDLEWARE)
    middleware.insert(middleware.index(AUTH) + 1, MIDDLEWARE_PATH)
    return middleware


@pytest.fixture(autouse=True)
def installed() -> Iterator[None]:
    with override_settings(MIDDLEWARE=with_middleware(), IDEMPOTENCY={"PATHS": [r"^/probe/mw/"]}):
        yield


@pytest.mark.django_db
def test_first_execution_and_replay(client: Client) -> None:
    first = post(client, URL, "k", {"a": 1})
    again = post(client, URL, "k", {"a": 1})
    assert first.status_code == again.status_code == 201
    assert again.content == first.content
    assert again["Location"] == first["Location"]
    assert again["Idempotent-Replayed"] == "true"
    assert not again.cookies
    problem(post(client, URL, "k", {"a": 2}), 422)
    problem(post(client, URL, "bad key"), 400)
    assert effects() == 1
    assert IdempotencyRecord.objects.get().path == URL


@pytest.mark.django_db
def test_requests_it_does_not_handle(client: Client) -> None:
    post(client, URL)  # no key: runs, nothing stored
    post(client, URL, "k", method="put")  # method not listed
    assert client.get(URL, headers={"Idempotency-Key": "k"}).status_code == 201
    with override_settings(IDEMPOTENCY={"PATHS": [r"^/elsewhere/"]}):
        post(client, URL, "k")
        post(client, URL, "k")
    with override_settings(IDEMPOTENCY={}):  # no PATHS: the middleware handles nothing
        post(client, URL, "k")
    assert effects() == 6
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
def test_a_raising_view_is_rolled_back_whatever_the_5xx_setting() -> None:
    client = Client(raise_request_exception=False)
    with override_settings(
        IDEMPOTENCY={"PATHS": [r"^/probe/mw/"], "ROLLBACK_ON_SERVER_ERROR": False}
    ):
        response = post(client, "/probe/mw/raise/", "k")
    assert response.status_code == 500
    assert effects() == 0
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
def test_the_exception_still_reaches_the_test_client(client: Client) -> None:
    with pytest.raises(ProbeError):
        post(client, "/probe/mw/raise/", "k")
    assert effects() == 0


@pytest.mark.django_db
def test_a_5xx_and_an_unstored_4xx(client: Client) -> None:
    assert post(client, f"{URL}?status=503", "k").status_code == 503
    assert effects() == 0
    assert post(client, f"{URL}?status=429", "k").status_code == 429
    assert effects() == 1
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
def test_a_decorated_view_is_left_to_its_decorator(client: Client) -> None:
    """/probe/mw/decorated/ is @idempotent(required=True): the decorator's options apply."""
    problem(post(client, "/probe/mw/decorated/"), 400)
    first = post(client, "/probe/mw/decorated/", "k")
    again = post(client, "/probe/mw/decorated/", "k")
    assert again.content == first.content
    assert IdempotencyRecord.objects.count() == 1
    assert effects("required") == 1


@pytest.mark.django_db
def test_a_class_based_view_under_the_middleware_is_handled_once(client: Client) -> None:
    with override_settings(IDEMPOTENCY={"PATHS": [r"^/probe/"]}):
        first = post(client, "/probe/cbv/", "k")
        again = post(client, "/probe/cbv/", "k")
    assert again.content == first.content
    assert IdempotencyRecord.objects.count() == 1
    assert effects("cbv") == 1


@pytest.mark.django_db
def test_users_are_scoped_because_it_runs_after_authentication(
    client: Client, django_user_model: type
) -> None:
    user = django_user_model.objects.create_user("ann")
    client.force_login(user)
    assert body(post(client, URL, "k"))["user"] == str(user.pk)
    assert IdempotencyRecord.objects.get().owner == f"user:{user.pk}"


@pytest.mark.django_db(transaction=True)
def test_atomic_requests_inside_the_middleware_transaction(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    first = post(client, URL, "k")
    assert post(client, URL, "k").content == first.content
    assert post(Client(raise_request_exception=False), "/probe/mw/raise/", "r").status_code == 500
    assert effects() == 1
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["k"]


@pytest.mark.django_db(transaction=True)
def test_async_mode_under_asgi() -> None:
    async def scenario() -> None:
        client = AsyncClient()
        headers = {"Idempotency-Key": "k"}
        kwargs = {"content_type": "application/json", "headers": headers}
        first = await client.post("/probe/mw/async/", {}, **kwargs)  # type: ignore[arg-type]
        again = await client.post("/probe/mw/async/", {}, **kwargs)  # type: ignore[arg-type]
        assert first.status_code == 201
        assert again.content == first.content
        assert again["Idempotent-Replayed"] == "true"
        sync_view = await client.post(
            URL, {}, content_type="application/json", headers={"Idempotency-Key": "k2"}
        )
        assert sync_view.status_code == 201
        assert await Effect.objects.acount() == 2
        raising = AsyncClient(raise_request_exception=False)
        failed = await raising.post(
            "/probe/mw/async/?raise=1", {}, content_type="application/json",
            headers={"Idempotency-Key": "r"},
        )  # fmt: skip
        assert failed.status_code == 500
        untouched = await client.post(
            "/probe/effect/", {}, content_type="application/json", headers={"Idempotency-Key": "u"}
        )
        assert untouched.status_code == 201  # not under PATHS: the decorator handled it
        assert await Effect.objects.acount() == 3

    async_to_sync(scenario)()
    assert sorted(IdempotencyRecord.objects.values_list("key", flat=True)) == ["k", "k2", "u"]


@pytest.mark.django_db
def test_a_path_without_a_view_is_handled_too(client: Client) -> None:
    first = post(client, "/probe/mw/no-such-page/", "k")
    again = post(client, "/probe/mw/no-such-page/", "k")
    assert first.status_code == again.status_code == 404
    assert again["Idempotent-Replayed"] == "true"


@pytest.mark.django_db
def test_a_405_is_replayed_with_its_allow_header(client: Client) -> None:
    """A PATCH to a class-based view without ``patch()``: Django answers ``405`` with ``Allow``,
    which a ``405`` must carry (RFC 9110); the middleware stored it and replayed it without."""
    first = post(client, "/probe/mw/cbv-lease/", "k", method="patch")
    again = post(client, "/probe/mw/cbv-lease/", "k", method="patch")
    assert first.status_code == again.status_code == 405
    assert again["Idempotent-Replayed"] == "true"
    assert again["Allow"] == first["Allow"]
    assert "PATCH" not in again["Allow"]


@pytest.mark.django_db(transaction=True)
def test_a_path_with_a_nul_character_is_answered_and_kept_as_sent(client: Client) -> None:
    """``%00`` in a path decodes to NUL, which a PostgreSQL text column refuses: the claim
    raised there, and the client got a 500. The record keeps it written back as ``%00``."""
    first = post(client, "/probe/mw/a%00b/", "k")
    again = post(client, "/probe/mw/a%00b/", "k")

    assert first.status_code == again.status_code == 404
    assert again["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().path == "/probe/mw/a%00b/"
