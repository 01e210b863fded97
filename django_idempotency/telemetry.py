"""OpenTelemetry metrics and spans: the one module that imports ``opentelemetry``.

Everything else calls the small functions below, which are no-ops unless both hold:

* ``opentelemetry-api`` is installed (the ``otel`` extra; the SDK and exporters are the user's
  choice), and
* ``IDEMPOTENCY["TELEMETRY"]`` is True (the default).

Without the package nothing is imported and nothing changes: the first call tries the import
once, and a missing package (or the setting off) makes every later call return at once. An API
that is installed but fails to load (``OTEL_PROPAGATORS`` naming a propagator that is not
installed raises ``ValueError`` on import) is treated as missing, with one WARNING that names
the cause: telemetry never breaks the caller. With
the API but no SDK configured, OpenTelemetry's own no-op providers answer.

Metric attributes are low-cardinality only: an outcome, a consumer, a transport or a flow name
(names the code or the settings give, a handful each). Never a key, an event id, an owner or a
payload: each distinct value makes a new time series in the user's metrics backend. Spans may
carry an event id (``messaging.message.id``), as the messaging conventions do; never a key or
an owner, which may be derived from credentials.

Trace context crosses the outbox as a W3C ``traceparent`` header: :func:`inject` adds it to a
message's headers when :func:`~django_idempotency.outbox.core.send` writes the row, so it lives
as long as the row (a relay restart, a resend) and travels with the message (Celery and Kafka
headers, a Kafka dead letter and its replay). The relay sends each message inside the stored
context (:func:`sending`), so Celery's own instrumentation, which injects the *current* context
at publish time, propagates the publishing request's trace and not the relay's. A consumer
starts its span from the message's header (:func:`consuming`), or nests in a span that an
instrumentation already started from it.

See docs/operations.md for every metric, what healthy looks like, and the alert rules.

Why this module is long: it is the one place that imports ``opentelemetry``, so that the lazy,
once-only import and the no-op path stay in one spot; every instrument, span helper and the
trace-context propagation through the outbox live here together.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar, cast

from django_idempotency.conf import conf

__all__ = [
    "configure",
    "consuming",
    "count",
    "deliveries",
    "delivery",
    "enabled",
    "flow_run",
    "held_deliveries",
    "http_outcome",
    "inject",
    "observe",
    "outbox_sends",
    "record",
    "relay_batch",
    "sending",
    "span",
    "timed",
    "traced",
    "tracing",
]

logger = logging.getLogger("django_idempotency")

F = TypeVar("F", bound=Callable[..., Any])

METER_NAME = "django_idempotency"
TRACE_HEADERS = ("traceparent", "tracestate")
"""The W3C trace-context headers stored with an outbox message and sent with it."""

# --- Metric names (OpenTelemetry semantic conventions: dotted, units in the unit field) --------

HTTP_REQUESTS = "idempotency.http.requests"
HTTP_DURATION = "idempotency.http.duration"
CONSUMER_DELIVERIES = "idempotency.consumer.deliveries"
OUTBOX_SENDS = "idempotency.outbox.sends"
OUTBOX_BATCH_DURATION = "idempotency.outbox.batch.duration"
OUTBOX_PENDING = "idempotency.outbox.pending"
OUTBOX_LAG = "idempotency.outbox.lag"
OUTBOX_PARKED = "idempotency.outbox.parked"
DELIVERIES_PARKED = "idempotency.consumer.parked"
KAFKA_MESSAGES = "idempotency.kafka.messages"
KAFKA_DEAD_LETTERED = "idempotency.kafka.dead_lettered"
KAFKA_COMMIT_FAILURES = "idempotency.kafka.commit_failures"
FLOW_RUNS = "idempotency.flow.runs"
FLOW_ABANDONED = "idempotency.flow.abandoned"

COUNTERS: dict[str, tuple[str, str]] = {
    HTTP_REQUESTS: ("{request}", "Requests with an idempotency key, by outcome."),
    CONSUMER_DELIVERIES: ("{delivery}", "Deliveries to an idempotent consumer, by outcome."),
    OUTBOX_SENDS: ("{message}", "Outbox messages the relay claimed, by outcome of the send."),
    KAFKA_MESSAGES: ("{message}", "Messages the Kafka runner handled, by outcome."),
    KAFKA_DEAD_LETTERED: ("{message}", "Messages the Kafka runner sent to a dead-letter topic."),
    KAFKA_COMMIT_FAILURES: ("{commit}", "Offset commits of the Kafka runner that failed."),
    FLOW_RUNS: ("{run}", "Runs of phased flows, by outcome."),
}
HISTOGRAMS: dict[str, tuple[str, str]] = {
    HTTP_DURATION: ("s", "Time the library adds to a request: its claim and its store."),
    OUTBOX_BATCH_DURATION: ("s", "Time the relay takes to send and record one batch."),
}

# The library's own outcome words (logged by the HTTP core) mapped to the request outcomes of
# the metric. "taken_over" is not an outcome (the request goes on), so it is not counted; nor
# is "release_failed" (a lease claim's release that lost the database: the request has an
# outcome of its own, "raised" or "rolled_back").
HTTP_OUTCOMES = {
    "stored": "first_execution",
    "stored_not_replayable": "first_execution",
    "released": "first_execution",
    "rolled_back": "first_execution",
    "raised": "first_execution",
    "paused": "first_execution",
    "flow_failed": "first_execution",
    "replayed": "replay",
    "conflict": "conflict",
    "stale": "conflict",
    "mismatch": "mismatch",
    "not_replayable": "not_stored",
    "malformed_key": "malformed_key",
    "missing_key": "missing_key",
    "unavailable": "unavailable",
    "erased": "erased",
    "undecryptable": "undecryptable",
}


class _State:
    """What the first call found: the API modules (or None), and the instruments made so far."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loaded = False
        self.api: Any = None  # a namespace of the opentelemetry modules, or None
        self.instruments: dict[str, Any] = {}
        self.observed: set[str] = set()  # the databases whose gauges are reported
        self.figures: dict[str, tuple[float, Any]] = {}  # their latest status, and when
        self.gauge_meter: Any = None  # the meter the gauges are registered with
        self.unreadable: set[str] = set()  # the databases whose figures failed, said once
        self.warned: set[str] = set()  # the kinds of failure said at WARNING already
        self.warned_lock = threading.Lock()


