"""Data-parallel training benchmark: torch DDP vs md.DistributedDataParallel vs a compiled step.

    python benchmarks/ddp.py            # about 2 minutes on a 2-core machine
    python benchmarks/ddp.py --quick    # fewer blocks, about 1 minute

The same training loop body (``opt.zero_grad(); F.mse_loss(model(x), y).backward();
opt.step()``, SGD lr 0.01, the same batch every step) on 2 ranks with 32 samples per rank (a
global batch of 64), for two models:

- ``big``: 8 x (Linear(1024, 1024) + ReLU), 8.4 M parameters (32 MiB of gradients);
- ``tiny``: 4 x (Linear(64, 64) + ReLU), 17 k parameters.

Systems, each timed in blocks of consecutive steps, the blocks of all systems interleaved
(A B C D A B C D ...), so that drift of the machine (the cores are shared) hits all alike:

1. ``torch DDP``: ``torch.nn.parallel.DistributedDataParallel`` (gloo) in 2 processes started
   as torchrun starts them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
   ``OMP_NUM_THREADS=1``; ``torch.set_num_threads(1)``), each rank timing its own block of
   steps; a block's time is the slower rank's.
2. ``md eager``: ``md.DistributedDataParallel(md.to_mesh(model, pm))`` on a ``dp=2`` mesh
   driven from this process, the batch from ``md.distribute(batch, {"dp": md.Shard(0)})``;
   the block ends with ``md.inspect`` of the last loss, as the compiled step's (the steps run
   in order on the workers, so all of them are done) and as torch DDP's ranks, which read no
   loss: the controller issues the next step while the workers run this one. ``md eager,
   read``: the same loop with ``md.inspect(loss)`` after every step (a loop that logs each
   loss), so each step's work is done before the next is issued. Both replay the repeated
   step (md.DistributedDataParallel's default: from the third step, one plan run per step);
   ``md eager, no replay``: the first loop with ``replay=False``, every instruction sent.
3. ``compiled``: ``@md.mesh_fn(data_parallel="dp")`` around the same loop body, called with
   the global batch (each rank gets its 32 rows); the block ends with ``md.inspect`` of the
   last loss (steps run in order on the workers, so all of them are done).
4. ``floor``: what one rank cannot avoid per step (issue 11, item 4): its compute -- the same
   step in one process on one intra-op thread at the per-rank batch (32), timed here, in this
   process -- plus the part of the gradient all-reduce that cannot be hidden behind compute.
   We count the all-reduce of the last gradient bucket of the compiled plan (it holds the
   first layer's gradients, complete only when the backward pass is) between the two worker
   processes, timed in them, as the compiled step does it: in a block of shared memory both
   ranks map (``monarch-dsl calibrate``'s probe of ``all_reduce_block``: a plan whose steps
   write that many float32s into the block, which is reduced where it lies; read as
   calibration reads it: the median over runs of the faster rank's time, from the later
   rank's arrival), or -- where the ranks can have no block
   (``MD_SHM_BLOCKS=0``) -- a raw shared-memory all-reduce (``ShmGroup.all_reduce``: through
   the group's slots; the slower rank's median). The other buckets
   could in principle overlap the backward pass; on this 2-core machine they cannot (each
   rank's core does its own compute and its share of the shared-memory reduction), so the
   whole all-reduce is printed too, as ``compute + all buckets``. ``floor, 2 at once``: the
   same, with the compute timed in both worker processes at once (each its own model and
   rows, no communication; the slower rank's time): on a machine whose ranks share cores,
   caches or memory bandwidth, what a rank's compute costs while the other computes too.

5. ``torch FSDP`` and ``md fully_shard``: the same step with parameters, gradients and
   optimizer state sharded over the 2 ranks -- torch's FSDP2 (``fully_shard`` on each Linear,
   then on the model, over a CPU device mesh; gloo) in the torch ranks' processes, and the
   compiled step with ``md.fully_shard(model)`` (parameters gathered for use and again for the
   backward pass, gradients reduce-scattered). Printed ``vs torch`` against torch FSDP.

Reported per model and system: ms/step (median of the blocks), samples/s (global batch /
step), ``vs torch`` (torch DDP's time / this one's: how many times faster than torch DDP) and
``vs floor`` (this one's time / the floor's). Goals (issue 11), on a 2-core machine:
compiled >= 2.5x torch DDP (big) and >= 5x (tiny), within 1.25x of the floor (big); md eager
>= 1.3x torch DDP (big). The garbage collector is off inside timed blocks (as ``timeit``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault("MONARCH_DSL_QUIET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import monarch_dsl as md  # noqa: E402
from monarch_dsl.calibrate import Probe, comm_seconds  # noqa: E402
from monarch_dsl.compiler.simulate import BLOCK_KIND  # noqa: E402

WORLD, BATCH, LR = 2, 32, 0.01  # ranks, samples per rank
MODELS = {"big": (1024, 8), "tiny": (64, 4)}  # name: (width, layers)
BLOCK_SECONDS = 0.6  # a block's length (steps chosen from the warm-up's step time)


def mlp(width: int, layers: int) -> nn.Module:
    """``layers`` x (Linear(width, width) + ReLU), seeded."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def make_model(name: str) -> nn.Module:
    return mlp(*MODELS[name])


