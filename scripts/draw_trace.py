"""Draw one trace that crosses the outbox, from exported spans, as a PNG (docs/img/).

The spans come from a real run: the Celery trace proof (tests/test_telemetry_traces.py) writes
every span of the request, the relays and the worker to ``IDEMPOTENCY_TRACE_DUMP`` as JSON
lines (the format of testproject/otel.py). This script lays the trace out as a waterfall, one
bar per span, indented under its parent, coloured by process, with the relay batches the sends
link to (their own traces) in grey::

    IDEMPOTENCY_TRACE_DUMP=/tmp/trace.jsonl DATABASE_URL=postgres://... \\
        pytest tests/test_telemetry_traces.py -k celery-instrumented
    python scripts/draw_trace.py /tmp/trace.jsonl docs/img/outbox-trace.png

The time axis is broken where nothing happens for a while (between the request and the relay,
and between the relay and the worker), so that a 5 ms claim and a later relay both show.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLOURS = {"app": "#4c72b0", "relay": "#dd8452", "worker": "#55a868", "linked": "#bbbbbb"}
GAP_NS = 50_000_000
"""A pause longer than this (50 ms) between spans is cut out of the time axis."""


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def choose_trace(spans: list[dict[str, Any]]) -> str:
    """The trace of the request that published: the one with a consumer span."""
    for span in spans:
        if span["name"] == "idempotency.consume":
            return str(span["trace_id"])
    raise SystemExit("no idempotency.consume span in the file")


def ordered(spans: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(depth, span) in tree order: each span under its parent, siblings by start time."""
    ids = {span["span_id"] for span in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        parent = span["parent_id"] if span["parent_id"] in ids else None
        children.setdefault(parent, []).append(span)
    out: list[tuple[int, dict[str, Any]]] = []

    def walk(parent: str | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s["start"]):
            out.append((depth, span))
            walk(span["span_id"], depth + 1)

    walk(None, 0)
    return out


def squeeze(spans: list[dict[str, Any]]) -> tuple[Any, list[tuple[float, int]]]:
    """A function mapping a time (ns) to an axis position (ms) with long idle gaps cut out."""
    edges = sorted((s["start"], s["end"]) for s in spans)
    busy: list[list[int]] = []
    for start, end in edges:
        if busy and start <= busy[-1][1] + GAP_NS:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    offsets = []
    position = 0.0
    for index, (start, end) in enumerate(busy):
        offsets.append((start, end, position))
        position += (end - start) / 1e6 + (2.0 if index < len(busy) - 1 else 0.0)

    def to_axis(ns: int) -> float:
        for start, end, at in offsets:
            if start <= ns <= end:
                return at + (ns - start) / 1e6
        return offsets[-1][2] + (offsets[-1][1] - offsets[-1][0]) / 1e6

    cuts = [
        (offsets[i][2] + (offsets[i][1] - offsets[i][0]) / 1e6, offsets[i + 1][0] - offsets[i][1])
        for i in range(len(offsets) - 1)
    ]
    return to_axis, cuts


def draw(spans: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = choose_trace(spans)
    in_trace = [s for s in spans if s["trace_id"] == trace]
    linked = {link.split(":")[1] for s in in_trace for link in s.get("links", [])}
    batches = [s for s in spans if s["span_id"] in linked]
    rows = ordered(in_trace) + [(0, s) for s in batches]
    to_axis, cuts = squeeze([s for _, s in rows])
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(rows) + 1.4), dpi=110)
    from matplotlib.transforms import blended_transform_factory

    labels = blended_transform_factory(ax.transAxes, ax.transData)  # x: axes, y: rows
    for index, (depth, span) in enumerate(rows):
        process = "linked" if span in batches else (span.get("process") or "app")
        left, right = to_axis(span["start"]), to_axis(span["end"])
        width = max(right - left, 0.15)
        ax.barh(index, width, left=left, color=COLOURS.get(process, "#8172b3"), height=0.6)
        outcome = span["attributes"].get("idempotency.outcome")
        label = f"{'  ' * depth}{process}: {span['name']}" + (f" ({outcome})" if outcome else "")
        ax.text(
            -0.72,
            index,
            label,
            transform=labels,
            ha="left",
            va="center",
            fontsize=8,
            family="monospace",
        )
        ax.text(
            left + width + 0.2,
            index,
            f"{(span['end'] - span['start']) / 1e6:.1f} ms",
            va="center",
            fontsize=7,
            color="#444444",
        )
    for at, idle in cuts:
        ax.axvline(at + 1.0, color="#999999", linestyle=(0, (2, 3)), linewidth=0.8)
        ax.text(
            at + 1.0, -0.9, f"{idle / 1e9:.1f} s later", ha="center", fontsize=7, color="#666666"
        )
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds of work (idle gaps cut out, dotted lines)")
    ax.set_title(
        f"One trace across the outbox: trace {trace[:8]}…  request → relay → Celery worker"
        "\n(grey: the relay batches, their own traces, linked from each send)",
        fontsize=10,
    )
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.subplots_adjust(left=0.42, right=0.97, top=0.88, bottom=0.12)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"wrote {out} ({len(rows)} spans of trace {trace})")


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(f"usage: {argv[0]} SPANS.jsonl OUT.png")
    draw(load(Path(argv[1])), Path(argv[2]))


if __name__ == "__main__":
    main(sys.argv)
