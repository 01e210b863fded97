"""The completer: finish multi-step requests that their client abandoned.

A phased request (``@idempotent(phases=True)``) whose process died, or that raised, keeps its
recovery point in a :class:`~django_idempotency.models.FlowRun`. Once its lease has run out,
:func:`complete_abandoned` rebuilds the request from what the run stored (method, path and query
string, host, body, content type, user, the view's URL arguments) and runs the view's flow again
through the same claim as a retry would: it takes the record over with a new token, resumes at
the first phase not done, and stores the final response, which a late retry gets as a replay.

A run that has raised, or answered an error (a 5xx, or a status that is not stored such as 401,
403, 409 or 429), ``max_attempts`` times is rolled forward to failure instead (its
compensations run, the ``flow-failed`` problem is stored). A pass counts its attempt when it
takes the run over, before any phase runs, so that a run whose resumption kills the
completer's process every time (SIGKILL, the OOM killer, a crash in a C extension) is rolled
forward too, after ``max_attempts`` passes, instead of killing every pass for ever; a pass
that ends with an answer, or with a conflict's ``503``, gives that count back. The
``idempotency_complete`` command and the ``django_idempotency.complete_flows`` Celery task are
thin wrappers.

Limits: the view is called directly, without middleware, session, cookies or headers other
than the content type and the idempotency key; views must be function views.

``request.user`` is the principal the run stored: the model's label and primary key, loaded
again from that model (:func:`load_principal`). When it cannot be, because the label names no
model any more, the row is gone, its primary key no longer matches exactly, it is inactive
(``is_active`` false, where the model has one) or not authenticated, or the run was stored
before the label was (only a primary key: its model is unknown), the run is never resumed as
anyone: it is rolled forward to failure at once, with its compensations, as an anonymous
request (outcome ``refused``). Decorators outside ``@idempotent`` and middleware do not run,
so whatever they check (``@login_required``, permissions, a revoked API key) is not checked
again; see docs/flows.md.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

from django.apps import apps
from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connections
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.test import RequestFactory

from django_idempotency.conf import conf
from django_idempotency.exceptions import (
    PROBLEM_CONTENT_TYPE,
    PROBLEM_TYPE_BASE,
    RequestInProgress,
    log_text,
)
from django_idempotency.flows.phases import get_flow_view, run, stored_view_args
from django_idempotency.http.core import REPLAYED_HEADER, Command
from django_idempotency.managers import DatabaseNow
from django_idempotency.models import FlowRun, IdempotencyRecord
from django_idempotency.outages import connection_lost, describe
from django_idempotency.protection.core import Undecryptable, flow_context, open_value

__all__ = [
    "Completion",
    "abandoned",
    "complete_abandoned",
    "load_principal",
    "rebuild_request",
]

logger = logging.getLogger("django_idempotency")

DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_LIMIT = 100
MAX_LIMIT = 1_000_000
"""The most runs one call handles. A database's ``LIMIT`` overflows far beyond it (SQLite,
PostgreSQL and MariaDB each fail the query), and a million runs is already hours of work."""


@dataclass(frozen=True)
class Completion:
    """What the completer did with one abandoned run."""

    record: int
    key: str
    flow: str
    outcome: str
    """``completed``, ``failed`` (rolled forward), ``replayed`` (someone finished it first),
    ``busy`` (a retry holds it now), ``paused`` (the view returned a 5xx, 401, 403, 409 or
    429 again: counted as an attempt, like a raise), ``raised``,
    ``unavailable`` (its view cannot be found or its request rebuilt) or ``refused`` (its
    principal cannot be loaded as it was, see :func:`load_principal`: rolled forward to
    failure with its compensations, ``detail`` says why)."""
    status: int | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def abandoned(using: str | None = None) -> Any:
    """Runs still in progress whose record's lease has run out, oldest first. A run marked
    ``failed`` whose record is still in progress is one too: it was rolled forward to failure
    and its answer was not stored (the database rolled that back, or the process died), so it
    is rolled forward again and its failure stored."""
    alias = using or conf.DATABASE
    return (
        FlowRun.objects.using(alias)
        .filter(
            state__in=[FlowRun.State.RUNNING, FlowRun.State.FAILED],
            record__state=IdempotencyRecord.State.IN_PROGRESS,
            record__locked_until__lte=DatabaseNow(),
        )
        .select_related("record")
        .order_by("updated_at")
    )


def complete_abandoned(
    *,
    limit: int = DEFAULT_LIMIT,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    using: str | None = None,
) -> list[Completion]:
    """Drive up to ``limit`` abandoned runs to their end; delete runs whose record is gone."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(
            f"limit must be a positive integer of at most {MAX_LIMIT}, not {limit!r}."
        )
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"max_attempts must be a positive integer, not {max_attempts!r}.")
    alias = using or conf.DATABASE
    done = []
    for run_row in abandoned(using)[:limit]:
        done.append(complete_one(run_row, max_attempts=max_attempts))
        _drop_if_lost(alias)
    try:
        delete_orphans(alias)
    except DatabaseError as exc:
        if not connection_lost(connections[alias], exc):
            raise
        # Housekeeping the next pass does again: the runs' outcomes are what this pass reports.
        logger.warning(
            "completer: the database was lost before orphaned runs were deleted, the next "
            "pass deletes them: %s",
            log_text(describe(exc)),
        )
    return done