_state = _State()


class _Api:
    """The OpenTelemetry modules, and the tracer and meter of this library."""

    def __init__(self, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        from opentelemetry import context, metrics, propagate, trace

        self.context = context
        self.metrics = metrics
        self.propagate = propagate
        self.trace = trace
        try:
            release = version("django-idempotency")
        except PackageNotFoundError:  # a source tree that was never installed
            release = ""
        self.tracer = trace.get_tracer(METER_NAME, release, tracer_provider=tracer_provider)
        self.meter = metrics.get_meter(METER_NAME, release, meter_provider=meter_provider)
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._silent_tracers: tuple[type, ...] = (
            trace.NoOpTracerProvider,
            trace.ProxyTracerProvider,
        )
        silent_meters: list[type] = [metrics.NoOpMeterProvider]
        try:  # the provider the API answers with until an SDK sets one (not public)
            from opentelemetry.metrics._internal import _ProxyMeterProvider
        except ImportError:  # pragma: no cover - an API version that moved it
            pass
        else:
            silent_meters.append(_ProxyMeterProvider)
        self._silent_meters = tuple(silent_meters)

    def tracing(self) -> bool:
        """Whether spans go anywhere: a tracer provider other than the API's no-op or proxy.

        Without an SDK (or with ``OTEL_SDK_DISABLED``) the API's providers answer every call
        with a no-op; the library then skips its span work altogether, so the extra alone costs
        one ``isinstance`` a call. Read at each call: an SDK may be set up after the first one.
        """
        provider = self._tracer_provider or self.trace.get_tracer_provider()
        return not isinstance(provider, self._silent_tracers)

    def metering(self) -> bool:
        """Whether metrics go anywhere: as :meth:`tracing`, for the meter provider."""
        provider = self._meter_provider or self.metrics.get_meter_provider()
        return not isinstance(provider, self._silent_meters)


def _api() -> _Api | None:
    """The OpenTelemetry API, or None: not installed, or ``TELEMETRY`` is False."""
    if not conf.TELEMETRY:
        return None
    if not _state.loaded:
        with _state.lock:
            if not _state.loaded:
                try:
                    _state.api = _Api()
                except ImportError:
                    _state.api = None
                except Exception as error:  # telemetry never breaks the caller
                    # The API is installed but will not load: OTEL_PROPAGATORS naming a
                    # propagator that is not installed makes ``opentelemetry.propagate`` raise
                    # ValueError on import. Off for this process, said once (not retried).
                    _state.api = None
                    logger.warning(
                        "telemetry: OpenTelemetry is installed but cannot be loaded (%s: %s); "
                        "metrics and spans are off in this process. Fix the OpenTelemetry "
                        "configuration (for example the OTEL_PROPAGATORS environment "
                        "variable) and restart.",
                        type(error).__name__,
                        error,
                    )
                    logger.debug("telemetry: loading OpenTelemetry failed", exc_info=True)
                _state.loaded = True
    return cast("_Api | None", _state.api)


def enabled() -> bool:
    """True when metrics and spans are recorded: the API is installed and the setting is on."""
    return _api() is not None


def tracing() -> bool:
    """True when spans are recorded now (an SDK's tracer provider is set). A loop that opens a
    span per item asks once per batch and skips :func:`sending` when it is False: asking costs
    the API's provider lookup (an environment read), twice per message in the relay."""
    return _tracer() is not None


def _tracer() -> _Api | None:
    """The API if spans are recorded now, else None."""
    api = _api()
    return api if api is not None and api.tracing() else None


def _meter() -> _Api | None:
    """The API if metrics are recorded now, else None."""
    api = _api()
    return api if api is not None and api.metering() else None


_NULL = nullcontext()
"""The context manager of a span that is not recorded: reusable, it does nothing."""


def _failed(what: str) -> None:
    """Log a failure of OpenTelemetry (API, SDK, a span processor, an exporter, a propagator)
    and go on: once per kind of failure (``what``) and process, a WARNING that names the cause,
    with its traceback; each later one at DEBUG. A broken SDK fails the same way at every call
    (every request, every message), and a WARNING with a traceback each time drowned the log."""
    error = sys.exc_info()[1]
    with _state.warned_lock:
        first = what not in _state.warned
        _state.warned.add(what)
    if not first:
        logger.debug("telemetry: %s failed again; ignored", what, exc_info=True)
        return
    said = " ".join(str(error).split())[:300] if error is not None else ""
    logger.warning(
        "telemetry: %s failed (%s: %s); ignored, and every later failure of this kind is "
        "logged at DEBUG",
        what,
        type(error).__name__,
        said,
        exc_info=True,
    )


class _Guarded:
    """A span's context manager whose own failures are logged and ignored.

    ``start`` makes the underlying context manager. An error from it, from entering it, or from
    leaving it (a span processor's ``on_end``) never reaches the caller; the block's own
    exception always does.
    """

    __slots__ = ("_inner", "_start")

    def __init__(self, start: Callable[[], AbstractContextManager[Any]]) -> None:
        self._start = start
        self._inner: AbstractContextManager[Any] | None = None

    def __enter__(self) -> Any:
        try:
            inner = self._start()
            value = inner.__enter__()
        except Exception:  # noqa: BLE001 - telemetry never breaks the caller
            _failed("starting a span")
            return None
        self._inner = inner
        return value

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        inner, self._inner = self._inner, None
        if inner is None:
            return
        try:
            inner.__exit__(exc_type, exc, tb)
        except Exception as error:  # noqa: BLE001 - telemetry never breaks the caller
            if error is not exc:
                _failed("ending a span")


def _quiet(func: F) -> F:
    """Run ``func`` (a metric or span helper that returns None) with its failures ignored."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - telemetry never breaks the caller
            _failed(func.__name__)

    return cast(F, wrapper)


class _Timed:
    """A span ``idempotency.<step>`` and a histogram point of its duration: either may be off."""

    __slots__ = ("_histogram", "_span", "_started", "_step")

    def __init__(self, step: str, span: Any, histogram: Any) -> None:
        self._step = step
        self._span = span
        self._histogram = histogram
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()
        if self._span is not None:
            self._span.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        try:
            if self._span is not None:
                self._span.__exit__(*exc_info)
        finally:
            if self._histogram is not None:
                elapsed = time.perf_counter() - self._started
                try:
                    self._histogram.record(elapsed, {"idempotency.step": self._step})
                except Exception:  # noqa: BLE001 - telemetry never breaks the caller
                    _failed("recording a duration")


def configure(tracer_provider: Any = None, meter_provider: Any = None) -> None:
    """Record through these providers instead of OpenTelemetry's global ones.

    For a process that keeps several providers (the microbenchmark compares a no-op provider
    with an SDK one); an application sets the global providers and never calls this. Without
    the ``opentelemetry`` package it raises ImportError.
    """
    api = _Api(tracer_provider, meter_provider)
    with _state.lock:
        _state.api = api
        _state.loaded = True
        _state.instruments.clear()
        _state.observed.clear()
        _state.figures.clear()
        _state.unreadable.clear()
        _state.warned.clear()


def reset() -> None:
    """Forget the instruments made so far (tests that install a new provider call this)."""
    with _state.lock:
        _state.loaded = False
        _state.api = None
        _state.instruments.clear()
        _state.observed.clear()
        _state.figures.clear()
        _state.unreadable.clear()
        _state.warned.clear()


def _instrument(api: _Api, name: str) -> Any:
    instrument = _state.instruments.get(name)
    if instrument is None:
        with _state.lock:
            instrument = _state.instruments.get(name)
            if instrument is None:
                if name in COUNTERS:
                    unit, description = COUNTERS[name]
                    instrument = api.meter.create_counter(name, unit, description)
                else:
                    unit, description = HISTOGRAMS[name]
                    instrument = api.meter.create_histogram(name, unit, description)
                _state.instruments[name] = instrument
    return instrument


# --- Metrics ------------------------------------------------------------------------------------


@_quiet
def count(name: str, attributes: Mapping[str, str], amount: int = 1) -> None:
    """Add ``amount`` to the counter ``name`` (one of :data:`COUNTERS`)."""
    api = _meter()
    if api is None or amount <= 0:
        return
    _instrument(api, name).add(amount, dict(attributes))


@_quiet
def record(name: str, value: float, attributes: Mapping[str, str]) -> None:
    """Record ``value`` in the histogram ``name`` (one of :data:`HISTOGRAMS`)."""
    api = _meter()
    if api is None:
        return
    _instrument(api, name).record(value, dict(attributes))


@_quiet
def http_outcome(outcome: str, level: int = logging.INFO) -> None:
    """Count one HTTP request under its outcome (the word the HTTP core logs).

    A ``stale`` logged at WARNING is a lease lost while *releasing* a claim after the request
    was already counted, so it is not counted again; at ERROR it is the request's answer (409).
    """
    category = HTTP_OUTCOMES.get(outcome)
    if category is None or (outcome == "stale" and level < logging.ERROR):
        return
    api = _api()
    if api is None:
        return
    if api.metering():
        _instrument(api, HTTP_REQUESTS).add(
            1, {"idempotency.outcome": category, "idempotency.result": outcome}
        )
    if api.tracing():
        current = api.trace.get_current_span()
        if current.is_recording():
            current.set_attribute("idempotency.outcome", category)


_HELD: ContextVar[list[tuple[str, str]] | None] = ContextVar(
    "django_idempotency_held_deliveries", default=None
)
"""The deliveries :func:`held_deliveries` holds in this context, or None: none is held."""


@contextmanager
def held_deliveries() -> Iterator[list[tuple[str, str]]]:
    """Hold the :func:`delivery` counts made in the block: they go to the list it yields,
    as (consumer, outcome), and are not recorded until the caller passes them to
    :func:`deliveries`. A batch of first deliveries holds them until its caller's transaction
    commits: a batch that rolls back counts nothing, and its messages count once, when they
    are delivered again one at a time."""
    held: list[tuple[str, str]] = []
    token = _HELD.set(held)
    try:
        yield held
    finally:
        _HELD.reset(token)


def deliveries(held: Sequence[tuple[str, str]]) -> None:
    """Count the deliveries :func:`held_deliveries` held."""
    for consumer, outcome in held:
        delivery(consumer, outcome)


@_quiet
def delivery(consumer: str, outcome: str) -> None:
    """Count one delivery to ``consumer``: applied, duplicate, failed or parked."""
    api = _api()
    if api is None:
        return
    held = _HELD.get()
    if held is not None:
        held.append((consumer, outcome))
        return
    attributes = {"idempotency.consumer": consumer, "idempotency.outcome": outcome}
    if api.metering():
        _instrument(api, CONSUMER_DELIVERIES).add(1, attributes)
    if api.tracing():
        current = api.trace.get_current_span()
        if current.is_recording():
            current.set_attributes(attributes)


def flow_run(flow: str, outcome: str) -> None:
    """Count a run of the phased flow ``flow``: completed, resumed, failed or compensated."""
    count(FLOW_RUNS, {"idempotency.flow": flow, "idempotency.outcome": outcome})


@_quiet
def outbox_sends(
    rows: Sequence[Any],
    outcomes: Sequence[BaseException | None],
    max_attempts: int,
    held: Collection[int] = (),
) -> None:
    """Count a relay batch's messages by transport and outcome: sent, failed, parked, held.

    ``rows`` are the rows the relay claimed (:class:`~django_idempotency.outbox.store.Claimed`) and
    ``outcomes`` what the transports answered for each (None: sent). A failure on a row that
    has used its last attempt is counted as ``parked``. ``held`` are the ids of the rows held
    back behind a failed message of their key: they were not attempted (whatever the transport
    answered for them), so they count as ``held``, not ``failed``.
    """
    if _meter() is None:
        return
    tally: dict[tuple[str, str], int] = {}
    for row, outcome in zip(rows, outcomes, strict=True):
        if row.pk in held:
            word = "held"
        elif outcome is None:
            word = "sent"
        elif row.attempts >= max_attempts:
            word = "parked"
        else:
            word = "failed"
        tally[row.transport, word] = tally.get((row.transport, word), 0) + 1
    for (transport, word), amount in tally.items():
        count(
            OUTBOX_SENDS, {"idempotency.transport": transport, "idempotency.outcome": word}, amount
        )


# --- Spans --------------------------------------------------------------------------------------


def span(
    name: str, attributes: Mapping[str, Any] | None = None, *, kind: str = "INTERNAL"
) -> AbstractContextManager[Any]:
    """A span ``name`` around the block, as a child of the current one; yields it (or None)."""
    api = _tracer()
    if api is None:
        return _NULL
    return _Guarded(
        lambda: api.tracer.start_as_current_span(
            name, kind=getattr(api.trace.SpanKind, kind), attributes=attributes
        )
    )


def timed(step: str, histogram: str = HTTP_DURATION) -> AbstractContextManager[None]:
    """A span ``idempotency.<step>`` and a point in ``histogram`` with its duration in seconds.

    The HTTP core times its claim (``claim``) and its store (``store``) with it: the time the
    library adds to a request is their sum.
    """
    api = _api()
    if api is None:
        return _NULL
    tracing, metering = api.tracing(), api.metering()
    if not (tracing or metering):
        return _NULL
    try:
        instrument = _instrument(api, histogram) if metering else None
    except Exception:  # noqa: BLE001 - telemetry never breaks the caller
        _failed("making a histogram")
        instrument = None
    return _Timed(
        step,
        _Guarded(lambda: api.tracer.start_as_current_span(f"idempotency.{step}"))
        if tracing
        else None,
        instrument,
    )


def traced(name: str, *, argument: int | None = None, attribute: str = "") -> Callable[[F], F]:
    """Decorate a function to run inside a span ``name``.

    ``argument`` names a positional argument (by index) whose value becomes the span attribute
    ``attribute``, for example a flow's phase name.
    """

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            api = _tracer()
            if api is None:
                return func(*args, **kwargs)
            attributes = {}
            if argument is not None and len(args) > argument:
                attributes[attribute] = str(args[argument])
            with _Guarded(lambda: api.tracer.start_as_current_span(name, attributes=attributes)):
                return func(*args, **kwargs)

        return cast(F, wrapper)

    return decorate


@contextmanager
def relay_batch(size: int) -> Iterator[None]:
    """A span around one relay batch (send and record), and its duration in a histogram."""
    api = _api()
    if api is None:
        yield
        return
    started = time.perf_counter()
    try:
        with span("idempotency.outbox.batch", {"messaging.batch.message_count": size}):
            yield
    finally:
        record(OUTBOX_BATCH_DURATION, time.perf_counter() - started, {})


# --- Trace context through the outbox ----------------------------------------------------------


def inject(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` with the current span's ``traceparent`` (and ``tracestate``) added.

    Called by :func:`~django_idempotency.outbox.core.send` on the headers it stores. A
    ``traceparent`` the caller set is kept; without a current span nothing is added.
    """
    api = _tracer()
    if api is None or "traceparent" in headers:
        return headers
    carrier: dict[str, str] = {}
    try:
        api.propagate.inject(carrier)
    except Exception:  # noqa: BLE001 - telemetry never breaks the caller
        _failed("injecting the trace context")
        return headers
    found = {name: carrier[name] for name in TRACE_HEADERS if name in carrier}
    return {**headers, **found} if found else headers


def carrier(headers: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """The trace-context headers among ``headers`` (a mapping, or Kafka's (name, bytes) pairs)."""
    if not headers:
        return {}
    if isinstance(headers, Mapping):
        pairs: Iterable[Any] = headers.items()
    elif isinstance(headers, (list, tuple)):
        pairs = headers
    else:  # a client's own header named "headers" (a string, a number): no trace context
        return {}
    found: dict[str, str] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            continue
        name, value = pair
        if name in TRACE_HEADERS:
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            if isinstance(value, str):
                found[name] = value
    return found


def celery_carrier(request: Any) -> dict[str, str]:
    """The trace-context headers of a Celery task request.

    Eagerly they arrive in ``request.headers``; from a broker Celery merges custom headers into
    the message headers, and each becomes an attribute of the request.
    """
    found = carrier(getattr(request, "headers", None) or {})
    for name in TRACE_HEADERS:
        value = getattr(request, name, None)
        if name not in found and isinstance(value, str):
            found[name] = value
    return found


def _remote(api: _Api, headers: Mapping[str, str]) -> Any:
    """The span context the headers carry, or None."""
    if not headers:
        return None
    context = api.propagate.extract(dict(headers))
    remote = api.trace.get_current_span(context).get_span_context()
    return remote if remote.is_valid else None


@contextmanager
def sending(
    headers: Mapping[str, Any], attributes: Mapping[str, Any] | None = None
) -> Iterator[None]:
    """A producer span for one outbox message, in the trace of the request that wrote it.

    The relay runs each send inside the context stored with the message, so the span (and any
    span an instrumentation starts inside it, such as Celery's ``apply_async``, which injects the
    *current* context into the message) belongs to the publishing request's trace. The relay's
    batch span is linked, so the batch still shows which messages it sent.
    """
    api = _tracer()
    if api is None:
        yield
        return

    def start() -> AbstractContextManager[Any]:
        assert api is not None
        remote = _remote(api, carrier(headers))
        if remote is None:
            return api.tracer.start_as_current_span(
                "idempotency.outbox.send", kind=api.trace.SpanKind.PRODUCER, attributes=attributes
            )
        batch = api.trace.get_current_span().get_span_context()
        links = [api.trace.Link(batch)] if batch.is_valid else []
        parent = api.trace.set_span_in_context(api.trace.NonRecordingSpan(remote))
        return api.tracer.start_as_current_span(
            "idempotency.outbox.send",
            context=parent,
            kind=api.trace.SpanKind.PRODUCER,
            links=links,
            attributes=attributes,
        )

    with _Guarded(start):
        yield


@contextmanager
def consuming(
    consumer: str, headers: Mapping[str, str], event_id: str | None = None
) -> Iterator[None]:
    """A consumer span for one message, a child of the request that published it.

    * No current span: the span's parent is the context in the message's headers.
    * A current span in the same trace (an instrumentation, such as Celery's, started the task
      span from the same header): the span nests in it, and nothing is duplicated.
    * A current span in another trace: the span nests in it and links to the publisher.
    """
    api = _tracer()
    if api is None:
        yield
        return

    def start() -> AbstractContextManager[Any]:
        assert api is not None
        remote = _remote(api, headers)
        current = api.trace.get_current_span().get_span_context()
        context = None
        links = []
        if remote is not None:
            if not current.is_valid:
                context = api.trace.set_span_in_context(api.trace.NonRecordingSpan(remote))
            elif current.trace_id != remote.trace_id:
                links.append(api.trace.Link(remote))
        attributes = {"idempotency.consumer": consumer}
        if event_id is not None:
            attributes["messaging.message.id"] = event_id
        return api.tracer.start_as_current_span(
            "idempotency.consume",
            context=context,
            kind=api.trace.SpanKind.CONSUMER,
            links=links,
            attributes=attributes,
        )

    with _Guarded(start):
        yield


# --- Observable gauges (pending, lag, parked, abandoned) ----------------------------------------


def observe(using: str | None = None) -> bool:
    """Register the observable gauges that read the tables of ``using``; True if registered.

    Each collection runs a few bounded queries (:func:`django_idempotency.status.collect`), so
    one process should report them, not every web worker: the relay (``idempotency_relay``)
    calls this for its database. Calling it twice for one database registers nothing more.
    """
    try:
        return _observe(using)
    except Exception:  # noqa: BLE001 - telemetry never breaks the caller
        _failed("registering the gauges")
        return False


def _observe(using: str | None) -> bool:
    api = _api()
    alias = using or conf.DATABASE
    if api is None or alias in _state.observed:
        return False
    with _state.lock:
        _state.observed.add(alias)
        if _state.gauge_meter is not api.meter:
            # Once per meter, for every database: a meter keeps the callbacks of the first
            # gauge of a name and ignores a second registration's (OpenTelemetry's SDK warns
            # and returns the first instrument), so a callback per database would leave every
            # database but the first unreported. The callbacks read _state.observed instead.
            _state.gauge_meter = api.meter
            _register_gauges(api.meter)
    return True


# The gauges: (name, field of status.Figures, unit, description).
GAUGES = (
    (OUTBOX_PENDING, "outbox_pending", "{message}", "Outbox messages not sent yet."),
    (
        OUTBOX_LAG,
        "outbox_oldest_pending_seconds",
        "s",
        "Age of the oldest pending outbox message: how far the relay is behind.",
    ),
    (OUTBOX_PARKED, "outbox_parked", "{message}", "Parked outbox messages."),
    (
        DELIVERIES_PARKED,
        "deliveries_parked",
        "{event}",
        "Events a consumer parked after too many failed deliveries.",
    ),
    (
        FLOW_ABANDONED,
        "flows_abandoned",
        "{run}",
        "Phased flow runs whose lease ran out before they finished: the completer's backlog.",
    ),
)


def _register_gauges(meter: Any) -> None:
    for name, field, unit, description in GAUGES:
        meter.create_observable_gauge(name, [_gauge_callback(field)], unit, description)


def _gauge_callback(field: str) -> Callable[[Any], list[Any]]:
    def observe_field(options: Any) -> list[Any]:
        api = _state.api
        if not api:
            return []
        observations = []
        # sorted() copies the set in one step under the GIL: an observe() on another thread
        # cannot change it mid-iteration (no lock: a callback must never wait on the caller).
        for alias in sorted(_state.observed):
            figures = _figures(alias)
            if figures is None:  # that database could not be read (logged): the others can
                continue
            value = getattr(figures, field)
            observations.append(
                api.metrics.Observation(value or 0, {"idempotency.database": alias})
            )
        return observations

    return observe_field


def _figures(alias: str) -> Any:
    """The status figures of ``alias``: one collection serves every gauge (read once, not once
    per gauge), for a second. None, logged once for all the gauges, when the database cannot
    be read: one database down must not hide the others (an exception raised into the SDK
    would drop every database's point of the gauge), nor reach the SDK or the application."""
    latest = _state.figures.get(alias)
    if latest is not None and time.monotonic() - latest[0] < 1.0:
        return latest[1]
    from django.db import connections

    from django_idempotency import status

    read: Any = None
    connection = connections[alias]
    # A periodic reader collects on its own thread, whose connection nobody else closes: it
    # is closed after each collection (one a minute by default). Only a connection this
    # collection opened: a thread that collects in the middle of its own work (a /metrics
    # view on a threaded server) keeps its connection, and its transaction.
    opened_here = connection.connection is None
    try:
        try:
            read = status.collect(alias)
        finally:
            if opened_here and threading.current_thread() is not threading.main_thread():
                connection.close()
    except Exception as error:  # logged; the gauges skip this database this time
        # One line per outage, not one per collection (every minute, or every scrape, for as
        # long as it lasts), and one when it ends; each failure's traceback at DEBUG.
        if alias not in _state.unreadable:
            _state.unreadable.add(alias)
            first = (str(error).strip().splitlines() or [""])[0]
            logger.warning(
                "telemetry: cannot read the figures of database %r (%s: %s); its gauges are "
                "not reported until it can be read again",
                alias,
                type(error).__name__,
                first[:300],
            )
        logger.debug("telemetry: reading the figures of %r failed", alias, exc_info=True)
    else:
        if alias in _state.unreadable:
            _state.unreadable.discard(alias)
            logger.warning(
                "telemetry: the figures of database %r can be read again; its gauges are reported",
                alias,
            )
    _state.figures[alias] = (time.monotonic(), read)
    return read
