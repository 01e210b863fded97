"""The optional dependencies: which extra of ``django-idempotency`` installs each one.

The package itself needs only Django and asgiref. A module that needs more imports it through
:func:`missing_extra`, so a missing dependency fails with an ``ImportError`` that says what to
install::

    try:
        from celery import shared_task
    except ImportError as error:
        raise missing_extra("celery", __name__) from error
"""

from __future__ import annotations

__all__ = ["EXTRAS", "missing_extra"]

#: Each extra and what it brings (setup.cfg's ``[options.extras_require]`` holds the versions).
EXTRAS = {
    "celery": "Celery",
    "redis": "Celery with its Redis transport",
    "kafka": "confluent-kafka",
    "drf": "Django REST framework",
    "ninja": "django-ninja",
    "dramatiq": "Dramatiq",
    "tasks": "the django-tasks backport of django.tasks (Django 5.2 only)",
    "postgres": "psycopg 3",
    "mysql": "mysqlclient",
    "crypto": "cryptography",
}


def missing_extra(extra: str, module: str) -> ImportError:
    """The error to raise when ``module`` cannot import the dependency that ``extra`` installs."""
    return ImportError(
        f"{module} needs {EXTRAS[extra]}, which is not installed: "
        f"pip install 'django-idempotency[{extra}]'"
    )
