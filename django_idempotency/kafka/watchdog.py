"""The Kafka runner's handler watchdog: a handler that hangs ends its process.

A handler that raises is retried and, after ``MAX_DELIVERIES``, dead-lettered; a handler that
kills its process is counted on each delivery (the count commits before the handler runs) and
parked on the delivery after the last. A handler that *hangs* (a socket without a timeout, a
deadlock, an endless loop) would do neither: the loop would wait for ever, and past
``max.poll.interval.ms`` Kafka hands its partitions to another consumer, which meets the same
message and hangs too. The watchdog turns a hang into the kill the runner already survives.

The runner arms it for a message's (or a batch's) transaction, ``with watchdog.arm(...):``,
which costs a clock read and two attribute stores. A
daemon thread wakes a few times per timeout and compares the clock with the deadline: once a
handler is past ``HANDLER_TIMEOUT``, it logs one CRITICAL line and ends the process with
``os._exit(HANG_EXIT_STATUS)``. No signal is used, so it works when the runner runs in a thread
other than the main one; it never fires while the runner waits in ``poll`` (it is disarmed
then). The whole process ends, as it would if the handler had killed it: run the runner under a
supervisor that restarts it. The thread needs the GIL: a hang in C code that holds it (a
regular expression that backtracks for ever) is seen only once that code returns.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["HANG_EXIT_STATUS", "Watchdog"]

HANG_EXIT_STATUS = 70
"""The exit status of a runner whose handler hung (``EX_SOFTWARE`` of ``sysexits.h``)."""

FLUSH_TIMEOUT = 5.0
"""Seconds the log handlers get to write the CRITICAL line before the process ends anyway (a
handler blocked on a full pipe must not keep a hung process alive)."""


def _end_process(status: int) -> None:
    os._exit(status)


class Watchdog:
    """Ends the process when one armed stretch of work runs past ``timeout`` seconds.

    :param timeout: seconds; 0 switches the watchdog off (:meth:`start` then starts nothing).
    :param logger: where the CRITICAL line goes.
    :param name: the consumer's name, for the log line and the thread's name.
    :param end_process: called with :data:`HANG_EXIT_STATUS` once the line is logged;
        ``os._exit`` (tests pass another).
    """

    def __init__(
        self,
        timeout: float,
        logger: logging.Logger,
        name: str,
        end_process: Callable[[int], object] = _end_process,
    ) -> None:
        self.timeout = timeout
        self._logger = logger
        self._name = name
        self._end_process = end_process
        self._armed: tuple[float, float, Callable[[], str]] | None = None
        """(started, deadline, what) of the work in hand: one attribute, swapped whole, so
        the thread never pairs one message's deadline with another's description."""
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._ending = threading.Event()
        """Set while the thread decides to end the process: no work begins meanwhile."""
        self._ended = threading.Event()
        """Set once ``end_process`` has returned (only a stand-in in a test returns)."""

    def start(self) -> None:
        """Start the watching thread (none if the timeout is 0)."""
        if self.timeout <= 0 or self._thread is not None:
            return
        self._stopped.clear()
        self._ending.clear()
        self._ended.clear()
        self._thread = threading.Thread(
            target=self._watch, name=f"idempotency-watchdog-{self._name}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the watching thread (the runner's loop has ended)."""
        self._armed = None
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def arm(self, what: Callable[[], str]) -> Watchdog:
        """Work begins; ``what()`` describes it (already safe to log) if it hangs.

        Returns the watchdog, whose ``with`` block disarms it: ``with watchdog.arm(...):``.
        Once the watchdog has decided to end the process, this waits for the end: the next
        message must not begin, to be cut off half-way and counted as a delivery that died.
        """
        if self._ending.is_set():
            self._ended.wait()
        now = time.monotonic()
        self._armed = (now, now + self.timeout, what)
        return self

    def disarm(self) -> None:
        """The work armed last has ended."""
        self._armed = None

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        self._armed = None

    def _watch(self) -> None:
        interval = max(0.01, min(0.5, self.timeout / 4))
        while not self._stopped.wait(interval):
            armed = self._armed
            if armed is None or time.monotonic() <= armed[1]:
                continue
            # No work may begin from here on; then, if the work read above has not ended
            # meanwhile, it is past its deadline with nothing after it: end the process. (Had
            # it ended, the loop may already have begun the next message, and the end would
            # cut that one off instead.)
            self._ending.set()
            if self._armed is armed:
                self._fire(*armed)
                return
            self._ending.clear()

    def _fire(self, started: float, deadline: float, what: Callable[[], str]) -> None:
        def report() -> None:
            self._logger.critical(
                "HANDLER HUNG, ending the process with status %d (restarted, the runner "
                "gets the message again, and dead-letters one that hangs every time after "
                "MAX_DELIVERIES): consumer %s, %s, running for %.1fs, past HANDLER_TIMEOUT "
                "(%gs)",
                HANG_EXIT_STATUS,
                self._name,
                what(),
                time.monotonic() - started,
                self.timeout,
            )
            _flush_logs()

        # In a thread of its own: a log handler that blocks must not keep the process alive.
        reporter = threading.Thread(target=report, name="idempotency-watchdog-report", daemon=True)
        reporter.start()
        reporter.join(FLUSH_TIMEOUT)
        try:
            self._end_process(HANG_EXIT_STATUS)
        finally:
            self._ended.set()  # never reached past os._exit; a stand-in lets the work go on


def _flush_logs() -> None:
    """Flush every logging handler and the standard streams: ``os._exit`` flushes nothing."""
    loggers = [logging.getLogger(), *list(logging.Logger.manager.loggerDict.values())]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
