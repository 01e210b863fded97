"""The Kafka runner's handler watchdog, on its own: when it fires, and when it must not.

The runner ends its process through it (``os._exit``); here a stand-in records the exit
status instead. tests/test_kafka_runner_fast.py ends a real runner process with it, and the
``hangs`` kind of tests/test_kafka_poison.py dead-letters a message that hangs every time.
"""

from __future__ import annotations

import logging
import threading

import pytest

from django_idempotency.kafka.watchdog import HANG_EXIT_STATUS, Watchdog

logger = logging.getLogger("django_idempotency.kafka.runner")


class Ended:
    """A stand-in for ``os._exit``: records the status and wakes the test."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.event = threading.Event()

    def __call__(self, status: int) -> None:
        self.statuses.append(status)
        self.event.set()


def test_work_past_the_timeout_ends_the_process_with_one_critical_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Armed from a thread that is not the main one (no signal is involved): the watchdog's
    own thread logs the line and ends the process."""
    ended = Ended()
    watchdog = Watchdog(0.05, logger, "billing.ledger", end_process=ended)
    watchdog.start()
    try:
        worker = threading.Thread(target=lambda: watchdog.arm(lambda: "event e-1, orders[0]@7"))
        worker.start()
        worker.join()
        assert ended.event.wait(30)
    finally:
        watchdog.stop()
    assert ended.statuses == [HANG_EXIT_STATUS]
    [record] = [r for r in caplog.records if "HANDLER HUNG" in r.getMessage()]
    assert record.levelno == logging.CRITICAL
    assert "consumer billing.ledger, event e-1, orders[0]@7" in record.getMessage()
    assert "past HANDLER_TIMEOUT (0.05s)" in record.getMessage()


def test_it_never_fires_while_disarmed_however_long_the_runner_idles() -> None:
    """Work that ends within the timeout disarms it (also when it raises), and the runner's
    polls in between, many timeouts long here, are not watched."""
    ended = Ended()
    watchdog = Watchdog(0.05, logger, "billing.ledger", end_process=ended)
    watchdog.start()
    try:
        for _ in range(100):
            with watchdog.arm(lambda: "quick"):
                pass
        with pytest.raises(RuntimeError), watchdog.arm(lambda: "raises"):
            raise RuntimeError("handler failed")
        assert not ended.event.wait(1.0)  # twenty timeouts, idle
    finally:
        watchdog.stop()
    assert ended.statuses == []


def test_a_timeout_of_zero_starts_no_thread() -> None:
    watchdog = Watchdog(0, logger, "billing.ledger", end_process=Ended())
    before = threading.active_count()
    watchdog.start()
    with watchdog.arm(lambda: "unwatched"):
        assert threading.active_count() == before
    watchdog.stop()


def test_stop_ends_its_thread() -> None:
    watchdog = Watchdog(300, logger, "billing.ledger", end_process=Ended())
    watchdog.start()
    name = "idempotency-watchdog-billing.ledger"
    [thread] = [t for t in threading.enumerate() if t.name == name]
    assert thread.daemon
    watchdog.stop()
    assert not thread.is_alive()


def test_no_work_begins_once_it_has_decided_to_end_the_process() -> None:
    """Regression: between the watchdog's decision and the end of the process (the CRITICAL
    line gets up to FLUSH_TIMEOUT to be written), the loop went on. Work that ended just past
    its timeout was followed by the next message, which the end then cut off half-way, to be
    counted as a delivery that died. Here the line is slow to write: the next message may
    begin only once the process has ended (the stand-in returns, so it then does)."""
    reporting, release = threading.Event(), threading.Event()

    class SlowHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reporting.set()
            release.wait(30)

    began: list[str] = []
    began_when_ended: list[list[str]] = []

    def end_process(status: int) -> None:
        began_when_ended.append(list(began))

    handler = SlowHandler()
    logger.addHandler(handler)
    watchdog = Watchdog(0.05, logger, "billing.ledger", end_process=end_process)
    watchdog.start()
    try:
        with watchdog.arm(lambda: "event slow, orders[0]@7"):
            assert reporting.wait(30)  # past its timeout, being reported
        # ...and it has just ended: the loop takes the next message.

        def next_message() -> None:
            with watchdog.arm(lambda: "event next, orders[0]@8"):
                began.append("next")

        worker = threading.Thread(target=next_message)
        worker.start()
        worker.join(1.0)  # it would have begun by now
        release.set()
        worker.join(30)
        assert not worker.is_alive()
    finally:
        release.set()
        logger.removeHandler(handler)
        watchdog.stop()
    assert began_when_ended == [[]]
    assert began == ["next"]
