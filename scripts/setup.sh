#!/usr/bin/env bash
# Set up storylens on a fresh machine: a virtual environment with every pinned dependency,
# and Debian's Chromium for the widget's real-browser test. Safe to run again (fast when done).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Exact versions from constraints.txt (torch==2.13.0 resolves to the CPU wheel these machines hold).
.venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]' -r requirements-dev.txt

if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium for the browser test" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: chromium not installed and not root: the browser test will be skipped" >&2
  fi
fi
