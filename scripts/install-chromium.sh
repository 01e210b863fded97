#!/usr/bin/env bash
# Installs Debian's chromium package (used by tests/test_browser.py through Playwright).
# Playwright's own browser download is not used: `playwright install` needs network access to
# a CDN that is not available everywhere, and Debian's package is enough for headless runs.
#
#   scripts/install-chromium.sh        (needs root and apt-get; does nothing if already there)
set -euo pipefail
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "!! $CHROMIUM is missing; install Debian's chromium package as root" \
       "(apt-get install chromium) to run the browser tests." >&2
  exit 1
fi
echo "== installing Debian's chromium for the browser tests"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  chromium fonts-dejavu-core >/dev/null
"$CHROMIUM" --version
