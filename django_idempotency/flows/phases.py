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
:class:`FlowFailed` problem (502) is stored as the response, replayed to every later retry.

Why this module is long: a phase, its recovery point, the lease it renews and the pause that
ends it are one state machine over one record; splitting them would spread its transitions over
several files.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial, wraps
from importlib import import_module
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction
from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.db.models import F, Model
from django.db.transaction import TransactionManagementError
from django.dispatch import Signal
from django.http import HttpResponse
from django.http.response import HttpResponseBase
from django.utils import timezone

from django_idempotency import telemetry
from django_idempotency.clock import DatabaseNow
from django_idempotency.conf import conf
from django_idempotency.events.core import try_reserve
from django_idempotency.exceptions import (
    ProblemError,
    RequestInProgress,
    StaleClaim,
    error_text,
)
from django_idempotency.http.core import Captured, Command, Idempotency, Replay, _Claim
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
from django_idempotency.models import FlowRun, IdempotencyRecord

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
    """``module:qualname``: stored on each :class:`FlowRun`, so renaming a view strands its
    unfinished runs."""
    func: Callable[..., HttpResponseBase]
    options: Options


_REGISTRY: dict[str, FlowView] = {}


def get_flow_view(name: str) -> FlowView:
    """The flow view registered as ``name``, importing its module first if needed."""
    if name not in _REGISTRY:
        module = name.partition(":")[0]
        try:
            import_module(module)
        except ImportError as exc:
            raise LookupError(
                f"Flow view {name!r}: its module cannot be imported ({exc})."
            ) from exc
    try:
        return _REGISTRY[name]
    except KeyError:
        raise LookupError(
            f"No view is decorated with @idempotent(phases=True) as {name!r}: was it renamed?"
        ) from None


