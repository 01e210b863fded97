"""The owner of any principal and any Authorization value: one owner per principal, kept byte
for byte by the database, and the credentials' letter case always counts (issue 34)."""

from __future__ import annotations

import unicodedata
from typing import Any

import pytest
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.test import RequestFactory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_idempotency import idempotent
from django_idempotency.http.owner import MAX_OWNER_LENGTH, default_owner, principal_owner
from django_idempotency.models import IdempotencyRecord

pytestmark = pytest.mark.django_db

ANY_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec=None),
        st.sampled_from(
            [" ", "\t", "\x00", "\ud800", "\udfff", "e", "\u0301", "\u00e9", "a", "A"]
        ),
    ),
    max_size=300,
)
CHECKS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Principal:
    """A principal that is no model, whose pk comes from outside (a token's claim)."""

    is_authenticated = True

    def __init__(self, pk: object) -> None:
        self.pk = pk


@idempotent(required=True)
def view(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"pk": repr(request.user.pk)}, status=201)  # type: ignore[union-attr]


def call(pk: object) -> Any:
    request = RequestFactory().post(
        "/", b"{}", content_type="application/json", headers={"Idempotency-Key": "k"}
    )
    request.user = Principal(pk)  # type: ignore[assignment]
    return view(request)


def variants(value: str) -> set[str]:
    forms = {value + " ", value.upper(), value.lower(), value.swapcase()}
    forms |= {unicodedata.normalize(form, value) for form in ("NFC", "NFD")}
    return {v for v in forms if v != value}


@CHECKS
@given(pk=ANY_TEXT)
def test_every_principal_gets_its_own_owner_stored_as_it_was_made(pk: str) -> None:
    owner = principal_owner(Principal(pk))
    assert owner is not None and 0 < len(owner) <= MAX_OWNER_LENGTH and owner.isprintable()
    with transaction.atomic():
        first = call(pk)
        assert first.status_code == 201
        assert IdempotencyRecord.objects.filter(owner=owner).count() == 1  # the same bytes back
        assert call(pk)["Idempotent-Replayed"] == "true"
        for other in sorted(variants(pk)):
            again = call(other)
            assert again.status_code == 201 and "Idempotent-Replayed" not in again, repr(other)
        transaction.set_rollback(True)


SCHEMES = st.sampled_from(["Bearer", "Basic", "Token", "Digest"])
SEPARATORS = st.text(alphabet=" \t", min_size=1, max_size=4)
CREDENTIALS = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0xFF), min_size=1, max_size=80
)


@CHECKS
@given(scheme=SCHEMES, separator=SEPARATORS, credentials=CREDENTIALS, data=st.data())
def test_only_the_scheme_is_compared_without_case(
    scheme: str, separator: str, credentials: str, data: st.DataObject
) -> None:
    factory = RequestFactory()

    def owner(value: str) -> str:
        return default_owner(factory.post("/", HTTP_AUTHORIZATION=value))

    cased = "".join(data.draw(st.sampled_from([c.lower(), c.upper()])) for c in scheme)
    canonical = owner(f"{scheme} {credentials}")
    assert owner(f"{cased}{separator}{credentials}") == canonical
    for other in {credentials.swapcase(), credentials.upper(), credentials.lower()} - {
        credentials
    }:
        assert owner(f"{cased}{separator}{other}") != canonical
