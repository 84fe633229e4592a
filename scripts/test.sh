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
exec python3 -m pytest "$@"
