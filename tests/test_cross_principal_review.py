"""An outside review of issue 34's fixes: the holes it found, each reproduced with the real
django-ninja, DRF and Django test client, on every database pass.

1. Under the middleware, a django-ninja operation is left to Ninja's own integration: it is
   never claimed nor replayed with an owner computed before Ninja's authentication ran.
2. The middleware decides (DRF, Ninja, the owner) on the view the request resolves to with its
   own ``request.urlconf``; a view resolved otherwise than Django resolves it (a middleware
   below it sets ``request.urlconf``, ``LocaleMiddleware`` below it and ``i18n_patterns``) is
   refused, never scoped wrongly; system check W023 names the placement.
3. ``@idempotent`` around a whole DRF view runs before DRF's authentication: refused.
4. Under the middleware, a replay is never served to a request that CSRF refuses.
5. A django-ninja auth that returns ``True`` names the credential it checked, not ``anonymous``.
6. Django's ``@idempotent`` on a django-ninja operation is refused, naming Ninja's decorator.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.contrib.auth.models import Group, User
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import AsyncClient, Client, RequestFactory, override_settings
from django.urls import path
from django.utils import translation
from django.utils.decorators import method_decorator
from django.views.decorators.csrf import csrf_exempt
from rest_framework.authentication import SessionAuthentication
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.http.checks import check_http_views
from django_idempotency.models import IdempotencyRecord
from tests.test_cross_principal import ApiClientAuthentication
from tests.test_middleware import with_middleware

pytestmark = pytest.mark.django_db

KEY = "6a0b1c2d-0000-4000-8000-0000000000a1"
BODY = {"amount": 100}
PASSWORD = "pw-for-tests"


def answer(request: Any) -> dict[str, Any]:
    who = getattr(request, "auth", None)
    if who is None:
        who = getattr(request, "user", None)
    return {"nonce": uuid.uuid4().hex, "who": str(who)}


def send(client: Client, url: str, key: str | None = KEY, body: Any = None, **headers: str) -> Any:
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post(
        url, json.dumps(BODY if body is None else body), content_type="application/json",
        headers=headers,
    )  # fmt: skip


def replayed(response: Any) -> bool:
    return response.get("Idempotent-Replayed") == "true"


def nonce(response: Any) -> str:
    return str(json.loads(response.content)["nonce"])


# -- django-ninja ------------------------------------------------------------------------------

try:  # django-ninja is the "ninja" extra, which the lowest CI job does not install
    from ninja import NinjaAPI, Router, Schema
    from ninja.security import APIKeyCookie, APIKeyHeader, APIKeyQuery, HttpBearer
except ImportError:  # pragma: no cover - the Ninja tests are skipped then
    NinjaAPI = None

needs_ninja = pytest.mark.skipif(NinjaAPI is None, reason="django-ninja is not installed")
#: The credentials Ninja accepts; removing one revokes it.
KEYS = {"key-of-ann", "key-of-bob"}

if NinjaAPI is not None:
    from django_idempotency.http import ninja as ninja_adapter

    class HeaderKey(APIKeyHeader):
        param_name = "X-Key"

        def authenticate(self, request: HttpRequest, key: str | None) -> str | None:
            return key if key in KEYS else None

    class Bearer(HttpBearer):
        def authenticate(self, request: HttpRequest, token: str) -> str | None:
            return token if token in KEYS else None

    class FlagHeader(APIKeyHeader):
        """An API key checked against a set, answering ``True``: the key says who."""

        param_name = "X-Flag"

        def authenticate(self, request: HttpRequest, key: str | None) -> bool | None:
            return True if key in KEYS else None

    class FlagQuery(APIKeyQuery):
        param_name = "flag"

        def authenticate(self, request: HttpRequest, key: str | None) -> bool | None:
            return True if key in KEYS else None

    class FlagCookie(APIKeyCookie):
        param_name = "flag"

        def authenticate(self, request: HttpRequest, key: str | None) -> bool | None:
            return True if key in KEYS else None

    def opaque_check(request: HttpRequest) -> bool | None:
        """An auth callable the library cannot look into: what it checked is unknown."""
        return True if request.headers.get("X-Opaque") in KEYS else None

    class In(Schema):
        amount: int

    router = Router()

    @router.post("/decorated", auth=[HeaderKey(), Bearer()])
    @ninja_adapter.idempotent
    def ninja_decorated(request: HttpRequest, payload: In) -> dict[str, Any]:
        return answer(request)

    @router.post("/plain", auth=[HeaderKey(), Bearer()])
    def ninja_plain(request: HttpRequest, payload: In) -> dict[str, Any]:
        return answer(request)

    @router.post("/flag", auth=[FlagHeader(), FlagQuery(), FlagCookie(csrf=False)])
    @ninja_adapter.idempotent
    def ninja_flag(request: HttpRequest, payload: In) -> dict[str, Any]:
        return answer(request)

    @router.post("/async-flag", auth=[FlagHeader()])
    @ninja_adapter.idempotent
    async def ninja_async_flag(request: HttpRequest, payload: In) -> dict[str, Any]:
        return answer(request)

    @router.post("/opaque", auth=[opaque_check])
    @ninja_adapter.idempotent
    def ninja_opaque(request: HttpRequest, payload: In) -> dict[str, Any]:
        return answer(request)

    mw_api = NinjaAPI(urls_namespace="review-mw-ninja")
    mw_api.add_router("/", router)
    own_api = NinjaAPI(urls_namespace="review-own-ninja")
    own_api.add_router("/", router)


# -- Django and DRF ----------------------------------------------------------------------------


class ApiClientView(APIView):
    authentication_classes = [ApiClientAuthentication]
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        return Response(answer(request), status=201)


class SessionView(APIView):
    authentication_classes = [SessionAuthentication]
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        return Response(answer(request), status=201)


def django_view(request: HttpRequest) -> JsonResponse:
    """CSRF-protected: not exempt, as any Django view is by default."""
    return JsonResponse(answer(request), status=201)


@csrf_exempt
def plain_exempt(request: HttpRequest) -> JsonResponse:
    return JsonResponse(answer(request), status=201)


@csrf_exempt
def sign_up(request: HttpRequest) -> JsonResponse:
    """Creates a user and logs it in: the view itself replaces ``request.user``."""
    from django.contrib.auth import login

    user = User.objects.create(username=f"new-{uuid.uuid4().hex[:8]}")
    login(request, user, backend="django.contrib.auth.backends.ModelBackend")
    return JsonResponse({"user": user.username}, status=201)


urlpatterns = [
    path("mw/sign-up/", sign_up),
    path("mw/api-client/", ApiClientView.as_view()),
    path("mw/session-drf/", SessionView.as_view()),
    path("mw/django/", django_view),
    path("mw/host/", plain_exempt),  # the host urlconf maps this path to ApiClientView
]
if NinjaAPI is not None:
    urlpatterns += [path("mw/ninja/", mw_api.urls), path("own/ninja/", own_api.urls)]


@pytest.fixture(autouse=True)
def installed() -> Iterator[None]:
    with override_settings(
        ROOT_URLCONF=__name__, MIDDLEWARE=with_middleware(), IDEMPOTENCY={"PATHS": [r"^/mw/"]}
    ):
        yield


@pytest.fixture
def api_clients() -> tuple[Group, Group]:
    return Group.objects.create(name="payments"), Group.objects.create(name="reports")


# -- 1. the middleware leaves django-ninja to Ninja ---------------------------------------------


@needs_ninja
@pytest.mark.parametrize("operation", ["decorated", "plain"])
def test_the_middleware_never_scopes_a_ninja_operation_before_ninjas_auth(
    client: Client, operation: str
) -> None:
    """An API key outside ``Authorization``: before Ninja's auth every client is anonymous."""
    url = f"/mw/ninja/{operation}"
    ann = send(client, url, **{"X-Key": "key-of-ann"})
    bob = send(client, url, **{"X-Key": "key-of-bob"})
    assert ann.status_code == bob.status_code == 200, (ann.content, bob.content)
    assert not replayed(bob)
    assert nonce(bob) != nonce(ann)
    assert json.loads(bob.content)["who"] == "key-of-bob"


