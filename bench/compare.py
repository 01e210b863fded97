"""``python -m bench --compare-with PATH``: this checkout's code against another checkout's.

For a change that claims "no change of behaviour" (a move of modules, a tidy), the in-process
microbenchmark (bench/micro.py, PostgreSQL) and the consumer rows (bench/consumer.py) of both
checkouts, round by round. Each round starts one process per checkout, with ``PYTHONPATH`` at
that checkout, so that each runs its own bench/ against its own package; the two take turns
(their order rotates from round to round, bench/rounds.py), so that outside load on a shared
machine hits both alike. Each checkout migrates a database of its own.

Per row: the median over the rounds of each checkout, ``this/base`` as the median of the
per-round ratios (never the ratio of two medians), the spread of those ratios, how many rounds
this checkout was the slower, and the noise: each checkout's own spread between its rounds (the
interquartile range as a share of its median). The same ratio is taken again on each row's ratio
to the baseline row of its own process and round (the bare view, the effect alone), where
outside load cancels out. A row is "slower beyond noise" when its ratio exceeds 1 by more than
the larger of the two noises, or when it lost against the baseline row in 3 rounds of 4 (the
lower quartile of those per-round ratios above 1, from 5 rounds on).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.rounds import median_ratio, rotation
from bench.servers import (
    REPO,
    database_url,
    prepare_url,
    recreate_database,
    run_python,
    variant_env,
)

COMPARE_SECTIONS = ("micro", "consumer")
DATABASES = {"base": "idempotency_bench_compare_base", "this": "idempotency_bench_compare_this"}
QUARTILE_ROUNDS = 5
"""Rounds from which a lower quartile of per-round ratios above 1 counts as slower."""
Measures = dict[str, dict[str, float]]
"""row -> {"us": wall µs per call, "cpu": CPU µs per call, "rel": us / the baseline row's}."""


def _micro_measures(result: dict[str, Any]) -> Measures:
    return {
        row["row"]: {
            "us": row["us_per_request"],
            "cpu": row["cpu_us_per_request"],
            "rel": row["ratio_to_bare"],
        }
        for row in result["rows"]
    }


def _consumer_measures(result: dict[str, Any]) -> Measures:
    out: Measures = {}
    for row in result["rows"]:
        if not row.get("rounds"):
            continue
        (one,) = row["rounds"]  # one round per process
        out[row["row"]] = {
            "us": 1e6 / one["events_per_s"],
            "cpu": one["client_cpu_us"] + one["server_cpu_us"],
        }
    alone = out.get("effect alone")
    for measures in out.values():
        if alone:
            measures["rel"] = measures["us"] / alone["us"]
    return out


def _one_round(args: list[str], checkout: Path, database: str) -> Any:
    """The JSON document that ``python args`` prints last, run in ``checkout``."""
    done = run_python(args, variant_env("app", database, checkout), checkout, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} in {checkout}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _micro_rows(checkout: Path) -> list[str]:
    code = "import json, bench.micro as m; print(json.dumps(m.ROWS))"
    return list(_one_round(["-c", code], checkout, ""))


def _command(section: str, rows: Sequence[str], requests: int, events: int) -> list[str]:
    if section == "micro":
        command = ["-m", "bench.micro", "--requests", str(requests), "--rounds", "1"]
        return [*command, "--rows", ",".join(rows)]
    return ["-m", "bench.consumer", "--events", str(events), "--rounds", "1"]


def _iqr_share(values: Sequence[float]) -> float:
    """The interquartile range of ``values`` as a share of their median."""
    if len(values) < 2:
        return 0.0
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return (high - low) / statistics.median(values)


def summarise(rounds: dict[str, list[Measures]]) -> list[dict[str, Any]]:
    """Per row (the rows both checkouts measured), ``this`` against ``base``."""
    base, this = rounds["base"], rounds["this"]
    names = [name for name in this[0] if all(name in r for r in [*base, *this])]
    out = []
    for name in names:
        b = {key: [r[name][key] for r in base] for key in base[0][name]}
        t = {key: [r[name][key] for r in this] for key in this[0][name]}
        ratios = [x / y for x, y in zip(t["us"], b["us"], strict=True)]
        noise = max(_iqr_share(b["us"]), _iqr_share(t["us"]))
        ratio = median_ratio(t["us"], b["us"])
        entry: dict[str, Any] = {
            "row": name,
            "base_us": round(statistics.median(b["us"]), 1),
            "this_us": round(statistics.median(t["us"]), 1),
            "ratio": ratio,
            "ratio_min": round(min(ratios), 3),
            "ratio_max": round(max(ratios), 3),
            "rounds_slower": sum(r > 1 for r in ratios),
            "rounds": len(ratios),
            "base_noise": round(_iqr_share(b["us"]), 3),
            "this_noise": round(_iqr_share(t["us"]), 3),
            "cpu_ratio": median_ratio(t["cpu"], b["cpu"]),
            "base_us_rounds": [round(x, 1) for x in b["us"]],
            "this_us_rounds": [round(x, 1) for x in t["us"]],
            "slower_beyond_noise": ratio - 1 > noise,
        }
        if "rel" in b and "rel" in t:
            # Against the baseline row of the same process and round (the bare view, the effect
            # alone): outside load on the whole round cancels out, and what is left is the
            # library's own share. Slower there when this checkout lost in 3 rounds of 4.
            rel = [x / y for x, y in zip(t["rel"], b["rel"], strict=True)]
            low, _, high = statistics.quantiles(rel, n=4, method="inclusive")
            entry["base_rel"] = round(statistics.median(b["rel"]), 3)
            entry["this_rel"] = round(statistics.median(t["rel"]), 3)
            entry["rel_ratio"] = median_ratio(t["rel"], b["rel"])
            entry["rel_ratio_iqr"] = [round(low, 3), round(high, 3)]
            entry["slower_beyond_noise"] |= len(rel) >= QUARTILE_ROUNDS and low > 1
        out.append(entry)
    return out


def run_compare(
    other: Path,
    sections: Sequence[str],
    *,
    requests: int,
    micro_rounds: int,
    events: int,
    consumer_rounds: int,
    problems: list[str],
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    checkouts = {"base": other.resolve(), "this": REPO}
    for label, checkout in checkouts.items():
        recreate_database(DATABASES[label])
        prepare_url(database_url(DATABASES[label]), checkout=checkout)
    rows = [r for r in _micro_rows(REPO) if r in _micro_rows(checkouts["base"])]
    measure = {"micro": _micro_measures, "consumer": _consumer_measures}
    results: dict[str, Any] = {"checkouts": {k: str(v) for k, v in checkouts.items()}}
    for section in sections:
        count = micro_rounds if section == "micro" else consumer_rounds
        command = _command(section, rows, requests, events)
        log(f"== {section}: {count} rounds, one process per checkout per round")
        rounds: dict[str, list[Measures]] = {"base": [], "this": []}
        try:
            for round_no in range(count):
                for label in rotation(list(checkouts), round_no):
                    result = _one_round(command, checkouts[label], DATABASES[label])
                    rounds[label].append(measure[section](result))
                log(f"   round {round_no + 1}/{count}")
        except (RuntimeError, ValueError, KeyError) as exc:
            problems.append(f"compare {section}: {exc}")
            log(f"!! compare {section}: {exc}")
            continue
        results[section] = summarise(rounds)
        results[f"{section}_rounds"] = rounds  # every figure, round by round
    return results


def compare_table(results: dict[str, Any]) -> str:
    lines = [
        f"base: {results['checkouts']['base']}, this: {results['checkouts']['this']}",
        "",
        "| section | row | base µs | this µs | this/base | rounds' ratios | this slower in |"
        " noise (IQR/median) base / this | CPU this/base | vs baseline row base / this |"
        " that, this/base (IQR of rounds) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for section in COMPARE_SECTIONS:
        for r in results.get(section, []):
            flag = " **slower beyond noise**" if r["slower_beyond_noise"] else ""
            rel = " |"
            if "base_rel" in r:
                low, high = r["rel_ratio_iqr"]
                rel = f"{r['base_rel']:.2f} / {r['this_rel']:.2f} | {r['rel_ratio']:.3f}"
                rel += f" ({low:.2f}-{high:.2f}) |"
            lines.append(
                f"| {section} | {r['row']} | {r['base_us']:.0f} | {r['this_us']:.0f} |"
                f" {r['ratio']:.3f}{flag} | {r['ratio_min']:.2f}-{r['ratio_max']:.2f} |"
                f" {r['rounds_slower']}/{r['rounds']} |"
                f" {r['base_noise']:.1%} / {r['this_noise']:.1%} |"
                f" {r['cpu_ratio']:.3f} | {rel}"
            )
    return "\n".join(lines)


def compare_main(
    args: argparse.Namespace,
    sections: Sequence[str],
    machine: dict[str, Any],
    log: Callable[[str], None] = print,
) -> int:
    """``python -m bench --compare-with PATH``: written to ``--output`` (compare.json) and its
    table beside it (compare.md); 1 if anything failed."""
    problems: list[str] = []
    results: dict[str, Any] = {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine,
        "config": {
            "micro_requests_per_round": args.micro_requests,
            "micro_rounds": args.micro_rounds,
            "consumer_events_per_round": args.events,
            "consumer_rounds": args.rounds,
        },
        "problems": problems,
    }
    log(f"== machine: {json.dumps(machine)}")
    results.update(
        run_compare(
            Path(args.compare_with),
            sections,
            requests=args.micro_requests,
            micro_rounds=args.micro_rounds,
            events=args.events,
            consumer_rounds=args.rounds,
            problems=problems,
            log=log,
        )
    )
    machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    text = compare_table(results)
    output.with_suffix(".md").write_text(text + "\n")
    log("\n" + text)
    for problem in problems:
        log(f"!! {problem}")
    return 1 if problems else 0
