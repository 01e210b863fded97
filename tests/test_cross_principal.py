"""No stored response crosses principals, whatever authenticated the request (issue 34).

A table: every owner source (a session user, a DRF token, DRF Basic, DRF authentication given
to ``as_view()``, a custom authenticator whose principal is no User, Authorization values that
differ only in letter case with tab and space separators, a django-ninja API key whose auth
answers ``True``, an anonymous client) through every entry point (``@idempotent`` on a Django
view and on a DRF method; the middleware in front of a Django view, a DRF view, an
``@api_view`` function, a DRF view and a ViewSet whose authentication is given to
``as_view()``, and a path that resolves to no view; ``IdempotentMixin``, with class-level and
``as_view()`` authentication; django-ninja's ``idempotent``, alone and under the middleware's
``PATHS``, and a bare Ninja operation under ``PATHS``, which the middleware leaves alone).

Two principals send the same key and the same body, one after the other. Each gets either its
own execution or the answer the view itself gives without a key (its own refusal), never the
other's stored response; and the first one's retry is a replay, so that the key was stored and
the test could see it crossing. Real DRF, Django's test client, real rows, on every backend.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.http import HttpRequest, JsonResponse
from django.test import Client, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework import viewsets
from rest_framework.authentication import (
    BaseAuthentication,
    BasicAuthentication,
    SessionAuthentication,
    TokenAuthentication,
)
from rest_framework.authtoken.models import Token
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.http.drf import IdempotentMixin
from django_idempotency.models import IdempotencyRecord
from tests.test_middleware import with_middleware

PASSWORD = "pw-for-tests"
KEY = "6a0b1c2d-0000-4000-8000-000000000034"
BODY = {"amount": 100, "iban": "DE00 1234"}


# -- a principal that is no User ---------------------------------------------------------------


class ApiClientAuthentication(BaseAuthentication):
    """``X-Api-Client: <name>``: the principal is a row of another model (a Group here, standing
    for an API client or a service account), whose pk may equal a user's. The credential is not
    in ``Authorization``, so nothing but this authenticator tells two clients apart."""

    def authenticate(self, request: Request) -> tuple[Any, None] | None:
        name = request.META.get("HTTP_X_API_CLIENT")
        if name is None:
            return None
        client = Group.objects.filter(name=name).first()
        if client is None:
            raise AuthenticationFailed("unknown client")
        client.is_authenticated = True  # type: ignore[attr-defined]
        return client, None

    def authenticate_header(self, request: Request) -> str:
        return "Client"


AUTHENTICATION = [
    SessionAuthentication,
    BasicAuthentication,
    TokenAuthentication,
    ApiClientAuthentication,
]


def answer(request: Any) -> dict[str, Any]:
    user = getattr(request, "user", None)
    return {"nonce": uuid.uuid4().hex, "who": str(user)}


# -- the views, one per entry point ------------------------------------------------------------


@csrf_exempt
@idempotent
def decorated(request: HttpRequest) -> JsonResponse:
    return JsonResponse(answer(request), status=201)


@csrf_exempt
def plain(request: HttpRequest) -> JsonResponse:
    return JsonResponse(answer(request), status=201)


class DrfDecorated(APIView):
    authentication_classes = AUTHENTICATION
    permission_classes = [IsAuthenticated]

    @idempotent
    def post(self, request: Request) -> Response:
        return Response(answer(request), status=201)


class DrfClassLevel(APIView):
    authentication_classes = AUTHENTICATION
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        return Response(answer(request), status=201)


class DrfDefaults(APIView):
    """No class-level authentication: the settings' (session and basic) and AllowAny, unless
    ``as_view()`` says otherwise, as the URLs below do."""

    permission_classes = [AllowAny]

    def post(self, request: Request) -> Response:
        return Response(answer(request), status=201)


class DrfViewSet(viewsets.ViewSet):
    permission_classes = [AllowAny]

    def create(self, request: Request) -> Response:
        return Response(answer(request), status=201)


@api_view(["POST"])
@authentication_classes(AUTHENTICATION)
@permission_classes([IsAuthenticated])
def drf_function(request: Request) -> Response:
    return Response(answer(request), status=201)


# -- django-ninja: the same principals, as Ninja's auth classes find them -----------------------

try:  # django-ninja is the "ninja" extra, which the lowest CI job does not install
    from ninja import NinjaAPI, Router
    from ninja.security import APIKeyHeader, HttpBasicAuth, HttpBearer, django_auth
except ImportError:  # pragma: no cover - its entry points are left out of the table then
    NinjaAPI = None

#: The API keys django-ninja's ``FlagKey`` accepts (answering True), and the bearer tokens that
#: differ only in letter case.
FLAGS = {"flag-key-of-ann", "flag-key-of-bob"}

if NinjaAPI is not None:
    from django_idempotency.http import ninja as ninja_adapter

    class NinjaToken(HttpBearer):
        openapi_scheme = "token"  # DRF's "Token <key>"

        def authenticate(self, request: HttpRequest, token: str) -> Any:
            found = Token.objects.filter(key=token).select_related("user").first()
            return found.user if found else None

    class NinjaBasic(HttpBasicAuth):
        def authenticate(self, request: HttpRequest, username: str, password: str) -> Any:
            user = User.objects.filter(username=username).first()
            return user if user is not None and user.check_password(password) else None

    class NinjaApiClient(APIKeyHeader):
        param_name = "X-Api-Client"

        def authenticate(self, request: HttpRequest, key: str | None) -> Any:
            return Group.objects.filter(name=key).first() if key else None

    class NinjaCaseBearer(HttpBearer):
        def authenticate(self, request: HttpRequest, token: str) -> Any:
            return token if token in (LOWER, LOWER.upper()) else None

    class FlagKey(APIKeyHeader):
        param_name = "X-Flag"

        def authenticate(self, request: HttpRequest, key: str | None) -> Any:
            return True if key in FLAGS else None

    NINJA_AUTH = [
        django_auth, NinjaToken(), NinjaBasic(), NinjaApiClient(), NinjaCaseBearer(), FlagKey(),
    ]  # fmt: skip
    ninja_router = Router()

    def ninja_answer(request: HttpRequest) -> dict[str, Any]:
        return {"nonce": uuid.uuid4().hex, "who": str(request.auth)}  # type: ignore[attr-defined]

    @ninja_router.post("/op", auth=NINJA_AUTH)
    @ninja_adapter.idempotent
    def ninja_op(request: HttpRequest) -> dict[str, Any]:
        return ninja_answer(request)

    @ninja_router.post("/bare", auth=NINJA_AUTH)
    def ninja_bare(request: HttpRequest) -> dict[str, Any]:
        return ninja_answer(request)

    own_ninja = NinjaAPI(urls_namespace="cross-principal-own")
    own_ninja.add_router("/", ninja_router)
    mw_ninja = NinjaAPI(urls_namespace="cross-principal-mw")
    mw_ninja.add_router("/", ninja_router)


class MixinClassLevel(IdempotentMixin, DrfClassLevel):
    pass


class MixinDefaults(IdempotentMixin, DrfDefaults):
    pass


PER_URL = {"authentication_classes": AUTHENTICATION, "permission_classes": [IsAuthenticated]}

urlpatterns = [
    path("own/decorator/", decorated),
    path("own/decorator-drf/", DrfDecorated.as_view()),
    path("own/mixin/", MixinClassLevel.as_view()),
    path("own/mixin-initkwargs/", MixinDefaults.as_view(**PER_URL)),
    path("mw/django/", plain),
    path("mw/drf/", DrfClassLevel.as_view()),
    path("mw/api-view/", drf_function),
    path("mw/drf-initkwargs/", DrfDefaults.as_view(**PER_URL)),
    path("mw/viewset-initkwargs/", DrfViewSet.as_view({"post": "create"}, **PER_URL)),
]

ENTRY_POINTS = {
    "decorator": "/own/decorator/",
    "decorator-drf": "/own/decorator-drf/",
    "mixin": "/own/mixin/",
    "mixin-initkwargs": "/own/mixin-initkwargs/",
    "middleware-django": "/mw/django/",
    "middleware-drf": "/mw/drf/",
    "middleware-api-view": "/mw/api-view/",
    "middleware-drf-initkwargs": "/mw/drf-initkwargs/",
    "middleware-viewset-initkwargs": "/mw/viewset-initkwargs/",
    "middleware-no-view": "/mw/nothing-here/",
}
#: Entry points that store nothing: a bare Ninja operation, which the middleware leaves alone.
NOT_STORED = {"middleware-ninja-bare"}
if NinjaAPI is not None:
    urlpatterns += [path("own/ninja/", own_ninja.urls), path("mw/ninja/", mw_ninja.urls)]
    ENTRY_POINTS.update(
        {
            "ninja": "/own/ninja/op",
            "middleware-ninja": "/mw/ninja/op",
            "middleware-ninja-bare": "/mw/ninja/bare",
        }
    )


# -- the owner sources: two principals each ----------------------------------------------------


@dataclass
class People:
    ann: User
    bob: User
    client: Group  # an API client whose pk is ann's
    other_client: Group


@dataclass(frozen=True)
class Principal:
    session: str | None = None  # the username to log in, if any
    authorization: str | None = None  # the header, built from People
    api_client: str | None = None  # X-Api-Client, for ApiClientAuthentication
    flag: str | None = None  # X-Flag, for django-ninja's FlagKey (its auth answers True)


def basic(user: User) -> str:
    return "Basic " + base64.b64encode(f"{user.username}:{PASSWORD}".encode()).decode()


def token(user: User) -> str:
    return Token.objects.get(user=user).key


LOWER = "case0only0token0abc"
SOURCES: dict[str, tuple[Callable[[People], Principal], Callable[[People], Principal]]] = {
    "session": (lambda p: Principal(session="ann"), lambda p: Principal(session="bob")),
    "drf-token": (
        lambda p: Principal(authorization=f"Token {token(p.ann)}"),
        lambda p: Principal(authorization=f"Token {token(p.bob)}"),
    ),
    "drf-basic": (
        lambda p: Principal(authorization=basic(p.ann)),
        lambda p: Principal(authorization=basic(p.bob)),
    ),
    # A principal of another model, pk equal to ann's; then ann herself.
    "non-user-principal": (
        lambda p: Principal(api_client=p.client.name),
        lambda p: Principal(authorization=basic(p.ann)),
    ),
    # Credentials only the view's own authenticators know (given to as_view() on the
    # "initkwargs" views): a second API client, and a client with no credentials at all.
    "second-api-client": (
        lambda p: Principal(api_client=p.client.name),
        lambda p: Principal(api_client=p.other_client.name),
    ),
    "api-client-then-nobody": (
        lambda p: Principal(api_client=p.client.name),
        lambda p: Principal(),
    ),
    "case-only-tab": (
        lambda p: Principal(authorization=f"Bearer\t{LOWER}"),
        lambda p: Principal(authorization=f"Bearer\t{LOWER.upper()}"),
    ),
    "case-only-space": (
        lambda p: Principal(authorization=f"Bearer {LOWER}"),
        lambda p: Principal(authorization=f"bearer \t {LOWER.upper()}"),
    ),
    # An API key only django-ninja checks, whose auth answers True (no one to Django and DRF).
    "ninja-flag-key": (
        lambda p: Principal(flag="flag-key-of-ann"),
        lambda p: Principal(flag="flag-key-of-bob"),
    ),
    "anonymous": (lambda p: Principal(authorization=basic(p.ann)), lambda p: Principal()),
}


@pytest.fixture(autouse=True)
def installed() -> Iterator[None]:
    with override_settings(
        ROOT_URLCONF=__name__,
        MIDDLEWARE=with_middleware(),
        IDEMPOTENCY={"PATHS": [r"^/mw/"]},
    ):
        yield


@pytest.fixture
def people(db: None) -> People:
    ann = User.objects.create_user("ann", password=PASSWORD)
    bob = User.objects.create_user("bob", password=PASSWORD)
    Token.objects.create(user=ann)
    Token.objects.create(user=bob)
    client = Group.objects.create(pk=ann.pk, name="payments-service")
    other_client = Group.objects.create(pk=bob.pk, name="reports-service")
    return People(ann, bob, client, other_client)


def send(people: People, principal: Principal, url: str, key: str | None) -> Any:
    client = Client()
    if principal.session:
        client.force_login(User.objects.get(username=principal.session))
    headers = {}
    if principal.authorization is not None:
        headers["Authorization"] = principal.authorization
    if principal.api_client is not None:
        headers["X-Api-Client"] = principal.api_client
    if principal.flag is not None:
        headers["X-Flag"] = principal.flag
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post(url, json.dumps(BODY), content_type="application/json", headers=headers)


def nonce(response: Any) -> str | None:
    if not 200 <= response.status_code < 300:
        return None
    return str(json.loads(response.content)["nonce"])


def both_anonymous(first: Principal, second: Principal, plain: dict[Principal, Any]) -> bool:
    """Whether the view saw no one in either request, and no Authorization header was sent."""
    if first.authorization or second.authorization or first.session or second.session:
        return False
    seen = {who(response) for response in plain.values()}
    return seen <= {"AnonymousUser", "None", "no view"}


def who(response: Any) -> str:
    """Whom the view saw: its answer's ``who``, "no view" for a 404, else "refused"."""
    if response.status_code == 404:
        return "no view"
    if response.status_code >= 300:
        return "refused"
    return str(json.loads(response.content)["who"])


