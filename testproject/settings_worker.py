"""The test project's settings without URLs: a worker-only settings module (Celery workers, the
outbox relay, the Kafka runner), as projects often have. ``tests/test_worker_settings.py`` runs
the commands under it."""

from testproject.settings import *  # noqa: F403

del ROOT_URLCONF  # noqa: F821
