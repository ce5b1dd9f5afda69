"""Where an eager ``md.DistributedDataParallel`` step's CPU goes, what the record/replay of
the step (issue 11, item 2; ``tensor/replay.py``) buys, and what it could buy at best.

    python benchmarks/eager_step.py [--blocks N]

The loop of ``benchmarks/ddp.py`` (SGD + MSE, batch 32 per rank, 2 ranks on this host), eager
``md.DistributedDataParallel``, for its two models, twice, blocks interleaved: ``eager``
(``replay=False``: every instruction sent) and ``replay`` (the default: the repeated step sent
as one plan run). Per step, medians of N blocks:

- ``wall``: issuing the block's steps until the last one is done on every rank;
- ``controller main`` / ``controller others``: the controller's CPU, on the loop's thread
  (the user's Python, autograd, torch's dispatch into md.Tensor and the engine's handlers) and
  on its other threads (encoding and sending the batches, replies);
- ``worker main`` / ``worker others``: a worker's CPU (mean of the ranks), on its main thread
  (receiving and decoding the batches, preparing the ops) and on the others (the stream
  threads running the ops and collectives);
- ``instructions``: what the controller issued per step.

Then two floors, in the same run:

- ``controller, nothing sent``: the same loop with the engine's ``append`` dropping every
  instruction (a separate model, thrown away after). What is left is the controller's part
  that a replay would nearly all still run: the user's loop runs its Python, autograd and the
  dispatch into md.Tensor on every step, whatever the workers are sent (a replay could skip
  only the handlers' last part, building the instruction and finding the user's line);
- ``compiled step``: ``@md.mesh_fn(data_parallel="dp")`` around the same body: the workers
  running the step as one plan (the C++ runtime), one message per step.

A replay that sends one message per step and runs the recorded step as a plan can at best take
the larger of the two floors per step; ``bound`` prints the eager wall / that, beside what the
replay got (eager wall / replay wall). An optimistic bound: it takes the two as overlapping
perfectly, where on a host with few cores the controller and the workers share them. Not a
test: the figures depend on the host.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("MONARCH_DSL_QUIET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from ddp import (  # noqa: E402
    MODELS,
    WORLD,
    md_compiled,
    md_eager,
    md_eager_training,
    timed,
    train_step,
)

import monarch_dsl as md  # noqa: E402
from monarch_dsl.tensor.engine import Engine  # noqa: E402


def thread_cpu(pid: int) -> tuple[float, float]:
    """(main thread, other threads) CPU seconds of process ``pid`` so far (``schedstat``:
    nanoseconds, where ``stat`` counts 10 ms ticks)."""
    main = others = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                secs = int(f.read().split()[0]) / 1e9
        except OSError:  # the thread ended meanwhile
            continue
        if int(tid) == pid:
            main += secs
        else:
            others += secs
    return main, others


def eager_loop(pm, name: str, replay: bool):
    """A step function of the eager loop on ``pm`` (its model made here), warmed up."""
    run = md_eager(pm, name, replay=replay)
    run(5)  # buckets rebuilt after the first step; caches warm
    return run


def measure_eager(pm, run, steps: int) -> dict:
    """Per step: wall, the controller's CPU by thread, a worker's CPU by thread, instructions."""
    engine = Engine.of(pm)
    workers = list(pm._job.pids.values())
    issued = [0]
    append = engine.append

    def counting(mesh, ins):
        issued[0] += 1
        append(mesh, ins)

    engine.append = counting  # (an instance attribute: the class's method is untouched)
    try:
        gc.collect()
        gc.disable()
        w0 = [thread_cpu(p) for p in workers]
        c0, m0 = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        run(steps)
        wall = time.perf_counter() - t0
        c1, m1 = time.process_time(), time.thread_time()
        w1 = [thread_cpu(p) for p in workers]
    finally:
        gc.enable()
        del engine.append
    n = len(workers)
    return {
        "wall": wall / steps,
        "controller main": (m1 - m0) / steps,
        "controller others": ((c1 - c0) - (m1 - m0)) / steps,
        "worker main": sum(b[0] - a[0] for a, b in zip(w0, w1)) / n / steps,
        "worker others": sum(b[1] - a[1] for a, b in zip(w0, w1)) / n / steps,
        "instructions": issued[0] / steps,
    }


def controller_floor(pm, name: str, steps: int, blocks: int) -> float:
    """The loop's controller main-thread CPU per step with nothing sent, on a model of its own
    (made and warmed up as usual first). Its handles then name values the workers never made:
    the model is dropped after, and of its values only those the workers made are deleted."""
    ddp, opt, xb, yb = md_eager_training(pm, name, replay=False)
    with pm.activate():
        for _ in range(5):
            loss = train_step(ddp, opt, xb, yb)
        md.inspect(loss)  # every rank is done: nothing of this model is in flight
    engine = Engine.of(pm)
    first_dropped = next(engine.refs)  # values from here on are never made on the workers
    engine.append = lambda mesh, ins: None
    try:
        secs = []
        with pm.activate():
            for _ in range(blocks + 1):
                gc.collect()
                gc.disable()
                try:
                    t0 = time.thread_time()
                    for _ in range(steps):
                        train_step(ddp, opt, xb, yb)
                    secs.append((time.thread_time() - t0) / steps)
                finally:
                    gc.enable()
        del ddp, opt, xb, yb, loss
        gc.collect()
        return statistics.median(secs[1:])
    finally:
        del engine.append
        # Deletes of values the workers made (the warm-up's, the model's) stay for the next
        # batch; those of the dropped steps' values go (the ones that died before the
        # activation ended were sent with its flush: a worker ignores an unknown ref).
        engine.dead.extend(d for d in engine._take_dead() if d[0] < first_dropped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=5, help="blocks per figure (median)")
    opts = ap.parse_args()
    torch.set_num_threads(1)
    pm = md.this_host().spawn_procs({"dp": WORLD})
    rows = {}
    try:
        for name in MODELS:
            loops = {"eager": eager_loop(pm, name, False), "replay": eager_loop(pm, name, True)}
            compiled = md_compiled(pm, name)
            compiled(5)
            steps = max(5, round(0.5 / timed(loops["eager"], 5)))
            csteps = max(5, round(0.5 / timed(compiled, 5)))
            runs: dict[str, list[dict]] = {k: [] for k in loops}
            cwall = []
            for _ in range(opts.blocks):
                for k, run in loops.items():
                    runs[k].append(measure_eager(pm, run, steps))
                cwall.append(timed(compiled, csteps))
            floor = controller_floor(pm, name, steps, opts.blocks)
            for k, done in runs.items():
                row = {c: statistics.median(r[c] for r in done) for c in done[0]}
                row["compiled"] = statistics.median(cwall)
                row["floor"] = floor
                rows[(name, k)] = row
    finally:
        pm.stop()

    print(
        f"Eager md.DistributedDataParallel step, {WORLD} ranks x batch 32, SGD + MSE, "
        f"{os.cpu_count()} cores, torch {torch.__version__}; medians of {opts.blocks} blocks, "
        "ms per step (CPU: per thread group; worker: mean of the ranks)"
    )
    cols = (
        "wall",
        "controller main",
        "controller others",
        "worker main",
        "worker others",
        "floor",
        "compiled",
    )
    label = {"floor": "ctl, nothing sent"}
    header = f"{'model':5s}  {'loop':6s}  {'instr':>5s}  " + "  ".join(
        f"{label.get(c, c):>17s}" for c in cols
    )
    print(header)
    print("-" * len(header))
    for (name, loop), r in rows.items():
        cells = "  ".join(f"{r[c] * 1e3:17.3f}" for c in cols)
        print(f"{name:5s}  {loop:6s}  {r['instructions']:5.0f}  {cells}")
    print()
    for name in MODELS:
        r, done = rows[(name, "eager")], rows[(name, "replay")]
        best = max(r["floor"], r["compiled"])
        print(
            f"{name}: replay {r['wall'] / done['wall']:.2f}x faster than eager "
            f"({done['wall'] * 1e3:.2f} vs {r['wall'] * 1e3:.2f} ms/step); bound "
            f"{r['wall'] / best:.2f}x (a replay takes at least max(controller with nothing sent "
            f"{r['floor'] * 1e3:.2f}, compiled step {r['compiled'] * 1e3:.2f}) = "
            f"{best * 1e3:.2f} ms/step)"
        )


if __name__ == "__main__":
    main()
