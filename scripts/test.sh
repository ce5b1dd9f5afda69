#!/usr/bin/env bash
# Set everything up, then run the test suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VIRTUAL_ENV:-.venv}
exec "$VENV/bin/python" -m pytest "$@"
