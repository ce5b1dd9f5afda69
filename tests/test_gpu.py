"""The tensor engine on CUDA workers (NCCL groups, tensors on ``cuda:<local index>``).

Marked ``gpu``: skipped where there is no GPU (CI). The tutorial on CUDA is in
test_examples.py."""

import pytest
import torch

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
