#!/usr/bin/env bash
# Set everything up, then run the demo on a local CPU mesh: a training step compiled for a
# dp x tp mesh (its communications, plan.check(), run on 4 workers beside one process), then
# actors. Extra arguments go to examples/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/venv.sh
exec "$VENV/bin/python" examples/demo.py "$@"
