"""HTTP rows (throughput, latency, statements) and the concurrent-duplicates race."""

from __future__ import annotations

import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.loadgen import LoadResult, Mode, Response, Target, race, run_load, send
from bench.rounds import rotation
from bench.servers import Server, database_url


@dataclass(frozen=True)
class Row:
    name: str
    server: str  # the variant whose gunicorn serves it
    path: str
    mode: Mode
    label: str
    baseline: str | None = None  # the row whose p50 and req/s this one is compared with
    effect: str = ""  # Effect.name that the view writes
    expected: tuple[int, ...] = (201,)  # the answers that count as served

    @property
    def library(self) -> str:
        return LIBRARIES[self.server]


LIBRARIES = {
    "app": "django-idempotency (this app)",
    "dik": "django-idempotency-key 1.3.0",
    "drfi": "drf-idempotency 1.0.0 (database backend)",
    "drfir": "drf-idempotency 1.0.0 (Redis backend)",
    "drfik": "drf-idempotencykey 0.2.0",
}

ROWS: tuple[Row, ...] = (
    Row("bare", "app", "/bare/", "first", "bare view (plain Django)", None, "bare"),
    Row(
        "bare-atomic",
        "app",
        "/bare-atomic/",
        "first",
        "bare view in transaction.atomic",
        "bare",
        "bare-atomic",
    ),
    Row("bare-drf", "app", "/bare-drf/", "first", "bare view (DRF APIView)", "bare", "bare-drf"),
    Row("app-first", "app", "/app/", "first", "this app, first execution", "bare", "app"),
    Row("app-replay", "app", "/app/", "replay", "this app, replay", "bare", "app"),
    Row("dik-first", "dik", "/dik/", "first", "django-idempotency-key, first", "bare", "dik"),
    # django-idempotency-key replays the stored response with CONFLICT_STATUS_CODE (409).
    Row(
        "dik-replay",
        "dik",
        "/dik/",
        "replay",
        "django-idempotency-key, replay",
        "bare",
        "dik",
        (409,),
    ),
    Row("drfi-first", "drfi", "/drfi/", "first", "drf-idempotency, first", "bare", "drfi"),
    Row("drfi-replay", "drfi", "/drfi/", "replay", "drf-idempotency, replay", "bare", "drfi"),
    Row(
        "drfir-first",
        "drfir",
        "/drfir/",
        "first",
        "drf-idempotency (Redis), first",
        "bare",
        "drfir",
    ),
    Row(
        "drfir-replay",
        "drfir",
        "/drfir/",
        "replay",
        "drf-idempotency (Redis), replay",
        "bare",
        "drfir",
    ),
    Row(
        "drfik-first",
        "drfik",
        "/drfik/",
        "first",
        "drf-idempotencykey, first",
        "bare-drf",
        "drfik",
    ),
    Row(
        "drfik-replay",
        "drfik",
        "/drfik/",
        "replay",
        "drf-idempotencykey, replay",
        "bare-drf",
        "drfik",
    ),
)


def count_effects(database: str, name: str, payload: str | None = None) -> int:
    import psycopg

    sql = "SELECT count(*) FROM benchproject_effect WHERE name = %s"
    params: list[str] = [name]
    if payload is not None:
        sql += " AND payload = %s"
        params.append(payload)
    with psycopg.connect(database_url(database)) as conn:
        row = conn.execute(sql, params).fetchone()
    return int(row[0]) if row else 0


