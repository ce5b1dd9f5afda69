"""md.DistributedDataParallel and md.distribute on real workers, against one process.

Scenarios ported from torch's own DDP tests (test_c10d_common.py, distributed_test.py): parity
with one process over several steps (SGD, AdamW), bucket caps, bucket order rebuilt from the
first iteration, no_sync accumulation, unused parameters (the error names them; correct with
find_unused_parameters), buffers broadcast, state_dict round trip into a plain module, ranks
with different parameter shapes refused, bad arguments, and a worker killed mid-training."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from conftest import local_mesh
from torch import nn

import monarch_dsl as md

pytestmark = pytest.mark.procs


dp2 = local_mesh({"dp": 2})


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def _batches(n=3, rows=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)) for _ in range(n)
    ]


def _train_local(model, opt, batches, micro=1):
    for k in range(0, len(batches), micro):
        opt.zero_grad()
        for x, y in batches[k : k + micro]:
            F.mse_loss(model(x), y).backward()
        opt.step()


def _train_ddp(ddp, opt, batches):
    """``_train_local``'s loop on the DDP wrapper, each batch split over dp."""
    for x, y in batches:
        opt.zero_grad()
        xb, yb = md.distribute((x, y), {"dp": md.Shard(0)})
        F.mse_loss(ddp(xb), yb).backward()
        opt.step()


def _assert_same(mesh_module, local, pm, atol=1e-5):
    for (name, p), q in zip(mesh_module.named_parameters(), local.parameters(), strict=True):
        for r in range(pm.size("dp")):
            torch.testing.assert_close(md.inspect(p, dp=r), q.detach(), atol=atol, rtol=1e-5,
                                       msg=f"{name} on dp={r}")  # fmt: skip


@pytest.mark.parametrize(
    "opt_cls, kwargs, cap, views",
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 25, False),  # one bucket
        (torch.optim.SGD, {"lr": 0.1}, 0.0005, False),  # a bucket per parameter or two
        (torch.optim.AdamW, {"lr": 0.01}, 25, False),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 0.0005, True),  # .grad: bucket views
    ],
)
def test_matches_one_process(dp2, opt_cls, kwargs, cap, views):
    local = _mlp()
    batches = _batches()
    with dp2.activate():
        model = md.to_mesh(copy.deepcopy(local), dp2)
        ddp = md.DistributedDataParallel(model, bucket_cap_mb=cap, gradient_as_bucket_view=views)
        opt = opt_cls(ddp.parameters(), **kwargs)
        for x, y in batches:
            xb, yb = md.distribute((x, y), {"dp": md.Shard(0)})
            opt.zero_grad()
            F.mse_loss(ddp(xb), yb).backward()
            opt.step()
        _train_local(local, opt_cls(local.parameters(), **kwargs), batches)
        _assert_same(ddp.module, local, dp2)
    if cap == 25:
        assert len(ddp.bucket_sizes) == 1
    else:
        assert len(ddp.bucket_sizes) >= 3


@pytest.mark.parametrize("threshold", [0, 16 * 16 * 4])
@pytest.mark.parametrize("views", [False, True])
def test_large_gradients_are_averaged_where_they_are(dp2, monkeypatch, threshold, views):
    """On CPU workers a gradient of IN_PLACE_BYTES or more gets an in-place all-reduce of its
    own (no copy into the bucket and back); the rest of its bucket is flattened as before.
    Training matches one process, with no_sync accumulation too; each backward issues one
    reduce per such gradient plus one per bucket of the others."""
    from monarch_dsl import isa
    from monarch_dsl.parallel import ddp as ddp_module

    monkeypatch.setattr(ddp_module, "IN_PLACE_BYTES", threshold)
    local = _mlp()
    batches = _batches(n=4)
    sizes = [p.numel() * 4 for p in local.parameters()]
    alone = sum(size >= threshold for size in sizes)  # 0: all 6; 1 KiB: the 16 x 16 weight
    with dp2.activate():
        model = md.to_mesh(copy.deepcopy(local), dp2)
        ddp = md.DistributedDataParallel(model, gradient_as_bucket_view=views)
        engine = next(iter(ddp.parameters()))._md_engine
        sent = []
        real = engine.append
        monkeypatch.setattr(engine, "append", lambda m, i: (sent.append(i), real(m, i)))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for k in range(0, len(batches), 2):
            opt.zero_grad()
            with ddp.no_sync():
                x, y = batches[k]
                F.mse_loss(
                    ddp(md.distribute(x, {"dp": md.Shard(0)})),
                    md.distribute(y, {"dp": md.Shard(0)}),
                ).backward()
            sent.clear()
            x, y = batches[k + 1]
            F.mse_loss(
                ddp(md.distribute(x, {"dp": md.Shard(0)})), md.distribute(y, {"dp": md.Shard(0)})
            ).backward()
            reduces = [i for i in sent if isinstance(i, isa.Reduce)]
            assert len(reduces) == alone + (alone < len(sizes)), (len(reduces), alone)
            opt.step()
        _train_local(
            local, torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9), batches, micro=2
        )
        _assert_same(ddp.module, local, dp2)


