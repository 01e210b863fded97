"""Outside security review: under ATOMIC_REQUESTS the DRF mixin opens the request's
transaction itself; a handler's DRF exception (answered 400 by DRF, not raised to Django) must
still roll back what it wrote, with a key and without one, as Django's transaction did."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.db import connections
from django.test import Client

from tests.probes import effects, post

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.review_sec_urls"),
]


@pytest.fixture
def atomic_requests() -> Iterator[None]:
    settings = connections["default"].settings_dict
    saved = settings["ATOMIC_REQUESTS"]
    settings["ATOMIC_REQUESTS"] = True
    try:
        yield
    finally:
        settings["ATOMIC_REQUESTS"] = saved


@pytest.mark.usefixtures("atomic_requests")
@pytest.mark.parametrize("keyed", [False, True])
def test_a_drf_exception_after_a_write_rolls_it_back(keyed: bool) -> None:
    key = f"invalid-{uuid.uuid4()}" if keyed else None
    response = post(Client(), "/invalid/", key, {"a": 1})
    assert response.status_code == 400, response.content
    assert effects("writes-then-invalid") == 0
