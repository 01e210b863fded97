"""The middleware in front of a DRF view: the view's own refusal wins over a replay (issue 34).

The middleware builds the view as DRF does, with the ``as_view()`` arguments of its URL, and
runs its checks (authentication, permissions) before it reaches a stored response. Throttles
stay the view's: they count each request once.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.test import AsyncClient, Client, override_settings
from django.urls import path
from rest_framework import viewsets
from rest_framework.authentication import BaseAuthentication, BasicAuthentication
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import BasePermission, IsAdminUser, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import BaseThrottle
from rest_framework.views import APIView

from django_idempotency.http.drf import authenticated_request
from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Effect
from tests.test_middleware import with_middleware

PASSWORD = "pw-for-tests"
THROTTLED: list[str] = []  # one entry per throttle check


class ServiceAuthentication(BaseAuthentication):
    """``X-Service: <username>``: refuses an unknown name, raises on "boom"."""

    def authenticate(self, request: Request) -> tuple[User, None] | None:
        name = request.META.get("HTTP_X_SERVICE")
        if name is None:
            return None
        if name == "boom":
            raise RuntimeError("the authenticator broke")
        user = User.objects.filter(username=name, is_active=True).first()
        if user is None:
            raise AuthenticationFailed("unknown service")
        return user, None

    def authenticate_header(self, request: Request) -> str:
        return "Service"


class CountingThrottle(BaseThrottle):
    def allow_request(self, request: Request, view: Any) -> bool:
        THROTTLED.append(request.method or "")
        return True


class ReadsData(BasePermission):
    def has_permission(self, request: Request, view: Any) -> bool:
        return bool(request.data.get("allowed", True))


class Transfer(APIView):
    """Class-level: the settings' authentication (session, basic) and no permission."""

    permission_classes: list[type] = []

    def post(self, request: Request) -> Response:
        effect = Effect.objects.create(name="transfer", payload=str(request.data))
        return Response({"effect": effect.pk, "user": str(request.user)}, status=201)


class Payments(viewsets.ViewSet):
    """Permissions that depend on the action, as a ViewSet's often do."""

    def get_permissions(self) -> list[BasePermission]:
        return [IsAdminUser()] if self.action == "create" else [IsAuthenticated()]

    def create(self, request: Request) -> Response:
        effect = Effect.objects.create(name="payment", payload=str(request.data))
        return Response({"effect": effect.pk, "user": str(request.user)}, status=201)


urlpatterns = [
    path(
        "mw/payments/",
        Payments.as_view({"post": "create"}, authentication_classes=[BasicAuthentication]),
    ),
    path(
        "mw/admin-only/",
        Transfer.as_view(
            authentication_classes=[BasicAuthentication], permission_classes=[IsAdminUser]
        ),
    ),
    path(
        "mw/service/",
        Transfer.as_view(
            authentication_classes=[ServiceAuthentication],
            permission_classes=[IsAuthenticated],
            throttle_classes=[CountingThrottle],
        ),
    ),
    path("mw/reads-data/", Transfer.as_view(permission_classes=[ReadsData])),
]


@pytest.fixture(autouse=True)
def installed() -> Iterator[None]:
    THROTTLED.clear()
    with override_settings(
        ROOT_URLCONF=__name__, MIDDLEWARE=with_middleware(), IDEMPOTENCY={"PATHS": [r"^/mw/"]}
    ):
        yield


