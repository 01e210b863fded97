"""A TCP proxy in front of PostgreSQL that breaks connections where a test asks it to.

The database-fault tests (tests/test_db_faults.py) point gunicorn, the relay and a Celery worker
at this proxy instead of at PostgreSQL, and keep the test's own connection direct, to check the
invariants afterwards. The proxy reads the PostgreSQL frontend protocol just enough to see each
statement a client sends (a simple ``Query``, or the text of an extended-protocol ``Parse``) and
the server's ``ReadyForQuery``, so that it can:

* :meth:`PgProxy.cut` a connection when a statement matches a pattern, either **before** the
  message is forwarded (the server never gets it) or **after** the server has answered it (the
  statement took effect, ``COMMIT`` included, but the client never hears so); the server then
  sees its client go away and rolls back whatever transaction is still open;
* :meth:`PgProxy.reset_all` connections (a TCP reset, as a restarting server or a failover does);
* :meth:`PgProxy.refuse` new connections for a while (each is reset as soon as it is accepted);
* :meth:`PgProxy.black_hole` all traffic for a while (nothing moves either way, as in a network
  partition; the connections are then reset, and new ones wait until it ends).

:class:`MySqlProxy` does the same in front of MariaDB (statements of ``COM_QUERY``; no TLS).
The PostgreSQL proxy answers the client's ``SSLRequest`` and ``GSSENCRequest`` with "no"
itself, so the session is plain text it can read. Threads, one pair per connection: the tests run
a few dozen connections at most.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102


@dataclass
class Rule:
    """Cut the connection that sends a statement matching ``pattern``, ``times`` times."""

    pattern: re.Pattern[str]
    when: str  # "before" (the server never gets it) or "after" (the server answered it)
    times: int
    following: re.Pattern[str] | None = None  # only right after a statement matching this
    hits: int = 0

    @property
    def spent(self) -> bool:
        return self.hits >= self.times


@dataclass
class _Link:
    client: socket.socket
    server: socket.socket
    closed: bool = False
    syncs: int = 0  # Query and Sync messages forwarded: each gets one ReadyForQuery
    ready: int = 0  # ReadyForQuery messages seen from the server
    cut_at: int | None = None  # reset once this many ReadyForQuery were seen; forward no more
    cut_on_next_sync: bool = False
    statements: list[str] = field(default_factory=list)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("closed")
        chunks += chunk
    return bytes(chunks)


def _pg_message(sock: socket.socket) -> tuple[bytes, bytes]:
    """The next PostgreSQL protocol message (not a startup one): its head (type byte and
    length), and its body."""
    head = _recv_exact(sock, 5)
    (length,) = struct.unpack("!i", head[1:])
    return head, _recv_exact(sock, length - 4)


def _mysql_packet(sock: socket.socket) -> tuple[bytes, bytes]:
    """The next MySQL protocol packet: its head (length and sequence number), and its body."""
    head = _recv_exact(sock, 4)
    return head, _recv_exact(sock, int.from_bytes(head[:3], "little"))


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a dead peer or a restarted server does."""
    with suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RD)  # wakes a thread blocked reading it, without a FIN
    with suppress(OSError):
        sock.close()


