"""A real (small) payment provider for the flow tests, served over HTTP from a thread.

It speaks what ``testproject/shop/psp.py`` sends: ``POST /v1/charges`` and ``POST /v1/refunds``
with an ``Idempotency-Key`` header. Like a real provider, it deduplicates on that key: the
first call under a key creates a charge, a later call under the same key returns the same
charge. It records every call, so a test can count calls, keys and distinct charges.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Provider:
    url: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)
    """``(path, idempotency key)`` of every call, duplicates included."""
    charges: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Distinct charges, by idempotency key."""
    refunds: dict[str, dict[str, Any]] = field(default_factory=dict)
    decline: set[str] = field(default_factory=set)
    """Customers whose card is declined."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def charge_keys(self) -> list[str]:
        return [key for path, key in self.calls if path == "/v1/charges"]

    def reset(self) -> None:
        """Forget every call, charge, refund and declined customer (between two tests)."""
        with self.lock:
            self.calls.clear()
            self.charges.clear()
            self.refunds.clear()
            self.decline.clear()


@contextmanager
def provider() -> Iterator[Provider]:
    """Start the provider on a free port of 127.0.0.1; stop it afterwards."""
    state = Provider()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            payload = json.loads(self.rfile.read(length) or b"{}")
            key = self.headers.get("Idempotency-Key", "")
            with state.lock:
                state.calls.append((self.path, key))
                status, body = self.answer(payload, key)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def answer(self, payload: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
            if not key:
                return 400, {"error": "Idempotency-Key required"}
            if self.path == "/v1/charges":
                if payload.get("customer") in state.decline:
                    return 402, {"reason": "card_declined"}
                charge = state.charges.setdefault(
                    key,
                    {
                        "id": f"ch_{len(state.charges) + 1}",
                        "amount": payload["amount"],
                        "customer": payload.get("customer"),
                    },
                )
                return 200, charge
            if self.path == "/v1/refunds":
                refund = state.refunds.setdefault(
                    key, {"id": f"re_{len(state.refunds) + 1}", "charge": payload["charge"]}
                )
                return 200, refund
            return 404, {"error": "not found"}

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