def global_batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    width, _ = MODELS[name]
    g = torch.Generator().manual_seed(1)
    return torch.randn(WORLD * BATCH, width, generator=g), torch.randn(
        WORLD * BATCH, width, generator=g
    )


def train_step(model, opt, x, y):
    """The loop body every system runs."""
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def timed(run, steps: int) -> float:
    """Seconds per step of ``run(steps)``, with the garbage collector off."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        run(steps)
        return (time.perf_counter() - t0) / steps
    finally:
        gc.enable()


# ---- torch DDP: one process per rank, driven over stdin / stdout -----------------------------


def torch_rank() -> None:
    """A torch rank (started by :class:`TorchDDP`): builds both models under DDP and under
    FSDP2 (``<name> fsdp``), then runs ``<model> <steps>`` lines from stdin, answering each
    with its seconds per step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    systems = {}
    for name in MODELS:
        x, y = (t.chunk(WORLD)[rank] for t in global_batch(name))
        model = DDP(make_model(name))
        systems[name] = (model, torch.optim.SGD(model.parameters(), lr=LR), x, y)
        sharded = make_model(name)
        for layer in sharded:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        systems[f"{name} fsdp"] = (sharded, torch.optim.SGD(sharded.parameters(), lr=LR), x, y)
    print("ready", flush=True)
    for line in sys.stdin:
        name, steps = line.rsplit(maxsplit=1)
        model, opt, x, y = systems[name]
        losses = []

        def run(n, model=model, opt=opt, x=x, y=y, losses=losses):
            for _ in range(n):
                losses.append(train_step(model, opt, x, y))

        dist.barrier()  # both ranks start the block together
        secs = timed(run, int(steps))
        ok = all(torch.isfinite(v).item() for v in losses)
        print(json.dumps({"secs": secs, "finite": ok}), flush=True)
    dist.destroy_process_group()


class TorchDDP:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs = []
        for rank in range(WORLD):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(WORLD),
                LOCAL_WORLD_SIZE=str(WORLD),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",  # as torchrun sets it for several processes per host
            )
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--torch-rank"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        for p in self.procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", "rank failed"

    def step_secs(self, name: str, steps: int) -> float:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"{name} {steps}\n")
            p.stdin.flush()
        results = [json.loads(p.stdout.readline()) for p in self.procs]  # type: ignore[union-attr]
        assert all(r["finite"] for r in results), results
        return max(r["secs"] for r in results)

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()  # type: ignore[union-attr]
        for p in self.procs:
            p.wait(timeout=60)


# ---- monarch_dsl ---------------------------------------------------------------------------


def md_eager_training(pm, name: str, replay: bool = True):
    """(``md.DistributedDataParallel`` of the model on ``pm``, its SGD, the global batch laid
    out over dp) for ``train_step``."""
    batch = global_batch(name)  # local data (made before activating), each rank sent its half
    with pm.activate():
        ddp = md.DistributedDataParallel(md.to_mesh(make_model(name), pm), replay=replay)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        xb, yb = md.distribute(batch, {"dp": md.Shard(0)})
    return ddp, opt, xb, yb


def md_eager(pm, name: str, read_each_step: bool = False, replay: bool = True):
    """``read_each_step``: ``md.inspect(loss)`` after every step (a loop that logs each loss),
    else at the end of the block only, as the compiled step and torch DDP's ranks are timed.
    ``replay``: md.DistributedDataParallel's (the repeated step sent as one plan run)."""
    ddp, opt, xb, yb = md_eager_training(pm, name, replay)

    def run(steps: int) -> None:
        with pm.activate():
            for _ in range(steps):
                loss = train_step(ddp, opt, xb, yb)
                if read_each_step:
                    md.inspect(loss)  # the step is done on every rank
            value = md.inspect(loss)  # the steps run in order: all of them are done
        assert torch.isfinite(value).item(), value

    return run


