"""The admin's JSON preview is bounded (issue 34, finding 6).

Pretty-printing a whole stored body before cutting it to the preview cost a 1 MB body of
deeply nested arrays 30 s and 2.7 GB for one page view. The preview now writes only what it
shows, and elides what lies deeper than PREVIEW_DEPTH.
"""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_idempotency.admin import PREVIEW_CHARS, PREVIEW_DEPTH, preview_body
from django_idempotency.models import IdempotencyRecord
from django_idempotency.pretty import pretty_json

MB = 1_000_000
PEAK_LIMIT = 50 * MB


def nested_body(size: int = MB, depth: int = 400) -> bytes:
    """``size`` bytes of arrays nested ``depth`` deep, side by side: the issue's body (each
    line of its indented text is about 800 characters: the 800-fold growth)."""
    unit = "[" * depth + "1" + "]" * depth
    return ("[" + ",".join([unit] * (size // (len(unit) + 1))) + "]").encode()


def record_with(body: bytes) -> IdempotencyRecord:
    now = timezone.now()
    return IdempotencyRecord.objects.create(
        owner="user:1",
        key="nested",
        fingerprint="f" * 64,
        method="POST",
        path="/api/orders/",
        state=IdempotencyRecord.State.COMPLETED,
        response_status=200,
        response_headers={"Content-Type": "application/json"},
        response_body=body,
        completed_at=now,
        expires_at=now + timezone.timedelta(hours=1),
    )


def page_peak(admin_client: Client, url: str) -> tuple[int, bytes]:
    """The page's content, and the peak of memory Python allocated while rendering it."""
    tracemalloc.start()
    try:
        response = admin_client.get(url)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert response.status_code == 200
    return peak, response.content


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body",
    [
        nested_body(),
        # One element, deep and wide: all of it past the depth, skipped (within the skips'
        # budget) and not built.
        b"[" * 30 + b"[" + b",".join([b"[[1],{}]"] * 120_000) + b"]" + b"]" * 30,
    ],
    ids=["deep-arrays", "deep-and-wide"],
)
def test_the_record_page_of_a_1mb_deeply_nested_body_stays_small(
    admin_client: Client, body: bytes
) -> None:
    assert len(body) >= 0.95 * MB
    record = record_with(body)
    url = reverse("admin:django_idempotency_idempotencyrecord_change", args=[record.pk])

    peak, content = page_peak(admin_client, url)

    assert peak < PEAK_LIMIT, f"peak {peak / MB:.1f} MB"
    page = content.decode()
    assert f"JSON, {len(body)} bytes, pretty-printed." in page
    assert "[…" in page
    assert "Truncated: showing the first" in page
    assert len(content) < 3 * PREVIEW_CHARS + 50_000  # the preview, escaped, and the page


def test_the_preview_of_a_deep_body_is_json_elided_at_the_depth() -> None:
    """It was shown as text: json.dumps could not write it (the recursion limit)."""
    preview = preview_body(b"[" * 40_000 + b"]" * 40_000, "application/json")
    assert preview.kind == "json"
    assert not preview.truncated
    lines = preview.text.splitlines()
    assert len(lines) == 2 * PREVIEW_DEPTH + 1
    assert lines[PREVIEW_DEPTH].strip() == "[…]"


def test_the_preview_stops_writing_after_the_limit() -> None:
    body = json.dumps([{"n": n, "tags": ["a", "b"]} for n in range(100_000)]).encode()
    preview = preview_body(body, "application/json")
    assert (preview.kind, preview.truncated) == ("json", True)
    assert len(preview.text) == PREVIEW_CHARS
    assert preview.text == json.dumps(json.loads(body), indent=2)[:PREVIEW_CHARS]


@pytest.mark.parametrize(
    "text",
    ["[1,]", '{"a"}', "[1 2]", "{1: 2}", "[", "]", "1 1", "", '["\\ud800"]', "tru", "[01]"],
)
def test_what_is_not_json_is_not_pretty_printed(text: str) -> None:
    assert pretty_json(text, PREVIEW_CHARS) is None


def test_skipping_deep_values_reads_at_most_its_budget() -> None:
    """A body deep and wide all along: the skips stop at their budget, and the preview is cut
    there, so the page view costs what the budget does, whatever the body's size."""
    items = ",".join(["[[1],{}]"] * 120_000)
    body = "[" * 3 + "[" + items + "]," + "[" + items + "]" + "]" * 3
    assert pretty_json(body, 1000, max_depth=3, skip_budget=len(body)) == (
        "[\n  [\n    [\n      [\u2026],\n      [\u2026]\n    ]\n  ]\n]",
        False,
    )
    shown, cut = pretty_json(body, 1000, max_depth=3, skip_budget=10_000) or ("", False)
    assert (shown, cut) == ("[\n  [\n    [\n      [\u2026", True)
    # A string that holds brackets and crosses the end of the budget is not skipped into.
    body = "[[" + '"' + "]" * 50 + '"' + "]]"
    assert pretty_json(body, 1000, max_depth=1, skip_budget=10) == ("[\n  [\u2026", True)
    assert pretty_json(body, 1000, max_depth=1) == ("[\n  [\u2026]\n]", False)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(st.characters(exclude_categories=["Cs"])),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    value=JSON_VALUES,
    indent=st.sampled_from([None, 1, "\t"]),
    compact=st.booleans(),
)
def test_it_writes_what_json_dumps_writes(value: Any, indent: Any, compact: bool) -> None:
    text = json.dumps(value, indent=indent, separators=(",", ":") if compact else None)
    expected = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    assert pretty_json(text, len(expected), max_depth=1000) == (expected, False)
    if len(expected) > 1:
        assert pretty_json(text, len(expected) - 1, max_depth=1000) == (expected[:-1], True)


#: Stored bodies built to make a backtracking regex retry (unterminated strings full of
#: escapes, runs of quotes and backslashes, control characters, elided depths), 1 to 2 MB each
#: (MAX_RESPONSE_BYTES is 1 MiB by default).
PATHOLOGICAL = {
    "unterminated string of escapes": "'\"' + '\\\\a' * N",
    "unterminated key": "'{\"' + '\\\\u00' * N",
    "escaped quotes past the depth": "'[' * 30 + '\"' + '\\\\\"' * N",
    "quotes past the depth": "'[' * 30 + '\"' * N",
    "backslashes past the depth": "'[' * 30 + '\"' + '\\\\' * N",
    "a control character at the end": "'\"' + '\\\\a' * N + '\\x01\"'",
    "elided values side by side": "'[' * 21 + '[\"\\\\\\\\\"],' * (N // 6)",
    "objects nested all along": "'[{\"a\":' * (N // 6 + 1)",
}


@pytest.mark.sqlite  # no database: once per run is enough
@pytest.mark.parametrize("body", list(PATHOLOGICAL.values()), ids=list(PATHOLOGICAL))
def test_a_pathological_body_is_read_in_linear_time(body: str) -> None:
    """Every regex in django_idempotency.pretty matches each character in one way only (no
    backtracking into a string, no rescanning the rest of the text): a body of a megabyte or
    two made to defeat that is read in milliseconds. The bound is a hang detector, not a timing
    assertion: in a process of its own, killed after 60 s (a regex that backtracks on these
    runs for hours)."""
    import subprocess
    import sys

    script = (
        "from django_idempotency.pretty import pretty_json\n"
        "N = 600_000\n"
        f"text = {body}\n"
        "assert len(text) >= N\n"
        "for depth in (3, 20, 1000):\n"
        "    pretty_json(text, 1000, max_depth=depth, skip_budget=len(text))\n"
        "    pretty_json(text, len(text), max_depth=depth)\n"
    )
    finished = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False
    )
    assert finished.returncode == 0, finished.stderr
