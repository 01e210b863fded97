"""Consumers: an event's effect applied once, however often it is delivered.

* adapters: :mod:`.consumers` (``@idempotent_consumer``), :mod:`.celery` (the
  ``IdempotentConsumer`` task base), :mod:`.django_tasks` (``@idempotent_task``),
  :mod:`.dramatiq` (``@idempotent_actor``); the Kafka
  runner (:mod:`django_idempotency.kafka.runner`) is one too;
* :mod:`.core`: ``try_reserve`` and ``process_event``, which decide (reserve, count the
  delivery, park), with :mod:`.ids` for reading and checking event ids;
* :mod:`.store`: the SQL per backend.
"""
