"""Multi-step requests: atomic phases, recovery points, keys for foreign calls.

``@idempotent(phases=True)`` is lease mode split into steps. The view gets a :class:`Flow`:

.. code-block:: python

    @idempotent(phases=True, lease=timedelta(seconds=30))
    def create_ride(request, flow):
        ride = flow.phase("ride_created", lambda: Ride.objects.create(...))
        charge = flow.call("charge_created", lambda key: psp.charge(ride, idempotency_key=key))
        flow.phase("receipt_sent", lambda: Receipt.objects.create(ride=ride, ...))
        return JsonResponse(...)

* :meth:`Flow.phase` runs a **local phase**: its function's writes commit in one transaction
  together with the move of the record's **recovery point** and the phase's result.
* :meth:`Flow.call` runs a **foreign call** outside any transaction, with a key
  (:meth:`Flow.key_for`) derived from the owner, the client's key and the phase name, so it is
  the same on every retry, in every process and in the completer. Its result is stored with its
  recovery point: a resumed request never calls out again for a call that completed.
* A retry after a crash (or the completer, :mod:`django_idempotency.flows.completer`) runs the view
  again: a phase that is done returns its stored result without running, so the view resumes at
  the first phase not yet done. Code between phases runs again: keep effects inside phases.

The claim is lease mode's (:mod:`django_idempotency.http.core`): it commits first, a concurrent
retry gets 409, and a retry after the lease takes it over with a new token. Each phase ends
with a compare-and-swap on that token that also extends the lease, so a holder that lost its
claim cannot commit a phase: its transaction rolls back and its client gets 409.

A run that raises after a phase committed keeps its recovery point and gives up its lease at
once, so a retry (or the completer) resumes it. A phase result is a JSON value (returned as
``json.loads(json.dumps(value))``, also on the first run, so both runs see the same thing) or a
saved model instance, stored as a reference and fetched again on resume.

A flow **rolls forward to failure** when a call marked ``resumable=False`` was interrupted (its
outcome is unknown, so it must not run again), or when the completer gives up after
``max_attempts`` failed runs: the compensations of the phases that are done run in reverse
order, each once (reserved with :func:`~django_idempotency.events.core.try_reserve`), and the
:class:`FlowFailed` problem (502) is stored as the response, replayed to every later retry. The
run is marked failed before the compensations: a run whose failure was not stored (a conflict
with another transaction, a 503) is rolled forward again by the next, never resumed.

Why this module is long: a phase, its recovery point, the lease it renews and the pause that
ends it are one state machine over one record; splitting them would spread its transitions over
several files.
"""

from __future__ import annotations

import base64
import gc
import hashlib
import json
import logging
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial, wraps
from importlib import import_module
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction
from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, OperationalError, connections, transaction
from django.db.models import F, Model
from django.db.transaction import TransactionManagementError
from django.dispatch import Signal
from django.http import HttpResponse
from django.http.request import RawPostDataException
from django.http.response import HttpResponseBase
from django.test.client import encode_multipart
from django.utils import timezone

from django_idempotency import telemetry
from django_idempotency.conf import conf
from django_idempotency.events.core import try_reserve
from django_idempotency.exceptions import (
    IdempotencyError,
    ProblemError,
    RequestInProgress,
    ResponseUndecryptable,
    StaleClaim,
    error_text,
    log_text,
)
from django_idempotency.http.core import Captured, Command, Idempotency, Replay, _Claim
from django_idempotency.http.fingerprint import is_form
from django_idempotency.http.handler import (
    OPTIONS_ATTRIBUTE,
    Options,
    capture,
    django_request,
    mark_non_atomic,
    policy,
    prepare,
    replay_response,
)
from django_idempotency.http.store import SERIALIZATION_FAILURE, _dependencies
from django_idempotency.models import FlowRun, IdempotencyRecord, ProcessedEvent
from django_idempotency.outages import sqlstate
from django_idempotency.protection.core import (
    Undecryptable,
    flow_context,
    open_value,
    seal_value_if_keys,
    stored_response,
)

__all__ = [
    "Flow",
    "FlowFailed",
    "FlowView",
    "derive_key",
    "flow_failed",
    "get_flow_view",
    "phase_committed",
    "phase_ran",
    "record_key",
]

logger = logging.getLogger("django_idempotency")

T = TypeVar("T")

MAX_PHASE_NAME = 100
"""The longest phase name: the width of :attr:`FlowRun.recovery_point`."""

COMPENSATION_CONSUMER = "django_idempotency.flow.compensate"
"""The consumer name under which each compensation reserves ``<run id>:<phase>``, to run once."""

IN_PROGRESS = IdempotencyRecord.State.IN_PROGRESS

PASS_STARTED = "a completer pass started and did not end (its process died, or lost its lease)"
"""The ``last_error`` of a run whose completer pass counted its attempt on starting
(:meth:`Flow._count_pass`); the end of the pass, if it comes, writes its own."""

#: Sent when a phase's function (or foreign call) returned, before its result commits; with
#: ``flow`` and ``phase``. A crash here loses the phase's local writes but not a foreign effect.
phase_ran = Signal()
#: Sent after a phase committed its recovery point; with ``flow`` and ``phase``.
phase_committed = Signal()
#: Sent after a flow rolled forward to failure; with ``flow``, ``phase`` (the interrupted one,
#: or None) and ``compensated`` (the phases whose compensation ran).
flow_failed = Signal()


class FlowFailed(ProblemError):
    """The flow was rolled forward to failure and its completed phases were compensated."""

    status = 502
    slug = "flow-failed"
    title = "The request could not be completed and was undone"


class _Conflicted(IdempotencyError):
    """The flow's own statements (a phase's or a call's fence, the move of its recovery point,
    their COMMIT; a roll forward's mark, a compensation's fence, reservation or COMMIT) met a
    conflict with another transaction
    (:meth:`~django_idempotency.http.store.RecordStore.conflicted`: a deadlock's victim, a
    serialization failure for read/write dependencies, a lock wait that ran out), or lost the
    database (:meth:`~django_idempotency.http.store.RecordStore.unreachable`). Not a lost
    claim: the claim is still this run's. :meth:`_FlowCore._abandon` answers it as the core
    answers such an error while a response is stored (``503`` with ``Retry-After``), the run
    kept for a retry to resume."""

    def __init__(self, error: DatabaseError) -> None:
        super().__init__(str(error))
        self.error = error


