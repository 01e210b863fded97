"""Drive the admin in headless Chromium and take the screenshots the docs show.

Uses Debian's ``chromium`` package through Playwright (``executable_path``); no browser is ever
downloaded (``playwright install`` is not used). When ``/usr/bin/chromium`` is missing the test
runs scripts/install-chromium.sh (root and apt-get needed); if that is impossible it is skipped
loudly, or fails when ``REQUIRE_SERVICES=1``.

It runs in the SQLite pass only. The screenshots (admin-records.png, admin-record-detail.png,
admin-events.png) land in a temporary folder, so a test run leaves the work tree clean; with
``UPDATE_SCREENSHOTS=1`` they replace the ones in docs/img/ that docs/admin.md shows.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from django_idempotency.models import EventDelivery, IdempotencyRecord, ProcessedEvent
from tests.conftest import REQUIRE_SERVICES, UNREACHABLE

pytestmark = [
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.sqlite,  # once per run is enough: tests/test_admin.py covers every database
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(180),
]

ROOT = Path(__file__).resolve().parent.parent
DOCS_IMAGES = ROOT / "docs" / "img"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "admin-browser-test"


def ensure_chromium() -> None:
    """Install Debian's chromium if it is missing; skip (or fail under CI) if that fails."""
    if not os.access(CHROMIUM, os.X_OK):
        result = subprocess.run(
            [str(ROOT / "scripts" / "install-chromium.sh")],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if result.returncode != 0 or not os.access(CHROMIUM, os.X_OK):
            message = f"{UNREACHABLE}: chromium ({CHROMIUM} missing): {result.stderr.strip()}"
            if REQUIRE_SERVICES:
                pytest.fail(f"{message} (REQUIRE_SERVICES=1)")
            pytest.skip(message)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"playwright is not installed: pip install -e '.[dev]' ({exc})")


def seed() -> dict[str, Any]:
    """A small, realistic data set: what a day of the demo's orders API leaves behind."""
    now = timezone.now()
    records = []
    for number in range(12):
        status = [201, 201, 201, 422, 201, None][number % 6]
        order_id = 1040 + number
        body: bytes | None
        if status == 201:
            body = json.dumps(
                {
                    "order": order_id,
                    "reference": f"ORD-2024-{order_id}",
                    "amount_cents": 1250 + number * 100,
                    "payment": {"provider": "stripe", "id": f"pi_3Qx{number:04d}"},
                    "status": "confirmed",
                }
            ).encode()
        elif status == 422:
            body = json.dumps({"amount_cents": ["must be positive"]}).encode()
        else:
            body = None
        records.append(
            IdempotencyRecord(
                owner=f"user:{1 + number % 3}",
                key=str(uuid.UUID(int=0x8E03978E40D543E8BC936894A57F9300 + number * 7919)),
                fingerprint=hashlib.sha256(f"POST /api/orders/ {number}".encode()).hexdigest(),
                method="POST",
                path="/api/orders/" if number % 4 else "/api/payments/",
                state=IdempotencyRecord.State.COMPLETED
                if status
                else IdempotencyRecord.State.IN_PROGRESS,
                response_status=status,
                response_headers={"Content-Type": "application/json"}
                | ({"Location": f"/api/orders/{order_id}/"} if status == 201 else {}),
                response_body=body,
                created_at=now - timedelta(minutes=7 * number),
                completed_at=now - timedelta(minutes=7 * number) if status else None,
                expires_at=now - timedelta(minutes=7 * number) + timedelta(hours=24)
                if number < 10
                else now - timedelta(minutes=5),
            )
        )
    IdempotencyRecord.objects.bulk_create(records)
    events = []
    for number in range(10):
        events.append(
            ProcessedEvent(
                consumer=["billing.apply_order_confirmed", "mail.send_receipt"][number % 2],
                event_id=f"0190f3a2-7c1e-7{number:03d}-9b2e-5d4c3b2a1f0{number}",
                topic="orders.confirmed",
                processed_at=now - timedelta(minutes=6 * number),
                expires_at=now - timedelta(minutes=6 * number) + timedelta(days=7),
            )
        )
    ProcessedEvent.objects.bulk_create(events)
    EventDelivery.objects.create(
        consumer="billing.apply_order_confirmed",
        event_id="0190f3a2-7c1e-7999-9b2e-5d4c3b2a1f99",
        topic="orders.confirmed",
        deliveries=6,
        parked_at=now,
        last_error="WorkerLostError: Worker exited prematurely: signal 9 (SIGKILL).",
        expires_at=now + timedelta(days=7),
    )
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_superuser("admin", "admin@example.com", PASSWORD)
    detail = IdempotencyRecord.objects.filter(response_status=201, path="/api/orders/").latest(
        "created_at"
    )
    return {
        "detail_pk": detail.pk,
        "detail_key": detail.key,
        "records": len(records),
        "events": len(events),
    }


