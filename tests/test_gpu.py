"""The tensor engine on CUDA workers (NCCL groups, tensors on ``cuda:<local index>``).

Marked ``gpu``: skipped where there is no GPU (CI). The tutorial on CUDA is in
test_examples.py."""

import pytest
import torch
from conftest import doubling_search

import monarch_dsl as md

pytestmark = [pytest.mark.gpu, pytest.mark.procs]


@pytest.fixture
def gpu_mesh():
    n = min(2, torch.cuda.device_count())
    pm = md.this_host().spawn_procs({"gpu": n}, env={"MD_DEVICE": "cuda"})
    try:
        yield pm
    finally:
        pm.stop()


def test_tensors_live_on_the_workers_gpus(gpu_mesh):
    n = len(gpu_mesh)
    with gpu_mesh.activate():
        torch.manual_seed(0)
        x = torch.rand(64, 64)
        assert x.device.type == "cuda"
        y = x @ x
        torch.manual_seed(0)
        expected = torch.rand(64, 64)  # on the workers too: compared on the CPU
        torch.testing.assert_close(
            md.inspect(y, gpu=n - 1), md.inspect(expected @ expected, gpu=n - 1)
        )
        total = md.inspect(torch.ones(8).reduce("gpu"))  # an NCCL all-reduce
        assert total.tolist() == [float(n)] * 8
        md.inspect(x.reduce("gpu", "stack"))  # all-gather


def test_a_failed_cuda_command_leaves_the_workers_usable(gpu_mesh):
    with gpu_mesh.activate():
        big = torch.empty(1 << 44)  # 64 TiB: fails on every GPU
        with pytest.raises(md.RemoteError):
            md.inspect(big)
        assert md.inspect(torch.ones(2) * 2).tolist() == [2.0, 2.0]


def test_streams_and_borrows_on_cuda_streams(gpu_mesh):
    """The comms stream runs on a CUDA stream of its own: a borrow makes it wait (on the GPU)
    for the matmul issued on main before it reduces the result."""
    n = len(gpu_mesh)
    comms = md.Stream("comms")
    with gpu_mesh.activate():
        x = torch.ones(2048, 2048)
        y = x @ x  # every element 2048
        lent, borrow = comms.borrow(y)
        with comms.activate():
            total = lent.reduce("gpu")
        borrow.drop()
        with comms.activate():
            value = md.inspect(total)
    assert torch.equal(value, torch.full((2048, 2048), 2048.0 * n))


def test_search_what_works_ends_in_a_cuda_oom_and_a_live_worker():
    """The tutorial's loop on a real GPU: allocations doubling until one fails. The failure is a
    RemoteError naming CUDA's out-of-memory, and the same worker keeps computing on the GPU."""
    pm = md.this_host().spawn_procs({"gpu": 1}, env={"MD_DEVICE": "cuda"})
    try:
        with pm.activate():
            largest, error = doubling_search(1 << 28, 1 << 42)
            assert largest is not None
            assert largest * 4 <= torch.cuda.get_device_properties(0).total_memory
            assert "out of memory" in str(error).lower(), error
            x = torch.ones(1024, 1024)
            assert md.inspect((x @ x).sum()).item() == 1024.0**3
    finally:
        pm.stop()


def test_more_cuda_workers_than_gpus_is_refused_clearly():
    n = torch.cuda.device_count()
    with pytest.raises(md.SpawnError, match=r"CUDA device"):
        md.this_host().spawn_procs({"gpu": n + 1}, env={"MD_DEVICE": "cuda"})


def test_a_compiled_step_on_a_cuda_worker_trains_like_local_cuda():
    """@md.mesh_fn on a one-GPU mesh (the C++ runtime on CUDA tensors) gives the losses and
    weights of the same three steps in this process on the same GPU."""
    from compiler_helpers import mse_step
    from torch import nn

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    step = md.mesh_fn(mse_step(model, opt), data_parallel="dp")
    pm = md.this_host().spawn_procs({"dp": 1}, env={"MD_DEVICE": "cuda"})
    try:
        with pm.activate():
            losses = [md.inspect(step(x, y)).item() for _ in range(3)]
        step.pull()
    finally:
        pm.stop()

    ref = make().cuda()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_step = mse_step(ref, ref_opt)
    want = [ref_step(x.cuda(), y.cuda()).item() for _ in range(3)]
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.detach().cpu(), q.detach().cpu(), atol=1e-5, rtol=1e-5, msg=name
        )


def test_eager_backward_and_ddp_on_a_cuda_worker():
    """Autograd on mesh tensors of a CUDA worker (the controller records the backward; its own
    GPU threads must not be asked to run it): loss.backward(), md.DistributedDataParallel and
    md.grad_generator give local CUDA's gradients."""
    import torch.nn.functional as F
    from torch import nn

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    ref = make().cuda()
    F.mse_loss(ref(x.cuda()), y.cuda()).backward()
    want = [p.grad.cpu() for p in ref.parameters()]

    # made here, on the CPU: a module made under activate() is initialized by the workers' CUDA
    # generator, whose numbers differ from the CPU's
    local = [make() for _ in range(3)]
    pm = md.this_host().spawn_procs({"dp": 1}, env={"MD_DEVICE": "cuda"})
    try:
        with pm.activate():
            xm, ym = md.distribute((x, y), {"dp": md.Replicate()})
            model = md.to_mesh(local[0], pm)
            F.mse_loss(model(xm), ym).backward()
            got = [md.inspect(p.grad) for p in model.parameters()]

            ddp = md.DistributedDataParallel(md.to_mesh(local[1], pm))
            F.mse_loss(ddp(xm), ym).backward()
            got_ddp = [md.inspect(p.grad) for p in ddp.parameters()]

            model2 = md.to_mesh(local[2], pm)
            loss = F.mse_loss(model2(xm), ym)
            params = list(model2.parameters())
            got_gen = [md.inspect(gr) for gr in md.grad_generator(loss, params)]
    finally:
        pm.stop()
    for a, b, c, w in zip(got, got_ddp, got_gen, want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b, w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, w, atol=1e-5, rtol=1e-5)