class _RollForward(BaseException):
    """Stops the view at the first phase not done, to roll the flow forward to failure.

    A ``BaseException`` so that a view's ``except Exception`` does not swallow it.
    """

    def __init__(self, phase: str | None) -> None:
        super().__init__(phase)
        self.phase = phase


# --- The registry of flow views -----------------------------------------------------------------


@dataclass(frozen=True)
class FlowView:
    """A view decorated with ``@idempotent(phases=True)``, found again by the completer."""

    name: str
    """``module:qualname``, or ``module:<name>`` for ``@idempotent(phases=True, name=...)``:
    stored on each :class:`FlowRun`, so renaming a view strands its unfinished runs."""
    func: Callable[..., HttpResponseBase]
    options: Options


_REGISTRY: dict[str, weakref.ref[FlowView]] = {}
"""Each name's live view. Weak: the module (or URLconf) that holds the decorated view keeps it;
a view that nothing holds any more (one a test defined and dropped) can never run again, so its
name is free for a new one."""

NAME_LENGTH: int = FlowRun._meta.get_field("flow").max_length  # type: ignore[assignment]


def get_flow_view(name: str) -> FlowView:
    """The flow view registered as ``name``, importing its module first if needed."""
    view = _registered(name)
    if view is None:
        module = name.partition(":")[0]
        try:
            import_module(module)
        except ImportError as exc:
            raise LookupError(
                f"Flow view {name!r}: its module cannot be imported ({exc})."
            ) from exc
        view = _registered(name)
    if view is None:
        raise LookupError(
            f"No view is decorated with @idempotent(phases=True) as {name!r}: was it renamed?"
        )
    return view


def _registered(name: str) -> FlowView | None:
    ref = _REGISTRY.get(name)
    return None if ref is None else ref()


def _register(view: FlowView) -> None:
    """Register ``view`` under its name; refuse a second live view of that name.

    Two views made by one factory (``def make(amount): @idempotent(phases=True) def v(...)``)
    share ``module:make.<locals>.v``. Registered over each other, the completer resumed the
    first one's runs with the second one's code (it charged the wrong amount): a wrong view must
    never run, so the second is refused until it gets a name of its own.
    """
    if _live_rival(view) is not None:
        gc.collect()  # a view that only a reference cycle still holds is not a rival
    rival = _live_rival(view)
    if rival is not None:
        raise ImproperlyConfigured(
            f"Two phased views are both named {view.name!r} (each made by one factory, or "
            "defined twice in one module): the completer would resume the runs of one with the "
            "code of the other. Give each its own name that stays the same across restarts: "
            "@idempotent(phases=True, name='charge_500'); the name is stored on its runs "
            f"as {view.name.partition(':')[0]}:<name>."
        )
    _REGISTRY[view.name] = weakref.ref(view)


def _live_rival(view: FlowView) -> FlowView | None:
    current = _registered(view.name)
    return current if current is not None and current.func is not view.func else None


def flow_name(func: Callable[..., Any], name: str | None) -> str:
    """The registered name of a phased view: ``module:qualname``, or ``module:name``."""
    if name is None:
        full = f"{func.__module__}:{func.__qualname__}"
    elif not isinstance(name, str) or not name.strip() or ":" in name:
        raise ImproperlyConfigured(
            f"@idempotent(phases=True, name=...) takes a non-empty name without ':', not {name!r}."
        )
    else:
        full = f"{func.__module__}:{name}"
    if len(full) > NAME_LENGTH:
        raise ImproperlyConfigured(
            f"The phased view name {full!r} is longer than {NAME_LENGTH} characters, the "
            "width of FlowRun.flow: give it a shorter one with @idempotent(phases=True, "
            "name=...)."
        )
    return full


def flow_view(
    func: Callable[..., HttpResponseBase], options: Options, name: str | None = None
) -> Callable[..., Any]:
    """Wrap ``func(request, flow, *args, **kwargs)``; called by ``@idempotent(phases=True)``."""
    if iscoroutinefunction(func):
        raise ImproperlyConfigured(
            f"@idempotent(phases=True) cannot wrap the coroutine function {func.__qualname__}: "
            "each phase is a synchronous transaction. Write the view with def."
        )
    view = FlowView(flow_name(func, name), func, options)
    _register(view)

    @wraps(func)
    def wrapper(request: Any, *args: Any, **kwargs: Any) -> HttpResponseBase:
        if not hasattr(request, "META"):
            raise TypeError(
                "@idempotent(phases=True) decorates view functions: (request, flow, ...)."
            )
        response: HttpResponseBase = handle(view, request, args, kwargs)
        return response

    setattr(wrapper, OPTIONS_ATTRIBUTE, options)
    mark_non_atomic(wrapper)  # each phase commits on its own, even under ATOMIC_REQUESTS
    return wrapper


# --- Running a flow -----------------------------------------------------------------------------