@pytest.fixture
def seeded() -> dict[str, Any]:
    return seed()


@pytest.fixture
def browser_page(seeded: dict[str, Any]) -> Iterator[Any]:
    """A Chromium page; it starts after seeding because the ORM refuses to run beside its loop."""
    ensure_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
        )
        try:
            context = browser.new_context(viewport={"width": 1720, "height": 900})
            # Start with the admin's navigation sidebar collapsed: more room for the columns.
            context.add_init_script(
                "localStorage.setItem('django.admin.navSidebarIsOpen', 'false');"
            )
            page = context.new_page()
            page.set_default_timeout(15_000)
            yield page
        finally:
            browser.close()


def test_admin_in_a_real_browser(
    live_server: Any, seeded: dict[str, Any], browser_page: Any, tmp_path: Path
) -> None:
    data, page = seeded, browser_page
    base = live_server.url
    IMAGES = DOCS_IMAGES if os.environ.get("UPDATE_SCREENSHOTS") == "1" else tmp_path
    IMAGES.mkdir(parents=True, exist_ok=True)

    page.goto(f"{base}/admin/login/?next=/admin/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"{base}/admin/")
    assert page.locator("text=Idempotency records").count() >= 1

    # The record list: twelve rows, filters, the purge button, the expired flags.
    page.goto(f"{base}/admin/django_idempotency/idempotencyrecord/")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == data["records"]
    filters = page.locator("#changelist-filter").inner_text()
    for title in ("state", "status class", "expired", "path"):
        assert f"By {title}" in filters
    assert page.locator("button.idempotency-purge-button").is_visible()
    assert page.locator("#result_list img[alt='True']").count() == 2  # two expired records
    page.screenshot(path=str(IMAGES / "admin-records.png"))

    # A filter click in the browser narrows the list.
    page.locator("#changelist-filter a", has_text="4xx").click()
    page.wait_for_url("**status_class=4xx**")
    assert page.locator("#result_list tbody tr").count() == 2

    # Search for one exact key.
    page.goto(f"{base}/admin/django_idempotency/idempotencyrecord/")
    page.fill("#searchbar", data["detail_key"])
    page.press("#searchbar", "Enter")
    page.wait_for_url("**q=**")
    assert page.locator("#result_list tbody tr").count() == 1

    # The detail page shows the stored response pretty-printed.
    page.goto(f"{base}/admin/django_idempotency/idempotencyrecord/{data['detail_pk']}/change/")
    body = page.locator(".field-stored_body pre").inner_text()
    assert '"payment": {\n    "provider": "stripe"' in body
    assert "Location: /api/orders/" in page.locator(".field-stored_headers").inner_text()
    assert page.locator("input[name=_save]").count() == 0
    page.screenshot(path=str(IMAGES / "admin-record-detail.png"), full_page=True)

    # The processed events list, filtered by consumer in the browser.
    page.goto(f"{base}/admin/django_idempotency/processedevent/")
    assert page.locator("#result_list tbody tr").count() == data["events"]
    page.screenshot(path=str(IMAGES / "admin-events.png"))
    page.locator("#changelist-filter a", has_text="mail.send_receipt").click()
    page.wait_for_url("**consumer=mail.send_receipt**")
    assert page.locator("#result_list tbody tr").count() == data["events"] // 2

    # Parked poison messages.
    page.goto(f"{base}/admin/django_idempotency/eventdelivery/?parked=yes")
    assert page.locator("#result_list tbody tr").count() == 1
    assert "WorkerLostError" in page.locator("#result_list").inner_text()

    # The purge button deletes the two expired records.
    page.goto(f"{base}/admin/django_idempotency/idempotencyrecord/")
    page.click("button.idempotency-purge-button")
    page.wait_for_selector(".messagelist")
    assert "Purged 2 expired idempotency records." in page.locator(".messagelist").inner_text()
    assert page.locator("#result_list tbody tr").count() == data["records"] - 2

    for name in ("admin-records.png", "admin-record-detail.png", "admin-events.png"):
        assert (IMAGES / name).stat().st_size > 10_000, name
