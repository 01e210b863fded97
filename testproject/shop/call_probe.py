"""What a Celery task received, for the parity proofs of ``outbox.publish()`` against
``apply_async`` (``tests/test_celery_call_parity.py``).

``shop.probe_call`` writes a report of its call to Redis under ``probe:<probe>``: each argument
with its type, and the fields of ``self.request`` that a message sets (eta, expires, retries,
time limits, headers, delivery info, ...). :class:`Money` is a type registered with
``kombu.utils.json.register_type``, as a project registers its own; the worker registers it by
importing this module with the tasks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from decimal import Decimal
from typing import Any

from celery import shared_task
from kombu.utils.json import register_type

PROBE_REDIS = os.environ.get("PROBE_REDIS_URL", "redis://127.0.0.1:6379/13")


@dataclasses.dataclass(frozen=True)
class Money:
    amount: Decimal
    currency: str


register_type(
    Money,
    "money",
    lambda money: {"amount": str(money.amount), "currency": money.currency},
    lambda value: Money(Decimal(value["amount"]), value["currency"]),
)


def describe(value: Any) -> Any:
    """``value`` with the type of everything in it: ``["UUID", "UUID('...')"]`` for a scalar."""
    if isinstance(value, dict):
        return {"dict": {str(key): describe(item) for key, item in value.items()}}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [describe(item) for item in value]}
    return [type(value).__name__, repr(value)]


def _plain(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


@shared_task(bind=True, name="shop.probe_call")
def probe_call(self: Any, *args: Any, probe: str = "", **kwargs: Any) -> int:
    """Report what this call received (see the module); return how many arguments it had (a
    ``link`` callback or a chain's next task gets it as its first argument)."""
    import redis

    request = self.request
    report = {
        "ran_at": time.time(),
        "args": describe(list(args)),
        "kwargs": describe(kwargs),
        "request": {key: _plain(value) for key, value in vars(request).items()},
    }
    client = redis.Redis.from_url(PROBE_REDIS)
    try:
        client.set(f"probe:{probe}", json.dumps(report), ex=600)
    finally:
        client.close()
    return len(args)
