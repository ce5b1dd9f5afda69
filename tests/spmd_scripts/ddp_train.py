"""A plain torchrun script: DDP training (gloo) with fixed seeds; rank 0 saves the final weights.

torchrun --nproc-per-node=2 ddp_train.py OUT.pt [STEPS]
monarch-dsl run --spmd -n 2 ddp_train.py OUT.pt [STEPS]
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main(out: str, steps: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    for step in range(steps):
        x = torch.randn(16, 8, generator=data)
        y = torch.randn(16, 4, generator=data)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
