"""Install a built wheel in fresh venvs, bare and with each extra, and import every module.

    python scripts/check_install.py dist/django_idempotency-*.whl

* Bare: the wheel pulls in only Django and asgiref (and what Django itself requires). Every
  module of the package imports, or fails with an ``ImportError`` that names the extra to install.
  ``manage.py check`` and ``migrate`` pass in a new ``startproject`` with the app installed.
* Each extra: a fresh venv with ``wheel[extra]``; the modules whose bare import named that extra
  now import, and so does what the extra promises (the driver, the transport).

Runs with the interpreter that runs it (the test command uses the main combination's, Python
3.13 with the newest Django). Needs ``uv`` (falls back to ``venv`` and pip).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# What each extra must make importable, beyond the package's modules that name it.
PROMISES = {
    "celery": ["celery", "celery.contrib.django.task"],
    "redis": ["celery", "kombu.transport.redis", "redis"],
    "kafka": ["confluent_kafka"],
    "drf": ["rest_framework"],
    "ninja": ["ninja"],
    "dramatiq": ["dramatiq", "dramatiq.brokers.rabbitmq", "dramatiq.brokers.redis"],
    "tasks": [],  # the backport on Django 5.2; Django 6 ships django.tasks
    "postgres": ["psycopg", "django.db.backends.postgresql.base"],
    "mysql": ["MySQLdb", "django.db.backends.mysql.base"],
    "crypto": ["cryptography.hazmat.primitives.ciphers.aead"],
}
NAMES_AN_EXTRA = re.compile(r"pip install 'django-idempotency\[([a-z]+)\]'")

# The start of a probe that runs in a fresh venv: Django set up with the app, on SQLite in memory.
PROBE_SETUP = r"""
import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes",
                    "django.contrib.admin", "django.contrib.messages",
                    "django.contrib.sessions", "django_idempotency"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    USE_TZ=True,
)
django.setup()
"""

# Runs inside the fresh venv: set Django up with the app and import every module.
PROBE = (
    PROBE_SETUP
    + r"""
import importlib, json, pkgutil, sys
from importlib import metadata

import django_idempotency

results = {}
for module in pkgutil.walk_packages(django_idempotency.__path__, "django_idempotency."):
    try:
        importlib.import_module(module.name)
    except ImportError as error:
        results[module.name] = str(error)
    else:
        results[module.name] = None
extra_modules = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError as error:
        extra_modules[name] = str(error)
    else:
        extra_modules[name] = None
