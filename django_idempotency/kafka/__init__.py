"""Kafka, both ways (the ``kafka`` extra, confluent-kafka).

* :mod:`.runner`: the consumer loop behind ``manage.py idempotency_consume``: each message's
  effect once, its offset committed after the database commit, poison dead-lettered;
* :mod:`.settings`: ``IDEMPOTENCY["KAFKA_CONSUMERS"]``, parsed and checked;
* :mod:`.transport`: ``KafkaTransport``, the outbox relay's way to Kafka.
"""
