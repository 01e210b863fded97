"""The versions the docs state come from setup.cfg, through the MkDocs hook."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts/mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_requirements_are_filled_in_from_setup_cfg() -> None:
    hooks = load_hooks()
    text = hooks.fill_versions("Celery {{ requires.celery }}+, Django {{requires.Django}}.")
    assert text == "Celery 5.7+, Django 5.2."  # the lowest job: see docs/installation.md
    assert hooks.minimum_versions()["python"] == "3.11"


def test_an_unknown_requirement_fails_the_build() -> None:
    with pytest.raises(KeyError, match="nosuchpackage"):
        load_hooks().fill_versions("{{ requires.nosuchpackage }}")


def test_no_page_hard_codes_an_old_minimum() -> None:
    stale = re.compile(r"PostgreSQL 13\+|Celery 5\.3\+|MySQL 8|dayly")
    for page in (ROOT / "docs").glob("*.md"):
        if page.name == "changelog.md":
            continue
        assert not stale.search(page.read_text()), page.name
