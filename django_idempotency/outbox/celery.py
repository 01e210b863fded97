"""The one-line move from ``delay_on_commit`` to the outbox: a Celery task base class.

.. code-block:: python

    from django_idempotency.outbox.celery import OutboxTask

    @app.task(base=OutboxTask)
    def send_receipt(order_id: int) -> None: ...

    with transaction.atomic():
        order.save()
        send_receipt.delay_in_outbox(order.pk)  # was: send_receipt.delay_on_commit(order.pk)

:class:`OutboxTaskMixin` gives a task two methods with the signatures of Celery's own:

* ``delay_in_outbox(*args, **kwargs)``, as ``delay_on_commit(*args, **kwargs)``;
* ``apply_in_outbox(args=None, kwargs=None, **options)``, as
  ``apply_async_on_commit(args, kwargs, **options)``, with the outbox's ``key``, ``transport``
  and ``using`` beside ``apply_async``'s options.

Each is :func:`~django_idempotency.outbox.core.publish` on the task, and returns the message's
event id (not an ``AsyncResult``: nothing is sent until the transaction commits, and the relay
sends it). :class:`OutboxTask` is Celery's Django task (``delay_on_commit`` included) with the
mixin; for a task base of your own, put the mixin in front of it: ``class MyTask(
OutboxTaskMixin, MyBase)``. An app whose every task should have them:
``Celery(..., task_cls="django_idempotency.outbox.celery:OutboxTask")``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django_idempotency.extras import missing_extra

try:
    from django_idempotency.celery_bases import DjangoTaskBase, TaskBase
except ImportError as error:  # Celery is the "celery" extra
    raise missing_extra("celery", __name__) from error

from django_idempotency.outbox.core import publish

__all__ = ["OutboxTask", "OutboxTaskMixin"]


class OutboxTaskMixin(TaskBase):
    """``delay_in_outbox`` and ``apply_in_outbox`` for a Celery task (see the module)."""

    def delay_in_outbox(self, *args: Any, **kwargs: Any) -> str:
        """Publish this task's call through the outbox, in the current transaction, as
        ``delay_on_commit(*args, **kwargs)`` would publish it after the commit: every argument
        goes to the task. Returns the event id.

        :raises TransactionManagementError: outside ``transaction.atomic``.
        """
        return publish(self, args, kwargs)

    def apply_in_outbox(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        transport: str = "default",
        using: str | None = None,
        **options: Any,
    ) -> str:
        """Publish this task's call through the outbox, in the current transaction, as
        ``apply_async_on_commit(args, kwargs, **options)`` would publish it after the commit
        (``countdown`` counts from the commit). ``key``, ``transport`` and ``using`` are
        :func:`~django_idempotency.outbox.core.publish`'s. Returns the event id.

        :raises TransactionManagementError: outside ``transaction.atomic``.
        """
        return publish(self, args, kwargs, key=key, transport=transport, using=using, **options)


class OutboxTask(OutboxTaskMixin, DjangoTaskBase):
    """Celery's ``DjangoTask`` (``delay_on_commit``, ``apply_async_on_commit``) with
    ``delay_in_outbox`` and ``apply_in_outbox``."""
