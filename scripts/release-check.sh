#!/usr/bin/env bash
# What a release uploads, checked before it is (make release-check; the test command runs it too):
# build the sdist and the wheel, `twine check --strict` both, then scripts/check_release.py: the
# sdist ships no tests/ (they need the checkout's conftest.py and testproject/), and the wheel,
# installed in a fresh venv with Django only, migrates, passes `manage.py check` in a new
# project, and imports every public name and every documented module (or names the extra one
# needs). Any failure exits non-zero with a "!! release check FAILED" line.
#
#   scripts/release-check.sh [DIR]   DIR: a folder that already holds the wheel (scripts/test.sh
#                                    passes the one it built); the sdist is built beside it.
#   VENV=path   the environment with build and twine (default .venv, made with the dev extra).
set -euo pipefail
cd "$(dirname "$0")/.."
trap 'echo "!! release check FAILED" >&2' ERR

VENV="${VENV:-.venv}"
if [ "$VENV" = .venv ] && ! { [ -x .venv/bin/python ] && .venv/bin/python -c "import build, twine" 2>/dev/null; }; then
  scripts/bootstrap.sh dev  # build and twine are in the dev extra
fi
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"  # its uv, for the fresh venv
dist="${1:-}"
if [ -z "$dist" ]; then
  dist=$(mktemp -d)
  echo "== building the sdist and the wheel in $dist"
  "$PY" -m build --no-isolation -o "$dist" . > "$dist/build.log" 2>&1 || { cat "$dist/build.log"; false; }
else
  echo "== building the sdist beside the wheel in $dist"
  "$PY" -m build --sdist --no-isolation -o "$dist" . > "$dist/build.log" 2>&1 || { cat "$dist/build.log"; false; }
fi
rm -rf django_idempotency.egg-info  # setuptools leaves it in the checkout
sdist=("$dist"/django_idempotency-*.tar.gz)
wheel=("$dist"/django_idempotency-*.whl)
echo "== twine check --strict"
"$VENV/bin/twine" check --strict "${sdist[0]}" "${wheel[0]}"
echo "== the sdist's contents, and the wheel in a fresh venv with Django only"
"$PY" scripts/check_release.py "${sdist[0]}" "${wheel[0]}"
echo "== release check passed"
