"""Torchrun-style scripts for tests/test_spmd.py: ``ranks.py ACTION DIR``. Each rank writes
``DIR/<RANK>.json`` (its pid, environment and whether torch was already imported when the
script started) and then does ACTION:

- ``ok``: prints a line and exits 0;
- ``exit3``: rank 1 exits 3, the others sleep (to be stopped);
- ``kill9``: rank 1 kills itself with SIGKILL while rank 0 waits in a gloo all_reduce;
- ``sleep``: every rank sleeps (for timeouts and dying workers);
- ``ignore_term``: rank 0 ignores SIGTERM and sleeps, rank 1 exits 1;
- ``sigint``: every rank sleeps; one interrupted writes ``DIR/<RANK>.interrupted`` and exits 0.
"""

import sys

TORCH_PRELOADED = "torch" in sys.modules  # before this script imports anything heavy

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "OMP_NUM_THREADS",
    "SPMD_TEST_EXTRA",
    "GROUP_WORLD_SIZE",
    "MONARCH_DSL_TOKEN",
    "TORCHELASTIC_USE_AGENT_STORE",
)

action, out_dir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])


def _proc_environ() -> bytes:
    try:
        with open("/proc/self/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def wait_for_every_rank() -> None:
    """Until every rank has written its file (the test reads them all after the failure: a
    rank stopped before it wrote one would have none), at most 30 s."""
    files = [os.path.join(out_dir, f"{r}.json") for r in range(int(os.environ["WORLD_SIZE"]))]
    deadline = time.monotonic() + 30
    while not all(map(os.path.exists, files)) and time.monotonic() < deadline:
        time.sleep(0.01)


if action == "ignore_term" and rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(out_dir, f"{rank}.tmp"), "w") as f:
    json.dump(
        {
            "pid": os.getpid(),
            "env": {k: os.environ.get(k) for k in VARS},
            "torch_preloaded": TORCH_PRELOADED,
            "argv": sys.argv[1:],
            "cwd": os.getcwd(),
            # (what the process was started with: a fork server's environment shows here)
            "token_in_proc_environ": b"MONARCH_DSL_TOKEN=" in _proc_environ(),
        },
        f,
    )
os.replace(os.path.join(out_dir, f"{rank}.tmp"), os.path.join(out_dir, f"{rank}.json"))

if action == "ok":
    print(f"hello from rank {rank} of {os.environ['WORLD_SIZE']}")
    print(f"to stderr from rank {rank}", file=sys.stderr)
elif action == "exit3":
    if rank == 1:
        wait_for_every_rank()
        print("rank 1 gives up", file=sys.stderr)
        sys.exit(3)
    time.sleep(120)
elif action == "kill9":
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))  # never completes: rank 1 is gone
    time.sleep(120)
elif action == "sleep":
    time.sleep(120)
elif action == "sigint":
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        open(os.path.join(out_dir, f"{rank}.interrupted"), "w").close()
elif action == "ignore_term":
    if rank == 1:
        wait_for_every_rank()
        sys.exit(1)
    time.sleep(120)
else:
    sys.exit(f"unknown action {action!r}")
