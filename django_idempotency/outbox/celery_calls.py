"""A Celery call as the outbox stores it, and as the relay gives it back to Celery.

``outbox.publish(task, args, kwargs, **options)`` takes what ``task.apply_async(args, kwargs,
**options)`` takes, and the task must receive what ``apply_async`` would have given it.
:func:`prepare` checks and stores the call; :func:`arguments` is the relay's side.

* **Values.** Celery's default serializer is kombu's JSON, which writes ``datetime``, ``date``,
  ``time``, ``UUID``, ``Decimal``, ``bytes`` and any type registered with
  ``kombu.utils.json.register_type`` as ``{"__type__": ..., "__value__": ...}``, and a worker
  decodes them back. The outbox row stores that JSON as kombu writes it (readable in the admin),
  and the relay hands it to kombu again: the worker reads the same bytes as after
  ``apply_async``. Bytes that hold a NUL are stored base64-encoded (kombu's other form for
  bytes), since PostgreSQL stores no NUL character in JSON.
* **Serializers.** With ``pickle``, ``yaml``, ``msgpack`` or another serializer (the task's,
  the call's or the app's), the relay decodes the stored JSON and serializes the values as
  Celery would. ``publish()`` first checks that the task gets exactly what ``apply_async`` would
  give it, values and types; when the JSON in between would change something (a tuple that
  pickle keeps and JSON turns into a list, a non-string dict key, an object JSON cannot hold),
  it refuses the call and says what.
* **Times.** ``countdown`` counts from the commit (:mod:`.schedule`); an ``eta`` is a moment.
  ``expires`` in seconds counts from the same moment as the countdown: the commit with one, the
  ``publish()`` call without (as ``apply_async`` counts it from its call).
* **Options.** :data:`OPTIONS` lists those honoured; :data:`REFUSED` those refused, with why.
* **Signatures.** ``publish(task.s(1, 2).set(queue="x"))`` is the signature's
  ``apply_async()``: its arguments and options merged as Celery merges them. ``link``,
  ``link_error`` and chains go in the message, as protocol 2 carries them
  (:mod:`.celery_canvas`); groups and chords are refused (see :data:`REFUSED`).

Why this module is long: ``apply_async``'s arguments are one contract. The values, the
serializer, the times, the options and the signature each change what the task receives, and
one pass over the call checks them together, in the order ``apply_async`` applies them.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.utils import timezone

from django_idempotency.extras import missing_extra
from django_idempotency.outbox.celery_canvas import CANVAS_OPTIONS, GROUPS, stored, unchain

__all__ = [
    "OPTIONS",
    "REFUSED",
    "CeleryCall",
    "arguments",
    "decode",
    "encode",
    "prepare",
    "shown",
]

#: Options the relay passes on to Celery as ``apply_async`` would (beside ``countdown``, ``eta``,
#: ``expires``, ``headers`` and ``task_id``, which are handled apart), and what each must be.
OPTIONS: dict[str, str] = {
    "queue": "str",
    "routing_key": "str",
    "exchange": "str",
    "exchange_type": "str",
    "priority": "int",
    "time_limit": "seconds",
    "soft_time_limit": "seconds",
    "shadow": "str",
    "ignore_result": "bool",
    "retries": "int",
    "root_id": "str",
    "parent_id": "str",
    "reply_to": "str",
    "argsrepr": "str",
    "kwargsrepr": "str",
    "serializer": "str",
    "compression": "str",
    "delivery_mode": "delivery_mode",
}

#: Options accepted and left out: they say how the caller's own publish should behave, and the
#: relay publishes instead (it retries until the broker has the message).
IGNORED = frozenset({"retry", "retry_policy", "add_to_parent"})

_GROUPS = GROUPS
_OWN_CONNECTION = (
    "the relay publishes later, with its own connection, producer and router (CeleryTransport's "
    "app and broker_url)"
)

#: Options refused, and why.
REFUSED: dict[str, str] = {
    "chord": _GROUPS,
    "group_id": _GROUPS,
    "group_index": _GROUPS,
    "producer": _OWN_CONNECTION,
    "publisher": _OWN_CONNECTION,
    "connection": _OWN_CONNECTION,
    "router": _OWN_CONNECTION,
    "route_name": _OWN_CONNECTION,
    "result_cls": "the outbox returns the event id, not an AsyncResult",
    "declare": "kombu entities are not JSON; declare the queue in the app's task_queues",
    "timeout": "the relay bounds its broker calls itself (CeleryTransport's timeout)",
    "confirm_timeout": "the relay bounds its broker calls itself (CeleryTransport's timeout)",
    "immediate": "RabbitMQ removed it, and no relay reads a returned message",
    "mandatory": "no relay reads a message the broker returns as unroutable",
    "stamped_headers": "canvas stamping is Celery's own bookkeeping for canvases",
    "replaced_task_nesting": "Celery's own bookkeeping for Task.replace()",
}

#: The subtask types of signatures refused, and why.
CANVASES = {
    "group": _GROUPS,
    "chord": _GROUPS,
    "chunks": _GROUPS,
    "xmap": _GROUPS,
    "xstarmap": _GROUPS,
}

_INT_MIN = -2147483648  # what Celery checks countdown and expires against
MAX_DEPTH = 31  # outbox.core.MAX_JSON_DEPTH, which send() applies to what is stored


@dataclass
class CeleryCall:
    """A call checked by :func:`prepare`, ready for ``outbox.send()``."""

    name: str
    payload: dict[str, Any]
    """``{"args": [...], "kwargs": {...}, "options": {...}}``, JSON as kombu writes it."""
    event_id: Any
    countdown: float | None = None
    """Seconds after the commit, for a call with a (non-zero) countdown."""
    eta: datetime | None = None
    """The moment it is due, for a call with an eta (aware)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Message headers that are strings (the row's ``headers``)."""


@functools.cache
def _encoder() -> type[json.JSONEncoder]:
    """kombu's JSON encoder, but for bytes that hold a NUL: base64 (kombu's other form)."""
    from kombu.utils.json import JSONEncoder

    class OutboxEncoder(JSONEncoder):
        def default(self, o: Any) -> Any:
            if type(o) is bytes and b"\x00" in o:
                return {"__type__": "base64", "__value__": base64.b64encode(o).decode("ascii")}
            return super().default(o)

    return OutboxEncoder


def encode(value: Any) -> tuple[Any, str]:
    """``value`` as kombu's JSON writes it: ``(the JSON value, its text)``.

    :raises TypeError: a value kombu's JSON cannot write (as ``apply_async`` would raise), NaN
        or infinity (no database stores them in JSON).
    :raises ValueError: a mapping shaped like kombu's ``{"__type__", "__value__"}`` that no
        decoder registered here takes (a worker would fail to decode the message), or a value
        nested too deep to write.
    """
    from kombu.utils.json import loads

    try:
        text = json.dumps(value, cls=_encoder(), allow_nan=False)
    except RecursionError as exc:
        raise ValueError(f"nested more levels deep than the {MAX_DEPTH} a message holds") from exc
    except ValueError as exc:  # NaN or infinity, or a circular reference
        raise TypeError(f"not JSON that a database stores: {exc}") from exc
    if '"__type__"' not in text:  # no tag: nothing for kombu to decode
        return json.loads(text), text
    try:
        loads(text)
    except Exception as exc:
        raise ValueError(
            "a mapping shaped like kombu's {'__type__': ..., '__value__': ...} that kombu cannot "
            f"decode ({type(exc).__name__}: {exc}); a worker would fail on it"
        ) from exc
    return json.loads(text), text


def decode(value: Any) -> Any:
    """The Python values a worker gets from a stored JSON value (kombu's ``object_hook``)."""
    from kombu.utils.json import loads

    return loads(json.dumps(value))


def shown(value: Any) -> Any:
    """What a task's ``argsrepr``/``kwargsrepr`` shows of arguments stored for kombu's JSON: the
    values, as ``apply_async`` writes their repr (``UUID('...')``), when they hold kombu's tags;
    else the stored value itself (no decoding). The relay calls it for every message: a flat
    list or mapping (most calls) is answered without a walk."""
    items = value.values() if type(value) is dict else value if type(value) is list else ()
    for item in items:
        if type(item) is dict or type(item) is list:
            break
    else:
        if not (type(value) is dict and value.keys() == {"__type__", "__value__"}):
            return value
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if item.keys() == {"__type__", "__value__"}:  # what kombu's object_hook decodes
                return decode(value)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return value


def arguments(payload_args: Any, payload_kwargs: Any, serializer: str) -> tuple[Any, Any]:
    """The relay's side: the stored arguments as JSON for kombu's JSON serializer (the same
    text again), decoded for any other serializer."""
    if serializer == "json":
        return payload_args, payload_kwargs
    return decode(payload_args), decode(payload_kwargs)


# --- publish() ---------------------------------------------------------------------------------


def prepare(
    task: Any,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    headers: Mapping[str, Any] | None,
    options: dict[str, Any],
) -> CeleryCall:
    """Check a call as ``apply_async`` would, and turn it into what the outbox stores.

    :raises TypeError: arguments the task does not take, a value the serializer cannot write
        or that would reach the task changed, an option of the wrong type, an unknown option.
    :raises ValueError: a refused option or canvas (the reason is in the message), a countdown
        or eta out of range, a soft time limit above the time limit.
    """
    try:
        from celery import current_app
        from celery.canvas import Signature
    except ImportError as error:
        raise missing_extra("celery", "outbox.publish()") from error

    task_object: Any = None
    resolve = getattr(task, "_get_current_object", None)  # a shared_task's proxy
    if callable(resolve) and not isinstance(task, (str, Signature)):
        task = resolve()  # once, instead of at every attribute read below
    if isinstance(task, Signature):
        kind = task.get("subtask_type")
        if kind == "chain":  # its first task is the message, the rest its chain option
            task, options = unchain(task, args, kwargs, options)
            args, kwargs, kind = None, None, task.get("subtask_type")
        if kind is not None:
            reason = CANVASES.get(kind, "only a signature of one task is one message")
            raise ValueError(f"outbox.publish() does not take a {kind}: {reason}.")
        given = {k: v for k, v in options.items() if v is not None}
        if args or kwargs or given:
            args, kwargs, options = task._merge(args, kwargs, given)
        else:
            args, kwargs, options = task.args, task.kwargs, dict(task.options)
        options = dict(options)
        name = str(task.task)
        try:
            task_object = task.type
        except Exception:  # noqa: BLE001 - not registered here: a call by name
            task_object = None
        app = task_object._get_app() if task_object is not None else current_app
    elif isinstance(task, str):
        name, app = task, current_app
    else:
        name, task_object, app = str(task.name), task, task._get_app()
    if isinstance(args, (str, bytes)) or not isinstance(args, (Sequence, type(None))):
        # list("ab") is ["a", "b"]: a string was stored as one argument per character.
        raise TypeError(f"args must be a list or tuple of arguments, not {args!r:.100}.")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping, not {kwargs!r:.100}.")
    args, kwargs = list(args or ()), dict(kwargs or {})
    options = {k: v for k, v in options.items() if k not in IGNORED}
    if "headers" in options:
        headers = {**(options.pop("headers") or {}), **(headers or {})}
    _refuse(options)
    explicit = "serializer" in options  # the call's own, not the task's
    if task_object is not None:
        args, kwargs, options = _as_the_task_would(name, task_object, args, kwargs, options)
    _inherit_parent(app, options)
    # A task's serializer is among its options (the app's unless it set one); the app's
    # setting is read only for a call by name (each read of app.conf costs microseconds).
    serializer = options.get("serializer") or app.conf.task_serializer
    stored = _encoded(name, args, kwargs, serializer)
    canvas = stored_canvas(name, options, serializer)
    stored_options = _options(options)
    stored_options.update(canvas)
    countdown, eta = _times(app, options, stored_options)
    string_headers, other_headers = _split_headers(headers)
    if other_headers:
        stored_options["headers"] = other_headers
    if serializer != "json" or explicit:
        stored_options["serializer"] = serializer  # the relay's app may default to another
    else:  # kombu's JSON, as the task (or the app) says: the relay reads it there too
        stored_options.pop("serializer", None)
    from django_idempotency.events.ids import find_event_id

    event_id = options.get("task_id") or find_event_id(tuple(args), kwargs)
    return CeleryCall(
        name=name,
        payload={"args": stored[0], "kwargs": stored[1], "options": stored_options},
        event_id=event_id,
        countdown=countdown,
        eta=eta,
        headers=string_headers,
    )


def _refuse(options: Mapping[str, Any]) -> None:
    for name in options:
        if name in REFUSED:
            raise ValueError(f"outbox.publish() refuses the option {name!r}: {REFUSED[name]}.")
    known = {*OPTIONS, *CANVAS_OPTIONS, "countdown", "eta", "expires", "task_id"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"outbox.publish() does not know the option(s) {', '.join(map(repr, unknown))}. It "
            f"takes apply_async's {', '.join(sorted(known | IGNORED))} (retry, retry_policy and "
            "add_to_parent change nothing: the relay retries until the broker has the message)."
        )


def _as_the_task_would(
    name: str, task: Any, args: list[Any], kwargs: dict[str, Any], options: dict[str, Any]
) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """What ``Task.apply_async`` does to a call before it sends it: the signature check, the
    time limits' check, the shadow name, the task's own options, pydantic models dumped."""
    if getattr(task, "typing", True) and callable(getattr(task, "__header__", None)):
        try:
            task.__header__(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(
                f"publish({name!r}): the arguments do not fit the task's signature: {exc}."
            ) from exc
    soft, hard = getattr(task, "soft_time_limit", None), getattr(task, "time_limit", None)
    if soft and hard and soft > hard:
        raise ValueError("soft_time_limit must be less than or equal to time_limit")
    if options.get("shadow") is None and callable(getattr(task, "shadow_name", None)):
        if getattr(task, "__v2_compat__", False):
            shadow = task.shadow_name(task(), args, kwargs, options)
        else:
            shadow = task.shadow_name(args, kwargs, options)
        if shadow is not None:
            options["shadow"] = shadow
    exec_options = getattr(task, "_get_exec_options", None)
    if callable(exec_options):
        defaults = {k: v for k, v in exec_options().items() if v is not None}
        options = {**defaults, **options}
    dump = getattr(task, "_dump_pydantic_arguments", None)
    if dump is not None and options.get("serializer") != "pickle":
        dumped_args, dumped_kwargs = dump(args, kwargs)
        args, kwargs = list(dumped_args), dict(dumped_kwargs)
    if options.get("ignore_result") is None and getattr(task, "ignore_result", False):
        options["ignore_result"] = True
    return args, kwargs, options


def stored_canvas(name: str, options: dict[str, Any], serializer: str) -> dict[str, list[Any]]:
    """The call's ``link``, ``link_error`` and ``chain`` as stored (:mod:`.celery_canvas`),
    taken out of ``options``; with a serializer other than JSON, each signature's arguments
    checked as the task's are."""

    def check(args: list[Any], kwargs: dict[str, Any], where: str) -> None:
        try:
            _check_serializer(name, (args, kwargs), encode((args, kwargs))[0], serializer)
        except (TypeError, ValueError) as exc:
            kind = TypeError if isinstance(exc, TypeError) else ValueError
            raise kind(f"{exc} (in a {where} signature)") from exc

    return stored(name, options, encode, None if serializer == "json" else check)


def _inherit_parent(app: Any, options: dict[str, Any]) -> None:
    """Inside a task, ``apply_async`` makes the new task its child (``send_task``)."""
    if options.get("root_id") and options.get("parent_id"):
        return
    parent = app.current_worker_task
    if not parent:
        return
    if not options.get("root_id"):
        options["root_id"] = parent.request.root_id or parent.request.id
    if not options.get("parent_id"):
        options["parent_id"] = parent.request.id
    if app.conf.task_inherit_parent_priority:
        priority = (parent.request.delivery_info or {}).get("priority")
        if priority is not None:
            options.setdefault("priority", priority)


def _encoded(
    name: str, args: list[Any], kwargs: dict[str, Any], serializer: str
) -> tuple[Any, Any]:
    """The arguments as stored, checked against what ``serializer`` would give the task."""
    try:
        stored, _ = encode((args, kwargs))
    except TypeError as exc:
        raise TypeError(
            f"publish({name!r}): the arguments must be what kombu's JSON writes (JSON, datetime, "
            f"date, time, UUID, Decimal, bytes, or a type registered with "
            f"kombu.utils.json.register_type): {exc}."
        ) from exc
    except ValueError as exc:
        raise ValueError(f"publish({name!r}): {exc}.") from exc
    if serializer != "json":
        _check_serializer(name, (args, kwargs), stored, serializer)
    return stored[0], stored[1]


def _check_serializer(name: str, original: Any, stored: Any, serializer: str) -> None:
    """Refuse a call whose task would get something else through the outbox's JSON than what
    ``serializer`` gives it after ``apply_async``."""
    from kombu import serialization

    known: Any = serialization.registry._encoders  # type: ignore[attr-defined]
    if serializer not in known:
        raise ValueError(
            f"publish({name!r}): the serializer {serializer!r} is not installed here "
            f"(kombu knows {', '.join(sorted(known))}); apply_async would fail the same way."
        )

    def round_trip(value: Any) -> Any:
        content_type, encoding, data = serialization.dumps(value, serializer=serializer)
        return serialization.loads(data, content_type, encoding, accept=[content_type])

    try:
        expected = round_trip(original)
    except Exception as exc:
        raise TypeError(
            f"publish({name!r}): the {serializer} serializer cannot write the arguments: {exc}."
        ) from exc
    got = round_trip(decode(stored))
    difference = _difference(list(expected[0]), list(got[0]), "args")
    difference = difference or _difference(expected[1], got[1], "kwargs")
    if difference is not None:
        raise TypeError(
            f"publish({name!r}) with the {serializer} serializer: {difference}. The outbox "
            "stores JSON (with kombu's types), and the task would not get what apply_async "
            "gives it. Pass a value JSON keeps, or use the json serializer for this task."
        )


def _difference(expected: Any, got: Any, path: str) -> str | None:
    """Where ``got`` differs from ``expected`` (types included), or None; without recursion."""
    pending = [(expected, got, path)]
    while pending:
        a, b, where = pending.pop()
        if type(a) is not type(b):
            got, expected = f"{b!r:.80} ({type(b).__name__})", f"{a!r:.80} ({type(a).__name__})"
            return f"{where} would be {got}, not {expected}"
        if isinstance(a, dict):
            if list(a) != list(b) and set(a) != set(b):
                return f"the keys of {where} would be {list(b)!r:.80}, not {list(a)!r:.80}"
            pending.extend((a[k], b[k], f"{where}[{k!r}]") for k in a)
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return f"{where} would have {len(b)} items, not {len(a)}"
            pairs = enumerate(zip(a, b, strict=True))
            pending.extend((x, y, f"{where}[{i}]") for i, (x, y) in pairs)
        elif not _same_scalar(a, b):
            return f"{where} would be {b!r:.80}, not {a!r:.80}"
    return None


def _same_scalar(a: Any, b: Any) -> bool:
    """Equal, of one type (checked before); a float or a ``Decimal`` by its repr: ``-0.0`` is
    not ``0.0``, ``Decimal("1.10")`` not ``Decimal("1.1")``, and a NaN is the same NaN."""
    if isinstance(a, (float, Decimal)):
        return repr(a) == repr(b)
    return bool(a == b)


def _options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options stored with the message, each checked (not the times, headers, task id)."""
    stored: dict[str, Any] = {}
    for name, value in options.items():
        kind = OPTIONS.get(name)
        if kind is None or value is None:
            continue
        if not _fits(kind, value):
            raise TypeError(
                f"outbox.publish(): the option {name!r} must be {_KINDS[kind]}, not "
                f"{value!r:.100}{_HINTS.get(name, '')}."
            )
        stored[name] = value
    return stored


_KINDS = {
    "str": "a string",
    "int": "an integer",
    "bool": "True or False",
    "seconds": "a number of seconds",
    "delivery_mode": "1, 2, 'transient' or 'persistent'",
}
_HINTS = {
    "queue": " (the outbox stores the queue's name: declare it in task_queues)",
    "exchange": " (the outbox stores the exchange's name)",
}


def _fits(kind: str, value: Any) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "seconds":
        return _is_seconds(value) and value >= 0
    return value in (1, 2, "transient", "persistent") and not isinstance(value, bool)


def _is_seconds(value: Any) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _times(
    app: Any, options: Mapping[str, Any], stored: dict[str, Any]
) -> tuple[float | None, datetime | None]:
    """``(countdown, eta)`` of the call, and its times as stored: ``eta`` as given (an ISO
    8601 string), ``expires`` as a moment in ISO 8601, or, with a countdown, in seconds after
    the message's due time (``apply_async`` counts both from one moment: here the commit). The
    countdown itself is the row's ``due_at``, set at the commit (:mod:`.schedule`)."""
    countdown = options.get("countdown")
    eta = options.get("eta")
    expires = options.get("expires")
    for what, seconds in (("countdown", countdown), ("expires", expires)):
        if seconds is None or (isinstance(seconds, (datetime, str)) and what == "expires"):
            continue
        if not _is_seconds(seconds):
            raise TypeError(
                f"outbox.publish(): {what} must be a number of seconds, not {seconds!r:.80}."
            )
        if seconds < _INT_MIN:
            raise ValueError(f"{what} is out of range: {seconds!r}")
        _moment(timezone.now(), seconds, what)  # in range
    due: datetime | None = None
    if countdown:  # as Celery: a countdown of 0 is none, and a countdown wins over an eta
        eta = None
    elif eta is not None:
        due = _aware(_parse(eta, "eta"))
        stored["eta"] = eta if isinstance(eta, str) else eta.isoformat()
    if expires is not None:
        if isinstance(expires, (datetime, str)):
            _parse(expires, "expires")
            stored["expires"] = expires if isinstance(expires, str) else expires.isoformat()
        elif countdown:
            stored["expires"] = expires - countdown  # after the due time (commit + countdown)
        else:  # counted from this call, as apply_async counts it
            stored["expires"] = _moment(app.now(), expires, "expires").isoformat()
    return (float(countdown) if countdown else None), due


def _moment(start: datetime, seconds: Any, what: str) -> datetime:
    try:
        moment = (start.astimezone(UTC) + timedelta(seconds=float(seconds))).astimezone(
            start.tzinfo
        )
    except OverflowError:
        moment = None
    if moment is None or moment.astimezone(UTC).year >= 9999:  # OUTBOX_UNSCHEDULED's year
        raise ValueError(f"{what} is out of range: {seconds!r} seconds from now.")
    return moment


def _parse(value: Any, what: str) -> datetime:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError as exc:
            raise ValueError(f"outbox.publish(): {what} {value!r:.80} is not ISO 8601.") from exc
    raise TypeError(
        f"outbox.publish(): {what} must be a datetime or an ISO 8601 string, not {value!r:.80}."
    )


def _aware(moment: datetime) -> datetime:
    """A worker reads a naive moment as UTC (``maybe_make_aware``)."""
    return moment.replace(tzinfo=UTC) if timezone.is_naive(moment) else moment


def _split_headers(headers: Mapping[str, Any] | None) -> tuple[dict[str, str], dict[str, Any]]:
    """``(string headers, the others)``: strings go in the row's headers, as before; a header
    of another JSON type is stored with the call's options. A header must be plain JSON: an
    AMQP header table cannot carry a UUID or a datetime."""
    if not headers:
        return {}, {}
    if not isinstance(headers, Mapping) or not all(isinstance(k, str) for k in headers):
        raise TypeError(f"Headers must be a mapping with string keys, not {headers!r:.100}.")
    if all(isinstance(v, str) for v in headers.values()):
        return dict(headers), {}
    try:
        json.dumps(headers, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"A message header must be plain JSON (a str, number, bool, None, list or dict): "
            f"{exc}. A broker's header table carries no UUID or datetime: pass str(value)."
        ) from exc
    return {}, dict(headers)
