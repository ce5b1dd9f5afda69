"""Distributed tensors from one controller on a 2x2 CPU mesh (SPEC §3, the parts built so far)."""

import copy
import gc

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import monarch_dsl as md
from monarch_dsl.runtime import worker

pytestmark = pytest.mark.procs

COORDS = [(h, g) for h in range(2) for g in range(2)]


class RefCounter(md.Actor):
    @md.endpoint
    def refs(self):
        ex = worker.current._executor
        return 0 if ex is None else len(ex.refs)


@pytest.fixture(scope="module", params=["cpp", "python"])
def pm(request):
    """Every test runs on workers with the C++ executor and with the Python reference one."""
    mesh = md.this_host().spawn_procs({"host": 2, "gpu": 2}, env={"MD_EXECUTOR": request.param})
    try:
        yield mesh
    finally:
        try:
            mesh.stop()
        except md.RemoteError:
            pass  # failures these tests provoke on purpose and did not fetch


def values(t):
    return [md.inspect(t, host=h, gpu=g).tolist() for h, g in COORDS]


def test_ops_run_on_every_rank_and_inspect_any_rank(pm):
    with pm.activate():
        torch.manual_seed(1)
        x = torch.rand(3, 4)
        y = x @ x.T + 1
        assert isinstance(y, md.Tensor) and y.shape == (3, 3) and y.dtype == torch.float32
        assert y.mesh == pm and y.stream == "main" and y.device == torch.device("cpu")
        assert "md.Tensor(shape=(3, 3)" in repr(y)
        local = md.inspect(y)
        assert isinstance(local, torch.Tensor) and not isinstance(local, md.Tensor)
    torch.manual_seed(1)  # outside: the controller's own generator, same seed
    expected = torch.rand(3, 4)
    torch.testing.assert_close(local, expected @ expected.T + 1)
    for h, g in COORDS:  # seeded alike: every rank holds the same values
        torch.testing.assert_close(md.inspect(y, host=h, gpu=g), local)
    assert md.inspect({"a": y, "b": [x]})["b"][0].shape == (3, 4)


def test_torch_tensor_data_and_in_place_ops(pm):
    with pm.activate():
        t = torch.tensor([1.0, 2.0, 3.0])
        same = t.mul_(2)
        assert same is t
        t += 1
    assert md.inspect(t, host=1, gpu=0).tolist() == [3.0, 5.0, 7.0]


@pytest.mark.parametrize(
    "reshape",
    [
        lambda t: t.unsqueeze_(0),
        lambda t: t.t_(),
        lambda t: t.resize_(6),
        lambda t: t.transpose_(0, 1),
        lambda t: t.as_strided_((3, 2), (1, 3)),
        lambda t: t.squeeze_(0).resize_(2, 3).mul_(2),  # (a size-2 dim is not squeezed)
        lambda t: torch.cat([t, t], out=t.new_empty(0)),
        lambda t: F.adaptive_avg_pool2d(  # (ATen's as_strided_ of its result)
            t.reshape(1, 3, 2, 1).contiguous(memory_format=torch.channels_last), 1
        ),
    ],
    ids=["unsqueeze_", "t_", "resize_", "transpose_", "as_strided_", "same", "out", "pool"],
)
def test_an_op_that_changes_a_shape_in_place_is_followed_by_the_handle(pm, reshape):
    """unsqueeze_, resize_, out= of another shape, and ATen's own as_strided_ (adaptive
    pooling of a channels-last input) change a tensor's shape or strides in place: the
    handle follows what the workers did. (It kept its old shape: x.unsqueeze_(0) gave shape
    (2, 3) here and (1, 2, 3) on the workers.)"""
    want = reshape(torch.arange(6.0).reshape(2, 3).clone())
    with pm.activate():
        got = reshape(torch.arange(6.0).reshape(2, 3))
        assert (got.shape, got.stride()) == (want.shape, want.stride())
        assert torch.equal(md.inspect(got, host=1, gpu=0), want)
        assert torch.equal(md.inspect(got + 1), want + 1)  # (an op of the handle's shape)


def test_a_shape_changed_through_a_mutable_borrow_is_the_origins_too(pm):
    """On the workers the lent tensor is the origin's: a change of its shape made on the
    borrowing stream is the origin's after the drop, here as there. Its .data cannot be set
    (the lent ref is the borrow's)."""
    comms = md.Stream("comms")
    with pm.activate():
        origin = torch.zeros(3)
        lent, borrow = comms.borrow(origin, mutable=True)
        with comms.activate():
            lent.unsqueeze_(0).add_(1)
            with pytest.raises(TypeError, match="lent to another stream"):
                lent.data = torch.ones(2)
        borrow.drop()
        assert origin.shape == (1, 3)
        assert md.inspect(origin).tolist() == [[1.0, 1.0, 1.0]]


