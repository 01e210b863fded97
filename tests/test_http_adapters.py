"""The decorator on every kind of view, its arguments, and the core called directly."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, RequestFactory

from django_idempotency import idempotent
from django_idempotency.exceptions import KeyReused
from django_idempotency.http.core import Captured, Command, Idempotency, Policy, Replay
from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Effect
from testproject.shop.probe_views import ProbeError
from tests.probes import body, effects, post, problem

# -- class-based views ------------------------------------------------------------------------


@pytest.mark.django_db
def test_class_based_view_through_method_decorator(client: Client) -> None:
    problem(post(client, "/probe/cbv/"), 400)
    first = post(client, "/probe/cbv/", "k")
    again = post(client, "/probe/cbv/", "k")
    assert first.status_code == again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert effects("cbv") == 1


@pytest.mark.django_db
def test_drf_apiview_method(client: Client) -> None:
    details = problem(post(client, "/probe/drf/apiview/", data={"a": 1}), 400)
    assert details["type"].endswith("#missing-key")
    first = post(client, "/probe/drf/apiview/", "k", {"b": [1, 2], "a": 1})
    assert first.status_code == 201
    assert body(first)["echo"] == {"a": 1, "b": [1, 2]}
    again = post(client, "/probe/drf/apiview/", "k", {"a": 1, "b": [1, 2]})
    assert again.status_code == 201
    assert again.content == first.content
    assert again["Content-Type"] == first["Content-Type"] == "application/json"
    assert again["Location"] == first["Location"]
    assert again["Idempotent-Replayed"] == "true"
    problem(post(client, "/probe/drf/apiview/", "k", {"a": 2}), 422)
    assert effects("drf-apiview") == 1


@pytest.mark.django_db
def test_drf_apiview_through_method_decorator(client: Client) -> None:
    problem(post(client, "/probe/drf/method-decorator/"), 400)
    first = post(client, "/probe/drf/method-decorator/", "k")
    again = post(client, "/probe/drf/method-decorator/", "k")
    assert first.status_code == 201
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert effects("drf-method-decorator") == 1


@pytest.mark.django_db
def test_drf_viewset_method_and_content_negotiation(client: Client) -> None:
    first = post(client, "/probe/drf/viewset/", "k", {"x": "y"})
    assert first.status_code == 201
    again = post(client, "/probe/drf/viewset/", "k", {"x": "y"})
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert post(client, "/probe/drf/viewset/", None, {"x": "y"}).status_code == 201
    assert effects("drf-viewset") == 2


@pytest.mark.django_db
def test_drf_authentication_scopes_the_owner() -> None:
    """DRF's own authentication (Basic here) decides the owner inside a DRF view."""
    users = [User.objects.create_user(name, password="pw") for name in ("ann", "bob")]
    responses = []
    for user in users:
        token = base64.b64encode(f"{user.username}:pw".encode()).decode()
        headers = {"Authorization": f"Basic {token}"}
        responses.append(post(Client(), "/probe/drf/viewset/", "same", {"a": 1}, headers=headers))
    assert [body(r)["user"] for r in responses] == [str(users[0].pk), str(users[1].pk)]
    owners = set(IdempotencyRecord.objects.values_list("owner", flat=True))
    assert owners == {f"user:{users[0].pk}", f"user:{users[1].pk}"}


# -- async views ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_async_view_from_a_sync_client(client: Client) -> None:
    first = post(client, "/probe/async/", "k")
    again = post(client, "/probe/async/", "k")
    assert first.status_code == 201
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert effects("async") == 1


@pytest.mark.django_db(transaction=True)
def test_async_view_under_asgi() -> None:
    async_to_sync(_async_view_under_asgi)()


