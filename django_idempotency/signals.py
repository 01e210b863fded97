"""Signals sent for every notable outcome, so projects can count and alert on them.

Each HTTP signal is sent with ``sender`` set to the :class:`~django_idempotency.models.
IdempotencyRecord` class and the keyword arguments ``key``, ``owner`` and ``request``.
Each consumer signal is sent with ``sender`` set to the consumer name and the keyword
arguments ``event_id`` and ``topic``.
"""

from django.dispatch import Signal

#: A completed record was replayed instead of running the view.
record_replayed = Signal()
#: A concurrent duplicate arrived while the first request was in progress (409).
record_conflict = Signal()
#: The key was reused with a different request fingerprint (422).
record_mismatch = Signal()
#: A first execution stored its response.
record_stored = Signal()
#: A consumer skipped an event it had already processed.
event_duplicate = Signal()
#: A consumer parked an event after too many deliveries; also sent with ``deliveries``.
event_parked = Signal()
