#!/usr/bin/env bash
# Set up (or reuse) the environment with the test dependencies and run the whole test suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k ring, or the quick loop
# ./scripts/test.sh -m "not slow" (markers: pytest.ini). CI (.ci/run) passes none: every test.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh test

exec python -m pytest tests -q "$@"
