"""A producer process that dies right after COMMIT, before any publish.

    python -m tests.outbox_producer QUEUE

What a web worker does when it confirms an order, then a SIGKILL at the worst moment:

1. a transaction that writes an ``Effect`` row, publishes through the outbox, and rolls back;
2. a transaction that creates an ``Order`` and publishes event A through the outbox **and**
   event B with ``delay_on_commit`` (the old way). Its first ``on_commit`` callback SIGKILLs the
   process: the COMMIT has happened, no publish has.

It prints ``{"rolled_back": ..., "outbox": A, "on_commit": B}`` before committing.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import django


def main(queue: str) -> None:
    django.setup()
    from django.db import transaction

    from django_idempotency import new_event_id
    from django_idempotency.outbox import core as outbox
    from testproject.shop.models import Order
    from testproject.shop.tasks import effect

    rolled_back = str(new_event_id())
    try:
        with transaction.atomic():
            outbox.publish(effect, kwargs={"event_id": rolled_back}, queue=queue)
            raise LookupError("the view failed; everything rolls back")
    except LookupError:
        pass

    via_outbox, via_on_commit = str(new_event_id()), str(new_event_id())
    with transaction.atomic():
        Order.objects.create(reference="KILLED-AFTER-COMMIT", amount_cents=100)
        transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))
        outbox.publish(effect, kwargs={"event_id": via_outbox}, queue=queue)
        effect.apply_async_on_commit(kwargs={"event_id": via_on_commit}, queue=queue)
        print(
            json.dumps(
                {"rolled_back": rolled_back, "outbox": via_outbox, "on_commit": via_on_commit}
            ),
            flush=True,
        )
    raise AssertionError("unreachable: the process is killed after COMMIT")


if __name__ == "__main__":
    main(sys.argv[1])
