"""The tables behind django-idempotency.

* :class:`IdempotencyRecord` remembers one HTTP command per (owner, key) and its response.
* :class:`FlowRun` remembers how far a multi-step request (``@idempotent(phases=True)``) got:
  its recovery point, its phases' results, and what is needed to finish it without the client.
* :class:`ProcessedEvent` remembers that a consumer applied an event; it is written in the same
  transaction as the business effect.
* :class:`EventDelivery` counts deliveries of an event, committed apart from the business
  transaction, so a message that keeps killing its worker can be parked.
* :class:`OutboxEntry` is a message waiting to leave: written in the producer's transaction, sent
  by the relay after it commits (:mod:`django_idempotency.outbox.core`).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from django.conf import settings
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_idempotency.managers import (
    EventDeliveryQuerySet,
    FlowRunQuerySet,
    IdempotencyRecordQuerySet,
    OutboxEntryQuerySet,
    ProcessedEventQuerySet,
)


class IdempotencyRecord(models.Model):
    class State(models.TextChoices):
        IN_PROGRESS = "in_progress", _("in progress")
        COMPLETED = "completed", _("completed")

    owner = models.CharField(
        _("owner scope"), max_length=255, help_text=_("Whose key this is: a user or a token hash.")
    )
    key = models.CharField(_("idempotency key"), max_length=255)
    fingerprint = models.CharField(
        _("request fingerprint"),
        max_length=64,
        help_text=_("SHA-256 of the method, path, query string and canonical body."),
    )
    method = models.CharField(_("method"), max_length=10)
    path = models.CharField(_("path"), max_length=2000)
    state = models.CharField(
        _("state"), max_length=16, choices=State.choices, default=State.IN_PROGRESS
    )
    token = models.UUIDField(
        _("ownership token"),
        default=uuid.uuid4,
        help_text=_("Changes on every claim; completing or releasing must present it."),
    )
    locked_until = models.DateTimeField(
        _("locked until"), null=True, blank=True, help_text=_("End of a lease-mode claim.")
    )
    response_status = models.PositiveSmallIntegerField(_("response status"), null=True, blank=True)
    response_headers = models.JSONField(_("response headers"), default=dict, blank=True)
    response_body = models.BinaryField(_("response body"), null=True, blank=True)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    completed_at = models.DateTimeField(_("completed"), null=True, blank=True)
    expires_at = models.DateTimeField(_("expires"))

    objects = IdempotencyRecordQuerySet.as_manager()

    class Meta:
        verbose_name = _("idempotency record")
        verbose_name_plural = _("idempotency records")
        permissions = [
            # The admin's erasure action (django_idempotency.protection.admin): an erasure
            # request, apart from deleting (which lets a retry run the view again).
            ("erase_idempotencyrecord", _("Can erase the stored data of an owner's records")),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["key", "owner"], name="idempotency_record_key_owner_uniq"
            ),
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="idem_record_expires_idx"),
            models.Index(fields=["created_at"], name="idem_record_created_idx"),
            # Records in progress and live leases (idempotency_status, the admin's stats):
            # counted from this index, not from a scan of every completed record.
            models.Index(fields=["state", "locked_until"], name="idem_record_state_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.method} {self.path} [{self.key}]"


class FlowRun(models.Model):
    """The recovery point of one multi-step request; see :mod:`django_idempotency.flows.phases`."""

    class State(models.TextChoices):
        RUNNING = "running", _("running")
        COMPLETED = "completed", _("completed")
        FAILED = "failed", _("failed")

    record = models.OneToOneField(
        IdempotencyRecord,
        # A run holds the raw request body (passwords, card numbers): it goes with its record,
        # whether the record is deleted by the purge (which deletes the runs of each batch in
        # the batch's transaction), the admin, Model.delete or QuerySet.delete (this cascade).
        on_delete=models.CASCADE,
        # No constraint in the database: a record claimed in the core's raw SQL and a run are
        # written in separate transactions. Runs of records deleted in raw SQL, or before the
        # cascade existed, are orphans: the purge deletes them in its batches (FlowRunQuerySet),
        # and so does the completer's sweep (delete_orphans).
        db_constraint=False,
        related_name="flow_run",
        verbose_name=_("idempotency record"),
    )
    flow = models.CharField(
        _("flow"), max_length=255, help_text=_("The view's registered name, module:qualname.")
    )
    fingerprint = models.CharField(_("request fingerprint"), max_length=64)
    state = models.CharField(
        _("state"), max_length=16, choices=State.choices, default=State.RUNNING
    )
    recovery_point = models.CharField(
        _("recovery point"),
        max_length=100,
        blank=True,
        default="",
        help_text=_("The last phase that committed."),
    )
    results = models.JSONField(_("phase results"), default=dict, blank=True)
    started = models.CharField(
        _("started phase"),
        max_length=100,
        blank=True,
        default="",
        help_text=_("A phase marked resumable=False that began and has not committed."),
    )
    request = models.JSONField(
        _("request"), default=dict, blank=True, help_text=_("What the completer rebuilds.")
    )
    attempts = models.PositiveIntegerField(
        _("failed attempts"), default=0, help_text=_("Runs that raised after a phase.")
    )
    last_error = models.TextField(_("last error"), blank=True, default="")
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    updated_at = models.DateTimeField(_("updated"), default=timezone.now)

    objects = FlowRunQuerySet.as_manager()

    class Meta:
        verbose_name = _("flow run")
        verbose_name_plural = _("flow runs")
        indexes = [
            models.Index(fields=["state", "updated_at"], name="idem_flow_state_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.flow} at {self.recovery_point} ({self.state})"


class ProcessedEvent(models.Model):
    consumer = models.CharField(_("consumer"), max_length=255)
    event_id = models.CharField(_("event id"), max_length=255)
    topic = models.CharField(_("topic"), max_length=255, blank=True, default="")
    processed_at = models.DateTimeField(_("processed"), default=timezone.now)
    expires_at = models.DateTimeField(_("expires"))

    objects = ProcessedEventQuerySet.as_manager()

    class Meta:
        verbose_name = _("processed event")
        verbose_name_plural = _("processed events")
        constraints = [
            models.UniqueConstraint(
                fields=["event_id", "consumer"], name="idempotency_event_consumer_uniq"
            ),
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="idem_event_expires_idx"),
            models.Index(fields=["processed_at"], name="idem_event_processed_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.consumer}: {self.event_id}"


class EventDelivery(models.Model):
    consumer = models.CharField(_("consumer"), max_length=255)
    event_id = models.CharField(_("event id"), max_length=255)
    topic = models.CharField(_("topic"), max_length=255, blank=True, default="")
    deliveries = models.PositiveIntegerField(_("deliveries"), default=0)
    first_delivered_at = models.DateTimeField(_("first delivered"), default=timezone.now)
    last_delivered_at = models.DateTimeField(_("last delivered"), default=timezone.now)
    parked_at = models.DateTimeField(_("parked"), null=True, blank=True)
    last_error = models.TextField(_("last error"), blank=True, default="")
    expires_at = models.DateTimeField(_("expires"))

    objects = EventDeliveryQuerySet.as_manager()

    class Meta:
        verbose_name = _("event delivery")
        verbose_name_plural = _("event deliveries")
        constraints = [
            models.UniqueConstraint(
                fields=["event_id", "consumer"], name="idempotency_delivery_consumer_uniq"
            ),
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="idem_delivery_expires_idx"),
            models.Index(fields=["parked_at"], name="idem_delivery_parked_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.consumer}: {self.event_id} ({self.deliveries} deliveries)"


OUTBOX_TOUCHED = ~models.Q(state="sent") & (
    models.Q(state="parked")
    | models.Q(available_at__isnull=False)
    | models.Q(locked_until__isnull=False)
)
"""Unsent outbox rows that a relay has touched: leased, backing off, or parked. Only these can
hold back the rest of their key, and in a backlog they are few (a batch or two in flight, the
failures), so the claim's per-candidate look at them, through the partial index
``idem_outbox_touched_idx`` (migration ``0011_outbox_claim_indexes``, on PostgreSQL and SQLite),
stays cheap however many rows are pending. Keep the two in step."""


OUTBOX_UNSCHEDULED = datetime(9999, 1, 1, tzinfo=UTC)
"""The ``available_at`` of a message with a countdown whose commit has not been seen yet: no
relay claims it, and it holds back the later messages of its key, until the producer's
``on_commit`` hook (or, if the producer died first, a relay) sets its due time from the commit
(:mod:`django_idempotency.outbox.schedule`). Read it through :func:`outbox_unscheduled`."""


def outbox_unscheduled() -> datetime:
    """:data:`OUTBOX_UNSCHEDULED`, naive under ``USE_TZ = False`` (as Django's datetimes are)."""
    return OUTBOX_UNSCHEDULED if settings.USE_TZ else OUTBOX_UNSCHEDULED.replace(tzinfo=None)


class OutboxEntry(models.Model):
    """A message written in the producer's transaction and sent by the relay once it commits."""

    class State(models.TextChoices):
        PENDING = "pending", _("pending")
        SENT = "sent", _("sent")
        PARKED = "parked", _("parked")
        #: Written for a change-capture reader (Debezium) that reads the table's log; the relay
        #: never claims it, and it expires ``OUTBOX_TTL`` after it was written.
        EXTERNAL = "external", _("read from the log")

    event_id = models.CharField(_("event id"), max_length=255)
    destination = models.CharField(
        _("destination"), max_length=255, help_text=_("A Celery task name or a topic.")
    )
    transport = models.CharField(
        _("transport"),
        max_length=100,
        default="default",
        help_text=_("A name in IDEMPOTENCY['OUTBOX_TRANSPORTS']."),
    )
    payload = models.JSONField(_("payload"))
    headers = models.JSONField(_("headers"), default=dict, blank=True)
    ordering_key = models.CharField(
        _("ordering key"),
        max_length=255,
        null=True,
        blank=True,
        help_text=_("Messages with one key are sent in order, never overtaking each other."),
    )
    state = models.CharField(
        _("state"), max_length=8, choices=State.choices, default=State.PENDING
    )
    attempts = models.PositiveIntegerField(_("attempts"), default=0)
    available_at = models.DateTimeField(
        _("next attempt"),
        null=True,
        blank=True,
        help_text=_(
            "Not sent before this time (a backoff after a failure, or a delayed message held "
            "until it is due); empty: at once."
        ),
    )
    locked_until = models.DateTimeField(
        _("claimed until"),
        null=True,
        blank=True,
        help_text=_("A relay is sending it; after this time another relay may take it over."),
    )
    due_at = models.DateTimeField(
        _("due"),
        null=True,
        blank=True,
        help_text=_(
            "Not delivered before this time: the call's eta, or its countdown counted from the "
            "commit. Celery gets it as the task's eta; other transports' messages are held "
            "until then. Empty: at once."
        ),
    )
    last_error = models.TextField(_("last error"), blank=True, default="")
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    sent_at = models.DateTimeField(_("sent"), null=True, blank=True)
    expires_at = models.DateTimeField(
        _("expires"),
        null=True,
        blank=True,
        help_text=_(
            "Set when sent (sent + OUTBOX_TTL), or when written for a change-capture reader "
            "(written + OUTBOX_TTL); pending and parked rows never expire."
        ),
    )

    objects = OutboxEntryQuerySet.as_manager()

    class Meta:
        verbose_name = _("outbox message")
        verbose_name_plural = _("outbox messages")
        indexes = [
            # The relay's claim: pending rows in id order.
            models.Index(fields=["state", "id"], name="idem_outbox_state_idx"),
            # The ordering check: the unsent rows of a few keys.
            models.Index(fields=["ordering_key", "state", "id"], name="idem_outbox_key_idx"),
            models.Index(fields=["event_id"], name="idem_outbox_event_idx"),
            models.Index(fields=["expires_at"], name="idem_outbox_expires_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.destination}: {self.event_id} ({self.state})"
