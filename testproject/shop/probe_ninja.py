"""django-ninja operations for the tests (tests/test_http_ninja.py): one router, mounted on an
API with a Bearer token whose principal is a string, Django's session/basic user, and API keys
in the query string, with ``@idempotent`` above and below the router's decorator."""

from __future__ import annotations

import asyncio
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.auth import authenticate
from django.http import HttpRequest
from ninja import NinjaAPI, Router, Schema, Status
from ninja.renderers import JSONRenderer
from ninja.security import APIKeyQuery, HttpBasicAuth, HttpBearer

from django_idempotency.http.ninja import idempotent
from testproject.shop.models import Effect
from testproject.shop.probe_views import record_effect

#: The bearer tokens Ninja accepts; deleting one revokes it.
TOKENS = {"token-ann", "token-bob"}


class Bearer(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> str | None:
        return token if token in TOKENS else None


class QueryKey(APIKeyQuery):
    param_name = "api_key"

    def authenticate(self, request: HttpRequest, key: str | None) -> str | None:
        return key if key in TOKENS else None


class Basic(HttpBasicAuth):
    def authenticate(self, request: HttpRequest, username: str, password: str) -> Any:
        return authenticate(request, username=username, password=password)


class OrderIn(Schema):
    item: str
    quantity: int = 1


class OrderOut(Schema):
    effect: int
    item: str
    quantity: int
    owner: str


router = Router()


def order_out(request: HttpRequest, effect: Effect, payload: OrderIn) -> OrderOut:
    auth = request.auth  # type: ignore[attr-defined]
    owner = str(getattr(auth, "pk", auth))
    return OrderOut(effect=effect.pk, item=payload.item, quantity=payload.quantity, owner=owner)


@router.post("/orders", response={201: OrderOut})
@idempotent  # below the router's decorator
def create_order(request: HttpRequest, payload: OrderIn) -> Any:
    return Status(201, order_out(request, record_effect(request, "ninja-order"), payload))


@idempotent(required=True)  # above the router's decorator
@router.post("/required", response={201: OrderOut})
def required_order(request: HttpRequest, payload: OrderIn) -> Any:
    return Status(201, order_out(request, record_effect(request, "ninja-required"), payload))


@router.post("/async/orders", response={201: OrderOut})
@idempotent
async def create_order_async(request: HttpRequest, payload: OrderIn) -> Any:
    effect = await sync_to_async(record_effect)(request, "ninja-async")
    await asyncio.sleep(0)
    return Status(201, order_out(request, effect, payload))


@idempotent(required=True)
@router.post("/async/required", response={201: OrderOut})
async def required_async(request: HttpRequest, payload: OrderIn) -> Any:
    effect = await sync_to_async(record_effect)(request, "ninja-async-required")
    return Status(201, order_out(request, effect, payload))


@router.post("/lease", response={201: OrderOut})
@idempotent(atomic=False, lease=30)
def lease_order(request: HttpRequest, payload: OrderIn) -> Any:
    return Status(201, order_out(request, record_effect(request, "ninja-lease"), payload))


class IndentedRenderer(JSONRenderer):
    json_dumps_params = {"indent": 2}


api = NinjaAPI(urls_namespace="probe-ninja", auth=[Bearer(), QueryKey(), Basic()])
api.add_router("/", router)
#: The same router mounted on a second API with its own renderer: Ninja clones the operations.
api_v2 = NinjaAPI(
    urls_namespace="probe-ninja-v2", auth=[Bearer()], renderer=IndentedRenderer(), version="2"
)
api_v2.add_router("/", router)
