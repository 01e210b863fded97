"""The admin pages: read-only lists and details, filters, search, purge, and a bounded query count.

The scale test at the end seeds PostgreSQL through ``generate_series`` and prints the query count
and time per list page; bench/admin.py runs the same measurement on a million rows.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.contrib.admin.sites import site
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_idempotency import admin as idem_admin
from django_idempotency.admin import (
    BINARY_PREVIEW_BYTES,
    PREVIEW_CHARS,
    EstimatedCountPaginator,
    header_pairs,
    preview_body,
)
from django_idempotency.models import EventDelivery, IdempotencyRecord, ProcessedEvent

pytestmark = pytest.mark.django_db

RECORDS = reverse("admin:django_idempotency_idempotencyrecord_changelist")
EVENTS = reverse("admin:django_idempotency_processedevent_changelist")
DELIVERIES = reverse("admin:django_idempotency_eventdelivery_changelist")
OUTBOX = reverse("admin:django_idempotency_outboxentry_changelist")


def make_record(
    key: str = "k-1",
    *,
    owner: str = "user:1",
    path: str = "/api/orders/",
    status: int | None = 201,
    body: bytes | None = b'{"id": 1, "status": "confirmed"}',
    headers: Any = None,
    expires_in: timedelta = timedelta(hours=1),
    created_at: Any = None,
) -> IdempotencyRecord:
    now = timezone.now()
    return IdempotencyRecord.objects.create(
        owner=owner,
        key=key,
        fingerprint="f" * 64,
        method="POST",
        path=path,
        state=IdempotencyRecord.State.COMPLETED
        if status is not None
        else IdempotencyRecord.State.IN_PROGRESS,
        response_status=status,
        response_headers={"Content-Type": "application/json"} if headers is None else headers,
        response_body=body,
        created_at=created_at or now,
        completed_at=now if status is not None else None,
        expires_at=now + expires_in,
    )


def make_event(
    event_id: str = "evt-1",
    *,
    consumer: str = "billing.apply_order_confirmed",
    topic: str = "orders",
    expires_in: timedelta = timedelta(days=7),
) -> ProcessedEvent:
    return ProcessedEvent.objects.create(
        consumer=consumer,
        event_id=event_id,
        topic=topic,
        expires_at=timezone.now() + expires_in,
    )


def make_delivery(event_id: str, *, parked: bool, error: str = "") -> EventDelivery:
    now = timezone.now()
    return EventDelivery.objects.create(
        consumer="billing.apply_order_confirmed",
        event_id=event_id,
        deliveries=6 if parked else 1,
        parked_at=now if parked else None,
        last_error=error,
        expires_at=now + timedelta(days=7),
    )


def listed(response: Any) -> list[Any]:
    return list(response.context["cl"].result_list)


# --- Rendering a stored body ------------------------------------------------------------------


def test_preview_pretty_prints_json() -> None:
    preview = preview_body(b'{"b":1,"a":[1,2]}', "application/json")
    assert preview.kind == "json"
    assert preview.text == json.dumps({"b": 1, "a": [1, 2]}, indent=2)
    assert preview.size == 17
    assert not preview.truncated


def test_preview_detects_json_without_a_content_type() -> None:
    assert preview_body(b'[{"x": "\xc3\xa9"}]').kind == "json"
    assert "é" in preview_body(b'[{"x": "\xc3\xa9"}]').text


def test_preview_of_broken_json_is_text() -> None:
    preview = preview_body(b"{not json", "application/json")
    assert (preview.kind, preview.text) == ("text", "{not json")


def test_preview_decodes_the_declared_charset() -> None:
    preview = preview_body("café".encode("latin-1"), "text/plain; charset=latin-1")
    assert (preview.kind, preview.text) == ("text", "café")


def test_preview_of_binary_is_a_bounded_hex_dump() -> None:
    body = bytes(range(256)) * 4
    preview = preview_body(body, "application/octet-stream")
    assert preview.kind == "binary"
    assert preview.size == 1024
    assert preview.truncated
    assert preview.text.splitlines()[0].startswith("00000000  00 01 02 03")
    assert len(preview.text.splitlines()) == BINARY_PREVIEW_BYTES // 16


def test_preview_truncates_long_text() -> None:
    preview = preview_body(b"x" * (PREVIEW_CHARS + 10), "text/plain")
    assert preview.truncated
    assert len(preview.text) == PREVIEW_CHARS


def test_preview_falls_back_to_utf8_for_an_unknown_charset() -> None:
    preview = preview_body("é".encode(), "text/plain; charset=no-such-charset")
    assert (preview.kind, preview.text) == ("text", "é")


def test_preview_of_no_body_and_empty_body() -> None:
    assert preview_body(None).kind == "none"
    assert preview_body(b"").kind == "empty"
    assert preview_body(memoryview(b"ok")).text == "ok"


def test_header_pairs_accepts_dicts_and_lists() -> None:
    assert header_pairs({"Location": "/x"}) == [("Location", "/x")]
    assert header_pairs([["Location", "/x"], ("A", "b")]) == [("Location", "/x"), ("A", "b")]
    assert header_pairs("junk") == []


# --- Record list ------------------------------------------------------------------------------


def test_record_changelist_lists_columns(admin_client: Client) -> None:
    make_record("k-1")
    response = admin_client.get(RECORDS)
    assert response.status_code == 200
    content = response.content.decode()
    for text in ("k-1", "user:1", "POST /api/orders/", "201", "completed"):
        assert text in content
    assert response.context["cl"].show_full_result_count is False
    # The expired flag is a boolean icon; this record is live.
    assert 'alt="False"' in content


def test_record_list_has_no_add_button_and_only_indexed_sorting(admin_client: Client) -> None:
    make_record()
    response = admin_client.get(RECORDS)
    content = response.content.decode()
    assert reverse("admin:django_idempotency_idempotencyrecord_add") not in content
    model_admin = site._registry[IdempotencyRecord]
    ordering_fields = {"created_at", "expires_at"}
    assert {
        name for name in model_admin.sortable_by if name in model_admin.list_display
    } <= ordering_fields | {"expired"}
    indexed = {field for index in IdempotencyRecord._meta.indexes for field in index.fields}
    assert ordering_fields <= indexed
    assert model_admin.ordering == ("-created_at",)


def test_record_filters(admin_client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    make_record("ok", status=201)
    make_record("bad", status=422, path="/api/payments/")
    make_record("running", status=None, body=None)
    make_record("old", status=200, expires_in=timedelta(hours=-1))

    def keys(query: str) -> set[str]:
        response = admin_client.get(RECORDS + query)
        assert response.status_code == 200, query
        return {record.key for record in listed(response)}

    assert keys("?state__exact=in_progress") == {"running"}
    assert keys("?status_class=2xx") == {"ok", "old"}
    assert keys("?status_class=4xx") == {"bad"}
    assert keys("?status_class=5xx") == set()
    assert keys("?status_class=none") == {"running"}
    assert keys("?expired=yes") == {"old"}
    assert keys("?expired=no") == {"ok", "bad", "running"}
    assert keys("?path=/api/payments/") == {"bad"}
    # The path filter offers the paths it saw in the newest rows.
    content = admin_client.get(RECORDS).content.decode()
    assert "?path=%2Fapi%2Fpayments%2F" in content
    # A path outside the sampled choices still filters, and is offered while selected.
    make_record("rare", path="/api/rare/")
    monkeypatch.setattr(idem_admin, "RECENT_SAMPLE", 1)
    make_record("newest", path="/api/orders/")
    content = admin_client.get(RECORDS, {"path": "/api/payments/"}).content.decode()
    assert "?path=%2Fapi%2Fpayments%2F" in content
    assert "?path=%2Fapi%2Frare%2F" not in content


def test_record_search_is_exact_on_key_and_owner(admin_client: Client) -> None:
    make_record("abc-123", owner="user:1")
    make_record("abc-1234", owner="user:2")

    def keys(term: str) -> set[str]:
        return {r.key for r in listed(admin_client.get(RECORDS, {"q": term}))}

    assert keys("abc-123") == {"abc-123"}
    assert keys("user:2") == {"abc-1234"}
    assert keys("abc") == set()
    assert keys("  ") == {"abc-123", "abc-1234"}


def test_date_hierarchy_links_the_days_between_oldest_and_newest(admin_client: Client) -> None:
    now = timezone.localtime()
    make_record("today", created_at=now)
    response = admin_client.get(RECORDS)
    content = response.content.decode()
    assert 'class="toplinks"' in content
    assert f"created_at__day={now.day}" in content
    year = now.year
    response = admin_client.get(RECORDS, {"created_at__year": year})
    assert f"created_at__month={now.month}" in response.content.decode()
    assert {r.key for r in listed(response)} == {"today"}
    response = admin_client.get(
        RECORDS,
        {"created_at__year": year, "created_at__month": now.month, "created_at__day": now.day},
    )
    assert {r.key for r in listed(response)} == {"today"}
    response = admin_client.get(RECORDS, {"created_at__year": year - 5})
    assert listed(response) == []


def test_date_hierarchy_spans_years(admin_client: Client) -> None:
    now = timezone.now()
    make_record("old", created_at=now - timedelta(days=800))
    make_record("new", created_at=now)
    content = admin_client.get(RECORDS).content.decode()
    for year in range((now - timedelta(days=800)).year, now.year + 1):
        assert f"created_at__year={year}" in content


def test_record_list_query_count_is_constant(admin_client: Client) -> None:
    make_record("k-0")
    admin_client.get(RECORDS)  # warm caches (content types, session)
    with CaptureQueriesContext(connection) as few:
        assert admin_client.get(RECORDS).status_code == 200
    for number in range(1, 60):
        make_record(f"k-{number}", path=f"/api/orders/{number % 7}/")
    with CaptureQueriesContext(connection) as many:
        response = admin_client.get(RECORDS)
    assert len(listed(response)) == 60
    assert len(many.captured_queries) == len(few.captured_queries)
    assert len(many.captured_queries) <= 8, [q["sql"] for q in many.captured_queries]
    # The list never loads the stored bodies.
    select = next(q["sql"] for q in many.captured_queries if "LIMIT 100" in q["sql"])
    assert "response_body" not in select


def test_event_list_query_count_is_constant(admin_client: Client) -> None:
    make_event("e-0")
    admin_client.get(EVENTS)
    with CaptureQueriesContext(connection) as few:
        admin_client.get(EVENTS)
    for number in range(1, 60):
        make_event(f"e-{number}", consumer=f"consumer-{number % 5}", topic=f"t{number % 3}")
    with CaptureQueriesContext(connection) as many:
        response = admin_client.get(EVENTS)
    assert len(listed(response)) == 60
    assert len(many.captured_queries) == len(few.captured_queries) <= 8


def test_delivery_list_query_count_is_constant(admin_client: Client) -> None:
    make_delivery("d-0", parked=False)
    admin_client.get(DELIVERIES)
    with CaptureQueriesContext(connection) as few:
        admin_client.get(DELIVERIES)
    for number in range(1, 30):
        make_delivery(f"d-{number}", parked=number % 2 == 0)
    with CaptureQueriesContext(connection) as many:
        response = admin_client.get(DELIVERIES)
    assert len(listed(response)) == 30
    assert len(many.captured_queries) == len(few.captured_queries) <= 8


# --- Record detail ----------------------------------------------------------------------------


def detail_url(obj: Any) -> str:
    opts = obj._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])


def test_record_detail_pretty_prints_json(admin_client: Client) -> None:
    record = make_record(body=b'{"id":7,"items":[{"sku":"A"}]}')
    response = admin_client.get(detail_url(record))
    assert response.status_code == 200
    content = response.content.decode()
    assert "JSON, 30 bytes, pretty-printed." in content
    assert "&quot;items&quot;: [\n    {\n      &quot;sku&quot;: &quot;A&quot;" in content
    assert "Content-Type: application/json" in content
    # View-only: no save button, no editable inputs.
    assert 'name="_save"' not in content
    assert 'name="key"' not in content


@pytest.mark.parametrize(
    ("stored", "shown"),
    [
        (b'{"name": "\\ud800"}', "{&quot;name&quot;: &quot;\\ud800&quot;}"),
    ],
    ids=["lone-surrogate"],
)
def test_record_detail_shows_json_it_cannot_pretty_print_as_text(
    admin_client: Client, stored: bytes, shown: str
) -> None:
    """Valid JSON that json.dumps cannot write for a page answered 500."""
    record = make_record(body=stored)
    response = admin_client.get(detail_url(record))
    assert response.status_code == 200
    content = response.content.decode()
    assert f"Text, {len(stored)} bytes." in content
    assert shown in content


def test_record_detail_escapes_stored_html(admin_client: Client) -> None:
    record = make_record(body=b"<script>alert(1)</script>", headers={"Content-Type": "text/html"})
    content = admin_client.get(detail_url(record)).content.decode()
    assert "<script>alert(1)</script>" not in content
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in content


def test_record_detail_shows_binary_as_size_and_hex(admin_client: Client) -> None:
    record = make_record(
        body=b"\x89PNG\r\n\x1a\n" + bytes(2000),
        headers=[["Content-Type", "image/png"]],
    )
    content = admin_client.get(detail_url(record)).content.decode()
    assert "Binary, 2008 bytes; hex dump below." in content
    assert "00000000  89 50 4e 47 0d 0a 1a 0a" in content
    assert f"Truncated: showing the first {BINARY_PREVIEW_BYTES} of 2008 bytes." in content


def test_record_detail_truncates_long_bodies(admin_client: Client) -> None:
    body = json.dumps({"blob": "y" * (PREVIEW_CHARS * 2)}).encode()
    record = make_record(body=body)
    content = admin_client.get(detail_url(record)).content.decode()
    assert (
        f"Truncated: showing the first {PREVIEW_CHARS} characters of a {len(body)}-byte body"
        in (content)
    )


def test_record_detail_without_response(admin_client: Client) -> None:
    record = make_record(status=None, body=None, headers={})
    content = admin_client.get(detail_url(record)).content.decode()
    assert "No body stored." in content
    assert "No headers stored." in content


# --- Read-only, delete, purge -----------------------------------------------------------------


def test_records_cannot_be_added_or_changed(admin_client: Client) -> None:
    record = make_record()
    add = reverse("admin:django_idempotency_idempotencyrecord_add")
    assert admin_client.get(add).status_code == 403
    response = admin_client.post(detail_url(record), {"key": "changed", "owner": "x"})
    assert response.status_code == 403
    record.refresh_from_db()
    assert record.key == "k-1"
    model_admin = site._registry[IdempotencyRecord]
    concrete = {field.name for field in IdempotencyRecord._meta.concrete_fields}
    assert concrete <= set(model_admin.get_readonly_fields(None))  # type: ignore[arg-type]


def test_events_and_deliveries_are_read_only(admin_client: Client) -> None:
    event = make_event()
    delivery = make_delivery("d-1", parked=True, error="Traceback\nBoom: worker lost")
    for obj in (event, delivery):
        opts = obj._meta
        assert (
            admin_client.get(reverse(f"admin:{opts.app_label}_{opts.model_name}_add")).status_code
            == 403
        )
        response = admin_client.get(detail_url(obj))
        assert response.status_code == 200
        assert 'name="_save"' not in response.content.decode()


def test_records_can_be_deleted(admin_client: Client) -> None:
    record = make_record()
    opts = record._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_delete", args=[record.pk])
    assert admin_client.get(url).status_code == 200
    assert admin_client.post(url, {"post": "yes"}).status_code == 302
    assert not IdempotencyRecord.objects.exists()


def test_bulk_delete_confirmation_names_a_bounded_number(admin_client: Client) -> None:
    IdempotencyRecord.objects.bulk_create(
        [
            IdempotencyRecord(
                owner="o",
                key=f"k-{n}",
                fingerprint="f",
                method="POST",
                path="/",
                expires_at=timezone.now() + timedelta(hours=1),
            )
            for n in range(idem_admin.DELETE_LIST_LIMIT + 20)
        ]
    )
    pks = list(IdempotencyRecord.objects.values_list("pk", flat=True))
    response = admin_client.post(RECORDS, {"action": "delete_selected", "_selected_action": pks})
    assert response.status_code == 200
    assert "… and 20 more" in response.content.decode()
    response = admin_client.post(
        RECORDS, {"action": "delete_selected", "_selected_action": pks, "post": "yes"}
    )
    assert response.status_code == 302
    assert not IdempotencyRecord.objects.exists()


def test_purge_action_deletes_expired_records_only(admin_client: Client) -> None:
    live = make_record("live")
    expired = make_record("expired", expires_in=timedelta(seconds=-1))
    response = admin_client.post(
        RECORDS,
        {"action": "purge_expired", "_selected_action": [live.pk]},
        follow=True,
    )
    assert response.status_code == 200
    assert "Purged 1 expired idempotency record." in response.content.decode()
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {"live"}
    assert not IdempotencyRecord.objects.filter(pk=expired.pk).exists()


def test_purge_button_purges_without_a_selection(admin_client: Client) -> None:
    make_record("live")
    make_record("expired-1", expires_in=timedelta(seconds=-1))
    make_record("expired-2", expires_in=timedelta(days=-1))
    content = admin_client.get(RECORDS).content.decode()
    url = reverse("admin:django_idempotency_idempotencyrecord_purge_expired")
    assert f'action="{url}"' in content
    assert admin_client.get(url).status_code == 405
    response = admin_client.post(url, follow=True)
    assert response.redirect_chain[-1][0] == RECORDS
    assert "Purged 2 expired idempotency records." in response.content.decode()
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["live"]


def test_purge_that_runs_out_of_time_says_more_remain(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    for number in range(3):
        make_record(f"expired-{number}", expires_in=timedelta(seconds=-1))
    monkeypatch.setattr(idem_admin, "ADMIN_PURGE_SECONDS", 1e-9)
    url = reverse("admin:django_idempotency_idempotencyrecord_purge_expired")
    # override_settings, not an in-place change: settings are cached until setting_changed.
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "PURGE_BATCH_SIZE": 1}):
        content = admin_client.post(url, follow=True).content.decode()
    assert "Purged 1 expired idempotency record." in content
    assert "More expired idempotency records remain" in content
    assert IdempotencyRecord.objects.count() == 2


def test_purge_needs_delete_permission(client: Client, django_user_model: Any) -> None:
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("viewer", password="x", is_staff=True)
    user.user_permissions.add(
        Permission.objects.get(codename="view_idempotencyrecord"),
    )
    client.force_login(user)
    make_record("expired", expires_in=timedelta(seconds=-1))
    content = client.get(RECORDS).content.decode()
    assert "Purge expired now" not in content
    url = reverse("admin:django_idempotency_idempotencyrecord_purge_expired")
    assert client.post(url).status_code == 403
    assert IdempotencyRecord.objects.count() == 1


# --- Events and deliveries --------------------------------------------------------------------


def test_event_changelist_filters_and_search(admin_client: Client) -> None:
    make_event("e-1", consumer="billing", topic="orders")
    make_event("e-2", consumer="mail", topic="payments")
    make_event("e-3", consumer="mail", topic="orders", expires_in=timedelta(seconds=-1))

    def ids(query: dict[str, str]) -> set[str]:
        response = admin_client.get(EVENTS, query)
        assert response.status_code == 200
        return {event.event_id for event in listed(response)}

    assert ids({}) == {"e-1", "e-2", "e-3"}
    assert ids({"consumer": "mail"}) == {"e-2", "e-3"}
    assert ids({"topic": "orders"}) == {"e-1", "e-3"}
    assert ids({"expired": "yes"}) == {"e-3"}
    assert ids({"q": "e-2"}) == {"e-2"}
    assert ids({"q": "e-"}) == set()
    content = admin_client.get(EVENTS).content.decode()
    for text in ("?consumer=billing", "?topic=payments", "billing", "payments"):
        assert text in content


def test_delivery_changelist_shows_parked_messages(admin_client: Client) -> None:
    make_delivery(
        "poison", parked=True, error="Traceback (most recent call last):\nWorkerLostError: killed"
    )
    make_delivery("fine", parked=False)

    def ids(query: dict[str, str]) -> set[str]:
        return {d.event_id for d in listed(admin_client.get(DELIVERIES, query))}

    assert ids({"parked": "yes"}) == {"poison"}
    assert ids({"parked": "no"}) == {"fine"}
    content = admin_client.get(DELIVERIES, {"parked": "yes"}).content.decode()
    assert "WorkerLostError: killed" in content
    poison = EventDelivery.objects.get(event_id="poison")
    detail = admin_client.get(detail_url(poison)).content.decode()
    assert "Traceback (most recent call last):" in detail


# --- Counting ---------------------------------------------------------------------------------


def test_paginator_counts_exactly_under_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    for number in range(5):
        make_event(f"e-{number}")
    paginator = EstimatedCountPaginator(ProcessedEvent.objects.order_by("-processed_at"), 2)
    assert paginator.count == 5
    assert paginator.num_pages == 3
    assert EstimatedCountPaginator([1, 2, 3], 2).count == 3


def test_paginator_estimates_over_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(idem_admin, "EXACT_COUNT_LIMIT", 3)
    for number in range(8):
        make_event(f"e-{number}")
    with CaptureQueriesContext(connection) as queries:
        count = EstimatedCountPaginator(ProcessedEvent.objects.order_by("pk"), 2).count
    assert not any(q["sql"].startswith('SELECT COUNT(*) FROM "django') for q in queries)
    if connection.vendor == "sqlite":
        assert count == 8  # SQLite counts: it has no cheap planner estimate and counts fast
    else:
        assert count >= 4  # at least the capped count; beyond it, the planner's estimate


# --- Scale ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(180)
def test_list_pages_on_a_large_table(admin_client: Client) -> None:
    """Seeds ADMIN_SCALE_ROWS rows per table (default 50,000: five times the count cap,
    ``STATS_COUNT_LIMIT``, past which the pages give the planner's estimate) and prints figures
    per page.

    The query count per page is asserted (it must not grow with the table); the times are only
    printed. bench/admin.py runs the same on a million rows.
    """
    from bench.admin import PAGES, measure, report, seed

    rows = int(os.environ.get("ADMIN_SCALE_ROWS", "50000"))
    started = time.perf_counter()
    seconds = seed(rows)
    print(f"\nseeded {rows:,} records and {rows:,} events in {seconds:.1f} s")
    # One timed load after the warm-up: the test asserts the query counts; bench/admin.py times.
    figures = [measure(admin_client, name, url, repeat=1) for name, url in PAGES]
    report(figures)
    print(f"measured in {time.perf_counter() - started:.1f} s")
    for fig in figures:
        assert fig.status == 200, fig
        assert fig.queries <= 8, fig


def test_flow_runs_are_listed_read_only_and_cannot_be_deleted(admin_client: Client) -> None:
    """A deleted run would make the next retry start its flow again from the first phase."""
    from django_idempotency.models import FlowRun

    record = make_record("flow-key")
    run = FlowRun.objects.create(
        record=record, flow="shop.rides:create_ride", fingerprint="f" * 64, recovery_point="one"
    )
    listing = admin_client.get(reverse("admin:django_idempotency_flowrun_changelist"))
    assert listing.status_code == 200
    assert "shop.rides:create_ride" in listing.content.decode()
    detail = admin_client.get(reverse("admin:django_idempotency_flowrun_change", args=[run.pk]))
    assert detail.status_code == 200
    assert 'name="flow"' not in detail.content.decode()  # shown, not editable
    delete = reverse("admin:django_idempotency_flowrun_delete", args=[run.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    assert FlowRun.objects.filter(pk=run.pk).exists()


@pytest.mark.postgres
@pytest.mark.parametrize("url", [RECORDS + "?expired=yes", OUTBOX + "?expired=yes"])
def test_expired_pages_read_no_live_row(admin_client: Client, url: str) -> None:
    """Expired rows are the oldest. Listed newest first (by creation or id), the *expired*
    page walked an index past every live row to find its hundred, and so did the date
    hierarchy's ``MAX``: 0.25 s each at a million rows, growing with the table (issue 28,
    bench/growth.py). The page is ordered by expiry then, and the hierarchy spans the table:
    no query of the page throws away more than a page of rows, whatever the table holds."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's plans")
    from bench.admin import RECORDS_SQL

    rows = (
        20_000  # one a second back from now, each expiring after 5 hours: the oldest 2,000 expired
    )
    with connection.cursor() as cursor:
        cursor.execute(RECORDS_SQL, {"rows": rows, "step": 1, "ttl": "5 hours"})
        cursor.execute(
            "INSERT INTO django_idempotency_outboxentry (event_id, destination, transport, "
            "payload, headers, ordering_key, state, attempts, last_error, created_at, sent_at, "
            "expires_at) SELECT 'e' || i, 'd', 'default', '{}', '{}', NULL, 'sent', 1, '', "
            "now() - make_interval(secs => i), now() - make_interval(secs => i), "
            "now() - make_interval(secs => i) + interval '5 hours' "
            f"FROM generate_series({rows}, 1, -1) AS i"
        )
        cursor.execute("ANALYZE django_idempotency_idempotencyrecord")
        cursor.execute("ANALYZE django_idempotency_outboxentry")
    admin_client.get(url)  # warm caches (content types, session)
    with CaptureQueriesContext(connection) as captured:
        response = admin_client.get(url)
    assert response.status_code == 200
    assert len(listed(response)) == 100
    assert all(row.expires_at < timezone.now() for row in listed(response))
    table = "django_idempotency_outboxentry" if "outbox" in url else "django_idempotency_idem"
    selects = [
        q["sql"]
        for q in captured.captured_queries
        if q["sql"].startswith("SELECT") and table in q["sql"]
    ]
    assert selects
    for sql in selects:
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
            [[explained]] = cursor.fetchall()
        if isinstance(explained, str):
            explained = json.loads(explained)
        removed = sum(node.get("Rows Removed by Filter", 0) for node in plan_nodes(explained))
        assert removed <= 1_000, (removed, sql)


def plan_nodes(explained: Any) -> Any:
    stack = [explained[0]["Plan"]]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.get("Plans", []))
