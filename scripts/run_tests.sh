#!/usr/bin/env bash
# Runs one test tier: default (fast), slow, or bench.
set -uo pipefail
cd "$(dirname "$0")/.."
tier=${1:-default}
case "$tier" in
    default) marks="not slow and not bench" ;;
    slow) marks="slow" ;;
    bench) marks="bench" ;;
    *) echo "unknown tier $tier (default|slow|bench)"; exit 2 ;;
esac
.venv/bin/python -m pytest -m "$marks" -q -ra --durations=10 "${@:2}"
rc=$?
# pytest exits 5 when a tier selects no tests; an empty tier is not a failure.
if [[ $rc -eq 5 ]]; then echo "tier $tier: no tests selected"; exit 0; fi
exit $rc