def basic(user: User) -> dict[str, str]:
    token = base64.b64encode(f"{user.username}:{PASSWORD}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def send(url: str, key: str, headers: dict[str, str] | None = None, data: Any = None) -> Any:
    client = Client(raise_request_exception=False)
    return client.post(
        url,
        json.dumps({"amount": 1} if data is None else data),
        content_type="application/json",
        headers={"Idempotency-Key": key, **(headers or {})},
    )


def replayed(response: Any) -> bool:
    return response.get("Idempotent-Replayed") == "true"


@pytest.mark.django_db
def test_a_withdrawn_permission_gets_the_views_403_not_the_replay() -> None:
    """The middleware served the stored 201 to a user whose IsAdminUser was withdrawn."""
    ann = User.objects.create_user("ann", password=PASSWORD, is_staff=True)
    assert send("/mw/admin-only/", "k", basic(ann)).status_code == 201
    assert replayed(send("/mw/admin-only/", "k", basic(ann)))
    User.objects.filter(pk=ann.pk).update(is_staff=False)
    refused = send("/mw/admin-only/", "k", basic(ann))
    assert refused.status_code == 403
    assert not replayed(refused)
    assert Effect.objects.count() == 1


@pytest.mark.django_db
def test_a_viewsets_action_permissions_run_before_a_replay() -> None:
    ann = User.objects.create_user("ann", password=PASSWORD, is_staff=True)
    assert send("/mw/payments/", "k", basic(ann)).status_code == 201
    assert replayed(send("/mw/payments/", "k", basic(ann)))
    User.objects.filter(pk=ann.pk).update(is_staff=False)
    refused = send("/mw/payments/", "k", basic(ann))
    assert refused.status_code == 403 and not replayed(refused)
    nobody = send("/mw/payments/", "k")
    assert nobody.status_code in (401, 403) and not replayed(nobody)
    assert Effect.objects.count() == 1


@pytest.mark.django_db
def test_as_view_authentication_scopes_the_owner_and_refuses_the_rest() -> None:
    """Under the middleware these clients all were ``anonymous``: the second and a client with
    no credentials got the first one's stored response."""
    User.objects.create_user("alice")
    User.objects.create_user("bob")
    first = send("/mw/service/", "k", {"X-Service": "alice"})
    assert first.status_code == 201
    assert json.loads(first.content)["user"] == "alice"
    assert replayed(send("/mw/service/", "k", {"X-Service": "alice"}))
    second = send("/mw/service/", "k", {"X-Service": "bob"})
    assert second.status_code == 201 and not replayed(second)
    assert json.loads(second.content)["user"] == "bob"
    for headers in ({}, {"X-Service": "mallory"}):
        refused = send("/mw/service/", "k", headers)
        assert refused.status_code in (401, 403) and not replayed(refused)
    owners = set(IdempotencyRecord.objects.values_list("owner", flat=True))
    assert owners == {f"user:{u.pk}" for u in User.objects.all()}


@pytest.mark.django_db
def test_an_authenticator_that_raises_is_the_views_failure_and_stores_nothing() -> None:
    response = send("/mw/service/", "k", {"X-Service": "boom"})
    assert response.status_code == 500
    assert not IdempotencyRecord.objects.exists()
    assert not Effect.objects.exists()


@pytest.mark.django_db
def test_throttles_count_each_request_once() -> None:
    """Checked by the view only: the middleware's checks would have counted them twice."""
    User.objects.create_user("alice")
    assert send("/mw/service/", "k", {"X-Service": "alice"}).status_code == 201
    assert THROTTLED == ["POST"]
    assert replayed(send("/mw/service/", "k", {"X-Service": "alice"}))
    assert THROTTLED == ["POST"]  # a replay never reaches the view, nor its throttles


@pytest.mark.django_db
def test_a_permission_that_reads_the_body_leaves_it_to_the_view() -> None:
    first = send("/mw/reads-data/", "k", data={"allowed": True, "amount": 5})
    assert first.status_code == 201, first.content
    assert "'amount': 5" in Effect.objects.get().payload  # the view still read the body
    assert replayed(send("/mw/reads-data/", "k", data={"allowed": True, "amount": 5}))
    refused = send("/mw/reads-data/", "k2", data={"allowed": False})
    assert refused.status_code == 403 and not replayed(refused)
    assert IdempotencyRecord.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_the_async_middleware_runs_the_same_checks() -> None:
    User.objects.create_user("alice")
    User.objects.create_user("bob")

    async def scenario() -> None:
        client = AsyncClient(raise_request_exception=False)

        async def send_async(headers: dict[str, str]) -> Any:
            return await client.post(
                "/mw/service/",
                {"amount": 1},
                content_type="application/json",
                headers={"Idempotency-Key": "k", **headers},
            )

        first = await send_async({"X-Service": "alice"})
        assert first.status_code == 201
        assert replayed(await send_async({"X-Service": "alice"}))
        second = await send_async({"X-Service": "bob"})
        assert second.status_code == 201 and not replayed(second)
        refused = await send_async({})
        assert refused.status_code in (401, 403) and not replayed(refused)

    async_to_sync(scenario)()
    assert Effect.objects.count() == 2


@pytest.mark.django_db
def test_authenticated_request_builds_the_view_with_its_initkwargs(rf: Any) -> None:
    request = rf.post("/", headers={"X-Service": "nobody"})
    request.user = None
    # The class alone has no ServiceAuthentication: the header means nothing to it.
    assert authenticated_request(request, Transfer) is not None
    initkwargs = {"authentication_classes": [ServiceAuthentication]}
    assert authenticated_request(request, Transfer, initkwargs) is None  # AuthenticationFailed
    User.objects.create_user("nobody")
    checked = authenticated_request(request, Transfer, initkwargs)
    assert checked is not None and checked.user.username == "nobody"
    assert request.user is None  # the Django request is left as it was