installed = {
    d.metadata["Name"].lower().replace("_", "-"): d.requires or []
    for d in metadata.distributions()
}
print(json.dumps({
    "modules": results, "promised": extra_modules, "installed": installed,
    "django": django.__version__, "python": sys.version.split()[0],
}))
"""
)


def uv() -> str | None:
    return shutil.which("uv")


def make_venv(path: Path) -> Path:
    if uv():
        subprocess.run([uv(), "venv", "-q", "-p", sys.executable, str(path)], check=True)
    else:
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def install(python: Path, *requirements: str) -> None:
    if uv():
        command = [uv(), "pip", "install", "-q", "--python", str(python), *requirements]
    else:
        command = [str(python), "-m", "pip", "install", "-q", *requirements]
    subprocess.run(command, check=True)


def probe(python: Path, promised: list[str]) -> dict[str, dict[str, object]]:
    answer = subprocess.run(
        [str(python), "-W", "error::DeprecationWarning", "-c", PROBE, *promised],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, dict[str, object]] = json.loads(answer.stdout)
    return result


def requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert match, requirement
    return match.group(0).lower().replace("_", "-")


def allowed_packages(installed: dict[str, list[str]]) -> set[str]:
    """What a bare install may hold: the package, Django and asgiref, what Django itself
    requires, and pip (in a venv made by the venv module)."""
    allowed = {"django-idempotency", "django", "asgiref", "pip"}
    return allowed | {requirement_name(r) for r in installed["django"] if "extra ==" not in r}


def check_bare(wheel: Path, work: Path) -> tuple[list[str], dict[str, str]]:
    """The bare install; returns the problems and, per module that needs one, its extra."""
    python = make_venv(work / "bare")
    install(python, str(wheel))
    found = probe(python, [])
    installed: dict[str, list[str]] = found["installed"]  # type: ignore[assignment]
    problems = []
    direct = {requirement_name(r) for r in installed["django-idempotency"] if "extra ==" not in r}
    if direct != {"django", "asgiref"}:
        problems.append(f"the bare wheel requires {sorted(direct)}, not only Django and asgiref")
    if extra := set(installed) - allowed_packages(installed):
        problems.append(
            f"the bare install pulled in more than Django and asgiref: {sorted(extra)}"
        )
    print(
        f"   bare, Django {found['django']} on Python {found['python']}: "
        f"installed {', '.join(sorted(installed))}"
    )
    needs: dict[str, str] = {}
    for module, error in found["modules"].items():  # type: ignore[union-attr]
        if error is None:
            continue
        named = NAMES_AN_EXTRA.search(str(error))
        if named is None:
            problems.append(f"bare: import {module} fails without naming an extra: {error}")
        else:
            needs[module] = named.group(1)
    print(f"   bare: {len(found['modules'])} modules; need an extra: {needs or 'none'}")
    problems += check_new_project(python, work)
    return problems, needs


def check_new_project(python: Path, work: Path) -> list[str]:
    """``startproject``, add the app, then ``check`` and ``migrate`` on SQLite."""
    project = work / "newproject"
    project.mkdir()
    bin_dir = python.parent
    subprocess.run(
        [str(bin_dir / "django-admin"), "startproject", "mysite", str(project)], check=True
    )
    settings = project / "mysite" / "settings.py"
    text = settings.read_text()
    settings.write_text(
        text.replace("INSTALLED_APPS = [", "INSTALLED_APPS = [\n    'django_idempotency',")
    )
    problems = []
    env = {**os.environ, "PYTHONWARNINGS": "error::DeprecationWarning"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env.pop("DATABASE_URL", None)
    for command in (["check", "--fail-level", "WARNING"], ["migrate", "-v", "0"]):
        done = subprocess.run(
            [str(python), "manage.py", *command], cwd=project, env=env, check=False
        )
        if done.returncode != 0:
            problems.append(f"new project: manage.py {' '.join(command)} failed")
    if "django_idempotency" not in settings.read_text():
        problems.append("new project: could not add the app to INSTALLED_APPS")
    if not problems:
        print("   new project: manage.py check and migrate ran")
    return problems


def check_extra(wheel: Path, work: Path, extra: str, needs: dict[str, str]) -> list[str]:
    python = make_venv(work / extra)
    install(python, f"{wheel}[{extra}]")
    found = probe(python, PROMISES[extra])
    problems = []
    for module, error in found["promised"].items():  # type: ignore[union-attr]
        if error is not None:
            problems.append(f"[{extra}]: import {module} fails: {error}")
    unlocked = [module for module, wanted in needs.items() if wanted == extra]
    for module in unlocked:
        error = found["modules"].get(module)  # type: ignore[union-attr]
        if error is not None:
            problems.append(f"[{extra}]: import {module} still fails: {error}")
    print(f"   [{extra}]: imports {', '.join(PROMISES[extra] + unlocked) or 'the package'}")
    return problems


def main(wheel: Path) -> int:
    problems = []
    with tempfile.TemporaryDirectory(prefix="check-install-") as tmp:
        work = Path(tmp)
        bare_problems, needs = check_bare(wheel, work)
        problems += bare_problems
        unknown = set(needs.values()) - set(PROMISES)
        problems += [f"a module names the extra [{name}], which is not tested" for name in unknown]
        for extra in PROMISES:
            problems += check_extra(wheel, work, extra, needs)
    for problem in problems:
        print(f"!! {problem}")
    if not problems:
        print(f"   {wheel.name}: bare and {len(PROMISES)} extras install and import")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve()))