def test_scalars_of_equal_value_and_other_types_give_their_own_dtypes(pm):
    """3, 3.0 and True are equal (and hash alike): the controller's caches of output shapes
    took one for the other, and a handle said int64 where the workers held float32."""
    steps = [
        lambda: torch.arange(4) * 3,
        lambda: torch.arange(4) * 3.0,
        lambda: torch.arange(5),
        lambda: torch.arange(5.0),
        lambda: torch.full((2,), 1),
        lambda: torch.full((2,), True),
        lambda: torch.ones(2) * (1 + 0j),
        lambda: torch.arange(4).clamp(min=1),
        lambda: torch.arange(4).clamp(min=1.5),
        lambda: torch.arange(4).div(2, rounding_mode="floor"),
        lambda: torch.arange(4).div(2.0, rounding_mode="floor"),
    ]
    want = [step().dtype for step in steps]
    with pm.activate():
        got = [step() for step in steps]
        held = [md.inspect(t).dtype for t in got]
    assert [t.dtype for t in got] == want == held


def test_the_workers_follow_the_controllers_default_dtype(pm):
    """torch.set_default_dtype on the controller: factories and type promotion give its dtype
    on the workers too, and the handles say so (they said float32 where a cache had seen the
    op before, and the workers made float32 always)."""
    steps = [
        lambda: torch.randn(3),
        lambda: torch.zeros(2),
        lambda: torch.arange(4) / 2,
        lambda: torch.arange(4) * 1.5,
        lambda: torch.arange(3.0),
        lambda: nn.Linear(2, 2).weight,
    ]
    try:
        with pm.activate():
            for default in (torch.float32, torch.float64, torch.float32):
                torch.set_default_dtype(default)
                made = [step() for step in steps]
                assert [t.dtype for t in made] == [default] * len(steps)
                assert [md.inspect(t, host=1, gpu=1).dtype for t in made] == [default] * len(steps)
            # Changed while the workers still run what came before: that runs under the old.
            x = torch.ones(256, 256)
            for _ in range(20):
                x = x @ x / 256
            made = []
            for default in (torch.float64, torch.float32, torch.float64):
                torch.set_default_dtype(default)
                made += [(default, step()) for step in steps]
            assert [md.inspect(t).dtype for _, t in made] == [d for d, _ in made]
    finally:
        torch.set_default_dtype(torch.float32)


def test_setting_data_makes_the_handle_one_on_the_new_value(pm):
    """``t.data = v`` (how ``model.half()``, ``.to(dtype)`` and ``vector_to_parameters`` change
    a module's tensors): the handle and the workers agree on the new value, its autograd state
    stays, and the old value is freed. (Before, torch's setter changed only the handle's shape
    and dtype: the workers kept the old float32 values.)"""
    counter = pm.spawn("refs", RefCounter)
    torch.manual_seed(0)
    local = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    vec = torch.arange(15.0)
    with pm.activate():
        gc.collect()
        md.tensor.sync(pm)
        before = counter.refs.call().get().values()
        model = md.to_mesh(copy.deepcopy(local), pm).half()
        assert model.weight.dtype == torch.float16 and model.weight.requires_grad
        assert md.inspect(model.weight, host=1, gpu=1).dtype == torch.float16
        torch.testing.assert_close(
            md.inspect(model(md.to_mesh(x.half(), pm))), local.half()(x.half())
        )
        torch.nn.utils.vector_to_parameters(md.to_mesh(vec.half(), pm), model.parameters())
        assert md.inspect(model.bias).tolist() == [12.0, 13.0, 14.0]
        t = torch.ones(3, 4)
        t.data = torch.zeros(5)
        assert t.shape == (5,) and md.inspect(t + 1).tolist() == [1.0] * 5
        with pytest.raises(TypeError, match="only to a mesh tensor"):
            t.data = local.weight.detach()  # (a local tensor)
        other = pm.slice(host=0)
        with other.activate():
            elsewhere = torch.zeros(5)
        with pytest.raises(TypeError, match="cannot be set to a tensor on"):
            t.data = elsewhere
        del model, t, elsewhere
        gc.collect()
        md.tensor.sync(pm)
        after = counter.refs.call().get().values()
    assert after == before


def test_mesh_rank_gives_coordinates(pm):
    with pm.activate():
        assert values(pm.rank("gpu")) == [0, 1, 0, 1]
        assert values(pm.rank("host")) == [0, 0, 1, 1]
        assert values(pm.rank(("host", "gpu"))) == [0, 1, 2, 3]
        with pytest.raises(KeyError):
            pm.rank("tp")
    with pytest.raises(RuntimeError, match="active mesh"):
        pm.rank("gpu")


