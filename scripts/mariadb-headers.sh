#!/usr/bin/env bash
# Installs the MariaDB client headers that mysqlclient builds against, with apt-get, when they
# are missing. Called by bootstrap.sh (the test environment) and bench.sh (the bench one).
set -euo pipefail
if { pkg-config --exists libmariadb || pkg-config --exists mysqlclient; } 2>/dev/null; then
  exit 0
fi
echo "== installing the MariaDB client headers (mysqlclient needs them)"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libmariadb-dev pkg-config >/dev/null
else
  echo "!! libmariadb-dev and pkg-config are missing; install them (as root: apt-get install" \
       "libmariadb-dev pkg-config), or run without MariaDB." >&2
  exit 1
fi