def replayed(response: Any) -> bool:
    return response.get("Idempotent-Replayed") == "true"


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_stored_response_never_crosses_principals(
    people: People, source: str, entry: str
) -> None:
    url = ENTRY_POINTS[entry]
    first, second = (build(people) for build in SOURCES[source])
    # What the view itself answers each principal, with no key (nothing stored, nothing replayed).
    plain = {p: send(people, p, url, None) for p in (first, second)}
    verdict = {p: response.status_code for p, response in plain.items()}
    if both_anonymous(first, second, plain):
        # Nothing the view knows tells them apart (a view that does not read X-Api-Client):
        # one anonymous client to it, and to the owner too; the documented shared scope.
        assert not replayed(send(people, first, url, KEY))
        assert verdict[second] >= 300 or replayed(send(people, second, url, KEY))
        return

    answers = []
    for principal in (first, second):
        response = send(people, principal, url, KEY)
        assert not replayed(response), (entry, source, principal, response.content)
        assert response.status_code == verdict[principal], (entry, source, principal)
        answers.append(response)
    nonces = [nonce(r) for r in answers]
    if None not in nonces:
        assert nonces[0] != nonces[1]  # two executions, not one answer

    # The first principal's retry: a replay of its own answer when it was stored (a 2xx, a
    # 404), so the key was there to cross; a refusal again otherwise.
    retry = send(people, first, url, KEY)
    if entry in NOT_STORED:
        assert not replayed(retry)
    elif 200 <= answers[0].status_code < 300:
        assert replayed(retry), (entry, source)
        assert retry.content == answers[0].content
    assert retry.status_code == answers[0].status_code
    # And the second principal, after the first one's retry, still never gets the first's.
    again = send(people, second, url, KEY)
    assert again.status_code == verdict[second]
    if nonce(again) is not None:
        assert nonce(again) != nonces[0]
    stored = IdempotencyRecord.objects.filter(key=KEY).count()
    assert stored <= 2


def test_the_table_covers_each_owner_kind(people: People) -> None:
    """The sources above reach the owner kinds they stand for (a guard on the table itself)."""
    for source in ("session", "drf-token", "non-user-principal", "case-only-tab"):
        for build in SOURCES[source]:
            send(people, build(people), ENTRY_POINTS["middleware-drf-initkwargs"], KEY)
            send(people, build(people), ENTRY_POINTS["decorator"], KEY + "-d")
    owners = set(IdempotencyRecord.objects.values_list("owner", flat=True))
    assert f"user:{people.ann.pk}" in owners
    assert f"user:{people.bob.pk}" in owners
    assert f"principal:auth.group:{people.client.pk}" in owners
    assert len([o for o in owners if o.startswith("auth:")]) >= 2