def test_misuse_is_a_type_error_naming_the_argument(pm):
    other = pm.slice(host=0)
    local = torch.ones(2)
    with pm.activate():
        a = torch.ones(2)
        with pytest.raises(TypeError, match=r"argument #1 is a local tensor"):
            a + local
        with pytest.raises(TypeError, match=r"argument #0 is a local tensor"):
            torch.mul(local, a)
    with other.activate():
        b = torch.ones(2)
    with pytest.raises(TypeError, match="two meshes"):
        a + b
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle

        pickle.dumps(a)


@pytest.mark.parametrize(
    "reduction, expected",
    [("sum", 1.0), ("avg", 0.5), ("min", 0.0), ("max", 1.0), ("prod", 0.0)],
)
def test_reduce_over_each_dim(pm, reduction, expected):
    with pm.activate():
        g = pm.rank("gpu").float()
        out = g.reduce("gpu", reduction)
        assert values(out) == [expected] * 4
        h = pm.rank("host").float() + 1
        assert values(h.reduce("host", "sum")) == [3.0] * 4
        assert values(pm.rank(("host", "gpu")).float().reduce((), "sum")) == [6.0] * 4


def test_stack_scatter_and_all_to_all(pm):
    with pm.activate():
        r = pm.rank(("host", "gpu")).float()
        assert values(r.reduce("gpu", "stack")) == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
        v = torch.arange(4.0) + 10 * r  # rank k holds [10k, 10k+1, 10k+2, 10k+3]
        rs = v.reduce(("host", "gpu"), "sum", scatter=True)  # reduce-scatter
        assert rs.shape == (1,)
        assert values(rs) == [[60.0], [64.0], [68.0], [72.0]]
        a2a = v.reduce(("host", "gpu"), "stack", scatter=True)  # all-to-all
        assert values(a2a)[1] == [1.0, 11.0, 21.0, 31.0]
        x = torch.ones(3)
        assert x.reduce_("gpu") is x
        assert values(x) == [[2.0] * 3] * 4
        x.reduce_(("host", "gpu"), "avg")
        assert values(x) == [[2.0] * 3] * 4
        col = torch.ones(4, 2)[:, 0]  # not contiguous: reduced through a copy
        col.reduce_("gpu", "max")
        assert values(col) == [[1.0] * 4] * 4


@md.remote(propagate=lambda t: torch.empty(t.dim(), dtype=torch.int64, device="meta"))
def _worker_strides(t):
    return torch.tensor(t.stride(), dtype=torch.int64)


def test_reduce_and_to_mesh_results_are_laid_out_as_on_the_workers_without_meta_ops(
    pm, monkeypatch
):
    """The handles of reduce() / to_mesh() results describe the layout the workers make
    (contiguous, whatever the input's: a transposed or permuted input included), so views of
    them are checked on the controller as the workers run them; no meta op goes through the
    dispatch mode to work it out."""
    from monarch_dsl.tensor import dispatch

    seen = []
    original = dispatch.MeshMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return original(self, func, types, args, kwargs)

    local = torch.arange(24.0).reshape(2, 3, 4)
    hosts = pm.slice(host=0), pm.slice(host=1)
    with pm.activate():
        x = torch.arange(24.0).reshape(2, 3, 4)
        cases = {
            "transposed": (x[0].t(), local[0].t()),
            "permuted": (x.permute(2, 0, 1), local.permute(2, 0, 1)),
            "a column": (x[1, :, 1], local[1, :, 1]),
        }
        monkeypatch.setattr(dispatch.MeshMode, "__torch_dispatch__", counting)
        outs = {}
        for name, (t, _) in cases.items():
            outs[name] = [
                t.reduce("gpu", "sum"),
                t.reduce("gpu", "stack", scatter=True) if t.shape[0] % 2 == 0 else None,
                t.to_mesh(pm),  # each rank to itself
            ]
        monkeypatch.setattr(dispatch.MeshMode, "__torch_dispatch__", original)
        assert seen == []
        for name, (_, loc) in cases.items():
            red, a2a, moved = outs[name]
            for got in (red, a2a, moved):
                if got is not None:
                    assert got.is_contiguous(), name
                    worker = md.inspect(_worker_strides(got), host=1, gpu=1).tolist()
                    assert list(got.stride()) == worker, (name, got.stride(), worker)
            assert md.inspect(red).tolist() == (loc * 2).tolist(), name
            assert md.inspect(moved).tolist() == loc.tolist(), name
            flipped = (loc * 2).transpose(0, -1).reshape(-1)
            assert md.inspect(red.transpose(0, -1).reshape(-1)).tolist() == flipped.tolist()
    with hosts[0].activate():  # between ranks: host 0 sends, host 1 receives
        sent = torch.arange(12.0).reshape(3, 4).t()
        got = sent.to_mesh(hosts[1])
    with hosts[1].activate():
        assert got.is_contiguous()
        assert list(got.stride()) == md.inspect(_worker_strides(got), gpu=0).tolist()
        assert md.inspect(got.view(12)).tolist() == local[0].t().reshape(-1).tolist()