@needs_ninja
def test_under_the_middleware_a_ninja_refusal_is_never_answered_by_a_replay(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = "/mw/ninja/decorated"
    first = send(client, url, Authorization="Bearer key-of-ann")
    assert first.status_code == 200
    assert replayed(send(client, url, Authorization="Bearer key-of-ann"))  # stored
    monkeypatch.setattr(__import__(__name__, fromlist=["KEYS"]), "KEYS", {"key-of-bob"})
    revoked = send(client, url, Authorization="Bearer key-of-ann")
    assert revoked.status_code == 401
    assert not replayed(revoked) and b"nonce" not in revoked.content


@needs_ninja
def test_under_the_middleware_ninjas_adapter_owns_the_key(client: Client) -> None:
    """The record is the adapter's: its owner is what Ninja authenticated."""
    send(client, "/mw/ninja/decorated", **{"X-Key": "key-of-ann"})
    owner = IdempotencyRecord.objects.get().owner
    assert owner == ninja_adapter.principal_owner("key-of-ann")


@needs_ninja
def test_an_undecorated_ninja_operation_is_left_alone_by_the_middleware(client: Client) -> None:
    """Not idempotent (system check W024 names it), never claimed before Ninja's auth."""
    send(client, "/mw/ninja/plain", **{"X-Key": "key-of-ann"})
    again = send(client, "/mw/ninja/plain", **{"X-Key": "key-of-ann"})
    assert again.status_code == 200 and not replayed(again)
    assert not IdempotencyRecord.objects.exists()


# -- 2. the view the middleware decides for is the one Django runs -----------------------------

HOST_URLCONF = "tests.review_host_urls"


class HostUrlconf:
    """Per-site urlconfs, as django-hosts sets them per host: the ``api`` site (``X-Site``,
    which both test clients send as given, unlike ``Host``) has its own URLs."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.headers.get("X-Site") == "api":
            request.urlconf = HOST_URLCONF
        return self.get_response(request)


HOST_MIDDLEWARE = f"{__name__}.HostUrlconf"
IDEMPOTENCY_MIDDLEWARE = "django_idempotency.http.middleware.IdempotencyMiddleware"


def host_middleware(above: bool) -> list[str]:
    middleware = list(settings.MIDDLEWARE)  # the fixture's: IdempotencyMiddleware is in it
    position = middleware.index(IDEMPOTENCY_MIDDLEWARE) + (0 if above else 1)
    middleware.insert(position, HOST_MIDDLEWARE)
    return middleware


def test_the_middleware_resolves_with_the_urlconf_an_earlier_middleware_set(
    client: Client, api_clients: tuple[Group, Group]
) -> None:
    with override_settings(MIDDLEWARE=host_middleware(above=True)):
        ann = send(client, "/mw/host/", **{"X-Site": "api", "X-Api-Client": "payments"})
        bob = send(client, "/mw/host/", **{"X-Site": "api", "X-Api-Client": "reports"})
        nobody = send(client, "/mw/host/", **{"X-Site": "api"})
    assert ann.status_code == bob.status_code == 201
    assert not replayed(bob) and nonce(bob) != nonce(ann)
    assert nobody.status_code in (401, 403) and not replayed(nobody)


def test_a_urlconf_set_below_the_middleware_is_refused_not_mis_scoped(
    api_clients: tuple[Group, Group],
) -> None:
    client = Client(raise_request_exception=False)
    with override_settings(MIDDLEWARE=host_middleware(above=False)):
        ann = send(client, "/mw/host/", **{"X-Site": "api", "X-Api-Client": "payments"})
        nobody = send(client, "/mw/host/", **{"X-Site": "api"})
    assert ann.status_code == 500 and nobody.status_code == 500
    assert not replayed(nobody)
    assert not IdempotencyRecord.objects.exists()


def test_the_refusal_names_what_to_move(api_clients: tuple[Group, Group]) -> None:
    with (
        override_settings(MIDDLEWARE=host_middleware(above=False)),
        pytest.raises(ImproperlyConfigured, match=r"request\.urlconf") as refused,
    ):
        send(Client(), "/mw/host/", **{"X-Site": "api", "X-Api-Client": "payments"})
    assert "W023" in str(refused.value)


LOCALE = "django.middleware.locale.LocaleMiddleware"
I18N_URLCONF = "tests.review_i18n_urls"
I18N_PATHS = {"PATHS": [r"^/[a-z-]+/mw/"]}


def locale_middleware(below: bool) -> list[str]:
    middleware = list(settings.MIDDLEWARE)
    position = middleware.index(IDEMPOTENCY_MIDDLEWARE) + (1 if below else 0)
    middleware.insert(position, LOCALE)
    return middleware


def test_locale_middleware_below_it_with_i18n_patterns_is_refused_not_mis_scoped(
    api_clients: tuple[Group, Group],
) -> None:
    """Before ``LocaleMiddleware``, ``/fr/...`` resolves to no view (the active language is
    not French yet): the request used to be handled as a plain Django view, and a client with
    no credentials got the API client's stored response."""
    client = Client(raise_request_exception=False)
    with (
        translation.override("en"),
        override_settings(
            ROOT_URLCONF=I18N_URLCONF,
            MIDDLEWARE=locale_middleware(below=True),
            IDEMPOTENCY=I18N_PATHS,
        ),
    ):
        ann = send(client, "/fr/mw/api-client/", **{"X-Api-Client": "payments"})
        translation.activate("en")  # LocaleMiddleware left French active in this thread
        nobody = send(client, "/fr/mw/api-client/")
    assert ann.status_code == 500 and nobody.status_code == 500
    assert not replayed(nobody)
    assert not IdempotencyRecord.objects.exists()


def test_locale_middleware_above_it_scopes_by_the_views_authentication(
    api_clients: tuple[Group, Group],
) -> None:
    client = Client()
    with (
        translation.override("en"),
        override_settings(
            ROOT_URLCONF=I18N_URLCONF,
            MIDDLEWARE=locale_middleware(below=False),
            IDEMPOTENCY=I18N_PATHS,
        ),
    ):
        ann = send(client, "/fr/mw/api-client/", **{"X-Api-Client": "payments"})
        bob = send(client, "/fr/mw/api-client/", **{"X-Api-Client": "reports"})
        nobody = send(client, "/fr/mw/api-client/")
        again = send(client, "/fr/mw/api-client/", **{"X-Api-Client": "payments"})
    assert ann.status_code == bob.status_code == 201
    assert not replayed(bob) and nonce(bob) != nonce(ann)
    assert nobody.status_code in (401, 403) and not replayed(nobody)
    assert replayed(again) and again.content == ann.content


def w023() -> list[str]:
    return [m.msg for m in check_http_views() if m.id == "django_idempotency.W023"]


def test_w023_names_locale_middleware_below_it_when_i18n_patterns_are_used() -> None:
    with override_settings(ROOT_URLCONF=I18N_URLCONF, MIDDLEWARE=locale_middleware(below=True)):
        (message,) = w023()
    assert LOCALE in message
    with override_settings(ROOT_URLCONF=I18N_URLCONF, MIDDLEWARE=locale_middleware(below=False)):
        assert w023() == []
    with override_settings(MIDDLEWARE=locale_middleware(below=True)):  # no i18n_patterns
        assert w023() == []


@needs_ninja
def test_w024_names_ninja_operations_under_paths_without_ninjas_decorator() -> None:
    (message,) = [m.msg for m in check_http_views() if m.id == "django_idempotency.W024"]
    assert "POST /mw/ninja/plain" in message
    assert "decorated" not in message and "/own/ninja/" not in message
    with override_settings(IDEMPOTENCY={"PATHS": [r"^/mw/(?!ninja)"]}):
        assert not [m for m in check_http_views() if m.id == "django_idempotency.W024"]


@pytest.mark.django_db(transaction=True)
def test_items_1_2_and_4_hold_under_asgi(api_clients: tuple[Group, Group]) -> None:
    """The middleware in async mode: Ninja left to Ninja, a mis-resolved view refused, CSRF
    checked before a replay."""
    ann = User.objects.create_user("ann", password=PASSWORD)
    token = "csrf0" * 6 + "ok"

    async def scenario() -> None:
        client = AsyncClient()

        async def asend(url: str, client: AsyncClient = client, **headers: str) -> Any:
            headers["Idempotency-Key"] = KEY
            return await client.post(
                url, json.dumps(BODY), content_type="application/json", headers=headers
            )

        if NinjaAPI is not None:
            first = await asend("/mw/ninja/decorated", **{"X-Key": "key-of-ann"})
            second = await asend("/mw/ninja/decorated", **{"X-Key": "key-of-bob"})
            assert first.status_code == second.status_code == 200
            assert not replayed(second) and nonce(second) != nonce(first)

        browser = AsyncClient(enforce_csrf_checks=True)
        await browser.aforce_login(ann)
        browser.cookies["csrftoken"] = token
        assert (await asend("/mw/django/", browser, **{"X-CSRFToken": token})).status_code == 201
        assert replayed(await asend("/mw/django/", browser, **{"X-CSRFToken": token}))
        forged = await asend("/mw/django/", browser)
        assert forged.status_code == 403 and not replayed(forged)

        refusing = AsyncClient(raise_request_exception=False)
        with override_settings(MIDDLEWARE=host_middleware(above=False)):
            misrouted = await asend(
                "/mw/host/", refusing, **{"X-Site": "api", "X-Api-Client": "payments"}
            )
        assert misrouted.status_code == 500, misrouted.content[:300]

    async_to_sync(scenario)()
    assert not IdempotencyRecord.objects.filter(path="/mw/host/").exists()


# -- found by the attacker's look: a framework the middleware cannot see --------------------

HIDDEN_URLCONF = "tests.review_hidden_urls"


def hidden_drf(request: HttpRequest) -> Any:
    """A DRF view behind a wrapper that does not use functools.wraps: no ``view_class``."""
    return ApiClientView.as_view()(request)


class LateTokenMiddleware:
    """An authentication middleware that sets ``request.auth`` from ``X-Api-Client``, placed
    below IdempotencyMiddleware (E004 knows only Django's AuthenticationMiddleware)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        name = request.headers.get("X-Api-Client")
        if name:
            request.auth = Group.objects.filter(name=name).first()  # type: ignore[attr-defined]
        return self.get_response(request)


@pytest.mark.parametrize(
    "url", ["/mw/hidden-drf/", pytest.param("/mw/hidden-ninja/decorated", marks=needs_ninja)]
)
def test_a_framework_hidden_behind_a_wrapper_is_refused_not_mis_scoped(
    url: str, api_clients: tuple[Group, Group]
) -> None:
    """The middleware sees a plain Django view and decides the owner from Django's middlewares
    alone (anonymous for an API client): a client with no credentials got the API client's
    stored response. DRF and Ninja set ``request.auth`` when they authenticate: a keyed request
    that gains one below the middleware is refused, and nothing is stored."""
    headers = {"X-Api-Client": "payments", "X-Key": "key-of-ann"}
    with override_settings(ROOT_URLCONF=HIDDEN_URLCONF):
        with pytest.raises(ImproperlyConfigured, match=r"functools\.wraps"):
            send(Client(), url, **headers)
        nobody = send(Client(raise_request_exception=False), url)
        keyless = send(Client(), url, None, **headers)  # no key: nothing claimed, it runs
    assert nobody.status_code in (401, 403, 500) and not replayed(nobody)
    assert keyless.status_code in (200, 201)
    assert not IdempotencyRecord.objects.exists()


def test_an_authentication_middleware_below_it_is_refused(
    api_clients: tuple[Group, Group],
) -> None:
    middleware = list(settings.MIDDLEWARE)
    middleware.insert(
        middleware.index(IDEMPOTENCY_MIDDLEWARE) + 1, f"{__name__}.LateTokenMiddleware"
    )
    with override_settings(MIDDLEWARE=middleware):
        with pytest.raises(ImproperlyConfigured, match="below IdempotencyMiddleware"):
            send(Client(), "/mw/host/", **{"X-Api-Client": "payments"})
        anonymous = send(Client(), "/mw/host/")  # nothing set request.auth: as before
    assert anonymous.status_code == 201 and not replayed(anonymous)
    assert IdempotencyRecord.objects.get().owner == "anonymous"


class LateUserMiddleware:
    """A remote-user style middleware that sets ``request.user`` from ``X-User``, placed below
    IdempotencyMiddleware: the owner was decided before it ran (anonymous), so ann's response
    was stored under ``anonymous`` and replayed to a client with no credentials."""

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> Any:
        name = request.headers.get("X-User")
        if name:
            request.user = User.objects.get(username=name)
        return self.get_response(request)


def late_user_middleware() -> list[str]:
    middleware = list(settings.MIDDLEWARE)
    middleware.insert(
        middleware.index(IDEMPOTENCY_MIDDLEWARE) + 1, f"{__name__}.LateUserMiddleware"
    )
    return middleware


def test_a_middleware_below_it_that_sets_request_user_is_refused() -> None:
    User.objects.create(username="ann")
    with override_settings(MIDDLEWARE=late_user_middleware()):
        with pytest.raises(ImproperlyConfigured, match=r"replaced request\.user"):
            send(Client(), "/mw/host/", **{"X-User": "ann"})
        nobody = send(Client(), "/mw/host/")  # the same key, no credentials: runs, no replay
        keyless = send(Client(), "/mw/host/", None, **{"X-User": "ann"})  # nothing claimed
    assert nobody.status_code == 201 and not replayed(nobody)
    assert keyless.status_code == 201
    assert [r.owner for r in IdempotencyRecord.objects.all()] == ["anonymous"]


def test_a_view_that_logs_a_user_in_is_not_refused() -> None:
    """``login()`` in the view replaces ``request.user`` after process_view: a sign-up view."""
    first = send(Client(), "/mw/sign-up/")
    again = send(Client(), "/mw/sign-up/")
    assert first.status_code == again.status_code == 201
    assert replayed(again) and again.content == first.content
    assert User.objects.filter(username__startswith="new-").count() == 1


def refused_async(url: str, match: str, key: str = KEY, **overrides: Any) -> None:
    """ann's keyed POST to ``url`` from an async client, under ``overrides`` of the settings,
    fails with ``ImproperlyConfigured`` matching ``match``."""

    async def scenario() -> None:
        with override_settings(**overrides), pytest.raises(ImproperlyConfigured, match=match):
            await AsyncClient().post(
                url, json.dumps(BODY), content_type="application/json",
                headers={"Idempotency-Key": key, "X-User": "ann"},
            )  # fmt: skip

    async_to_sync(scenario)()


def test_an_async_stack_refuses_a_middleware_below_it_that_sets_request_user() -> None:
    User.objects.create(username="ann")
    refused_async("/mw/host/", r"replaced request\.user", MIDDLEWARE=late_user_middleware())
    assert not IdempotencyRecord.objects.exists()


# -- 3. @idempotent around a whole DRF view ----------------------------------------------------


@api_view(["POST"])
@authentication_classes([ApiClientAuthentication])
@permission_classes([IsAuthenticated])
def drf_function(request: Request) -> Response:
    return Response(answer(request), status=201)


@pytest.mark.parametrize(
    "view",
    [
        pytest.param(lambda: ApiClientView.as_view(), id="as_view"),
        pytest.param(lambda: csrf_exempt(ApiClientView.as_view()), id="as_view-wrapped"),
        pytest.param(lambda: drf_function, id="api_view"),
    ],
)
def test_idempotent_around_a_whole_drf_view_is_refused(view: Callable[[], Any]) -> None:
    with pytest.raises(ImproperlyConfigured, match="IdempotentMixin") as refused:
        idempotent(view())
    assert "@api_view" in str(refused.value)
    with pytest.raises(ImproperlyConfigured, match="IdempotentMixin"):
        idempotent(required=True)(view())


def test_idempotent_on_a_drf_views_dispatch_is_refused(api_clients: tuple[Group, Group]) -> None:
    """``method_decorator(idempotent, name="dispatch")``: dispatch gets Django's request,
    before DRF authenticates it."""

    @method_decorator(idempotent, name="dispatch")
    class Dispatched(ApiClientView):
        pass

    view = Dispatched.as_view()
    post = RequestFactory().post(
        "/x/", "{}", content_type="application/json", headers={"Idempotency-Key": KEY}
    )
    with pytest.raises(ImproperlyConfigured, match="IdempotentMixin"):
        view(post)
    assert not IdempotencyRecord.objects.exists()


def test_idempotent_under_api_view_and_on_a_drf_method_are_still_accepted() -> None:
    @api_view(["POST"])
    @idempotent
    def inner(request: Request) -> Response:
        return Response({})

    class Method(APIView):
        @idempotent
        def post(self, request: Request) -> Response:
            return Response({})

    assert callable(inner) and callable(Method.as_view())


# -- 4. CSRF before a replay -------------------------------------------------------------------


def csrf_client(user: User) -> tuple[Client, str]:
    """A logged-in browser that enforces CSRF, and the token its pages would carry."""
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    token = "csrf0" * 6 + "ok"  # a 32-character secret, sent unmasked in the header
    client.cookies["csrftoken"] = token
    return client, token


@pytest.mark.parametrize("url", ["/mw/django/", "/mw/session-drf/"])
def test_under_the_middleware_csrf_refuses_before_a_replay(url: str) -> None:
    ann = User.objects.create_user("ann", password=PASSWORD)
    client, token = csrf_client(ann)
    first = send(client, url, **{"X-CSRFToken": token})
    assert first.status_code == 201, first.content
    assert replayed(send(client, url, **{"X-CSRFToken": token}))  # stored, and replayed
    forged = send(client, url)  # the session cookie, no CSRF token: a cross-site request
    assert forged.status_code == 403
    assert not replayed(forged) and b"nonce" not in forged.content


def test_under_the_middleware_a_cross_origin_request_gets_no_replay() -> None:
    """A valid token sent from another origin (``Origin`` not trusted): CSRF refuses it before
    a replay; once that origin is trusted (read per request), it is replayed."""
    ann = User.objects.create_user("ann", password=PASSWORD)
    client, token = csrf_client(ann)
    assert send(client, "/mw/django/", **{"X-CSRFToken": token}).status_code == 201
    evil = {"X-CSRFToken": token, "Origin": "http://evil.example"}
    refused = send(client, "/mw/django/", **evil)
    assert refused.status_code == 403 and not replayed(refused)
    with override_settings(CSRF_TRUSTED_ORIGINS=["http://evil.example"]):
        assert replayed(send(client, "/mw/django/", **evil))


def test_a_csrf_exempt_view_is_replayed_as_before() -> None:
    ann = User.objects.create_user("ann", password=PASSWORD)
    client, _ = csrf_client(ann)
    with override_settings(ROOT_URLCONF=HOST_URLCONF):
        assert send(client, "/mw/exempt/").status_code == 201
        assert replayed(send(client, "/mw/exempt/"))


# -- 5. a Ninja auth that answers True ---------------------------------------------------------


@needs_ninja
@pytest.mark.parametrize(
    "how",
    [
        pytest.param(lambda value: ({}, {"X-Flag": value}), id="header"),
        pytest.param(lambda value: ({"flag": value}, {}), id="query"),
        pytest.param(lambda value: ({"cookie": value}, {}), id="cookie"),
    ],
)
def test_an_auth_answering_true_scopes_by_the_credential(
    how: Callable[[str], tuple[dict[str, str], dict[str, str]]],
) -> None:
    answers = []
    owners = []
    for value in ("key-of-ann", "key-of-bob"):
        client = Client()
        query, headers = how(value)
        url = "/own/ninja/flag"
        if "flag" in query:
            url += f"?flag={query['flag']}"
        if "cookie" in query:
            client.cookies["flag"] = query["cookie"]
        answers.append(send(client, url, **headers))
        owners.append(IdempotencyRecord.objects.order_by("-pk").values_list("owner")[0][0])
    assert [a.status_code for a in answers] == [200, 200], [a.content for a in answers]
    assert not replayed(answers[1]) and nonce(answers[1]) != nonce(answers[0])
    assert owners[0] != owners[1] and "anonymous" not in owners
    assert not any("key-of" in owner for owner in owners)  # an HMAC, never the key


@needs_ninja
@pytest.mark.django_db(transaction=True)
def test_an_async_operation_answering_true_scopes_by_the_credential() -> None:
    ann = send(Client(), "/own/ninja/async-flag", **{"X-Flag": "key-of-ann"})
    bob = send(Client(), "/own/ninja/async-flag", **{"X-Flag": "key-of-bob"})
    again = send(Client(), "/own/ninja/async-flag", **{"X-Flag": "key-of-ann"})
    assert ann.status_code == bob.status_code == 200
    assert not replayed(bob) and nonce(bob) != nonce(ann)
    assert replayed(again) and again.content == ann.content
    assert IdempotencyRecord.objects.values("owner").distinct().count() == 2


@needs_ninja
def test_the_same_credential_is_the_same_owner_and_replays() -> None:
    first = send(Client(), "/own/ninja/flag", **{"X-Flag": "key-of-ann"})
    again = send(Client(), "/own/ninja/flag", **{"X-Flag": "key-of-ann"})
    assert replayed(again) and again.content == first.content


@needs_ninja
def test_an_auth_answering_true_that_the_library_cannot_read_is_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"request\.auth"):
        send(Client(), "/own/ninja/opaque", **{"X-Opaque": "key-of-ann"})
    assert not IdempotencyRecord.objects.exists()


# -- 6. Django's @idempotent on a Ninja operation ----------------------------------------------


@needs_ninja
def test_djangos_decorator_below_a_ninja_operation_is_refused() -> None:
    api = NinjaAPI(urls_namespace=f"review-{uuid.uuid4().hex}")
    with pytest.raises(ImproperlyConfigured, match=r"django_idempotency\.http\.ninja"):

        @api.post("/x", auth=HeaderKey())
        @idempotent
        def op(request: HttpRequest) -> HttpResponse:
            return JsonResponse(answer(request))


@needs_ninja
def test_djangos_decorator_above_a_ninja_operation_is_refused() -> None:
    api = NinjaAPI(urls_namespace=f"review-{uuid.uuid4().hex}")
    with pytest.raises(ImproperlyConfigured, match=r"django_idempotency\.http\.ninja"):

        @idempotent
        @api.post("/x", auth=HeaderKey())
        def op(request: HttpRequest) -> HttpResponse:
            return JsonResponse(answer(request))


@needs_ninja
def test_djangos_decorator_as_a_ninja_view_decorator_is_refused() -> None:
    from ninja.decorators import decorate_view

    api = NinjaAPI(urls_namespace=f"review-{uuid.uuid4().hex}")
    with pytest.raises(ImproperlyConfigured, match=r"django_idempotency\.http\.ninja"):

        @api.post("/x", auth=HeaderKey())
        @decorate_view(idempotent)
        def op(request: HttpRequest) -> HttpResponse:
            return JsonResponse(answer(request))