class _Backwards(nn.Module):
    """Registered a, b; used b then a: gradients arrive a's first."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(self.b(x))


def test_buckets_follow_the_first_iterations_gradient_order(dp2):
    x = torch.randn(4, 8)
    with dp2.activate():
        torch.manual_seed(0)
        ddp = md.DistributedDataParallel(_Backwards(), bucket_cap_mb=0.0001)
        # reverse registration order at first, as torch: b.bias, b.weight, a.bias, a.weight
        assert ddp.bucket_names == [["b.bias"], ["b.weight"], ["a.bias"], ["a.weight"]]
        ddp(md.distribute(x, {"dp": md.Shard(0)})).sum().backward()
        # autograd reached a (used last) first
        assert ddp.bucket_names[0][0].startswith("a.")
        assert ddp.bucket_names[-1][0].startswith("b.")


@pytest.mark.parametrize("views", [False, True])
def test_no_sync_accumulates_then_averages_the_sums(dp2, views):
    local = _mlp()
    batches = _batches(n=3)
    with dp2.activate():
        ddp = md.DistributedDataParallel(
            md.to_mesh(copy.deepcopy(local), dp2), gradient_as_bucket_view=views
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        opt.zero_grad()
        with ddp.no_sync():
            for x, y in batches[:2]:
                xb, yb = md.distribute((x, y), {"dp": md.Shard(0)})
                F.mse_loss(ddp(xb), yb).backward()
        w = ddp.module[0].weight.grad
        assert not torch.equal(md.inspect(w, dp=0), md.inspect(w, dp=1)), "no_sync communicated"
        xb, yb = md.distribute(batches[2], {"dp": md.Shard(0)})
        F.mse_loss(ddp(xb), yb).backward()
        if views:  # the averages are views of the bucket; the .grad taken before kept its sums
            assert ddp.module[0].weight.grad is not w
            w = ddp.module[0].weight.grad
            assert ddp.module[0].bias.grad._base is w._base is not None
        else:  # the averages were copied into the same .grad
            assert ddp.module[0].weight.grad is w
        torch.testing.assert_close(md.inspect(w, dp=0), md.inspect(w, dp=1))
        opt.step()
        _train_local(local, torch.optim.SGD(local.parameters(), lr=0.1), batches, micro=3)
        _assert_same(ddp.module, local, dp2)


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 4)
        self.unused = nn.Linear(8, 4)

    def forward(self, x):
        return self.used(x)


def test_unused_parameters_are_named_or_skipped_with_the_flag(dp2):
    x, y = _batches(n=1)[0]
    torch.manual_seed(0)
    local = _Unused()
    with dp2.activate():
        ddp = md.DistributedDataParallel(md.to_mesh(copy.deepcopy(local), dp2))
        xb, yb = md.distribute((x, y), {"dp": md.Shard(0)})
        with pytest.raises(RuntimeError) as info:
            F.mse_loss(ddp(xb), yb).backward()
        assert "module.unused.weight, module.unused.bias" in str(info.value)
        assert "find_unused_parameters=True" in str(info.value)

        ddp = md.DistributedDataParallel(
            md.to_mesh(copy.deepcopy(local), dp2), find_unused_parameters=True
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(ddp(xb), yb).backward()
            opt.step()
        assert ddp.module.unused.weight.grad is None
        _train_local(local, torch.optim.SGD(local.parameters(), lr=0.1), [(x, y)] * 2)
        _assert_same(ddp.module, local, dp2)


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x):
        self.count.add_(1.0)
        return self.lin(x) + self.count


@pytest.mark.parametrize(
    "keyword, at_start, in_forward",
    [
        ({}, True, True),  # torch's default: forward_sync_buffers=None, i.e. True
        ({"broadcast_buffers": True}, True, True),
        ({"broadcast_buffers": False}, False, False),  # torch 2.13: not at construction either
        ({"forward_sync_buffers": False}, True, False),  # ... where this one still is
    ],
)
def test_buffers_are_broadcast_from_the_first_rank(dp2, keyword, at_start, in_forward):
    x = torch.randn(4, 8)
    with dp2.activate():
        torch.manual_seed(0)
        model = _WithBuffer()
        with torch.no_grad():  # different buffers (and parameters) on the two ranks
            model.count.add_(dp2.rank("dp") * 10.0)
            model.lin.weight.add_(dp2.rank("dp"))
        ddp = md.DistributedDataParallel(model, **keyword)
        # construction: parameters (always) and buffers from dp=0
        torch.testing.assert_close(
            md.inspect(model.lin.weight, dp=1), md.inspect(model.lin.weight, dp=0)
        )
        assert md.inspect(model.count, dp=1).tolist() == [0.0 if at_start else 10.0] * 4
        with torch.no_grad():
            model.count.add_(dp2.rank("dp") * 100.0)  # the ranks drift apart again
        ddp(md.distribute(x, {"dp": md.Shard(0)}))
        want = 1.0 if in_forward else (111.0 if not at_start else 101.0)
        assert md.inspect(model.count, dp=1).tolist() == [want] * 4
        assert ddp.broadcast_buffers is in_forward


def test_buffers_are_broadcast_after_a_forward_with_grad_as_torch_decides(dp2):
    """torch broadcasts at the start of a forward when the forward before it ran with grad
    enabled outside no_sync() (an evaluation under no_grad() right after training gets the
    first rank's running statistics; the one after it does not)."""
    xb = None
    with dp2.activate():
        torch.manual_seed(0)
        ddp = md.DistributedDataParallel(_WithBuffer())
        xb = md.distribute(torch.randn(4, 8), {"dp": md.Shard(0)})

        def drift_then_forward():
            with torch.no_grad():
                ddp.module.count.add_(dp2.rank("dp") * 100.0)
                ddp(xb)
            return md.inspect(ddp.module.count, dp=1)[0].item()

        ddp(xb)  # with grad: the next forward broadcasts
        assert drift_then_forward() == 2.0
        assert drift_then_forward() == 103.0  # the forward before ran under no_grad()
        with ddp.no_sync():
            ddp(xb)  # with grad but inside no_sync(): no broadcast in the next one either
        assert drift_then_forward() == 205.0


def _local_grads(model, x, y):
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_only_a_backward_through_a_forward_of_the_wrapper_is_averaged(dp2):
    """As torch's reducer: hooks count in the first backward after a forward through the DDP
    wrapper; a second backward of the same graph, and one through ``ddp.module``, accumulate
    each rank's own gradients."""
    local = _mlp()
    x, y = _batches(n=1)[0]
    halves = list(zip(x.chunk(2), y.chunk(2)))
    own = [_local_grads(copy.deepcopy(local), *h) for h in halves]
    mean = [(a + b) / 2 for a, b in zip(*own)]
    with dp2.activate():
        ddp = md.DistributedDataParallel(md.to_mesh(copy.deepcopy(local), dp2))
        xb, yb = md.distribute((x, y), {"dp": md.Shard(0)})
        loss = F.mse_loss(ddp(xb), yb)
        loss.backward(retain_graph=True)
        loss.backward()  # torch: the average plus this rank's own
        for r in range(2):
            for p, m, o in zip(ddp.parameters(), mean, own[r]):
                torch.testing.assert_close(md.inspect(p.grad, dp=r), m + o)
        ddp.zero_grad()
        F.mse_loss(ddp.module(xb), yb).backward()  # not through the wrapper: not averaged
        for r in range(2):
            for p, o in zip(ddp.parameters(), own[r]):
                torch.testing.assert_close(md.inspect(p.grad, dp=r), o)
        ddp.zero_grad()
        with ddp.join():  # torch's context for uneven inputs: here it just runs
            loss = F.mse_loss(ddp(xb), yb)
            with torch.no_grad():  # an evaluation between the forward and its backward
                ddp(xb)
            loss.backward()  # still averaged, as torch's (its reducer stays armed)
        for r in range(2):
            for p, m in zip(ddp.parameters(), mean):
                torch.testing.assert_close(md.inspect(p.grad, dp=r), m)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # tied input and output embeddings

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def test_tied_parameters_stay_one_parameter_on_the_mesh(dp2):
    torch.manual_seed(0)
    local = _Tied()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 10, (8,), generator=g), torch.randn(8, 10, generator=g))
               for _ in range(3)]  # fmt: skip
    with dp2.activate():
        model = md.to_mesh(copy.deepcopy(local), dp2)
        assert model.head.weight is model.emb.weight
        ddp = md.DistributedDataParallel(model)
        assert len(list(ddp.parameters())) == len(list(local.parameters())) == 3
        _train_ddp(ddp, torch.optim.SGD(ddp.parameters(), lr=0.5), batches)
        _train_local(local, torch.optim.SGD(local.parameters(), lr=0.5), batches)
        _assert_same(ddp.module, local, dp2)


