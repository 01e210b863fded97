"""Review s3: request.user replaced below IdempotencyMiddleware, where its process_view cannot
see it (a middleware's own process_view, which Django runs after the middleware's)."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import logout
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, JsonResponse
from django.test import Client, override_settings
from django.urls import path
from django.utils.deprecation import MiddlewareMixin
from django.views.decorators.csrf import csrf_exempt

from django_idempotency.models import IdempotencyRecord
from tests.test_cross_principal_review import (  # noqa: F401 - an autouse fixture
    IDEMPOTENCY_MIDDLEWARE,
    installed,
    refused_async,
    replayed,
    send,
)

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.test_cross_principal_review")]


class ViewTimeUserMiddleware(MiddlewareMixin):
    """Sets ``request.user`` from ``X-User`` in its process_view, below IdempotencyMiddleware."""

    def process_view(self, request: HttpRequest, view: Any, args: Any, kwargs: Any) -> None:
        name = request.headers.get("X-User")
        if name:
            request.user = User.objects.get(username=name)


def middleware() -> list[str]:
    stack = list(settings.MIDDLEWARE)
    if IDEMPOTENCY_MIDDLEWARE not in stack:
        stack.append(IDEMPOTENCY_MIDDLEWARE)
    stack.insert(stack.index(IDEMPOTENCY_MIDDLEWARE) + 1, f"{__name__}.ViewTimeUserMiddleware")
    return stack


def test_a_middleware_below_that_sets_request_user_in_process_view_is_refused() -> None:
    User.objects.create(username="ann")
    with override_settings(MIDDLEWARE=middleware()):
        try:
            ann = send(Client(), "/mw/host/", **{"X-User": "ann"})
        except ImproperlyConfigured:
            ann = None
        nobody = send(Client(), "/mw/host/")  # the same key, no credentials
    assert ann is None, "ann's response was stored under the owner decided before her"
    assert not replayed(nobody)
    assert [r.owner for r in IdempotencyRecord.objects.all()] == ["anonymous"]


def test_an_async_stack_refuses_it_too() -> None:
    User.objects.create(username="ann")
    refused_async(
        "/mw/host/", r"another principal after the view", "k-async", MIDDLEWARE=middleware()
    )
    assert not IdempotencyRecord.objects.exists()


# -- what stays allowed --------------------------------------------------------------------------


@csrf_exempt
def log_out(request: HttpRequest) -> JsonResponse:
    """logout() in the view replaces request.user with AnonymousUser."""
    logout(request)
    return JsonResponse({"bye": True}, status=201)


@csrf_exempt
def plain(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"who": str(request.user)}, status=201)


class ReadsUserMiddleware(MiddlewareMixin):
    def process_view(self, request: HttpRequest, view: Any, args: Any, kwargs: Any) -> None:
        request.seen_by = str(request.user)  # type: ignore[attr-defined]


urlpatterns = [path("mw/log-out/", log_out), path("mw/plain/", plain)]


def below(*paths: str) -> list[str]:
    stack = list(settings.MIDDLEWARE)
    if IDEMPOTENCY_MIDDLEWARE not in stack:
        stack.append(IDEMPOTENCY_MIDDLEWARE)
    index = stack.index(IDEMPOTENCY_MIDDLEWARE) + 1
    return stack[:index] + list(paths) + stack[index:]


def test_a_view_that_logs_out_and_middlewares_below_that_read_the_user_are_not_refused() -> None:
    ann = User.objects.create(username="ann")
    client = Client()
    client.force_login(ann)
    stack = below(
        f"{__name__}.ReadsUserMiddleware",
        "django.contrib.auth.middleware.LoginRequiredMiddleware",
    )
    with override_settings(ROOT_URLCONF=__name__, MIDDLEWARE=stack):
        first = send(client, "/mw/plain/", "k-plain")
        again = send(client, "/mw/plain/", "k-plain")
        out = send(client, "/mw/log-out/", "k-out")
    assert first.status_code == 201 and replayed(again)
    assert out.status_code == 201 and not replayed(out)


class SameUserWrapperMiddleware:
    """django-otp's OTPMiddleware style: replaces ``request.user`` with a lazy wrapper of the
    same user (adding ``is_verified``), below IdempotencyMiddleware: the same principal."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> Any:
        from django.utils.functional import SimpleLazyObject

        user = request.user
        request.user = SimpleLazyObject(lambda: user)
        return self.get_response(request)


def test_a_middleware_below_that_wraps_the_same_user_is_not_refused() -> None:
    ann = User.objects.create(username="ann")
    client = Client()
    client.force_login(ann)
    with override_settings(
        ROOT_URLCONF=__name__, MIDDLEWARE=below(f"{__name__}.SameUserWrapperMiddleware")
    ):
        first = send(client, "/mw/plain/", "k-wrapped")
        again = send(client, "/mw/plain/", "k-wrapped")
    assert first.status_code == 201 and replayed(again)


class LazyViewTimeUserMiddleware(MiddlewareMixin):
    """As ViewTimeUserMiddleware, with a lazy user that reads the database when first used."""

    def process_view(self, request: HttpRequest, view: Any, args: Any, kwargs: Any) -> None:
        from django.utils.functional import SimpleLazyObject

        name = request.headers.get("X-User")
        if name:
            request.user = SimpleLazyObject(lambda: User.objects.get(username=name))


@csrf_exempt
async def async_view(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"async": True}, status=201)


urlpatterns.append(path("mw/async/", async_view))


def test_an_async_stack_reads_a_lazy_user_off_the_event_loop() -> None:
    User.objects.create(username="ann")
    refused_async(
        "/mw/async/",
        r"another principal after the view",
        "k-lazy",
        ROOT_URLCONF=__name__,
        MIDDLEWARE=below(f"{__name__}.LazyViewTimeUserMiddleware"),
    )
    assert not IdempotencyRecord.objects.exists()
