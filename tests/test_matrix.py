"""The test command's matrix plumbing: the summary table and the parallel lanes of noxfile.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_pass(reports: Path, name: str, code: int, tests: int, failures: int = 0) -> None:
    junit = reports / f"{name}.xml"
    junit.write_text(
        f'<testsuites><testsuite tests="{tests}" failures="{failures}" errors="0" skipped="1">'
        "</testsuite></testsuites>"
    )
    entry = {
        "combination": name,
        "backend": "sqlite",
        "exit": code,
        "ok": code == 0,
        "seconds": 1.5,
        "junit": str(junit),
    }
    with (reports / "passes.jsonl").open("a") as lines:
        lines.write(json.dumps(entry) + "\n")


def test_summary_adds_up_the_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = load(ROOT / "scripts" / "summary.py")
    write_pass(tmp_path, "django6.1-py3.13", 0, tests=10)
    write_pass(tmp_path, "django5.2-py3.11", 0, tests=5)
    assert summary.main(tmp_path) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "total: 13 passed, 0 failed, 2 skipped"


@pytest.mark.parametrize(
    ("code", "failures", "verdict"),
    [(1, 1, "FAILED (exit 1)"), (5, 0, "FAILED: no test ran (exit 5)")],
)
def test_summary_fails_a_failed_or_empty_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], code: int, failures: int, verdict: str
) -> None:
    summary = load(ROOT / "scripts" / "summary.py")
    write_pass(tmp_path, "django6.1-py3.13", 0, tests=10)
    write_pass(tmp_path, "lowest-py3.11", code, tests=3 if failures else 0, failures=failures)
    assert summary.main(tmp_path) == 1
    assert verdict in capsys.readouterr().out


def test_lanes_hold_every_session_once_and_share_the_work_evenly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("QUICK", raising=False)  # make test-quick weighs every session alike
    sys.path.insert(0, str(ROOT))
    try:
        noxfile = importlib.import_module("noxfile")
    finally:
        sys.path.remove(str(ROOT))
    sessions = [f"tests({d}-py{p})" for d, p in noxfile.PLAN if (d, p) != noxfile.MAIN]
    sessions += ["lowest", "install"]
    lanes = noxfile.lanes(sessions, 2)
    assert sorted(name for lane in lanes for name in lane) == sorted(sessions)
    assert len(lanes) == 2
    # Each lane gets about half of the sessions (they weigh alike, give or take a pass).
    sizes = [len(lane) for lane in lanes]
    assert abs(sizes[0] - sizes[1]) <= 1, lanes
    # The slow tests run in the main combination only, which runs first and alone.
    assert [combination for combination, (_, slow) in noxfile.PLAN.items() if slow] == [
        noxfile.MAIN
    ]
