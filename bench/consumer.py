"""Consumer rows: an effect alone against ``try_reserve`` + the effect, and duplicates.

Every row is the same transaction shape, one ``transaction.atomic`` per event:

* ``effect alone``: insert one Effect (an unprotected consumer);
* ``try_reserve + effect``: reserve the event id, then insert the Effect;
* ``@idempotent_consumer + effect``: the same through the decorator;
* ``duplicate (try_reserve)``: reserve an id that is already reserved (returns False);
* ``duplicate (@idempotent_consumer)``: the same through the decorator;
* ``@idempotent_consumer + effect, ASYNC_DELIVERY_COUNT``: the decorator with the delivery count
  committed asynchronously (PostgreSQL; the setting is on for that row's rounds only);
* ``@idempotent_consumer + effect, redelivered=False``: the decorator on a first delivery that
  the broker vouches for (AMQP's redelivered flag, as the Celery adapter reads it on RabbitMQ),
  which skips its count;
* ``dramatiq actor alone``: a ``dramatiq.actor`` whose body is the effect's transaction, called
  as Dramatiq's worker calls it (the message handed to the broker's middleware first);
* ``@idempotent_actor + effect``: the same body under
  :func:`~django_idempotency.events.dramatiq.idempotent_actor`, a message as Redis delivers it
  (no redelivered flag: the delivery is counted); ``..., RabbitMQ first delivery``: a message
  RabbitMQ flags as never delivered (the count is skipped); ``duplicate (@idempotent_actor)``:
  an event already processed. These rows' ``ratio_to_actor_alone`` is the consumer's overhead
  against the actor alone, measured side by side in the same rounds.

Run in its own process with the benchmark settings (the runner does that)::

    BENCH_DATABASE_URL=postgres://... python -m bench.consumer --events 1000 --rounds 3

It prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from bench.rounds import median_ratio, rotation

CONSUMER = "bench.consumer"
DECORATED = "bench.decorated-consumer"
DRAMATIQ = "bench.dramatiq-actor"
ACTOR_ALONE = "dramatiq actor alone"


def _setup() -> None:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.benchproject.settings")
    os.environ.setdefault("BENCH_VARIANT", "app")
    django.setup()


def build_rows() -> dict[str, tuple[Callable[[str], Any], str]]:
    """name -> (handle(event_id), which ids it takes: "new" or "duplicate")."""
    from django.db import transaction

    from bench.benchproject.models import Effect

    rows: dict[str, tuple[Callable[[str], Any], str]] = {}

    def effect_alone(event_id: str) -> None:
        with transaction.atomic():
            Effect.objects.create(name="consumer-alone", payload=event_id, amount_cents=1)

    rows["effect alone"] = (effect_alone, "new")

    try:
        from django_idempotency import try_reserve
    except ImportError as exc:
        rows["try_reserve + effect"] = (_missing(exc), "new")
        return rows

    def reserved_effect(event_id: str) -> None:
        with transaction.atomic():
            if try_reserve(event_id, CONSUMER):
                Effect.objects.create(name="consumer-reserved", payload=event_id, amount_cents=1)

    def duplicate(event_id: str) -> None:
        with transaction.atomic():
            if try_reserve(event_id, CONSUMER):
                raise AssertionError(f"{event_id} was reserved twice")

    rows["try_reserve + effect"] = (reserved_effect, "new")
    rows["duplicate (try_reserve)"] = (duplicate, "duplicate")

    try:
        from django_idempotency import idempotent_consumer

        @idempotent_consumer(
            DECORATED,
            event_id=lambda evt: evt["event_id"],
            redelivered=lambda evt: evt.get("redelivered"),
        )
        def decorated(evt: dict[str, Any]) -> None:
            Effect.objects.create(name="consumer-decorated", payload=evt["event_id"])

    except (ImportError, TypeError) as exc:
        rows["@idempotent_consumer + effect"] = (_missing(exc), "new")
    else:
        rows["@idempotent_consumer + effect"] = (lambda eid: decorated({"event_id": eid}), "new")
        rows["duplicate (@idempotent_consumer)"] = (
            lambda eid: decorated({"event_id": eid}),
            "duplicate-decorated",
        )
        rows[ASYNC_ROW] = (lambda eid: decorated({"event_id": eid}), "new")
        rows[FIRST_ROW] = (
            lambda eid: decorated({"event_id": eid, "redelivered": False}),
            "new",
        )
    rows.update(dramatiq_rows())
    return rows


def dramatiq_rows() -> dict[str, tuple[Callable[[str], Any], str]]:
    """The Dramatiq rows: the actor alone, and under ``idempotent_actor``."""
    from django.db import transaction

    from bench.benchproject.models import Effect

    try:
        import dramatiq
        from dramatiq.broker import MessageProxy
        from dramatiq.brokers.rabbitmq import _RabbitmqMessage
        from dramatiq.brokers.stub import StubBroker

        from django_idempotency.events.dramatiq import IdempotentMessages, idempotent_actor
    except ImportError as exc:
        return {ACTOR_ALONE: (_missing(exc), "new")}
    broker = StubBroker(middleware=[])
    middleware = IdempotentMessages()

    @dramatiq.actor(broker=broker, actor_name="bench_alone")
    def alone(event_id: str) -> None:
        with transaction.atomic():
            Effect.objects.create(name="dramatiq-alone", payload=event_id, amount_cents=1)

    @idempotent_actor(broker=broker, consumer=DRAMATIQ, actor_name="bench_idempotent")
    def protected(event_id: str) -> None:
        Effect.objects.create(name="dramatiq-idempotent", payload=event_id, amount_cents=1)

    def delivered(actor: Any, rabbitmq: bool) -> Callable[[str], None]:
        def handle(event_id: str) -> None:
            message = dramatiq.Message(
                queue_name="default",
                actor_name=actor.actor_name,
                args=(event_id,),
                kwargs={},
                options={},
            )
            proxy = _RabbitmqMessage(False, 1, message) if rabbitmq else MessageProxy(message)
            middleware.before_process_message(broker, proxy)
            try:
                actor(*proxy.args, **proxy.kwargs)  # as dramatiq's worker calls it
            finally:
                middleware.after_process_message(broker, proxy)

        return handle

    return {
        ACTOR_ALONE: (delivered(alone, False), "new"),
        "@idempotent_actor + effect": (delivered(protected, False), "new"),
        "@idempotent_actor + effect, RabbitMQ first delivery": (delivered(protected, True), "new"),
        "duplicate (@idempotent_actor)": (delivered(protected, False), "duplicate-dramatiq"),
    }


ASYNC_ROW = "@idempotent_consumer + effect, ASYNC_DELIVERY_COUNT"
FIRST_ROW = "@idempotent_consumer + effect, redelivered=False"
ROW_SETTINGS: dict[str, dict[str, Any]] = {ASYNC_ROW: {"ASYNC_DELIVERY_COUNT": True}}
"""IDEMPOTENCY overrides in force during a row's warm-up and rounds (never while timing others)."""


