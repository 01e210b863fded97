"""An idempotent Celery consumer's callbacks and chain, sent through the outbox with its effect.

A delivery of a task carries its ``link`` callbacks (``request.callbacks``) and the rest of its
chain (``request.chain``); Celery's worker applies them after the task returns, on every
delivery that succeeds. An idempotent consumer returns None for a duplicate, so a redelivery
would run them again, with None. Instead, the consumer takes them over
(:func:`take_over`): inside the transaction of the delivery that applies the event, it
publishes each callback and the chain's next task through the outbox, as Celery's worker would
build them (``celery.app.trace``: the result as first argument, the chain's remaining tasks as
its ``chain`` option, the task as parent), and clears them from the request so that the worker
publishes nothing itself. The follow-up leaves if and only if the effect commits; a duplicate
delivery publishes nothing (:func:`clear`).

Errbacks (``link_error``) stay Celery's: the worker runs them when a delivery fails for good.
"""

from __future__ import annotations

from typing import Any

__all__ = ["clear", "give_back", "take_over"]

#: What :func:`take_over` took from a request: its ``callbacks`` and ``chain``.
Taken = tuple[Any, Any]


def take_over(task: Any, request: Any, result: Any, event_id: str) -> Taken | None:
    """Publish the delivery's callbacks and its chain's next task with ``result``, through the
    outbox, in the current transaction (the effect's); then :func:`clear` them, and return what
    was taken (None: nothing), for :func:`give_back` should that transaction not commit.

    :raises TypeError: ``result`` (or a callback's own arguments) is not what the outbox stores
        (kombu's JSON): the delivery fails and rolls back, and the callback is not lost.
    """
    callbacks, chain = _ours(request)
    if not callbacks and not chain:
        return None
    taken = (request.callbacks, request.chain)
    from celery.canvas import signature

    app = task.app
    for callback in callbacks:
        _publish(task, signature(callback, app=app), result, {}, event_id, "link callback")
    if chain:
        step = signature(chain[-1], app=app)
        _publish(task, step, result, {"chain": chain[:-1]}, event_id, "chain's next task")
    clear(request)
    return taken


def _ours(request: Any) -> tuple[list[Any], list[Any]]:
    """The callbacks and the chain the outbox can carry. A group or a chord (as a callback, the
    chain's next task, or inside one), or a member of one (a chain's last task in a group), is
    one message per task and a joined result: the outbox refuses it, so Celery's worker keeps
    publishing it, as it did before the takeover (at least once: a duplicate runs it with
    None), rather than fail every delivery."""
    callbacks = [item for item in request.callbacks or () if not _celerys(item)]
    chain = list(request.chain or ())
    return callbacks, chain if chain and not _celerys(chain[-1]) else []


def give_back(request: Any, taken: Taken) -> None:
    """The transaction :func:`take_over` published in rolled back (a database lost at its
    COMMIT, say): the callbacks and chain are the request's again, so that the retry Celery
    builds from the request (``signature_from_request``) carries them."""
    request.update({"callbacks": taken[0], "chain": taken[1]})


def clear(request: Any) -> None:
    """Leave the worker no callback nor chain to publish for this delivery, but a group or a
    chord the outbox cannot carry (:func:`_ours`)."""
    kept = [item for item in request.callbacks or () if _celerys(item)]
    chain = request.chain or None
    request.update(
        {"callbacks": kept or None, "chain": chain if chain and _celerys(chain[-1]) else None}
    )


def _celerys(item: Any) -> bool:
    """Whether the outbox refuses ``item``: a group or chord in it, or an option of a group's
    member (``group_id``, ``group_index``, ``chord``: a chain's last task inside a group)."""
    from django_idempotency.outbox.celery_calls import REFUSED
    from django_idempotency.outbox.celery_canvas import walk

    options = item.get("options") if isinstance(item, dict) else None
    if any(option in REFUSED for option in options or ()):
        return True
    try:
        walk(item, "step", None)
    except (TypeError, ValueError):
        return True
    return False


def _publish(
    task: Any, step: Any, result: Any, options: dict[str, Any], event_id: str, what: str
) -> None:
    from django_idempotency.events.ids import new_event_id
    from django_idempotency.outbox.core import publish

    if not step.options.get("task_id"):
        # As apply_async gives the message a new task id; the outbox's event id is that id.
        options["task_id"] = str(new_event_id())
    try:
        publish(
            step,
            (result,),
            transport=getattr(task, "outbox_transport", "default"),
            using=getattr(task, "database", None),
            **options,
        )
    except (TypeError, ValueError) as exc:
        raise (TypeError if isinstance(exc, TypeError) else ValueError)(
            f"Consumer {task.consumer_name!r}, event {event_id}: the task's result goes to its "
            f"{what} {step.get('task')!r} through the outbox, in the effect's transaction, and "
            f"cannot: {exc} The delivery is rolled back; return a value kombu's JSON writes."
        ) from exc
