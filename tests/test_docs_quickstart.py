"""docs/quickstart.md, followed literally: a fresh ``django-admin startproject`` built from the
page's own code blocks, then the page's requests against ``runserver``.

A code block whose title is a path (```` ```python title="orders/views.py" ````) is that file;
a title ending in ``: add at the end`` is appended to the file. The ``curl`` commands of the
console blocks are sent as written (to a free port instead of 8000), and the status line,
headers and body the page shows are compared with the answers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "quickstart.md"
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```$", re.M | re.S)
TITLE = re.compile(r'title="(?P<title>[^"]+)"')
APPEND = ": add at the end"
#: What the test runs itself; each must be on the page as written.
COMMANDS = [
    "django-admin startproject mysite",
    "python manage.py startapp orders",
    "python manage.py makemigrations orders",
    "python manage.py migrate",
]


@dataclass
class Exchange:
    """One ``curl`` of the page and the answer the page shows for it."""

    command: str
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""


def blocks(page: Path = PAGE) -> list[tuple[str, str]]:
    return [(m["info"].strip(), m["body"]) for m in FENCE.finditer(page.read_text())]


def files(page: Path = PAGE) -> list[tuple[str, bool, str]]:
    """``(path, append, text)`` for each titled code block, in page order."""
    found = []
    for info, body in blocks(page):
        title = TITLE.search(info)
        if title:
            path = title["title"]
            found.append((path.removesuffix(APPEND), path.endswith(APPEND), body))
    return found


def exchanges(page: Path = PAGE) -> list[Exchange]:
    """The ``curl`` commands of the console blocks, each with the answer shown under it."""
    found: list[Exchange] = []
    for info, body in blocks(page):
        if info != "console":
            continue
        lines = body.splitlines()
        index = 0
        while index < len(lines):
            line = lines[index]
            index += 1
            if not line.startswith("$ curl"):
                continue
            command = line[2:]
            while command.endswith("\\"):
                command = command[:-1] + " " + lines[index].strip()
                index += 1
            exchange = Exchange(command)
            status_line = lines[index].split()
            exchange.status = int(status_line[1])
            index += 1
            while lines[index]:
                name, value = lines[index].split(": ", 1)
                exchange.headers[name] = value
                index += 1
            exchange.body = lines[index + 1]
            found.append(exchange)
    return found


def send(exchange: Exchange, port: int) -> tuple[int, dict[str, str], str]:
    args = shlex.split(exchange.command)
    url = method = data = None
    headers = {}
    position = 1
    while position < len(args):
        arg = args[position]
        if arg == "-X":
            method = args[position + 1]
            position += 1
        elif arg == "-H":
            name, value = args[position + 1].split(": ", 1)
            headers[name] = value
            position += 1
        elif arg == "-d":
            data = args[position + 1].encode()
            position += 1
        elif not arg.startswith("-"):
            url = arg.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        position += 1
    assert url and method, exchange.command
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.sqlite  # its own SQLite project: once is enough
def test_the_quickstart_builds_and_answers_as_the_page_says(tmp_path: Path) -> None:
    page = PAGE.read_text()
    for command in COMMANDS:
        assert f"$ {command}\n" in page, f"the page no longer says {command!r}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_URL"))}
    python = sys.executable
    run([python, "-m", "django", "startproject", "mysite"], tmp_path, env)
    project = tmp_path / "mysite"
    run([python, "manage.py", "startapp", "orders"], project, env)
    for path, append, text in files():
        target = project / path
        target.write_text((target.read_text() + "\n" if append else "") + text)
    run([python, "manage.py", "makemigrations", "orders"], project, env)
    run([python, "manage.py", "migrate"], project, env)
    checked = run([python, "manage.py", "check"], project, env)
    assert "no issues" in checked

    port = free_port()
    server = subprocess.Popen(
        [python, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
        cwd=project,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120  # a guard against a hang: Django starts slowly on CI
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                assert time.monotonic() < deadline, "runserver did not start"
                time.sleep(0.2)
        shown = exchanges()
        assert len(shown) == 4
        for exchange in shown:
            status, headers, body = send(exchange, port)
            assert status == exchange.status, (exchange.command, status, body)
            for name, value in exchange.headers.items():
                assert headers.get(name) == value, (exchange.command, name, headers)
            if "Idempotent-Replayed" not in exchange.headers:
                assert "Idempotent-Replayed" not in headers
            assert json.loads(body) == json.loads(exchange.body)
    finally:
        server.terminate()
        server.wait(30)

    # The page's confirm(), its task run eagerly (a real worker runs the outbox guide's version
    # in test_docs_guides.py), then the same event delivered again: one ledger entry.
    script = (
        "from mysite.celery import app\n"
        "app.conf.task_always_eager = True\n"
        "from orders.models import LedgerEntry, Order\n"
        "from orders.services import confirm\n"
        "from orders.tasks import apply_order_confirmed\n"
        "confirm(Order.objects.get(pk=1))\n"
        "entry = LedgerEntry.objects.get()\n"
        "event = {'event_id': entry.event_id, 'order_id': 1, 'amount_cents': 1250}\n"
        "apply_order_confirmed.apply(args=[event])\n"
        "print(LedgerEntry.objects.count())\n"
    )
    output = run([python, "manage.py", "shell", "-c", script], project, env)
    assert output.strip().splitlines()[-1] == "1"
