"""``manage.py retry_storm``: many concurrent retries of one order, with and without protection.

    python manage.py retry_storm                 # against the server at http://127.0.0.1:8000
    python manage.py retry_storm --in-process    # no server: django.test.Client in threads
    python manage.py retry_storm --requests 50 --redeliveries 10 --url http://127.0.0.1:8000

It fires ``--requests`` identical ``POST`` requests with **one** ``Idempotency-Key`` at
``/api/orders/``, all released at once from as many threads. The one execution writes the order's
``OrderConfirmed`` event to the transactional outbox; the relay sends it (in this process with
eager Celery; a running ``manage.py idempotency_relay`` with a broker). Then it delivers that
event ``--redeliveries`` more times to the billing consumer. Then it does the
same to ``/api/unsafe-orders/``, the copy without protection. It prints, for each endpoint, the
requests sent, the orders created, the outbox messages written, the replays served, the
conflicts (409) and the ledger entries.

The counts are read from the database in this process's settings: run it with the same
``DATABASE_URL`` as the server (the demo's SQLite file by default). With ``CELERY_BROKER_URL``
set, events go through the broker and a worker (``celery -A testproject worker``) applies them;
the command waits up to ``--wait`` seconds for the ledger to settle.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.test import Client

from django_idempotency.models import OutboxEntry
from django_idempotency.outbox.relay import Relay
from testproject.shop.models import LedgerEntry, Order
from testproject.shop.orders import apply_unprotected, order_key
from testproject.shop.tasks import apply_order_confirmed

PROTECTED = "/api/orders/"
UNPROTECTED = "/api/unsafe-orders/"
REPLAYED_HEADER = "Idempotent-Replayed"


@dataclass
class Outcome:
    status: int = 0
    replayed: bool = False
    error: str = ""
    retries: int = 0
    """Connections refused or reset before an answer, and sent again."""


@dataclass
class StormResult:
    endpoint: str
    requests_sent: int = 0
    executions: int = 0
    """2xx answers that were not replays: the view ran."""
    replays: int = 0
    conflicts: int = 0
    other: dict[str, int] = field(default_factory=dict)
    """Any other status (or "error"), with its count."""
    first_error: str = ""
    network_retries: int = 0
    orders_created: int = 0
    outbox_messages: int = 0
    """Outbox rows written for the order's event (the relay sends them)."""
    relay_waiting: bool = False
    """True when the outbox message was not sent within --wait: no relay is running."""
    redeliveries: int = 0
    ledger_entries: int = 0


Sender = Callable[[str, bytes, str | None], Outcome]


CONNECT_ATTEMPTS = 5