def handle(view: FlowView, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``view`` for an incoming request: claim, run or resume its phases, store the answer."""
    prepared = prepare(request, view.options)
    if prepared is None:  # no key on an optional endpoint, or a method that is not handled
        return view.func(request, Flow.unrecorded(request), *args, **kwargs)
    if isinstance(prepared, HttpResponse):
        return prepared
    return run(view, request, prepared, args, kwargs)


def run(
    view: FlowView,
    request: Any,
    command: Command,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    failing: bool = False,
    refused: bool = False,
    count_lost: bool = False,
    count_pass: bool = False,
) -> HttpResponseBase:
    """Claim ``command`` and run (or resume) the flow; the completer calls this too.

    ``failing`` rolls the flow forward to failure at its first phase not done (the completer
    sets it once a run has failed ``max_attempts`` times). ``refused`` (with ``failing``: the
    completer refuses the run's principal) rolls it forward whatever the view answers: a view
    that returns before its first phase not done (a check of the anonymous user it now gets)
    must not leave the done phases in place as a stored success. ``count_lost`` (the
    completer): a lost database at a phase's own statements counts as an attempt
    (:meth:`_FlowCore._count_lost`). ``count_pass`` (the completer): a run taken over counts
    its attempt before any phase runs (:meth:`Flow._count_pass`).
    """
    core = _FlowCore(policy(view.options), request=request)
    core.count_lost = count_lost

    def body() -> HttpResponseBase:
        assert core.claim is not None
        flow = Flow(core, command, core.claim, view, request, args, kwargs, failing=failing)
        core.flow = flow
        if count_pass and flow.recorded and not flow.failing:
            flow._count_pass()
        if flow._unopened:  # recorded: the run pauses, its record kept
            raise ResponseUndecryptable(
                "This request's earlier steps were stored encrypted with a key that is no "
                "longer configured, so it cannot be resumed. Do not retry it; look the result "
                "up instead."
            )
        try:
            response = view.func(request, flow, *args, **kwargs)
        except _RollForward as stop:
            return flow._roll_forward(stop.phase)
        except Exception:
            if not flow.failing:
                raise
            logger.exception(
                "flow %s raised while rolling forward to failure", log_text(view.name)
            )
            return flow._roll_forward(None)
        again = refused or flow.unstored_failure or core.paused_by(response)
        if flow.failing and flow.recorded and not flow.failed and again:
            # Every phase is done, yet the view answers an error once more: pausing again would
            # rerun it on every pass of the completer, for ever. A run rolled forward before
            # (flow.unstored_failure) rolls forward whatever the view answers: its compensations
            # ran, a success must not be stored over them.
            return flow._roll_forward(None)
        return response

    try:
        with telemetry.span("idempotency.request", {"http.request.method": command.method}):
            result = core.run(command, body, partial(capture, request=request))
    except StaleClaim:
        return RequestInProgress(
            "This request's lease ran out and a retry took it over; its current phase was "
            "rolled back. Retry after the delay in the Retry-After header to get the result.",
            retry_after=core.policy.retry_after,
        ).as_response()
    except ProblemError as exc:
        return exc.as_response()
    return replay_response(result) if isinstance(result, Replay) else result


class _FlowCore(Idempotency):
    """The core, with lease mode's view transaction replaced by one transaction per phase."""

    claim: _Claim | None = None
    flow: Flow | None = None
    count_lost: bool = False

    def _begin(self, command: Command, *, final: bool) -> _Claim | Replay | None:
        step = super()._begin(command, final=final)
        if isinstance(step, _Claim):
            step.atomic.__exit__(None, None, None)  # empty: each phase opens its own
            self.claim = step
        return step

    def _fresh_atomic(self, claim: _Claim) -> None:
        claim.atomic = transaction.atomic(using=self.policy.using)
        claim.atomic.__enter__()

    def paused_by(self, response: HttpResponseBase) -> bool:
        """Whether a run that committed a phase and answers ``response`` is paused, not done:
        a 5xx or an unstored status (401, 403, 409, 429, ...) is not the request's answer."""
        status = response.status_code
        return status >= 500 or status in self.policy.unstored_statuses

    def _finish(self, command: Command, claim: _Claim, captured: Captured) -> None:
        flow = self.flow
        if flow is not None and flow.failed:
            self._store_failure(command, claim, captured)
            return
        temporary = captured.status >= 500 or captured.status in self.policy.unstored_statuses
        if flow is not None and flow.recorded and temporary:
            # Phases committed and cannot be rolled back: keep the recovery point, give up the
            # lease so that a retry or the completer resumes at once. The attempt counts, as a
            # raise does: a view that keeps answering an error is rolled forward to failure
            # after the completer's max_attempts, instead of being rerun on every pass.
            flow._pause(f"the view returned {captured.status}", count=True)
            self._log(command, "paused", record=claim.record_id, status=captured.status)
            return
        self._fresh_atomic(claim)
        super()._finish(command, claim, captured)

    def _before_store(self, claim: _Claim) -> None:
        # In _finish's try: a conflict on the run's row is answered as one on the record's
        # (503, the run paused). Before _fresh_atomic's block was left open: the thread's
        # connection stayed in it, and every later query on it failed.
        flow = self.flow
        if flow is not None and flow.recorded:
            flow._set_state(FlowRun.State.COMPLETED, settle=True)
            telemetry.flow_run(flow.view.name if flow.view else "", "completed")

    def _store_failure(self, command: Command, claim: _Claim, captured: Captured) -> None:
        """Store the ``flow-failed`` problem and mark the run ``failed``, in one transaction.

        The compensations have run, and the run was marked ``failed`` before them
        (:meth:`Flow._roll_forward`). A conflict with another transaction here (a deadlock's
        victim, a serialization failure, a lock wait that ran out) or a lost database rolled
        this transaction back: it escaped as the driver's error, a ``500``. It is now the
        core's ``503`` with ``Retry-After`` (:meth:`_rolled_back_by_database`,
        :meth:`_unavailable`): the record and the run stay, the lease is given up
        (:meth:`_free`), and the retry, or the completer, finds the run ``failed`` and rolls it
        forward again: no phase runs, each compensation has run once already (reserved), and
        the failure is stored then.
        """
        flow = self.flow
        assert flow is not None
        try:
            with transaction.atomic(using=self.policy.using):
                flow._set_state(
                    FlowRun.State.FAILED, stopped_at=flow._stopped_at or "", settle=True
                )
                headers, body = stored_response(
                    command.owner,
                    command.key,
                    dict(captured.headers),
                    captured.body,
                    status=captured.status,
                )
                self.store.complete(
                    claim.record_id,
                    claim.token,
                    status=captured.status,
                    headers=headers,
                    body=body,
                )
        except StaleClaim:
            self._log(command, "stale", record=claim.record_id, level=logging.ERROR)
            raise
        except DatabaseError as exc:
            self._saving_failed(command, exc, claim)
            raise
        self._log(command, "flow_failed", record=claim.record_id, level=logging.ERROR)
        telemetry.flow_run(flow.view.name if flow.view else "", "failed")

    def _free(self, claim: _Claim) -> None:
        flow = self.flow
        if flow is not None and flow.recorded:
            # Phases committed (the database rolled back only the response's store, or one
            # phase, a deadlock's victim, http.core's _rolled_back_by_database): deleting the
            # record would strand its run, and the retry, a new record, would run those phases
            # again. Keep the recovery point and give up the lease, so a retry (or the
            # completer) resumes. Not an attempt: the view did not fail.
            flow._pause("the database rolled the request back (a conflict)", count=False)
            return
        super()._free(claim)

    def _count_lost(self, error: DatabaseError) -> None:
        """The completer's pass lost the database at a phase's own statements: count an
        attempt, on a new connection, the lease kept (the lost transaction's outcome is
        unknown). Not counted, a server that kills the connection at every pass (MariaDB's
        ``idle_transaction_timeout`` shorter than a phase) paused the run on every pass, for
        ever; counted, it is rolled forward after ``max_attempts`` passes, as a view that
        raises every time is. A roll forward (``failing``) has nothing more to count toward.
        A pass that counted itself on starting (:meth:`Flow._count_pass`) is not counted
        again: only its ``last_error`` is written. Best effort: a database still out of reach
        leaves the count as it was."""
        flow = self.flow
        if flow is None or not flow.recorded or flow.failing:
            return
        self._drop_lost_connection()
        try:
            flow._count_attempt(error_text(error))
        except DatabaseError as exc:
            if not self.store.unreachable(exc) and not self.store.conflicted(exc):
                raise
            self._drop_lost_connection()
            logger.debug("idempotency: the attempt's count was lost too", exc_info=exc)

    def _abandon(self, command: Command, claim: _Claim, exc_info: Any) -> None:
        flow = self.flow
        error = exc_info[1]
        if isinstance(error, StaleClaim):
            self._log(command, "stale", record=claim.record_id, level=logging.ERROR)
            return
        if isinstance(error, _Conflicted):
            # The phase's (or a compensation's) transaction rolled back, or lost the database,
            # the claim still this run's: 503, the run kept (or, before its first phase, the
            # claim released), as while storing.
            if self.count_lost and self.store.unreachable(error.error):
                self._count_lost(error.error)
            self._saving_failed(command, error.error, claim)
        if flow is not None and flow.recorded:
            flow._pause(error_text(error), count=True)
            self._log(command, "raised", record=claim.record_id, level=logging.WARNING)
            return
        self._fresh_atomic(claim)
        super()._abandon(command, claim, exc_info)


# --- The flow object ----------------------------------------------------------------------------


def derive_key(owner: str, key: str, fingerprint: str, name: str) -> str:
    """A UUID (version 8) derived from a request (owner, key, fingerprint) and a name.

    The fingerprint keeps a key that is reused for a different request, after its record
    expired, from reaching the other system under the earlier request's keys.
    """
    text = f"django_idempotency.flow\0{owner}\0{key}\0{fingerprint}\0{name}"
    digest = hashlib.sha256(text.encode()).digest()
    value = int.from_bytes(digest[:16], "big")
    value = (value & ~(0xF << 76)) | (0x8 << 76)  # version 8
    value = (value & ~(0b11 << 62)) | (0b10 << 62)  # the RFC 9562 variant
    return str(uuid.UUID(int=value))


def record_key(record: IdempotencyRecord, name: str) -> str:
    """The key that the flow of ``record`` passes out for phase ``name`` (to look a call up)."""
    return derive_key(record.owner, record.key, record.fingerprint, name)


@dataclass
class _Done:
    name: str
    result: Any
    compensate: Callable[[Any, str], Any] | None


@dataclass
class Flow:
    """What a phased view gets besides the request. Create it through the decorator only."""

    core: _FlowCore | None
    command: Command | None
    claim: _Claim | None
    view: FlowView | None
    request: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    failing: bool = False
    failed: bool = False
    """True once the flow rolled forward to failure."""
    unstored_failure: bool = False
    """True when an earlier run rolled this flow forward to failure (its compensations ran or
    began) and its ``flow-failed`` answer was not stored (the database rolled that back, or the
    process died): this run rolls it forward again, whatever the view answers."""
    resumed: bool = False
    """True when an earlier run of this request committed a phase."""
    recovery_point: str = ""
    """The last phase that committed ("" before the first)."""
    _run_id: int | None = None
    _results: dict[str, Any] = field(default_factory=dict)
    _started: str = ""
    _seen: set[str] = field(default_factory=set)
    _done: list[_Done] = field(default_factory=list)
    _keys: dict[str, str] = field(default_factory=dict)
    _stopped_at: str | None = None
    """The phase an earlier roll-forward of this run stopped at (with unstored_failure)."""
    _unopened: bool = False
    """The run's stored results could not be decrypted: it must not run (see run())."""
    _counted: bool = False
    """This completer pass counted its attempt on starting (:meth:`_count_pass`), and has not
    given it back."""
    _last_error: str = ""
    """The run's ``last_error`` as this pass found it, written back when it gives back its
    count on ending (:meth:`_set_state`)."""

    def __post_init__(self) -> None:
        if self.claim is not None:
            self._load()

    @classmethod
    def unrecorded(cls, request: Any) -> Flow:
        """A flow for a request without a key: phases run, nothing is recorded or resumed."""
        return cls(None, None, None, None, request)

    # -- the API ----------------------------------------------------------------------------

    @telemetry.traced("idempotency.flow.phase", argument=1, attribute="idempotency.phase")
    def phase(
        self,
        name: str,
        fn: Callable[[], T],
        *,
        compensate: Callable[[T, str], Any] | None = None,
    ) -> T:
        """Run a local phase once: ``fn``'s writes commit with the recovery point and result.

        When the phase is already done, ``fn`` does not run and its stored result is returned.
        ``compensate(result, key)`` undoes it if the flow rolls forward to failure; ``key`` is
        stable, for a compensation that calls out.
        """
        done = self._lookup(name, compensate)
        if done is not None:
            return done.result  # type: ignore[no-any-return]
        if self.claim is None:
            with transaction.atomic(using=self._alias):
                return fn()
        self._check_can_run(name)
        ours = False  # past fn: an error now is the fence's, the run's or the COMMIT's
        try:
            with transaction.atomic(using=self._alias):
                value = fn()
                stored, returned = _encode(name, value)
                phase_ran.send(sender=Flow, flow=self, phase=name)
                ours = True
                self._fence()
                self._save(recovery_point=name, result=(name, stored), started="")
        except DatabaseError as exc:
            if ours:
                self._conflicted(exc)
            raise
        return self._committed(name, returned, compensate)  # type: ignore[no-any-return]

    @telemetry.traced("idempotency.flow.call", argument=1, attribute="idempotency.phase")
    def call(
        self,
        name: str,
        fn: Callable[[str], T],
        *,
        compensate: Callable[[T, str], Any] | None = None,
        resumable: bool = True,
    ) -> T:
        """Make a foreign call once: ``fn(key)`` runs outside any transaction.

        Pass ``key`` (:meth:`key_for` ``(name)``) to the other system as its idempotency key:
        if this process dies after the call and before its result is stored, the retry calls
        again with the same key. ``resumable=False`` is for a system that takes no key: the
        start of the call is recorded first, and a run interrupted after that start is never
        called again but rolled forward to failure.
        """
        done = self._lookup(name, compensate)
        if done is not None:
            return done.result  # type: ignore[no-any-return]
        key = self.key_for(name)
        if self.claim is None:
            return fn(key)
        self._check_can_run(name)
        with self._conflicts(), transaction.atomic(using=self._alias):
            self._fence()  # never call out on a lost claim, and give the call a full lease
            if not resumable:
                self._save(started=name)
        value = fn(key)
        stored, returned = _encode(name, value)
        phase_ran.send(sender=Flow, flow=self, phase=name)
        with self._conflicts(), transaction.atomic(using=self._alias):
            self._fence()
            self._save(recovery_point=name, result=(name, stored), started="")
        return self._committed(name, returned, compensate)  # type: ignore[no-any-return]

    def key_for(self, name: str) -> str:
        """The idempotency key for phase ``name``'s foreign call.

        Derived from the owner, the client's key, the request's fingerprint and ``name``, so it
        is the same on every retry, in every process and in the completer (a random one when
        the request has no key). :func:`record_key` finds it again from the record.
        """
        if name not in self._keys:
            if self.command is None:
                self._keys[name] = str(uuid.uuid4())
            else:
                command = self.command
                self._keys[name] = derive_key(
                    command.owner, command.key, command.fingerprint, name
                )
        return self._keys[name]

    @property
    def recorded(self) -> bool:
        """True once a phase (or the start of a non-resumable call) committed."""
        return self._run_id is not None

    # -- internals --------------------------------------------------------------------------

    @property
    def _alias(self) -> str:
        # Unrecorded (no key), a phase still runs in one transaction on the business data's
        # database: IDEMPOTENCY["DATABASE"], as the claim's policy says for a recorded one.
        return self.core.policy.using if self.core is not None else conf.DATABASE

    @property
    def _record_id(self) -> int:
        """The claimed record's id: a flow runs in lease mode, whose claim writes the record."""
        assert self.claim is not None and self.claim.record_id is not None
        return self.claim.record_id

    def _load(self) -> None:
        assert self.claim is not None and self.command is not None and self.view is not None
        run = FlowRun.objects.using(self._alias).filter(record_id=self._record_id).first()
        if run is None:
            return
        if (
            run.state == FlowRun.State.COMPLETED
            or (run.state == FlowRun.State.FAILED and self.claim.replaced)
            or run.fingerprint != self.command.fingerprint
            or run.flow != self.view.name
        ):
            # Left by an earlier request whose record expired and was taken over as new. (A
            # run marked failed whose record never completed is this request's: its failure
            # was not stored, see _roll_forward.)
            FlowRun.objects.using(self._alias).filter(pk=run.pk).delete()
            return
        self._run_id = run.pk
        self._last_error = run.last_error
        try:
            results = open_value(run.results, flow_context(run.record_id, "results"))
        except Undecryptable as error:
            # Its phases' results are lost to this process: resuming would run done phases
            # again. run() refuses it, and the run pauses, kept for a key that opens it.
            logger.error(
                "idempotency undecryptable flow run id=%s record=%s key_id=%s: %s",
                run.pk,
                run.record_id,
                error.key_id,
                log_text(error),
            )
            self._unopened = True
            return
        self._results = dict(results)
        self._started = run.started
        self.recovery_point = run.recovery_point
        self.resumed = True
        if run.state == FlowRun.State.FAILED:
            # Rolled forward to failure, its answer not stored: roll forward again. No phase
            # runs, each compensation runs once (reserved), and the failure is stored with the
            # phase the first roll-forward stopped at, which the mark kept in ``started``.
            self.failing = self.unstored_failure = True
            self._stopped_at, self._started = run.started or None, ""
        telemetry.flow_run(self.view.name, "resumed")

    def _lookup(self, name: str, compensate: Callable[[Any, str], Any] | None) -> _Done | None:
        if not isinstance(name, str) or not name or len(name) > MAX_PHASE_NAME:
            raise ValueError(f"A phase name is a string of 1 to {MAX_PHASE_NAME} characters.")
        if name in self._seen:
            raise ValueError(f"Phase {name!r} appears twice in one flow: give each its own name.")
        self._seen.add(name)
        if name not in self._results:
            return None
        done = _Done(name, _decode(self._results[name]), compensate)
        self._done.append(done)
        return done

    def _check_can_run(self, name: str) -> None:
        if connections[self._alias].in_atomic_block:
            raise TransactionManagementError(
                f"Phase {name!r} opens its own transaction to commit with its recovery point: "
                "do not call flow.phase() or flow.call() inside transaction.atomic."
            )
        if self.failing:
            raise _RollForward(name)
        if self._started == name:
            raise _RollForward(name)  # a call that takes no key was interrupted: never again

    def _committed(
        self, name: str, returned: Any, compensate: Callable[[Any, str], Any] | None
    ) -> Any:
        self.recovery_point = name
        self._done.append(_Done(name, returned, compensate))
        phase_committed.send(sender=Flow, flow=self, phase=name)
        return returned

    @contextmanager
    def _conflicts(self) -> Iterator[None]:
        """Around the flow's own statements and their transaction's COMMIT (the fence, the
        run's writes): a conflict with another transaction there, or a lost database, raises
        :class:`_Conflicted` (:meth:`_conflicted`)."""
        try:
            yield
        except DatabaseError as exc:
            self._conflicted(exc)
            raise

    def _conflicted(self, exc: DatabaseError) -> None:
        """Raise :class:`_Conflicted` (a ``503`` with the run kept, not the driver's error, a
        ``500``) when ``exc``, raised by the flow's own statements or the COMMIT of their
        transaction (a phase's, a foreign call's, a roll forward's), is a conflict with another
        transaction (:meth:`RecordStore.conflicted
        <django_idempotency.http.store.RecordStore.conflicted>`) or a lost database
        (:meth:`RecordStore.unreachable
        <django_idempotency.http.store.RecordStore.unreachable>`). A lost database at a
        phase's fence, the move of its recovery point or its COMMIT escaped as the driver's
        error (a ``500``; ``raised``, an attempt counted, in the completer). The phase's
        function is not covered: an error of its writes is the view's, as in lease mode."""
        assert self.core is not None
        store = self.core.store
        if store.conflicted(exc) or store.unreachable(exc):
            raise _Conflicted(exc) from exc

    def _fence(self) -> None:
        """Compare-and-swap on the claim's token; extends the lease. Raises StaleClaim, or
        the driver's error for a conflict (:meth:`_conflicts` makes that a ``503``)."""
        assert self.claim is not None and self.core is not None
        lease = self.core.policy.lease
        assert lease is not None
        try:
            # By the record's primary key (MariaDB: FORCE INDEX): read from the state index,
            # the update waited on every other request's uncommitted in-progress record.
            updated = self.core.store.extend(self._record_id, self.claim.token, lease)
        except OperationalError as exc:
            # PostgreSQL at REPEATABLE READ or SERIALIZABLE: a takeover committed after the
            # phase's snapshot fails the update (40001) instead of leaving it no row. The claim
            # is lost all the same; this answered 500. Not SERIALIZABLE's failure for
            # read/write dependencies (a write skew, _dependencies): the record's row did not
            # change, the claim is still this run's. That is a conflict (503, the run kept for
            # a retry to resume), as it is while the response is stored; it answered 409 "a
            # retry took it over", and the lease stayed held until it ran out.
            if sqlstate(exc) != SERIALIZATION_FAILURE or _dependencies(exc):
                raise
            updated = 0
        if updated != 1:
            raise StaleClaim(
                f"Record {self.claim.record_id} is no longer held by token {self.claim.token}: "
                "its lease ran out and another run took it over."
            )

    def _save(
        self,
        *,
        recovery_point: str | None = None,
        result: tuple[str, Any] | None = None,
        started: str | None = None,
    ) -> None:
        """Move the recovery point (creating the run on the first save); inside the fence."""
        assert self.claim is not None and self.command is not None and self.view is not None
        results = dict(self._results)
        if result is not None:
            results[result[0]] = result[1]
        context = flow_context(self._record_id, "results")
        values: dict[str, Any] = {
            "results": seal_value_if_keys(results, context),
            "updated_at": timezone.now(),
        }
        if recovery_point is not None:
            values["recovery_point"] = recovery_point
        if started is not None:
            values["started"] = started
        runs = FlowRun.objects.using(self._alias)
        if self._run_id is None:
            run = runs.create(
                record_id=self._record_id,
                flow=self.view.name,
                fingerprint=self.command.fingerprint,
                request=seal_value_if_keys(
                    self._request_data(), flow_context(self._record_id, "request")
                ),
                **values,
            )
            self._run_id = run.pk
        else:
            runs.filter(pk=self._run_id).update(**values)
        self._results = results
        self._started = values.get("started", self._started)

    def _set_state(self, state: str, *, stopped_at: str = "", settle: bool = False) -> None:
        """Set the run's state. ``stopped_at``: a run marked ``failed`` keeps in ``started``
        the phase its roll-forward stopped at (the failure's ``interrupted``; "" for none), so
        that a later roll-forward stores the same answer (:meth:`_roll_forward`). ``settle``:
        the run's answer is stored in this same transaction, so the attempt a completer pass
        counted on starting (:meth:`_count_pass`) is given back, with the ``last_error`` it
        found: a pass that ends with an answer is no failed attempt, as before. Rolled back
        with that transaction, the give-back is made again by the pause that follows."""
        assert self._run_id is not None
        values: dict[str, Any] = {
            "state": state,
            "started": stopped_at,
            "updated_at": timezone.now(),
        }
        if settle and self._counted:
            values.update(attempts=F("attempts") - 1, last_error=self._last_error)
        FlowRun.objects.using(self._alias).filter(pk=self._run_id).update(**values)

    def _count_pass(self) -> None:
        """Count this completer pass as an attempt before any phase runs, in a transaction of
        its own behind the fence (:data:`PASS_STARTED`).

        Counted only when it ended (a pause, a raise), a pass whose process died at the same
        point every time (SIGKILL, the OOM killer, a crash in a C extension) was never counted:
        each pass after the lease took the run over and died again, for ever, and the runs
        behind it were never reached. Counted now, it is rolled forward to failure after
        ``max_attempts`` passes, as a run that raises every time is. The ends of the pass that
        count an attempt do not count it again, and one that is no attempt gives it back
        (:meth:`_recount`, :meth:`_set_state`). A pass whose lease another pass took over keeps
        its count: it did not end within its lease.
        """
        assert self._run_id is not None
        with self._conflicts(), transaction.atomic(using=self._alias):
            self._fence()
            FlowRun.objects.using(self._alias).filter(pk=self._run_id).update(
                attempts=F("attempts") + 1, last_error=PASS_STARTED, updated_at=timezone.now()
            )
        self._counted = True

    def _recount(self, count: bool) -> int:
        """How ``attempts`` moves at an end of this run that is (``count``) or is not an
        attempt: by one, or by none, or back by one for the attempt that the completer pass
        counted on starting (:meth:`_count_pass`) when this end is no attempt."""
        if self._counted:
            return 0 if count else -1
        return 1 if count else 0

    def _pause(self, error: str, *, count: bool) -> None:
        """Give up the lease at once and keep the recovery point (a run that did not finish);
        ``count``: this is an attempt (:meth:`_recount`)."""
        assert self.claim is not None and self._run_id is not None
        with transaction.atomic(using=self._alias):
            assert self.core is not None
            held = self.core.store.extend(self._record_id, self.claim.token, timedelta(0))
            if held:
                FlowRun.objects.using(self._alias).filter(pk=self._run_id).update(
                    attempts=F("attempts") + self._recount(count),
                    last_error=error,
                    updated_at=timezone.now(),
                )
        if held:
            self._counted = self._counted and count

    def _count_attempt(self, error: str) -> None:
        """Count an attempt without giving up the lease (:meth:`_FlowCore._count_lost`)."""
        assert self._run_id is not None
        FlowRun.objects.using(self._alias).filter(
            pk=self._run_id, state=FlowRun.State.RUNNING
        ).update(
            attempts=F("attempts") + self._recount(True),
            last_error=error,
            updated_at=timezone.now(),
        )

    def _roll_forward(self, interrupted: str | None) -> HttpResponse:
        """Compensate the phases that are done, newest first, each once; answer FlowFailed.

        The run is marked ``failed`` first, in a transaction of its own, with the phase it
        stopped at (``interrupted``): if storing the answer is then rolled back (a conflict
        with another transaction, :meth:`_FlowCore._store_failure`), or a compensation's own
        transaction is (:meth:`_compensate`), or the process dies before the answer is stored,
        the next run (the client's retry, or the completer, which looks for such runs too)
        finds the mark and rolls forward again instead of resuming a flow whose compensations
        ran. Before, a client's retry of a flow the completer had rolled forward ran its next
        phases, on top of the undone ones.

        That next roll-forward answers with the first one's ``interrupted``, kept on the run:
        a view that now raises (or returns) before it reaches a phase stopped at none itself,
        and stored ``interrupted: null``. Its ``compensated`` also names the compensations
        the first one ran for phases this one does not reach (:meth:`_compensated_before`).
        """
        if self.unstored_failure:
            interrupted = self._stopped_at or interrupted
        self._stopped_at = interrupted  # kept by _FlowCore._store_failure's mark too
        if self._run_id is not None and not self.unstored_failure:
            with self._conflicts(), transaction.atomic(using=self._alias):
                self._fence()
                self._set_state(FlowRun.State.FAILED, stopped_at=interrupted or "")
        compensated = []
        for done in reversed(self._done):
            if done.compensate is not None:
                self._compensate(done)
                compensated.append(done.name)
        if self.unstored_failure:
            compensated = self._compensated_before(compensated) + compensated
        self.failed = True
        if compensated:
            telemetry.flow_run(self.view.name if self.view else "", "compensated")
        flow_failed.send(sender=Flow, flow=self, phase=interrupted, compensated=compensated)
        problem = FlowFailed(
            "The request stopped at a step that cannot be retried safely, or failed too many "
            "times; the steps that were done have been undone. Send a new request with a new "
            "key to try again.",
            recovery_point=self.recovery_point,
            interrupted=interrupted,
            compensated=compensated,
        )
        return problem.as_response()

    def _compensate(self, done: _Done) -> None:
        """Run ``done``'s compensation once: reserved (``try_reserve``) in the transaction of
        its effect, behind the fence.

        The fence, the reservation and the transaction's COMMIT are the flow's own statements:
        a conflict with another transaction there (a deadlock's victim, a lock wait that ran
        out, a serialization failure) or a lost database raises :class:`_Conflicted`, which
        :meth:`_FlowCore._abandon` answers ``503`` with the record and the run (marked
        ``failed``) kept; the next roll-forward runs this compensation once, or finds it
        reserved if its COMMIT took effect unheard. They escaped as the driver's error: a
        ``500``, and a ``raised`` outcome in the completer that counted an attempt. An error
        of the compensation's own writes is the compensation's, as a phase's is the view's.
        """
        ours = True  # False while the compensation's own code runs
        try:
            with transaction.atomic(using=self._alias):
                self._fence()
                reserved = try_reserve(
                    f"{self._run_id}:{done.name}",  # FlowRun ids are never reused
                    COMPENSATION_CONSUMER,
                    topic=self.view.name if self.view else None,
                    using=self._alias,
                )
                if reserved:
                    ours = False
                    assert done.compensate is not None
                    done.compensate(done.result, self.key_for(f"{done.name}:compensate"))
                    ours = True  # next: the COMMIT
        except DatabaseError as exc:
            if ours:
                self._conflicted(exc)
            raise

    def _compensated_before(self, reached: list[str]) -> list[str]:
        """The done phases an earlier roll-forward of this run compensated (their reservations
        committed) that are not in ``reached``, in the order they were compensated."""
        names = [f"{self._run_id}:{name}" for name in self._results if name not in reached]
        if not names:
            return []
        events = (
            ProcessedEvent.objects.using(self._alias)
            .filter(consumer=COMPENSATION_CONSUMER, event_id__in=names)
            .order_by("processed_at", "pk")
            .values_list("event_id", flat=True)
        )
        return [event.partition(":")[2] for event in events]

    def _request_data(self) -> dict[str, Any]:
        """What the completer needs to rebuild the request (see docs/flows.md for the limits).

        The URL arguments are kept as ASCII JSON text (``"view_args"``, read back with
        :func:`stored_view_args`): a NUL (``%00`` in the URL) or a lone surrogate is then an
        escape in a string, which PostgreSQL's ``jsonb`` stores, where a raw ``\\u0000``
        made it refuse the first phase (a 500); the completer gets the arguments back exactly.
        """
        request = django_request(self.request)
        user = getattr(self.request, "user", None)
        authenticated = bool(getattr(user, "is_authenticated", False))
        try:
            view_args: str | None = json.dumps(
                [list(self.args), self.kwargs], ensure_ascii=True, allow_nan=False
            )
        except (TypeError, ValueError, RecursionError):
            view_args = None
        body, content_type = _stored_body(self.request, request)
        return {
            "method": request.method,
            "path": request.get_full_path(),
            # As sent: validating it against ALLOWED_HOSTS is the view's business, not a phase's.
            "host": _storable(
                request.META.get("HTTP_HOST") or request.META.get("SERVER_NAME", "")
            ),
            "secure": request.is_secure(),
            "content_type": _storable(content_type),
            # None: too large to store (see _stored_body); the completer reports the run as
            # unavailable, and the client's retry resumes it.
            "body": None if body is None else base64.b64encode(body).decode("ascii"),
            # The principal: its model's label and primary key. The completer loads it again
            # from that model, and refuses a run whose principal it cannot load as it was.
            "user": str(getattr(user, "pk", "")) if authenticated else None,
            "principal": principal_label(user) if authenticated else None,
            "view_args": view_args,
        }


def principal_label(user: Any) -> str | None:
    """The model label a run stores for its principal; None for an object that is no model
    instance, which the completer then cannot load and refuses."""
    if isinstance(user, Model):
        return str(user._meta.label_lower)
    return None


MULTIPART_BOUNDARY = "django-idempotency-stored-form"
"""The boundary of a multipart body written again from its parsed form (:func:`_stored_body`)."""


def _stored_body(request: Any, http_request: Any) -> tuple[bytes | None, str]:
    """The request's body and content type, as the completer will send them again.

    A multipart POST is parsed from the stream (by the fingerprint, CSRF or the view), and
    Django then keeps no raw body: reading ``request.body`` raised ``RawPostDataException``,
    and every multipart POST to a phased view answered 500. Its parsed fields and files are
    written again as a multipart body of the same content. A body a DRF parser consumed is
    stored as the JSON of what it parsed.

    Uploaded files do not count toward ``DATA_UPLOAD_MAX_MEMORY_SIZE``, the bound Django puts on
    a raw body, so a multipart body written again can be far larger than any raw body: above
    that setting it is not stored (None), as a raw body that large would have been refused.
    Stored, a 13 MB upload made the first phase's insert exceed MariaDB's
    ``max_allowed_packet`` (a 500, and the connection dropped).
    """
    content_type = str(http_request.META.get("CONTENT_TYPE", ""))
    try:
        return http_request.body, content_type
    except RawPostDataException as exc:
        consumed = exc
    if is_form(content_type):
        fields: dict[str, list[Any]] = {
            name: list(http_request.POST.getlist(name)) for name in http_request.POST
        }
        for name in http_request.FILES:
            fields.setdefault(name, []).extend(http_request.FILES.getlist(name))
        stored_type = f"multipart/form-data; boundary={MULTIPART_BOUNDARY}"
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        files_size = sum(getattr(upload, "size", 0) or 0 for upload in _uploads(fields))
        if limit is not None and files_size > limit:
            return None, stored_type  # not read into memory at all
        for upload in _uploads(fields):
            upload.seek(0)
        try:
            body = encode_multipart(MULTIPART_BOUNDARY, fields)
        finally:
            for upload in _uploads(fields):
                upload.seek(0)  # the view reads its files after the first phase, too
        if limit is not None and len(body) > limit:
            return None, stored_type
        return body, stored_type
    if hasattr(request, "_full_data"):  # a DRF request whose parser read the stream
        text = json.dumps(request.data, ensure_ascii=True, default=str)
        return text.encode("ascii"), "application/json"
    raise consumed


def _uploads(fields: dict[str, list[Any]]) -> list[Any]:
    return [value for values in fields.values() for value in values if hasattr(value, "seek")]


def _storable(text: str) -> str:
    """A header value as a JSON column stores it: a NUL written as ``%00``, as the record's
    path is (:func:`~django_idempotency.http.store.stored_path`)."""
    return text.replace("\x00", "%00").encode("utf-8", "backslashreplace").decode("utf-8")


def stored_view_args(data: dict[str, Any]) -> tuple[list[Any], dict[str, Any]] | None:
    """A stored request's URL arguments, ``(args, kwargs)``, or None when they were not stored.
    A run stored before they were kept as text holds the JSON list itself."""
    value = data.get("view_args")
    if value is None:
        return None
    args, kwargs = json.loads(value) if isinstance(value, str) else value
    return list(args), dict(kwargs)


# --- Phase results ------------------------------------------------------------------------------


def _encode(name: str, value: Any) -> tuple[dict[str, Any], Any]:
    """The stored form of a phase result, and what the phase returns (the same on resume)."""
    if isinstance(value, Model):
        if value.pk is None:
            raise TypeError(f"Phase {name!r} returned an unsaved {type(value).__name__}.")
        pk = value._meta.pk
        assert pk is not None
        reference = {
            "model": value._meta.label_lower,
            "pk": pk.value_to_string(value),
            "db": value._state.db,
        }
        return reference, value
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"Phase {name!r} returned {type(value).__name__}, which cannot be stored: return a "
            f"JSON value (dict, list, str, int, float, bool, None) or a saved model ({exc})."
        ) from exc
    return {"json": json.loads(text)}, json.loads(text)


def _decode(stored: dict[str, Any]) -> Any:
    if "model" in stored:
        model = apps.get_model(stored["model"])
        return model._default_manager.db_manager(stored.get("db")).get(pk=stored["pk"])
    return stored["json"]