def flow_view(func: Callable[..., HttpResponseBase], options: Options) -> Callable[..., Any]:
    """Wrap ``func(request, flow, *args, **kwargs)``; called by ``@idempotent(phases=True)``."""
    if iscoroutinefunction(func):
        raise ImproperlyConfigured(
            f"@idempotent(phases=True) cannot wrap the coroutine function {func.__qualname__}: "
            "each phase is a synchronous transaction. Write the view with def."
        )
    view = FlowView(f"{func.__module__}:{func.__qualname__}", func, options)
    _REGISTRY[view.name] = view

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
) -> HttpResponseBase:
    """Claim ``command`` and run (or resume) the flow; the completer calls this too.

    ``failing`` rolls the flow forward to failure at its first phase not done (the completer
    sets it once a run has failed ``max_attempts`` times).
    """
    core = _FlowCore(policy(view.options), request=request)

    def body() -> HttpResponseBase:
        assert core.claim is not None
        flow = Flow(core, command, core.claim, view, request, args, kwargs, failing=failing)
        core.flow = flow
        try:
            return view.func(request, flow, *args, **kwargs)
        except _RollForward as stop:
            return flow._roll_forward(stop.phase)
        except Exception:
            if not failing:
                raise
            logger.exception("flow %s raised while rolling forward to failure", view.name)
            return flow._roll_forward(None)

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

    def _begin(self, command: Command, *, final: bool) -> _Claim | Replay | None:
        step = super()._begin(command, final=final)
        if isinstance(step, _Claim):
            step.atomic.__exit__(None, None, None)  # empty: each phase opens its own
            self.claim = step
        return step

    def _fresh_atomic(self, claim: _Claim) -> None:
        claim.atomic = transaction.atomic(using=self.policy.using)
        claim.atomic.__enter__()

    def _finish(self, command: Command, claim: _Claim, captured: Captured) -> None:
        flow = self.flow
        if flow is not None and flow.failed:
            self._store_failure(command, claim, captured)
            return
        temporary = captured.status >= 500 or captured.status in self.policy.unstored_statuses
        if flow is not None and flow.recorded and temporary:
            # Phases committed and cannot be rolled back: keep the recovery point, give up the
            # lease so that a retry or the completer resumes at once.
            flow._pause(f"the view returned {captured.status}", count=False)
            self._log(command, "paused", record=claim.record_id, status=captured.status)
            return
        self._fresh_atomic(claim)
        if flow is not None and flow.recorded:
            flow._set_state(FlowRun.State.COMPLETED)
            telemetry.flow_run(flow.view.name if flow.view else "", "completed")
        super()._finish(command, claim, captured)

    def _store_failure(self, command: Command, claim: _Claim, captured: Captured) -> None:
        try:
            with transaction.atomic(using=self.policy.using):
                assert self.flow is not None
                self.flow._set_state(FlowRun.State.FAILED)
                self.store.complete(
                    claim.record_id,
                    claim.token,
                    status=captured.status,
                    headers=dict(captured.headers),
                    body=captured.body,
                )
        except StaleClaim:
            self._log(command, "stale", record=claim.record_id, level=logging.ERROR)
            raise
        self._log(command, "flow_failed", record=claim.record_id, level=logging.ERROR)
        telemetry.flow_run(self.flow.view.name if self.flow.view else "", "failed")

    def _abandon(self, command: Command, claim: _Claim, exc_info: Any) -> None:
        flow = self.flow
        error = exc_info[1]
        if isinstance(error, StaleClaim):
            self._log(command, "stale", record=claim.record_id, level=logging.ERROR)
            return
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
        with transaction.atomic(using=self._alias):
            value = fn()
            stored, returned = _encode(name, value)
            phase_ran.send(sender=Flow, flow=self, phase=name)
            self._fence()
            self._save(recovery_point=name, result=(name, stored), started="")
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
        with transaction.atomic(using=self._alias):
            self._fence()  # never call out on a lost claim, and give the call a full lease
            if not resumable:
                self._save(started=name)
        value = fn(key)
        stored, returned = _encode(name, value)
        phase_ran.send(sender=Flow, flow=self, phase=name)
        with transaction.atomic(using=self._alias):
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
            run.state != FlowRun.State.RUNNING
            or run.fingerprint != self.command.fingerprint
            or run.flow != self.view.name
        ):
            # Left by an earlier request whose record expired and was taken over as new.
            FlowRun.objects.using(self._alias).filter(pk=run.pk).delete()
            return
        self._run_id = run.pk
        self._results = dict(run.results)
        self._started = run.started
        self.recovery_point = run.recovery_point
        self.resumed = True
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

    def _fence(self) -> None:
        """Compare-and-swap on the claim's token; extends the lease. Raises StaleClaim."""
        assert self.claim is not None and self.core is not None
        lease = self.core.policy.lease
        assert lease is not None
        updated = (
            IdempotencyRecord.objects.using(self._alias)
            .filter(pk=self._record_id, token=self.claim.token, state=IN_PROGRESS)
            .update(locked_until=DatabaseNow() + lease)
        )
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
        values: dict[str, Any] = {"results": results, "updated_at": timezone.now()}
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
                request=self._request_data(),
                **values,
            )
            self._run_id = run.pk
        else:
            runs.filter(pk=self._run_id).update(**values)
        self._results = results
        self._started = values.get("started", self._started)

    def _set_state(self, state: str) -> None:
        assert self._run_id is not None
        FlowRun.objects.using(self._alias).filter(pk=self._run_id).update(
            state=state, started="", updated_at=timezone.now()
        )

    def _pause(self, error: str, *, count: bool) -> None:
        """Give up the lease at once and keep the recovery point (a run that did not finish)."""
        assert self.claim is not None and self._run_id is not None
        with transaction.atomic(using=self._alias):
            held = (
                IdempotencyRecord.objects.using(self._alias)
                .filter(pk=self._record_id, token=self.claim.token, state=IN_PROGRESS)
                .update(locked_until=DatabaseNow())
            )
            if held:
                FlowRun.objects.using(self._alias).filter(pk=self._run_id).update(
                    attempts=F("attempts") + (1 if count else 0),
                    last_error=error,
                    updated_at=timezone.now(),
                )

    def _roll_forward(self, interrupted: str | None) -> HttpResponse:
        """Compensate the phases that are done, newest first, each once; answer FlowFailed."""
        compensated = []
        for done in reversed(self._done):
            if done.compensate is None:
                continue
            with transaction.atomic(using=self._alias):
                self._fence()
                if try_reserve(
                    f"{self._run_id}:{done.name}",  # FlowRun ids are never reused
                    COMPENSATION_CONSUMER,
                    topic=self.view.name if self.view else None,
                    using=self._alias,
                ):
                    done.compensate(done.result, self.key_for(f"{done.name}:compensate"))
            compensated.append(done.name)
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

    def _request_data(self) -> dict[str, Any]:
        """What the completer needs to rebuild the request (see docs/flows.md for the limits)."""
        request = django_request(self.request)
        user = getattr(self.request, "user", None)
        try:
            view_args: Any = json.loads(json.dumps([list(self.args), self.kwargs]))
        except (TypeError, ValueError):
            view_args = None
        return {
            "method": request.method,
            "path": request.get_full_path(),
            # As sent: validating it against ALLOWED_HOSTS is the view's business, not a phase's.
            "host": request.META.get("HTTP_HOST") or request.META.get("SERVER_NAME", ""),
            "secure": request.is_secure(),
            "content_type": request.META.get("CONTENT_TYPE", ""),
            "body": base64.b64encode(request.body).decode("ascii"),
            "user": str(getattr(user, "pk", ""))
            if getattr(user, "is_authenticated", False)
            else None,
            "view_args": view_args,
        }


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