def test_contiguous_strides_are_torchs_and_fresh_results_contiguous():
    from monarch_dsl.tensor.handle import contiguous_desc, contiguous_strides, describe

    for shape in [(), (3,), (3, 4), (0, 5), (2, 0, 3), (1, 1, 4), (5, 1, 0, 2)]:
        assert contiguous_strides(shape) == torch.empty(shape).stride(), shape
        want = torch.empty(shape, dtype=torch.float16)
        assert contiguous_desc(shape, torch.float16) == ("T", *describe(want))


def test_reduce_needs_a_mesh_tensor():
    with pytest.raises(TypeError, match="md.Tensor"):
        md.Tensor.reduce(torch.ones(2), "gpu")


def test_invalid_reduces_are_rejected_before_sending(pm):
    with pm.activate():
        t = torch.ones(3)
        engine = t._md_engine
        with pytest.raises(KeyError, match="dims"):
            t.reduce("tp")
        with pytest.raises(ValueError, match="reduction must be"):
            t.reduce("gpu", "median")
        with pytest.raises(ValueError, match="divisible"):
            t.reduce("gpu", "sum", scatter=True)
        with pytest.raises(ValueError, match="divisible"):
            t.reduce("gpu", "stack", scatter=True)
        with pytest.raises(ValueError, match="out-of-place"):
            t.reduce_("gpu", "stack")
        with pytest.raises(ValueError, match="named twice"):
            t.reduce(("gpu", "gpu"))
        with pytest.raises(TypeError, match="floating point"):
            torch.ones(2, dtype=torch.int64).reduce("gpu", "avg")
        assert not any(type(i).__name__ == "Reduce" for _, i in engine.batch)


def test_failures_fail_dependents_only_and_workers_survive(pm):
    with pm.activate():
        good = torch.ones(2) * 3
        bad = torch.ones(1 << 50)  # far too big: fails on every worker
        worse = (bad + 1).sum()
        summed = bad.reduce("gpu")  # a collective on a failed input still completes
        fine = good.reduce("gpu")
        with pytest.raises(md.RemoteError) as info:
            md.inspect(worse)
        err = info.value
        assert err.op == "aten::ones.default" and "test_tensor.py:" in err.line
        assert "allocate" in err.error and err.rank == 0 and err.coords == {"host": 0, "gpu": 0}
        with pytest.raises(md.RemoteError):
            md.inspect(summed, host=1, gpu=1)
        assert md.inspect(fine).tolist() == [6.0, 6.0]
        assert md.inspect(good * 2).tolist() == [6.0, 6.0]  # recovered


def test_unfetched_error_is_raised_at_stop():
    pm = md.this_host().spawn_procs({"gpu": 2})
    with pm.activate():
        torch.ones(1 << 50)  # fails on the workers (the shape is fine); nobody fetches it
        ok = torch.zeros(2)
    assert md.inspect(ok).tolist() == [0.0, 0.0]
    with pytest.raises(md.RemoteError, match="aten::ones"):
        pm.stop()
    assert pm.stopped


def test_del_frees_worker_memory_and_ops_are_batched(pm):
    counter = pm.spawn("refs", RefCounter)
    with pm.activate():
        x = torch.ones(2)
        gc.collect()  # earlier tests' tensors: their deletes go out with the next batch
        md.tensor.sync(pm)
        before = counter.refs.call().get().values()
        engine = x._md_engine
        sent = engine.batches_sent
        ts = [x + i for i in range(200)]
        md.inspect(ts[-1])
        # 200 ops and a fetch: batches, not a message per op (a batch also leaves when it is
        # 1 ms old, so a slow machine sends a few)
        assert engine.batches_sent - sent < 100
        md.tensor.sync(pm)  # every stream has run what was sent (actors do not wait for it)
        during = counter.refs.call().get().values()
        del ts
        md.tensor.sync(pm)  # the deletes go out before the barrier
        after = counter.refs.call().get().values()
    assert all(d >= b + 200 for b, d in zip(before, during))
    assert after == before


