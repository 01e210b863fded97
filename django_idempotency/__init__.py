"""django-idempotency: exactly-once effects for Django views and message consumers.

The public API is re-exported here and imported lazily, so that listing the app in
``INSTALLED_APPS`` does not import models before the app registry is ready.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("django-idempotency")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = [
    "IdempotentConsumer",
    "__version__",
    "idempotent",
    "idempotent_consumer",
    "idempotent_task",
    "new_event_id",
    "try_reserve",
]

_LAZY = {
    "IdempotentConsumer": "django_idempotency.events.celery",
    "idempotent": "django_idempotency.http.decorators",
    "idempotent_consumer": "django_idempotency.events.consumers",
    "idempotent_task": "django_idempotency.events.django_tasks",
    "new_event_id": "django_idempotency.events.ids",
    "try_reserve": "django_idempotency.events.core",
}

if TYPE_CHECKING:
    from django_idempotency.events.celery import IdempotentConsumer
    from django_idempotency.events.consumers import idempotent_consumer
    from django_idempotency.events.core import try_reserve
    from django_idempotency.events.django_tasks import idempotent_task
    from django_idempotency.events.ids import new_event_id
    from django_idempotency.http.decorators import idempotent


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
