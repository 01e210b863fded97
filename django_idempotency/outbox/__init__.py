"""The transactional outbox: a message leaves if and only if its transaction commits.

* :mod:`.core`: ``publish()`` and ``send()`` check a message and write it in the caller's
  transaction;
* :mod:`.relay`: claims committed messages, hands them to a transport and records the outcome
  (the ``idempotency_relay`` command and the ``relay_outbox`` task run it);
* :mod:`.transports`: the transport interface and the Celery transport (Kafka's is
  :mod:`django_idempotency.kafka.transport`, Dramatiq's :mod:`.dramatiq`).

``from django_idempotency import outbox`` then ``outbox.publish(...)`` or ``outbox.send(...)``;
:class:`~django_idempotency.outbox.celery.OutboxTask` gives Celery tasks ``delay_in_outbox()``
and ``apply_in_outbox()``.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__all__ = ["OutboxTask", "OutboxTaskMixin", "publish", "send"]

_LAZY = {
    "publish": "django_idempotency.outbox.core",
    "send": "django_idempotency.outbox.core",
    "OutboxTask": "django_idempotency.outbox.celery",
    "OutboxTaskMixin": "django_idempotency.outbox.celery",
}

if TYPE_CHECKING:
    from django_idempotency.outbox.celery import OutboxTask, OutboxTaskMixin
    from django_idempotency.outbox.core import publish, send


def __getattr__(name: str) -> Any:
    # Lazily, so that importing a transport (named in settings) loads no model.
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
