"""The test project's consumers.

* ``billing.apply_order_confirmed`` is the demo's billing consumer: it writes one
  :class:`~testproject.shop.models.LedgerEntry` per ``OrderConfirmed`` event.
* :func:`on_payment_captured` is the money double protection recipe of ``docs/consumers.md``: a
  plain consumer with an event id, and a ``UNIQUE(provider, external_payment_id)`` behind it.
* The ``shop.*`` tasks exist for the worker tests (``tests/test_celery_worker.py``): each writes
  one :class:`~testproject.shop.models.Effect` row per execution of its body, named after its
  consumer, with the event id as payload, and some of them fail or kill their own worker process
  on purpose. The killing ones refuse to run eagerly, so they can never kill a test process or a
  web server.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from celery import shared_task
from django.db import OperationalError, transaction

from django_idempotency import IdempotentConsumer, idempotent_consumer
from django_idempotency.models import EventDelivery
from testproject.shop.models import Effect, LedgerEntry, Order, Payment


@shared_task(
    base=IdempotentConsumer,
    bind=True,
    name="billing.apply_order_confirmed",
    consumer="billing.ledger",
)
def apply_order_confirmed(self: IdempotentConsumer, event: dict[str, Any]) -> int:
    """Apply an ``OrderConfirmed`` event to the ledger, once per event id.

    ``event`` is the event payload, a JSON object::

        {"event_id": "<uuid>", "order_id": <Order pk>, "amount_cents": <int>}

    Publish it from the transaction that confirms the order, so that it leaves only if that
    transaction commits::

        from django_idempotency import new_event_id
        from testproject.shop.tasks import apply_order_confirmed

        with transaction.atomic():
            order = Order.objects.create(...)
            apply_order_confirmed.delay_on_commit(
                {"event_id": str(new_event_id()), "order_id": order.pk,
                 "amount_cents": order.amount_cents}
            )

    The consumer name is ``billing.ledger``: a redelivered or republished event with the same
    ``event_id`` is skipped. Returns the new ledger entry's pk (None for a duplicate).
    """
    entry = LedgerEntry.objects.create(
        order_id=int(event["order_id"]),
        event_id=str(event["event_id"]),
        amount_cents=int(event["amount_cents"]),
    )
    return entry.pk


# --- Consumers for the worker tests -------------------------------------------------------------


class TransientError(Exception):
    """Raised once by ``shop.flaky_effect`` and retried by autoretry."""


def _effect(task: IdempotentConsumer) -> None:
    Effect.objects.create(name=task.consumer_name, payload=task.request.event_id)


def _first_time(marker: str) -> bool:
    """True the first time it is called with ``marker`` (a file path), False afterwards."""
    try:
        Path(marker).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def _kill_own_process(task: IdempotentConsumer) -> None:
    if task.request.is_eager or task.request.called_directly:
        raise RuntimeError(f"{task.name} kills its worker process; it never runs eagerly.")
    os.kill(os.getpid(), signal.SIGKILL)


@shared_task(base=IdempotentConsumer, bind=True, name="shop.effect")
def effect(self: IdempotentConsumer, event_id: str | None = None, sleep: float = 0.0) -> str:
    """Write one Effect. ``sleep`` holds the transaction open, so duplicates contend."""
    _effect(self)
    if sleep:
        time.sleep(sleep)
    return "applied"


@shared_task(
    base=IdempotentConsumer, bind=True, name="shop.effect_without_result", ignore_result=True
)
def effect_without_result(self: IdempotentConsumer, event_id: str | None = None) -> str:
    """``shop.effect`` with no result stored (bench/latency.py: a result nobody reads costs the
    worker a write to the result backend per task)."""
    _effect(self)
    return "applied"


@shared_task(base=IdempotentConsumer, bind=True, name="shop.effect_audit", consumer="shop.audit")
def effect_audit(self: IdempotentConsumer, event_id: str | None = None) -> str:
    """A second consumer of the same events, under its own consumer name."""
    _effect(self)
    return "applied"


@shared_task(
    base=IdempotentConsumer,
    bind=True,
    name="shop.flaky_effect",
    autoretry_for=(TransientError,),
    max_retries=3,
    default_retry_delay=0,
)
def flaky_effect(self: IdempotentConsumer, event_id: str, marker: str) -> str:
    """Write an Effect, then fail the first time; autoretry runs it again."""
    _effect(self)
    if _first_time(marker):
        raise TransientError(f"first attempt of {event_id} fails")
    return "applied"


@shared_task(
    base=IdempotentConsumer,
    bind=True,
    name="shop.database_unavailable",
    database_retry_delay=0.2,
    database_retry_delay_max=0.5,
)
def database_unavailable(self: IdempotentConsumer, event_id: str, marker: str) -> str:
    """Write an Effect, then fail with OperationalError on the first two attempts."""
    _effect(self)
    attempts = Path(marker)
    tried = len(attempts.read_text()) if attempts.exists() else 0
    if tried < 2:
        attempts.write_text("x" * (tried + 1))
        raise OperationalError("could not connect to server (simulated)")
    return "applied"


class LingeringRetry(IdempotentConsumer):
    """A consumer base whose ``retry()`` lingers before it hands back the retry exception.

    It stands for a failed delivery that is slow to roll back and count (a loaded database):
    had ``retry()`` published the retry message already, another pool child would run it
    meanwhile (``tests/test_celery_worker.py``)."""

    linger = 1.0

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().retry(*args, **kwargs)
        finally:
            time.sleep(self.linger)


def _record_counted(task: IdempotentConsumer, marker_dir: str) -> None:
    """Leave a file ``<retries>-<deliveries counted so far>`` in ``marker_dir``: what this run
    of the body found on the event's delivery counter."""
    counted = EventDelivery.objects.filter(
        consumer=task.consumer_name, event_id=task.request.event_id
    ).values_list("deliveries", flat=True)
    Path(marker_dir, f"{task.request.retries}-{counted.first() or 0}").touch()