async def _async_view_under_asgi() -> None:
    client = AsyncClient()
    headers = {"Idempotency-Key": "k"}
    first = await client.post(
        "/probe/async/", {}, content_type="application/json", headers=headers
    )
    again = await client.post(
        "/probe/async/", {}, content_type="application/json", headers=headers
    )
    assert first.status_code == 201
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    with pytest.raises(ProbeError):
        await client.post(
            "/probe/async/?raise=1",
            {},
            content_type="application/json",
            headers={"Idempotency-Key": "r"},
        )
    failed = await client.post(
        "/probe/async/?status=503",
        {},
        content_type="application/json",
        headers={"Idempotency-Key": "f"},
    )
    assert failed.status_code == 503
    unkeyed = await client.post("/probe/async/", {}, content_type="application/json")
    assert unkeyed.status_code == 201
    malformed = await client.post(
        "/probe/async/", {}, content_type="application/json", headers={"Idempotency-Key": ""}
    )
    assert malformed.status_code == 400
    assert await Effect.objects.filter(name="async").acount() == 2
    assert await IdempotencyRecord.objects.acount() == 1


# -- decorator arguments ----------------------------------------------------------------------


@pytest.mark.django_db
def test_methods_argument(client: Client) -> None:
    post(client, "/probe/put-only/", "k")
    post(client, "/probe/put-only/", "k")
    assert effects("put") == 2  # POST is not listed for this view
    first = post(client, "/probe/put-only/", "k", method="put")
    again = post(client, "/probe/put-only/", "k", method="put")
    assert again.content == first.content
    assert effects("put") == 3


@pytest.mark.django_db
def test_ttl_argument(client: Client) -> None:
    post(client, "/probe/put-only/", "k", method="put")
    stored = IdempotencyRecord.objects.get()
    assert stored.expires_at - stored.created_at == timedelta(minutes=5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lease": timedelta(seconds=5)}, "atomic=False"),
        ({"methods": ["POST", "GET"]}, "GET"),
        ({"methods": "POST"}, "list of methods"),
        # An empty list fell back to METHODS; bytes matched no request: both silently
        # protected something other than what they said.
        ({"methods": []}, "method names"),
        ({"methods": [b"POST"]}, "method names"),
        ({"methods": ["POST", ""]}, "method names"),
        ({"ttl": 0}, "longer than zero"),
        ({"ttl": "1h"}, "timedelta"),
        ({"atomic": False, "lease": -1}, "longer than zero"),
    ],
)
def test_invalid_arguments_raise_improperly_configured(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ImproperlyConfigured, match=message):
        idempotent(**kwargs)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "duration",
    [timedelta(days=3_000_000), 10**12, float("inf"), float("nan")],
    ids=["timedelta", "seconds", "infinity", "nan"],
)
def test_a_ttl_or_lease_beyond_ten_years_is_improperly_configured(duration: object) -> None:
    """``ttl=timedelta(days=3_000_000)`` was accepted: then every request answered 500 on MariaDB
    and SQLite, whose claim failed (``now + ttl`` past year 9999), and PostgreSQL stored records
    that Python cannot read. Infinity and NaN raised OverflowError and ValueError. The limit is
    that of the RECORD_TTL and LEASE settings."""
    with pytest.raises(ImproperlyConfigured, match=r"at most 3650 days"):
        idempotent(ttl=duration)  # type: ignore[call-overload]
    with pytest.raises(ImproperlyConfigured, match=r"at most 3650 days"):
        idempotent(atomic=False, lease=duration)  # type: ignore[call-overload]


@pytest.mark.django_db
def test_a_ttl_of_ten_years_is_stored() -> None:
    @idempotent(ttl=timedelta(days=3650))
    def view(request: HttpRequest) -> HttpResponse:
        return HttpResponse(b"ok", status=201)

    request = RequestFactory().post("/x", b"{}", "application/json", HTTP_IDEMPOTENCY_KEY="k")
    assert view(request).status_code == 201
    stored = IdempotencyRecord.objects.get()
    assert stored.expires_at - stored.created_at == timedelta(days=3650)


