"""``pm.run_spmd`` benchmark: a torchrun script run on a mesh, first and second run, beside
``torchrun`` (``python -m torch.distributed.run --standalone``) running the same script.

Run from the repository root: ``python benchmarks/spmd.py [--nproc N]`` (about a minute on 2
cores; N defaults to 2).

What is measured (wall clock, seconds, median of ``RUNS``)
---------------------------------------------------------
Two scripts, each a plain torchrun script:

- ``allreduce``: ``init_process_group("gloo")``, one ``all_reduce``, ``destroy_process_group``:
  almost nothing but the launch, so the launcher's own cost shows.
- ``ddp_train``: ``tests/spmd_scripts/ddp_train.py``, 4 steps of DDP training of a small MLP
  (torch's ``DistributedDataParallel`` constructor alone takes ~1.2 s here, with either
  launcher).

For each, in a fresh controller process (``python -c``; ``RUNS`` of them):

1. ``mesh start``: ``md.this_host().spawn_procs({"gpu": N})``, in the controller (torch already
   imported by ``import monarch_dsl``).
2. ``1st run``: the first ``pm.run_spmd(script)`` on that mesh.
3. ``2nd run``: the same call again on the same mesh -- what every later run costs.
4. ``cold, end to end``: from ``Popen`` of that controller to the end of its first run
   (interpreter start, ``import monarch_dsl``/torch, mesh start, first run); what
   ``monarch-dsl run --spmd`` costs.

and ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node=N script``
from ``Popen`` to exit (its agent and each rank start an interpreter and import torch).

``remote``: the same first and second run on a mesh of ``md.remote_hosts(1)`` whose N workers
were started as an external launcher starts them (``python -m monarch_dsl worker --connect``;
not timed): there each worker has its rank forked by a fork server of its own, which the
first run starts (an interpreter and ``import torch``); later runs fork from it.

Measurements of monarch_dsl and torchrun alternate run by run, so noise on a busy machine hits
both alike. "torchrun / this" is how many times faster a monarch_dsl run is than torchrun
running the same script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = 3
DDP_TRAIN = os.path.join(ROOT, "tests", "spmd_scripts", "ddp_train.py")
ALLREDUCE = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
assert t[0].item() == dist.get_world_size()
dist.destroy_process_group()
"""

CONTROLLER = """\
import json, sys, time
import monarch_dsl as md

script, nproc, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
t0 = time.perf_counter()
pm = md.this_host().spawn_procs({"gpu": nproc})
t1 = time.perf_counter()
pm.run_spmd(script, *args)
t2 = time.perf_counter()
sys.stdout.write("FIRST_RUN_DONE\\n")
sys.stdout.flush()
pm.run_spmd(script, *args)
t3 = time.perf_counter()
pm.stop()
sys.stdout.write(json.dumps({"mesh": t1 - t0, "first": t2 - t1, "second": t3 - t2}) + "\\n")
"""

REMOTE_CONTROLLER = """\
import json, os, subprocess, sys, time
import monarch_dsl as md

script, nproc, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
hosts = md.remote_hosts(1)
address = hosts.listen({"gpu": nproc})
env = dict(os.environ, **hosts.env())
command = [sys.executable, "-m", "monarch_dsl", "worker", "--connect", address]
workers = [subprocess.Popen(command, env=dict(env, RANK=str(r))) for r in range(nproc)]
try:
    pm = hosts.spawn_procs({"gpu": nproc}, timeout=120)
    t1 = time.perf_counter()
    pm.run_spmd(script, *args)
    t2 = time.perf_counter()
    pm.run_spmd(script, *args)
    t3 = time.perf_counter()
    pm.stop()
finally:
    for w in workers:
        w.wait(timeout=60) if w.poll() is None else None
sys.stdout.write(json.dumps({"first": t2 - t1, "second": t3 - t2}) + "\\n")
"""


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        MONARCH_DSL_QUIET="1",
        MONARCH_DSL_WORKER_OUTPUT="0",  # the ranks' output is not what is timed here
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p),
    )


def monarch_once(script: str, nproc: int, args: list[str]) -> dict[str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, script, str(nproc), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert proc.stdout is not None
    cold = None
    result = None
    for line in proc.stdout:
        if line.startswith("FIRST_RUN_DONE"):
            cold = time.perf_counter() - start
        elif line.startswith("{"):
            result = json.loads(line)
    if proc.wait(timeout=300) != 0 or result is None or cold is None:
        raise SystemExit(f"the monarch_dsl controller failed (exit {proc.returncode})")
    return dict(result, cold=cold)


def remote_once(script: str, nproc: int, args: list[str]) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", REMOTE_CONTROLLER, script, str(nproc), *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the remote-hosts controller failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def torchrun_once(script: str, nproc: int, args: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + [f"--nproc-per-node={nproc}", script, *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    if proc.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{proc.stderr[-4000:]}")
    return time.perf_counter() - start


def measure(script: str, nproc: int, args: list[str]) -> dict[str, float]:
    ours: list[dict[str, float]] = []
    theirs: list[float] = []
    remote: list[dict[str, float]] = []
    for _ in range(RUNS):
        ours.append(monarch_once(script, nproc, args))
        theirs.append(torchrun_once(script, nproc, args))
        remote.append(remote_once(script, nproc, args))
    med = {k: statistics.median(r[k] for r in ours) for k in ours[0]}
    med["torchrun"] = statistics.median(theirs)
    med.update({f"remote {k}": statistics.median(r[k] for r in remote) for k in remote[0]})
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    opts = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        allreduce = os.path.join(tmp, "allreduce.py")
        with open(allreduce, "w") as f:
            f.write(ALLREDUCE)
        cases = [
            ("allreduce", allreduce, []),
            ("ddp_train", DDP_TRAIN, [os.path.join(tmp, "w.pt"), "4"]),
        ]
        print(
            f"run_spmd vs torchrun: {opts.nproc} ranks, CPU (gloo), torch {torch.__version__}, "
            f"{os.cpu_count()} cores, median of {RUNS}, seconds"
        )
        header = (
            f"{'script':<10}  {'mesh start':>10}  {'1st run':>8}  {'2nd run':>8}  "
            f"{'cold, end to end':>16}  {'torchrun':>8}  {'torchrun / 2nd run':>18}  "
            f"{'torchrun / cold':>15}  {'remote 1st':>10}  {'remote 2nd':>10}  "
            f"{'torchrun / remote 2nd':>21}"
        )
        print(header)
        print("-" * len(header))
        for name, script, args in cases:
            m = measure(script, opts.nproc, args)
            print(
                f"{name:<10}  {m['mesh']:>10.3f}  {m['first']:>8.3f}  {m['second']:>8.3f}  "
                f"{m['cold']:>16.3f}  {m['torchrun']:>8.3f}  "
                f"{m['torchrun'] / m['second']:>17.1f}x  {m['torchrun'] / m['cold']:>14.1f}x  "
                f"{m['remote first']:>10.3f}  {m['remote second']:>10.3f}  "
                f"{m['torchrun'] / m['remote second']:>20.1f}x"
            )
    print(
        textwrap.dedent(
            """
            mesh start: spawn_procs in a controller that has imported torch; 1st/2nd run: one
            pm.run_spmd on that mesh (each rank forked from the fork server: no interpreter
            start, no import torch); cold: Popen of a controller to the end of its first run;
            torchrun: Popen to exit of python -m torch.distributed.run --standalone; remote:
            one pm.run_spmd on workers of md.remote_hosts (each rank forked by its worker's
            fork server, which the 1st run starts)."""
        ).strip()
    )


if __name__ == "__main__":
    main()
