"""One data-parallel training loop, run four ways; each prints the same losses and weights.

    torchrun --nproc-per-node=2 examples/ddp_train.py       # torch DDP, 2 processes (gloo)
    monarch-dsl run --spmd -n 2 examples/ddp_train.py       # the same script, unchanged, on a mesh
    python examples/ddp_train.py --md                       # md.DistributedDataParallel, eager
    python examples/ddp_train.py --md --compiled            # the loop body as one compiled plan

The loop (``train``) is the same in every case; only the setup differs (``setup_torch`` vs
``setup_md``): the README shows the diff.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

STEPS, BATCH, WORLD = 5, 16, 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 32, generator=g), torch.randn(BATCH, 8, generator=g))
        for _ in range(STEPS)
    ]


def train(model, opt, data):
    """The training loop: unchanged between torch DDP and monarch_dsl."""
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss)
    return losses


def setup_torch():
    """torchrun: one process per rank; each takes its rank's part of every batch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model())
    data = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in global_batches()]
    return model, data, rank == 0, lambda t: t.detach()


def setup_md(pm, batches):
    """monarch_dsl: one controller; the model and the data are put on the mesh."""
    import monarch_dsl as md

    model = md.DistributedDataParallel(md.to_mesh(make_model(), pm))
    data = [md.distribute((x, y), {"dp": md.Shard(0)}) for x, y in batches]
    return model, data, True, md.inspect


def report(losses, model, fetch) -> None:
    # Each rank's loss is its own batch's; the mean over ranks is the global batch's loss.
    print("losses (rank 0):", [round(float(fetch(loss)), 6) for loss in losses])
    weight = next(model.parameters())
    print("weight checksum:", round(float(fetch(weight).sum()), 6))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--md", action="store_true", help="drive the workers from this process")
    parser.add_argument("--compiled", action="store_true", help="compile the loop body (with --md)")
    args = parser.parse_args()
    if not args.md:  # under torchrun (or monarch-dsl run --spmd)
        import torch.distributed as dist

        model, data, leader, fetch = setup_torch()
        try:
            losses = train(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
            if leader:
                report(losses, model, fetch)
        finally:
            # As torch asks; the DDP module (its reducer holds the group) goes first: left to
            # interpreter exit, a gloo rank sometimes aborted ("terminate called without an
            # active exception", about 1 run in 8 on torch 2.13, CPU).
            del model
            dist.destroy_process_group()
        return

    import monarch_dsl as md

    # Made here, before pm.activate(): under it, torch.randn would run on the workers.
    batches = global_batches()
    pm = md.this_host().spawn_procs({"dp": WORLD})
    try:
        if not args.compiled:
            with pm.activate():
                model, data, _, fetch = setup_md(pm, batches)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                report(train(model, opt, data), model, fetch)
            return
        model = make_model()  # a plain local module: the compiler lays it out over dp
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        @md.mesh_fn(data_parallel="dp")
        def step(x, y):  # the same loop, one batch at a time
            return train(model, opt, [(x, y)])[0]

        with pm.activate():
            losses = [step(x, y) for x, y in batches]
            # The compiled step returns the global batch's loss (the mean over the ranks').
            print("global losses:", [round(float(md.inspect(loss)), 6) for loss in losses])
        step.pull()  # the trained weights back into the local module
        print("weight checksum:", round(float(next(model.parameters()).detach().sum()), 6))
    finally:
        pm.stop()


if __name__ == "__main__":
    os.environ.setdefault("MONARCH_DSL_QUIET", "1")
    main()