def test_both_spellings_return_a_wrapped_view() -> None:
    def view(request: HttpRequest) -> HttpResponse:
        return HttpResponse()

    assert idempotent(view).__name__ == "view"
    assert idempotent()(view).__wrapped__ is view  # type: ignore[attr-defined]
    assert idempotent(required=True, ttl=60, methods=["post"])(view).__name__ == "view"


def test_a_view_without_a_request_is_a_type_error() -> None:
    @idempotent
    def not_a_view(value: int) -> int:
        return value

    with pytest.raises(TypeError, match="could not find the request"):
        not_a_view(1)


@pytest.mark.django_db
def test_request_factory_requests_work_without_middleware() -> None:
    @idempotent
    def view(request: HttpRequest) -> HttpResponse:
        Effect.objects.create(name="factory")
        return HttpResponse(b"ok", status=201)

    request = RequestFactory().post("/x", b"{}", "application/json", HTTP_IDEMPOTENCY_KEY="k")
    assert view(request).status_code == 201
    request = RequestFactory().post("/x", b"{}", "application/json", HTTP_IDEMPOTENCY_KEY="k")
    assert view(request)["Idempotent-Replayed"] == "true"
    assert effects("factory") == 1


# -- the core on its own ----------------------------------------------------------------------


@pytest.mark.django_db
def test_the_core_can_be_called_without_django_http_objects() -> None:
    """Another framework describes its request as a Command and its response as Captured."""
    core = Idempotency(Policy(using=connection.alias, ttl=timedelta(hours=1)))
    command = Command(owner="tenant:7", key=str(uuid.uuid4()), method="POST", path="/rpc",
                      fingerprint="f" * 64)  # fmt: skip

    def view() -> dict[str, int]:
        Effect.objects.create(name="core")
        return {"status": 202, "id": 7}

    def capture(result: dict[str, int]) -> Captured:
        return Captured(result["status"], {"Content-Type": "application/json"},
                        json.dumps(result).encode())  # fmt: skip

    assert core.run(command, view, capture) == {"status": 202, "id": 7}
    replay = core.run(command, view, capture)
    assert isinstance(replay, Replay)
    assert replay.status == 202
    assert json.loads(replay.body) == {"status": 202, "id": 7}
    assert replay.headers == {"Content-Type": "application/json", "Idempotent-Replayed": "true"}
    with pytest.raises(KeyReused):
        core.run(Command(**{**command.__dict__, "fingerprint": "0" * 64}), view, capture)
    assert effects("core") == 1


# -- async cancellation -----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_cancelled_async_request_leaves_no_transaction_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client goes away while the claim runs (made slow here): the claim still finishes
    in its thread, then is rolled back; no transaction stays open on the connection."""
    from django_idempotency.http.store import RecordStore

    claim = RecordStore.claim

    def slow_claim(self: RecordStore, **kwargs: object) -> object:
        result = claim(self, **kwargs)  # type: ignore[arg-type]
        time.sleep(0.3)
        return result

    monkeypatch.setattr(RecordStore, "claim", slow_claim)
    core = Idempotency(Policy(using=connection.alias))
    command = Command("anonymous", "k", "POST", "/x", "f" * 64)
    ran = []

    async def view() -> str:
        ran.append(True)
        return "ran"

    async def scenario() -> None:
        task = asyncio.ensure_future(core.arun(command, view, lambda result: Captured(201)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async_to_sync(scenario)()
    assert not ran
    assert not connection.in_atomic_block
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_cancelled_async_view_is_rolled_back() -> None:
    core = Idempotency(Policy(using=connection.alias))
    command = Command("anonymous", "k", "POST", "/x", "f" * 64)

    async def view() -> str:
        await Effect.objects.acreate(name="cancelled")
        await asyncio.sleep(30)
        return "never"

    async def scenario() -> None:
        task = asyncio.ensure_future(core.arun(command, view, lambda result: Captured(201)))
        while not await Effect.objects.filter(name="cancelled").aexists():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async_to_sync(scenario)()
    assert not connection.in_atomic_block
    assert effects("cancelled") == 0
    assert not IdempotencyRecord.objects.exists()
