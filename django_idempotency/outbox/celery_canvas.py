"""The Celery canvases the outbox carries: ``link``, ``link_error`` and chains.

Celery's message protocol 2 carries them in the task message itself: the body's embed holds
``callbacks`` (``link``), ``errbacks`` (``link_error``) and ``chain`` (the chain's remaining
tasks, last first), each a list of signatures as dicts. The worker that runs the task applies
them: the callbacks and the chain's next task with the task's result on success, the errbacks on
failure. So ``outbox.publish()`` stores them as JSON dicts in the row's options, and the relay
hands them to ``create_task_message`` as ``send_task`` would: the worker receives what
``apply_async`` would have given it.

* :func:`unchain`: a chain, as ``celery.canvas._chain.run`` sends it: its first task is the
  message, the rest go as its ``chain`` option, reversed, each frozen (given its task id).
* :func:`stored`: the ``link``, ``link_error`` and ``chain`` options of a call, checked and
  encoded; a group, a chord or another canvas that publishes several messages among them is
  refused, as is a signature whose values the JSON in between would change.

An idempotent consumer takes the callbacks and the chain over (they leave through the outbox,
with its effect): :mod:`django_idempotency.events.celery_steps`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["CANVAS_OPTIONS", "GROUPS", "stored", "unchain", "walk"]

#: The options of a call that carry signatures.
CANVAS_OPTIONS = ("link", "link_error", "chain")

GROUPS = (
    "a group or a chord publishes several task messages at once and joins their results; the "
    "outbox writes one message per call and reads no result. Publish each task with its own "
    "publish() (in the same transaction: all or none leave)"
)

#: The subtask types refused anywhere in a call (as the call, a callback or a chain's task).
REFUSED_CANVASES = frozenset({"group", "chord", "chunks", "xmap", "xstarmap"})


def unchain(
    chain: Any, args: Any, kwargs: Any, options: Mapping[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """``(first task, its options)``: a chain as ``chain.apply_async(args, kwargs, **options)``
    sends it (``_chain.run`` and ``prepare_steps`` with protocol 2).

    The call's ``args`` go before the first task's (unless the chain or that task is
    immutable), its ``task_id`` and ``link`` go to the last task, its ``link_error`` to every
    task; the tasks after the first are frozen, and go as the ``chain`` option, last first.
    """
    from celery.canvas import maybe_signature
    from celery.utils.functional import maybe_list

    app = chain._app or None
    options = dict(chain.options, **options) if options else dict(chain.options)
    link = options.pop("link", None)
    link_error = options.pop("link_error", None)
    last_id = options.pop("task_id", None)
    head = tuple(args) + tuple(chain.args) if args and not chain.immutable else chain.args
    steps = _steps(chain, app)
    if not steps:
        raise ValueError("outbox.publish() does not take an empty chain: it sends no message.")
    tasks = [steps[0].clone(head, kwargs or {})] + [step.clone() for step in steps[1:]]
    for index, task in enumerate(tasks):
        last = index == len(tasks) - 1
        if last and last_id is not None:
            task.options["task_id"] = last_id
        if index:  # the first is the message: its task id is the outbox's event id
            task.freeze(root_id=options.get("root_id"))
        if last and link:
            task.extend_list_option("link", link)
        for errback in maybe_list(link_error) or ():
            task.link_error(maybe_signature(errback, app=app))
    rest = list(reversed(tasks[1:]))
    if rest:
        options["chain"] = list(options.get("chain") or ()) + rest
    return tasks[0], options


def _steps(chain: Any, app: Any) -> list[Any]:
    """The chain's tasks, nested chains spliced in; a group or chord among them is refused."""
    from celery.canvas import _chain, maybe_signature

    found: list[Any] = []
    pending = list(reversed(list(chain.tasks)))
    while pending:
        task: Any = maybe_signature(pending.pop(), app=app)
        if isinstance(task, _chain):
            pending.extend(reversed(list(task.tasks)))
            continue
        kind = task.get("subtask_type")
        if kind is not None:
            raise ValueError(f"outbox.publish() does not take a chain holding a {kind}: {GROUPS}.")
        found.append(task)
    return found


def stored(
    name: str,
    options: dict[str, Any],
    encode: Callable[[Any], tuple[Any, str]],
    check: Callable[[Any, Any, str], None] | None,
) -> dict[str, list[Any]]:
    """Take the ``link``, ``link_error`` and ``chain`` options out of ``options``: each a list
    of signatures as kombu's JSON writes them (what the row stores), empty ones left out.

    :param encode: kombu's JSON encoding (``celery_calls.encode``).
    :param check: called with each signature's ``(args, kwargs, where)``, for a serializer
        other than JSON: it raises when the JSON in between would change what the task gets.
    :raises ValueError: a group, chord or other canvas that is not one message per task.
    :raises TypeError: a signature whose values kombu's JSON cannot write.
    """
    from celery.utils.functional import maybe_list

    found: dict[str, list[Any]] = {}
    for option in CANVAS_OPTIONS:
        value = options.pop(option, None)
        items = maybe_list(value) if value is not None else None
        if not items:
            continue
        if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
            raise TypeError(
                f"outbox.publish(): {option} must be a signature or a list of signatures, "
                f"not {value!r:.100}."
            )
        signatures = [_signature(item, option) for item in items]
        for signature in signatures:
            walk(signature, option, check)
        try:
            found[option] = encode([dict(signature) for signature in signatures])[0]
        except (TypeError, ValueError) as exc:
            raise (TypeError if isinstance(exc, TypeError) else ValueError)(
                f"publish({name!r}): the {option} signatures must be what kombu's JSON writes "
                f"(as the task's arguments): {exc}."
            ) from exc
    return found


def _signature(item: Any, option: str) -> Any:
    from celery.canvas import Signature, maybe_signature

    if isinstance(item, Signature):
        return item
    if isinstance(item, Mapping) and "task" in item:
        return maybe_signature(dict(item))
    raise TypeError(
        f"outbox.publish(): each {option} must be a signature (task.s(...)), not {item!r:.100}."
    )


def walk(signature: Any, where: str, check: Callable[[Any, Any, str], None] | None) -> None:
    """Refuse a group or chord anywhere in ``signature`` (its own callbacks, a chain's tasks);
    run ``check`` on the arguments of each task in it."""
    pending: list[tuple[Any, str]] = [(signature, where)]
    while pending:
        item, path = pending.pop()
        if not isinstance(item, Mapping):
            raise TypeError(f"outbox.publish(): {path} must be a signature, not {item!r:.100}.")
        kind = item.get("subtask_type")
        if kind in REFUSED_CANVASES:
            raise ValueError(f"outbox.publish() does not take a {kind} as {path}: {GROUPS}.")
        if kind == "chain":
            tasks = (item.get("kwargs") or {}).get("tasks") or ()
            pending.extend((task, f"{path}'s chain") for task in tasks)
        elif check is not None:
            check(list(item.get("args") or ()), dict(item.get("kwargs") or {}), path)
        own = item.get("options") or {}
        for option in CANVAS_OPTIONS:
            nested = own.get(option)
            if nested:
                nested = nested if isinstance(nested, (list, tuple)) else [nested]
                pending.extend((sub, f"{path}'s {option}") for sub in nested)
