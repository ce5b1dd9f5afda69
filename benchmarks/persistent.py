"""What re-attaching to a persistent mesh costs, against starting a mesh.

    python benchmarks/persistent.py            # about 30 s

Per round (median of --rounds), on 4 local CPU workers:

- ``spawn``: ``spawn_procs({"gpu": 4})`` from this controller, until every worker joined (the
  fork server is warm: forks of a process that imported torch);
- ``spawn persistent``: ``spawn_procs(name=, persistent=True)``: a keeper is a fresh
  interpreter that imports torch, then forks the workers;
- ``attach``: ``md.attach(name)`` from a new process, until every worker joined it, and
  ``attach + first call``: then one actor endpoint call answered by all 4 (the actor spawned
  by an earlier controller);
- ``python -c "import torch"``: what a process start costs at least here (the floor that
  attach does not pay).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

os.environ.setdefault("MONARCH_DSL_QUIET", "1")

import monarch_dsl as md  # noqa: E402

ATTACH = """
import sys, time
t0 = time.perf_counter()
import monarch_dsl as md
t1 = time.perf_counter()
pm = md.attach(sys.argv[1])
t2 = time.perf_counter()
pm.actors("counter").incr.call().get()
t3 = time.perf_counter()
print(t2 - t1, t3 - t1)
"""

COUNTER = """
import monarch_dsl as md
class Counter(md.Actor):
    def __init__(self):
        self.n = 0
    @md.endpoint
    def incr(self):
        self.n += 1
        return self.n
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    opts = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="md-bench-")
    with open(os.path.join(folder, "bench_counter.py"), "w") as f:
        f.write(COUNTER)
    sys.path.insert(0, folder)
    from bench_counter import Counter  # type: ignore[import-not-found]

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([folder, *sys.path]))
    rows: dict[str, list[float]] = {}
    md.this_host()  # the fork server, warm
    for _ in range(opts.rounds):
        t0 = time.perf_counter()
        pm = md.this_host().spawn_procs({"gpu": 4})
        rows.setdefault("spawn", []).append(time.perf_counter() - t0)
        pm.stop()

        name = "bench" + uuid.uuid4().hex[:6]
        t0 = time.perf_counter()
        pm = md.this_host().spawn_procs({"gpu": 4}, name=name, persistent=True)
        rows.setdefault("spawn persistent", []).append(time.perf_counter() - t0)
        pm.spawn("counter", Counter).incr.call().get()
        pm.detach()
        out = subprocess.run(
            [sys.executable, "-c", ATTACH, name], capture_output=True, text=True, env=env
        )
        if out.returncode:
            raise SystemExit(out.stderr)
        attach, first = map(float, out.stdout.split())
        rows.setdefault("attach", []).append(attach)
        rows.setdefault("attach + first call", []).append(first)
        md.attach(name).stop()

        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        rows.setdefault('python -c "import torch"', []).append(time.perf_counter() - t0)
    print(f"4 local CPU workers, median of {opts.rounds} rounds")
    for name, values in rows.items():
        print(f"  {name:<28} {statistics.median(values) * 1e3:9.1f} ms")
    ratio = statistics.median(rows['python -c "import torch"']) / statistics.median(rows["attach"])
    print(f"  attach is {ratio:.0f}x faster than starting one process that imports torch")


if __name__ == "__main__":
    main()
