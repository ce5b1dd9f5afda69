# Sourced by setup.sh, test.sh and demo.sh (from the repository root): sets VENV, the virtual
# env monarch_dsl is set up in and run from, the one rule for all three.
#
# - an active virtual env ($VIRTUAL_ENV);
# - else .venv, once it exists;
# - else, when python3 itself belongs to a virtual env (an image whose torch lives in one, not
#   activated), that env: a venv made from it would see the base interpreter's packages, not
#   its torch, and setup would install a second torch;
# - else .venv (setup.sh creates it).
PYTHON=${PYTHON:-python3}
if [ -n "${VIRTUAL_ENV:-}" ]; then
    VENV=$VIRTUAL_ENV
elif [ -x .venv/bin/python ]; then
    VENV=.venv
else
    VENV=$("$PYTHON" -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "")')
    VENV=${VENV:-.venv}
fi
