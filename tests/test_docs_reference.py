"""The reference lists of the docs, checked against the code they describe.

A list written by hand drifts: a new check ID, setting, command option or problem type lands in
the code and not on the page. Each test below reads the list from the page and the truth from
the code (the system checks' source, ``conf.OPTIONS``, each command's argparse parser, the
``ProblemError`` subclasses), and fails on any difference, naming it.
"""

from __future__ import annotations

import ast
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.apps import apps
from django.core.management import load_command_class
from django.test import override_settings

import django_idempotency
from django_idempotency import exceptions
from django_idempotency.conf import OPTIONS, conf
from django_idempotency.exceptions import ProblemError
from django_idempotency.http.owner import AUTHORIZATION_SALT, PRINCIPAL_SALT

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGE = Path(django_idempotency.__file__).resolve().parent
#: The options every management command has, documented by Django.
DJANGO_OPTIONS = {
    "--help", "--version", "--verbosity", "--settings", "--pythonpath", "--traceback",
    "--no-color", "--force-color", "--skip-checks",
}  # fmt: skip
COMMANDS = sorted(p.stem for p in (PACKAGE / "management/commands").glob("idempotency_*.py"))


def page(name: str) -> str:
    return (DOCS / name).read_text()


def all_docs() -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")) if p.name != "changelog.md")


def emitted_check_ids() -> set[str]:
    """Every ``django_idempotency.E###``/``W###`` the package's code (not its docstrings) names."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= set(re.findall(r"^django_idempotency\.[EW]\d{3}$", node.value))
    return found


def test_the_check_id_list_is_every_id_the_code_emits() -> None:
    text = page("installation.md")
    listed = text.split("<!-- check-ids: start -->")[1].split("<!-- check-ids: end -->")[0]
    documented = set(re.findall(r"`(django_idempotency\.[EW]\d{3})`", listed))
    emitted = emitted_check_ids()
    assert len(emitted) >= 16
    assert documented == emitted, (
        f"missing on the page: {sorted(emitted - documented)}, "
        f"not in the code: {sorted(documented - emitted)}"
    )


def test_every_check_id_a_page_mentions_exists() -> None:
    emitted = {name.rsplit(".", 1)[1] for name in emitted_check_ids()}
    for path in DOCS.glob("*.md"):
        if path.name == "changelog.md":
            continue
        for found in re.findall(r"\b([EW]0\d\d)\b", path.read_text()):
            assert found in emitted, f"{path.name} names check {found}, which no code emits"


def overview_rows() -> dict[str, str]:
    """``{key: default as written}`` from the settings page's overview table."""
    rows: dict[str, str] = {}
    overview = page("settings.md").split("## Overview")[1].split("\n## ")[0]
    for line in overview.splitlines():
        match = re.match(r"^\| \[`([A-Z_]+)`\]\(#([a-z_]+)\) \| (.+?) \| .+ \|$", line)
        if match:
            assert match[2] == match[1].lower(), line
            rows[match[1]] = match[3]
    return rows


def test_every_setting_is_in_the_overview_and_has_a_section() -> None:
    rows = overview_rows()
    assert set(rows) == set(OPTIONS), (
        f"missing: {sorted(set(OPTIONS) - set(rows))}, unknown: {sorted(set(rows) - set(OPTIONS))}"
    )
    # The table is one block: a blank line inside it renders the rest as text.
    overview = page("settings.md").split("## Overview")[1].split("\n## ")[0].strip()
    assert "\n\n" not in overview, "a blank line breaks the overview table"
    headings = set(re.findall(r"^## `([A-Z_]+)`$", page("settings.md"), re.M))
    assert headings == set(OPTIONS)


def test_the_documented_defaults_are_the_code_defaults() -> None:
    for name, written in overview_rows().items():
        default = OPTIONS[name].default
        code = re.match(r"^`([^`]+)`", written)
        assert code, f"{name}: no default in code format: {written}"
        if name == "OUTBOX_TRANSPORTS":
            section = page("settings.md").split("## `OUTBOX_TRANSPORTS`")[1]
            assert repr(default).replace("'", '"') in section, name
            continue
        value = eval(code[1], {"timedelta": timedelta})  # the page's own literal
        if isinstance(default, (list, tuple)):
            value, default = tuple(value), tuple(default)
        assert value == default, f"{name}: the page says {code[1]}, the code {default!r}"
        heading = page("settings.md").split(f"## `{name}`")[1]
        assert f"`{code[1]}`" in heading.split("\n\n")[1], f"{name}: its section's default"


def test_the_durations_the_page_lists_are_every_duration() -> None:
    text = page("settings.md")
    listed = re.search(r"Durations \(([^)]+)\)", text)
    assert listed
    durations = {name for name, option in OPTIONS.items() if isinstance(option.default, timedelta)}
    assert set(re.findall(r"`([A-Z_]+)`", listed[1])) == durations


