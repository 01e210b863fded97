"""The bases of the library's Celery task classes, for the type checker and at run time.

:class:`~django_idempotency.events.celery.IdempotentConsumerMixin` and
:class:`~django_idempotency.outbox.celery.OutboxTaskMixin` derive from :data:`TaskBase`, their
ready-made classes from :data:`DjangoTaskBase`: Celery's generic ``Task[..., Any]`` and
``DjangoTask[..., Any]`` for the type checker, ``object`` and ``DjangoTask`` at run time, where
Celery's Task classes are not subscriptable in every supported release. Internal: import the
adapters, not this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django_idempotency.extras import missing_extra

try:
    from celery.contrib.django.task import DjangoTask
except ImportError as error:  # Celery is the "celery" extra; 5.4 brought celery.contrib.django
    raise missing_extra("celery", __name__) from error

__all__ = ["DjangoTaskBase", "TaskBase"]

if TYPE_CHECKING:
    from celery import Task

    TaskBase = Task[..., Any]
    DjangoTaskBase = DjangoTask[..., Any]
else:
    TaskBase = object
    DjangoTaskBase = DjangoTask