def http_sender(base_url: str) -> Sender:
    """Send over real HTTP with urllib (one connection per request).

    A connection the server refuses or resets before answering (runserver's listen backlog is
    10) is retried, as a real client would, up to CONNECT_ATTEMPTS times.
    """

    def send(path: str, body: bytes, key: str | None) -> Outcome:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = f'"{key}"'  # an RFC 8941 string, as the draft says
        for attempt in range(1, CONNECT_ATTEMPTS + 1):
            request = urllib.request.Request(
                base_url.rstrip("/") + path, data=body, headers=headers, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    replayed = response.headers.get(REPLAYED_HEADER) == "true"
                    return Outcome(response.status, replayed, retries=attempt - 1)
            except urllib.error.HTTPError as exc:
                replayed = exc.headers.get(REPLAYED_HEADER) == "true"
                return Outcome(exc.code, replayed, retries=attempt - 1)
            except (ConnectionError, urllib.error.URLError):
                if attempt == CONNECT_ATTEMPTS:
                    raise
                time.sleep(0.2 * attempt)
        raise AssertionError("unreachable")

    return send


def in_process_sender() -> Sender:
    """Send through django.test.Client: the whole stack, middleware included, without a server."""

    def send(path: str, body: bytes, key: str | None) -> Outcome:
        headers = {} if key is None else {"Idempotency-Key": f'"{key}"'}
        # raise_request_exception=False: Client records view exceptions through a global signal,
        # which threads would see each other's through; a 500 is counted as a 500 instead.
        client = Client(raise_request_exception=False)
        response = client.post(path, body, content_type="application/json", headers=headers)
        return Outcome(response.status_code, response.get(REPLAYED_HEADER) == "true")

    return send


def check_server(base_url: str) -> None:
    """Fail early, with what to do, when nothing answers at ``base_url``."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/", timeout=10):
            pass
    except urllib.error.HTTPError:
        pass  # it answered
    except (ConnectionError, urllib.error.URLError, TimeoutError) as exc:
        raise CommandError(
            f"No server answers at {base_url} ({exc}). Start the demo (make demo), point --url "
            "at a running server, or use --in-process."
        ) from exc


def fire(send: Sender, path: str, body: bytes, key: str | None, count: int) -> list[Outcome]:
    """Send ``count`` requests from ``count`` threads, released together by a barrier."""
    barrier = threading.Barrier(count)
    outcomes = [Outcome() for _ in range(count)]

    def worker(index: int) -> None:
        try:
            barrier.wait(timeout=60)
            outcomes[index] = send(path, body, key)
        except Exception as exc:  # noqa: BLE001 - every failure is counted and printed
            outcomes[index] = Outcome(error=f"{type(exc).__name__}: {exc}")
        finally:
            connections.close_all()  # this thread's own connections (in-process mode)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return outcomes


def tally(result: StormResult, outcomes: list[Outcome]) -> None:
    result.requests_sent = len(outcomes)
    other: Counter[str] = Counter()
    for outcome in outcomes:
        result.network_retries += outcome.retries
        if outcome.error:
            other["error"] += 1
            result.first_error = result.first_error or outcome.error
        elif outcome.replayed:
            result.replays += 1
        elif 200 <= outcome.status < 300:
            result.executions += 1
        elif outcome.status == 409:
            result.conflicts += 1
        else:
            other[str(outcome.status)] += 1
    result.other = dict(other)


def _ledger(reference: str) -> int:
    return LedgerEntry.objects.filter(order__reference=reference).count()


def settle(reference: str, wait: float) -> int:
    """The ledger count once it stops changing (a real broker's worker may still be busy)."""
    if settings.CELERY_TASK_ALWAYS_EAGER or wait <= 0:
        return _ledger(reference)
    deadline = time.monotonic() + wait
    last, stable_since = _ledger(reference), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        current = _ledger(reference)
        if current != last:
            last, stable_since = current, time.monotonic()
        elif last and time.monotonic() - stable_since >= 2:
            break
    return last


def order_body(reference: str, payment_id: str, amount_cents: int) -> bytes:
    return json.dumps(
        {
            "reference": reference,
            "amount_cents": amount_cents,
            "provider": "demo-psp",
            "external_payment_id": payment_id,
        }
    ).encode()


def first_event(reference: str, wait: float) -> dict[str, Any] | None:
    """The OrderConfirmed event of the order, as the consumer saw it (its ledger entry)."""
    deadline = time.monotonic() + (0 if settings.CELERY_TASK_ALWAYS_EAGER else wait)
    while True:
        entry = (
            LedgerEntry.objects.filter(order__reference=reference)
            .select_related("order")
            .order_by("pk")
            .first()
        )
        if entry is not None:
            return {
                "event_id": entry.event_id,
                "order_id": entry.order_id,
                "amount_cents": entry.amount_cents,
            }
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.25)


def relay_order_events(order_id: int, wait: float) -> tuple[int, bool]:
    """Count the order's outbox messages and get them sent; (count, still waiting for a relay).

    With eager Celery (no broker) the relay runs here, in this process. With a broker, a relay
    process (``manage.py idempotency_relay``) sends them; this waits up to ``wait`` seconds.
    """
    messages = OutboxEntry.objects.filter(ordering_key=order_key(order_id))
    if settings.CELERY_TASK_ALWAYS_EAGER:
        Relay().drain()
    else:
        deadline = time.monotonic() + wait
        while messages.filter(state="pending").exists() and time.monotonic() < deadline:
            time.sleep(0.25)
    return messages.count(), messages.filter(state="pending").exists()


def protected_storm(
    send: Sender, requests: int, redeliveries: int, amount: int, wait: float, tag: str
) -> StormResult:
    reference = f"STORM-{tag}"
    result = StormResult(PROTECTED)
    body = order_body(reference, f"pay_{tag}", amount)
    tally(result, fire(send, PROTECTED, body, str(uuid.uuid4()), requests))
    result.orders_created = Order.objects.filter(reference=reference).count()
    order = Order.objects.filter(reference=reference).first()
    if order is not None:
        result.outbox_messages, result.relay_waiting = relay_order_events(order.pk, wait)
    event = first_event(reference, wait)
    if event is not None:
        for _ in range(redeliveries):
            apply_order_confirmed.delay(event)  # the broker delivering the same event again
        result.redeliveries = redeliveries
    result.ledger_entries = settle(reference, wait)
    return result


def unprotected_storm(
    send: Sender, requests: int, redeliveries: int, amount: int, tag: str
) -> StormResult:
    reference = f"UNSAFE-{tag}"
    result = StormResult(UNPROTECTED)
    body = order_body(reference, f"pay_unsafe_{tag}", amount)
    tally(result, fire(send, UNPROTECTED, body, str(uuid.uuid4()), requests))
    result.orders_created = Order.objects.filter(reference=reference).count()
    event = first_event(reference, 0)
    if event is not None:
        for _ in range(redeliveries):
            apply_unprotected(event)  # the naive consumer applies every delivery
        result.redeliveries = redeliveries
    result.ledger_entries = _ledger(reference)
    return result


ROWS = [
    ("requests sent", "requests_sent"),
    ("views executed (2xx)", "executions"),
    ("replays served", "replays"),
    ("conflicts (409)", "conflicts"),
    ("orders created", "orders_created"),
    ("outbox messages", "outbox_messages"),
    ("event redeliveries", "redeliveries"),
    ("ledger entries", "ledger_entries"),
]


class Command(BaseCommand):
    help = (
        "Fire many concurrent retries of one order with one Idempotency-Key, redeliver its event, "
        "and compare with the unprotected endpoint."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--url",
            default="http://127.0.0.1:8000",
            help="the running server (default: %(default)s)",
        )
        parser.add_argument(
            "--in-process",
            action="store_true",
            help="no server: send through django.test.Client in threads (works on SQLite)",
        )
        parser.add_argument("--requests", type=int, default=20, help="concurrent retries (20)")
        parser.add_argument("--redeliveries", type=int, default=5, help="extra deliveries (5)")
        parser.add_argument("--amount-cents", type=int, default=4200)
        parser.add_argument(
            "--wait", type=float, default=15.0, help="seconds to wait for a real broker (15)"
        )
        parser.add_argument("--json", action="store_true", help="print the figures as JSON")
        parser.add_argument(
            "--check",
            action="store_true",
            help="exit non-zero unless the protected endpoint made one order and one ledger entry",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        requests = options["requests"]
        if not 1 <= requests <= 500:
            raise CommandError("--requests must be between 1 and 500.")
        if options["redeliveries"] < 0:
            raise CommandError("--redeliveries must be 0 or more.")
        if not options["in_process"]:
            check_server(options["url"])
        send = in_process_sender() if options["in_process"] else http_sender(options["url"])
        where = (
            f"in-process (django.test.Client in {requests} threads)"
            if options["in_process"]
            else options["url"]
        )
        tag = uuid.uuid4().hex[:10]
        protected = protected_storm(
            send, requests, options["redeliveries"], options["amount_cents"], options["wait"], tag
        )
        unprotected = unprotected_storm(
            send, requests, options["redeliveries"], options["amount_cents"], tag
        )
        if options["json"]:
            self.stdout.write(
                json.dumps({"protected": asdict(protected), "unprotected": asdict(unprotected)})
            )
        else:
            self.report(where, protected, unprotected)
        outcome = (
            protected.orders_created,
            protected.outbox_messages,
            protected.ledger_entries,
        )
        if options["check"] and outcome != (1, 1, 1):
            raise CommandError(
                "expected 1 order, 1 outbox message and 1 ledger entry with protection, got "
                f"{outcome[0]}, {outcome[1]} and {outcome[2]}"
            )

    def report(self, where: str, protected: StormResult, unprotected: StormResult) -> None:
        write = self.stdout.write
        write(
            f"Retry storm: {protected.requests_sent} concurrent POSTs of one order with one "
            f"Idempotency-Key, then its event delivered {protected.redeliveries} more times.\n"
            f"Target: {where}; Celery: "
            + ("eager" if settings.CELERY_TASK_ALWAYS_EAGER else settings.CELERY_BROKER_URL)
            + "\n"
        )
        write(f"{'':<24}{'with django-idempotency':>25}{'without':>22}")
        write(f"{'':<24}{PROTECTED:>25}{UNPROTECTED:>22}")
        for label, name in ROWS:
            left, right = getattr(protected, name), getattr(unprotected, name)
            write(f"{label:<24}{left:>25}{right:>22}")
        if protected.relay_waiting:
            write(
                self.style.WARNING(
                    "The order's outbox message is still pending: start a relay "
                    "(python manage.py idempotency_relay) next to the worker."
                )
            )
        for result in (protected, unprotected):
            if result.network_retries:
                write(
                    f"connections refused or reset and sent again ({result.endpoint}): "
                    f"{result.network_retries}"
                )
            if result.other:
                write(self.style.WARNING(f"other answers from {result.endpoint}: {result.other}"))
            if result.first_error:
                write(
                    self.style.ERROR(f"first error from {result.endpoint}: {result.first_error}")
                )
        verdict = (
            self.style.SUCCESS
            if (protected.orders_created, protected.ledger_entries) == (1, 1)
            else self.style.ERROR
        )
        write(
            verdict(
                f"\nWith the app: {protected.orders_created} order, "
                f"{protected.ledger_entries} ledger entry. "
            )
            + self.style.WARNING(
                f"Without: {unprotected.orders_created} orders, "
                f"{unprotected.ledger_entries} ledger entries."
            )
        )