@shared_task(
    base=IdempotentConsumer,
    bind=True,
    name="shop.retry_lingers",
    max_deliveries=3,
    max_retries=10,
    default_retry_delay=0,
)
def retry_lingers(self: IdempotentConsumer, event_id: str, marker_dir: str) -> str:
    """Fail every time: ``self.retry(throw=False)``, linger a second, then raise the retry.
    Each run records what it found on the counter; parked after 3 runs."""
    _record_counted(self, marker_dir)
    _effect(self)
    retry = self.retry(exc=TransientError(f"{event_id} always fails"), throw=False)
    time.sleep(1.0)
    raise retry


@shared_task(
    base=LingeringRetry,
    bind=True,
    name="shop.autoretry_lingers",
    autoretry_for=(TransientError,),
    max_deliveries=3,
    max_retries=10,
    default_retry_delay=0,
)
def autoretry_lingers(self: IdempotentConsumer, event_id: str, marker_dir: str) -> str:
    """Fail every time, retried by autoretry through a ``retry()`` that lingers a second.
    Each run records what it found on the counter; parked after 3 runs."""
    _record_counted(self, marker_dir)
    _effect(self)
    raise TransientError(f"{event_id} always fails")


@shared_task(base=IdempotentConsumer, bind=True, name="shop.replaced")
def replaced(self: IdempotentConsumer, event_id: str) -> None:
    """Write an Effect, then replace itself with ``shop.effect`` of ``<event_id>-next``."""
    _effect(self)
    queue = (self.request.delivery_info or {}).get("routing_key")
    raise self.replace(effect.si(event_id=f"{event_id}-next").set(queue=queue))


@shared_task(base=IdempotentConsumer, bind=True, name="shop.crash_before_commit")
def crash_before_commit(self: IdempotentConsumer, event_id: str, marker: str) -> str:
    """Write an Effect, then SIGKILL the worker child mid-transaction the first time."""
    _effect(self)
    if _first_time(marker):
        _kill_own_process(self)
    return "applied"


