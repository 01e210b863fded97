"""The Celery app the worker tests run: the test project's own app, with its database
connections kept across tasks (Celery's Django fixup otherwise reconnects for every task)."""

from testproject.celery import app

app.conf["CELERY_DB_REUSE_MAX"] = 100_000

__all__ = ["app"]
