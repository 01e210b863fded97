"""Phased views for the test suite (``@idempotent(phases=True)``), and the crash-point hook.

``/probe/flow/`` runs three phases: ``one`` (local, an ``Effect`` named ``flow-one``), ``two``
(a "foreign" call, counted in :data:`REMOTE_CALLS` in this process and as a committed
``flow-remote-call`` effect with the call's key as payload) and ``three`` (local,
``flow-three``). ``/probe/flow-unresumable/`` is the same with ``two`` marked
``resumable=False``. ``/probe/flow-whoami/`` records who ran each of its two phases.
``/probe/flow-poison/`` runs ``one`` and ``two`` (local, ``poison-one``/``poison-two``), and
its ``two`` SIGKILLs its own process for a body ``{"poison": true}`` in a process started with
``PROBE_POISON=1`` (the completer's, in ``tests/test_completer_poison.py``).
Headers, which are not part of the fingerprint, so that a retry may differ:

* ``X-Flow-Raise: <phase>`` raises :class:`ProbeError` after that phase; ``X-Flow-Raise:
  inside-two`` raises inside the foreign call.
* ``X-Flow-Status: <status>`` answers with that status instead of 201.

The crash-point hook (:func:`crash_at`): with ``PROBE_PID_DIR`` set (the gunicorn tests), a
request with ``X-Crash-At: <phase>:ran`` (its function returned, nothing committed yet) or
``<phase>:committed`` SIGKILLs its own worker there, once per key.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from django_idempotency import idempotent
from django_idempotency.flows.phases import Flow, phase_committed, phase_ran
from testproject.shop.models import Effect

REMOTE_CALLS: Counter[str] = Counter()


class ProbeError(RuntimeError):
    pass


def _remote(key: str, request: HttpRequest) -> dict[str, Any]:
    # An "other system": it commits on its own (no transaction is open during a call), so the
    # gunicorn tests can count calls across processes.
    Effect.objects.create(name="flow-remote-call", payload=key)
    REMOTE_CALLS[key] += 1
    if request.headers.get("X-Flow-Raise") == "inside-two":
        raise ProbeError("the remote call failed after it started")
    return {"id": f"ch_{key[:8]}", "calls": REMOTE_CALLS[key]}


def _undo(name: str, payload: str) -> Any:
    return lambda result, key: Effect.objects.create(name=name, payload=payload)


def _run(request: HttpRequest, flow: Flow, *, resumable: bool) -> HttpResponse:
    key = request.headers.get("Idempotency-Key", "")
    fail = request.headers.get("X-Flow-Raise")
    one = flow.phase(
        "one",
        lambda: Effect.objects.create(name="flow-one", payload=key),
        compensate=_undo("flow-undo-one", key),
    )
    if fail == "one":
        raise ProbeError("raised after phase one")
    two = flow.call(
        "two",
        lambda call_key: _remote(call_key, request),
        compensate=_undo("flow-refund-two", key),
        resumable=resumable,
    )
    if fail == "two":
        raise ProbeError("raised after phase two")
    three = flow.phase(
        "three", lambda: {"effect": Effect.objects.create(name="flow-three", payload=key).pk}
    )
    if fail == "three":
        raise ProbeError("raised after phase three")
    status = int(request.headers.get("X-Flow-Status", 201))
    body = {"one": one.pk, "two": two, "three": three, "resumed": flow.resumed}
    return JsonResponse(body, status=status)


@csrf_exempt
@idempotent(phases=True, lease=timedelta(seconds=30))
def flow_probe(request: HttpRequest, flow: Flow) -> HttpResponse:
    return _run(request, flow, resumable=True)


@csrf_exempt
@idempotent(phases=True, lease=timedelta(seconds=30))
def flow_unresumable(request: HttpRequest, flow: Flow) -> HttpResponse:
    return _run(request, flow, resumable=False)


def whoami(request: HttpRequest) -> str:
    """``<model label>:<pk>`` of ``request.user``, or ``anonymous``."""
    user = request.user
    if not user.is_authenticated:
        return "anonymous"
    return f"{user._meta.label_lower}:{user.pk}"


@csrf_exempt
@idempotent(phases=True, lease=timedelta(seconds=30))
def flow_whoami(request: HttpRequest, flow: Flow) -> HttpResponse:
    """Two phases, each recording who ran it (``whoami-one``/``-two`` effects, payload
    ``<key> <whoami>``); ``X-Flow-Raise: one`` raises between them, and with ``?members-only``
    an anonymous request is answered 200 between them."""
    key = request.headers.get("Idempotency-Key", "")
    flow.phase(
        "one",
        lambda: Effect.objects.create(name="whoami-one", payload=f"{key} {whoami(request)}").pk,
        compensate=_undo("whoami-undo-one", key),
    )
    if request.headers.get("X-Flow-Raise") == "one":
        raise ProbeError("raised after phase one")
    if "members-only" in request.GET and not request.user.is_authenticated:
        # A check of the user between phases, answered with a status that is stored.
        return JsonResponse({"user": "anonymous", "members": False}, status=200)
    flow.phase(
        "two",
        lambda: Effect.objects.create(name="whoami-two", payload=f"{key} {whoami(request)}").pk,
    )
    return JsonResponse({"user": whoami(request)}, status=201)


@csrf_exempt
@idempotent(phases=True, lease=timedelta(seconds=30))
def flow_poison(request: HttpRequest, flow: Flow) -> HttpResponse:
    """A poison message for the completer: ``two`` kills the process that resumes it (see the
    module's docstring); ``one`` is compensated by a ``poison-undo-one`` effect."""
    key = request.headers.get("Idempotency-Key", "")
    poison = json.loads(request.body or b"{}").get("poison") is True
    one = flow.phase(
        "one",
        lambda: Effect.objects.create(name="poison-one", payload=key).pk,
        compensate=_undo("poison-undo-one", key),
    )
    two = flow.phase("two", lambda: _poisoned_phase(key, poison))
    return JsonResponse({"one": one, "two": two}, status=201)


def _poisoned_phase(key: str, poison: bool) -> int:
    if poison and os.environ.get("PROBE_POISON") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return int(Effect.objects.create(name="poison-two", payload=key).pk)


@receiver(phase_ran, dispatch_uid="probe-crash-ran")
def _crash_when_ran(sender: Any, flow: Flow, phase: str, **kwargs: Any) -> None:
    crash_at(flow, f"{phase}:ran")


@receiver(phase_committed, dispatch_uid="probe-crash-committed")
def _crash_when_committed(sender: Any, flow: Flow, phase: str, **kwargs: Any) -> None:
    crash_at(flow, f"{phase}:committed")


def crash_at(flow: Flow, point: str) -> None:
    """SIGKILL this process at ``point`` if the request asks for it, the first time per key."""
    pid_dir = os.environ.get("PROBE_PID_DIR")
    headers = getattr(flow.request, "headers", {})
    if not pid_dir or headers.get("X-Crash-At") != point:
        return
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", headers.get("Idempotency-Key", ""))
    marker = Path(pid_dir, f"{safe}.crashed")
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
