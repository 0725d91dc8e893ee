#!/usr/bin/env bash
# Runs one test tier: default (fast), slow, or bench.
# Each tier has a per-test time bound (pytest-timeout): generous, so only a hung test (a Ray
# or vLLM call that never returns) reaches it, and that test is named in the failure.
set -uo pipefail
cd "$(dirname "$0")/.."
tier=${1:-default}
case "$tier" in
    default) marks="not slow and not bench"; timeout=1200 ;;
    slow) marks="slow"; timeout=1800 ;;
    bench) marks="bench"; timeout=14400 ;;
    *) echo "unknown tier $tier (default|slow|bench)"; exit 2 ;;
esac
# The slow tier renders the run report in headless Chromium (tests/test_report_browser.py).
# Install Debian's package when it is missing; if that fails the test fails and says so.
if [[ "$tier" == slow ]] && ! command -v chromium >/dev/null; then
    echo "[tests] installing chromium (apt-get) for the report's browser test"
    sudo_cmd=(); [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo -n)
    { "${sudo_cmd[@]}" apt-get update -qq && "${sudo_cmd[@]}" apt-get install -y -qq chromium; } \
        || echo "[tests] could not install chromium; the browser test will fail"
fi
# pytest exits 5 when a tier selects no tests: that is a failure (a tier that runs nothing
# proves nothing), so the exit status is passed through unchanged.
exec .venv/bin/python -m pytest -m "$marks" --timeout="$timeout" -q -ra --durations=10 "${@:2}"
