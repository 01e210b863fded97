"""Benchmarks for django-idempotency: ``scripts/bench.sh`` (``make bench``) runs them all.

Not part of the package or of ``make test``. See ``docs/benchmarks.md``.
"""