class _Conv(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = norm(4)
        self.head = nn.Linear(4 * 5 * 5, 2)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).flatten(1))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batch_norm_uses_the_whole_batchs_statistics(dp2, momentum):
    """torch's SyncBatchNorm falls back to a per-rank BatchNorm on a controller without
    torch.distributed; under md.DDP it normalizes over the batch of every rank, as torch's on
    GPUs: training matches one process's BatchNorm on the whole batch (parameters, running
    statistics, and the eval output after)."""
    torch.manual_seed(0)
    local = _Conv(lambda c: nn.BatchNorm2d(c, momentum=momentum))
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(8, 3, 5, 5, generator=g) * 3 + 1, torch.randn(8, 2, generator=g))
               for _ in range(3)]  # fmt: skip
    probe = torch.randn(4, 3, 5, 5, generator=g)
    with dp2.activate():
        synced = md.to_mesh(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(local)), dp2)
        ddp = md.DistributedDataParallel(synced)
        assert isinstance(ddp.module.norm, nn.SyncBatchNorm)
        _train_ddp(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches)
        _train_local(local, torch.optim.SGD(local.parameters(), lr=0.1), batches)
        _assert_same(ddp.module, local, dp2)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            want = getattr(local.norm, name)
            for r in range(2):
                got = md.inspect(getattr(ddp.module.norm, name), dp=r)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
        ddp.eval()
        local.eval()
        got = md.inspect(ddp(md.to_mesh(probe, dp2)), dp=1)
        torch.testing.assert_close(got, local(probe), atol=1e-5, rtol=1e-5)