def options_of(command: str) -> set[str]:
    parser = load_command_class("django_idempotency", command).create_parser("manage.py", command)
    own = set()
    for action in parser._actions:  # argparse has no public list of a parser's options
        own |= {s for s in action.option_strings if s.startswith("--")}
    return own - DJANGO_OPTIONS


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_option_is_documented_and_every_documented_one_exists(
    command: str,
) -> None:
    options = options_of(command)
    text = all_docs()
    for option in options:
        assert f"`{option}" in text or f" {option}" in text, f"{command} {option} is undocumented"
    # An option the docs show with the command must be the command's.
    for line in text.splitlines():
        if re.search(rf"\b{command}\b", line):
            for shown in re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", line):
                assert shown in options or shown in DJANGO_OPTIONS, (
                    f"the docs show {command} {shown}: {line.strip()}"
                )


def problem_classes() -> list[type[ProblemError]]:
    import django_idempotency.flows.phases  # noqa: F401 - registers FlowFailed

    def walk(cls: type[ProblemError]) -> list[type[ProblemError]]:
        return [cls, *[c for sub in cls.__subclasses__() for c in walk(sub)]]

    return [
        c
        for c in walk(ProblemError)
        if c is not ProblemError and c.__module__.startswith("django_idempotency")
    ]


def test_every_problem_type_is_on_the_problems_page_with_its_status() -> None:
    text = page("problems.md")
    classes = problem_classes()
    slugs = {cls.slug for cls in classes}
    assert slugs == set(re.findall(r"^## .+ \{#([a-z-]+)\}$", text, re.M))
    for cls in classes:
        row = re.search(rf"^\| \[`{cls.slug}`\]\(#{cls.slug}\) \| (\d+) \| `(\w+)`", text, re.M)
        assert row, cls.slug
        assert (int(row[1]), row[2]) == (cls.status, cls.__name__), cls.slug
        section = text.split(f"{{#{cls.slug}}}")[1]
        assert section.lstrip().startswith(f"**{cls.status} "), cls.slug


def test_the_documented_problem_type_base_is_the_default() -> None:
    example = re.search(r'"type": "([^"]+)#in-progress"', page("problems.md"))
    assert example and example[1] + "#" == exceptions.PROBLEM_TYPE_BASE
    assert OPTIONS["PROBLEM_TYPE_BASE"].default == exceptions.PROBLEM_TYPE_BASE
    assert exceptions.MissingKey("none").type == exceptions.PROBLEM_TYPE_BASE + "missing-key"


def test_the_problem_type_base_is_configurable() -> None:
    base = "https://api.example.com/errors/idempotency#"
    with override_settings(IDEMPOTENCY={"PROBLEM_TYPE_BASE": base}):
        assert conf.PROBLEM_TYPE_BASE == base
        body: dict[str, Any] = exceptions.KeyReused("no").as_dict()
        assert body["type"] == base + "key-reused"


def test_a_bad_problem_type_base_is_a_system_check_error() -> None:
    from django_idempotency.checks import check_settings

    with override_settings(IDEMPOTENCY={"PROBLEM_TYPE_BASE": "not a uri"}):
        errors = check_settings(None)
    assert [e.id for e in errors] == ["django_idempotency.E002"]
    assert "PROBLEM_TYPE_BASE" in errors[0].msg


def test_the_migration_guide_settings_pass_the_checks() -> None:
    """The ``IDEMPOTENCY`` that docs/migrating.md says both libraries accept passes this app's
    checks, and holds only keys drf-idempotency 1.0.0 also reads."""
    from django_idempotency.checks import check_settings

    block = re.search(r'```python title="settings.py"\n(.*?)```', page("migrating.md"), re.S)
    assert block
    namespace: dict[str, Any] = {}
    exec(block[1], namespace)  # the page's own settings
    assert set(namespace["IDEMPOTENCY"]) <= {"METHODS", "MAX_KEY_LENGTH"}
    with override_settings(IDEMPOTENCY=namespace["IDEMPOTENCY"]):
        assert check_settings(None) == []
        assert conf.METHODS == {"POST", "PUT", "PATCH"}


def resolves(dotted: str) -> bool:
    """``dotted`` is a module of the package, or an attribute of one."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                target = getattr(target, name)
        except AttributeError:
            return False
        return True
    return False


def test_every_dotted_path_on_the_pages_exists() -> None:
    """After the package was reorganised, a page naming an old path sends readers nowhere."""
    from django_idempotency import tasks

    task_names = {
        task.name
        for task in vars(tasks).values()
        if hasattr(task, "name") and str(getattr(task, "name", "")).startswith("django_idem")
    }
    task_names |= {"django_idempotency.complete_flows"}
    labels = {
        model._meta.label for model in apps.get_app_config("django_idempotency").get_models()
    }
    found = set(re.findall(r"\bdjango_idempotency(?:\.[A-Za-z_][A-Za-z0-9_]*)+", all_docs()))
    found |= set(
        re.findall(r"\bdjango_idempotency(?:\.[A-Za-z_][A-Za-z0-9_]*)+", page("../README.md"))
    )
    missing = sorted(
        path
        for path in found
        if path not in task_names
        and not re.fullmatch(r"django_idempotency\.[EWI]\d{3}", path)
        and path not in labels
        and path not in (AUTHORIZATION_SALT, PRINCIPAL_SALT)
        and not resolves(path)
    )
    assert missing == []
