#!/usr/bin/env bash
# Set everything up, then type-check (mypy, the modules pyproject.toml lists) and run the test
# suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/venv.sh
"$VENV/bin/python" -m mypy
exec "$VENV/bin/python" -m pytest "$@"