def _row_settings(name: str) -> Any:
    from django.conf import settings
    from django.test import override_settings

    overrides = ROW_SETTINGS.get(name)
    if not overrides:
        return contextlib.nullcontext()
    return override_settings(IDEMPOTENCY={**getattr(settings, "IDEMPOTENCY", {}), **overrides})


def _missing(exc: BaseException) -> Callable[[str], Any]:
    def fail(event_id: str) -> None:
        raise RuntimeError(f"not available: {exc}")

    return fail


def _reserve_all(ids: list[str], consumer: str) -> None:
    """Untimed: process each id once so that the duplicate rows meet only known ids."""
    from django.db import transaction

    from django_idempotency import try_reserve

    for event_id in ids:
        with transaction.atomic():
            try_reserve(event_id, consumer)


BLOCK = 25
"""Events a row runs in one turn: the rows take turns block by block, so that a burst of outside
load (two shared cores) hits every row alike instead of whichever row ran at that moment."""


def run(events: int, rounds: int) -> dict[str, Any]:
    _setup()
    from django.db import connection

    from bench.benchproject.middleware import StatementCounter
    from bench.micro import _backend_cpu_reader
    from django_idempotency.conf import conf

    rows = build_rows()
    names = list(rows)
    # One more event per round than is timed: its statements are counted, untimed.
    duplicates = [str(uuid.uuid4()) for _ in range((events + 1) * rounds)]
    errors: dict[str, str] = {}
    if "duplicate (try_reserve)" in rows:
        _reserve_all(duplicates, CONSUMER)
    if "duplicate (@idempotent_consumer)" in rows:
        _reserve_all(duplicates, DECORATED)
    if "duplicate (@idempotent_actor)" in rows:
        _reserve_all(duplicates, DRAMATIQ)
    per_round: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    statements: dict[str, Counter[int]] = {name: Counter() for name in names}
    commits: dict[str, Counter[int]] = {name: Counter() for name in names}
    for name in names:  # warm-up: imports, the connection, plan caches
        handle, kind = rows[name]
        if kind == "new":
            try:
                with _row_settings(name):
                    for _ in range(20):
                        handle(str(uuid.uuid4()))
            except Exception as exc:  # noqa: BLE001 - reported as the row's error
                errors[name] = f"{type(exc).__name__}: {exc}"
    backend_cpu = _backend_cpu_reader(connection, pooled=False)
    perf_counter, thread_time = time.perf_counter, time.thread_time
    live = [name for name in names if name not in errors]
    for round_no in range(rounds):
        order = rotation(live, round_no)
        batches: dict[str, list[str]] = {}
        for name in order:
            handle, kind = rows[name]
            if kind == "new":
                batches[name] = [str(uuid.uuid4()) for _ in range(events + 1)]
            else:
                batches[name] = duplicates[round_no * (events + 1) : (round_no + 1) * (events + 1)]
            # Statements and commits of one more event, untimed (the counter costs time).
            with _row_settings(name), StatementCounter().counting() as counter:
                handle(batches[name].pop())
            statements[name][counter.count] += 1
            commits[name][counter.commits] += 1
        latencies: dict[str, list[float]] = {name: [] for name in order}
        client = dict.fromkeys(order, 0.0)
        server = dict.fromkeys(order, 0)
        for start in range(0, events, BLOCK):
            for name in order:
                handle = rows[name][0]
                with _row_settings(name):
                    conf.ASYNC_DELIVERY_COUNT  # noqa: B018 - settings parsed before the clock
                    for event_id in batches[name][start : start + BLOCK]:
                        before = backend_cpu()
                        cpu = thread_time()
                        began = perf_counter()
                        handle(event_id)
                        latencies[name].append(perf_counter() - began)
                        client[name] += thread_time() - cpu
                        server[name] += backend_cpu() - before
        for name in order:
            done = sorted(latencies[name])
            per_round[name].append(
                {
                    "events_per_s": round(len(done) / sum(done), 1),
                    "p50_ms": round(done[len(done) // 2] * 1000, 3),
                    "p99_ms": round(done[int(len(done) * 0.99) - 1] * 1000, 3),
                    "client_cpu_us": round(client[name] * 1e6 / len(done), 1),
                    "server_cpu_us": round(server[name] / 1e3 / len(done), 1),
                }
            )
    out_rows = []
    alone = per_round.get("effect alone", [])
    actor_alone = per_round.get(ACTOR_ALONE, []) if ACTOR_ALONE not in errors else []
    for name in names:
        entry: dict[str, Any] = {"row": name, "rounds": per_round[name]}
        if name in errors:
            entry["error"] = errors[name]
        if per_round[name]:
            entry["events_per_s"] = statistics.median(r["events_per_s"] for r in per_round[name])
            entry["p50_ms"] = statistics.median(r["p50_ms"] for r in per_round[name])
            entry["p99_ms"] = statistics.median(r["p99_ms"] for r in per_round[name])
            entry["statements"] = statements[name].most_common(1)[0][0]
            entry["statements_histogram"] = {str(k): v for k, v in statements[name].items()}
            entry["commits"] = commits[name].most_common(1)[0][0]
            cpu = [_cpu_us(r) for r in per_round[name]]
            entry["cpu_us_per_event"] = round(statistics.median(cpu), 1)
            mine = per_round[name]
            if alone and name != "effect alone":
                entry["ratio_to_effect_alone"] = _ratio(mine, alone, _events_per_s)
                entry["p50_ratio_to_effect_alone"] = _ratio(mine, alone, _p50_ms)
                entry["cpu_ratio_to_effect_alone"] = _ratio(mine, alone, _cpu_us)
            if actor_alone and "idempotent_actor" in name:
                entry["ratio_to_actor_alone"] = _ratio(mine, actor_alone, _events_per_s)
                entry["cpu_ratio_to_actor_alone"] = _ratio(mine, actor_alone, _cpu_us)
        out_rows.append(entry)
    return {
        "events_per_round": events,
        "rounds": rounds,
        "cpu_measured": "client+server" if backend_cpu() else "client",
        "rows": out_rows,
    }


Round = dict[str, float]
"""One row's figures of one round (:func:`run`)."""


def _events_per_s(figures: Round) -> float:
    return figures["events_per_s"]


def _p50_ms(figures: Round) -> float:
    return figures["p50_ms"]


def _cpu_us(figures: Round) -> float:
    return figures["client_cpu_us"] + figures["server_cpu_us"]


def _ratio(mine: list[Round], baseline: list[Round], measure: Callable[[Round], float]) -> float:
    """The median of the per-round ratios of ``measure`` to the baseline's (bench.rounds)."""
    return median_ratio([measure(r) for r in mine], [measure(r) for r in baseline])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1000, help="events per row per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.events, args.rounds)))


if __name__ == "__main__":
    main()
