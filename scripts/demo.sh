#!/usr/bin/env bash
# Set everything up, then run the actors demo on a local 4-process mesh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VIRTUAL_ENV:-.venv}
exec "$VENV/bin/python" examples/actors.py "$@"
