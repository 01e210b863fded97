"""Retention: expired records purged in bounded batches, partitions created and dropped.

* :mod:`.purge`: every table's purge (``idempotency_purge``, the ``purge_expired`` task);
* :mod:`.partitioning`: the partitioned layout of processed events
  (``idempotency_partitions``);
* :mod:`.reports`: what a purge or a maintenance run did, and table statistics.
"""
