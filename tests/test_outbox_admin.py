"""The outbox's admin page: pending, sent and parked messages with their lag; requeue."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_idempotency.models import OutboxEntry

pytestmark = pytest.mark.django_db

OUTBOX = reverse("admin:django_idempotency_outboxentry_changelist")


def entry(name: str, state: str, **fields: object) -> OutboxEntry:
    return OutboxEntry.objects.create(
        event_id=f"ev-{name}", destination=name, payload={}, state=state, **fields
    )


def test_list_shows_each_state_with_its_lag_and_error(admin_client: Client) -> None:
    an_hour_ago = timezone.now() - timedelta(hours=1)
    entry("waiting", "pending", created_at=an_hour_ago)
    entry("done", "sent", created_at=an_hour_ago, sent_at=an_hour_ago + timedelta(seconds=2))
    entry("stuck", "parked", attempts=20, last_error="OSError: broker down\nOSError: again")

    response = admin_client.get(OUTBOX)

    assert response.status_code == 200
    content = response.content.decode()
    for text in ("waiting", "done", "stuck", "2.0 s", "OSError: again"):
        assert text in content
    assert "Add outbox message" not in content
    parked_only = admin_client.get(OUTBOX, {"state": "parked"}).content.decode()
    assert "ev-stuck" in parked_only
    assert "ev-waiting" not in parked_only and "ev-done" not in parked_only


def test_detail_page_renders(admin_client: Client) -> None:
    row = entry("stuck", "parked", last_error="ValueError: bad", headers={"h": "v"})
    url = reverse("admin:django_idempotency_outboxentry_change", args=[row.pk])
    response = admin_client.get(url)
    assert response.status_code == 200
    assert "ValueError: bad" in response.content.decode()


def test_requeue_puts_parked_messages_back_and_leaves_others(admin_client: Client) -> None:
    parked = entry("stuck", "parked", attempts=20, available_at=timezone.now())
    sent = entry("done", "sent")

    response = admin_client.post(
        OUTBOX,
        {"action": "requeue", "_selected_action": [parked.pk, sent.pk]},
        follow=True,
    )

    assert "Requeued 1 parked message." in response.content.decode()
    parked.refresh_from_db()
    assert (parked.state, parked.attempts, parked.available_at) == ("pending", 0, None)
    assert OutboxEntry.objects.get(pk=sent.pk).state == "sent"


def test_requeue_needs_the_change_permission(client: Client) -> None:
    user = User.objects.create_user("viewer", password="x", is_staff=True)
    user.user_permissions.add(
        Permission.objects.get(codename="view_outboxentry"),
        Permission.objects.get(codename="delete_outboxentry"),
    )
    client.force_login(user)
    parked = entry("stuck", "parked")

    client.post(OUTBOX, {"action": "requeue", "_selected_action": [parked.pk]})

    assert OutboxEntry.objects.get(pk=parked.pk).state == "parked"