def test_autograd_module_and_optimizer_match_local_training(pm):
    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x = torch.randn(5, 3)
    target = torch.randn(5, 2)
    expected = [p.detach().clone() for p in local.parameters()]
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(local(x), target).backward()
        opt.step()
    trained = [p.detach().clone() for p in local.parameters()]

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    with torch.no_grad():
        for p, e in zip(model.parameters(), expected):
            p.copy_(e)
    with pm.activate():
        md.to_mesh(model, pm)
        assert all(isinstance(p, md.Tensor) and p.requires_grad for p in model.parameters())
        xs, ts = md.to_mesh((x, target), pm)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs), ts).backward()
            opt.step()
        for p, want in zip(model.parameters(), trained):
            for h, g in COORDS:
                torch.testing.assert_close(md.inspect(p, host=h, gpu=g), want)


def test_deepcopy_of_a_mesh_model_is_a_model_on_the_mesh_and_local_ones_stay_local(pm):
    """copy.deepcopy of a model on the mesh (an EMA copy) copies on the workers: parameters
    stay parameters, with their requires_grad and .grad, independent of the original. Under
    pm.activate(), a local model's copy (buffers too: torch copies their storages) is local."""

    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    with pm.activate():
        kept = copy.deepcopy(local)
        assert not any(isinstance(t, md.Tensor) for t in kept.state_dict().values())
        for name, t in kept.state_dict().items():
            assert torch.equal(t, local.state_dict()[name]), name
        model = md.to_mesh(torch.nn.Linear(3, 2), pm)
        model(torch.ones(4, 3)).sum().backward()
        ema = copy.deepcopy(model)
        assert isinstance(ema.weight, torch.nn.Parameter) and isinstance(ema.weight, md.Tensor)
        assert ema.weight.requires_grad and ema.weight is not model.weight
        assert torch.equal(md.inspect(ema.weight.grad), md.inspect(model.weight.grad))
        before = md.inspect(model.weight)
        with torch.no_grad():
            ema.weight.mul_(0)
        assert torch.equal(md.inspect(model.weight, host=1, gpu=1), before)
        assert md.inspect(ema.weight, host=1, gpu=1).abs().sum() == 0
        with pytest.raises(RuntimeError, match="graph leaf"):
            copy.deepcopy(model(torch.ones(1, 3)))


def test_a_local_checkpoint_loads_into_a_model_on_the_mesh(pm):
    """load_state_dict of local tensors into a model on the mesh (copy_ with a local source)
    sends each value to every rank; another op with a local argument is still refused."""
    torch.manual_seed(0)
    saved = torch.nn.Linear(3, 2).state_dict()
    other = torch.ones(2, 3)
    with pm.activate():
        model = md.to_mesh(torch.nn.Linear(3, 2), pm)
        model.load_state_dict(saved)
        for name, value in saved.items():
            for h, g in COORDS:
                assert torch.equal(md.inspect(model.state_dict()[name], host=h, gpu=g), value)
        with pytest.raises(TypeError, match="is a local tensor"):
            model.weight.detach().add_(other)


def test_to_mesh_between_pipeline_stages(pm):
    stages = pm.rename(host="pp", gpu="dp")
    s0, s1 = stages.slice(pp=0), stages.slice(pp=1)
    with s0.activate():
        a = s0.rank("dp").float() + 10
        b = a.to_mesh(s1)
        a.add_(100)  # the copy is independent of the source
        bad = torch.ones(1 << 50).to_mesh(s1)
    assert b.mesh == s1
    with s1.activate():
        assert [md.inspect(b * 2, dp=i).item() for i in range(2)] == [20.0, 22.0]
        with pytest.raises(md.RemoteError):
            md.inspect(bad)
    with pytest.raises(ValueError, match="same dims and sizes"):
        a.to_mesh(stages.slice(dp=0))


@md.remote
def _plus_rank(t, v):
    return t * 0 + v + md.current_rank().rank


@md.remote(propagate=lambda t: (t, t.sum()))
def _pair(t):
    return t + 1, t.sum()


@md.remote
def _fails_on_gpu1(t):
    if md.current_rank()["gpu"] == 1:
        raise ValueError("only gpu=1 fails")
    return t + 1


@md.remote(propagate=lambda t: t)
def _meta_on_gpu1(t):
    # A tensor on another device than the worker's (as a CPU tensor on a GPU worker) on one
    # rank only.
    return torch.empty_like(t, device="meta") if md.current_rank()["gpu"] == 1 else t + 1


