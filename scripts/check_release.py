"""Check what a release uploads: the sdist's contents, and the wheel in a venv with Django only.

    python scripts/check_release.py dist/django_idempotency-X.tar.gz dist/django_idempotency-X.whl

(``scripts/release-check.sh`` builds both, runs ``twine check --strict``, then this.)

* The sdist holds the package, its migrations and templates, README, LICENSE and the build
  configuration, and no ``tests/``: the tests need ``tests/conftest.py``, ``testproject/`` and
  the services, so they run from a checkout, not from an sdist (MANIFEST.in prunes them).
* A fresh venv gets the wheel and what it requires (Django and asgiref) and nothing else; a new
  ``startproject`` with the app passes ``manage.py check`` and ``migrate`` (and, given a Kafka
  transport, fails check E033 naming the ``kafka`` extra, not E030); every name in
  ``django_idempotency.__all__``, and every module the API reference documents (its ``:::``
  lines in docs/) with each name of its ``__all__``, imports. A module or name that needs an
  extra must fail with an ``ImportError`` that names it (``pip install
  'django-idempotency[celery]'``); any other failure fails the check.

Reuses ``check_install.py``'s venv and new-project helpers (uv when it is there, else venv+pip).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_install import (
    NAMES_AN_EXTRA,
    PROBE_SETUP,
    allowed_packages,
    check_new_project,
    install,
    make_venv,
)

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTED = re.compile(r"^:::\s+(django_idempotency(?:\.\w+)*)\s*$", re.M)
SDIST_REQUIRED = [
    "PKG-INFO",
    "README.md",
    "LICENSE",
    "setup.cfg",
    "pyproject.toml",
    "django_idempotency/__init__.py",
    "django_idempotency/py.typed",
    "django_idempotency/migrations/0001_initial.py",
]
SDIST_FORBIDDEN = ["tests/", "testproject/", "bench/", "scripts/", "docs/", ".venv/", "changes/"]

# Runs in the fresh venv: import each module and each public name, report what failed and how.
PROBE = (
    PROBE_SETUP
    + r"""
import importlib, json, sys

results = {}
for module_name in ["django_idempotency", *sys.argv[1:]]:
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        results[module_name] = f"{type(error).__name__}: {error}"
        continue
    results[module_name] = None
    for name in getattr(module, "__all__", []):
        try:
            getattr(module, name)
        except Exception as error:
            results[f"{module_name}.{name}"] = f"{type(error).__name__}: {error}"
        else:
            results[f"{module_name}.{name}"] = None
from importlib import metadata
installed = {
    d.metadata["Name"].lower().replace("_", "-"): d.requires or []
    for d in metadata.distributions()
}
print(json.dumps({"results": results, "installed": installed}))
"""
)


def documented_modules() -> list[str]:
    found: set[str] = set()
    for page in (ROOT / "docs").glob("*.md"):
        found.update(DOCUMENTED.findall(page.read_text()))
    return sorted(found)


def check_sdist(path: Path) -> list[str]:
    with tarfile.open(path) as archive:
        # Every member sits under the "django_idempotency-VERSION/" folder.
        names = [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]
    problems = [f"sdist: missing {name}" for name in SDIST_REQUIRED if name not in names]
    if not any(name.startswith("django_idempotency/templates/") for name in names):
        problems.append("sdist: nothing under django_idempotency/templates/")
    problems += [
        f"sdist: must not ship {name}"
        for name in names
        if any(name.startswith(prefix) for prefix in SDIST_FORBIDDEN)
    ]
    if not problems:
        print(f"   {path.name}: {len(names)} files, no tests/, contents OK")
    return problems


def check_missing_extra_is_e033(python: Path, project: Path) -> list[str]:
    """In the new project (no confluent-kafka here), a Kafka transport fails check E033, which
    names the extra, and not E030 ("cannot be imported"): the library really is missing."""
    settings = project / "mysite" / "settings.py"
    settings.write_text(
        settings.read_text() + "\nIDEMPOTENCY = {'OUTBOX_TRANSPORTS': {'default': "
        "{'BACKEND': 'django_idempotency.kafka.transport.KafkaTransport'}}}\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in {"DJANGO_SETTINGS_MODULE"}}
    done = subprocess.run(
        [str(python), "manage.py", "check"], cwd=project, env=env, capture_output=True, text=True
    )
    output = done.stdout + done.stderr
    if done.returncode == 0 or "django_idempotency.E033" not in output:
        return [f"a Kafka transport without confluent-kafka did not fail E033:\n{output}"]
    if "django_idempotency.E030" in output or "django-idempotency[kafka]" not in output:
        return [f"a Kafka transport without confluent-kafka: not E033 alone:\n{output}"]
    print("   a Kafka transport without confluent-kafka fails check E033, naming the extra")
    return []


def check_wheel_with_django_only(wheel: Path, work: Path) -> list[str]:
    python = make_venv(work / "release")
    install(python, str(wheel))
    problems = check_new_project(python, work)
    problems += check_missing_extra_is_e033(python, work / "newproject")
    modules = documented_modules()
    answer = subprocess.run(
        [str(python), "-W", "error::DeprecationWarning", "-c", PROBE, *modules],
        capture_output=True,
        text=True,
    )
    if answer.returncode != 0:
        return [*problems, f"the import probe failed:\n{answer.stdout}{answer.stderr}"]
    found = json.loads(answer.stdout)
    results: dict[str, str | None] = found["results"]
    installed: dict[str, list[str]] = found["installed"]
    print(f"   fresh venv: {', '.join(sorted(installed))}")
    if extra := set(installed) - allowed_packages(installed):
        problems.append(f"the wheel pulled in more than Django: {sorted(extra)}")
    need_extra = {}
    for name, error in results.items():
        if error is None:
            continue
        named = NAMES_AN_EXTRA.search(error)
        if error.startswith(("ImportError", "ModuleNotFoundError")) and named:
            need_extra[name] = named.group(1)
        else:
            problems.append(f"import {name} failed: {error}")
    imported = sum(error is None for error in results.values())
    print(
        f"   imported {imported} of {len(results)} public modules and names "
        f"({len(modules)} documented modules); need an extra: "
        f"{', '.join(f'{k} [{v}]' for k, v in sorted(need_extra.items())) or 'none'}"
    )
    return problems


def main(sdist: Path, wheel: Path) -> int:
    problems = check_sdist(sdist)
    with tempfile.TemporaryDirectory(prefix="release-check-") as tmp:
        problems += check_wheel_with_django_only(wheel, Path(tmp))
    for problem in problems:
        print(f"!! {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    paths = [Path(arg).resolve() for arg in sys.argv[1:]]
    sdists = [p for p in paths if p.name.endswith(".tar.gz")]
    wheels = [p for p in paths if p.suffix == ".whl"]
    if len(sdists) != 1 or len(wheels) != 1:
        sys.exit("usage: check_release.py SDIST.tar.gz WHEEL.whl")
    sys.exit(main(sdists[0], wheels[0]))
