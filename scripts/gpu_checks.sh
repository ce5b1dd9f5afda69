#!/usr/bin/env bash
# The GPU checklist (GPU_CHECKS.md in the project's shared folder) as one script, for a machine
# with a CUDA GPU: setup from the README (the CUDA torch kept, the C++ runtime built against
# it), the GPU's calibration (`monarch-dsl calibrate --device cuda`) and the simulator's
# accuracy there, the gpu-marked tests on CUDA workers, the tutorial on CUDA workers, and the
# benchmarks' GPU parts (most wanted first: a step past its limit still leaves the others). Every step has a time limit and its own log; a failed step does not stop the next.
#
#     bash scripts/gpu_checks.sh [LOG_DIR] [TARBALL]   # default: gpu-logs/; TARBALL: the
#                                                     # logs, packed again after every step
#
# Offline machines: put wheels of the dev extra's missing packages in .whl/ (see the README's
# GPU section); setup then installs from there only.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${1:-gpu-logs}
TARBALL=${2:-}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 MONARCH_DSL_QUIET=1
if [ -d .whl ]; then
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl"
fi

step() {  # step NAME SECONDS CMD...: run CMD with a limit, its output to LOGS/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$LOGS/summary.txt"
    tail -n 25 "$LOGS/$name.log"
    if [ -n "$TARBALL" ]; then tar czf "$TARBALL" -C "$LOGS" .; fi
    return $rc
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import torch, sys; print("python3:", sys.prefix, "torch", torch.__version__,
        "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
    nproc
} >"$LOGS/machine.txt" 2>&1
cat "$LOGS/machine.txt"

if ! step setup 240 bash scripts/setup.sh; then
    # Go on with the rest of the checklist: the package alone into python3's env.
    step setup_fallback 150 bash -c 'python3 -m pip install -q --no-deps --no-build-isolation \
        -e . lark && python3 -m monarch_dsl build' || exit 1
    VIRTUAL_ENV=$(python3 -c 'import sys; print(sys.prefix)')
fi
. scripts/venv.sh
PY="$VENV/bin/python"
step torch_kept 30 "$PY" -c 'import torch; assert torch.version.cuda, torch.__version__
print("torch", torch.__version__, "cuda", torch.version.cuda)'

# The simulator on this GPU (issue 13): its compute calibrated, then the one-GPU steps timed
# beside what the built-in profile and the calibrated one predict.
step calibrate_cuda 180 "$PY" -m monarch_dsl calibrate --device cuda \
    --out "$LOGS/cuda-local.json"
mkdir -p "${MONARCH_DSL_PROFILE_DIR:=$HOME/.cache/monarch_dsl/profiles}"
export MONARCH_DSL_PROFILE_DIR
cp "$LOGS/cuda-local.json" "$MONARCH_DSL_PROFILE_DIR/" 2>/dev/null
step bench_gpu_step 180 "$PY" benchmarks/gpu_step.py
step pytest_gpu 240 env MD_DEVICE=cuda "$PY" -m pytest -m gpu -q -p no:cacheprovider --durations=5
step bench_executor 90 "$PY" benchmarks/executor.py --reps 5
# The tutorial's meshes have 4 ranks: on fewer GPUs its first mesh must be refused, naming the
# GPU count (what passes here then), never started on a shared GPU.
step tutorial_cuda 60 env MD_DEVICE=cuda PY="$PY" bash -c '
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    if [ "$gpus" -ge 4 ]; then exec "$PY" examples/tutorial.py; fi
    out=$("$PY" examples/tutorial.py 2>&1); rc=$?; echo "$out" | tail -n 5
    echo "$out" | grep -q "host with $gpus CUDA device(s)" && [ $rc -ne 0 ] &&
        echo "refused as it should be: $gpus GPU(s), 4 ranks"'
step bench_kernels 90 "$PY" benchmarks/kernels.py
cat "$LOGS/summary.txt"