def test_remote_functions_learn_or_propagate_shapes(pm):
    _plus_rank._shapes.clear()  # learnt on the other executor's mesh, if that ran first
    with pm.activate():
        x = torch.ones(3)
        y = _plus_rank(x, 5)
        assert isinstance(y, md.Tensor) and y.shape == (3,)
        assert [v[0] for v in values(y)] == [5.0, 6.0, 7.0, 8.0]
        assert len(_plus_rank._shapes) == 1
        assert values(_plus_rank(x, 1))[3] == [4.0] * 3  # the cached shapes, no round trip
        a, b = _pair(x)
        assert a.shape == (3,) and b.shape == ()
        assert md.inspect(b).item() == 3.0
    with pytest.raises(RuntimeError, match="active mesh"):
        _plus_rank(1, 2)


def test_an_input_on_another_device_fails_the_collective_on_every_rank_without_a_hang(pm):
    with pm.activate():
        z = _meta_on_gpu1(torch.ones(3))
        total = z.reduce("gpu")
        with pytest.raises(md.RemoteError, match="the input is on meta") as info:
            md.inspect(total, host=0, gpu=1)
        assert info.value.coords == {"host": 0, "gpu": 1}
        with pytest.raises(md.RemoteError):
            md.inspect(total, host=0, gpu=0)
        assert md.inspect(torch.ones(2).reduce("gpu")).tolist() == [2.0, 2.0]  # still usable


def test_failure_on_some_ranks_does_not_hang_a_collective(pm):
    with pm.activate():
        x = torch.ones(3)
        z = _fails_on_gpu1(x)
        total = z.reduce("gpu")
        assert md.inspect(z, host=0, gpu=0).tolist() == [2.0] * 3
        with pytest.raises(md.RemoteError, match="only gpu=1 fails") as info:
            md.inspect(z, host=1, gpu=1)
        assert info.value.coords == {"host": 1, "gpu": 1}
        for h, g in COORDS:  # every rank of the collective knows its result is failed
            with pytest.raises(md.RemoteError):
                md.inspect(total, host=h, gpu=g)
        assert md.inspect(x.reduce("gpu"), host=1, gpu=1).tolist() == [2.0] * 3


def test_streams_and_borrows(pm):
    comms = md.Stream("comms")
    assert md.get_active_stream() == md.Stream("main")
    with pm.activate():
        torch.manual_seed(3)
        grad = torch.rand(4) + pm.rank(("host", "gpu")).float()
        other = torch.ones(4) * 7
        g, borrow = comms.borrow(grad, mutable=True)
        assert g.stream == "comms" and grad.stream == "main"
        with comms.activate():
            assert md.get_active_stream() == comms
            g.reduce_(("host", "gpu"), "avg")  # overlaps whatever main does next
            with pytest.raises(TypeError, match="stream 'main' but the active stream is 'comms'"):
                other + 1
        later = other * 2  # main keeps going while comms reduces
        with pytest.raises(TypeError, match="lent to stream 'comms'.*mutable"):
            grad + 1
        with pytest.raises(TypeError, match="lent to stream 'comms'"):
            md.inspect(grad)
        with pytest.raises(TypeError, match="stream 'comms' but the active stream is 'main'"):
            g + 1
        borrow.drop()
        with pytest.raises(TypeError, match=r"dropped at \S*test_tensor\.py:\d+;"):
            with comms.activate():
                g + 1
        with pytest.raises(TypeError, match="already dropped"):
            borrow.drop()
        avg = md.inspect(grad, host=1, gpu=1)
        for h, gg in COORDS:
            torch.testing.assert_close(md.inspect(grad, host=h, gpu=gg), avg)
        assert md.inspect(later).tolist() == [14.0] * 4

        frozen, b2 = comms.borrow(other)  # immutable: both sides may read, neither write
        assert md.inspect(other + 1).tolist() == [8.0] * 4
        with pytest.raises(TypeError, match="read but not written"):
            other.add_(1)
        with comms.activate():
            assert md.inspect(frozen * 2).tolist() == [14.0] * 4
            with pytest.raises(TypeError, match="borrowed immutably"):
                frozen.mul_(2)
        b2.drop()
        other.add_(1)
        assert md.inspect(other).tolist() == [8.0] * 4
    with pytest.raises(ValueError, match="identifier"):
        md.Stream("not a name")


def test_a_list_an_op_writes_is_checked_tensor_by_tensor(pm):
    """torch._foreach_add_ writes each tensor of its list: one lent for reading is refused
    as for add_ (the list, not its tensors, was checked: the write went through)."""
    comms = md.Stream("comms")
    with pm.activate():
        t, u = torch.ones(2), torch.ones(2)
        lent, borrow = comms.borrow(t)
        for write in (lambda: t.add_(1), lambda: torch._foreach_add_([u, t], 1.0)):
            with pytest.raises(TypeError, match="is lent to stream 'comms'.*not written"):
                write()
        torch._foreach_add_([u], [t])  # (reading it is fine)
        borrow.drop()
        torch._foreach_add_([u, t], 1.0)
        assert md.inspect(t).tolist() == [2.0, 2.0]


