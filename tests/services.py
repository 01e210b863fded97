"""Probe the services the test suite can use; print one line each.

Usage: python tests/services.py NAME...   (postgres, mariadb, redis, rabbitmq)
Prints ``NAME up`` or ``NAME down`` and exits 0; the caller decides what a down service means.
"""

from __future__ import annotations

import socket
import sys

ADDRESSES = {
    "postgres": ("127.0.0.1", 5432),
    "mariadb": ("127.0.0.1", 3306),
    "redis": ("127.0.0.1", 6379),
    "rabbitmq": ("127.0.0.1", 5672),
}

BROKER_URLS = {
    "redis": "redis://127.0.0.1:6379/15",
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672//",
}


def reachable(name: str, timeout: float = 1.0) -> bool:
    host, port = ADDRESSES[name]
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    for service in sys.argv[1:] or list(ADDRESSES):
        print(service, "up" if reachable(service) else "down")
