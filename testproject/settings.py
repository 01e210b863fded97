"""Settings of the test project, shared by the demo and the test suite.

Configured from the environment with django-environ:

* ``DATABASE_URL``: SQLite by default (``testproject/db.sqlite3``); for example
  ``postgres://postgres@127.0.0.1:5432/idempotency`` or ``mysql://root@127.0.0.1:3306/idempotency``.
* ``CELERY_BROKER_URL``: unset means Celery runs tasks eagerly in the web process; set it
  (``redis://127.0.0.1:6379/0``, ``amqp://guest:guest@127.0.0.1:5672//``) to use a real broker.
* ``PSP_URL``: the payment provider the ride checkout (``testproject/shop/rides.py``) charges;
  the tests start a fake one (``tests/psp.py``).
* ``TEST_DB_SUFFIX``: appended to test database names so parallel runs do not collide.
* ``TASKS_BACKEND``: the default Django Tasks backend. ``immediate`` (the default) runs a task
  when it is enqueued, in the same process; ``database`` stores it for ``manage.py db_worker``
  (needs django-tasks-db). The ``database`` alias exists whenever django-tasks-db is installed.

* ``PGBOUNCER=1``: ``DATABASE_URL`` points at PgBouncer in transaction pooling mode
  (``scripts/pgbouncer.sh``); the test database is dropped after its server connections are
  closed (tests/conftest.py).

* ``IDEMPOTENCY_OUTBOX_TRANSPORTS``: ``IDEMPOTENCY["OUTBOX_TRANSPORTS"]`` as JSON (optional).
* ``IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS``: ``IDEMPOTENCY["OUTBOX_MAX_ATTEMPTS"]`` (optional).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent
env = environ.Env()

SECRET_KEY = env("DJANGO_SECRET_KEY", default="testproject-not-a-secret")
DEBUG = env.bool("DJANGO_DEBUG", default=True)
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "testserver"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",  # DRF token owners (tests/test_cross_principal.py)
    "django_idempotency",
    "testproject.shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "testproject.urls"
WSGI_APPLICATION = "testproject.wsgi.application"
ASGI_APPLICATION = "testproject.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

TEST_DB_SUFFIX = env("TEST_DB_SUFFIX", default="")
DATABASES = {
    "default": env.db_url_config(
        env("DATABASE_URL", default="") or f"sqlite:///{BASE_DIR / 'db.sqlite3'}"
    ),
}
_default_db = DATABASES["default"]
if _default_db["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not memory: races, gunicorn workers and Celery workers share the test database.
    _default_db["TEST"] = {"NAME": str(BASE_DIR / f"test_db{TEST_DB_SUFFIX}.sqlite3")}
    _default_db.setdefault("OPTIONS", {}).update({"timeout": 20})
else:
    _default_db["TEST"] = {"NAME": f"test_idempotency{TEST_DB_SUFFIX}"}
if env.bool("PGBOUNCER", default=False):
    # Behind PgBouncer in transaction pooling mode (the `pooler` test pass): a server-side
    # cursor would outlive the transaction that declared it (Django's docs on transaction
    # pooling). Prepared statements stay off: Django leaves psycopg's prepare_threshold unset.
    _default_db["DISABLE_SERVER_SIDE_CURSORS"] = True
if _default_db["ENGINE"] == "django.db.backends.mysql":
    _default_db.setdefault("OPTIONS", {}).update(
        {"charset": "utf8mb4", "isolation_level": "read committed"}
    )
    _default_db["TEST"].update({"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"})
# A second alias on the same server, for consumers that write with using="other" (the purge
# tests); a test that uses it asks for it with databases=["default", "other"].
DATABASES["other"] = {
    **_default_db,
    "TEST": {
        **_default_db["TEST"],
        "NAME": str(_default_db["TEST"]["NAME"]).replace("test_", "test_other_", 1),
    },
}
# The test database again, through connections at REPEATABLE READ, as OPTIONS sets it (the
# isolation tests: tests/test_first_delivery_isolation.py); a test asks for it with
# databases=["default", "repeatable_read"]. SQLite has no isolation levels to choose.
if _default_db["ENGINE"] != "django.db.backends.sqlite3":
    _repeatable_options = dict(_default_db.get("OPTIONS", {}))
    if _default_db["ENGINE"] == "django.db.backends.mysql":
        _repeatable_options["isolation_level"] = "repeatable read"
    else:
        try:
            from psycopg import IsolationLevel

            _repeatable_options["isolation_level"] = IsolationLevel.REPEATABLE_READ
        except ImportError:  # psycopg2 (tests/test_relay_psycopg2.py hides psycopg 3)
            from psycopg2.extensions import (  # type: ignore[import-untyped]
                ISOLATION_LEVEL_REPEATABLE_READ,
            )

            _repeatable_options["isolation_level"] = ISOLATION_LEVEL_REPEATABLE_READ
    DATABASES["repeatable_read"] = {
        **_default_db,
        "OPTIONS": _repeatable_options,
        "TEST": {**_default_db["TEST"], "MIRROR": "default"},
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS: list[dict[str, str]] = []
# Django's default hashers, and MD5 last, so that every process of a test run (gunicorn, Celery
# and Kafka workers started by the tests) can check the passwords the tests set. Under pytest
# MD5 comes first: PBKDF2's 1,000,000 iterations cost about 0.3 s of CPU for each password set
# or checked, and the admin and DRF tests (basic authentication on every request) set and check
# hundreds (tests/test_admin.py and tests/test_http_drf.py: 37 s of CPU, 2026-12-01). Never do
# this in a real project: MD5 is fit only for test passwords.
PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2SHA1PasswordHasher",
    "django.contrib.auth.hashers.Argon2PasswordHasher",
    "django.contrib.auth.hashers.BCryptSHA256PasswordHasher",
    "django.contrib.auth.hashers.ScryptPasswordHasher",
    "django.contrib.auth.hashers.MD5PasswordHasher",
]
if "pytest" in sys.modules:
    PASSWORD_HASHERS.insert(0, PASSWORD_HASHERS.pop())
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "static"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.BasicAuthentication",
    ],
    "UNAUTHENTICATED_USER": None,
}

IDEMPOTENCY: dict[str, object] = {}
# The outbox's transports, as JSON (the outbox proofs start relays with their own).
if env("IDEMPOTENCY_OUTBOX_TRANSPORTS", default=""):
    IDEMPOTENCY["OUTBOX_TRANSPORTS"] = json.loads(env("IDEMPOTENCY_OUTBOX_TRANSPORTS"))
if env("IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS", default=""):
    IDEMPOTENCY["OUTBOX_MAX_ATTEMPTS"] = env.int("IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS")

PSP_URL = env("PSP_URL", default="http://127.0.0.1:8010")

# The trace proofs (tests/test_telemetry_traces.py): every span of this process, as JSON lines.
if env("IDEMPOTENCY_SPANS_FILE", default=""):
    from testproject.otel import export_spans_to

    export_spans_to(
        env("IDEMPOTENCY_SPANS_FILE"),
        env("IDEMPOTENCY_SPANS_SERVICE", default="app"),
        celery=env.bool("IDEMPOTENCY_SPANS_CELERY", default=False),
    )

# The Kafka consumer of the Kafka tests (tests/test_kafka_runner.py), which set these variables.
if env("SHOP_KAFKA_BOOTSTRAP", default=""):
    shop_kafka: dict[str, object] = {
        "HANDLER": "testproject.shop.kafka_handlers.apply",
        "TOPICS": env.list("SHOP_KAFKA_TOPICS"),
        "GROUP": env("SHOP_KAFKA_GROUP"),
        "CONFIG": {
            "bootstrap.servers": env("SHOP_KAFKA_BOOTSTRAP"),
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
        },
        "EVENT_ID": env("SHOP_KAFKA_EVENT_ID", default="header:event_id"),
        "MAX_DELIVERIES": 3,
        "RETRY_DELAY": 0.2,
        "POLL_TIMEOUT": 0.2,
        "COMMIT_INTERVAL": env.float("SHOP_KAFKA_COMMIT_INTERVAL", default=0.0),
        "BATCH_SIZE": env.int("SHOP_KAFKA_BATCH_SIZE", default=1),
    }
    if env("SHOP_KAFKA_HANDLER_TIMEOUT", default=""):  # the hang tests: a short one
        shop_kafka["HANDLER_TIMEOUT"] = env.float("SHOP_KAFKA_HANDLER_TIMEOUT")
    IDEMPOTENCY["KAFKA_CONSUMERS"] = {"shop.kafka": shop_kafka}

CELERY_BROKER_URL = env("CELERY_BROKER_URL", default="")
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=not CELERY_BROKER_URL)
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_RESULT_BACKEND = env("CELERY_RESULT_BACKEND", default=None)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# The serializers a worker takes (the parity proofs of tests/test_celery_call_parity.py start
# theirs with json,pickle,yaml).
CELERY_ACCEPT_CONTENT = env.list("CELERY_ACCEPT_CONTENT", default=["json"])
# Purge expired idempotency records, processed events and delivery counters every 15 minutes
# (run `celery -A testproject beat`); see docs/operations.md.
CELERY_BEAT_SCHEDULE = {
    "idempotency-purge": {
        "task": "django_idempotency.purge_expired",
        "schedule": timedelta(minutes=15),
    },
    # Finish phased requests whose client gave up (docs/flows.md).
    # --8<-- [start:complete-flows]
    "idempotency-complete-flows": {
        "task": "django_idempotency.complete_flows",
        "schedule": timedelta(minutes=1),
    },
    # --8<-- [end:complete-flows]
}

# Django Tasks: django.tasks on Django 6.0+, the django-tasks backport on Django 5.2 (which is
# also an app). django-tasks-db, when installed, adds the "database" backend and its worker,
# `python manage.py db_worker --backend database`. Without either, the settings still load and
# the demo runs: only testproject/shop/tasks_django.py needs a tasks framework.
TASKS_MODULE = next((name for name in ("django.tasks", "django_tasks") if find_spec(name)), "")
if TASKS_MODULE:
    if TASKS_MODULE == "django_tasks":
        INSTALLED_APPS.append("django_tasks")
    TASKS: dict[str, dict[str, object]] = {
        "immediate": {"BACKEND": f"{TASKS_MODULE}.backends.immediate.ImmediateBackend"},
    }
    if find_spec("django_tasks_db"):
        INSTALLED_APPS.append("django_tasks_db")
        TASKS["database"] = {"BACKEND": "django_tasks_db.DatabaseBackend"}
    _tasks_backend = env("TASKS_BACKEND", default="immediate")
    if _tasks_backend not in TASKS:
        raise ImproperlyConfigured(
            f"TASKS_BACKEND={_tasks_backend!r}: choose one of {sorted(TASKS)} "
            "(database needs `pip install django-tasks-db`)."
        )
    TASKS["default"] = TASKS[_tasks_backend]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django_idempotency": {
            "handlers": ["console"],
            "level": env("IDEMPOTENCY_LOG_LEVEL", default="INFO"),
        },
    },
}