def md_compiled(pm, name: str, sharded: bool = False):
    model = make_model(name)
    if sharded:
        md.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = global_batch(name)

    @md.mesh_fn(data_parallel="dp")
    def step(x, y):
        return train_step(model, opt, x, y)

    def run(steps: int) -> None:
        with pm.activate():
            for _ in range(steps):
                loss = step(x, y)
            value = md.inspect(loss)
        assert torch.isfinite(value).item(), value

    return run


def bucket_bytes(name: str) -> list[int]:
    """The gradient buckets of the compiled step (compiled apart: no processes), in the order
    they are all-reduced, in bytes."""
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    @md.mesh_fn(data_parallel="dp")
    def step(x, y):
        return train_step(model, opt, x, y)

    plan = step.compile(*global_batch(name), mesh=md.Mesh.from_string(f"dp={WORLD}"))
    sizes = []
    for c in plan.collectives:
        m = re.search(r"gradient bucket \d+/\d+ \(\d+ tensors, ([\d.]+) MiB\)", c.reason)
        if m:
            sizes.append(round(float(m.group(1)) * (1 << 20)))
    assert sizes, "the compiled plan has no gradient bucket"
    return sizes


def local_step(name: str):
    """The floor's compute: the step in this process, one intra-op thread, batch 32."""
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = (t[:BATCH] for t in global_batch(name))

    def run(steps: int) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for _ in range(steps):
                train_step(model, opt, x, y)
        finally:
            torch.set_num_threads(threads)

    return run


