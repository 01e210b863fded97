"""Print the test command's summary table from the passes that noxfile.py recorded.

    python scripts/summary.py [.reports]

Reads ``.reports/passes.jsonl`` (one line per pytest pass) and each pass's JUnit report. Prints
combination, backend, passed, failed, skipped, time and result; the last line is the totals.
Exits 1 when a pass failed, crashed or found no test where it must. A pass whose service was
unreachable shows loudly as skipped (noxfile.py already failed it under REQUIRE_SERVICES=1).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def counts(junit: Path) -> tuple[int, int, int] | None:
    """(passed, failed, skipped) from a JUnit report; None when there is none."""
    if not junit.exists():
        return None
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = failed = skipped = 0
    for suite in suites:
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def verdict(entry: dict[str, object]) -> str:
    if entry.get("absent"):
        return "NOT RUN (scripts/pgbouncer.sh absent)"
    if entry.get("unreachable"):
        return "SKIPPED: SERVICE UNREACHABLE"
    code = entry.get("exit")
    if code == 5:
        return "FAILED: no test ran (exit 5)"
    if not entry["ok"]:
        return f"FAILED (exit {code})"
    return "ok"


def main(reports: Path) -> int:
    passes = reports / "passes.jsonl"
    lines = passes.read_text().splitlines() if passes.exists() else []
    if not lines:
        print("!! no test pass was recorded")
        return 1
    entries = [json.loads(line) for line in lines]
    # Parallel lanes interleave their lines: group them by combination, in order of first pass.
    first = {name: i for i, name in reversed(list(enumerate(e["combination"] for e in entries)))}
    entries.sort(key=lambda entry: first[entry["combination"]])
    header = ("combination", "backend", "passed", "failed", "skipped", "time", "result")
    rows = []
    totals = [0, 0, 0]
    bad = 0
    for entry in entries:
        found = counts(Path(entry["junit"])) if entry.get("junit") else None
        if found is not None:
            totals = [total + n for total, n in zip(totals, found, strict=True)]
        seconds = entry.get("seconds")
        result = verdict(entry)
        bad += result.startswith("FAILED")
        rows.append(
            (
                entry["combination"],
                entry["backend"],
                *(str(n) for n in found or ("-", "-", "-")),
                f"{seconds:.0f}s" if isinstance(seconds, int | float) else "-",
                result,
            )
        )
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    rule = "  ".join("-" * width for width in widths)
    print(rule)
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))
        if row is header:
            print(rule)
    print(rule)
    total_time = sum(float(e.get("seconds") or 0) for e in entries)
    print(f"{len(entries)} passes, {bad} failed, pytest time {total_time / 60:.1f} min")
    print(f"total: {totals[0]} passed, {totals[1]} failed, {totals[2]} skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".reports")))