def summarize(result: LoadResult, expected: Sequence[int]) -> dict[str, Any]:
    """One run's figures; statements are those of the expected answers (not of errors)."""
    wanted = Counter(
        {key: n for key, n in result.statements.items() if int(key.split(":")[0]) in expected}
    )
    statements: int | None = None
    commits: int | None = None
    if wanted:
        counted = wanted.most_common(1)[0][0].split(":")[1]
        statements_text, _, commits_text = counted.partition("/")
        statements, commits = int(statements_text), int(commits_text or 0)
    ok = sum(n for status, n in result.statuses.items() if status in expected)
    return {
        "requests": result.requests,
        "seconds": round(result.seconds, 3),
        "rps": round(result.rps, 1),
        "ok_rps": round(ok / result.seconds, 1) if result.seconds else 0.0,
        "ok_share": round(ok / result.requests, 4) if result.requests else 0.0,
        "p50_ms": round(result.percentile(50) * 1000, 2),
        "p99_ms": round(result.percentile(99) * 1000, 2),
        "statuses": {str(k): v for k, v in sorted(result.statuses.items())},
        "statements": statements,
        "commits": commits,
        "statements_histogram": {str(k): v for k, v in sorted(result.statements.items())},
        "errors": dict(result.errors),
    }


def _median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def run_http(
    servers: dict[str, Server],
    rows: Sequence[Row],
    *,
    clients: Sequence[int],
    rounds: int,
    seconds: float,
    warmup: float,
    max_requests: int,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Alternating rounds (the order rotates each round); medians and per-round ratios."""
    by_name = {row.name: row for row in rows}
    usable = [row for row in rows if row.server in servers]
    out: list[dict[str, Any]] = []
    for n_clients in clients:
        per_round: dict[str, list[dict[str, Any]]] = {row.name: [] for row in usable}
        extra_runs: dict[str, list[int]] = {row.name: [] for row in usable}
        for row in usable:  # warm every worker (imports, connections, the user)
            run_load(_target(servers, row), clients=n_clients, seconds=warmup, mode=row.mode)
        for round_no in range(rounds):
            for row in rotation(usable, round_no):
                server = servers[row.server]
                before = count_effects(server.database, row.effect)
                result = run_load(
                    _target(servers, row),
                    clients=n_clients,
                    seconds=seconds,
                    mode=row.mode,
                    max_requests=max_requests,
                )
                executed = count_effects(server.database, row.effect) - before
                summary = summarize(result, row.expected)
                per_round[row.name].append(summary)
                # A replay row executes the view once per client (the untimed priming) only.
                expected = n_clients if row.mode == "replay" else None
                if expected is not None:
                    extra_runs[row.name].append(executed - expected)
                summary["executions"] = executed
                log(
                    f"   {n_clients:>2} clients  round {round_no + 1}/{rounds}  {row.name:<13}"
                    f" {summary['rps']:>8.1f} req/s  p50 {summary['p50_ms']:>7.2f} ms"
                    f"  p99 {summary['p99_ms']:>7.2f} ms  {summary['statuses']}"
                )
        for row in usable:
            rounds_of = per_round[row.name]
            entry: dict[str, Any] = {
                "row": row.name,
                "label": row.label,
                "library": row.library,
                "mode": row.mode,
                "clients": n_clients,
                "rounds": rounds_of,
                "rps": _median([r["rps"] for r in rounds_of]),
                "ok_rps": _median([r["ok_rps"] for r in rounds_of]),
                "ok_share": _median([r["ok_share"] for r in rounds_of]),
                "expected_statuses": list(row.expected),
                "p50_ms": _median([r["p50_ms"] for r in rounds_of]),
                "p99_ms": _median([r["p99_ms"] for r in rounds_of]),
                "statements": _mode([r["statements"] for r in rounds_of]),
                "commits": _mode([r["commits"] for r in rounds_of]),
                "statuses": _sum_statuses(rounds_of),
                "errors": _sum_errors(rounds_of),
                "baseline": row.baseline,
            }
            if row.mode == "replay":
                entry["view_executions_during_replay"] = sum(extra_runs[row.name])
            base = by_name.get(row.baseline or "")
            if base is not None and base.name in per_round:
                pairs = list(zip(rounds_of, per_round[base.name], strict=True))
                entry["p50_ratio"] = _median([a["p50_ms"] / b["p50_ms"] for a, b in pairs])
                entry["rps_ratio"] = _median([a["rps"] / b["rps"] for a, b in pairs])
                base_statements = _mode([b["statements"] for _, b in pairs])
                if entry["statements"] is not None and base_statements is not None:
                    entry["statements_added"] = entry["statements"] - base_statements
            # The same view inside transaction.atomic: the app's cost over a transactional view.
            atomic = per_round.get("bare-atomic")
            if row.baseline == "bare" and atomic and row.name != "bare-atomic":
                pairs = list(zip(rounds_of, atomic, strict=True))
                entry["p50_ratio_vs_bare_atomic"] = _median(
                    [a["p50_ms"] / b["p50_ms"] for a, b in pairs]
                )
            out.append(entry)
    return out


def _target(servers: dict[str, Server], row: Row) -> Target:
    return Target("127.0.0.1", servers[row.server].port, row.path)


def _mode(values: Sequence[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return Counter(present).most_common(1)[0][0] if present else None


def _sum_statuses(rounds_of: Sequence[dict[str, Any]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for r in rounds_of:
        total.update(r["statuses"])
    return dict(sorted(total.items()))


def _sum_errors(rounds_of: Sequence[dict[str, Any]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for r in rounds_of:
        total.update(r["errors"])
    return dict(total)


RACE_VARIANTS = (
    ("bare", "app", "/race/bare/", "no idempotency (control)"),
    ("app", "app", "/race/app/", LIBRARIES["app"]),
    ("dik", "dik", "/race/dik/", LIBRARIES["dik"]),
    ("drfi", "drfi", "/race/drfi/", LIBRARIES["drfi"]),
    ("drfir", "drfir", "/race/drfir/", LIBRARIES["drfir"]),
    ("drfik", "drfik", "/race/drfik/", LIBRARIES["drfik"]),
)


def run_race(
    servers: dict[str, Server], *, duplicates: int, log: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """``duplicates`` requests with one key at once to a view that sleeps, then one late retry."""
    out = []
    for effect, variant, path, library in RACE_VARIANTS:
        if variant not in servers:
            continue
        server = servers[variant]
        target = Target("127.0.0.1", server.port, path)
        key = str(uuid.uuid4())
        began = time.perf_counter()
        answers = race(target, duplicates=duplicates, key=key)
        elapsed = time.perf_counter() - began
        effects = count_effects(server.database, effect, key)
        late = send(target, key)
        effects_after_retry = count_effects(server.database, effect, key)
        responses = [a for a in answers if isinstance(a, Response)]
        statuses = Counter(str(a.status) for a in responses)
        first_ok = next((a for a in responses if 200 <= a.status < 300), None)
        identical = sum(
            1
            for a in responses
            if first_ok is not None and a.status == first_ok.status and a.body == first_ok.body
        )
        entry = {
            "variant": effect,
            "library": library,
            "duplicates": duplicates,
            "effects": effects,
            "statuses": dict(sorted(statuses.items())),
            "identical_to_first_success": identical,
            "failed_requests": [a for a in answers if isinstance(a, str)],
            "seconds": round(elapsed, 3),
            "late_retry_status": late.status,
            "late_retry_replayed": _replay_marker(late),
            "effects_after_late_retry": effects_after_retry,
            "sample_bodies": _sample_bodies(responses),
        }
        out.append(entry)
        log(
            f"   {effect:<6} effects={effects:<3} statuses={entry['statuses']}"
            f"  late retry {late.status} -> effects {effects_after_retry}"
        )
    return out


def _replay_marker(response: Response) -> str:
    for name in ("idempotent-replayed", "cached-from-idempotency-key"):
        if name in response.headers:
            return f"{name}: {response.headers[name]}"
    return ""


def _sample_bodies(responses: Sequence[Response]) -> dict[str, str]:
    samples: dict[str, str] = {}
    for a in responses:
        samples.setdefault(str(a.status), a.body[:300].decode("utf-8", "replace"))
    return samples
