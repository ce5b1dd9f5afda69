"""Code sync benchmark: ``pm.sync_code()`` of one edited file to 4 workers, against restarting
them (what a sync saves).

Run from the repository root: ``python benchmarks/codesync.py`` (about 20 seconds).

A temporary package on ``sys.path`` holds ``MODULES`` modules of about 4 KB each. One defines
an actor, spawned on a 4-process mesh; the controller imports them all. After a first sync
(which sends everything: the workers' copies are of unknown age), each timed run rewrites the
actor's module with a new version number (not timed), then times ``pm.sync_code(dir)``. That
covers hashing every local module on the controller, sending the changed one to the 4 workers,
their reload (the live actor gets the new class), and their replies. The result is checked
once: the live actor answers with the new version. The other rows are:

- nothing changed: ``pm.sync_code(dir)`` with no edit (the hashing, and no message sent);
- restart (the peer): ``spawn_procs({"gpu": 4})``, ``spawn`` and the first
  ``call().get()`` of a new mesh: what picking up an edit costs without code sync (not
  counting the ``pm.stop()`` of the old one).

Medians of ``RUNS`` (``RESTARTS`` for the restart). Lower is better; the last column is the
restart's time divided by the sync's.
"""

from __future__ import annotations

import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import monarch_dsl as md

RUNS = 20
RESTARTS = 5
MODULES = 10
WORKERS = 4

ACTOR = """\
import monarch_dsl as md

VERSION = {version}


class Model(md.Actor):
    def __init__(self):
        self.calls = 0

    @md.endpoint
    def version(self):
        self.calls += 1
        return VERSION
"""

FILLER = (
    "\n\ndef helper_{i}(x):\n    '''Padding: a module of a realistic size.'''\n    return x + {i}\n"
)


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def module_text(head: str) -> str:
    return head + "".join(FILLER.format(i=i) for i in range(40))  # about 4 KB


def main() -> None:
    os.environ.setdefault("MONARCH_DSL_QUIET", "1")
    root = tempfile.mkdtemp(prefix="md-codesync-bench-")
    pkg = os.path.join(root, "bench_pkg")
    os.mkdir(pkg)
    write(os.path.join(pkg, "__init__.py"), "")
    actor_path = os.path.join(pkg, "model.py")
    write(actor_path, module_text(ACTOR.format(version=0)))
    for i in range(MODULES - 1):
        write(os.path.join(pkg, f"util{i}.py"), module_text(f"NAME = 'util{i}'\n"))
    sys.path.insert(0, root)
    model = importlib.import_module("bench_pkg.model")
    for i in range(MODULES - 1):
        importlib.import_module(f"bench_pkg.util{i}")

    pm = md.this_host().spawn_procs({"gpu": WORKERS})
    try:
        actors = pm.spawn("model", model.Model)
        actors.version.call().get()
        first = pm.sync_code(root)
        print(first)
        sync_ms, idle_ms = [], []
        report = first
        for version in range(1, RUNS + 1):
            write(actor_path, module_text(ACTOR.format(version=version)))
            t0 = time.perf_counter()
            report = pm.sync_code(root)
            sync_ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            idle = pm.sync_code(root)
            idle_ms.append((time.perf_counter() - t0) * 1e3)
            assert report.sent == ("bench_pkg.model",) and not idle.sent, (report, idle)
        print(report)
        assert actors.version.call().get().values() == [RUNS] * WORKERS
    finally:
        pm.stop()

    restart_ms = []
    try:
        for _ in range(RESTARTS):
            t0 = time.perf_counter()
            pm = md.this_host().spawn_procs({"gpu": WORKERS})
            try:
                pm.spawn("model", model.Model).version.call().get()
                restart_ms.append((time.perf_counter() - t0) * 1e3)
            finally:
                pm.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    sync = statistics.median(sync_ms)
    rows = [
        (f"sync of 1 changed file ({MODULES} local modules)", sync),
        ("sync, nothing changed", statistics.median(idle_ms)),
        ("restart: spawn_procs + spawn + first call", statistics.median(restart_ms)),
    ]
    print(f"\n{WORKERS} workers; medians of {RUNS} syncs / {RESTARTS} restarts")
    print(f"{'':48} {'ms':>8} {'/ sync':>8}")
    for label, ms in rows:
        print(f"{label:48} {ms:8.2f} {ms / sync:8.1f}")


if __name__ == "__main__":
    main()
