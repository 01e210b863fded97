"""The test suite's own guard (tests/leaks.py): a relay that outlives its test is stopped and
named before the next test starts."""

from __future__ import annotations

import threading

import pytest
from django.db import connections

from django_idempotency.outbox.relay import Relay
from tests import leaks

pytestmark = pytest.mark.django_db(transaction=True)


class Nothing:
    def send(self, messages: list[object]) -> list[None]:
        return [None for _ in messages]

    def close(self) -> None:
        pass


def test_a_relay_left_serving_is_stopped_and_named() -> None:
    relay = Relay(transports={"default": Nothing()})

    def serve() -> None:
        try:
            relay.serve(poll_interval=0.05)
        finally:
            connections.close_all()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert leaks._wait_until(lambda: id(relay) in leaks.SERVING, 60.0)
    with pytest.warns(leaks.RelayOutlivedItsTest, match="was still serving"):
        leaks.stop_leftovers(grace=0.2)
    thread.join(60)
    assert not thread.is_alive() and relay.stopping
    assert not leaks.SERVING