class PgProxy:
    """Forwards ``127.0.0.1:<port>`` to PostgreSQL at ``target``; see the module docstring."""

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.target = target
        self.faults: Counter[str] = Counter()
        """Faults injected so far, by kind: cut_before, cut_after, reset, refused, black_hole."""
        self.connections = 0
        self.pace = 0.0
        """Seconds to wait after forwarding each result's end (``CommandComplete``) to the
        client, as a slow network would between the results of a query of several statements."""
        self._rules: list[Rule] = []
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._refuse_until = 0.0
        self._flowing = threading.Event()
        self._flowing.set()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(128)
        self.port: int = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="pg-proxy-accept").start()

    # -- faults ----------------------------------------------------------------------------------

    def cut(
        self, pattern: str, *, when: str, times: int = 1, following: str | None = None
    ) -> Rule:
        """Cut the next ``times`` connections that send a statement matching ``pattern`` (a
        regular expression, searched case-insensitively), ``before`` forwarding it or ``after``
        the server's answer to it; with ``following``, only where the connection's previous
        statement matched that pattern (``COMMIT`` after the relay's lease, say)."""
        if when not in ("before", "after"):
            raise ValueError(f"when must be 'before' or 'after', not {when!r}")
        flags = re.IGNORECASE | re.DOTALL
        after = None if following is None else re.compile(following, flags)
        rule = Rule(re.compile(pattern, flags), when, times, after)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        """Forget the rules that have not fired yet."""
        with self._lock:
            self._rules.clear()

    def reset_all(self) -> int:
        """Reset every open connection; the number reset."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            self._close(link)
        self.faults["reset"] += 1
        return len(links)

    def refuse(self, seconds: float) -> None:
        """Reset every connection now, and each new one at once for ``seconds``."""
        self._refuse_until = time.monotonic() + seconds
        self.reset_all()

    @contextmanager
    def black_hole(self) -> Iterator[None]:
        """Nothing moves either way inside the block; its connections are reset at its end."""
        self.faults["black_hole"] += 1
        self._flowing.clear()
        try:
            yield
        finally:
            with self._lock:
                links, self._links = self._links, []
            self._flowing.set()
            for link in links:
                self._close(link)

    def close(self) -> None:
        with suppress(OSError):
            self._server.close()
        self._flowing.set()
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            self._close(link)

    def statements(self, pattern: str) -> int:
        """How many statements matching ``pattern`` clients sent through open connections."""
        regex = re.compile(pattern, re.IGNORECASE | re.DOTALL)
        with self._lock:
            return sum(1 for link in self._links for s in link.statements if regex.search(s))

    # -- forwarding ------------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            if time.monotonic() < self._refuse_until:
                self.faults["refused"] += 1
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            server.settimeout(None)
            link = _Link(client, server)
            with self._lock:
                self._links.append(link)
                self.connections += 1
            threading.Thread(target=self._from_client, args=(link,), daemon=True).start()
            threading.Thread(target=self._from_server, args=(link,), daemon=True).start()

    def _close(self, link: _Link) -> None:
        link.closed = True
        _reset(link.client)
        _reset(link.server)
        with self._lock, suppress(ValueError):
            self._links.remove(link)

    def _from_client(self, link: _Link) -> None:
        try:
            if not self._startup(link):
                return
            while not link.closed:
                head, body = _pg_message(link.client)
                kind = head[:1]
                self._flowing.wait()
                if link.closed:
                    return
                statement = self._statement(kind, body)
                cut = None if statement is None else self._sent(link, statement)
                if cut == "before":
                    return
                if cut == "after":
                    if kind == b"Q":
                        link.cut_at = link.syncs + 1
                    else:
                        link.cut_on_next_sync = True
                if kind in (b"Q", b"S"):
                    link.syncs += 1
                    if kind == b"S" and link.cut_on_next_sync:
                        link.cut_on_next_sync = False
                        link.cut_at = link.syncs
                link.server.sendall(head + body)
        except OSError:
            pass
        finally:
            if link.cut_at is None:  # a cut after the answer closes when the answer comes
                self._close(link)

    def _startup(self, link: _Link) -> bool:
        """Forward the startup message, answering SSL and GSS encryption requests with "no"."""
        while True:
            head = _recv_exact(link.client, 4)
            (length,) = struct.unpack("!i", head)
            body = _recv_exact(link.client, length - 4)
            (code,) = struct.unpack("!i", body[:4])
            if code in (SSL_REQUEST, GSSENC_REQUEST):
                link.client.sendall(b"N")
                continue
            link.server.sendall(head + body)
            return code != CANCEL_REQUEST

    @staticmethod
    def _statement(kind: bytes, body: bytes) -> str | None:
        if kind == b"Q":
            return body.rstrip(b"\0").decode("utf-8", "replace")
        if kind == b"P":
            _name, _, rest = body.partition(b"\0")
            return rest.partition(b"\0")[0].decode("utf-8", "replace")
        return None

    def _sent(self, link: _Link, statement: str) -> str | None:
        """Note a statement the client sent; the cut of the rule it matches (counted): "before"
        (the connection is closed now, the statement not forwarded), "after", or None."""
        previous = link.statements[-1] if link.statements else ""
        link.statements.append(statement)
        rule = self._match(statement, previous)
        if rule is None:
            return None
        self.faults[f"cut_{rule.when}"] += 1
        if rule.when == "before":
            self._close(link)
        return rule.when

    def _match(self, statement: str, previous: str) -> Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.spent or not rule.pattern.search(statement):
                    continue
                if rule.following is None or rule.following.search(previous):
                    rule.hits += 1
                    return rule
        return None

    def _from_server(self, link: _Link) -> None:
        try:
            while not link.closed:
                head, body = _pg_message(link.server)
                self._flowing.wait()
                if head[:1] == b"Z":
                    link.ready += 1
                if link.cut_at is not None or link.cut_on_next_sync:
                    # The cut statement went out: the client hears nothing more.
                    if link.cut_at is not None and link.ready >= link.cut_at:
                        return
                    continue
                link.client.sendall(head + body)
                if self.pace and head[:1] == b"C":
                    time.sleep(self.pace)
        except OSError:
            pass
        finally:
            self._close(link)


class MySqlProxy(PgProxy):
    """The same faults in front of MariaDB or MySQL, reading the client/server protocol: a
    packet is a 3-byte length and a sequence number; a command starts a sequence (number 0),
    and ``COM_QUERY`` (0x03) carries a statement. A cut ``after`` resets the connection at the
    server's first packet of its answer, which it sends once the statement has run: for a
    ``COMMIT`` (one OK packet), the whole answer. It does not turn TLS off: use it with a server
    that offers none (``have_ssl`` DISABLED), as the test MariaDB does."""

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 3306)) -> None:
        super().__init__(target)

    def _from_client(self, link: _Link) -> None:
        try:
            while not link.closed:
                head, body = _mysql_packet(link.client)
                self._flowing.wait()
                if link.closed:
                    return
                if head[3] == 0 and body[:1] == b"\x03":
                    cut = self._sent(link, body[1:].decode("utf-8", "replace"))
                    if cut == "before":
                        return
                    if cut == "after":
                        link.cut_on_next_sync = True
                link.server.sendall(head + body)
        except OSError:
            pass
        finally:
            if not link.cut_on_next_sync:
                self._close(link)

    def _from_server(self, link: _Link) -> None:
        try:
            while not link.closed:
                head, body = _mysql_packet(link.server)
                self._flowing.wait()
                if link.cut_on_next_sync:
                    return  # the statement ran; its answer never reaches the client
                link.client.sendall(head + body)
        except OSError:
            pass
        finally:
            self._close(link)


@contextmanager
def proxy_for(settings: Mapping[str, Any]) -> Iterator[PgProxy]:
    """A proxy in front of the server of ``settings`` (a ``DATABASES`` entry): a
    :class:`PgProxy` for PostgreSQL, a :class:`MySqlProxy` for MariaDB or MySQL."""
    mysql = "mysql" in settings["ENGINE"]
    port = int(settings["PORT"] or (3306 if mysql else 5432))
    target = (settings["HOST"] or "127.0.0.1", port)
    proxy = MySqlProxy(target) if mysql else PgProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()


@contextmanager
def repointed(alias: str, port: int, **options: Any) -> Iterator[None]:
    """Inside the block, every thread's new connection to ``alias`` goes to
    ``127.0.0.1:port`` (a proxy, or a port nobody listens on), with ``options`` added to its
    ``OPTIONS``. Afterwards the settings are restored, so that the test database's flush
    reaches the real server; this thread's connection is closed on the way in and out."""
    from django.db import connections

    settings = connections[alias].settings_dict
    saved = dict(settings)
    connections[alias].close()
    settings.update(
        HOST="127.0.0.1", PORT=port, OPTIONS={**settings.get("OPTIONS", {}), **options}
    )
    try:
        yield
    finally:
        connections[alias].close()
        settings.clear()
        settings.update(saved)


@contextmanager
def mysql_proxy(target: tuple[str, int] = ("127.0.0.1", 3306)) -> Iterator[MySqlProxy]:
    proxy = MySqlProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()


@contextmanager
def pg_proxy(target: tuple[str, int] = ("127.0.0.1", 5432)) -> Iterator[PgProxy]:
    proxy = PgProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()
