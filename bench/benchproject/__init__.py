"""The benchmark's own Django project: one settings module, one variant per server.

``BENCH_VARIANT`` selects what a server process protects its endpoint with:

* ``app``: django-idempotency (``@idempotent``), plus the bare views it is compared with;
* ``dik``: django-idempotency-key (Redis cache storage and the Redis multi-process lock);
* ``drfi``: drf-idempotency (its middleware and its database backend);
* ``drfir``: drf-idempotency with its Redis backend;
* ``drfik``: drf-idempotencykey (its ``DrfIdempotencyKeyMixin`` on a DRF ``APIView``).

Each variant is a separate settings shape because the libraries collide: drf-idempotency reads a
setting named ``IDEMPOTENCY`` too, and the middleware-based ones apply to every view.
"""
