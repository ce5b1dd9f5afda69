"""The README's first command (``bash scripts/demo.sh``): a training step compiled for a
``dp x tp`` mesh, looked at, checked, and run on 4 local CPU worker processes, its losses
beside the same training in this one process; then actors.

python examples/demo.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

import monarch_dsl as md

STEPS = 5


def make_step():
    """A 2-layer MLP with AdamW and its training step, written for one device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 76 - len(title)))


def main() -> None:
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)) for _ in range(STEPS)
    ]

    section("1. the mesh: 2-way data parallel x 2-way tensor parallel")
    mesh = md.Mesh.from_string("dp=2,tp=2")
    print(mesh.to_table())

    section("2. compile the step (no processes needed)")
    # The batch is split over dp; the MLP is Megatron-style over tp: the first Linear split by
    # output features (column parallel), the second by input features (row parallel).
    step = md.mesh_fn(
        data_parallel="dp",
        placements={
            "model.0.weight": {"tp": md.Shard(0)},
            "model.0.bias": {"tp": md.Shard(0)},
            "model.2.weight": {"tp": md.Shard(1)},
        },
    )(make_step())
    start = time.perf_counter()
    plan = step.compile(*batches[0], mesh=mesh)
    print(f"compiled in {time.perf_counter() - start:.2f} s; the communications it inserted:\n")
    print(plan.summary())
    plan.check()
    print("\nplan.check(): every collective is matched on all 4 ranks; no transfer can deadlock")
    lines = len(str(plan).splitlines())
    print(f"(str(plan) is the whole plan, one line per instruction: {lines} lines)")

    section("3. run it on 4 local CPU worker processes, beside one process")
    local = make_step()
    want = [local(x, y).item() for x, y in batches]
    pm = md.this_host().spawn_procs({"dp": 2, "tp": 2})
    try:
        with pm.activate():
            losses = [step(x, y) for x, y in batches]  # the plan is sent once, then run
            got = [md.inspect(loss).item() for loss in losses]
    finally:
        pm.stop()
    print(f"{'step':>4}  {'loss on the mesh':>16}  {'loss, one process':>17}  {'difference':>10}")
    for i, (a, b) in enumerate(zip(got, want)):
        print(f"{i:>4}  {a:>16.6f}  {b:>17.6f}  {abs(a - b):>10.1e}")
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst < 1e-4, f"the mesh's losses differ from one process's by {worst}"
    print("the compiled step on the mesh trains exactly like one process (up to float rounding)")

    section("4. actors")
    from actors import main as actors_main

    actors_main()


if __name__ == "__main__":
    main()
