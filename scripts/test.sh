#!/usr/bin/env bash
# Installs moelab with its test, export, lab, ray, eval, curation, docs and serve extras (plus the
# headless browser the dashboard test drives) and runs the test suite. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test,export,lab,ray,eval,curation,docs,serve]'
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  (apt-get update -q && apt-get install -y -q chromium chromium-driver) >/dev/null 2>&1 \
    || echo "warning: could not install chromium; the browser test will be skipped" >&2
fi
# Given test paths, one pytest run over them. Otherwise the suite runs as two pytest
# processes (files a-l, then m-z): run as one process, two full runs on 2026-12-06 crashed
# about three quarters in, in different tests (SIGSEGV inside libgcc_s.so.1, the stack
# unwinder; cause not found), so no one process runs the whole suite.
if printf '%s\n' "$@" | grep -q '^tests'; then
  exec python3 -m pytest "$@"
fi
python3 -m pytest "$@" tests/test_[a-l]*.py
exec python3 -m pytest "$@" tests/test_[m-z]*.py
