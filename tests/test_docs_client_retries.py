"""docs/client-retries.md: its Python and JavaScript clients, run as the page shows them.

Against the demo project on a live server, each client gets a first answer and, with the same
key, its replay. Against a scripted server that drops the connection, answers ``409`` with
``Retry-After`` and ``503`` before a ``201``, every attempt carries one key and the ``409``'s
``Retry-After`` is waited out; a ``422`` is not retried.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

#: The clients do not depend on the database the demo runs on: the SQLite pass runs them.
pytestmark = pytest.mark.sqlite

PAGE = Path(__file__).resolve().parent.parent / "docs" / "client-retries.md"
ORDER = {"reference": "R-1", "amount_cents": 700, "provider": "stripe", "external_payment_id": ""}


def block(title: str) -> str:
    match = re.search(
        rf'^```\w+ title="{re.escape(title)}"\n(.*?)^```$', PAGE.read_text(), re.M | re.S
    )
    assert match, title
    return match[1]


@dataclass
class Sleeps:
    seconds: list[float] = field(default_factory=list)

    def sleep(self, seconds: float) -> None:
        self.seconds.append(seconds)


def python_client() -> tuple[types.ModuleType, Sleeps]:
    """The page's ``retrying_client.py`` as a module, its waits recorded instead of slept."""
    module = types.ModuleType("retrying_client")
    exec(compile(block("retrying_client.py"), "retrying_client.py", "exec"), module.__dict__)
    sleeps = Sleeps()
    module.time = sleeps  # type: ignore[attr-defined]
    return module, sleeps


def run_javascript(tmp_path: Path, url: str, payload: dict[str, Any], key: str) -> list[Any]:
    """Call the page's ``postIdempotently`` twice with one key; ``[[status, replayed, body]]``."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    (tmp_path / "retryingClient.js").write_text(block("retryingClient.js"))
    driver = f"""
const {{ postIdempotently }} = require("./retryingClient.js");
(async () => {{
  const results = [];
  for (let i = 0; i < 2; i++) {{
    const r = await postIdempotently({json.dumps(url)}, {json.dumps(payload)},
      {{ key: {json.dumps(key)}, base: 10, cap: 50 }});
    results.push([r.status, r.headers.get("Idempotent-Replayed"), await r.text()]);
  }}
  console.log(JSON.stringify(results));
}})();
"""
    (tmp_path / "driver.js").write_text(driver)
    done = subprocess.run(
        [node, "driver.js"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.mark.django_db(transaction=True)
def test_the_python_client_gets_the_answer_then_its_replay(live_server: Any) -> None:
    client, sleeps = python_client()
    url = live_server.url + "/api/orders/"
    payload = {**ORDER, "external_payment_id": "pi_retry_py"}
    key = str(uuid.uuid4())
    first = client.post_idempotently(url, payload, key=key)
    again = client.post_idempotently(url, payload, key=key)
    assert first.status_code == again.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    reused = client.post_idempotently(url, {**payload, "amount_cents": 1}, key=key)
    assert reused.status_code == 422  # key-reused: final, not retried
    assert sleeps.seconds == []


@pytest.mark.slow  # a node process
@pytest.mark.django_db(transaction=True)
def test_the_javascript_client_gets_the_answer_then_its_replay(
    live_server: Any, tmp_path: Path
) -> None:
    payload = {**ORDER, "external_payment_id": "pi_retry_js"}
    url = live_server.url + "/api/orders/"
    (first, again) = run_javascript(tmp_path, url, payload, str(uuid.uuid4()))
    assert first[0] == again[0] == 201
    assert (first[1], again[1]) == (None, "true")
    assert json.loads(again[2]) == json.loads(first[2])


class Scripted(BaseHTTPRequestHandler):
    """Answers each POST with the next step of ``server.script``; records the keys seen."""

    server: Any

    def do_POST(self) -> None:  # http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.keys.append(self.headers.get("Idempotency-Key"))
        step = self.server.script.pop(0)
        if step == "drop":
            self.close_connection = True
            return
        status, headers, body = step
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


PROBLEM = {"Content-Type": "application/problem+json"}
OK = (201, {"Content-Type": "application/json"}, b'{"id": 1}')
FLAKY = [
    "drop",
    (409, {**PROBLEM, "Retry-After": "2"}, b'{"status": 409}'),
    (503, {"Content-Type": "text/html"}, b"busy"),
    (503, {**PROBLEM, "Retry-After": "1"}, b'{"status": 503}'),  # database-unavailable
    OK,
]
REUSED = [(422, PROBLEM, b'{"status": 422}'), OK]


@pytest.fixture
def scripted() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    server.keys = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_the_python_client_retries_with_one_key_and_waits_out_retry_after(
    scripted: Any,
) -> None:
    client, sleeps = python_client()
    url = f"http://127.0.0.1:{scripted.server_port}/"
    scripted.script = list(FLAKY)
    response = client.post_idempotently(url, {"a": 1}, base=0.01, cap=0.05)
    assert response.status_code == 201
    assert len(scripted.keys) == 5 and len(set(scripted.keys)) == 1
    assert len(sleeps.seconds) == 4
    assert sleeps.seconds[1] >= 2  # after the 409, its Retry-After
    assert sleeps.seconds[3] >= 1  # after the 503 problem, its Retry-After
    assert max(sleeps.seconds[0], sleeps.seconds[2]) <= 0.05  # jittered, within the cap

    scripted.script, scripted.keys[:] = list(REUSED), []
    assert client.post_idempotently(url, {"a": 1}).status_code == 422
    assert len(scripted.keys) == 1


@pytest.mark.slow  # a node process
def test_the_javascript_client_retries_with_one_key(scripted: Any, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{scripted.server_port}/"
    scripted.script = [*FLAKY, *REUSED]
    results = run_javascript(tmp_path, url, {"a": 1}, "js-key")
    assert [r[0] for r in results] == [201, 422]
    assert scripted.keys == ["js-key"] * 6  # five attempts, then one for the 422
