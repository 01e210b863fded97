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
delivery publishes nothing (:func:`clear`). A callback or step the outbox cannot carry, a
group, a chord or one it refuses for its own arguments or options, stays Celery's.

Errbacks (``link_error``) stay Celery's: the worker runs them when a delivery fails for good.
"""

from __future__ import annotations

import logging
from typing import Any

from django_idempotency.exceptions import log_text

__all__ = ["clear", "give_back", "take_over"]

logger = logging.getLogger(__name__)

#: What :func:`take_over` took from a request: its ``callbacks`` and ``chain``.
Taken = tuple[Any, Any]


def take_over(task: Any, request: Any, result: Any, event_id: str) -> Taken | None:
    """Publish the delivery's callbacks and its chain's next task with ``result``, through the
    outbox, in the current transaction (the effect's); then :func:`clear` them, and return what
    was taken (None: nothing), for :func:`give_back` should that transaction not commit.

    A callback or chain step the outbox refuses whatever the result (:func:`_refusal`) is left
    in the request, for Celery's worker to publish, as a group is.

    :raises TypeError: ``result`` is not what the outbox stores (kombu's JSON): the delivery
        fails and rolls back, and the callback is not lost.
    :raises ValueError: ``result`` is over ``OUTBOX_MAX_PAYLOAD_BYTES`` or nested too deep.
    """
    callbacks, chain = _ours(request)
    if not callbacks and not chain:
        return None
    taken = (request.callbacks, request.chain)
    from celery.canvas import signature

    app = task.app
    priority = _parents_priority(app, request)
    left = [item for item in request.callbacks or () if _celerys(item)]
    for callback in callbacks:
        step = signature(callback, app=app)
        if not _publish(task, step, result, dict(priority), event_id, "link callback"):
            left.append(callback)
    left_chain = request.chain if request.chain and _celerys(request.chain[-1]) else None
    if chain:
        step = signature(chain[-1], app=app)
        rest = {"chain": chain[:-1], **priority}
        if not _publish(task, step, result, rest, event_id, "chain's next task"):
            left_chain = request.chain
    request.update({"callbacks": left or None, "chain": left_chain or None})
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


def clear(request: Any, task: Any = None) -> None:
    """Leave the worker no callback nor chain to publish for this delivery, but a group or a
    chord the outbox cannot carry (:func:`_ours`), and, given the ``task``, a callback or chain
    step the outbox refuses whatever the result (:func:`_refusal`): :func:`take_over` left those
    to Celery's worker too, which publishes them on every delivery, a duplicate's included."""

    def celerys(item: Any, options: dict[str, Any]) -> bool:
        return _celerys(item) or (task is not None and _refusal(task, item, options) is not None)

    kept = [item for item in request.callbacks or () if celerys(item, {})]
    chain = request.chain or None
    left = chain if chain and celerys(chain[-1], {"chain": chain[:-1]}) else None
    request.update({"callbacks": kept or None, "chain": left})


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
) -> bool:
    """Publish ``step`` with ``result`` through the outbox; False (nothing written) when the
    outbox refuses the step whatever the result: it is left to Celery's worker."""
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
        refused = _refusal(task, step, options)
        if refused is not None:
            logger.warning(
                "consumer %s, event %s: the outbox refuses its %s %s whatever the result (%s); "
                "Celery's worker publishes it instead, after the delivery, at least once",
                log_text(task.consumer_name),
                log_text(event_id),
                what,
                log_text(step.get("task")),
                log_text(refused),
            )
            return False
        raise (TypeError if isinstance(exc, TypeError) else ValueError)(
            f"Consumer {task.consumer_name!r}, event {event_id}: the task's result goes to its "
            f"{what} {step.get('task')!r} through the outbox, in the effect's transaction, and "
            f"cannot: {exc} The delivery is rolled back; return a value kombu's JSON writes."
        ) from exc
    return True


def _refusal(task: Any, item: Any, options: dict[str, Any]) -> Exception | None:
    """Why the outbox refuses to publish ``item`` (a signature) with ``options`` whatever the
    result (its own arguments or options: one Celery's worker publishes, but the outbox cannot
    store), checked with None as the result and nothing written; None when it takes it.

    Such a callback or chain step is left to Celery's worker, as a group is: taken over, it
    failed every delivery, and the event was never applied."""
    from celery.canvas import signature
    from django.db import connections

    from django_idempotency.conf import conf
    from django_idempotency.outbox.celery_calls import prepare
    from django_idempotency.outbox.core import _json

    alias = getattr(task, "database", None) or conf.DATABASE
    vendor = connections[alias].vendor
    try:
        call = prepare(signature(item, app=task.app), (None,), None, None, dict(options))
        _, payload_size, _ = _json("payload", call.payload, vendor)
        _, headers_size, _ = _json("headers", call.headers, vendor)
        if payload_size + headers_size > conf.OUTBOX_MAX_PAYLOAD_BYTES:
            raise ValueError(
                f"{payload_size + headers_size} bytes as JSON, over OUTBOX_MAX_PAYLOAD_BYTES"
            )
    except (TypeError, ValueError) as exc:
        return exc
    return None


def _parents_priority(app: Any, request: Any) -> dict[str, Any]:
    """``{"priority": p}`` when Celery's worker would apply the callbacks and the chain's next
    task with ``priority=p`` (``task_inherit_parent_priority``, and the delivery had one),
    which wins over a signature's own; else nothing."""
    if not app.conf.task_inherit_parent_priority:
        return {}
    priority = (request.delivery_info or {}).get("priority")
    return {} if priority is None else {"priority": priority}