class RawAllReduce(md.Actor):
    """A shared-memory all-reduce between the workers, timed in them (the floor's
    communication)."""

    @md.endpoint
    def secs(self, numel: int, reps: int) -> float:
        from monarch_dsl.runtime import worker

        ex = worker.current._executor
        group = ex.process_group(list(range(WORLD)), "bench-floor")  # made by both ranks at once
        t = torch.ones(numel)
        group.shm.all_reduce(t, "sum")  # warm: pages touched
        times = []
        for _ in range(reps):
            group.shm.barrier()
            t0 = time.perf_counter()
            group.shm.all_reduce(t, "sum")
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def block_all_reduce_secs(probe, raw, nbytes: int) -> tuple[float, str]:
    """The floor's all-reduce of ``nbytes`` (see the docstring) and how it went: in a block
    of shared memory (as calibration reads the probe: ``comm_seconds``), else through the
    slots (``raw``: the slower rank's median) -- wherever the ranks voted no to a block
    (``MD_SHM_BLOCKS=0``, ``MD_SHM_SIZE_LIMIT``, no room in /dev/shm)."""
    got = probe.comm.call("shm", BLOCK_KIND, nbytes, 5, 0).get().values()
    seconds = comm_seconds(BLOCK_KIND, got)
    if seconds is not None:
        return seconds, "in a block"
    return max(raw.secs.call(nbytes // 4, 5).get().values()), "through the slots"


class LocalSteps(md.Actor):
    """The floor's compute in every worker at once: each rank runs the step alone (its own
    model, its 32 rows, no communication) -- what a rank's compute costs while the other
    rank computes too, on the cores they share."""

    def __init__(self) -> None:
        self.runs: dict[str, object] = {}

    @md.endpoint
    def secs(self, name: str, steps: int) -> float:
        from monarch_dsl.runtime import worker

        run = self.runs.get(name)
        if run is None:
            run = self.runs[name] = local_step(name)
            run(2)  # warm
        group = worker.current._executor.process_group(list(range(WORLD)), "bench-floor")
        group.shm.barrier()  # (both ranks start together)
        return timed(run, steps)


# ---- the run -------------------------------------------------------------------------------


def measure(pm, ddp_torch: TorchDDP, raw, probe, both, name: str, blocks: int) -> dict:
    eager = md_eager(pm, name)
    eager_read = md_eager(pm, name, read_each_step=True)
    eager_off = md_eager(pm, name, replay=False)
    compiled = md_compiled(pm, name)
    compute = local_step(name)
    buckets = bucket_bytes(name)

    ways: set[str] = set()

    def floor_comm() -> tuple[float, float]:
        (last, a), (whole, b) = (
            block_all_reduce_secs(probe, raw, buckets[-1]),
            block_all_reduce_secs(probe, raw, sum(buckets)),
        )
        ways.update((f"last bucket {a}", f"all buckets {b}"))
        return last, whole

    sharded = md_compiled(pm, name, sharded=True)
    systems = {
        "torch DDP": lambda n: ddp_torch.step_secs(name, n),
        "md eager": lambda n: timed(eager, n),
        "md eager, read": lambda n: timed(eager_read, n),
        "md eager, no replay": lambda n: timed(eager_off, n),
        "compiled": lambda n: timed(compiled, n),
        "compute": lambda n: timed(compute, n),
        "compute, 2 at once": lambda n: max(both.secs.call(name, n).get().values()),
        "torch FSDP": lambda n: ddp_torch.step_secs(f"{name} fsdp", n),
        "md fully_shard": lambda n: timed(sharded, n),
    }
    steps = {}
    for key, run in systems.items():  # warm-up (the compiled step compiles twice), and sizing
        run(3)
        steps[key] = max(3, round(BLOCK_SECONDS / run(2)))
    times: dict[str, list[float]] = {key: [] for key in systems}
    last_bucket, all_buckets = [], []
    for _ in range(blocks):
        for key, run in systems.items():
            times[key].append(run(steps[key]))
        last, whole = floor_comm()
        last_bucket.append(last)
        all_buckets.append(whole)
    med = {key: statistics.median(v) for key, v in times.items()}
    med["last bucket"] = statistics.median(last_bucket)
    med["all buckets"] = statistics.median(all_buckets)
    med["floor"] = med["compute"] + med["last bucket"]
    med["floor, 2 at once"] = med["compute, 2 at once"] + med["last bucket"]
    return {"med": med, "times": times, "steps": steps, "buckets": buckets, "ways": ways}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer blocks")
    ap.add_argument("--torch-rank", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.torch_rank:
        torch_rank()
        return
    blocks = 3 if opts.quick else 7
    t_start = time.perf_counter()
    pm = md.this_host().spawn_procs({"dp": WORLD})  # first: before this process runs any op
    ddp_torch = TorchDDP()
    try:
        raw = pm.spawn("raw_all_reduce", RawAllReduce)
        probe = pm.spawn("block_all_reduce", Probe, list(pm.ranks))
        both = pm.spawn("local_steps", LocalSteps)
        results = {name: measure(pm, ddp_torch, raw, probe, both, name, blocks) for name in MODELS}
    finally:
        ddp_torch.close()
        pm.stop()

    print(
        f"DDP training step, {WORLD} ranks x batch {BATCH}, SGD + MSE, {os.cpu_count()} cores, "
        f"torch {torch.__version__}; median of {blocks} interleaved blocks"
    )
    header = (
        f"{'model':5s}  {'system':19s}  {'ms/step':>8s}  {'samples/s':>9s}  {'vs torch':>8s}  "
        f"{'vs floor':>8s}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        med = r["med"]
        rows = [
            (k, med[k], "torch DDP")
            for k in ("torch DDP", "md eager", "md eager, read", "md eager, no replay", "compiled")
        ]
        rows += [(k, med[k], "torch DDP") for k in ("floor", "floor, 2 at once")]
        rows += [(k, med[k], "torch FSDP") for k in ("torch FSDP", "md fully_shard")]
        for system, secs, peer in rows:
            print(
                f"{name:5s}  {system:19s}  {secs * 1e3:8.2f}  {WORLD * BATCH / secs:9.0f}  "
                f"{med[peer] / secs:7.2f}x  {secs / med['floor']:7.2f}x"
            )
    print()
    for name, r in results.items():
        med = r["med"]
        mib = ", ".join(f"{b / (1 << 20):.2f}" for b in r["buckets"])
        whole = med["compute"] + med["all buckets"]
        print(
            f"{name}: floor = compute {med['compute'] * 1e3:.2f} ms (1 process, 1 thread, batch "
            f"{BATCH}) + last bucket's all-reduce {med['last bucket'] * 1e3:.2f} ms; "
            f"compute + all buckets ({mib} MiB) {whole * 1e3:.2f} ms; the same compute in both "
            f"workers at once {med['compute, 2 at once'] * 1e3:.2f} ms "
            f"({med['compute, 2 at once'] / med['compute']:.2f}x alone); compiled / that floor "
            f"{med['compiled'] / med['floor, 2 at once']:.2f}x (all-reduces timed: "
            f"{', '.join(sorted(r['ways']))})"
        )
        for system, v in r["times"].items():
            print(
                f"    {system:19s} blocks of {r['steps'][system]:4d} steps (ms/step): "
                + ", ".join(f"{s * 1e3:.2f}" for s in v)
            )
    big, tiny = results["big"]["med"], results["tiny"]["med"]
    checks = [
        ("compiled >= 2.5x torch DDP (big)", big["torch DDP"] / big["compiled"] >= 2.5),
        ("compiled >= 5x torch DDP (tiny)", tiny["torch DDP"] / tiny["compiled"] >= 5),
        ("compiled within 1.25x of the floor (big)", big["compiled"] / big["floor"] <= 1.25),
        ("md eager >= 1.3x torch DDP (big)", big["torch DDP"] / big["md eager"] >= 1.3),
    ]
    print()
    for what, ok in checks:
        print(f"{'PASS' if ok else 'MISS'}  {what}")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
