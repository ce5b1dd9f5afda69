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
time over eager CUDA's (lower is better; 1.00x means no overhead over plain torch), and on an
H100 or H200 what ``plan.simulate`` predicts for the compiled step with the built-in profile.
The peer is plain eager torch on the same GPU in one process: what the user has without us.
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


def simulator_profile(device_name: str) -> str | None:
    """The built-in profile of this GPU, if there is one."""
    for profile in ("h100", "h200"):
        if profile in device_name.lower():
            return profile
    return None


def predicted_ms(name: str, profile: str) -> float:
    """The compiled step's time as ``plan.simulate`` predicts it with the built-in profile."""
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    @md.mesh_fn(data_parallel="dp")
    def step(x, y):
        return train_step(model, opt, x, y)

    plan = step.compile(*batch(name), mesh=md.Mesh.from_string("dp=1"))
    return plan.simulate(profile=profile).step_time * 1e3


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
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to time")
        return
    pm = md.this_host().spawn_procs({"dp": 1}, env={"MD_DEVICE": args.device})
    try:
        where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(f"{where}, torch {torch.__version__}")
        print(f"{'model':<6}{'system':<22}{'ms/step':>10}{'vs eager torch':>15}")
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
            profile = simulator_profile(where)
            if profile:
                predicted = predicted_ms(name, profile)
                measured = statistics.median(times["md compiled"]) * 1e3
                print(
                    f"{name:<6}{'simulated: ' + profile:<22}{predicted:>10.3f}"
                    f"{'':>15}  ({(predicted - measured) / measured:+.0%} of md compiled)"
                )
    finally:
        pm.stop()


if __name__ == "__main__":
    main()
