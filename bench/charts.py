"""SVG charts of a benchmark run (matplotlib, the ``bench`` extra), for docs/benchmarks.md.

Each chart shows, per library and path, the cost relative to its baseline as a bar (the median
of the per-round ratios) with the rounds' spread (the lowest and highest round) as an error bar,
and beside it the statements each request sends. Lower is better everywhere; the dashed line is
the baseline (1.0x).

``python -m bench.charts bench/results/results.json docs/assets/benchmarks`` draws them again
from a saved run.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

APP_COLOR = "#2b6cb0"
FLOOR_COLOR = "#9aa5b1"
BASE_COLOR = "#cbd2d9"
OTHER_COLOR = "#dd6b20"


def _bars(
    title: str,
    labels: Sequence[str],
    ratios: Sequence[float],
    spreads: Sequence[tuple[float, float]],
    statements: Sequence[int | None],
    colors: Sequence[str],
    path: Path,
    *,
    xlabel: str,
    target: float | None = None,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "django-idempotency"  # stable ids: small diffs
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: small, searchable files
    height = 0.9 + 0.38 * len(labels)
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(9.5, height), sharey=True, gridspec_kw={"width_ratios": [4, 1]}
    )
    ys = list(range(len(labels)))[::-1]
    low = [max(r - lo, 0.0) for r, (lo, _) in zip(ratios, spreads, strict=True)]
    high = [max(hi - r, 0.0) for r, (_, hi) in zip(ratios, spreads, strict=True)]
    left.barh(ys, ratios, color=colors, xerr=[low, high], capsize=3, ecolor="#3e4c59")
    for y, ratio, (_, hi) in zip(ys, ratios, spreads, strict=True):
        left.text(max(ratio, hi) + 0.03, y, f"{ratio:.2f}x", va="center", fontsize=8)
    left.axvline(1.0, color="#3e4c59", linestyle="--", linewidth=0.8)
    if target is not None:
        left.axvline(target, color="#c53030", linestyle=":", linewidth=1)
    left.set_yticks(ys, labels, fontsize=8)
    left.set_xlabel(xlabel, fontsize=8)
    left.set_xlim(0, max([*(hi for _, hi in spreads), *ratios, 1.0]) * 1.18)
    left.tick_params(axis="x", labelsize=8)
    counts = [0 if s is None else s for s in statements]
    right.barh(ys, counts, color=colors)
    for y, count in zip(ys, statements, strict=True):
        right.text(
            (count or 0) + 0.1, y, "" if count is None else str(count), va="center", fontsize=8
        )
    right.set_xlabel("statements / request", fontsize=8)
    right.set_xlim(0, max([*counts, 1]) + 1.5)
    right.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg")
    plt.close(fig)
    return path


def _spread(values: Sequence[float]) -> tuple[float, float]:
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


def micro_charts(results: list[dict[str, Any]], out: Path) -> list[Path]:
    paths = []
    for result in results:
        rows = result["rows"]
        paths.append(
            _bars(
                f"In-process, {result['backend']}: µs per request relative to the bare view",
                [r["label"] for r in rows],
                [r["ratio_to_bare"] for r in rows],
                [(r["ratio_min"], r["ratio_max"]) for r in rows],
                [r.get("statements") for r in rows],
                [
                    FLOOR_COLOR
                    if r["row"].startswith("floor")
                    else APP_COLOR
                    if r["row"].startswith("app")
                    else BASE_COLOR
                    for r in rows
                ],
                out / f"micro-{result['backend']}.svg",
                xlabel="time per request / bare view (median of rounds; bar: lowest-highest)",
                target=2.2 if result["backend"] in ("postgres", "pgbouncer") else None,
            )
        )
    return paths


def _http_color(row: str) -> str:
    if row.startswith("app"):
        return APP_COLOR
    return BASE_COLOR if row.startswith("bare") else OTHER_COLOR


def http_chart(rows: list[dict[str, Any]], out: Path, clients: int) -> Path | None:
    chosen = [r for r in rows if r["clients"] == clients and r.get("baseline")]
    by_name = {r["row"]: r for r in rows if r["clients"] == clients}
    if not chosen:
        return None
    ratios, spreads = [], []
    for row in chosen:
        base = by_name[row["baseline"]]
        per_round = [
            a["p50_ms"] / b["p50_ms"] for a, b in zip(row["rounds"], base["rounds"], strict=True)
        ]
        ratios.append(statistics.median(per_round))
        spreads.append(_spread(per_round))
    return _bars(
        f"HTTP, {clients} clients: p50 latency relative to the bare view",
        [r["label"] for r in chosen],
        ratios,
        spreads,
        [r.get("statements") for r in chosen],
        [
            APP_COLOR
            if r["row"].startswith("app")
            else BASE_COLOR
            if "bare" in r["row"]
            else OTHER_COLOR
            for r in chosen
        ],
        out / f"http-{clients}.svg",
        xlabel="p50 / bare view's p50 (median of rounds; bar: lowest-highest)",
    )


def consumer_chart(consumer: dict[str, Any], out: Path) -> Path | None:
    rows = [r for r in consumer.get("rows", []) if r.get("rounds")]
    alone = next((r for r in rows if r["row"] == "effect alone"), None)
    if alone is None:
        return None
    ratios, spreads = [], []
    for row in rows:
        per_round = [
            a["p50_ms"] / b["p50_ms"] for a, b in zip(row["rounds"], alone["rounds"], strict=True)
        ]
        ratios.append(statistics.median(per_round))
        spreads.append(_spread(per_round))
    return _bars(
        "Consumers: p50 time per event relative to the effect alone",
        [r["row"] for r in rows],
        ratios,
        spreads,
        [r.get("statements") for r in rows],
        [BASE_COLOR if r["row"] == "effect alone" else APP_COLOR for r in rows],
        out / "consumer.svg",
        xlabel="p50 / effect alone's p50 (median of rounds; bar: lowest-highest)",
        target=1.5,
    )


def render(results: dict[str, Any], out: Path) -> list[Path]:
    """Every chart the results allow; returns the files written."""
    paths: list[Path] = []
    if results.get("micro"):
        paths += micro_charts(results["micro"], out)
    for clients in sorted({r["clients"] for r in results.get("http", [])}):
        path = http_chart(results["http"], out, clients)
        if path:
            paths.append(path)
    if isinstance(results.get("consumer"), dict):
        path = consumer_chart(results["consumer"], out)
        if path:
            paths.append(path)
    return paths


if __name__ == "__main__":
    source, target = Path(sys.argv[1]), Path(sys.argv[2])
    for written in render(json.loads(source.read_text()), target):
        print(written)
