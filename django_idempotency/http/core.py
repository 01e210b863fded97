"""The one place that decides what happens to a request that carries an idempotency key.

It knows nothing of ``HttpRequest`` or ``HttpResponse``: an adapter (the decorator and the
middleware, through :mod:`django_idempotency.http.handler`, or another framework) describes the
request
as a :class:`Command`, and gives :meth:`Idempotency.run` two callables, one that runs the view and
one that turns its result into a :class:`Captured` response. The core then:

1. claims ``(owner, key)`` through the unique index (:class:`~django_idempotency.http.store.
   RecordStore`), which never waits on another request;
2. for a completed record, returns a :class:`Replay` (same fingerprint) or raises
   :class:`~django_idempotency.exceptions.KeyReused` (different one) or
   :class:`~django_idempotency.exceptions.ResponseNotStored` (the response was not storable);
3. for a record another request is running, raises
   :class:`~django_idempotency.exceptions.RequestInProgress` (409, ``Retry-After``), or first
   waits up to ``WAIT`` seconds for it to finish and replays;
4. otherwise runs the view and stores its response.

Atomic mode (the default): the claim, the view and the storing of the response run in **one**
``transaction.atomic`` on ``IDEMPOTENCY["DATABASE"]``. If the view raises, everything rolls
back, record included. A crash rolls back too, so a key is never stuck.

Lease mode (``lease=timedelta``): for views that call other systems and should not hold a
transaction open meanwhile. The claim commits first, ``in_progress`` with ``locked_until = now +
lease`` and a fresh ownership token. The view runs in its own transaction, which ends by storing
the response with a compare-and-swap on the token. After a crash the claim stays until the lease
runs out; the next retry then takes it over with a new token. If the first holder wakes up
later, its compare-and-swap fails: its transaction (the view's database writes included) rolls
back and its client gets a 409, so it can never overwrite the new holder's result.

Why this module is long: every outcome of a claim (replay, reuse, wait, take-over, erased,
undecryptable, database unavailable, a save the database rolled back) is decided here, in one
state machine over one record; splitting the outcomes over files would hide which of them a
request can reach.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, transaction

from django_idempotency import signals, telemetry
from django_idempotency.conf import conf
from django_idempotency.exceptions import (
    DatabaseUnavailable,
    KeyReused,
    RequestInProgress,
    ResponseNotStored,
    StaleClaim,
    log_text,
)
from django_idempotency.http.owner import display_owner
from django_idempotency.http.store import ClaimResult, ClaimValues, Existing, RecordStore
from django_idempotency.models import IdempotencyRecord
from django_idempotency.outages import describe
from django_idempotency.protection import core as protection

logger = logging.getLogger("django_idempotency")

R = TypeVar("R")
T = TypeVar("T")

#: Key in ``response_headers`` marking a record whose response could not be stored. Header
#: names cannot contain ``@``, so it never collides with a real header.
NOT_REPLAYABLE = "@not-replayable"
REPLAYED_HEADER = "Idempotent-Replayed"

_FIRST_POLL = 0.05
_MAX_POLL = 0.5


@dataclass(frozen=True)
class Command:
    """One request that carries an idempotency key, as the core sees it."""

    owner: str
    key: str
    method: str
    path: str
    fingerprint: str


@dataclass(frozen=True)
class Policy:
    """How the core treats a request. :meth:`from_settings` fills it from ``IDEMPOTENCY``."""

    using: str = "default"
    ttl: timedelta = timedelta(hours=24)
    lease: timedelta | None = None
    """None: atomic mode. A duration: lease mode."""
    wait: float = 0.0
    retry_after: int = 1
    unstored_statuses: frozenset[int] = frozenset({401, 403, 408, 409, 425, 429})
    rollback_on_server_error: bool = True

    @classmethod
    def from_settings(
        cls, *, ttl: timedelta | None = None, atomic: bool = True, lease: timedelta | None = None
    ) -> Policy:
        return cls(
            using=conf.DATABASE,
            ttl=ttl or conf.RECORD_TTL,
            lease=None if atomic else (lease or conf.LEASE),
            wait=conf.WAIT,
            retry_after=conf.RETRY_AFTER,
            unstored_statuses=conf.UNSTORED_STATUSES,
            rollback_on_server_error=conf.ROLLBACK_ON_SERVER_ERROR,
        )


@dataclass(frozen=True)
class Captured:
    """A view's response, described so that the core can decide whether and what to store."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    """Only the headers safe to replay."""
    body: bytes | None = b""
    """None when the response cannot be stored (streaming, or too large)."""
    not_replayable_reason: str = ""