@shared_task(base=IdempotentConsumer, bind=True, name="shop.crash_after_commit")
def crash_after_commit(self: IdempotentConsumer, event_id: str, marker: str) -> str:
    """Write an Effect; the first time, SIGKILL the child after the commit and before the ack."""
    _effect(self)
    if _first_time(marker):
        transaction.on_commit(lambda: _kill_own_process(self))
    return "applied"


@shared_task(base=IdempotentConsumer, bind=True, name="shop.poison", max_deliveries=2)
def poison(self: IdempotentConsumer, event_id: str) -> str:
    """Kill the worker child every time: parked after 2 deliveries."""
    _effect(self)
    _kill_own_process(self)
    return "unreachable"


# --- Money double protection (docs/consumers.md) ------------------------------------------------


# --8<-- [start:money]
class PaymentMismatch(Exception):
    """The provider's payment id is already recorded, for another order or amount."""


def record_payment(
    order: Order, provider: str, external_payment_id: str, amount_cents: int
) -> tuple[Payment, bool]:
    """Insert the payment, or return the row already recorded for this provider payment id.

    The second line of defence behind the event id: ``UNIQUE(provider, external_payment_id)``.
    ``get_or_create`` inserts in a savepoint; when a concurrent transaction inserted the same
    pair first, the insert waits for it, fails on the constraint, and the committed row is
    returned instead. Returns ``(payment, created)``.
    """
    payment, created = Payment.objects.get_or_create(
        provider=provider,
        external_payment_id=external_payment_id,
        defaults={"order": order, "amount_cents": amount_cents},
    )
    if not created and (payment.order_id, payment.amount_cents) != (order.pk, amount_cents):
        raise PaymentMismatch(
            f"{provider} payment {external_payment_id} is already recorded for order "
            f"{payment.order_id} ({payment.amount_cents} cents)."
        )
    return payment, created


@idempotent_consumer("payments.captured", event_id=lambda event: event["event_id"])
def on_payment_captured(event: dict[str, Any]) -> int:
    """A plain consumer (a webhook queue, a Kafka loop) of ``PaymentCaptured`` events.

    ``event`` is ``{"event_id", "order_id", "provider", "external_payment_id",
    "amount_cents"}``. Returns the payment's pk; None for a duplicate event.
    """
    order = Order.objects.get(pk=event["order_id"])
    payment, _ = record_payment(
        order, event["provider"], event["external_payment_id"], int(event["amount_cents"])
    )
    return payment.pk


# --8<-- [end:money]


from testproject.shop import checkout_saga  # noqa: E402, F401 - registers the saga's tasks

# --- The outbox proofs (tests/test_outbox_proofs.py) --------------------------------------------


@shared_task(
    base=IdempotentConsumer, bind=True, name="shop.ordered_effect", count_deliveries=False
)
def ordered_effect(self: IdempotentConsumer, key: str, seq: int) -> str:
    """Write one Effect ``key:seq`` per event (the event id travels in the message header).

    One consumer process applies thousands of these in a row, so it skips delivery counting
    (one transaction less per message)."""
    Effect.objects.create(name="shop.ordered_effect", payload=f"{key}:{seq}")
    return "applied"


# --- Callbacks and chains of an idempotent consumer (tests/test_celery_canvas_worker.py) ---------


@shared_task(base=IdempotentConsumer, bind=True, name="shop.effect_result")
def effect_result(self: IdempotentConsumer, event_id: str, unstorable: bool = False) -> Any:
    """Write one Effect and return ``"<event id>:result"``, which its ``link`` callbacks and its
    chain's next task receive; with ``unstorable``, a result the outbox cannot store."""
    _effect(self)
    return object() if unstorable else f"{event_id}:result"


@shared_task(name="shop.follow_up")
def follow_up(previous: Any = None, tag: str = "") -> str:
    """A plain task (not idempotent): one Effect ``shop.follow_up<tag>`` per run, whose payload
    is what it received. Returns ``"<previous>+<tag>"`` for the next task of a chain."""
    Effect.objects.create(name=f"shop.follow_up{tag}", payload=str(previous))
    return f"{previous}+{tag}"


from testproject.shop import call_probe  # noqa: E402, F401 - registers shop.probe_call and Money
