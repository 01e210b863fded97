"""Owner scope: keys live per owner, and no owner ever receives another's response."""

from __future__ import annotations

import base64
import hashlib
import logging

import pytest
from django.contrib.auth.models import AnonymousUser, Group, User
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.test import Client, RequestFactory, override_settings
from django.utils.crypto import salted_hmac
from django.utils.functional import SimpleLazyObject

from django_idempotency.http.owner import (
    AUTHORIZATION_SALT,
    default_owner,
    display_owner,
    normalise_authorization,
    principal_owner,
    resolve_owner,
)
from django_idempotency.models import IdempotencyRecord
from tests.probes import body, effects, post

pytestmark = pytest.mark.django_db

URL = "/probe/effect/"


def tenant_owner(request: HttpRequest) -> str:
    return "tenant:" + request.headers.get("X-Tenant", "none")


def bad_owner(request: HttpRequest) -> object:
    return 42


def owners() -> set[str]:
    return set(IdempotencyRecord.objects.values_list("owner", flat=True))


def test_default_owner_order() -> None:
    factory = RequestFactory()
    request = factory.post("/")
    assert default_owner(request) == "anonymous"
    request = factory.post("/", HTTP_AUTHORIZATION="Bearer s3cret")
    expected = salted_hmac(AUTHORIZATION_SALT, b"bearer s3cret", algorithm="sha256")
    assert default_owner(request) == "auth:" + expected.hexdigest()
    user = User.objects.create_user("ann")
    request.user = user
    assert default_owner(request) == f"user:{user.pk}"


def test_two_users_use_the_same_key_independently() -> None:
    ann, bob = User.objects.create_user("ann"), User.objects.create_user("bob")
    clients = {}
    for user in (ann, bob):
        clients[user.username] = Client()
        clients[user.username].force_login(user)
    first = {name: post(c, URL, "shared", {"a": 1}) for name, c in clients.items()}
    assert body(first["ann"])["user"] == str(ann.pk)
    assert body(first["bob"])["user"] == str(bob.pk)
    assert effects() == 2
    for name, c in clients.items():
        again = post(c, URL, "shared", {"a": 1})
        assert again["Idempotent-Replayed"] == "true"
        assert again.content == first[name].content
    # A different request under the same key is only a mismatch for its own owner.
    assert post(clients["ann"], URL, "shared", {"a": 2}).status_code == 422
    assert owners() == {f"user:{ann.pk}", f"user:{bob.pk}"}


def test_credentials_and_anonymous_are_separate_scopes(client: Client) -> None:
    anonymous = post(client, URL, "shared")
    token_a = post(client, URL, "shared", headers={"Authorization": "Bearer a"})
    token_b = post(client, URL, "shared", headers={"Authorization": "Bearer b"})
    nonces = {body(r)["nonce"] for r in (anonymous, token_a, token_b)}
    assert len(nonces) == 3
    assert effects() == 3
    replay = post(client, URL, "shared", headers={"Authorization": "Bearer a"})
    assert replay.content == token_a.content
    # The credentials themselves are never stored, only their hash.
    assert not IdempotencyRecord.objects.filter(owner__contains="Bearer").exists()
    assert len(owners()) == 3


@override_settings(IDEMPOTENCY={"OWNER": "tests.test_http_owner.tenant_owner"})
def test_owner_setting_replaces_the_default(client: Client) -> None:
    one = post(client, URL, "k", headers={"X-Tenant": "one"})
    two = post(client, URL, "k", headers={"X-Tenant": "two"})
    assert body(one)["nonce"] != body(two)["nonce"]
    assert post(client, URL, "k", headers={"X-Tenant": "one"}).content == one.content
    assert owners() == {"tenant:one", "tenant:two"}


@override_settings(IDEMPOTENCY={"OWNER": "tests.test_http_owner.bad_owner"})
def test_owner_callable_must_return_a_string() -> None:
    with pytest.raises(ImproperlyConfigured, match="must return a non-empty string"):
        resolve_owner(RequestFactory().post("/"))


@override_settings(IDEMPOTENCY={"OWNER": "tests.test_http_owner.missing"})
def test_unimportable_owner_is_improperly_configured() -> None:
    with pytest.raises(ImproperlyConfigured, match="cannot be imported"):
        resolve_owner(RequestFactory().post("/"))


BASIC = base64.b64encode(b"ann:correct horse battery staple").decode()


@pytest.mark.parametrize(
    "variant", [f"basic {BASIC}", f"BASIC {BASIC}", f"Basic  {BASIC} ", f"\tbAsIc {BASIC}"]
)
def test_the_auth_scheme_is_case_insensitive(client: Client, variant: str) -> None:
    """``Basic`` and ``basic`` were two owners, so a retry ran twice."""
    first = post(client, URL, "k", headers={"Authorization": f"Basic {BASIC}"})
    retry = post(client, URL, "k", headers={"Authorization": variant})
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects() == 1


def test_credentials_stay_case_sensitive() -> None:
    factory = RequestFactory()
    lower = factory.post("/", HTTP_AUTHORIZATION="Bearer abc")
    upper = factory.post("/", HTTP_AUTHORIZATION="Bearer ABC")
    assert default_owner(lower) != default_owner(upper)