@dataclass(frozen=True)
class Replay:
    """A stored response, to send instead of running the view again."""

    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class _Claim:
    """A record this request owns, and the transaction the view runs in."""

    record_id: int | None
    """None until the record is written, for a deferred claim (see ``deferred``)."""
    token: uuid.UUID
    atomic: Any
    deferred: ClaimValues | None = None
    """The claim wrote no record (PostgreSQL, atomic mode, a new key): storing the response
    writes it (:attr:`~django_idempotency.http.store.ClaimResult.deferred`)."""
    replaced: bool = False
    """The claim took over a record that had completed and whose TTL ran out: the key counts as
    new, and whatever its earlier request left (a phased flow's run) is not this request's."""


class Idempotency:
    """The core. One instance per request (it is cheap); see the module docstring.

    Call :meth:`run` from synchronous code and :meth:`arun` from asynchronous code. Both return
    the view's own result, or a :class:`Replay`, or raise a
    :class:`~django_idempotency.exceptions.ProblemError` for the client.
    """

    def __init__(self, policy: Policy, *, request: Any = None) -> None:
        self.policy = policy
        self.request = request
        self.store = RecordStore(policy.using)

    # -- entry points -----------------------------------------------------------------------

    def run(
        self, command: Command, view: Callable[[], R], capture: Callable[[R], Captured]
    ) -> R | Replay:
        deadline = time.monotonic() + self.policy.wait
        delay = _FIRST_POLL
        while True:
            step = self._begin(command, final=time.monotonic() >= deadline)
            if step is not None:
                break
            time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, _MAX_POLL)
        if isinstance(step, Replay):
            return step
        try:
            result = view()
            captured = capture(result)
        except BaseException:
            self._abandon(command, step, sys.exc_info())
            raise
        self._finish(command, step, captured)
        return result

    async def arun(
        self,
        command: Command,
        view: Callable[[], Awaitable[R]],
        capture: Callable[[R], Captured],
    ) -> R | Replay:
        """Like :meth:`run`, for an ``async def`` view.

        The database work runs through ``sync_to_async(thread_sensitive=True)``, so it shares
        one thread (and so one connection and one transaction) with the view's own ORM calls.
        """
        deadline = time.monotonic() + self.policy.wait
        delay = _FIRST_POLL
        while True:
            final = time.monotonic() >= deadline
            step = await self._settle(command, self._begin, command, final=final)
            if step is not None:
                break
            await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, _MAX_POLL)
        if isinstance(step, Replay):
            return step
        try:
            result = await view()
            captured = await sync_to_async(capture, thread_sensitive=True)(result)
        except BaseException:
            await self._settle(command, self._abandon, command, step, sys.exc_info())
            raise
        await self._settle(command, self._finish, command, step, captured)
        return result

    async def _settle(
        self, command: Command, step: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """Run a database step on the request's sync thread, and let it settle if cancelled.

        A thread cannot be interrupted: if the request is cancelled (the client went away)
        while a step runs, the step still finishes. This waits for it before re-raising, and
        abandons a claim it made, so no transaction is ever left open on the connection.
        """
        task = asyncio.ensure_future(sync_to_async(step, thread_sensitive=True)(*args, **kwargs))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            claim = None if task.cancelled() or task.exception() else task.result()
            if isinstance(claim, _Claim):
                abandon = sync_to_async(self._abandon, thread_sensitive=True)
                await abandon(command, claim, sys.exc_info())
            raise

    # -- steps --------------------------------------------------------------------------------

    def _begin(self, command: Command, *, final: bool) -> _Claim | Replay | None:
        """Claim the key. Returns a claim (the view may run), a replay, or None to wait more.

        In atomic mode a returned claim holds an open ``transaction.atomic``; in lease mode the
        claim is committed and the view's own transaction is open.
        """
        lease = self.policy.lease
        connection = connections[self.policy.using]
        if lease is not None and connection.in_atomic_block:
            raise ImproperlyConfigured(
                "@idempotent(atomic=False) commits its claim before the view runs, so it cannot "
                f"run inside a transaction on database {self.policy.using!r}. With "
                "ATOMIC_REQUESTS = True, also decorate the view with "
                "@transaction.non_atomic_requests."
            )
        token = uuid.uuid4()
        atomic = transaction.atomic(using=self.policy.using)
        # The span and the duration cover the transaction's start too: on MariaDB it is a round
        # trip of its own (autocommit off), and it is where a dead connection is met first.
        lost: BaseException | None = None
        try:
            with telemetry.timed("claim"):
                try:
                    atomic.__enter__()  # opens the connection if need be
                except DatabaseError as exc:
                    lost = exc if self.store.unreachable(exc) else None
                    raise
                try:
                    result = self.store.claim(
                        owner=command.owner,
                        key=command.key,
                        fingerprint=command.fingerprint,
                        method=command.method,
                        path=command.path,
                        token=token,
                        ttl=self.policy.ttl,
                        lease=lease,
                    )
                except BaseException as exc:
                    lost = exc if self.store.unreachable(exc) else None
                    try:
                        atomic.__exit__(*sys.exc_info())
                    except DatabaseError:
                        if lost is None:
                            raise
                    raise
        except BaseException:
            if lost is not None:  # outside the claim's span, which ended with the error
                self._unavailable(command, lost)
            raise
        if not result.claimed:
            atomic.__exit__(None, None, None)
            if result.busy:
                self._unavailable(command, None, result.cause)
            return self._refuse(command, result, final=final)
        if result.existing is not None:
            self._log(command, "taken_over", record=result.record_id)
        if lease is not None:
            try:
                atomic.__exit__(None, None, None)  # commit the claim; the view gets its own
                atomic = transaction.atomic(using=self.policy.using)
                atomic.__enter__()
            except DatabaseError as exc:
                # The claim's COMMIT (or the view's BEGIN) lost the database. The claim may
                # have committed: a retry with the same key gets 409 until its lease runs out,
                # then takes it over.
                if self.store.unreachable(exc):
                    self._unavailable(command, exc)
                raise
        replaced = result.existing is not None and result.existing.completed
        return _Claim(result.record_id, token, atomic, result.deferred, replaced)

    def _unavailable(
        self,
        command: Command,
        exc: BaseException | None,
        busy: str = "",
        *,
        saving: bool = False,
    ) -> None:
        """Raise :class:`DatabaseUnavailable` (503, ``Retry-After``) for ``exc``, an error that
        says the database cannot be reached (:meth:`RecordStore.unreachable`), or, with ``exc``
        None, for a claim too busy to take the key's lock (MariaDB, :attr:`ClaimResult.busy`).

        ``saving``: the view ran, and the database was lost while its response was stored or
        its transaction committed (a COMMIT whose answer never came may have taken effect).
        Either way a retry with the same key is right: it replays what committed, or runs a
        request that did not.

        One WARNING line names the cause; the traceback goes to DEBUG.
        """
        if exc is None:
            cause = busy or "another transaction's lock stayed in the way"
        else:
            cause = describe(exc)
            self._drop_lost_connection()
        self._log(
            command, "unavailable", level=logging.WARNING, database=self.policy.using, cause=cause
        )
        if exc is not None:
            logger.debug("idempotency: the claim's database error", exc_info=exc)
        # The cause stays in the log: a driver's message names hosts, ports and databases.
        if saving:
            raise DatabaseUnavailable(
                "The database was lost while this request's result was being saved, so whether "
                "it took effect is unknown. Retry with the same idempotency key after the delay "
                "in the Retry-After header: a result that was saved is replayed, a request that "
                "was not runs again.",
                retry_after=self.policy.retry_after,
            ) from exc
        reason = "was too busy to claim" if exc is None else "could not be reached to claim"
        raise DatabaseUnavailable(
            f"The database {reason} this idempotency key. Nothing was run; retry with the same "
            "key after the delay in the Retry-After header.",
            retry_after=self.policy.retry_after,
        ) from exc

    def _drop_lost_connection(self) -> None:
        """The connection to :attr:`Policy.using` was lost: leave it so that the next query on
        this thread (this request's, or the next request's) opens a new one."""
        connection = connections[self.policy.using]
        if connection.in_atomic_block:
            # The caller's transaction (ATOMIC_REQUESTS) must roll back, not fail its COMMIT
            # (a 500 after this 503); its failed ROLLBACK drops the connection.
            connection.needs_rollback = True
        else:
            # Drop the dead connection now (MySQLdb's rollback does not notice it is
            # gone), so the next query on this thread opens a new one instead of failing
            # with "server has gone away".
            connection.close()

    @contextmanager
    def request_transaction(self, command: Command) -> Iterator[None]:
        """The request's transaction (``ATOMIC_REQUESTS``), opened here instead of by Django
        (:func:`~django_idempotency.http.handler.request_transaction`): a database that cannot
        be reached then is answered as at the claim (503), not with Django's 500."""
        atomic = transaction.atomic(using=self.policy.using)
        try:
            atomic.__enter__()
        except DatabaseError as exc:
            if self.store.unreachable(exc):
                self._unavailable(command, exc)
            raise
        try:
            yield
        except BaseException:
            atomic.__exit__(*sys.exc_info())
            raise
        self._commit(command, atomic)

    def _refuse(self, command: Command, result: ClaimResult, *, final: bool) -> Replay | None:
        existing = result.existing
        if existing and not existing.expired and protection.ERASED in existing.response_headers:
            return self._replay(command, existing)  # no fingerprint left to compare: 410
        if (
            existing is not None
            and not existing.expired
            and existing.fingerprint != command.fingerprint
        ):
            self._log(command, "mismatch", record=existing.id)
            signals.record_mismatch.send(IdempotencyRecord, **self._signal_kwargs(command))
            raise KeyReused(
                "This idempotency key was already used for a different request (method, path or "
                "body). Use a new key for a new request."
            )
        if existing is not None and existing.completed and not existing.expired:
            return self._replay(command, existing)
        if not final:
            return None
        self._log(command, "conflict", record=existing.id if existing else None)
        signals.record_conflict.send(IdempotencyRecord, **self._signal_kwargs(command))
        raise RequestInProgress(
            "A request with this idempotency key is still being processed. Retry after the "
            "delay in the Retry-After header to get its result.",
            retry_after=self.policy.retry_after,
        )

    def _replay(self, command: Command, existing: Existing) -> Replay:
        stored, body = existing.response_headers, existing.response_body
        try:  # sealed or erased (django_idempotency.protection): opened, or a problem
            if protection.protected(stored):
                stored, body = protection.open_response(
                    command.owner, command.key, stored, body, status=existing.response_status
                )
        except (protection.Erased, protection.Undecryptable) as error:
            lost = isinstance(error, protection.Undecryptable)  # an operator's doing: ERROR
            outcome, level = ("undecryptable", logging.ERROR) if lost else ("erased", logging.INFO)
            extra = {"record": existing.id, "key_id": getattr(error, "key_id", None)}
            self._log(command, outcome, level=level, **extra)
            raise protection.replay_problem(error, existing.response_status) from None
        headers = dict(stored)
        reason = headers.pop(NOT_REPLAYABLE, None)
        if reason is not None or body is None:
            self._log(command, "not_replayable", record=existing.id)
            raise ResponseNotStored(
                "The request with this idempotency key was already processed, but its response "
                f"was not stored ({reason or 'no body'}), so it cannot be replayed. Do not "
                "retry it; look the result up instead.",
                original_status=existing.response_status,
            )
        self._log(command, "replayed", record=existing.id)
        signals.record_replayed.send(IdempotencyRecord, **self._signal_kwargs(command))
        return Replay(
            status=existing.response_status or 200,
            headers={**headers, REPLAYED_HEADER: "true"},
            body=body,
        )

    def _finish(self, command: Command, claim: _Claim, captured: Captured) -> None:
        """Store or drop the response, then end the view's transaction."""
        policy = self.policy
        release_after = False
        try:
            self._before_store(claim)
            # A view that marked its block for rollback (transaction.set_rollback) without
            # raising gets the same as a server error: nothing of it commits, and the key is free.
            marked = transaction.get_rollback(using=policy.using)
            if marked or (captured.status >= 500 and policy.rollback_on_server_error):
                outcome = "rolled_back"
                transaction.set_rollback(True, using=policy.using)
                release_after = policy.lease is not None
            elif captured.status >= 500 or captured.status in policy.unstored_statuses:
                outcome = "released"
                self.store.release(claim.record_id, claim.token, deferred=claim.deferred)
            else:
                outcome = "stored" if captured.body is not None else "stored_not_replayable"
                headers = dict(captured.headers)
                if captured.body is None:
                    headers[NOT_REPLAYABLE] = captured.not_replayable_reason or "not stored"
                headers, body = protection.stored_response(
                    command.owner, command.key, headers, captured.body, status=captured.status
                )
                with telemetry.timed("store"):
                    claim.record_id = self.store.complete(
                        claim.record_id,
                        claim.token,
                        status=captured.status,
                        headers=headers,
                        body=body,
                        commit=True,  # leaving claim.atomic, next, commits
                        deferred=claim.deferred,
                    )
        except StaleClaim:
            transaction.set_rollback(True, using=policy.using)
            claim.atomic.__exit__(None, None, None)
            self._log(command, "stale", record=claim.record_id, level=logging.ERROR)
            raise RequestInProgress(
                "This request's lease ran out and a retry took it over; its changes were rolled "
                "back. Retry after the delay in the Retry-After header to get the result.",
                retry_after=policy.retry_after,
            ) from None
        except DatabaseError as exc:
            lost = self.store.unreachable(exc)
            try:
                claim.atomic.__exit__(*sys.exc_info())
            except DatabaseError:
                if not lost:
                    raise
            if lost:
                self._unavailable(command, exc, saving=True)
            if self.store.conflicted(exc):
                self._rolled_back_by_database(command, exc, claim)
            raise
        except BaseException:
            claim.atomic.__exit__(*sys.exc_info())
            raise
        self._commit(command, claim.atomic, claim)
        if release_after:
            self._release_quietly(command, claim)
        self._log(command, outcome, record=claim.record_id, status=captured.status)
        if outcome.startswith("stored"):
            signals.record_stored.send(IdempotencyRecord, **self._signal_kwargs(command))

    def _before_store(self, claim: _Claim) -> None:
        """Writes of a subclass in the view's transaction, before its response is stored (a
        phased flow's state), whose database errors :meth:`_finish` answers as its own."""

    def _commit(self, command: Command, atomic: Any, claim: _Claim | None = None) -> None:
        """Leave the view's transaction (its COMMIT, or a savepoint's release under
        ``ATOMIC_REQUESTS``); a lost database there is a 503, not the driver's error, and so is
        a COMMIT the database refused (a serialization failure), which rolled it all back.
        ``claim`` is the request's claim, None for the request's own transaction."""
        try:
            atomic.__exit__(None, None, None)
        except DatabaseError as exc:
            self._saving_failed(command, exc, claim)
            raise

    def _saving_failed(self, command: Command, exc: DatabaseError, claim: _Claim | None) -> None:
        """The view ran, and saving its outcome (or the COMMIT) raised ``exc``, its transaction
        already left: raise the ``503`` of a lost database (:meth:`_unavailable`, the outcome
        unknown) or of a conflict that rolled it back (:meth:`_rolled_back_by_database`).
        Returns for any other error, which the caller raises."""
        if self.store.unreachable(exc):
            self._unavailable(command, exc, saving=True)
        if self.store.conflicted(exc):
            self._rolled_back_by_database(command, exc, claim)

    def _rolled_back_by_database(
        self, command: Command, exc: Exception, claim: _Claim | None
    ) -> NoReturn:
        """The view ran, but storing its response (or the COMMIT) failed on a live connection
        because of another transaction (:meth:`RecordStore.conflicted`: a deadlock's victim, a
        serialization failure, a lock wait that ran out), and the view's transaction, already
        left, rolled back with the claim: nothing of the request took effect. Raise
        :class:`DatabaseUnavailable` (503, ``Retry-After``), not the driver's error (a 500): a
        retry with the same key runs the request again. A lease-mode claim, committed on its
        own, is released first, so that retry runs at once instead of meeting ``409`` until the
        lease runs out.

        One WARNING line (``unavailable``) names the cause; the traceback goes to DEBUG.
        """
        if claim is not None and self.policy.lease is not None:
            self._release_quietly(command, claim)
        connection = connections[self.policy.using]
        if connection.in_atomic_block:
            # ATOMIC_REQUESTS: the caller's transaction must roll back too (MariaDB's deadlock
            # victim lost it all already), not fail at its COMMIT with a 500 after this 503.
            connection.needs_rollback = True
        self._log(
            command,
            "unavailable",
            level=logging.WARNING,
            record=claim.record_id if claim is not None else None,
            database=self.policy.using,
            cause=describe(exc),
        )
        logger.debug("idempotency: the stored response's database error", exc_info=exc)
        raise DatabaseUnavailable(
            "The database rolled this request back to settle a conflict with another "
            "transaction (a deadlock, a serialization failure or a lock wait that ran out), so "
            "its result was not saved. Retry with the same idempotency key after the delay in "
            "the Retry-After header: the request runs again (a phased request resumes after "
            "its last committed phase).",
            retry_after=self.policy.retry_after,
        ) from exc

    def _abandon(self, command: Command, claim: _Claim, exc_info: Any) -> None:
        """The view (or capturing its response) raised: roll back, and free a lease claim."""
        claim.atomic.__exit__(*exc_info)
        if self.policy.lease is not None:
            self._release_quietly(command, claim)
        self._log(command, "raised", record=claim.record_id, level=logging.WARNING)

    def _release_quietly(self, command: Command, claim: _Claim) -> None:
        """Release a lease-mode claim in its own transaction, once the view's transaction has
        rolled back (the view raised, or answered ``5xx``, or the database rolled it back).

        The request's answer is decided already (the view's response, or its exception), so
        the release never replaces it. A claim a retry took over is only logged (``stale``).
        A database that cannot be reached (:meth:`RecordStore.unreachable`), or a release that
        loses a conflict with another transaction (:meth:`RecordStore.conflicted`: a lock wait
        that ran out, a deadlock, which a 503 for that very conflict met again), is logged
        too, as one WARNING line (``release_failed``) with the traceback at DEBUG: the record
        stays ``in_progress`` under its lease, a retry gets ``409`` until the lease runs out
        and then takes the record over and runs the view, as after a crash. Any other database
        error (a statement failing on a live connection) is raised.
        """
        try:
            self._free(claim)
        except StaleClaim:
            self._log(command, "stale", record=claim.record_id, level=logging.WARNING)
        except DatabaseError as exc:
            lost = self.store.unreachable(exc)
            if not lost and not self.store.conflicted(exc):
                raise
            if lost:
                self._drop_lost_connection()
            lease = self.policy.lease
            self._log(
                command,
                "release_failed",
                level=logging.WARNING,
                record=claim.record_id,
                database=self.policy.using,
                lease=f"{lease.total_seconds():g}s" if lease else None,
                cause=describe(exc),
            )
            logger.debug("idempotency: the release's database error", exc_info=exc)

    def _free(self, claim: _Claim) -> None:
        """Free a lease-mode claim whose request will not store a response (for
        :meth:`_release_quietly`): delete its record, in a transaction of its own, if its token
        still holds it (else :class:`StaleClaim`)."""
        with transaction.atomic(using=self.policy.using):
            self.store.release(claim.record_id, claim.token, deferred=claim.deferred)

    # -- reporting ----------------------------------------------------------------------------

    def _signal_kwargs(self, command: Command) -> dict[str, Any]:
        return {"key": command.key, "owner": command.owner, "request": self.request}

    def _log(
        self, command: Command, outcome: str, *, level: int = logging.INFO, **extra: Any
    ) -> None:
        telemetry.http_outcome(outcome, level)  # every outcome passes here, logged or not
        if not logger.isEnabledFor(level):  # nothing is formatted for a level that is off
            return
        details = "".join(
            f" {name}={log_text(value)}" for name, value in extra.items() if value is not None
        )
        # Every value from the request is escaped (log_text): a path with %0A or a key with an
        # ESC sequence would otherwise forge log lines or rewrite a terminal.
        key = log_text(command.key)
        owner = log_text(display_owner(command.owner))  # never a credential-derived value in full
        logger.log(
            level,
            "idempotency %s key=%s owner=%s method=%s path=%s%s",
            outcome,
            key,
            owner,
            log_text(command.method),
            log_text(command.path),
            details,
            extra={
                "idempotency_outcome": outcome,
                "idempotency_key": key,
                "idempotency_owner": owner,
            },
        )