def test_state_dict_round_trips_into_a_plain_module(dp2):
    local = _mlp()
    probe, batches = torch.randn(3, 8), _batches(n=2)
    with dp2.activate():
        ddp = md.DistributedDataParallel(md.to_mesh(copy.deepcopy(local), dp2))
        _train_ddp(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches)
        state = ddp.state_dict()
        assert all(k.startswith("module.") for k in state)
        local_state = {k.removeprefix("module."): md.inspect(v) for k, v in state.items()}
        want = md.inspect(ddp(md.to_mesh(probe, dp2)))
    plain = _mlp(seed=5)
    plain.load_state_dict(local_state)
    torch.testing.assert_close(plain(probe), want)


def test_a_dropped_wrapper_and_its_parameters_are_freed(dp2):
    """Its gradient hooks held the wrapper strongly: parameter -> hook (kept by autograd, out
    of the garbage collector's sight) -> wrapper -> parameter, so a dropped md.DDP and its
    parameters (and their values on the workers) lived until the process ended."""
    import gc
    import weakref

    with dp2.activate():
        ddp = md.DistributedDataParallel(md.to_mesh(_mlp(), dp2))
        F.mse_loss(ddp(torch.randn(4, 8)), torch.randn(4, 4)).backward()  # (hooks have run)
        gone = [weakref.ref(ddp)] + [weakref.ref(p) for p in ddp.parameters()]
        del ddp
        gc.collect()
        assert all(r() is None for r in gone)


