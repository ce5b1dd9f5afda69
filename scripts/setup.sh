#!/usr/bin/env bash
# Set up a development environment: a virtual env (scripts/venv.sh says which), torch, and
# monarch_dsl in editable mode with its dev tools. Safe to run again: it only does what is missing.
#
# torch: an installed torch is kept. If none is importable, TORCH_SPEC (default torch==2.13.0)
# is installed; on the project's machines that is a CPU wheel on local disk. It is installed
# before the package so pip never resolves the package's torch range to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

. scripts/venv.sh
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "monarch_dsl needs Python >= 3.10"'
    echo "setup: creating $VENV (sees system packages, so an installed torch is kept)"
    "$PYTHON" -m venv --system-site-packages "$VENV"
elif [ "$VENV" != .venv ] && [ "$VENV" != "${VIRTUAL_ENV:-}" ]; then
    echo "setup: python3 belongs to the virtual env $VENV: using it"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
    echo "setup: installing $TORCH_SPEC"
    "${PIP[@]}" install "$TORCH_SPEC"
fi

# Reinstall the package only when its metadata changed.
stamp="$VENV/.monarch_dsl-installed"
want="$(cat pyproject.toml | cksum)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$PY" -c 'import monarch_dsl' >/dev/null 2>&1; then
    echo "setup: installing monarch_dsl (editable) with its dev extra"
    "${PIP[@]}" install "setuptools>=68"
    "${PIP[@]}" install --no-build-isolation -e ".[dev]"
    echo "$want" > "$stamp"
fi
# The C++ runtime: compiled once against this torch (about a minute per source file on two
# cores), then only loaded; a failed build prints the compiler's output.
"$PY" -m monarch_dsl build

"$PY" -c 'import platform, torch, monarch_dsl
print(f"setup: ok (python {platform.python_version()}, torch {torch.__version__}, monarch_dsl {monarch_dsl.__version__})")'
