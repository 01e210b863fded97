"""Relays that outlive their test: stopped before the next test starts, and named.

A relay left serving after its test (a thread whose ``stop()`` came late, a
``manage.py idempotency_relay`` subprocess a test failed to stop) keeps claiming and sending
the outbox rows of the tests that follow it on the same database, and a later test sees its
rows sent, or the relay's counters move, for no reason of its own. The hooks in
``tests/conftest.py`` call :func:`stop_leftovers` after each test's teardown: a leftover relay
is stopped (a subprocess killed) and a :class:`RelayOutlivedItsTest` warning names the test
that started it; one that cannot be stopped fails that test's teardown.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import threading
import time
import warnings
from contextlib import suppress
from typing import Any

import pytest

from django_idempotency.outbox.relay import Relay

#: Relays serving in this process: id -> (relay, the test that started it).
SERVING: dict[int, tuple[Relay, str]] = {}
#: Relay subprocesses started by a test's body (not a fixture's set-up): (process, test).
PROCESSES: list[tuple[subprocess.Popen[bytes], str]] = []
_lock = threading.Lock()


class RelayOutlivedItsTest(pytest.PytestWarning):
    """A relay was still serving after the test that started it; it was stopped."""


def current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?")


def install() -> None:
    """Track every ``Relay.serve()`` of the process (idempotent)."""
    if getattr(Relay.serve, "_tracked", False):
        return
    serve = Relay.serve

    @functools.wraps(serve)
    def tracked(self: Relay, *args: Any, **kwargs: Any) -> Any:
        with _lock:
            SERVING[id(self)] = (self, current_test())
        try:
            return serve(self, *args, **kwargs)
        finally:
            with _lock:
                SERVING.pop(id(self), None)

    tracked._tracked = True  # type: ignore[attr-defined]
    Relay.serve = tracked  # type: ignore[method-assign]


def track_process(process: subprocess.Popen[bytes], command: list[str]) -> None:
    """Note a relay subprocess started in a test's body (its own teardown must stop it)."""
    test = current_test()
    if "idempotency_relay" in command and test.endswith("(call)"):
        PROCESSES.append((process, test))


def _wait_until(done: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_leftovers(grace: float = 15.0) -> None:
    """Stop what outlived its test; warn naming it; fail if a relay thread cannot be stopped.

    ``grace``: how long a relay its test already stopped may take to return on a loaded machine
    before it counts as left serving (costs nothing when none serves)."""
    if not _wait_until(lambda: not SERVING, grace):
        with _lock:
            left = list(SERVING.values())
        for relay, test in left:
            relay.stop()
            warnings.warn(
                f"a relay started by {test} was still serving", RelayOutlivedItsTest, stacklevel=1
            )
        if not _wait_until(lambda: not SERVING, 120.0):  # a guard against a hang
            raise AssertionError(f"relays that would not stop: {[t for _, t in left]}")
    alive = [(p, test) for p, test in PROCESSES if p.poll() is None]
    PROCESSES.clear()
    for process, test in alive:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            process.wait(10)
        warnings.warn(
            f"a relay process (pid {process.pid}) started by {test} was still running",
            RelayOutlivedItsTest,
            stacklevel=1,
        )