def _drop_if_lost(alias: str) -> None:
    """Close a connection the run just handled left dead, so that the next run of the pass
    connects again, as the next request would (Django closes, at each request's end, a
    connection that had an error and is unusable; nothing does between the completer's runs):
    ``alias``'s, checked after every run (every later run answered ``503`` on it), and every
    other alias's that had an error (a view's data on another database: every later run
    raised on it, an attempt counted each time). Not inside a caller's transaction, which a
    close would break."""
    for connection in connections.all(initialized_only=True):
        if connection.connection is None or connection.in_atomic_block:
            continue
        if connection.alias != alias and not connection.errors_occurred:
            continue  # no round trip for a connection that had no error
        if connection.is_usable():
            connection.errors_occurred = False  # as Django's check at a request's end
        else:
            connection.close()


def complete_one(run_row: FlowRun, *, max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> Completion:
    record = run_row.record

    def outcome(name: str, status: int | None = None, detail: str = "") -> Completion:
        return Completion(record.pk, record.key, run_row.flow, name, status, detail)

    try:
        view = get_flow_view(run_row.flow)
        request, refusal = _rebuild(run_row, record)
    except (LookupError, ValueError) as exc:
        logger.error(
            "completer cannot finish flow %s (record %s): %s",
            log_text(run_row.flow),
            record.pk,
            log_text(exc),
        )
        return outcome("unavailable", detail=str(exc))
    stored_args = stored_view_args(stored_request(run_row))
    assert stored_args is not None  # rebuild_request refused a run without them
    args, kwargs = stored_args
    command = Command(
        owner=record.owner,
        key=record.key,
        method=record.method,
        path=record.path,
        fingerprint=record.fingerprint,
    )
    if refusal:
        logger.warning(
            "completer refuses to resume flow %s (record %s) and rolls it forward: %s",
            log_text(run_row.flow),
            record.pk,
            log_text(refusal),
        )
    try:
        response = run(
            view,
            request,
            command,
            tuple(args),
            kwargs,
            failing=bool(refusal) or run_row.attempts >= max_attempts,
            refused=bool(refusal),
            count_lost=True,
            count_pass=True,
        )
    except Exception as exc:  # reported, counted on the run, retried next time
        logger.exception(
            "completer: flow %s (record %s) raised", log_text(run_row.flow), record.pk
        )
        return outcome("raised", detail=f"{type(exc).__name__}: {exc}")
    status = response.status_code
    if response.get(REPLAYED_HEADER) == "true":
        return outcome("replayed", status)
    if _in_progress(response):
        return outcome("busy", status)
    alias = run_row._state.db or conf.DATABASE
    try:
        states = (
            FlowRun.objects.using(alias)
            .filter(pk=run_row.pk)
            .values_list("state", "record__state")
            .first()
        )
    except DatabaseError as exc:
        if not connection_lost(connections[alias], exc):
            raise
        # Lost after the run answered (most often its own 503 for the same outage): the run
        # stays as the database has it, and the next pass reads it again. This raised out of
        # the pass, and the outcomes of the runs before it were not reported.
        return outcome("paused", status, detail=describe(exc))
    names = {FlowRun.State.COMPLETED.value: "completed", FlowRun.State.FAILED.value: "failed"}
    name = names.get(str(states[0]), "paused") if states else "paused"
    if states and states[1] != IdempotencyRecord.State.COMPLETED:
        # Marked failed, but its answer was not stored (a conflict, a 503): the next pass
        # rolls it forward again.
        name = "paused"
    if refusal and name == "failed":
        return outcome("refused", status, refusal)
    return outcome(name, status)


def _in_progress(response: HttpResponseBase) -> bool:
    """Whether ``response`` is the claim's own 409 (another run holds the record), not a 409
    the view answered after a phase, which pauses the run and counts as an attempt."""
    if response.status_code != 409 or response.get("Content-Type") != PROBLEM_CONTENT_TYPE:
        return False
    try:
        problem = json.loads(getattr(response, "content", b""))
    except ValueError:
        return False
    return isinstance(problem, dict) and problem.get("type") == IN_PROGRESS_TYPE


IN_PROGRESS_TYPE = PROBLEM_TYPE_BASE + RequestInProgress.slug


def rebuild_request(run_row: FlowRun, record: IdempotencyRecord) -> HttpRequest:
    """The request a flow run was started by, as far as it was stored.

    ``request.user`` is its principal loaded again (:func:`load_principal`), or anonymous when
    the run had none or its principal is refused.
    """
    return _rebuild(run_row, record)[0]


def load_principal(data: dict[str, Any]) -> tuple[Any, str]:
    """The principal a run stored, loaded again: ``(principal, "")`` or ``(None, why not)``.

    A run stores its principal as the model's label (``"principal"``, e.g. ``"auth.user"``)
    and primary key (``"user"``); ``(None, "")`` is a run started anonymously. It is refused
    when the label names no installed model any more (an app renamed, a model removed), no
    row of that model has the key (deleted; or its default manager hides it), the row found
    does not have exactly that key (a case-insensitive or padding collation matched another
    spelling), it is inactive (``is_active`` false, where the model has one), or it is not
    authenticated. A run stored without the label (a principal that is no model instance, or
    a run written by an earlier version, which stored the key alone) is refused too: it may
    have been written for any model an authentication middleware set as ``request.user``, and
    loading it from ``AUTH_USER_MODEL`` resumed an API client's flow as the user with the same
    key.
    """
    pk = data.get("user")
    if pk is None:
        return None, ""
    label = data.get("principal")
    if not label or not isinstance(label, str):
        return None, (
            "the run stored its principal's primary key without its model (a principal that "
            "is no model instance, or a run written before the model was stored), so it "
            "cannot be loaded as the same principal"
        )
    try:
        model = apps.get_model(label)
    except (LookupError, ValueError):
        return None, f"the run's principal model {label!r} is not installed any more"
    try:
        principal = model._default_manager.filter(pk=pk).first()
    except (TypeError, ValueError, ValidationError):  # the key does not fit the model's any more
        principal = None
    if principal is None or str(principal.pk) != str(pk):
        return None, f"the run's principal ({label} {pk!r}) no longer exists"
    if not getattr(principal, "is_active", True):
        return None, f"the run's principal ({label} {pk!r}) is inactive"
    if not getattr(principal, "is_authenticated", False):
        return None, f"the run's principal ({label} {pk!r}) is not authenticated"
    return principal, ""


def _rebuild(run_row: FlowRun, record: IdempotencyRecord) -> tuple[HttpRequest, str]:
    """The stored request, and why its principal is refused ("" when it is not)."""
    data = stored_request(run_row)
    if not data or data.get("view_args") is None:
        raise ValueError("the run did not store its request (its URL arguments are not JSON)")
    if data.get("body") is None:
        raise ValueError(
            "the run did not store its request body (a multipart body over "
            "DATA_UPLOAD_MAX_MEMORY_SIZE): a retry by the client resumes it"
        )
    meta: dict[str, Any] = {"HTTP_" + conf.HEADER.upper().replace("-", "_"): record.key}
    if data.get("host"):
        meta["HTTP_HOST"] = data["host"]
    request = RequestFactory().generic(
        data["method"],
        data["path"],
        data=base64.b64decode(data["body"]),
        content_type=data["content_type"] or "application/octet-stream",
        secure=bool(data["secure"]),
        **meta,
    )
    principal, refusal = load_principal(data)
    request.user = AnonymousUser() if principal is None else principal
    return request, refusal


def stored_request(run_row: FlowRun) -> dict[str, Any]:
    """What the run stored of its request, decrypted if it was stored encrypted
    (:mod:`django_idempotency.protection`); ValueError when no configured key opens it."""
    try:
        data = open_value(run_row.request, flow_context(run_row.record_id, "request"))
    except Undecryptable as error:
        raise ValueError(
            f"the run's stored request cannot be decrypted ({error}): put the key with id "
            f"{error.key_id} back in ENCRYPTION_KEYS to finish it"
        ) from None
    return data if isinstance(data, dict) else {}


def delete_orphans(using: str | None = None, batch_size: int = 1000) -> int:
    """Delete one batch of runs whose record is gone; returns how many.

    The purge and every ORM delete take a record's run with it, and the purge deletes the
    runs whose record was deleted otherwise (in raw SQL, or by a version whose purge kept
    them) in its own batches: this is the same batch, run by the completer too, so that a
    site that schedules only the completer keeps no orphan either.
    """
    alias = using or conf.DATABASE
    _, deleted = FlowRun.objects.using(alias)._delete_batch(alias, batch_size)
    return deleted
