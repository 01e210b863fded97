#!/usr/bin/env bash
# Creates .venv (if needed) and installs the package in editable form with the given extras.
# Usage: scripts/bootstrap.sh [extras]    e.g. scripts/bootstrap.sh dev,postgres,mysql
# Re-installs only when setup.cfg or the extras change. Installs the MariaDB client headers
# with apt-get when the mysql extra is asked for and they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-demo}"
PYTHON="${PYTHON:-python3}"

if [[ ",$extras," == *",mysql,"* ]]; then
  scripts/mariadb-headers.sh
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel 2> >(grep -v "is ignored" >&2)
fi

stamp=".venv/.installed-$(echo "$extras" | tr ',' '-')"
want="$(sha256sum setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "== installing django-idempotency[$extras] in editable form"
  # setuptools' "Editable installation" note is information, not a warning: keep it quiet.
  PYTHONWARNINGS="ignore:Editable installation" \
    .venv/bin/python -m pip install -q -e ".[$extras]" 2> >(grep -v "is ignored" >&2)
  echo "$want" > "$stamp"
fi
