"""Settings of the benchmark project; ``BENCH_VARIANT`` picks the library under test.

Environment:

* ``BENCH_VARIANT``: ``app`` (default), ``dik``, ``drfi`` or ``drfik`` (see the package doc).
* ``BENCH_DATABASE_URL``: the database, for example
  ``postgres://postgres@127.0.0.1:5432/idempotency_bench_app`` (the runner sets it) or
  ``sqlite:////tmp/bench.sqlite3`` (the smoke test).
* ``BENCH_REDIS_URL``: Redis for django-idempotency-key (default ``redis://127.0.0.1:6379/13``).
* ``BENCH_PGBOUNCER=1``: ``BENCH_DATABASE_URL`` goes through PgBouncer (transaction pooling).

Every variant gets the same middleware in front (statement counting, then a fixed user), the same
view body and the same database settings, so the only difference between two rows is the library.
"""

from __future__ import annotations

import os

import environ

VARIANTS = ("app", "dik", "drfi", "drfir", "drfik")
VARIANT = os.environ.get("BENCH_VARIANT", "app")
if VARIANT not in VARIANTS:
    raise RuntimeError(f"BENCH_VARIANT must be one of {VARIANTS}, not {VARIANT!r}")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")

SECRET_KEY = "bench-not-a-secret"
DEBUG = False  # DEBUG=True keeps every query in memory and slows every row
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "bench.benchproject.urls"
WSGI_APPLICATION = "bench.benchproject.wsgi.application"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "rest_framework",
    "bench.benchproject",
]

# Outermost first: the statement counter sees every query, the library's included.
MIDDLEWARE = [
    "bench.benchproject.middleware.StatementCountMiddleware",
    "bench.benchproject.middleware.BenchUserMiddleware",
]

DATABASE_URL = os.environ.get(
    "BENCH_DATABASE_URL", f"postgres://postgres@127.0.0.1:5432/idempotency_bench_{VARIANT}"
)
DATABASES = {"default": environ.Env.db_url_config(DATABASE_URL)}
if DATABASES["default"]["ENGINE"] != "django.db.backends.sqlite3":
    # Persistent connections, as a production deployment would have (or a pooler).
    DATABASES["default"]["CONN_MAX_AGE"] = 600
else:
    DATABASES["default"].setdefault("OPTIONS", {}).update({"timeout": 20})
if DATABASES["default"]["ENGINE"] == "django.db.backends.mysql":
    # The app's documented MariaDB settings (docs/installation.md).
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"charset": "utf8mb4", "isolation_level": "read committed"}
    )
if os.environ.get("BENCH_PGBOUNCER") == "1":
    # Behind PgBouncer in transaction pooling mode, as Django's docs require.
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["bench.benchproject.middleware.BenchAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": [],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "UNAUTHENTICATED_USER": None,
}

if VARIANT == "app":
    INSTALLED_APPS.append("django_idempotency")
    IDEMPOTENCY: dict[str, object] = {}  # every default
elif VARIANT == "dik":
    # django-idempotency-key's production shape from its README: a shared cache as storage
    # (MemoryKeyStorage is per process) and MultiProcessRedisLock (ThreadLock is per process).
    MIDDLEWARE.append("idempotency_key.middleware.ExemptIdempotencyKeyMiddleware")
    CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "idempotency": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "TIMEOUT": 24 * 3600,
        },
    }
    IDEMPOTENCY_KEY = {
        "STORAGE": {
            "CLASS": "idempotency_key.storage.CacheKeyStorage",
            "CACHE_NAME": "idempotency",
        },
        "LOCK": {
            "CLASS": "idempotency_key.locks.redis.MultiProcessRedisLock",
            "LOCATION": REDIS_URL,
            "NAME": "bench-idempotency-lock",
            "TTL": 300,
            # The documented default is 0.1 s; BENCH_DIK_LOCK_TIMEOUT tries others.
            "TIMEOUT": float(os.environ.get("BENCH_DIK_LOCK_TIMEOUT", "0.1")),
        },
    }
elif VARIANT == "drfi":
    # drf-idempotency's Quick Start: the project-wide middleware and the database backend.
    INSTALLED_APPS.append("drf_idempotency")
    MIDDLEWARE.append("drf_idempotency.middleware.IdempotencyMiddleware")
    IDEMPOTENCY = {"BACKEND": "drf_idempotency.backends.database.DatabaseBackend"}
elif VARIANT == "drfir":
    # drf-idempotency with the backend its docs recommend under load: Redis (SET NX).
    INSTALLED_APPS.append("drf_idempotency")
    MIDDLEWARE.append("drf_idempotency.middleware.IdempotencyMiddleware")
    IDEMPOTENCY = {
        "BACKEND": "drf_idempotency.backends.redis.RedisBackend",
        "BACKEND_OPTIONS": {"url": REDIS_URL, "key_prefix": "bench-drf-idempotency:"},
    }
elif VARIANT == "drfik":
    # drf-idempotencykey's Quick Start: the mixin on an APIView (it needs an authenticated user).
    INSTALLED_APPS.append("drf_idempotencykey")