def test_an_op_that_writes_a_list_bumps_each_tensors_version(pm):
    """As torch does for a local tensor: autograd refuses a backward pass that needs a value
    a foreach op changed (it ran on the changed value, and gave another gradient)."""
    with pm.activate():
        a = torch.ones(3, requires_grad=True)
        for _ in range(2):  # (the second time, on the fast path)
            e = a.exp()
            torch._foreach_add_([e], 1.0)
            assert e._version == 1
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                e.sum().backward()


def test_grad_generator_yields_each_gradient_in_the_order_given(pm):
    torch.manual_seed(5)
    w1, w2, x = torch.randn(3, 4), torch.randn(4, 2), torch.randn(5, 3)
    a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    torch.tanh(x @ a).matmul(b).sum().backward()
    with pm.activate():
        m1, m2 = md.to_mesh(w1, pm).requires_grad_(), md.to_mesh(w2, pm).requires_grad_()
        loss = torch.tanh(md.to_mesh(x, pm) @ m1).matmul(m2).sum()
        grads = list(md.grad_generator(loss, [m2, m1]))
        assert m1.grad is None and m2.grad is None
        torch.testing.assert_close(md.inspect(grads[0], host=1, gpu=1), b.grad)
        torch.testing.assert_close(md.inspect(grads[1]), a.grad)
        unused = md.to_mesh(torch.ones(2), pm).requires_grad_()
        with pytest.raises((ValueError, RuntimeError)):
            list(md.grad_generator((m1 * 2).sum(), [m1, unused]))


def test_pytree_reduce_forms(pm):
    with pm.activate():
        tree = {"a": pm.rank("gpu").float(), "b": [torch.ones(2), 3]}
        out = md.reduce(tree, "gpu")
        assert out["b"][1] == 3 and values(out["a"]) == [1.0] * 4
        assert md.reduce_(tree, ("host", "gpu"), "max") is tree
        assert values(tree["b"][0]) == [[1.0, 1.0]] * 4 and values(tree["a"]) == [1.0] * 4


def test_device_arguments_mean_the_workers_device(pm, monkeypatch):
    """A device the controller names ("cpu" here) is each worker's own device there (its
    cuda:<local index> on GPUs): the instruction carries WORKER_DEVICE, on the fast path too."""
    from monarch_dsl import isa

    with pm.activate():
        x = torch.ones(2)
        engine = x._md_engine
        sent = []
        real_append = engine.append
        monkeypatch.setattr(engine, "append", lambda m, i: (sent.append(i), real_append(m, i)))
        for _ in range(2):  # the second time through the cached fast path
            y = x.new_ones(2, device="cpu")
            ops = [i for i in sent if isinstance(i, isa.CallOp)]
            assert ops[-1].op == "aten::new_ones.default"
            assert ops[-1].kwargs["device"] is isa.WORKER_DEVICE
            assert md.inspect(y + x, host=1, gpu=1).tolist() == [2.0, 2.0]


def test_ops_on_lists_of_mesh_tensors_take_the_fast_path_the_second_time(pm, monkeypatch):
    """An op given a list of mesh tensors (torch.cat, _foreach_*, the DDP bucket ops) is
    recorded from the cache once it has been seen with those shapes -- values alike -- and
    a list that mixes meshes or streams still gets the full checks."""
    from monarch_dsl.tensor import dispatch

    general = []
    real = dispatch._dispatch_general
    monkeypatch.setattr(
        dispatch, "_dispatch_general", lambda *a, **k: (general.append(a[0]), real(*a, **k))[1]
    )
    with pm.activate():
        x, y = torch.ones(2), pm.rank("gpu").float().expand(2).contiguous()
        for k in range(2):
            general.clear()
            z = torch.cat([x, y])
            torch._foreach_add_((x, y), 1.0)  # (returns nothing: cached as such)
            assert values(z) == [[1.0 + k] * 2 + [g + k] * 2 for _, g in COORDS]
            assert values(y) == [[g + 1.0 + k] * 2 for _, g in COORDS]
            if k == 1:
                assert not any("cat" in str(f) or "foreach" in str(f) for f in general), general
        with md.Stream("side").activate():
            w = torch.ones(2)
        with pytest.raises(TypeError, match="stream"):
            torch.cat([x, w])
    with pm.slice(host=0).activate():
        b = torch.ones(2)
    with pytest.raises(TypeError, match="two meshes"):
        torch.cat([x, b])


