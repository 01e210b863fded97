"""Request bodies of every shape: forms and multipart from their parsed fields, JSON that cannot
be canonicalised, and any bytes under any content type. The library never answers 500."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client, override_settings
from django.test.client import encode_multipart
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_idempotency.http.fingerprint import canonical_form, fingerprint
from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Effect
from tests.probes import body, effects, post, problem
from tests.test_middleware import with_middleware

pytestmark = pytest.mark.django_db

TOKEN = "a" * 32  # an unmasked CSRF secret, accepted as both cookie and form field
FORM = "application/x-www-form-urlencoded"


def csrf_client(user: User | None = None) -> Client:
    """A client that enforces CSRF like a browser meets it, so CSRF reads ``request.POST``."""
    client = Client(enforce_csrf_checks=True)
    client.cookies["csrftoken"] = TOKEN
    if user is not None:
        client.force_login(user)
    return client


def multipart(
    client: Client, url: str, key: str, data: Mapping[str, object], boundary: str
) -> Any:
    files = {
        name: SimpleUploadedFile(value.name or "", value.read())
        if isinstance(value, SimpleUploadedFile)
        else value
        for name, value in data.items()
    }
    raw = encode_multipart(boundary, {"csrfmiddlewaretoken": TOKEN, **files})
    return client.post(
        url,
        data=raw,
        content_type=f"multipart/form-data; boundary={boundary}",
        headers={"Idempotency-Key": key},
    )


def upload(content: bytes = b"hello", name: str = "a.txt") -> SimpleUploadedFile:
    return SimpleUploadedFile(name, content)


# -- forms and multipart -----------------------------------------------------------------------


def test_a_multipart_post_to_a_csrf_protected_view_runs_and_replays() -> None:
    """CSRF read request.POST first, so request.body was gone: this answered 500."""
    client = csrf_client()
    data = {"amount": "10", "receipt": upload()}
    first = multipart(client, "/probe/form/", "k", data, "boundary-one")
    assert first.status_code == 201, first.content
    assert body(first)["files"] == {"receipt": "hello"}  # the view still reads the file
    # A browser retries with a new boundary: the same submission, so a replay.
    data = {"amount": "10", "receipt": upload()}
    retry = multipart(client, "/probe/form/", "k", data, "boundary-two")
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects() == 1


@pytest.mark.parametrize(
    "changed",
    [
        {"amount": "11", "receipt": upload()},
        {"amount": "10", "receipt": upload(b"hellO")},
        {"amount": "10", "receipt": upload(name="b.txt")},
        {"amount": "10"},
    ],
)
def test_a_changed_field_or_file_is_a_different_request(changed: dict[str, object]) -> None:
    client = csrf_client()
    multipart(client, "/probe/form/", "k", {"amount": "10", "receipt": upload()}, "one")
    problem(multipart(client, "/probe/form/", "k", changed, "two"), 422)
    assert effects() == 1


def test_a_urlencoded_form_ignores_field_order_and_the_csrf_token() -> None:
    client = csrf_client()
    first = client.post(
        "/probe/form/",
        data=f"a=1&b=2&csrfmiddlewaretoken={TOKEN}",
        content_type=FORM,
        headers={"Idempotency-Key": "k"},
    )
    assert first.status_code == 201
    masked = "b" * 64  # a masked token for the same secret would do too; it is not hashed
    again = client.post(
        "/probe/form/",
        data=f"csrfmiddlewaretoken={TOKEN}&b=2&a=1",
        content_type=FORM,
        headers={"Idempotency-Key": "k"},
    )
    assert again["Idempotent-Replayed"] == "true"
    assert canonical_form({"a": ["1"], "csrfmiddlewaretoken": [masked]}) == canonical_form(
        {"a": ["1"]}
    )
    changed = client.post(
        "/probe/form/",
        data=f"a=1&b=3&csrfmiddlewaretoken={TOKEN}",
        content_type=FORM,
        headers={"Idempotency-Key": "k"},
    )
    problem(changed, 422)
    assert effects() == 1


def test_values_of_one_name_keep_their_order() -> None:
    assert canonical_form({"a": ["1", "2"]}) != canonical_form({"a": ["2", "1"]})
    assert canonical_form({"a": ["1"], "b": ["2"]}) == canonical_form({"b": ["2"], "a": ["1"]})


def test_a_form_is_never_the_same_request_as_a_raw_body() -> None:
    form = canonical_form({"a": ["1"]})
    assert fingerprint("POST", "/x", form) != fingerprint("POST", "/x", form[5:])


def test_a_drf_session_authenticated_multipart_post_runs_and_replays() -> None:
    """DRF's SessionAuthentication checks CSRF, which reads request.POST before the view."""
    client = csrf_client(User.objects.create_user("ann"))
    first = multipart(client, "/probe/drf/apiview/", "k", {"note": "hi"}, "one")
    assert first.status_code == 201, first.content
    assert body(first)["echo"]["note"] == "hi"
    retry = multipart(client, "/probe/drf/apiview/", "k", {"note": "hi"}, "two")
    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


