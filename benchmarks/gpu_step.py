"""A training step on one GPU: eager CUDA torch in this process beside the same step on a
one-CUDA-worker mesh, compiled (``@md.mesh_fn``, the C++ runtime) and eager (the tensor
engine, an instruction per op from this controller).

    python benchmarks/gpu_step.py          # needs a CUDA GPU; about a minute

The loop body is ``benchmarks/ddp.py``'s (``opt.zero_grad(); F.mse_loss(model(x),
y).backward(); opt.step()``, SGD lr 0.01, the same batch every step), for two models:

- ``big``: 8 x (Linear(4096, 4096) + ReLU), batch 1024: the GPU's work sets the pace;
- ``tiny``: 4 x (Linear(64, 64) + ReLU), batch 32: launch and control overheads set it.

Each system is timed in blocks of consecutive steps, blocks interleaved (A B C A B C ...);
a block ends when its work is done (``torch.cuda.synchronize()`` here, ``md.inspect`` of the
last loss on the mesh). Printed per model: ms/step (median of the blocks) and each system's
time over eager CUDA's (lower is better; 1.00x means no overhead over plain torch). The peer
is plain eager torch on the same GPU in one process: what the user has without us.

Then the simulator's accuracy on this GPU (issue 13; ``benchmarks/simulator.py`` is the same
table for CPU workers): each md step predicted with each ``--profiles`` profile (default: the
built-in one of this GPU, and ``"cuda-local"`` once ``monarch-dsl calibrate --device cuda``
has measured it) beside its measured time, and the error. Compiled steps: ``plan.simulate``,
called back to back (``steady_step_time``); their peak CUDA memory in a call above what is
allocated when it starts (``plan.simulate().peak_memory - resident_memory``, less the
arguments: mesh tensors here, allocated before the call) beside the worker's
(``torch.cuda.max_memory_allocated`` over 3 calls; its blocks are whole multiples of 512
bytes, which the simulator does not round to: a few KiB on the tiny step). Eager steps:
``md.Simulator`` running the same loop, per step (the time of 6 steps less that of 2, over
4: the model's first copy to the mesh is not a step).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

os.environ.setdefault("MONARCH_DSL_QUIET", "1")

import torch  # noqa: E402
from ddp import mlp, train_step  # noqa: E402  (benchmarks/ddp.py: the same loop body)
from torch import nn  # noqa: E402

import monarch_dsl as md  # noqa: E402

LR = 0.01
MODELS = {"big": (4096, 8, 1024), "tiny": (64, 4, 32)}  # name: (width, layers, batch)


def make_model(name: str) -> nn.Module:
    width, layers, _ = MODELS[name]
    return mlp(width, layers)


def batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    width, _, n = MODELS[name]
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def eager_local(name: str, device: str):
    model = make_model(name).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = (t.to(device) for t in batch(name))

    def run(steps: int) -> float:
        for _ in range(steps):
            loss = train_step(model, opt, x, y)
        if device == "cuda":
            torch.cuda.synchronize()
        return loss.item()

    return run


def md_compiled(pm, name: str):
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = batch(name)
    with pm.activate():
        xm, ym = md.distribute((x, y), {"dp": md.Replicate()})  # on the worker's GPU once

    @md.mesh_fn(data_parallel="dp")
    def step(x, y):
        return train_step(model, opt, x, y)

    def run(steps: int) -> float:
        with pm.activate():
            for _ in range(steps):
                loss = step(xm, ym)
            return md.inspect(loss).item()

    return run


def md_eager(pm, name: str):
    x, y = batch(name)
    with pm.activate():
        model = md.to_mesh(make_model(name), pm)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        xm, ym = md.distribute((x, y), {"dp": md.Replicate()})

    def run(steps: int) -> float:
        with pm.activate():
            for _ in range(steps):
                loss = train_step(model, opt, xm, ym)
            return md.inspect(loss).item()

    return run


def default_profiles(device_name: str) -> list[str]:
    """The built-in profile of this GPU (H100's for another), and ``"cuda-local"`` where it
    has been measured here."""
    from monarch_dsl.calibrate import gpu_base
    from monarch_dsl.compiler.profile import calibrated_path

    names = [gpu_base(device_name).name]
    if calibrated_path("cuda-local").exists():
        names.append("cuda-local")
    return names


def predicted_compiled(name: str, profile: str) -> tuple[float, int]:
    """The compiled step's seconds per call, called back to back, as ``plan.simulate``
    predicts them (``steady_step_time``: its inputs are on the worker already), and the peak
    bytes in a call above those allocated when it starts. (``plan.simulate`` counts the
    arguments as coming with the call, as local tensors do; here they are mesh tensors,
    allocated before it: their bytes are not the call's.)"""
    from monarch_dsl.compiler.simulate import call_results, steady_step_time

    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    @md.mesh_fn(data_parallel="dp")
    def step(x, y):
        return train_step(model, opt, x, y)

    plan = step.compile(*batch(name), mesh=md.Mesh.from_string("dp=1"))
    p = md.DeviceProfile.get(profile)
    report = plan.simulate(profile=p)
    per_call = steady_step_time(
        report.step_time, p, len(plan.inputs), [], ranks=1, outputs=call_results(plan)
    )
    args = sum(t.numel() * t.element_size() for t in batch(name))  # (dp=1: whole)
    return per_call, report.peak_memory[0] - report.resident_memory[0] - args


def predicted_eager(name: str, profile: str) -> float:
    """Seconds per eager step as ``md.Simulator`` predicts them: (6 steps - 2 steps) / 4."""

    def program(steps: int) -> float:
        sim = md.Simulator(hosts=1, gpus=1, profile=profile)
        x, y = batch(name)
        with sim.mesh.activate():
            model = md.to_mesh(make_model(name), sim.mesh)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            xm, ym = md.to_mesh((x, y), sim.mesh)
            for _ in range(steps):
                loss = train_step(model, opt, xm, ym)
            md.inspect(loss)
        seconds = sim.summary().step_time
        sim.mesh.stop()
        return seconds

    return (program(6) - program(2)) / 4


@md.remote(propagate=lambda: torch.empty(1, dtype=torch.int64, device="meta"))
def cuda_memory_start():
    """Start of the measured calls: the bytes allocated now; the peak counts from here."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.tensor([torch.cuda.memory_allocated()])


@md.remote(propagate=lambda: torch.empty(1, dtype=torch.int64, device="meta"))
def cuda_memory_peak():
    """The most bytes allocated since ``cuda_memory_start``."""
    torch.cuda.synchronize()
    return torch.tensor([torch.cuda.max_memory_allocated()])


def measured_memory(pm, run) -> int:
    """The worker's peak CUDA bytes during 3 calls of ``run`` (one at a time: each call's
    result fetched before the next) above those allocated when they start."""
    with pm.activate():
        start = md.inspect(cuda_memory_start()).item()
    for _ in range(3):
        run(1)
    with pm.activate():
        return md.inspect(cuda_memory_peak()).item() - start


def timed(run, steps: int) -> float:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        value = run(steps)
        secs = (time.perf_counter() - t0) / steps
    finally:
        gc.enable()
    assert value == value, "the loss is NaN"
    return secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--block-seconds", type=float, default=0.5)
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script, no GPU")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument(
        "--profiles", nargs="*", default=None,
        help="profiles to predict with (default: this GPU's built-in, and cuda-local if "
        "calibrated)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to time")
        return
    pm = md.this_host().spawn_procs({"dp": 1}, env={"MD_DEVICE": args.device})
    try:
        where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(f"{where}, torch {torch.__version__}")
        print(f"{'model':<6}{'system':<22}{'ms/step':>10}{'vs eager torch':>15}")
        measured: dict[tuple[str, str], float] = {}
        memory: dict[str, int] = {}
        for name in args.models:
            systems = {
                "eager torch (peer)": eager_local(name, args.device),
                "md compiled": md_compiled(pm, name),
                "md eager": md_eager(pm, name),
            }
            steps = {}
            for label, run in systems.items():
                run(3)  # warm-up: compile, send the plan, CUDA kernels' first launch
                per = timed(run, 3)
                steps[label] = max(3, int(args.block_seconds / per))
            times: dict[str, list[float]] = {k: [] for k in systems}
            for _ in range(args.blocks):
                for label, run in systems.items():
                    times[label].append(timed(run, steps[label]))
            base = statistics.median(times["eager torch (peer)"])
            for label in systems:
                ms = statistics.median(times[label]) * 1e3
                print(f"{name:<6}{label:<22}{ms:>10.3f}{ms / (base * 1e3):>14.2f}x")
            measured[(name, "compiled")] = statistics.median(times["md compiled"])
            measured[(name, "eager")] = statistics.median(times["md eager"])
            if args.device == "cuda":
                memory[name] = measured_memory(pm, systems["md compiled"])
    finally:
        pm.stop()
    profiles = args.profiles
    if profiles is None:
        profiles = default_profiles(where) if args.device == "cuda" else ["cpu-local"]
    accuracy(args.models, measured, memory, profiles)


def accuracy(
    models: list[str],
    measured: dict[tuple[str, str], float],
    memory: dict[str, int],
    profiles: list[str],
) -> None:
    """The simulator's predictions with each profile beside the measured times and memory."""
    for profile in profiles:
        p = md.DeviceProfile.get(profile)
        print(f"\nsimulator accuracy, profile {profile} ({p.notes})")
        print(f"{'case':<16}{'predicted ms':>13}{'measured ms':>13}{'error':>8}"
              f"{'pred. MiB':>11}{'meas. MiB':>11}{'error':>8}")  # fmt: skip
        errors, mem_errors = [], []
        for name in models:
            for kind in ("compiled", "eager"):
                got = measured[(name, kind)]
                mem = ""
                if kind == "compiled":
                    want, peak = predicted_compiled(name, profile)
                    if name in memory:
                        me = (peak - memory[name]) / max(1, memory[name])
                        mem_errors.append(abs(me))
                        mem = f"{peak / 2**20:11.1f}{memory[name] / 2**20:11.1f}{me:+8.1%}"
                else:
                    want = predicted_eager(name, profile)
                e = (want - got) / got
                errors.append(abs(e))
                print(f"{kind + ' ' + name:<16}{want * 1e3:13.3f}{got * 1e3:13.3f}{e:+8.1%}{mem}")
        print(f"time: median |error| {statistics.median(errors):.1%} (goal <= 10%), "
              f"max {max(errors):.1%} (goal <= 25%)")  # fmt: skip
        if mem_errors:
            print(f"memory: max |error| {max(mem_errors):.1%} (goal <= 10%)")


if __name__ == "__main__":
    main()
