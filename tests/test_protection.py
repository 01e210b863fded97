"""Encryption at rest of stored responses and phased requests (issue 37), on every backend.

With ``ENCRYPTION_KEYS`` set, a raw read of every column finds none of a request's distinctive
response text, headers or phased body; replays are byte-identical; a record whose key was
removed is answered with a problem and never runs again. Without keys, nothing changes: the
same statements store the same bytes.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from django_idempotency.models import FlowRun, IdempotencyRecord
from django_idempotency.protection.core import SEALED, open_response
from django_idempotency.protection.keys import key_id, keyring
from testproject.shop.probe_flows import ProbeError
from tests.probes import effects, post, problem
from tests.protection_helpers import keys, leaked, new_key, raw_tables

pytestmark = pytest.mark.django_db

URL = "/probe/secret/"
K1, K2 = new_key(), new_key()


def secret() -> str:
    return f"s3cr3t{uuid.uuid4().hex}"


def replayable(response: Any) -> dict[str, str]:
    return {
        name: response[name]
        for name in ("Content-Type", "Location", "Content-Disposition")
        if name in response
    }


def send(client: Client, key: str, text: str, **data: Any) -> Any:
    return post(client, URL, key, {"secret": text, **data})


def test_with_keys_no_stored_column_holds_the_response_text_or_headers(client: Client) -> None:
    text = secret()
    with keys(K1):
        first = send(client, "k", text)
        assert first.status_code == 201
        assert text.encode() in first.content and text in first["Location"]
        assert leaked(text) == []
        again = send(client, "k", text)
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert replayable(again) == replayable(first)
    assert effects("secret") == 1
    record = IdempotencyRecord.objects.get(key="k")
    assert record.response_headers == {SEALED: key_id(keyring_bytes(K1))}
    assert record.response_status == 201  # what locates or describes a row stays readable
    assert record.path == URL


def statement(sql: str) -> str:
    """A statement without its values and savepoint names: what it does, not with what."""
    sql = re.sub(r"E?'(?:[^'\\]|\\.|'')*'", "?", sql)
    sql = re.sub(r"[`\"]s\d+_x\d+[`\"]|\b\d+\b", "?", sql)
    return " ".join(sql.split())[:160]


def keyring_bytes(key: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(key)


def test_without_keys_the_same_statements_store_the_same_bytes(client: Client) -> None:
    """No key: the response is stored as it always was, byte for byte, with as many queries as
    with keys (encryption adds none)."""
    text = secret()
    with CaptureQueriesContext(connection) as plain_first:
        first = send(client, "plain", text)
    with CaptureQueriesContext(connection) as plain_replay:
        send(client, "plain", text)
    record = IdempotencyRecord.objects.get(key="plain")
    assert bytes(record.response_body) == first.content
    assert record.response_headers == replayable(first)
    assert text.encode() in raw_tables()
    with keys(K1):
        with CaptureQueriesContext(connection) as sealed_first:
            send(client, "sealed", text)
        with CaptureQueriesContext(connection) as sealed_replay:
            send(client, "sealed", text)
    assert len(sealed_first) == len(plain_first)
    assert len(sealed_replay) == len(plain_replay)
    for plain, sealed in zip(plain_first, sealed_first, strict=True):
        assert statement(plain["sql"]) == statement(sealed["sql"])


def test_a_record_stored_before_keys_were_set_still_replays(client: Client) -> None:
    text = secret()
    first = send(client, "k", text)
    with keys(K1):
        again = send(client, "k", text)
    assert again.content == first.content and again["Idempotent-Replayed"] == "true"


def test_a_record_sealed_with_an_older_listed_key_replays(client: Client) -> None:
    text = secret()
    with keys(K1):
        first = send(client, "k", text)
    with keys(K2, K1):
        again = send(client, "k", text)
        assert send(client, "new", text).status_code == 201
    assert again.content == first.content and replayable(again) == replayable(first)
    assert IdempotencyRecord.objects.get(key="new").response_headers[SEALED] == key_id(
        keyring_bytes(K2)
    )


@pytest.mark.parametrize("listed", [(), (K2,)], ids=["no-keys", "other-key"])
def test_a_removed_key_answers_a_problem_and_never_runs_again(
    client: Client, caplog: pytest.LogCaptureFixture, listed: tuple[str, ...]
) -> None:
    text = secret()
    with keys(K1):
        send(client, "k", text)
    record = IdempotencyRecord.objects.get(key="k")
    caplog.set_level(logging.INFO, logger="django_idempotency")
    with keys(*listed):
        for _ in range(2):
            details = problem(send(client, "k", text), 422)
            assert details["type"].endswith("#response-undecryptable")
            assert details["original_status"] == 201
            assert text not in json.dumps(details)
    assert effects("secret") == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2  # one line per answer
    line = errors[0].getMessage()
    assert "undecryptable" in line and f"record={record.pk}" in line
    assert f"key_id={key_id(keyring_bytes(K1))}" in line
    assert K1 not in caplog.text


def test_a_sealed_record_moved_to_another_key_does_not_open(client: Client) -> None:
    """The sealed response is bound to its owner and key: copied onto another record (someone
    with write access to the database), it answers a problem instead of the other response."""
    with keys(K1):
        send(client, "a", secret())
        b_text = secret()
        send(client, "b", b_text)
        a = IdempotencyRecord.objects.get(key="a")
        IdempotencyRecord.objects.filter(key="b").update(
            response_body=a.response_body, response_headers=a.response_headers
        )
        # The same body as b's first request: only the seal's binding can refuse it.
        details = problem(send(client, "b", b_text), 422)
    assert details["type"].endswith("#response-undecryptable")


def test_a_mismatching_request_is_still_refused_when_sealed(client: Client) -> None:
    with keys(K1):
        send(client, "k", secret())
        details = problem(send(client, "k", "another body"), 422)
    assert details["type"].endswith("#key-reused")


def test_an_unstored_response_is_still_not_replayable_when_sealed(client: Client) -> None:
    with keys(K1):
        assert post(client, "/probe/stream/", "k").status_code == 201
        assert IdempotencyRecord.objects.get(key="k").response_headers == {
            SEALED: key_id(keyring_bytes(K1))
        }
        details = problem(post(client, "/probe/stream/", "k"), 422)
    assert details["type"].endswith("#response-not-stored")


def test_the_sealed_format_opens_to_the_response(client: Client) -> None:
    text = secret()
    with keys(K1):
        first = send(client, "k", text)
        record = IdempotencyRecord.objects.get(key="k")
        headers, body = open_response(
            record.owner,
            record.key,
            record.response_headers,
            bytes(record.response_body),
            status=record.response_status,
        )
        assert keyring() is not None
    assert body == first.content
    assert headers == replayable(first)


# --- Phased requests ---------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_a_phased_request_body_and_results_are_not_stored_in_plaintext(client: Client) -> None:
    from testproject.shop.probe_flows import REMOTE_CALLS

    text = secret()
    with keys(K1):
        with pytest.raises(ProbeError):
            post(client, "/probe/flow/", "f", {"card": text}, headers={"X-Flow-Raise": "two"})
        run = FlowRun.objects.get()
        assert set(run.request) == {SEALED, "@data"}
        assert set(run.results) == {SEALED, "@data"}
        assert leaked(text) == []
        assert b"ch_" not in raw_tables()  # the foreign call's result is sealed too
        done = post(client, "/probe/flow/", "f", {"card": text})
        assert done.status_code == 201
        assert json.loads(done.content)["resumed"] is True
    assert sum(REMOTE_CALLS.values()) == 1
    assert effects("flow-one") == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_a_paused_run_whose_key_was_removed_is_never_run_again(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    from django_idempotency.flows.completer import complete_abandoned
    from testproject.shop.probe_flows import REMOTE_CALLS

    text = secret()
    with keys(K1), pytest.raises(ProbeError):
        post(client, "/probe/flow/", "f", {"card": text}, headers={"X-Flow-Raise": "two"})
    run = FlowRun.objects.get()
    with keys(K2):
        details = problem(post(client, "/probe/flow/", "f", {"card": text}), 422)
        assert details["type"].endswith("#response-undecryptable")
        [completion] = complete_abandoned()
        assert completion.outcome == "unavailable"
        assert "cannot be decrypted" in completion.detail
    assert f"flow run id={run.pk}" in caplog.text
    assert sum(REMOTE_CALLS.values()) == 1 and effects("flow-one") == 1
    assert FlowRun.objects.filter(pk=run.pk).exists()
    with keys(K1):  # the key is back: the run resumes where it stopped
        done = post(client, "/probe/flow/", "f", {"card": text})
    assert done.status_code == 201
    assert sum(REMOTE_CALLS.values()) == 1 and effects("flow-one") == 1
    assert effects("flow-three") == 1