@pytest.mark.parametrize("method", ["post", "patch"])
def test_a_body_drf_parsed_before_the_view_is_fingerprinted_from_what_it_parsed(
    client: Client, method: str
) -> None:
    """A permission class read request.data: DRF's parser consumed the stream, and reading
    request.body raised RawPostDataException (500)."""
    url = "/probe/drf/data-permission/"
    first = post(client, url, "k", {"b": 1, "a": [1, 2]}, method=method)
    assert first.status_code == 201, first.content  # type: ignore[attr-defined]
    again = post(client, url, "k", raw=b'{"a": [1, 2], "b": 1}', method=method)
    assert again["Idempotent-Replayed"] == "true"
    problem(post(client, url, "k", {"b": 2, "a": [1, 2]}, method=method), 422)

    def send_form(boundary: str, note: str) -> Any:
        raw = encode_multipart(boundary, {"note": note, "receipt": upload()})
        content_type = f"multipart/form-data; boundary={boundary}"
        return post(client, url, "m", raw=raw, method=method, content_type=content_type)

    assert send_form("x", "hi").status_code == 201
    assert send_form("y", "hi")["Idempotent-Replayed"] == "true"
    problem(send_form("z", "bye"), 422)
    assert effects() == 2


# -- JSON that parses but cannot be canonicalised ----------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"name": "\\ud800"}',
        b'"\\udfff"',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    ],
    ids=["lone-surrogate-in-object", "lone-surrogate", "deep-array", "deep-object"],
)
def test_json_that_cannot_be_canonicalised_gets_the_views_answer(
    client: Client, raw: bytes
) -> None:
    """A lone surrogate raised UnicodeEncodeError and deep nesting RecursionError: 500."""
    first = post(client, "/probe/effect/", "k", raw=raw)
    assert first.status_code == 201
    assert post(client, "/probe/effect/", "k", raw=raw)["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_the_fingerprint_of_unparseable_json_is_its_raw_bytes() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    assert fingerprint("POST", "/x", deep, "application/json") == fingerprint("POST", "/x", deep)
    surrogate = b'{"a":"\\ud800", "b": 1}'
    same = b'{"b":1,"a":"\\ud800"}'
    assert fingerprint("POST", "/x", surrogate, "application/json") == fingerprint(
        "POST", "/x", same, "application/json"
    )


CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "application/merge-patch+json",
        "application/json; charset=latin-1",
        FORM,
        "multipart/form-data; boundary=x",
        "multipart/form-data",
        "text/plain",
        "application/octet-stream",
        "",
    ]
)
BODIES = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=100).map(lambda text: text.encode("utf-8", "surrogatepass")),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(st.text(max_size=5), children, max_size=3)
        ),
        max_leaves=10,
    ).map(lambda value: json.dumps(value).encode()),
)


#: The decorator on a view function, on a DRF action, and the middleware on a plain view.
FUZZED_URLS = st.sampled_from(["/probe/effect/", "/probe/drf/viewset/", "/probe/mw/effect/"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=BODIES,
    content_type=CONTENT_TYPES,
    method=st.sampled_from(["POST", "PATCH"]),
    url=FUZZED_URLS,
)
def test_any_body_under_any_content_type_never_answers_500(
    raw: bytes, content_type: str, method: str, url: str
) -> None:
    client = Client(raise_request_exception=False)
    answers = []
    middleware = with_middleware() if url.startswith("/probe/mw/") else django_settings.MIDDLEWARE
    for _ in range(2):
        with override_settings(MIDDLEWARE=middleware, IDEMPOTENCY={"PATHS": [r"^/probe/mw/"]}):
            response = client.generic(
                method,
                url,
                data=raw,
                content_type=content_type,
                headers={"Idempotency-Key": "fuzz"},
            )
        assert response.status_code < 500, response.content
        answers.append(response)
    if answers[0].status_code == 201:
        assert answers[1]["Idempotent-Replayed"] == "true"
    assert effects() <= 1
    IdempotencyRecord.objects.all().delete()  # hypothesis reuses the test's database
    Effect.objects.all().delete()


def test_a_file_is_rewound_after_hashing() -> None:
    stream = SimpleUploadedFile("a.txt", b"abc")
    stream.read(1)
    canonical_form({}, {"f": [stream]})
    assert stream.read() == b"abc"
