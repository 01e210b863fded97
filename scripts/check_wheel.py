"""Check that a built wheel ships the app, its migrations and templates, and no tests."""

from __future__ import annotations

import sys
import zipfile

REQUIRED = [
    "django_idempotency/__init__.py",
    "django_idempotency/py.typed",
    "django_idempotency/migrations/0001_initial.py",
]
REQUIRED_PREFIXES = ["django_idempotency/templates/"]
FORBIDDEN_PREFIXES = ["tests/", "testproject/", "bench/", "scripts/", "docs/"]


def main(path: str) -> int:
    names = zipfile.ZipFile(path).namelist()
    problems = [f"missing {name}" for name in REQUIRED if name not in names]
    problems += [
        f"nothing under {prefix}"
        for prefix in REQUIRED_PREFIXES
        if not any(name.startswith(prefix) for name in names)
    ]
    problems += [
        f"must not ship {name}"
        for name in names
        if any(name.startswith(prefix) for prefix in FORBIDDEN_PREFIXES)
    ]
    for problem in problems:
        print(f"   {path}: {problem}")
    if not problems:
        print(f"   {path}: {len(names)} files, contents OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
