"""The calls of the parity proofs: one row per kind of ``apply_async`` call, and how to compare
what a task received after ``apply_async`` with what it received through the outbox.

Each row builds a call from the probe task (``shop.probe_call`` of the publishing app), the
proof's queue and a probe id (the report's key): ``(target, args, kwargs, options)``, sent as
``target.apply_async(args, kwargs, **options)`` and as ``outbox.publish(target, args, kwargs,
**options)``. A row with ``refused`` is one ``publish()`` refuses: the pattern its error must
match (the reason, as docs/outbox.md documents it).

A report (:func:`compare`) is ``{"args", "kwargs", "request"}``: the arguments with their types
(``testproject.shop.call_probe.describe``) and the task's ``request`` fields, as the probe task
writes it, or as a queue's message gives them (:func:`wire_report`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from testproject.shop.call_probe import Money, describe


@dataclass(frozen=True)
class Call:
    target: Any
    args: Any = None
    kwargs: Any = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    id: str
    build: Callable[[Any, str, str], Call]
    """``(probe task, queue, probe id) -> Call``."""
    refused: str | None = None
    """The pattern of publish()'s error, for a refused call."""
    error: type[Exception] = ValueError
    delay: float = 0.0
    """Seconds after the call (the commit) before the task may run."""
    follows: tuple[str, ...] = ()
    """The suffixes of the probes its callbacks and chain steps report under
    (``<probe>.<suffix>``), in the order they run: each is compared both ways too."""
    reprs: bool = False
    """Whether ``argsrepr`` and ``kwargsrepr`` are the same both ways: given, or written by the
    relay from arguments given as a list whose mappings keep their order in ``jsonb`` too. The
    relay writes them from the stored JSON (of the values, for kombu's types): a list for a
    tuple of arguments, and on PostgreSQL a mapping's keys in ``jsonb``'s order
    (docs/outbox.md)."""