def test_different_parameter_shapes_on_the_ranks_are_refused(dp2):
    with dp2.activate():
        model = nn.Linear(4, 4)
        # torch.chunk of 3 rows over 2 ranks: 2 rows on dp=0, 1 on dp=1
        model.extra = nn.Parameter(md.distribute(torch.zeros(3), {"dp": md.Shard(0)}))
        with pytest.raises(
            ValueError, match=r"parameter 'extra' has different shapes .*dp=0: \(2,\); dp=1: \(1,\)"
        ):
            md.DistributedDataParallel(model)


def test_bad_arguments_are_refused_before_anything_runs(dp2):
    local = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="needs a mesh"):
        md.DistributedDataParallel(local)
    with dp2.activate():
        with pytest.raises(TypeError, match="is a local tensor"):
            md.DistributedDataParallel(local)
        model = nn.Linear(4, 4)
        with pytest.raises(KeyError, match="'tp'"):
            md.DistributedDataParallel(model, dim="tp")
        with pytest.raises(ValueError, match="device_ids"):
            md.DistributedDataParallel(model, device_ids=[0, 1])
        with pytest.raises(TypeError, match="replace torch process groups"):
            md.DistributedDataParallel(model, process_group=object())
        with pytest.raises(TypeError, match="mixed_precision"):
            md.DistributedDataParallel(model, mixed_precision=object())
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            md.DistributedDataParallel(model, bucket_cap_mb=0)
        # torch's keywords that make sense (or none) are taken
        ddp = md.DistributedDataParallel(
            model, device_ids=[0], output_device=0, static_graph=True,
            gradient_as_bucket_view=True, dim=0,
        )  # fmt: skip
        assert ddp.module is model and ddp.dim == "dp"


@md.remote(propagate=lambda: torch.zeros((), dtype=torch.int64))
def _pid():
    return torch.tensor(os.getpid())


def test_a_worker_killed_mid_training_is_named():
    pm = md.this_host().spawn_procs({"dp": 2})
    batch = _batches(n=1)[0]
    try:
        with pm.activate():
            ddp = md.DistributedDataParallel(_mlp())
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            victim = int(md.inspect(_pid(), dp=1))
            x, y = md.distribute(batch, {"dp": md.Shard(0)})
            F.mse_loss(ddp(x), y).backward()
        os.kill(victim, signal.SIGKILL)
        # The death is noticed at the latest at a fetch; the block's end adds no second error
        # (its flush fails too) and the flusher thread does not die of it.
        with pytest.raises(md.SupervisionError, match=r"rank 1 \(dp=1.*SIGKILL"):
            with pm.activate():
                for _ in range(50):
                    opt.zero_grad()
                    loss = F.mse_loss(ddp(x), y)
                    loss.backward()
                    opt.step()
                    md.inspect(loss)
        # What was issued after the error is not sent, and no thread died of it: the mesh
        # still names the dead rank.
        with pytest.raises(md.SupervisionError, match=r"rank 1 \(dp=1.*SIGKILL"):
            with pm.activate():
                md.inspect(ddp(x))
    finally:
        pm.stop()


@md.remote(propagate=lambda: torch.zeros(2, dtype=torch.int64))
def _bucket_backends():
    from monarch_dsl.runtime import kernels

    probe = torch.empty(1)
    return torch.tensor([kernels.backend(probe, op) == "triton" for op in kernels.OPS[:2]])


def test_buckets_go_through_the_triton_kernels_where_chosen():
    """Each bucket is one monarch_dsl::flatten_scale and one unflatten_into instruction, run by
    the workers' kernels: here Triton's (its interpreter on CPU workers, as a CUDA worker runs
    them compiled), chosen per mesh with MD_KERNELS. Training matches one process."""
    pytest.importorskip("triton")
    env = {"MD_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    pm = md.this_host().spawn_procs({"dp": 2}, env=env)
    try:
        local = _mlp()
        batches = _batches(n=2)
        with pm.activate():
            assert md.inspect(_bucket_backends()).tolist() == [1, 1]
            ddp = md.DistributedDataParallel(
                md.to_mesh(copy.deepcopy(local), pm), bucket_cap_mb=0.001
            )
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for x, y in batches:
                xb, yb = md.distribute((x, y), {"dp": md.Shard(0)})
                opt.zero_grad()
                F.mse_loss(ddp(xb), yb).backward()
                opt.step()
            _train_local(local, torch.optim.SGD(local.parameters(), lr=0.1), batches)
            _assert_same(ddp.module, local, pm)
        assert len(ddp.bucket_sizes) >= 2
    finally:
        pm.stop()
