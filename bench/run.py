"""The benchmark runner behind ``scripts/bench.sh`` (``make bench``).

It creates its databases (``idempotency_bench_*``), runs every section side by side in
alternating rounds, prints tables, and writes ``bench/results/results.json`` (every figure)
and ``bench/results/results.md`` (the tables, for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.compare import COMPARE_SECTIONS, compare_main
from bench.httpbench import ROWS, run_http, run_race
from bench.microrun import MICRO_BACKENDS, micro_tables, run_micro
from bench.servers import (
    REPO,
    RESULTS,
    Server,
    postgres_version,
    prepare,
    recreate_database,
    variant_env,
)

SECTIONS = ("micro", "http", "race", "consumer", "purge")
CHARTS = REPO / "docs" / "assets" / "benchmarks"
VARIANTS = ("app", "dik", "drfi", "drfir", "drfik")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
HTTP_WORKERS = 4
RACE_WORKERS, RACE_THREADS = 4, 4


def log(message: str) -> None:
    print(message, flush=True)


def database_for(variant: str) -> str:
    return f"idempotency_bench_{variant}"


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import django

    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "postgresql": postgres_version(),
        "python": platform.python_version(),
        "django": django.get_version(),
        "platform": platform.platform(),
        # The machine is shared: a load average well above 0 means other work ran alongside.
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def flush_redis() -> None:
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()


def start_servers(
    variants: Sequence[str], problems: list[str], *, workers: int, threads: int, tag: str
) -> dict[str, Server]:
    servers = {
        v: Server(v, database_for(v), workers=workers, threads=threads, name=f"{tag}-{v}").start()
        for v in variants
    }
    ready: dict[str, Server] = {}
    for variant, server in servers.items():
        try:
            server.wait_ready()
        except RuntimeError as exc:
            problems.append(f"{variant} server did not start: {exc}")
            log(f"!! {variant}: {exc}")
            server.stop()
        else:
            ready[variant] = server
    return ready


def run_consumer(events: int, rounds: int, problems: list[str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.consumer", "--events", str(events), "--rounds", str(rounds)],
        env=variant_env("app", database_for("app")),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode:
        problems.append(f"consumer benchmark failed:\n{done.stderr.strip()[-2000:]}")
        return {"error": done.stderr.strip()[-2000:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_purge(quick: bool, problems: list[str]) -> dict[str, Any]:
    """Call bench/purge.py's ``main(argv) -> dict`` in its own process (its own settings)."""
    if not (REPO / "bench" / "purge.py").exists():
        problems.append("bench/purge.py does not exist: no purge figures")
        return {"error": "bench/purge.py does not exist"}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        code = (
            "import json, sys\n"
            "from bench.purge import main\n"
            "result = main(sys.argv[2:])\n"
            "with open(sys.argv[1], 'w') as f:\n"
            "    json.dump(result, f, default=str)\n"
        )
        argv = ["--quick"] if quick else []
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
        done = subprocess.run(
            [sys.executable, "-c", code, out.name, *argv],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode:
            problems.append(f"bench/purge.py failed:\n{done.stderr.strip()[-2000:]}")
            return {"error": done.stderr.strip()[-2000:], "stdout": done.stdout[-2000:]}
        result: dict[str, Any] = json.load(open(out.name))  # noqa: SIM115
    return result


# -- targets (issue 12) ------------------------------------------------------------------------


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    http = {(r["row"], r["clients"]): r for r in results.get("http", [])}
    micro = {
        (m["backend"], r["row"]): r for m in results.get("micro", []) for r in m.get("rows", [])
    }
    consumer = {r["row"]: r for r in results.get("consumer", {}).get("rows", [])}
    out: list[dict[str, Any]] = []

    def add(name: str, value: Any, ok: Callable[[Any], bool], unit: str = "x") -> None:
        out.append(_target(name, value, ok, unit))

    first = micro.get(("postgres", "app-first"), {})
    add(
        "first execution in-process <= 2.2x the bare view (PostgreSQL, median of rounds)",
        first.get("ratio_to_bare"),
        lambda v: v <= 2.2,
    )
    add(
        "the same, best rounds (each row's fastest round)",
        first.get("best_ratio"),
        lambda v: v <= 2.2,
    )
    http_first = http.get(("app-first", 8), {})
    add(
        "first execution >= 0.6x the bare view's req/s (HTTP, 8 clients)",
        http_first.get("rps_ratio"),
        lambda v: v >= 0.6,
    )
    replay = http.get(("app-replay", 8), {})
    add(
        "replay p50 below the bare view's (HTTP, 8 clients)",
        replay.get("p50_ratio"),
        lambda v: v < 1.0,
    )
    add(
        "replay req/s above the bare view's (HTTP, 8 clients)",
        replay.get("rps_ratio"),
        lambda v: v > 1.0,
    )
    for row, limit in (
        ("@idempotent_consumer + effect", 1.5),
        ("@idempotent_consumer + effect, ASYNC_DELIVERY_COUNT", 1.5),
        ("@idempotent_consumer + effect, redelivered=False", 1.5),
        ("duplicate (@idempotent_consumer)", 0.6),
        ("try_reserve + effect", 1.3),
    ):
        add(
            f"{row} <= {limit}x the effect alone (p50)",
            consumer.get(row, {}).get("p50_ratio_to_effect_alone"),
            lambda v, limit=limit: v <= limit,
        )
    added_first = http_first.get("statements_added")
    if added_first is None and first.get("statements") is not None:
        added_first = first["statements"] - micro[("postgres", "bare")].get("statements", 1)
    add("statements added on a first execution <= 2", added_first, lambda v: v <= 2, "")
    replay_micro = micro.get(("postgres", "app-replay"), {})
    added_replay = replay.get("statements_added")
    if added_replay is None and replay_micro.get("statements") is not None:
        added_replay = replay_micro["statements"] - micro[("postgres", "bare")]["statements"]
    add("statements added on a replay <= 1", added_replay, lambda v: v <= 1, "")
    app_race = next((r for r in results.get("race", []) if r["variant"] == "app"), None)
    add(
        "zero double effects under 16 concurrent duplicates (effects == 1)",
        app_race and app_race["effects"],
        lambda v: v == 1,
        " effect(s)",
    )
    return out


def _target(name: str, value: Any, ok: Callable[[Any], bool], unit: str = "") -> dict[str, Any]:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return {"target": name, "value": None, "met": None, "text": "not measured"}
    return {"target": name, "value": value, "met": bool(ok(value)), "text": f"{value}{unit}"}


# -- tables ------------------------------------------------------------------------------------


def tables(results: dict[str, Any]) -> str:
    lines: list[str] = []
    m = results.get("machine")
    if m:
        lines += [
            f"Machine: {m['cores']} cores, {m['cpu_model']}, {m['memory_gib']} GiB;"
            f" PostgreSQL {m['postgresql']}; Python {m['python']}; Django {m['django']};"
            f" load average {m['loadavg_at_start']} at start,"
            f" {m.get('loadavg_at_end', '?')} at end.",
            "",
        ]
    if results.get("micro"):
        lines += micro_tables(results["micro"])
    if results.get("http"):
        lines += [
            "### HTTP (gunicorn, PostgreSQL)",
            "",
            "| row | clients | req/s | p50 ms | p99 ms | p50 vs base | p50 vs atomic bare |"
            " req/s vs base | SQL/req | commits/req | served | statuses |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in results["http"]:
            base = f" ({r['baseline']})" if r.get("p50_ratio") else ""
            lines.append(
                f"| {r['label']} | {r['clients']} | {r['rps']:.0f} | {r['p50_ms']:.2f} |"
                f" {r['p99_ms']:.2f} | {_ratio(r.get('p50_ratio'))}{base} |"
                f" {_ratio(r.get('p50_ratio_vs_bare_atomic'))} |"
                f" {_ratio(r.get('rps_ratio'))} | {_na(r.get('statements'))} |"
                f" {_na(r.get('commits'))} | {r['ok_share']:.0%} |"
                f" {_statuses(r['statuses'], r.get('errors'))} |"
            )
        lines.append("")
    if results.get("race"):
        lines += [
            "### 16 concurrent duplicates (one key, a view that sleeps 200 ms)",
            "",
            "| library | effects | statuses of the 16 | late retry |",
            "|---|---:|---|---|",
        ]
        for r in results["race"]:
            late = f"{r['late_retry_status']} {r['late_retry_replayed']}".strip()
            lines.append(
                f"| {r['library']} | {r['effects']} | {_statuses(r['statuses'], None)} |"
                f" {late}, effects then {r['effects_after_late_retry']} |"
            )
        lines.append("")
    consumer = results.get("consumer", {})
    if consumer.get("rows"):
        lines += [
            f"### Consumer (one process, {consumer['events_per_round']} events per row per round,"
            " one transaction per event)",
            "",
            "| row | events/s | p50 ms | p99 ms | SQL/event | commits/event |"
            " events/s vs effect alone | p50 vs effect alone | CPU µs/event |"
            " CPU vs effect alone |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in consumer["rows"]:
            if "events_per_s" not in r:
                lines.append(f"| {r['row']} | error: {r.get('error', '?')} | | | | | | | | |")
                continue
            lines.append(
                f"| {r['row']} | {r['events_per_s']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} |"
                f" {r['statements']} | {r['commits']} |"
                f" {_ratio(r.get('ratio_to_effect_alone'))} |"
                f" {_ratio(r.get('p50_ratio_to_effect_alone'))} |"
                f" {r.get('cpu_us_per_event', 0):.0f} |"
                f" {_ratio(r.get('cpu_ratio_to_effect_alone'))} |"
            )
        lines.append("")
        actor_rows = [r for r in consumer["rows"] if "ratio_to_actor_alone" in r]
        if actor_rows:
            lines += [
                "Dramatiq: `idempotent_actor` against the actor alone, in the same rounds:",
                "",
                "| row | events/s vs actor alone | CPU vs actor alone |",
                "|---|---:|---:|",
            ]
            lines += [
                f"| {r['row']} | {_ratio(r.get('ratio_to_actor_alone'))} |"
                f" {_ratio(r.get('cpu_ratio_to_actor_alone'))} |"
                for r in actor_rows
            ]
            lines.append("")
    purge = results.get("purge")
    if purge and all(isinstance(purge.get(k), dict) for k in ("delete", "drop")):
        lines += [
            f"### Purge (bench/purge.py: {_num(purge.get('rows_expired'))} expired +"
            f" {_num(purge.get('rows_live'))} live rows, {purge.get('inserters', '?')} threads"
            f" inserting {purge.get('insert_rate_per_thread', '?')}/s each meanwhile)",
            "",
            "| method | rows | seconds | rows/s | insert p50 / p99 ms, quiet |"
            " insert p50 / p99 ms, during |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for label, key, rows_key in (
            ("batched DELETE (delete_expired)", "delete", "rows_deleted"),
            ("partition DROP (drop_expired_partitions)", "drop", "rows_dropped"),
        ):
            r = purge[key]
            quiet, during = r.get("inserts_baseline", {}), r.get("inserts_during", {})
            lines.append(
                f"| {label} | {_num(r.get(rows_key))} | {r.get('seconds', '?')} |"
                f" {_num(r.get('rows_per_second'))} |"
                f" {quiet.get('p50_ms', '?')} / {quiet.get('p99_ms', '?')} |"
                f" {during.get('p50_ms', '?')} / {during.get('p99_ms', '?')} |"
            )
        lines.append("")
    elif purge:
        lines += ["### Purge (bench/purge.py)", ""]
        lines += [f"- {k}: {v}" for k, v in _flatten(purge)]
        lines.append("")
    if results.get("targets"):
        lines += ["### Targets (issue 12)", "", "| target | measured | met |", "|---|---|---|"]
        for t in results["targets"]:
            met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
            lines.append(f"| {t['target']} | {t['text']} | {met} |")
        lines.append("")
    if results.get("problems"):
        lines += ["### Problems", ""] + [f"- {p}" for p in results["problems"]] + [""]
    return "\n".join(lines)


def _flatten(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            items += _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, list) and len(value) > 8:
            items.append((f"{prefix}{key}", f"[{len(value)} values]"))
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _num(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int | float) else "?"


def _ratio(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.2f}x"


def _na(value: Any) -> str:
    return "" if value is None else str(value)


def _statuses(statuses: dict[str, int], errors: dict[str, int] | None) -> str:
    text = ", ".join(f"{k}: {v}" for k, v in statuses.items())
    if errors:
        text += "; errors " + ", ".join(f"{k}: {v}" for k, v in errors.items())
    return text


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/bench.sh", description=__doc__)
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections: %(default)s")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="servers: %(default)s")
    parser.add_argument("--clients", default="8,32", help="concurrent clients: %(default)s")
    # Many short alternating rounds rather than a few long ones: on a shared machine a burst of
    # other work then hits every row alike, and the per-round ratios stay comparable.
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per row")
    parser.add_argument("--seconds", type=float, default=2.5, help="seconds per row per round")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per row")
    parser.add_argument("--max-requests", type=int, default=50_000, help="per row per round")
    parser.add_argument("--duplicates", type=int, default=16, help="concurrent duplicates")
    parser.add_argument("--events", type=int, default=1000, help="consumer events per round")
    parser.add_argument(
        "--micro-backends",
        default=",".join(MICRO_BACKENDS),
        help="databases of the in-process section: %(default)s",
    )
    parser.add_argument("--micro-requests", type=int, default=300, help="per row per round")
    parser.add_argument("--micro-rounds", type=int, default=9, help="in-process rounds")
    parser.add_argument(
        "--charts",
        default=str(CHARTS),
        help="where the SVG charts go (empty: none); default %(default)s",
    )
    parser.add_argument("--quick", action="store_true", help="tiny run to check it works")
    parser.add_argument(
        "--compare-with",
        metavar="PATH",
        help="another checkout (e.g. before a change): its micro (PostgreSQL) and consumer"
        " sections against this one's, one process per checkout per round (bench/compare.py)",
    )
    parser.add_argument(
        "--output", help="default bench/results/results.json (compare.json with --compare-with)"
    )
    args = parser.parse_args(argv)
    if not args.output:
        args.output = str(RESULTS / ("compare.json" if args.compare_with else "results.json"))
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.events = 1, 1.0, 0.3, 50
        args.micro_requests, args.micro_rounds = 20, 1
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    unknown = (set(sections) - set(SECTIONS)) | (set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown section or variant: {sorted(unknown)}")
    clients = [int(c) for c in args.clients.split(",")]
    if args.compare_with:
        sections = [s for s in sections if s in COMPARE_SECTIONS]
        return compare_main(args, sections, machine(), log)
    started = time.monotonic()
    problems: list[str] = []
    results: dict[str, Any] = {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {
            "sections": sections,
            "variants": variants,
            "clients": clients,
            "rounds": args.rounds,
            "seconds_per_row_per_round": args.seconds,
            "max_requests_per_row_per_round": args.max_requests,
            "http_server": f"gunicorn --workers {HTTP_WORKERS} --worker-class sync",
            "race_server": f"gunicorn --workers {RACE_WORKERS} --threads {RACE_THREADS}"
            " --worker-class gthread",
            "duplicates": args.duplicates,
            "consumer_events_per_round": args.events,
            "micro_requests_per_round": args.micro_requests,
            "micro_rounds": args.micro_rounds,
        },
        "problems": problems,
    }
    log(f"== machine: {json.dumps(results['machine'])}")

    if "micro" in sections:
        backends = [b for b in args.micro_backends.split(",") if b]
        log(f"== in-process: {', '.join(backends)}")
        results["micro"] = run_micro(
            backends,
            requests=args.micro_requests,
            rounds=args.micro_rounds,
            problems=problems,
            log=log,
        )

    needs_servers = {"http", "race"} & set(sections)
    db_variants = variants if needs_servers else (["app"] if "consumer" in sections else [])
    log("== databases: " + ", ".join(database_for(v) for v in db_variants))

    def setup(variant: str) -> str | None:
        try:
            recreate_database(database_for(variant))
            prepare(variant, database_for(variant))
        except Exception as exc:  # noqa: BLE001 - reported and the variant is left out
            return f"{variant}: {exc}"
        return None

    with ThreadPoolExecutor(2) as pool:
        for failure in pool.map(setup, db_variants):
            if failure:
                problems.append(f"setting up {failure}")
                log(f"!! setting up {failure}")
    variants = [v for v in variants if not any(p.startswith(f"setting up {v}:") for p in problems)]
    if {"dik", "drfir"} & set(variants):
        flush_redis()

    if "http" in sections:
        log(f"== HTTP: {len(clients)} client levels x {args.rounds} rounds x {args.seconds}s")
        servers = start_servers(variants, problems, workers=HTTP_WORKERS, threads=1, tag="http")
        try:
            rows = [row for row in ROWS if row.server in servers]
            results["http"] = run_http(
                servers,
                rows,
                clients=clients,
                rounds=args.rounds,
                seconds=args.seconds,
                warmup=args.warmup,
                max_requests=args.max_requests,
                log=log,
            )
        finally:
            for server in servers.values():
                server.stop()
    if "race" in sections:
        log(f"== {args.duplicates} concurrent duplicates")
        servers = start_servers(
            variants, problems, workers=RACE_WORKERS, threads=RACE_THREADS, tag="race"
        )
        try:
            results["race"] = run_race(servers, duplicates=args.duplicates, log=log)
        finally:
            for server in servers.values():
                server.stop()
    if "consumer" in sections:
        log("== consumer")
        results["consumer"] = run_consumer(args.events, args.rounds, problems)
    if "purge" in sections:
        log("== purge (bench/purge.py)")
        results["purge"] = run_purge(args.quick, problems)

    results["targets"] = targets(results)
    results["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["seconds"] = round(time.monotonic() - started, 1)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    text = tables(results)
    output.with_suffix(".md").write_text(text + "\n")
    if args.charts:
        try:
            from bench.charts import render

            for chart in render(results, Path(args.charts)):
                log(f"== chart {chart}")
        except ImportError as exc:  # matplotlib is in the bench extra
            problems.append(f"no charts: {exc}")
    print()
    print(text)
    log(f"== wrote {output} and {output.with_suffix('.md')} in {results['seconds']}s")
    return 1 if problems else 0