def test_the_owner_is_keyed_with_secret_key_and_never_shown_or_logged_in_full(
    client: Client, caplog: pytest.LogCaptureFixture, admin_client: Client
) -> None:
    """An unsalted SHA-256 of a Basic header was stored, shown and logged: a word list
    recovered the password from it."""
    header = f"Basic {BASIC}"
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        post(client, URL, "k", headers={"Authorization": header})
    (owner,) = owners()
    unsalted = {hashlib.sha256(value.encode()).hexdigest() for value in (header, header.lower())}
    assert owner.removeprefix("auth:") not in unsalted
    with override_settings(SECRET_KEY="another-secret"):
        assert default_owner(RequestFactory().post("/", HTTP_AUTHORIZATION=header)) != owner
    digest = owner.removeprefix("auth:")
    assert digest not in caplog.text
    assert display_owner(owner) in caplog.text
    record = IdempotencyRecord.objects.get()
    for url in (
        "/admin/django_idempotency/idempotencyrecord/",
        f"/admin/django_idempotency/idempotencyrecord/{record.pk}/change/",
    ):
        page = admin_client.get(url).content.decode()
        assert display_owner(owner) in page
        assert digest not in page


def test_display_owner_cuts_only_auth_owners() -> None:
    assert display_owner("user:7") == "user:7"
    assert display_owner("anonymous") == "anonymous"
    assert display_owner("auth:" + "a" * 64) == "auth:aaaaaaaa…"


# -- issue 34: the principal's kind, and tabs in Authorization ---------------------------------


@pytest.mark.parametrize(
    ("lower", "upper"),
    [
        ("Bearer\tabc", "Bearer\tABC"),
        ("Bearer \t abc", "Bearer\t \tABC"),
        ("Bearer\t\tabc", "Bearer ABC"),
        ("Basic\tYW5uOnB3", "Basic\tyw5uonb3"),
    ],
)
def test_a_tab_never_casefolds_the_credentials(lower: str, upper: str) -> None:
    """``Bearer<TAB>token`` was lowercased whole: two tokens that differ in case, one owner."""
    factory = RequestFactory()
    owner = default_owner(factory.post("/", HTTP_AUTHORIZATION=lower))
    assert owner != default_owner(factory.post("/", HTTP_AUTHORIZATION=upper))
    # The scheme still compares without case, whatever separates it from the credentials.
    scheme, credentials = lower.split(None, 1)
    for variant in (f"{scheme.upper()} {credentials}", f"{scheme.lower()}\t{credentials}"):
        assert default_owner(factory.post("/", HTTP_AUTHORIZATION=variant)) == owner


def test_normalise_authorization_splits_on_any_run_of_spaces_and_tabs() -> None:
    assert normalise_authorization("Bearer\tAbC") == "bearer AbC"
    assert normalise_authorization(" \tBEARER \t\t AbC d \t") == "bearer AbC d"
    assert normalise_authorization("Bearer") == "bearer"
    assert normalise_authorization("Bearer\t") == "bearer"


def test_a_principal_of_another_model_is_another_owner() -> None:
    """A DRF authenticator's principal of another model with pk 1 got user 1's responses."""
    ann = User.objects.create_user("ann")
    client = Group.objects.create(pk=ann.pk, name="api-client")
    client.is_authenticated = True  # type: ignore[attr-defined]
    assert principal_owner(ann) == f"user:{ann.pk}"  # unchanged: live records stay valid
    assert principal_owner(client) == f"principal:auth.group:{ann.pk}"
    request = RequestFactory().post("/")
    request.user = client  # type: ignore[assignment]
    assert default_owner(request) == f"principal:auth.group:{ann.pk}"
    # A lazy request.user (AuthenticationMiddleware's) is the object it wraps.
    request.user = SimpleLazyObject(lambda: ann)  # type: ignore[assignment]
    assert default_owner(request) == f"user:{ann.pk}"


class TokenPrincipal:
    """A principal that is no model (simplejwt's TokenUser, an API client object)."""

    is_authenticated = True

    def __init__(self, pk: object) -> None:
        self.pk = pk


class Nameless:
    is_authenticated = True


def test_principals_that_are_no_model() -> None:
    assert principal_owner(TokenPrincipal(1)) == (f"principal:{__name__}.TokenPrincipal:1")
    # django-ninja's request.auth may be the token itself: a keyed HMAC, never the value.
    token_owner = principal_owner("s3cret-token")
    assert token_owner is not None and token_owner.startswith("auth:")
    assert "s3cret" not in token_owner
    assert principal_owner("S3CRET-TOKEN") != token_owner
    assert principal_owner(b"s3cret-token") == token_owner
    for nobody in (None, True, False, "", AnonymousUser(), Nameless(), 7, Group(name="unsaved")):
        assert principal_owner(nobody) is None
    long = principal_owner(TokenPrincipal("x" * 300))
    assert long is not None and len(long) <= 255 and long.startswith("principal:")


def test_an_authenticated_user_that_names_no_one_is_a_configuration_error() -> None:
    request = RequestFactory().post("/")
    request.user = Nameless()  # type: ignore[assignment]
    with pytest.raises(ImproperlyConfigured, match="names no one"):
        resolve_owner(request)
    # With an Authorization header, the header scopes it.
    request = RequestFactory().post("/", HTTP_AUTHORIZATION="Bearer abc")
    request.user = Nameless()  # type: ignore[assignment]
    assert resolve_owner(request).startswith("auth:")
