"""The store's own cost, this version against an older one, call by call in one process.

On a busy machine whole-request figures move with the load; this alternates the two versions'
``claim`` + ``complete`` (a first execution's SQL, without the view) and ``claim`` of a completed
key (a replay) call by call on one PostgreSQL connection, so both meet the same load. A first
execution runs in a transaction that is rolled back (no WAL flush to wait for, no rows left);
the "committed" row commits it, WAL flush included, so that a version that sends the ``COMMIT``
with the store shows it.
It reports wall time, and CPU time of this process plus the PostgreSQL backend, per call::

    git show 3303a9f:django_idempotency/store.py > /tmp/store_before.py
    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/idempotency_bench_micro \\
        python -m bench.storecost /tmp/store_before.py --calls 2000

It prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import time
import uuid
from datetime import timedelta
from typing import Any

from bench.micro import _backend_cpu_reader, _setup


def _deferred(result: Any) -> dict[str, Any]:
    """``deferred=`` for a version whose claim can leave a new key's record to its store."""
    deferred = getattr(result, "deferred", None)
    return {} if deferred is None else {"deferred": deferred}


def _load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("store_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["store_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run(before_path: str, calls: int) -> dict[str, Any]:
    _setup()
    from django.db import connection, transaction

    from django_idempotency.http import store as after

    before = _load(before_path)
    stores = {"before": before.RecordStore("default"), "after": after.RecordStore("default")}
    backend_cpu = _backend_cpu_reader(connection, pooled=False)
    day = timedelta(days=1)

    def claim(store: Any, key: str, token: uuid.UUID | None = None) -> Any:
        return store.claim(
            owner="cost",
            key=key,
            fingerprint="f" * 64,
            method="POST",
            path="/x/",
            token=token or uuid.uuid4(),
            ttl=day,
            lease=None,
        )

    def first(store: Any, *, commit: bool = False) -> None:
        """Claim and store in one transaction, rolled back; with ``commit``, committed, and a
        version that can send the COMMIT with the store (``complete(commit=True)``) does."""
        token = uuid.uuid4()
        travels = commit and "commit" in inspect.signature(store.complete).parameters
        with transaction.atomic():
            result = claim(store, str(uuid.uuid4()), token)
            store.complete(
                result.record_id,
                token,
                status=201,
                headers={"Content-Type": "application/json"},
                body=b'{"id": 1}',
                **({"commit": True} if travels else {}),
                **_deferred(result),
            )
            if not commit:
                transaction.set_rollback(True)

    def committed(store: Any) -> None:
        first(store, commit=True)

    replay_key = f"cost-replay-{uuid.uuid4()}"
    token = uuid.uuid4()
    with transaction.atomic():
        result = claim(stores["after"], replay_key, token)
        stores["after"].complete(
            result.record_id, token, status=201, headers={}, body=b"{}", **_deferred(result)
        )

    def replay(store: Any) -> None:
        with transaction.atomic():
            claim(store, replay_key)

    paths = {
        "first execution (claim + store)": first,
        "first execution, committed (claim + store + COMMIT)": committed,
        "replay (claim)": replay,
    }
    samples: dict[str, dict[str, list[float]]] = {
        f"{path} {version}": {"wall": [], "cpu": []} for path in paths for version in stores
    }
    for _ in range(50):  # warm-up: imports, plan caches
        for function in paths.values():
            for store in stores.values():
                function(store)
    for index in range(calls):
        versions = list(stores) if index % 2 else list(reversed(stores))
        for path, function in paths.items():
            for version in versions:
                store = stores[version]
                server = backend_cpu()
                cpu = time.thread_time()
                began = time.perf_counter()
                function(store)
                wall = time.perf_counter() - began
                cpu = time.thread_time() - cpu
                sample = samples[f"{path} {version}"]
                sample["wall"].append(wall * 1e6)
                sample["cpu"].append(cpu * 1e6 + (backend_cpu() - server) / 1e3)
    rows = []
    for name, sample in samples.items():
        rows.append(
            {
                "row": name,
                "wall_us_median": round(statistics.median(sample["wall"]), 1),
                "cpu_us_mean": round(statistics.fmean(sample["cpu"]), 1),
            }
        )
    return {"calls": calls, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "before",
        help="an older django_idempotency/http/store.py (store.py before the layout move)",
    )
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.before, args.calls)))


if __name__ == "__main__":
    main()