def test_an_in_place_reduce_makes_no_meta_tensor(pm, monkeypatch):
    """reduce_ reads the shape from the handle: no meta op, each of which goes through the
    dispatch mode under activation (they were about 95% of the controller's time for a
    reduce_); the out-of-place form still makes its output's."""
    from monarch_dsl.tensor import handle

    with pm.activate():
        t = pm.rank("gpu").float() + torch.ones(2, 1)

        def refuse(*args, **kwargs):
            raise AssertionError("a meta tensor was made")

        with monkeypatch.context() as m:
            m.setattr(handle, "new_meta", refuse)
            m.setattr(torch, "empty_like", refuse)
            assert t.reduce_("gpu", "sum") is t
        assert values(t) == [[[3.0], [3.0]]] * 4  # (0 + 1) + (1 + 1) over gpu
        assert tuple(t.reduce("gpu", "stack").shape) == (2, 2, 1)


def test_python_values_of_mesh_tensors_need_a_fetch(pm):
    with pm.activate():
        s = torch.ones(2).sum()
        for get in (s.item, lambda: bool(s), torch.ones(2).tolist, s.numpy):
            with pytest.raises(TypeError, match=r"md\.inspect\(t\)"):
                get()
        with pytest.raises(TypeError, match="output shape is not known"):
            torch.ones(2).nonzero()
        with pytest.raises(TypeError, match="output shape is not known"):  # (torch: RuntimeError)
            torch.ones(3).repeat_interleave(torch.tensor([1, 2, 3]))
        with pytest.raises(RuntimeError, match="broadcast"):  # (the user's own error, as it is)
            torch.ones(3) + torch.ones(4)
        with pytest.raises(TypeError, match=r"md\.inspect\(t\)\.item\(\):\.3f"):
            f"{s:.3f}"
        with pytest.raises(TypeError, match="allclose.*needs the tensor's value"):
            torch.allclose(s, s)
        # Torch's versions read a local storage, which a handle has not (two crashed the
        # controller with a segmentation fault).
        for local_only in ("share_memory_", "is_shared", "apply_", "pin_memory", "untyped_storage"):
            args = (float,) if local_only == "apply_" else ()
            with pytest.raises(TypeError, match=rf"{local_only}\(\) needs the tensor's local"):
                getattr(s, local_only)(*args)
        # As for a local tensor: not equal to what is not a tensor or a number.
        assert (s == None) is False and (s != "a") is True  # noqa: E711
        assert md.inspect(s == np.float32(2.0)).item() is True  # (numpy scalars compare)
        assert f"{s}" == repr(s)
        assert md.inspect(s).item() == 2.0


def test_a_batch_that_cannot_be_sent_fails_its_fetches_instead_of_hanging(pm, monkeypatch):
    """An internal error encoding a tensor batch (nothing a user's value can cause: those are
    refused when issued): the fetch in it fails with the cause, in the caller's flush and in
    the flusher thread's, which goes on; the mesh runs later batches."""
    import threading

    from monarch_dsl.runtime import controller
    from monarch_dsl.runtime.messages import RunBatch

    real = controller._encode_call

    def broken(msg):
        if isinstance(msg, RunBatch):
            raise TypeError("made-up encoding failure")
        return real(msg)

    from monarch_dsl import isa
    from monarch_dsl.tensor import Engine

    with pm.activate():
        x = torch.ones(3) * 2
        md.inspect(x)
        engine = Engine.of(pm)
        monkeypatch.setattr(controller, "_encode_call", broken)
        # (no timed flush: the flusher thread could send the batch first, on a busy machine)
        monkeypatch.setattr(engine, "_hold", lambda lazy: None)
        with pytest.raises(TypeError, match="made-up encoding failure"):
            md.inspect(x + 1)  # (flushed by the caller: raised there)
        monkeypatch.undo()
        monkeypatch.setattr(controller, "_encode_call", broken)
        # flushed by the flusher thread (a fetch as md.fetch issues it, less its own flush):
        # the fetch's future fails with the cause
        y = x + 3
        call_id, fut = engine.job.expect((pm.ranks[0],), lambda values: values[0])
        engine.append(engine.mesh_id(pm), isa.Fetch(call_id, y._md_ref, "main", "test"))
        with pytest.raises(RuntimeError, match="could not be sent.*made-up"):
            fut.get(timeout=30)
        assert all(t.is_alive() for t in threading.enumerate() if t.name == "md-flusher")
        monkeypatch.setattr(controller, "_encode_call", real)
        later = md.inspect(x * 5)
    assert torch.equal(later, torch.full((3,), 10.0))
