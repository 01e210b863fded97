"""Values from outside are escaped in the logs (``exceptions.log_text``), as Django's request
logging escapes them since CVE-2025-48432: a path with ``%0A`` or a key with an ESC sequence
must not forge a log line or rewrite a terminal."""

from __future__ import annotations

import io
import logging
import uuid
from collections.abc import Iterator

import pytest
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client, override_settings
from django.urls import re_path
from django.views.decorators.csrf import csrf_exempt

from django_idempotency import idempotent
from django_idempotency.exceptions import log_text
from django_idempotency.flows.phases import Flow
from testproject.shop.models import Effect


@csrf_exempt
@idempotent
def order(request: HttpRequest, name: str) -> HttpResponse:
    Effect.objects.create(name="logged", payload=name[:200])
    return JsonResponse({"ok": True}, status=201)


@csrf_exempt
@idempotent(phases=True, lease=30)
def phased_order(request: HttpRequest, flow: Flow, name: str) -> HttpResponse:
    flow.phase("made", lambda: Effect.objects.create(name="logged", payload=name[:200]).pk)
    return JsonResponse({"ok": True}, status=201)


urlpatterns = [
    re_path(r"^orders/(?P<name>[\s\S]+)$", order),
    re_path(r"^phased/(?P<name>[\s\S]+)$", phased_order),
]


# --- log_text itself ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "logged"),
    [
        ("/a\nforged line", "/a\\x0aforged line"),
        ("/a\r\nb", "/a\\x0d\\x0ab"),
        ("\x1b[2J\x1b[31mred", "\\x1b[2J\\x1b[31mred"),
        ("nul\x00byte", "nul\\x00byte"),
        ("del\x7f", "del\\x7f"),
        ("next\x85line", "next\\x85line"),
        ("lone\ud800surrogate", "lone\\ud800surrogate"),
        ("line\u2028separator\u2029", "line\\u2028separator\\u2029"),
        ("tab\there", "tab\\x09here"),
        ("caf\u00e9 \U0001f600 \u4e2d", "caf\u00e9 \U0001f600 \u4e2d"),  # printable text stays
        (b"raw\nbytes", "b'raw\\nbytes'"),
        (42, "42"),
    ],
)
def test_log_text_escapes_control_characters(value: object, logged: str) -> None:
    assert log_text(value) == logged
    assert log_text(value).isprintable()
    log_text(value).encode("utf-8")  # any handler can write it


def test_log_text_cuts_long_values() -> None:
    assert log_text("x" * 10_000) == "x" * 500
    assert log_text("abcdef", limit=3) == "abc"
    assert log_text("\n" * 600).count("\\x0a") == 500  # cut first: escaping adds no lines


# --- end to end ---------------------------------------------------------------------------------


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """What the django_idempotency logger writes, one record a line, as a file handler would."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    target = logging.getLogger("django_idempotency")
    target.addHandler(handler)
    level = target.level
    target.setLevel(logging.INFO)
    yield stream
    target.setLevel(level)
    target.removeHandler(handler)


FORGED = "%0AINFO idempotency stored key=forged owner=admin%0D%1B[2J"


@pytest.mark.django_db(transaction=True)
@override_settings(ROOT_URLCONF=__name__)
@pytest.mark.parametrize("prefix", ["orders", "phased"])
def test_a_path_with_a_newline_logs_one_line(
    client: Client, log_lines: io.StringIO, prefix: str
) -> None:
    key = f"k{uuid.uuid4().hex}"
    response = client.post(
        f"/{prefix}/x{FORGED}",
        data=b"{}",
        content_type="application/json",
        headers={"Idempotency-Key": key},
    )
    assert response.status_code == 201
    lines = log_lines.getvalue().splitlines()
    assert len(lines) == 1, lines
    [line] = lines
    assert line.startswith("INFO idempotency stored key=")
    assert f"path=/{prefix}/x\\x0aINFO idempotency stored key=forged owner=admin\\x0d\\x1b[2J" in (
        line
    )
    assert "\x1b" not in line and "\r" not in line
