"""The database clock: every expiry and lease is decided by the database server's time.

App servers and workers with skewed clocks then agree on what has expired, because none of them
asks its own clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.functions import Now
from django.db.models.sql.compiler import SQLCompiler

if TYPE_CHECKING:
    from django.db.models.sql.compiler import _AsSqlType

__all__ = ["DatabaseNow"]


class DatabaseNow(Now):
    """The database server's current time, compared in UTC on every backend.

    Django's :class:`~django.db.models.functions.Now` is ``CURRENT_TIMESTAMP(6)`` on MySQL,
    which is in the session's time zone, while Django stores naive UTC there; this uses
    ``UTC_TIMESTAMP(6)`` instead. PostgreSQL uses ``STATEMENT_TIMESTAMP()`` and SQLite
    ``'now'``, both already comparable with stored values.
    """

    def as_mysql(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra_context: Any
    ) -> _AsSqlType:
        return self.as_sql(compiler, connection, template="UTC_TIMESTAMP(6)", **extra_context)