def call(target: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Call:
    return Call(target, args, kwargs, options)


def soon(seconds: float = 3.0) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


MOMENT = datetime(2024, 2, 29, 23, 59, 58, 123456, tzinfo=UTC)

ROWS: list[Row] = [
    Row(
        "plain-json",
        lambda t, q, p: call(
            t, [1, "two", [3.5, None], {"a": True}], {"probe": p, "x": {"y": [1]}}, queue=q
        ),
    ),
    Row(
        "kombu-types",
        lambda t, q, p: call(
            t,
            [
                uuid.UUID("0190c3a2-7b7e-7cc3-8e61-2a3b4c5d6e7f"),
                MOMENT,
                MOMENT.replace(tzinfo=None),
                date(2024, 2, 29),
                time(13, 14, 15, 16),
                Decimal("1.10"),
                Decimal("-0.00001"),
            ],
            {"probe": p, "nested": {"when": [MOMENT, {"id": uuid.UUID(int=7)}]}},
            queue=q,
        ),
        reprs=True,
    ),
    Row(
        "bytes",
        lambda t, q, p: call(t, [b"text", b"\x00\xff\xfe", b""], {"probe": p}, queue=q),
        reprs=True,
    ),
    Row(
        "registered-type",
        lambda t, q, p: call(t, [Money(Decimal("9.99"), "EUR")], {"probe": p}, queue=q),
        reprs=True,
    ),
    Row(
        "floats",
        lambda t, q, p: call(t, [1e16, 1.5e300, 5e-324, 0.1, 2.0**53], {"probe": p}, queue=q),
    ),
    Row(
        "tuples-and-int-keys",
        lambda t, q, p: call(t, (1, (2, 3), {4: "four"}), {"probe": p}, queue=q),
    ),
    Row(
        "kombu-shaped-mapping",
        lambda t, q, p: call(
            t, [{"__type__": "decimal", "__value__": "2.50"}], {"probe": p}, queue=q
        ),
    ),
    Row(
        "event-id-keyword",
        lambda t, q, p: call(t, [], {"probe": p, "event_id": uuid.UUID(int=36)}, queue=q),
    ),
    Row("countdown", lambda t, q, p: call(t, [1], {"probe": p}, queue=q, countdown=3), delay=3),
    Row("eta-aware", lambda t, q, p: call(t, [1], {"probe": p}, queue=q, eta=soon()), delay=3),
    Row(
        "eta-naive",
        lambda t, q, p: call(t, [1], {"probe": p}, queue=q, eta=soon().replace(tzinfo=None)),
        delay=3,
    ),
    Row(
        "eta-string",
        lambda t, q, p: call(t, [1], {"probe": p}, queue=q, eta=soon().isoformat()),
        delay=3,
    ),
    Row("expires-seconds", lambda t, q, p: call(t, [1], {"probe": p}, queue=q, expires=120)),
    Row(
        "expires-moment",
        lambda t, q, p: call(t, [1], {"probe": p}, queue=q, expires=soon(120)),
    ),
    Row(
        "countdown-and-expires",
        lambda t, q, p: call(t, [1], {"probe": p}, queue=q, countdown=2, expires=60),
        delay=2,
    ),
    Row("priority", lambda t, q, p: call(t, [1], {"probe": p}, queue=q, priority=7)),
    Row(
        "exchange-and-routing-key",
        lambda t, q, p: call(t, [1], {"probe": p}, exchange=q, routing_key=q),
    ),
    Row(
        "headers",
        lambda t, q, p: call(
            t, [1], {"probe": p}, queue=q, headers={"tenant": "acme", "n": 3, "tags": ["a"]}
        ),
    ),
    Row(
        "time-limits",
        lambda t, q, p: call(t, [1], {"probe": p}, queue=q, time_limit=30, soft_time_limit=20),
    ),
    Row("shadow", lambda t, q, p: call(t, [1], {"probe": p}, queue=q, shadow="probe-shadow")),
    Row("retries", lambda t, q, p: call(t, [1], {"probe": p}, queue=q, retries=2)),
    Row("ignore-result", lambda t, q, p: call(t, [1], {"probe": p}, queue=q, ignore_result=True)),
    Row(
        "root-and-parent",
        lambda t, q, p: call(
            t,
            [1],
            {"probe": p},
            queue=q,
            root_id="0190c3a2-0000-7000-8000-000000000001",
            parent_id="0190c3a2-0000-7000-8000-000000000002",
        ),
    ),
    Row(
        "argsrepr",
        lambda t, q, p: call(
            t, ["secret"], {"probe": p}, queue=q, argsrepr="('***',)", kwargsrepr="{}"
        ),
        reprs=True,
    ),
    Row(
        "compression",
        lambda t, q, p: call(t, ["x" * 500], {"probe": p}, queue=q, compression="zlib"),
    ),
    Row("delivery-mode", lambda t, q, p: call(t, [1], {"probe": p}, queue=q, delivery_mode=1)),
    Row(
        "task-id",
        lambda t, q, p: call(t, [1], {"probe": p}, queue=q, task_id=f"given-{p}"),
    ),
    Row(
        "retry-options",
        lambda t, q, p: call(
            t, [1], {"probe": p}, queue=q, retry=True, retry_policy={"max_retries": 1}
        ),
    ),
    Row(
        "signature",
        lambda t, q, p: call(t.s(1, 2, probe=p).set(queue=q, priority=4), [0], {"k": "v"}),
    ),
    Row("signature-immutable", lambda t, q, p: call(t.si(1, probe=p).set(queue=q), [9])),
    Row(
        "signature-with-options",
        lambda t, q, p: call(t.s(5, probe=p), None, None, queue=q, countdown=2),
        delay=2,
    ),
    Row(
        "pickle",
        lambda t, q, p: call(
            t,
            [uuid.UUID(int=1), Decimal("3.30"), {"a": [1, MOMENT]}, b"\x00"],
            {"probe": p},
            queue=q,
            serializer="pickle",
        ),
    ),
    Row(
        "yaml",
        lambda t, q, p: call(
            t, [MOMENT, date(2024, 1, 2), "x", 1.5], {"probe": p}, queue=q, serializer="yaml"
        ),
    ),
    # --- Callbacks and chains, carried in the message (protocol 2) -------------------------------
    Row(
        "link",
        lambda t, q, p: call(
            t, [1], {"probe": p}, queue=q, link=t.s(probe=f"{p}.link").set(queue=q)
        ),
        follows=("link",),
    ),
    Row(
        "link-error",
        lambda t, q, p: call(
            t, [1], {"probe": p}, queue=q, link_error=[t.si(2, probe=f"{p}.error").set(queue=q)]
        ),
    ),
    Row(
        "signature-set-link",
        lambda t, q, p: call(
            t.s(1, probe=p).set(queue=q, link=t.s(7, probe=f"{p}.link").set(queue=q))
        ),
        follows=("link",),
    ),
    Row(
        "chain-of-3",
        lambda t, q, p: call(
            _chain(
                t.s(1, probe=p).set(queue=q),
                t.s(probe=f"{p}.2").set(queue=q),
                t.s(8, probe=f"{p}.3").set(queue=q),
            )
        ),
        follows=("2", "3"),
    ),
    # --- Refused, with the reason ---------------------------------------------------------------
    Row("group", lambda t, q, p: call(_group(t)), refused="group.*one message per call"),
    Row(
        "link-group",
        lambda t, q, p: call(t, [1], {"probe": p}, queue=q, link=_group(t)),
        refused="group as link.*one message per call",
    ),
    Row(
        "chain-with-group",
        lambda t, q, p: call(t.si(1) | _group(t)),
        refused="chain holding a group.*one message per call",
    ),
    Row("chord", lambda t, q, p: call(_chord(t)), refused="chord.*one message per call"),
    Row(
        "group-id",
        lambda t, q, p: call(t, [1], {"probe": p}, queue=q, group_id="g"),
        refused="'group_id'.*one message per call",
    ),
    Row(
        "producer",
        lambda t, q, p: call(t, [1], {"probe": p}, queue=q, producer=object()),
        refused="'producer'.*its own connection",
    ),
    Row(
        "pickle-tuple",
        lambda t, q, p: call(t, [(1, 2)], {"probe": p}, queue=q, serializer="pickle"),
        refused=r"args\[0\] would be \[1, 2\] \(list\), not \(1, 2\) \(tuple\)",
        error=TypeError,
    ),
    Row(
        "yaml-uuid",
        lambda t, q, p: call(t, [uuid.UUID(int=1)], {"probe": p}, queue=q, serializer="yaml"),
        refused="the yaml serializer cannot write the arguments",
        error=TypeError,
    ),
    Row(
        "unknown-option",
        lambda t, q, p: call(t, [1], {"probe": p}, queue=q, flavour="vanilla"),
        refused="does not know the option.*'flavour'",
        error=TypeError,
    ),
    Row(
        "object-argument",
        lambda t, q, p: call(t, [object()], {"probe": p}, queue=q),
        refused="what kombu's JSON writes",
        error=TypeError,
    ),
]

SENT = [row for row in ROWS if row.refused is None]
REFUSED_ROWS = [row for row in ROWS if row.refused is not None]


def _chain(*tasks: Any) -> Any:
    from celery import chain

    return chain(*tasks)


def _group(task: Any) -> Any:
    from celery import group

    return group(task.si(1), task.si(2))


def _chord(task: Any) -> Any:
    from celery import chord

    return chord([task.si(1), task.si(2)], task.si(3))


# --- Comparing what the task received -----------------------------------------------------------

#: Request fields that differ between any two messages (ids, origins, clocks, brokers' tags),
#: compared apart or not at all. The outbox adds its ``event_id`` header.
VARYING = {
    "id",
    "root_id",
    "parent_id",
    "correlation_id",
    "origin",
    "hostname",
    "reply_to",
    "eta",
    "expires",
    "event_id",
    "properties",
    "delivery_info",
    "headers",
    "argsrepr",
    "kwargsrepr",
    "args",
    "kwargs",
    "ran_at",
    "_protected",
    "callbacks",
    "errbacks",
    "chain",
}
#: Request fields holding signatures: compared without their ids and probes (:func:`_canvas`).
CANVAS = ("callbacks", "errbacks", "chain")


def wire_report(message: Any) -> dict[str, Any]:
    """The report of a message taken from a queue: what a worker would make of it."""
    args, kwargs, embed = message.decode()
    headers = dict(message.headers)
    properties = dict(message.properties)
    delivery_info = dict(message.delivery_info)
    return {
        "args": describe(list(args)),
        "kwargs": describe({k: v for k, v in kwargs.items() if k != "probe"}),
        "request": {
            **headers,
            **(embed or {}),
            "properties": properties,
            "delivery_info": delivery_info,
        },
    }


def worker_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """A probe task's report, the probe id taken out of its keyword arguments."""
    kwargs = dict(report["kwargs"]["dict"])
    kwargs.pop("probe", None)
    return {**report, "kwargs": {"dict": kwargs}}


def compare(
    row: Row,
    direct: Mapping[str, Any],
    outboxed: Mapping[str, Any],
    called_at: float,
    committed_at: float,
    slack: float,
) -> list[str]:
    """The differences between the two reports of ``row`` (empty: the same call).

    ``called_at`` is when ``apply_async`` ran and ``committed_at`` when the outbox's
    transaction committed (epoch seconds): an eta or expiry counted from the call must be as
    far from it as the outbox's from the commit, within ``slack`` seconds, in the same time
    zone. Everything else compares as it is, but for the ids and what depends on them.
    """
    found: list[str] = []
    if direct.get("args") != outboxed.get("args"):
        found.append(f"args: {direct.get('args')} != {outboxed.get('args')}")
    if direct.get("kwargs") != outboxed.get("kwargs"):
        found.append(f"kwargs: {direct.get('kwargs')} != {outboxed.get('kwargs')}")
    a, b = dict(direct["request"]), dict(outboxed["request"])
    for key in sorted((set(a) | set(b)) - VARYING):
        if a.get(key) != b.get(key):
            found.append(f"request.{key}: {a.get(key)!r} != {b.get(key)!r}")
    for key in ("eta", "expires"):
        found += _moment_difference(key, a.get(key), b.get(key), called_at, committed_at, slack)
    for name in ("root_id", "parent_id", "correlation_id"):
        # Given, they are the same; not given, the root and correlation are the task's own id.
        own_a, own_b = a.get(name) == a.get("id"), b.get(name) == b.get("id")
        if own_a != own_b or (not own_a and a.get(name) != b.get(name)):
            found.append(f"request.{name}: {a.get(name)!r} != {b.get(name)!r}")
    found += _properties_difference(a, b, slack)
    for key in CANVAS:
        if _canvas(a.get(key)) != _canvas(b.get(key)):
            found.append(f"request.{key}: {a.get(key)!r} != {b.get(key)!r}")
    headers_a = {k: v for k, v in (a.get("headers") or {}).items() if k != "event_id"}
    headers_b = {k: v for k, v in (b.get("headers") or {}).items() if k != "event_id"}
    if headers_a != headers_b:
        found.append(f"request.headers: {headers_a} != {headers_b}")
    for key in ("argsrepr", "kwargsrepr", "args", "kwargs") if row.reprs else ():
        if key in a and isinstance(a[key], str) and _unprobed(a[key]) != _unprobed(b.get(key)):
            found.append(f"request.{key}: {a[key]!r} != {b.get(key)!r}")
    if row.id == "task-id" and not all(str(x.get("id")).startswith("given-") for x in (a, b)):
        found.append(f"request.id: {a.get('id')!r}, {b.get('id')!r}: not the given task id")
    return found


def _canvas(value: Any) -> Any:
    """Signatures as JSON text, without what differs each call: the task ids a chain's steps
    are given, the publisher's ``reply_to``, the probe ids."""
    import json
    import re

    text = json.dumps(value or None, sort_keys=True, default=repr)
    text = re.sub(r'"(task_id|reply_to)": "[^"]*"', r'"\1": "..."', text)
    return re.sub(r"[0-9a-f]{32}", "PROBE", text)


def _unprobed(text: Any) -> Any:
    import re

    if not isinstance(text, str):
        return text
    return re.sub(r"'probe': '[0-9a-f]+'(, )?", "", text)


def _moment_difference(
    key: str, a: Any, b: Any, called_at: float, committed_at: float, slack: float
) -> list[str]:
    if a is None or b is None:
        return [] if a is None and b is None else [f"request.{key}: {a!r} != {b!r}"]
    moment_a, moment_b = datetime.fromisoformat(a), datetime.fromisoformat(b)
    if (moment_a.tzinfo is None) != (moment_b.tzinfo is None) or (
        moment_a.utcoffset() != moment_b.utcoffset()
    ):
        return [f"request.{key}: {a!r} and {b!r} are not in one time zone"]
    after_a = _epoch(moment_a) - called_at
    after_b = _epoch(moment_b) - committed_at
    if abs(after_a - after_b) > slack:
        return [f"request.{key}: {after_a:.2f} s after the call, {after_b:.2f} s after the commit"]
    return []


def _epoch(moment: datetime) -> float:
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _properties_difference(a: Mapping[str, Any], b: Mapping[str, Any], slack: float) -> list[str]:
    found = []
    props_a, props_b = dict(a.get("properties") or {}), dict(b.get("properties") or {})
    for key in ("delivery_mode", "priority", "content_type", "content_encoding"):
        if props_a.get(key) != props_b.get(key):
            found.append(f"properties.{key}: {props_a.get(key)!r} != {props_b.get(key)!r}")
    exp_a, exp_b = props_a.get("expiration"), props_b.get("expiration")
    if (exp_a is None) != (exp_b is None) or (
        exp_a is not None and abs(float(exp_a) - float(exp_b)) > slack * 1000
    ):
        found.append(f"properties.expiration: {exp_a!r} != {exp_b!r}")
    info_a, info_b = dict(a.get("delivery_info") or {}), dict(b.get("delivery_info") or {})
    for key in ("exchange", "routing_key", "priority"):
        if info_a.get(key) != info_b.get(key):
            found.append(f"delivery_info.{key}: {info_a.get(key)!r} != {info_b.get(key)!r}")
    return found
