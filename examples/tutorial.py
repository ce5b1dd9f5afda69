"""The tensor engine walkthrough (issue 3), on a local CPU mesh (gloo); unchanged on GPUs.

python examples/tutorial.py

"""

import copy

import torch

import monarch_dsl as md


@md.remote
def my_shard(batch):
    """Each data-parallel rank takes its own slice of the batch."""
    return batch[md.current_rank()["dp"]].clone()


def ddp_step(mesh, model, batch, lr=0.1):
    """A hand-written DDP step: each gradient is averaged over `dp` on a `comms` stream as soon
    as backward produces it, overlapping the rest of the backward pass on the workers."""
    comms = md.Stream("comms")
    loss = model(my_shard(batch)).pow(2).mean()
    params = list(reversed(list(model.parameters())))  # the order backward reaches them
    lent = []
    for param, grad in zip(params, md.grad_generator(loss, params)):
        on_comms, borrow = comms.borrow(grad, mutable=True)
        with comms.activate():
            on_comms.reduce_("dp", "avg")
        lent.append((param, grad, borrow))
    for param, grad, borrow in lent:
        borrow.drop()  # main waits for the reduce here, not before
        with torch.no_grad():
            param -= lr * grad
    return loss


def main() -> None:
    # A 4-rank mesh, and the same 4 processes seen as a 2x2 host/gpu mesh.
    procs = md.this_host().spawn_procs({"host": 2, "gpu": 2})
    flat = procs.flatten("rank")
    print(procs.to_table())

    with procs.activate():
        torch.manual_seed(0)
        x = torch.rand(3, 4)
        y = x @ x.T
        md.show(y)  # rank 0
        md.show(y, host=1, gpu=1)  # the same seed on every rank: the same values

        # A command that fails on the workers (far too big), then one that works.
        too_big = torch.ones(1 << 50)
        try:
            md.inspect(too_big.sum())
        except md.RemoteError as e:
            print("failed as expected:", e.error.splitlines()[0][:80])
        print("recovered:", md.inspect(torch.ones(2) * 2).tolist())

        # Double a batch size until an allocation fails; report the largest that worked.
        # The limit is what a worker may allocate: on a GPU, its memory; on the CPU, the
        # worker's memory budget (a share of the host's available memory, or
        # spawn_procs(memory_limit=...)), so the OS never kills a worker for its memory.
        size, largest = 1 << 24, None
        while size <= 1 << 50:
            try:
                md.inspect(torch.empty(size)[:1])
                largest = size
                size *= 2
            except md.RemoteError:
                break
        print(f"largest batch that worked: {largest} elements")

        # Collectives by dimension name.
        g = procs.rank("gpu").float()
        print("reduce over gpu:", md.inspect(g.reduce("gpu"), host=0, gpu=1).item())
        h = procs.rank("host").float()
        print("reduce over host:", md.inspect(h.reduce("host"), host=1, gpu=0).item())
        print("stack over everything:", md.inspect(procs.rank(("host", "gpu")).reduce((), "stack")))

    # Mesh algebra on process meshes: rename, split, slice.
    dp_tp = procs.rename(host="dp", gpu="tp")
    split = flat.split(rank=("pp", "dp"), dp=2)
    print("renamed:", dp_tp, " split:", split, " slice:", procs.slice(gpu=1).ranks)

    # A 2-stage pipeline: activations move between the stages with to_mesh.
    stage0, stage1 = split.slice(pp=0), split.slice(pp=1)
    with stage0.activate():
        torch.manual_seed(1)
        w0 = torch.rand(4, 4)
        acts = torch.relu(torch.ones(2, 4) @ w0)
        sent = acts.to_mesh(stage1)
    with stage1.activate():
        torch.manual_seed(2)
        w1 = torch.rand(4, 1)
        out = sent @ w1
        print("pipeline output at dp=1:", md.inspect(out, dp=1).flatten().tolist())

    # Data parallel by hand: 4 ranks along `dp`, checked against one local process.
    dp = flat.rename(rank="dp")
    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = copy.deepcopy(local)
    batch = torch.randn(4, 5, 4)  # 4 shards of 5 samples
    with dp.activate():
        md.to_mesh(model, dp)
        on_mesh = md.to_mesh(batch, dp)
        for _ in range(3):
            ddp_step(dp, model, on_mesh)
        trained = [md.inspect(p, dp=3) for p in model.parameters()]
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        local(batch.reshape(-1, 4)).pow(2).mean().backward()
        opt.step()
    same = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(trained, local.parameters()))
    print("ddp step matches single-process training:", same)

    procs.stop()


if __name__ == "__main__":
    main()
