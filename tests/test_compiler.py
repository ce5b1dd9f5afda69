"""The compiler on a simulated mesh (pure: no processes): parity with one-process training,
inserted communication, errors. The same programs run on real workers in test_mesh_fn.py."""

from __future__ import annotations

import copy
import inspect
import math
import re
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import monarch_dsl as md
from monarch_dsl.compiler.plan import Partial, Plan, PlanError

sys.path.insert(0, str(Path(__file__).parent))
from compiler_helpers import (  # noqa: E402
    MEGATRON_MLP,
    Block,
    TwoStages,
    block_batches,
    cross_entropy_step,
    mse_batches,
    mse_step,
    simulate_both,
    simulate_training,
    two_stages,
    two_stages_sgd,
)

R, S = md.Replicate(), md.Shard


def _mlp(opt_cls=torch.optim.SGD, ln=False, **opt_kwargs):
    def make():
        torch.manual_seed(0)
        layers = [nn.LayerNorm(16)] if ln else []
        model = nn.Sequential(*layers, nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        return model, opt_cls(model.parameters(), **(opt_kwargs or {"lr": 0.1})), mse_step

    return make


def _assert_parity(model, ref, losses, ref_losses):
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"parameter {name}")
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)


DP = {"mesh": (("dp", 2),), "data_parallel": "dp"}


@pytest.mark.parametrize(
    "opt",
    [
        (torch.optim.SGD, {"lr": 0.1}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.Adam, {"lr": 0.01}),
        (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    ],
    ids=["sgd", "sgd-momentum", "adam", "adamw"],
)
def test_data_parallel_matches_one_process(opt):
    model, ref, losses, ref_losses, plans = simulate_training(
        _mlp(opt[0], **opt[1]), batches=mse_batches(), **DP
    )
    _assert_parity(model, ref, losses, ref_losses)
    for plan in plans:
        plan.check()
        assert {c.kind for c in plan.collectives} == {"all_reduce"}
        assert all(c.dims == ("dp",) for c in plan.collectives)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_linear_and_relu_are_traced_without_ops_that_change_nothing(dtype):
    """``nn.Linear`` is an mm and a bias add (torch's decomposition multiplies both by 1
    first: two ops a layer on every rank at every step), ReLU's backward one
    ``threshold_backward`` (not le + scalar_tensor + where); training matches one process.
    bfloat16 keeps torch's decomposition (it computes in float32 and casts back)."""

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).to(dtype)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), mse_step

    batches = [(x.to(dtype), y.to(dtype)) for x, y in mse_batches()]
    model, ref, losses, ref_losses, plans = simulate_training(make, batches=batches, **DP)
    ops = [i.op for i in plans[0].body]
    assert ops.count("aten.threshold_backward.default") == 1
    assert "aten.where.self" not in ops and "aten.scalar_tensor.default" not in ops
    # each bias gradient: one sum over the batch, not a keepdim sum and a view of it
    assert "aten.view.default" not in ops
    assert [i.args[1:] for i in plans[0].body if i.op == "aten.sum.dim_IntList"] == [
        ([0], False)
    ] * 2
    ones = [str(i) for i in plans[0].body if i.op == "aten.mul.Tensor" and 1 in i.args[1:]]
    assert (ones == []) == (dtype != torch.bfloat16), ones
    if dtype == torch.bfloat16:
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    else:
        _assert_parity(model, ref, losses, ref_losses)


def test_an_op_computed_twice_from_the_same_inputs_is_computed_once_but_not_across_a_write():
    """MSE's backward repeats its forward's ``sub(out, y)``: one sub in the plan, training as
    one process. The same op on a parameter before and after an in-place write to it stays
    twice, and two dropouts of the same input stay two (random ops are never merged)."""
    make = _mlp()
    model, ref, losses, ref_losses, plans = simulate_training(make, batches=mse_batches(), **DP)
    assert [i.op for i in plans[0].body].count("aten.sub.Tensor") == 1
    _assert_parity(model, ref, losses, ref_losses)

    from monarch_dsl.compiler.compile import compile_step

    holder = nn.Linear(4, 4, bias=False)
    nn.init.constant_(holder.weight, 2.0)

    def step(x):
        w = holder.weight
        before = (w * 3).sum()
        with torch.no_grad():
            w.add_(1.0)
        after = (w * 3).sum()
        return before, after, x.sum()

    x = torch.ones(8, 4)
    plan, c = compile_step(step, (x,), {}, (("dp", 2),), data_parallel="dp")
    ops = [i.op for i in plan.body]
    assert ops.count("aten.mul.Tensor") == 2, ops  # w * 3 before and after the write
    outs, _ = simulate_both(plan, c.input_values)
    assert outs[0].item() == 2.0 * 3 * 16 and outs[1].item() == 3.0 * 3 * 16

    def clones(x):  # copies written differently, one through a view: three buffers
        a = x.clone()
        b = x.clone()  # (torch's fx_graph_cse makes a and b one: its graphs are functional)
        a.view(-1).add_(1.0)
        b.mul_(3.0)
        c = x.clone()
        return a.sum(), b.sum(), c.sum(), x * 2, x * 2  # (the last two: results apart)

    plan, c = compile_step(clones, (x,), {}, (("dp", 2),), data_parallel="dp")
    ops = [i.op for i in plan.body]
    assert ops.count("aten.clone.default") == 3 and ops.count("aten.mul.Tensor") == 2, ops
    outs, _ = simulate_both(plan, c.input_values)
    assert [o.item() for o in outs[:3]] == [2.0 * 32, 3.0 * 32, 32.0]

    def dropouts(x):
        return F.dropout(x, 0.5), F.dropout(x, 0.5)

    plan, _ = compile_step(dropouts, (x,), {}, (("dp", 2),), data_parallel="dp")
    random = [i.op for i in plan.body if "bernoulli" in i.op or "rand" in i.op]
    assert len(random) == 2, [i.op for i in plan.body]


@torch.library.custom_op("md_test::noise", mutates_args=())
def _noise(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand_like(x)


@_noise.register_fake
def _(x):
    return torch.empty_like(x)


def test_cse_keeps_apart_what_only_looks_alike():
    """Found by review: a write into one of two ``_unsafe_view`` results (a 3-d matmul's; its
    schema does not say it is a view); ``x * 0.0`` and ``x * -0.0``; a custom op (maybe
    random); two bias gradients that are both step results (they would share memory)."""
    from monarch_dsl.compiler.compile import compile_step

    holder = nn.Linear(4, 4, bias=False)

    def linear3d(x):
        a = F.linear(x, holder.weight)
        b = F.linear(x, holder.weight)
        a.relu_()
        return a.sum(), b.sum(), 1 / (x * 0.0), 1 / (x * -0.0)

    x = torch.randn(2, 4, 4)
    plan, c = compile_step(linear3d, (x,), {}, (("tp", 2),))
    outs, _ = simulate_both(plan, c.input_values)
    with torch.no_grad():
        want = linear3d(x.clone())
    for got, ref in zip(outs, want, strict=True):
        torch.testing.assert_close(got, ref)

    plan, _ = compile_step(lambda x: (_noise(x) * 1, _noise(x) * 1), (x,), {}, (("tp", 2),))
    assert [i.op for i in plan.body].count("md_test.noise.default") == 2

    class TwoBiases(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))
            self.b1 = nn.Parameter(torch.zeros(4))
            self.b2 = nn.Parameter(torch.zeros(4))

        def forward(self, x):
            return x @ self.w + self.b1 + self.b2

    def make():
        torch.manual_seed(0)
        model = TwoBiases()
        return model, torch.optim.SGD(model.parameters(), lr=0.1), mse_step

    batches = [(torch.randn(8, 4), torch.randn(8, 4)) for _ in range(3)]
    model, ref, losses, ref_losses, plans = simulate_training(make, batches=batches, **DP)
    sums = [i for i in plans[0].body if i.op == "aten.sum.dim_IntList"]
    assert len(sums) == 2, [str(i) for i in plans[0].body]  # one per bias gradient
    _assert_parity(model, ref, losses, ref_losses)


def test_a_keepdim_sum_viewed_to_another_shape_or_used_twice_stays():
    from monarch_dsl.compiler.compile import compile_step

    def step(x):
        s = x.sum(0, keepdim=True)
        a = s.view(2, 2)  # not the dropped-dims shape
        b = x.sum(1, keepdim=True)
        return a * 2, b.view(-1) + b.sum()  # b is used twice

    x = torch.arange(32.0).reshape(8, 4)
    plan, c = compile_step(step, (x,), {}, (("dp", 2),), data_parallel="dp")
    ops = [i.op for i in plan.body]
    assert ops.count("aten.view.default") == 2, ops

    outs, _ = simulate_both(plan, c.input_values)
    torch.testing.assert_close(outs[0], x.sum(0, keepdim=True).view(2, 2) * 2)
    b = x.sum(1, keepdim=True)
    torch.testing.assert_close(outs[1], b.view(-1) + b.sum())

    def every_dim(x):  # sum over no dims listed: every dim; the view keeps its shape
        return x.sum(dim=[], keepdim=True).view(1, 1) * 2

    plan, c = compile_step(every_dim, (x,), {}, (("tp", 2),))
    out, _ = simulate_both(plan, c.input_values)
    assert list(out[0].shape) == [1, 1] and out[0].item() == x.sum().item() * 2


class _Attention(nn.Module):
    """Token embedding, nn.MultiheadAttention (batch first) and a classifier on the mean."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = self.embed(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head((a + h).mean(1))


def test_data_parallel_multihead_attention_matches_one_process():
    """nn.MultiheadAttention's ``permute(...).contiguous().view(...)`` is traced without the
    ``contiguous`` (a no-op on the traced layout); on the ranks, the attention's inputs come
    from collectives laid out otherwise, and its ``view`` failed until views ran as
    ``reshape`` (lower._AS_RESHAPE)."""

    def make():
        torch.manual_seed(0)
        model = _Attention()
        return model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_step

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 40, (8, 6), generator=g), torch.randint(0, 10, (8,), generator=g))]
    model, ref, losses, ref_losses, _ = simulate_training(make, batches=batches * 2, steps=2, **DP)
    _assert_parity(model, ref, losses, ref_losses)


class _ConvNet(nn.Module):
    def __init__(self, transposed=False):
        super().__init__()
        conv = nn.ConvTranspose2d if transposed else nn.Conv2d
        self.conv = conv(3, 8, 3, padding=1, groups=1)
        self.norm = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.head = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        h = torch.relu(self.norm(self.conv(x)))
        return self.head(self.conv2(h).flatten(1))


class _PoolNet(nn.Module):
    """Pools, upsamplings, activations without a rule of their own before, a stack of two
    branches and a slice of the output (whose backward makes zeros as large as it)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 4 * 4 * 2, 6)

    def forward(self, x):
        h = F.hardswish(self.conv(x))  # [N, 4, 8, 8]
        a = F.leaky_relu(F.max_pool2d(h, 2), 0.1)  # [N, 4, 4, 4]
        b = F.adaptive_avg_pool2d(F.avg_pool2d(h, 2, stride=1), (2, 2))
        b = F.interpolate(b, scale_factor=2, mode="nearest") + F.interpolate(
            F.adaptive_max_pool2d(h, (2, 2)), size=(4, 4), mode="bilinear"
        )
        out = self.head(torch.stack([a, F.elu(b)], dim=1).flatten(1))
        return torch.cat([out[:, :2], F.softplus(out[:, 2:])], dim=1)[:, :4]


def _assert_data_parallel_stays_sharded(module, batches, step_of=mse_step):
    """Training ``module()`` under dp=2 matches one process on the whole batch (parameters,
    buffers); no op gathers a sharded input (a warning is an error); only small all-reduces
    (gradients, per-channel statistics) are communicated."""

    def make():
        torch.manual_seed(0)
        model = module()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), step_of

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, ref, losses, ref_losses, plans = simulate_training(make, batches=batches, **DP)
    fallbacks = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert not fallbacks, fallbacks  # no op falls back to running replicated
    _assert_parity(model, ref, losses, ref_losses)
    for (name, a), b in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"buffer {name}")
    plan = plans[0].check()
    assert {c.kind for c in plan.collectives} == {"all_reduce"}
    types = plan.types()
    moved = sum(math.prod(types[o].shape or ()) for i in plan.body if i.is_comm for o in i.outs)
    params = sum(p.numel() for p in model.parameters())
    assert moved < params + 64, "an activation was communicated"


def _image_batches(shape, out, n=3):
    """``n`` batches of inputs of ``shape`` and targets of (batch, *``out``)."""
    g = torch.Generator().manual_seed(1)
    out = out if isinstance(out, tuple) else (out,)
    return [(torch.randn(*shape, generator=g) * 2 + 1, torch.randn(shape[0], *out, generator=g))
            for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("transposed", [False, True])
def test_data_parallel_convolutions_and_batch_norm_stay_sharded(transposed):
    """A CNN's convolutions run on each rank's samples (a convolution had no sharding rule:
    its input batch was gathered onto every rank and its backward all-reduced an
    activation-sized gradient), and batch norm normalizes with the whole batch's statistics
    from per-channel sums all-reduced (var_mean as sums), as one process on the whole batch:
    parameters and running statistics match; the step moves only small all-reduces."""
    _assert_data_parallel_stays_sharded(
        lambda: _ConvNet(transposed), _image_batches((8, 3, 6, 6), 4)
    )


def test_data_parallel_pools_upsamplings_and_activations_stay_sharded():
    """Max / average / adaptive pools, nearest and bilinear upsampling, hardswish, leaky_relu,
    elu, softplus, a stack and a slice of the output: each had no sharding rule (its input
    gathered onto every rank); a probe of everyday blocks under data parallel found them."""
    _assert_data_parallel_stays_sharded(_PoolNet, _image_batches((8, 3, 8, 8), 4))


def _losses_step(model, opt):
    """Binary cross-entropy (with logits and on probabilities), smooth L1 and Huber losses."""

    def step(x, y):
        opt.zero_grad()
        out = model(x)
        target = torch.sigmoid(y)
        loss = F.binary_cross_entropy_with_logits(out, target) + F.smooth_l1_loss(out, y)
        loss = loss + F.huber_loss(out, y, delta=0.5)
        loss = loss + F.binary_cross_entropy(torch.sigmoid(out), target)
        loss.backward()
        opt.step()
        return loss

    return step


def test_data_parallel_group_norm_and_elementwise_losses_stay_sharded():
    """GroupNorm (per sample) and the losses that are pointwise ops and a mean are traced as
    such (torch's decompositions): each had no sharding rule, and gathered the batch."""

    def module():
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Flatten(),
            nn.Linear(8 * 4 * 4, 4),
        )  # fmt: skip

    _assert_data_parallel_stays_sharded(module, _image_batches((8, 3, 4, 4), 4), _losses_step)


class _SelfAttention(nn.Module):
    """A GPT-style block on (B, T, E): heads split from the batch-first projections, fused
    causal attention, and a residual."""

    def __init__(self, e=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(e, 3 * e)
        self.proj = nn.Linear(e, e)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, e // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, e))


def test_data_parallel_fused_attention_stays_sharded():
    """``F.scaled_dot_product_attention`` (the fused CPU kernel and its backward) had no
    sharding rule: q, k and v were gathered onto every rank."""
    _assert_data_parallel_stays_sharded(_SelfAttention, _image_batches((8, 5, 8), (5, 8)))


class _Recurrent(nn.Module):
    """A GRU (its traced step unbinds a gate dim) and an unbind of a dim of size 1."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(6, 4, batch_first=True)
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        (first,) = x[:, :1].unbind(1)  # one tensor from a list of one
        return self.gru(x)[0][:, -1] + self.head(first)


def test_a_gru_and_an_unbind_of_one_train_as_one_process():
    """An op that returns a list of one tensor (unbind of a dim of size 1, a GRU's traced
    step) bound the list itself to its one output: the next op failed ('expected Tensor ...
    found list'), on one rank or two."""

    def make():
        torch.manual_seed(0)
        model = _Recurrent()
        return model, torch.optim.SGD(model.parameters(), lr=0.1), mse_step

    batches = _image_batches((8, 3, 6), 4, n=2)
    for mesh in ((("dp", 1),), (("dp", 2),)):
        model, ref, losses, ref_losses, _ = simulate_training(
            make, mesh, batches, steps=2, data_parallel="dp"
        )
        _assert_parity(model, ref, losses, ref_losses)


def test_megatron_mlp_tp2():
    model, ref, losses, ref_losses, plans = simulate_training(
        _mlp(), (("tp", 2),), mse_batches(), placements=MEGATRON_MLP
    )
    _assert_parity(model, ref, losses, ref_losses)
    plan = plans[0].check()
    # Column- then row-parallel: the forward makes the row-parallel result whole once; the
    # input needs no gradient, so the backward needs no communication at all.
    kinds = [(c.kind, c.dims) for c in plan.collectives]
    assert kinds == [("all_reduce", ("tp",))], plan.collectives
    # The sharded weights stay sharded: the step never gathers them.
    types = plan.types()
    assert types["model.0.weight"].placements == (S(0),)


def test_dp_times_tp():
    tp = {
        "model.1.weight": {"tp": S(0)},
        "model.1.bias": {"tp": S(0)},
        "model.3.weight": {"tp": S(1)},
    }
    model, ref, losses, ref_losses, plans = simulate_training(
        _mlp(ln=True), (("dp", 2), ("tp", 2)), mse_batches(), placements=tp, data_parallel="dp"
    )
    _assert_parity(model, ref, losses, ref_losses)
    plans[0].check()
    assert {c.dims for c in plans[0].collectives} == {("dp",), ("tp",)}


def test_compile_takes_a_mesh_or_its_sizes_and_refuses_anything_else():
    model, opt, _ = _mlp()()
    step = md.mesh_fn(data_parallel="dp", placements=MEGATRON_MLP)(mse_step(model, opt))
    args = mse_batches(1, (8, 16))[0]
    by_sizes = step.compile(*args, mesh={"dp": 2, "tp": 2})
    assert str(by_sizes) == str(step.compile(*args, mesh=md.Mesh.from_string("dp=2,tp=2")))
    with pytest.raises(TypeError, match="mesh must be a mesh or its sizes.*got str"):
        step.compile(*args, mesh="dp=2,tp=2")
    step = md.mesh_fn(data_parallel="dp", placements=MEGATRON_MLP, mesh={"dp": 2, "tp": 2})(
        mse_step(model, opt)
    )
    assert str(step.compile(*args)) == str(by_sizes)  # the decorator's mesh, as sizes too


def test_a_step_is_compiled_again_under_another_default_dtype():
    """What its factories and type promotion give follows torch's default dtype, as the
    eager ops' do: the plan of a step traced under float32 is not the one run under float64."""

    @md.mesh_fn(data_parallel="dp")
    def step(x):
        return x.sum() + torch.arange(3).sum() / 2  # (int / int: the default dtype)

    x = torch.ones(4, 2)
    plans = {}
    try:
        for default in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(default)
            plans[default] = str(step.compile(x, mesh={"dp": 2}))
    finally:
        torch.set_default_dtype(torch.float32)
    assert step.compiles == 2
    assert "f64[" in plans[torch.float64] and "f64[" not in plans[torch.float32]


def test_plan_summary_is_a_table_of_the_communications():
    model, opt, _ = _mlp()()
    step = md.mesh_fn(data_parallel="dp", placements=MEGATRON_MLP)(mse_step(model, opt))
    plan = step.compile(*mse_batches(1, (8, 16))[0], mesh=md.Mesh.from_string("dp=2,tp=2"))
    text = plan.summary()
    head, blank, header, rule, *rows = text.splitlines()
    assert head.startswith("plan 'step' for mesh dp=2,tp=2:")
    assert f"{len(plan.collectives)} communications" in head
    assert header.split() == [
        "#",
        "kind",
        "dims",
        "stream",
        "moves",
        "(per",
        "rank)",
        "why",
        "where",
    ]
    numbered = [r for r in rows if r[:1].isdigit()]  # a row per communication (+ wrapped reasons)
    assert len(numbered) == len(plan.collectives)
    for row, c in zip(numbered, plan.collectives, strict=True):
        assert row.split()[1:3] == [c.kind, ",".join(c.dims)]
        assert row.rstrip().endswith(c.loc.rsplit("/", 1)[-1])  # the user's file:line
    # the tp all-reduce of the row-parallel result moves each rank's (8/2)x16 float32 part
    assert "f32[4x16]" in numbered[0], numbered[0]
    assert "tensors," in text  # a gradient bucket: how many tensors and bytes
    assert plan.summary() == text


def test_transformer_block_dp2():
    def make():
        torch.manual_seed(0)
        model = Block()
        # (Not Adam: the key bias's true gradient is zero — softmax ignores it — and Adam
        # turns the float noise of any reordering into full-size steps.)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, cross_entropy_step

    model, ref, losses, ref_losses, plans = simulate_training(make, batches=block_batches(), **DP)
    _assert_parity(model, ref, losses, ref_losses)
    for plan in plans:
        plan.check()


def test_gradients_bucketed_on_comms_stream():
    x, y = mse_batches(1)[0]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mesh = md.Mesh.from_string("dp=2")

    def buckets(cap):
        step = md.mesh_fn(mse_step(model, opt), data_parallel="dp", bucket_cap_mb=cap)
        plan = step.compile(x, y, mesh=mesh)
        return [c for c in plan.collectives if c.stream == "comms"], plan

    one, plan = buckets(25)
    assert len(one) == 1 and "6 tensors" in one[0].reason
    many, plan = buckets(0.01)  # 0.25 MiB per 256x256 weight: several buckets
    assert len(many) >= 3
    # Issued as soon as ready: the first bucket comes before the backward pass ends (before
    # the last mm of the backward).
    body = plan.body
    first = next(i for i, ins in enumerate(body) if ins.stream == "comms")
    last_mm = max(i for i, ins in enumerate(body) if ins.op == "aten.mm.default")
    assert first < last_mm


def test_the_loss_rides_in_the_last_gradient_bucket():
    """A result's all-reduce (the loss, an average over dp) goes out in the last gradient
    bucket, summed, and is divided where it was: one collective per step fewer. A result
    made after the bucket went out (a second loss after the update) keeps its own."""
    x, y = mse_batches(1)[0]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mesh = md.Mesh.from_string("dp=2")
    plan = md.mesh_fn(mse_step(model, opt), data_parallel="dp").compile(x, y, mesh=mesh)
    plan.check()
    [bucket] = plan.collectives
    ins = _made_by(plan, bucket.value)
    assert ins.stream == "comms" and ins.kw("op") == "sum" and len(ins.outs) == 5
    assert "and the step's result %mean" in ins.reason
    loss = _made_by(plan, plan.outputs[0].var)
    assert loss.op == "aten.div.Tensor" and loss.args[1] == 2 and loss.stream == "main"
    assert loss.args[0].name == ins.outs[-1] and loss.uses() == [ins.outs[-1]]

    def twice(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss, F.mse_loss(model(x), y)  # the second: after the bucket went out

    plan = md.mesh_fn(twice, data_parallel="dp").compile(x, y, mesh=mesh)
    plan.check()
    comms = [c for c in plan.collectives if c.stream == "comms"]
    assert len(comms) == 1 and "and the step's result" in comms[0].reason
    [own] = [c for c in plan.collectives if c.stream == "main"]
    assert _made_by(plan, own.value).kw("op") == "avg"


def test_a_loss_written_after_it_is_ready_keeps_its_own_all_reduce():
    """The bucket reads a rider where it goes out and on the comms stream after: a loss the
    step writes later (here after the update, past the bucket) must not ride, or the step
    returns the value before the write (it returned 1/3 of the loss)."""
    from monarch_dsl.compiler.compile import compile_step

    x, y = mse_batches(1)[0]

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step_of(model, opt):
        train = mse_step(model, opt)

        def step(x, y):
            loss = train(x, y)
            loss.detach().mul_(3.0)  # written after the update: after the bucket went out
            return loss

        return step

    model, opt = make()
    plan, c = compile_step(step_of(model, opt), (x, y), {}, (("dp", 2),), data_parallel="dp")
    plan.check()
    assert not any("the step's result" in col.reason for col in plan.collectives)
    outs, _ = simulate_both(plan, c.input_values)
    ref_model, ref_opt = make()
    expected = step_of(ref_model, ref_opt)(x, y)  # (both ranks hold the same batch here)
    torch.testing.assert_close(outs[0], expected)


def test_zero_grad_keeping_the_tensors_after_the_update_trains_as_eager():
    """``opt.zero_grad(set_to_none=False)`` after the update zeroes gradients that are still
    each rank's partial sum: zeros sum to zero, so it writes them where they are (it was
    refused: the write would have had to make them whole)."""

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

        def step_of(model, opt):
            def step(x, y):
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
                return loss

            return step

        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), step_of

    model, ref, losses, ref_losses, _ = simulate_training(make, batches=mse_batches(3), **DP)
    _assert_parity(model, ref, losses, ref_losses)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.001])
@pytest.mark.parametrize(
    "kind",
    ["clipped", "row of a gradient", "diagonal of a gradient", "loss written after the update"],
)
def test_writes_around_the_buckets_train_as_eager(kind, bucket_cap_mb):
    """Writes between the backward pass and the end of the step -- into gradients before the
    update, into the loss after it -- with every gradient in one bucket or each in its own:
    the cases of a differential fuzzer against eager that found wrong results (two steps,
    SGD with momentum, values and parameters as eager's)."""

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))

        def step_of(model, opt):
            def step(x, y):
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                grad = model[-1].weight.grad
                if kind == "clipped":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                elif kind == "row of a gradient":
                    grad[0].mul_(0.5)
                elif kind == "diagonal of a gradient":
                    grad.diagonal().mul_(0.5)
                    loss = (grad * 1.0).sum()  # the gradient read again after the write
                opt.step()
                if kind == "loss written after the update":
                    loss.detach().mul_(3.0)
                return loss

            return step

        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), step_of

    got = simulate_training(
        make, batches=mse_batches(2), steps=2, bucket_cap_mb=bucket_cap_mb, **DP
    )
    _assert_parity(*got[:4])


def test_writes_the_plan_cannot_honour_are_refused_at_the_users_line():
    """Writes in place whose target the plan holds as a copy laid out for another op: each
    was compiled, and the step returned the value before the write. Now a PlanError names the
    op and the user's line -- or, for a view that can keep its input's layout, the write is
    where it belongs."""
    from monarch_dsl.compiler.compile import compile_step

    def through_a_row_slice(x):  # rows of a dp-sharded batch: the slice reads a column split
        x = x.clone()
        x[:2].mul_(0.0)
        return x.sum()

    def through_a_diagonal(x):  # (without a rule, diagonal ran on an all-reduced copy)
        w = (x.t() @ x).detach()  # a partial sum over dp: its diagonal is too
        w.diagonal().mul_(0.0)
        return (w * 1.0).sum()

    def through_out(x):  # aten.mul.out writes its out= argument: the name does not say so
        s = x.sum()
        d = s.detach()
        torch.mul(d, 3.0, out=d)
        return s

    x = torch.ones(8, 4)
    cases = [
        (through_a_row_slice, "x[:2].mul_", r"writes in place into %slice\w*, a view of %clone"),
        (through_out, "torch.mul(d", r"aten.mul.out writes in place into %\w+, whose placement"),
    ]
    for fn, line, message in cases:
        with pytest.raises(PlanError, match=message) as e:
            compile_step(fn, (x,), {}, (("dp", 2),), data_parallel="dp")
        _assert_loc(e.value.loc, fn, line)

    # a slice of the dim that is not sharded, a diagonal of a partial sum: views of the value
    # itself, written where it is
    def through_a_column_slice(x):
        x = x.clone()
        x[:, :2].mul_(0.0)
        return x.sum()

    x = torch.arange(32.0).reshape(8, 4)
    for fn in (through_a_column_slice, through_a_diagonal):
        plan, c = compile_step(fn, (x,), {}, (("dp", 2),), data_parallel="dp")
        for view in (i for i in plan.body if i.op == "aten.diagonal.default"):
            assert _made_by(plan, view.uses()[0]).op == "aten.detach.default"  # not a copy
        outs, _ = simulate_both(plan, c.input_values)
        torch.testing.assert_close(outs[0], fn(x.clone()))


def test_plan_cache_and_recompile():
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = md.mesh_fn(mse_step(model, opt), data_parallel="dp")
    mesh = md.Mesh.from_string("dp=2")
    x, y = mse_batches(1)[0]
    p1 = step.compile(x, y, mesh=mesh)
    assert step.compile(x, y, mesh=mesh) is p1 and step.compiles == 1
    step.compile(torch.randn(4, 16), torch.randn(4, 16), mesh=mesh)
    assert step.compiles == 2


def test_data_dependent_control_flow_names_the_line():
    model = nn.Linear(4, 4)

    @md.mesh_fn(data_parallel="dp")
    def step(x):
        y = model(x)
        if y.sum() > 0:  # the line the error names
            y = y * 2
        return y

    with pytest.raises(PlanError, match=r"depends on a tensor's value.*test_compiler.py:\d+") as e:
        step.compile(torch.randn(4, 4), mesh=md.Mesh.from_string("dp=2"))
    _assert_loc(e.value.loc, step.fn, "if y.sum() > 0")
    assert str(e.value).endswith(f"(at {e.value.loc})")


def test_placement_errors():
    model = nn.Linear(4, 4)
    mesh = md.Mesh.from_string("dp=2")

    def fn(x):
        return model(x)

    with pytest.raises(ValueError, match="'nope' is not an argument or a parameter"):
        md.mesh_fn(fn, placements={"nope": R}).compile(torch.randn(4, 4), mesh=mesh)
    with pytest.raises(ValueError, match="'tp' is not a dim of the mesh"):
        md.mesh_fn(fn, placements={"x": {"tp": S(0)}}).compile(torch.randn(4, 4), mesh=mesh)
    with pytest.raises(PlanError, match="divisible by the mesh dim's size 2"):
        md.mesh_fn(fn, data_parallel="dp").compile(torch.randn(3, 4), mesh=mesh)
    with pytest.raises(ValueError, match="data_parallel='dq'"):
        md.mesh_fn(fn, data_parallel="dq").compile(torch.randn(4, 4), mesh=mesh)


def test_op_without_rule_falls_back_with_a_warning():
    def fn(x):
        return torch.cumsum(x, 0) * 2

    step = md.mesh_fn(fn, data_parallel="dp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = step.compile(torch.randn(4, 4), mesh=md.Mesh.from_string("dp=2"))
    msgs = [str(w.message) for w in caught]
    assert any("no sharding rule for aten.cumsum.default" in m and "MiB" in m for m in msgs), msgs
    assert [c.kind for c in plan.collectives][0] == "all_gather"


@pytest.mark.parametrize("mesh", [(("pp", 2),), (("dp", 2), ("pp", 2))], ids=["pp2", "dp2xpp2"])
def test_pipeline_gpipe_micro_batches(mesh):
    dp = "dp" if len(mesh) == 2 else None
    model, ref, losses, ref_losses, plans = simulate_training(
        two_stages_sgd, mesh, mse_batches(), micro_batches=4, data_parallel=dp
    )
    _assert_parity(model, ref, losses, ref_losses)
    plan = plans[0].check()
    kinds = [c.kind for c in plan.collectives]
    # Every micro-batch's activation goes forward and its gradient back: 4 + 4 transfers.
    assert kinds.count("send") == kinds.count("recv") == 8
    sends = [ins for ins in plan.body if ins.op == "send"]
    assert [s.on for s in sends[:4]] == [(("pp", 0),)] * 4  # forward, stage 0 -> 1
    assert [s.on for s in sends[4:]] == [(("pp", 1),)] * 4  # backward, stage 1 -> 0
    # GPipe: all forwards (on stage 0) before any backward.
    first_bwd_recv = next(
        i for i, ins in enumerate(plan.body) if ins.op == "recv" and ins.on == (("pp", 0),)
    )
    assert all(
        i < first_bwd_recv
        for i, ins in enumerate(plan.body)
        if ins.op == "send" and ins.on == (("pp", 0),)
    )
    assert plan.micro_batches == 4


def test_megatron_input_gradient_one_all_reduce_each_way():
    """Column- then row-parallel with the input's gradient wanted (as inside a transformer):
    exactly one all-reduce in the forward pass and one in the backward."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    tp = {"mlp.0.weight": {"tp": S(0)}, "mlp.0.bias": {"tp": S(0)}, "mlp.2.weight": {"tp": S(1)}}

    @md.mesh_fn(placements=tp)
    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(mlp(x), y)
        loss.backward()
        opt.step()
        return loss, x.grad

    x = torch.randn(8, 16, requires_grad=True)
    plan = step.compile(x, torch.randn(8, 16), mesh=md.Mesh.from_string("tp=2"))
    seed = next(i for i, ins in enumerate(plan.body) if ins.op == "aten.ones_like.default")
    where = [
        "forward" if i < seed else "backward" for i, ins in enumerate(plan.body) if ins.is_comm
    ]
    assert where == ["forward", "backward"]
    assert all(c.kind == "all_reduce" and c.dims == ("tp",) for c in plan.collectives)
    assert all(c.loc.startswith("tests/test_compiler.py:") for c in plan.collectives)


def test_autograd_grad_and_embedding():
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def step_of(model, opt):
            def step(ids, y):
                params = list(model.parameters())
                loss = F.mse_loss(model(ids), y)
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    for p, g in zip(params, grads):
                        p.sub_(0.5 * g)
                return loss

            return step

        return model, opt, step_of

    g = torch.Generator().manual_seed(4)
    batches = [
        (torch.randint(0, 32, (8, 4), generator=g), torch.randn(8, 4, 16, generator=g))
        for _ in range(3)
    ]
    model, ref, losses, ref_losses, plans = simulate_training(make, batches=batches, **DP)
    _assert_parity(model, ref, losses, ref_losses)


def test_every_pass_is_recorded_in_passes():
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = md.mesh_fn(mse_step(model, opt), data_parallel="dp").compile(
        *mse_batches(1)[0], mesh=md.Mesh.from_string("dp=2")
    )
    assert [p.name for p in plan.passes] == ["capture", "propagate", "schedule", "check"]
    assert all(p.seconds >= 0 for p in plan.passes)
    assert plan.passes[-1].plan == plan
    assert plan.stages == plan.passes  # SPEC §5's name


def test_dropout_cat_chunk_amax_log_softmax_stay_sharded():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)

    def fn(x):
        a, b = torch.chunk(lin(x), 2, dim=1)
        h = torch.cat([F.dropout(a, 0.1), torch.tanh(b)], dim=1)
        return F.log_softmax(h, dim=-1).amax(dim=1).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every op has a rule: no fallback warning
        plan = md.mesh_fn(fn, data_parallel="dp").compile(
            torch.randn(8, 16), mesh=md.Mesh.from_string("dp=2")
        )
    plan.check()
    # Only the final sum over the sharded batch needs communication.
    assert [(c.kind, c.dims) for c in plan.collectives] == [("all_reduce", ("dp",))]


# ---- regressions (found in review) ----------------------------------------------------------


def _simulate(fn, args, mesh, **options):
    from monarch_dsl.compiler.compile import compile_step

    plan, c = compile_step(fn, args, {}, mesh, **options)
    plan.check()
    return simulate_both(plan, c.input_values)[0]


def test_a_value_used_twice_can_be_wanted_two_ways():
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    out = _simulate(
        lambda a, b: (a @ b) * (a @ b).clone(),
        (a, b),
        (("tp", 2),),
        placements={"a": {"tp": S(1)}, "b": {"tp": S(0)}},
    )[0]
    torch.testing.assert_close(out, (a @ b) ** 2)

    def square(a, b):
        h = a @ b  # Partial over tp
        return h * h  # one use made whole, the other kept partial

    out = _simulate(square, (a, b), (("tp", 2),), placements={"a": {"tp": S(1)}, "b": {"tp": S(0)}})
    torch.testing.assert_close(out[0], (a @ b) ** 2)


@pytest.mark.parametrize(
    "fn,placement",
    [
        (lambda x: x[:, 0:4] * 1, S(1)),
        (lambda x: x[2:6] * 1, S(0)),
        (lambda x: x.narrow(0, 2, 4) * 1, S(0)),
    ],
    ids=["slice-dim1", "slice-dim0", "narrow"],
)
def test_slicing_a_sharded_dim_gathers_it_first(fn, placement):
    x = torch.randn(8, 8)
    out = _simulate(fn, (x,), (("tp", 2),), placements={"x": {"tp": placement}})[0]
    torch.testing.assert_close(out, fn(x))


def test_mean_cross_entropy_with_ignored_targets_is_the_batch_mean():
    torch.manual_seed(0)
    lin = nn.Linear(16, 4)
    x = torch.randn(8, 16)
    y = torch.tensor([0, 0, 0, 1, 2, 3, 1, 2])  # rank 0 ignores three targets, rank 1 none

    def loss(x, y):
        return F.cross_entropy(lin(x), y, ignore_index=0)

    out = _simulate(loss, (x, y), (("dp", 2),), data_parallel="dp")[0]
    torch.testing.assert_close(out, loss(x, y).detach())


def test_optimizer_state_that_exists_locally_is_used_and_keyed():
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step_fn = mse_step(model, opt)
    x, y = mse_batches(1)[0]
    step = md.mesh_fn(step_fn, data_parallel="dp")
    mesh = md.Mesh.from_string("dp=2")
    fresh = step.compile(x, y, mesh=mesh)
    step_fn(x, y)  # a local step: the optimizer now has momentum buffers
    with_state = step.compile(x, y, mesh=mesh)
    assert with_state is not fresh  # the cache key covers the local optimizer state
    assert any(i.name.endswith("momentum_buffer") for i in with_state.inputs)
    assert not any(i.name.endswith("momentum_buffer") for i in fresh.inputs)


def test_state_of_a_sharded_parameter_follows_it_and_step_counts_stay_whole():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step_fn = mse_step(model, opt)
    x, y = mse_batches(1)[0]
    step_fn(x, y)  # Adam state exists: exp_avg like the weight, a 0-d step count
    tp = {"model.0.weight": {"tp": S(0)}, "model.0.bias": {"tp": S(0)}}
    plan = md.mesh_fn(step_fn, placements=tp).compile(x, y, mesh=md.Mesh.from_string("tp=2"))
    types = {i.name: i.type for i in plan.inputs}
    assert types["model.0.weight.exp_avg"].placements == (S(0),)
    assert types["model.0.weight.step"].placements == (R,)


def test_weights_tied_across_pipeline_stages_are_refused():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16, bias=False)
            self.b = nn.Linear(16, 16, bias=False)

        def forward(self, x):
            with md.pipeline_stage(0):
                h = torch.tanh(self.a(x))
            with md.pipeline_stage(1):
                return F.linear(torch.tanh(self.b(h)), self.a.weight)

    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = md.mesh_fn(mse_step(model, opt))
    with pytest.raises(PlanError, match="weights shared across stages"):
        step.compile(*mse_batches(1)[0], mesh=md.Mesh.from_string("pp=2"))


def test_embedding_gradient_scaled_by_frequency_under_dp():
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(8, 16, scale_grad_by_freq=True), nn.Linear(16, 16))
        return model, torch.optim.SGD(model.parameters(), lr=0.5), mse_step

    g = torch.Generator().manual_seed(5)
    batches = [
        (torch.randint(0, 8, (8, 4), generator=g), torch.randn(8, 4, 16, generator=g))
        for _ in range(3)
    ]
    model, ref, losses, ref_losses, _ = simulate_training(make, batches=batches, **DP)
    _assert_parity(model, ref, losses, ref_losses)


def test_megatron_with_gelu_backward_matches():
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 16)
        )
        return model, torch.optim.SGD(model.parameters(), lr=0.1), mse_step

    model, ref, losses, ref_losses, _ = simulate_training(
        make, (("tp", 2),), mse_batches(), placements=MEGATRON_MLP
    )
    _assert_parity(model, ref, losses, ref_losses)


# ---- every kind of inserted collective, and where each comes from ----------------------------


@pytest.fixture(autouse=True)
def _from_the_repository_root(monkeypatch):
    """Every test of this module runs from the repository root: plans print the user's file
    relative to the working directory, and tests that read a ``loc`` as
    ``tests/test_compiler.py:<line>`` must hold wherever pytest was started."""
    monkeypatch.chdir(Path(__file__).parent.parent)


def _line_of(fn, text: str) -> int:
    """The line number, in ``fn``'s file, of the one line of ``fn``'s source that contains
    ``text``."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + k for k, line in enumerate(lines) if text in line]
    assert len(hits) == 1, f"{text!r} is on {len(hits)} lines of {fn.__qualname__}"
    return hits[0]


def _assert_loc(loc: str, fn, text: str) -> None:
    """``loc`` (a plan's ``file:line``, the file relative to the working directory) is
    ``fn``'s file, at the line of ``fn`` that contains ``text``."""
    path, _, line = loc.rpartition(":")
    assert Path(path).resolve() == Path(inspect.getsourcefile(fn)).resolve(), loc
    assert int(line) == _line_of(fn, text), f"{loc}: expected the line of {text!r}"


def _fmt(placements, dims) -> str:
    return "{" + ", ".join(f"{d}: {p}" for d, p in zip(dims, placements)) + "}"


def _run_simulated(fn, args, mesh, **options):
    """Compile ``fn`` for ``mesh`` (compiling runs ``plan.check()``), check that its text
    parses back exactly, and run it on the simulated mesh; returns the plan and the whole
    results."""
    from monarch_dsl.compiler.compile import compile_step

    plan, c = compile_step(fn, args, {}, mesh, **options)
    text = str(plan)
    assert Plan.parse(text) == plan and str(Plan.parse(text)) == text
    return plan, simulate_both(plan, c.input_values)[0]


def _made_by(plan, value):
    """The instruction whose first result is ``value``."""
    return next(ins for ins in plan.body if ins.outs and ins.outs[0] == value)


def test_zero_sharded_parameters_reduce_scatter_their_gradients():
    """ZeRO-like data parallel: every parameter sharded over dp. A gradient is the sum of the
    ranks' partial gradients, and the update needs only this rank's shard of it, so each is
    reduce-scattered (never all-reduced) for the optimizer's update."""
    zero = {f"model.{k}.{p}": {"dp": S(0)} for k in (0, 2) for p in ("weight", "bias")}
    model, ref, losses, ref_losses, plans = simulate_training(
        _mlp(), (("dp", 2),), mse_batches(), placements=zero, data_parallel="dp"
    )
    _assert_parity(model, ref, losses, ref_losses)
    plan = plans[0]
    # no gradient bucket (the reduce-scatters go out on comms as soon as their gradient is
    # ready; a parameter gathered whole is prefetched there)
    assert not [c for c in plan.collectives if c.stream == "comms" and c.kind == "all_reduce"]
    scattered = {c.value: c for c in plan.collectives if c.kind == "reduce_scatter"}
    updated = set()
    for ins in plan.body:
        if ins.op == "aten.add_.Tensor" and ins.args[0].name in zero:  # p.add_(grad, alpha=-lr)
            updated.add(ins.args[0].name)
            grad = ins.args[1].name
            c, rs = scattered[grad], _made_by(plan, grad)
            assert c.dims == ("dp",) and rs.kw("dim") == 0 and rs.kw("op") == "sum"
            assert c.reason == (
                "sharded gradient, as soon as it is ready: "
                f"{{dp: P(sum)}} -> {{dp: S(0)}} of %{rs.uses()[0]} for {ins.op}"
            )
            assert rs.stream == "comms"
            _assert_loc(c.loc, mse_step, "opt.step()")
    assert updated == set(zero)


ZERO_OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
]


@pytest.mark.parametrize("opt", ZERO_OPTIMIZERS, ids=["sgd", "adam", "adamw"])
@pytest.mark.parametrize(
    "mesh, micro_batches", [(DP["mesh"], 2), ((("dp", 2), ("pp", 2)), 4)], ids=["dp2", "dp2xpp2"]
)
def test_zero_sharded_parameters_with_micro_batches(opt, mesh, micro_batches):
    """ZeRO-like parameters with micro-batches: x is {dp: S(0), mb: S(0)} (mb the inner
    chunk) and the first matmul wants it {dp: R, mb: S(0)}: the micro-batches are joined, dp
    gathered, and the whole batch sliced into micro-batches again (a shard_local over mb, which
    was refused: "shard_local over micro-batches is not supported yet")."""
    if len(mesh) == 1:
        make, layers = _mlp(opt[0], **opt[1]), ("0", "2")
    else:
        make, layers = two_stages(opt[0], **opt[1]), ("first.0", "second")
    zero = {f"model.{k}.{p}": {"dp": S(0)} for k in layers for p in ("weight", "bias")}
    model, ref, losses, ref_losses, plans = simulate_training(
        make, mesh, mse_batches(), placements=zero, data_parallel="dp", micro_batches=micro_batches
    )
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.state_dict(), ref.state_dict(), **close)
    torch.testing.assert_close(losses, [loss.detach() for loss in ref_losses], **close)
    for plan in plans:
        plan.check()
        sliced = [ins for ins in plan.body if ins.reason.startswith("micro-batch 0 of %all_")]
        assert sliced and all(ins.op == "aten.slice.Tensor" for ins in sliced)


FOREACH_OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    (torch.optim.Adam, {"lr": 0.01, "foreach": True}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "foreach": True}),
]
FOREACH_MESHES = {
    "dp2": dict(mesh=DP["mesh"], data_parallel="dp"),
    "tp2": dict(mesh=(("tp", 2),), placements=MEGATRON_MLP),
    "pp2": dict(mesh=(("pp", 2),), micro_batches=2),
    "dp2xpp2": dict(mesh=(("dp", 2), ("pp", 2)), data_parallel="dp", micro_batches=4),
}


@pytest.mark.parametrize("opt", FOREACH_OPTIMIZERS, ids=["sgd-momentum", "adam", "adamw"])
@pytest.mark.parametrize("where", list(FOREACH_MESHES))
def test_foreach_optimizers_match_one_process(opt, where):
    """foreach=True: one multi-tensor op updates every parameter (``_foreach_add_([p0, p1,
    ...], ...)``). It was one instruction: on a pipeline all on one stage (stage 0's
    parameters never changed), with tp its sharded parameters' gathered copies were updated
    instead of them, and Adam/AdamW did not trace ("Expected scalars to be on CPU, got
    meta"). Traced as one op per tensor, each is placed, sharded and staged on its own."""
    options = dict(FOREACH_MESHES[where])
    mesh = options.pop("mesh")
    make = (two_stages if where.endswith("pp2") else _mlp)(opt[0], **opt[1])
    model, ref, losses, ref_losses, plans = simulate_training(make, mesh, mse_batches(), **options)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.state_dict(), ref.state_dict(), **close)
    torch.testing.assert_close(losses, [loss.detach() for loss in ref_losses], **close)
    for plan in plans:
        plan.check()
        assert not [ins.op for ins in plan.body if "_foreach_" in ins.op]
        if "pp" in dict(mesh):  # each parameter is updated on its own stage
            for ins in plan.body:
                if any(u.startswith("model.second.") for u in ins.uses()):
                    assert dict(ins.on)["pp"] == 1, ins
                if any(u.startswith("model.first.") for u in ins.uses()):
                    assert dict(ins.on)["pp"] == 0, ins


def test_a_foreach_op_writes_each_tensor_of_its_list(monkeypatch):
    """Were a foreach op left whole (tracing makes it one op per tensor), it writes in place
    every tensor of its first list: the compiler refuses what it cannot do with it instead of
    updating gathered copies or one stage's tensors, and a foreach path that does not trace
    says foreach=False."""
    from monarch_dsl.compiler import capture

    monkeypatch.setattr(capture, "_foreach_decompositions", lambda: {})
    x, y = mse_batches(1)[0]
    sgd = {"lr": 0.1, "foreach": True}
    cases = [
        (two_stages(**sgd), "pp=2", r"_foreach_add_\.List updates tensors of several pipeline"),
        (_mlp(**sgd), "tp=2", r"_foreach_add_\.List writes in place into %model\.0\.weight"),
        (_mlp(torch.optim.Adam, lr=0.01, foreach=True), "tp=2", "could not be traced"),
    ]
    for make, mesh, message in cases:
        model, opt, step_of = make()
        placements = MEGATRON_MLP if mesh == "tp=2" else None
        step = md.mesh_fn(step_of(model, opt), placements=placements)
        with pytest.raises(PlanError, match=message) as e:
            step.compile(x, y, mesh=md.Mesh.from_string(mesh))
        assert "foreach=False" in str(e.value) or "tp" in mesh
        _assert_loc(e.value.loc, mse_step, "opt.step()")


def _matmul(x, w):
    return x @ w  # the op the collectives below come from


def _tanh_matmul(x, w):
    return torch.tanh(x @ w)  # the op the collectives below come from


def test_partial_result_wanted_sharded_is_reduce_scattered():
    """Row-parallel matmul (contracting dim sharded over tp) with its result wanted
    Shard(1) over tp — and a batch sharded over dp, which it leaves alone."""
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    plan, outs = _run_simulated(
        _matmul,
        (x, w),
        (("dp", 2), ("tp", 2)),
        placements={"x": {"dp": S(0), "tp": S(1)}, "w": {"tp": S(0)}},
        out_placements={"out0": {"dp": S(0), "tp": S(1)}},
    )
    torch.testing.assert_close(outs[0], x @ w)
    [c] = plan.collectives
    assert (c.kind, c.dims, _made_by(plan, c.value).kw("dim")) == ("reduce_scatter", ("tp",), 1)
    assert c.reason == "{dp: S(0), tp: P(sum)} -> {dp: S(0), tp: S(1)} of %mm for the result out0"
    _assert_loc(c.loc, _matmul, "x @ w")
    assert plan.types()[c.value].placements == (S(0), S(1))


def test_result_wanted_sharded_on_another_dim_is_all_to_all():
    """A batch-sharded result wanted sharded along its features instead."""
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    plan, outs = _run_simulated(
        _tanh_matmul,
        (x, w),
        (("tp", 2),),
        placements={"x": {"tp": S(0)}},
        out_placements={"out0": {"tp": S(1)}},
    )
    torch.testing.assert_close(outs[0], torch.tanh(x @ w))
    [c] = plan.collectives
    a2a = _made_by(plan, c.value)
    assert (c.kind, c.dims) == ("all_to_all", ("tp",))
    assert (a2a.kw("split_dim"), a2a.kw("cat_dim")) == (1, 0)
    assert c.reason == "{tp: S(0)} -> {tp: S(1)} of %tanh for the result out0"
    _assert_loc(c.loc, _tanh_matmul, "x @ w")


DP_TP = (("dp", 2), ("tp", 2))


def test_all_to_all_onto_a_tensor_dim_another_mesh_dim_shards():
    """tanh(x @ w) is {dp: S(0), tp: S(1)}, the result is wanted {dp: S(1)}. Mesh dims shard
    a tensor dim left to right (dp's chunk outside tp's): an all_to_all over dp onto dim 1
    while tp still shards it would nest dp's chunks inside tp's and permute the values, so
    tp is gathered first."""
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    plan, outs = _run_simulated(
        _tanh_matmul,
        (x, w),
        DP_TP,
        placements={"x": {"dp": S(0)}, "w": {"tp": S(1)}},  # tanh(x @ w): {dp: S(0), tp: S(1)}
        out_placements={"out0": {"dp": S(1)}},
    )
    assert _redistributions(plan) == [("all_gather", "tp", 1), ("all_to_all", "dp", 1)]
    torch.testing.assert_close(outs[0], torch.tanh(x @ w))


def _redistributions(plan):
    """(op, mesh dim, tensor dim it gathers from or shards onto) of every redistribution."""
    dim = {"all_gather": "dim", "shard_local": "dim", "reduce_scatter": "dim"}
    return [
        (ins.op, ins.kw("dims")[0], ins.kw(dim.get(ins.op, "split_dim")))
        for ins in plan.body
        if ins.op in ("all_gather", "shard_local", "reduce_scatter", "all_to_all")
    ]


def _double(x):
    return x * 2  # the op the redistributions below come from


def _add(x, y):
    return x + y


@pytest.mark.parametrize(
    "given, wanted, steps",
    [
        # all_gather off the outer of two mesh dims sharding dim 0: the inner one first
        ({"dp": S(0), "tp": S(0)}, {"tp": S(0)}, ["ag tp 0", "ag dp 0", "sl tp 0"]),
        ({"dp": S(0), "tp": S(0)}, {}, ["ag tp 0", "ag dp 0"]),
        # a local chunk onto a dim an inner mesh dim shards: the inner one out of the way
        ({"tp": S(0)}, {"dp": S(0), "tp": S(0)}, ["ag tp 0", "sl dp 0", "sl tp 0"]),
        ({"dp": S(0)}, {"dp": S(0), "tp": S(0)}, ["sl tp 0"]),  # nests right as it is
        # all_to_all off a dim an inner mesh dim shards
        ({"dp": S(0), "tp": S(0)}, {"dp": S(1), "tp": S(0)}, ["ag tp 0", "a2a dp 1", "sl tp 0"]),
        # all_to_all onto a dim an inner mesh dim shards (the other way round: in one step)
        ({"dp": S(0), "tp": S(1)}, {"dp": S(1), "tp": S(0)}, ["ag dp 0", "a2a tp 0", "sl dp 1"]),
        ({"dp": S(0), "tp": S(0)}, {"dp": S(0), "tp": S(1)}, ["a2a tp 1"]),
    ],
)
def test_redistributing_a_tensor_dim_two_mesh_dims_shard(given, wanted, steps):
    x = torch.randn(8, 8)
    plan, outs = _run_simulated(
        _double, (x,), DP_TP, placements={"x": given}, out_placements={"out0": wanted}
    )
    short = {"all_gather": "ag", "shard_local": "sl", "all_to_all": "a2a"}
    assert [f"{short[op]} {d} {t}" for op, d, t in _redistributions(plan)] == steps
    torch.testing.assert_close(outs[0], x * 2)


@pytest.mark.parametrize("mesh", [DP_TP, DP_TP[::-1]], ids=["dp,tp", "tp,dp"])
def test_reduce_scatter_onto_a_tensor_dim_another_mesh_dim_shards(mesh):
    """x @ w is {dp: P(sum), tp: S(0)}, wanted {dp: S(0), tp: S(0)}. With dp left of tp, a
    reduce-scatter over dp would chunk inside tp's chunk: tp is gathered first, then sharded
    again. With tp left of dp, dp is the inner chunk: the reduce-scatter alone."""
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    plan, outs = _run_simulated(
        _matmul,
        (x, w),
        mesh,
        placements={"x": {"dp": S(1), "tp": S(0)}, "w": {"dp": S(0)}},
        out_placements={"out0": {"dp": S(0), "tp": S(0)}},
    )
    expected = [("reduce_scatter", "dp", 0)]
    if mesh == DP_TP:
        expected = [("all_gather", "tp", 0)] + expected + [("shard_local", "tp", 0)]
    assert _redistributions(plan) == expected
    assert [c.kind for c in plan.collectives] == [op for op, _, _ in expected[:2]]
    torch.testing.assert_close(outs[0], x @ w)


ONE_DIM = [R, S(0), S(1), Partial("sum")]


@pytest.mark.parametrize("given", [(a, b) for a in ONE_DIM for b in ONE_DIM], ids=str)
def test_every_redistribution_on_two_mesh_dims_keeps_the_values(given):
    """From every placement of x on dp x tp to every placement of the result: the values are
    the one-process ones (before: wrong, or a crash, wherever both dims shard one dim)."""
    x = torch.randn(8, 4)
    for wanted in [(a, b) for a in ONE_DIM[:3] for b in ONE_DIM[:3]]:
        _, outs = _run_simulated(
            _double,
            (x,),
            DP_TP,
            placements={"x": dict(zip(("dp", "tp"), given))},
            out_placements={"out0": dict(zip(("dp", "tp"), wanted))},
        )
        torch.testing.assert_close(outs[0], x * 2, msg=f"{given} -> {wanted}")


@pytest.mark.parametrize("wanted", [{}, {"dp": S(0)}])
def test_micro_batches_of_a_data_parallel_batch_are_joined_inner_first(wanted):
    """With micro-batches the batch is sharded over dp and, inside each dp shard, over the
    micro-batches: a per-sample result is joined over the micro-batches first."""
    x = torch.randn(8, 4)
    plan, outs = _run_simulated(
        _double,
        (x,),
        (("dp", 2),),
        data_parallel="dp",
        micro_batches=2,
        out_placements={"out0": wanted},
    )
    torch.testing.assert_close(outs[0], x * 2)


def test_nested_shards_that_do_not_divide_are_refused_or_avoided():
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    nested = {"dp": S(0), "tp": S(0)}  # dim 0 in 4 parts: 6 rows do not divide
    with pytest.raises(PlanError, match=r"'x': dim 0 \(size 6\).*product of their sizes \(4\)"):
        _run_simulated(_double, (a,), DP_TP, placements={"x": nested})
    with pytest.raises(PlanError, match="the result out0 needs") as e:
        _run_simulated(
            _double, (a,), DP_TP, placements={"x": {"dp": S(0)}}, out_placements={"out0": nested}
        )
    _assert_loc(e.value.loc, _double, "x * 2")
    # x + y with x {dp: S(0)} and y {tp: S(0)}: following x on tp too would split the 6 rows
    # in 4; the strategy search takes another way.
    plan, outs = _run_simulated(
        _add, (a, b), DP_TP, placements={"x": {"dp": S(0)}, "y": {"tp": S(0)}}
    )
    for t in plan.types().values():
        if t.shape == (6, 4):
            assert t.placements.count(S(0)) < 2, t
    torch.testing.assert_close(outs[0], a + b)


def _dp_plan():
    model, opt, step_of = _mlp()()
    step = md.mesh_fn(step_of(model, opt), data_parallel="dp")
    return step.compile(*mse_batches(1)[0], mesh=md.Mesh.from_string("dp=2"))


def _megatron_plan():
    model, opt, step_of = _mlp()()
    step = md.mesh_fn(step_of(model, opt), placements=MEGATRON_MLP)
    return step.compile(*mse_batches(1)[0], mesh=md.Mesh.from_string("tp=2"))


def _pipeline_plan():
    model, opt, step_of = two_stages_sgd()
    step = md.mesh_fn(step_of(model, opt), micro_batches=2)
    return step.compile(*mse_batches(1)[0], mesh=md.Mesh.from_string("pp=2"))


@pytest.mark.parametrize(
    "make,lines",
    [
        (_dp_plan, ["opt.step()"]),  # the gradient bucket (the loss's average rides in it)
        (_megatron_plan, ["loss = F.mse_loss"]),  # the row-parallel layer's output
    ],
    ids=["dp", "megatron-tp2"],
)
def test_each_collective_records_its_op_placement_change_and_user_line(make, lines):
    """``plan.collectives[i]``: ``.reason`` says which op needed which placement change (the
    change is the one between its input's and its result's types, the op is what reads the
    result), ``.loc`` is the step's line the collective comes from."""
    plan = make()
    types = plan.types()
    assert len(plan.collectives) == len(lines)
    for c, line in zip(plan.collectives, lines):
        _assert_loc(c.loc, mse_step, line)
        ins = _made_by(plan, c.value)
        srcs = ins.uses()
        if c.stream == "comms":  # gradients bucketed for the update: each made whole
            assert re.fullmatch(r"gradient bucket 1/1 \(\d+ tensors, [\d.]+ MiB\): .*", c.reason)
            grads, rider = c.reason.split("; and the step's result ")
            srcs, last = srcs[:-1], srcs[-1]  # (the loss rides last)
            assert rider.startswith(f"%{last} (") and types[last].placements == (Partial("avg"),)
            assert grads.endswith(
                f": {', '.join('%' + s for s in srcs)} made whole for the optimizer update"
            )
            assert all(types[s].placements == (Partial("sum"),) for s in srcs)
            assert all(t.placements == (R,) for t in ins.types)
            [loss] = [i for i in plan.body if i.uses() == [ins.outs[-1]]]
            assert loss.op == "aten.div.Tensor" and loss.outs[0] == plan.outputs[0].var
            _assert_loc(loss.loc, mse_step, "loss = F.mse_loss")
            continue
        change = f"{_fmt(types[srcs[0]].placements, plan.dims)} -> "
        change += f"{_fmt(ins.types[0].placements, plan.dims)} of %{srcs[0]} for "
        assert c.reason.startswith(change), (c.reason, change)
        reader = c.reason.removeprefix(change)
        if reader.startswith("the result "):
            assert any(o.name == reader.removeprefix("the result ") for o in plan.outputs)
        else:
            assert any(i.op == reader and c.value in i.uses() for i in plan.body), c.reason


def _with_collective_on_one_rank(plan):
    """Rank tp=0 issues the first all_reduce a second time: the bug of a collective under a
    branch on the rank."""
    k = next(i for i, ins in enumerate(plan.body) if ins.op == "all_reduce")
    a = plan.body[k]
    extra = replace(a, outs=(a.outs[0] + "_again",), on=(("tp", 0),))
    return plan.replace(body=plan.body[: k + 1] + (extra,) + plan.body[k + 1 :])


def _without(op, on):
    """The plan without its first ``op`` (send/recv) that runs ``on``."""

    def drop(plan):
        k = next(i for i, ins in enumerate(plan.body) if ins.op == op and ins.on == on)
        return plan.replace(body=plan.body[:k] + plan.body[k + 1 :])

    return drop


@pytest.mark.parametrize(
    "make,brk,fragment,where",
    [
        (
            _megatron_plan,
            _with_collective_on_one_rank,
            "issues this as its 2nd collective over ('tp',) on stream main, but rank (tp=1)",
            (mse_step, "loss = F.mse_loss"),
        ),
        (
            _pipeline_plan,
            _without("send", (("pp", 1),)),  # stage 1's first gradient for stage 0
            "the recv has no send",
            (mse_step, "loss.backward()"),
        ),
        (
            _pipeline_plan,
            _without("recv", (("pp", 1),)),  # stage 1's first activation from stage 0
            "which is never defined",
            (TwoStages.forward, "return self.second(h)"),
        ),
    ],
    ids=["collective-on-one-rank", "send-dropped", "recv-dropped"],
)
def test_broken_compiled_plan_fails_check_at_the_users_line(make, brk, fragment, where):
    """A real compiled plan, broken the way a wrong pass would break it: ``check()`` refuses
    it, naming the line of the step (or of the module it calls) the instruction came from."""
    plan = make()
    broken = brk(plan)
    assert Plan.parse(str(broken)) == broken  # still a well-formed plan, only wrong
    with pytest.raises(PlanError) as e:
        broken.check()
    assert fragment in str(e.value)
    _assert_loc(e.value.loc, *where)
    assert str(e.value).endswith(f"(at {e.value.loc})")


def test_a_scalar_constant_in_the_step_takes_the_workers_device():
    """A 0-dim constant tensor in the step becomes ``aten.scalar_tensor`` with a device that
    each worker replaces by its own (cuda:i on GPUs: ``cat`` with a CPU tensor would fail)."""

    def f(x):
        return torch.cat([x, torch.tensor(3.0).expand(4, 1)], 1)

    x = torch.randn(4, 2)
    plan, out = _run_simulated(f, (x,), (("dp", 2),), data_parallel="dp")
    (const,) = [i for i in plan.body if i.op == "aten.scalar_tensor.default"]
    assert dict(const.kwargs)["device"] == torch.device("cpu")
    assert torch.equal(out[0], f(x))


def test_detach_and_a_transpose_back_are_no_steps_of_the_lowered_program():
    """A training step's plan has detaches (autograd's, the optimizer's) and weight gradients
    as ``t(t(mm))``; the program the workers and the simulator run has no detach, no
    transpose of a transpose, no view nobody uses, and fewer slots (the left-out results are
    their values' slots). (The values: every training test here runs lowered programs.)"""
    from monarch_dsl.compiler.lower import _aliases, lower, slot_numbers
    from monarch_dsl.compiler.simulate import slot_types

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = md.mesh_fn(mse_step(model, opt), data_parallel="dp")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    plan = step.compile(x, y, mesh=md.Mesh.from_string("dp=2"))
    alias = _aliases(plan)
    ops = {i.outs[0]: i.op for i in plan.body if i.outs}
    assert {ops[o] for o in alias} == {"aten.detach.default", "aten.transpose.int"}
    program = lower(plan)
    names = [getattr(s, "name", "") for s in program.steps]
    assert "aten.detach.default" not in names
    assert names.count("aten.transpose.int") < [i.op for i in plan.body].count(
        "aten.transpose.int"
    ) - sum(ops[o] == "aten.transpose.int" for o in alias)  # (inner ones unused: gone too)
    slots, n = slot_numbers(plan)
    assert n == program.n_slots == len(slot_types(plan))
    assert n == len(plan.inputs) + sum(len(i.outs) for i in plan.body) - len(alias)
    for name, value in alias.items():
        assert slots[name] == slots[value] and value not in alias


def test_a_step_finds_the_modules_and_optimizers_its_helper_functions_use():
    """A step that calls the user's helpers reaches their modules and optimizers too (as
    state to keep on the workers); a name taken by another object gets its function's name."""
    from monarch_dsl.compiler.capture import used_objects

    model, head = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def update():
        opt.step()

    def make_helper(model):  # its closure's "model": the same name, another module
        def other_model(x):
            return model(x).sum()

        return other_model

    other_model = make_helper(head)

    def step(x):
        loss = model(x).sum() + other_model(x)
        loss.backward()
        update()
        return loss

    modules, optimizers = used_objects(step)
    assert modules == {"model": model, "other_model_model": head}
    assert optimizers == {"opt": opt}
    assert used_objects(F.mse_loss) == ({}, {})  # (torch's own functions are not looked into)


# ---- optimizer settings as plan inputs (compiler/hyper.py) ----------------------------------


def _settings_case(opt_cls, module=None, **opt_kwargs):
    torch.manual_seed(0)
    model = module() if module else nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    ref = copy.deepcopy(model)
    opt, ref_opt = (
        opt_cls(model.parameters(), **opt_kwargs),
        opt_cls(ref.parameters(), **opt_kwargs),
    )
    return model, ref, opt, ref_opt


@pytest.mark.parametrize(
    "opt_cls, opt_kwargs, lifted, layout",
    [
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3), ["lr", "momentum"], "dp"),
        (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1), ["lr", ("betas", 0)], "dp"),
        (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5), ["lr"], "dp"),
        (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1), ["lr"], "pp"),
    ],
)
def test_a_scheduled_setting_is_an_input_of_one_plan_that_follows_it(
    opt_cls, opt_kwargs, lifted, layout
):
    """One plan, compiled with the learning rate (and momentum / beta1) as inputs of kind
    hyper, runs three steps of a per-step schedule on a dp=2 mesh, or a 2-stage pipeline with
    2 micro-batches (one input read on both stages), through both executors: the same
    parameters as one-process torch with the scheduler changing the settings at every step."""
    from monarch_dsl.compiler.compile import compile_step
    from monarch_dsl.compiler.hyper import Hyper, current

    module = TwoStages if layout == "pp" else None
    model, ref, opt, ref_opt = _settings_case(opt_cls, module, **opt_kwargs)
    fn, ref_fn = mse_step(model, opt), mse_step(ref, ref_opt)
    batches = mse_batches(4)
    fn(*batches[0]), ref_fn(*batches[0])  # the state exists (Adam's moments, momentum)
    hypers = tuple(
        Hyper("opt", 0, k) if isinstance(k, str) else Hyper("opt", 0, *k) for k in lifted
    )

    def schedule(o, step):
        g = o.param_groups[0]
        g["lr"] = opt_kwargs["lr"] * (0.5 + 0.25 * step)
        if "momentum" in lifted:
            g["momentum"] = 0.9 - 0.1 * step
        if ("betas", 0) in lifted:
            g["betas"] = (0.9 - 0.05 * step, g["betas"][1])

    if layout == "pp":
        options = dict(micro_batches=2)
    else:
        options = dict(data_parallel="dp")
    plan, c = compile_step(fn, batches[1], {}, ((layout, 2),), lift=hypers, **options)
    assert c.not_lifted == "" and c.lifted
    assert Plan.parse(str(plan)) == plan and "# hyper" in str(plan)
    kinds = [i.kind for i in plan.inputs]
    values = list(c.input_values)
    for step, (x, y) in enumerate(batches[1:], start=1):
        schedule(opt, step), schedule(ref_opt, step)
        now = current(c.hypers, {"opt": opt})
        values[:2] = [x, y]
        lifted_values = iter(c.lifted)
        for k, kind in enumerate(kinds):
            if kind == "hyper":
                lift = next(lifted_values)
                values[k] = torch.tensor(lift.value(now), dtype=lift.dtype)
        _, values = simulate_both(plan, values)
        ref_fn(x, y)
    want = dict(ref.named_parameters())
    got = {
        i.name.removeprefix("model."): v for i, v in zip(plan.inputs, values) if i.kind == "param"
    }
    assert got.keys() == want.keys()
    for name, a in got.items():
        torch.testing.assert_close(a, want[name], atol=1e-6, rtol=1e-5, msg=name)


def test_settings_that_cannot_be_inputs_stay_constants_and_say_why():
    """Lifting is refused, with the step traced as before: where the step's own code reads
    the setting (it could clamp it: no trace can tell), for an optimizer not known to use
    its settings linearly (a subclass may override step()), and where a constant is not a
    linear function of it (Adam's first step folds lr / (1 - beta1))."""
    from monarch_dsl.compiler.hyper import Hyper, capture_lifted

    x, y = mse_batches(1)[0]
    lr = Hyper("opt", 0, "lr")
    model, _, opt, _ = _settings_case(torch.optim.SGD, lr=0.1)

    def reads_it(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * min(opt.param_groups[0]["lr"], 1.0)
        loss.backward()
        opt.step()
        return loss

    c, why = capture_lifted(reads_it, (x, y), {}, [lr])
    assert f"{__file__}:" in why and not c.lifted and "hyper" not in c.input_kinds
    assert opt.param_groups[0]["lr"] == 0.1 and type(opt.param_groups[0]) is dict  # put back

    class MySGD(torch.optim.SGD):
        pass

    model, _, opt, _ = _settings_case(MySGD, lr=0.1)
    c, why = capture_lifted(mse_step(model, opt), (x, y), {}, [lr])
    assert "MySGD, not one of torch.optim's" in why and not c.lifted

    model, _, opt, _ = _settings_case(torch.optim.Adam, lr=0.01)
    beta1 = Hyper("opt", 0, "betas", 0)
    c, why = capture_lifted(mse_step(model, opt), (x, y), {}, [lr, beta1])
    assert "not a linear function" in why and not c.lifted
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)

    # AdamW's decay 1 - lr * wd with both lifted, at usual values: it misses the linear fit
    # by 0.05 * lr * wd (7.5e-7), far below 1e-6 of the constant, but not of how it moved.
    model, _, opt, _ = _settings_case(torch.optim.AdamW, lr=3e-4, weight_decay=0.05)
    fn = mse_step(model, opt)
    fn(x, y)
    c, why = capture_lifted(fn, (x, y), {}, [lr, Hyper("opt", 0, "weight_decay")])
    assert "not a linear function" in why and not c.lifted
    c, why = capture_lifted(fn, (x, y), {}, [lr])  # lr alone: 1 - lr * 0.05 is
    assert why == "" and c.lifted

    # Copies a trace cannot vary: a parameter group kept from before, a scheduler's
    # get_last_lr(). They were read at their first value in every trace, so no constant
    # differed, and the plan kept it.
    model, _, opt, _ = _settings_case(torch.optim.SGD, lr=0.1)
    group = opt.param_groups[0]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e))

    def kept_group(x, y):
        opt.zero_grad()
        (F.mse_loss(model(x), y) * (1 + group["lr"])).backward()
        opt.step()

    def scheduler(x, y):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            model[0].weight.mul_(1 - sched.get_last_lr()[0] * 0.5)

    for fn, held in ((kept_group, "group: a parameter group"), (scheduler, "sched: an LR")):
        c, why = capture_lifted(fn, (x, y), {}, [lr])
        assert held in why and not c.lifted, why


def test_a_lifted_setting_of_half_precision_parameters_keeps_float32():
    """A number an arithmetic op takes is read at float32 for bfloat16 tensors: the input
    that stands for it is float32 too (a bfloat16 input would round the rate itself)."""
    from monarch_dsl.compiler.hyper import Hyper, capture_lifted

    torch.manual_seed(0)
    model = nn.Linear(16, 16).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0111)
    x, y = (t.to(torch.bfloat16) for t in mse_batches(1)[0])
    c, why = capture_lifted(mse_step(model, opt), (x, y), {}, [Hyper("opt", 0, "lr")])
    assert why == "" and [lift.dtype for lift in c.lifted] == [torch.float32]


def test_the_settings_key_knows_which_parameters_each_group_has():
    """Of a lifted setting the key holds only its sign: groups swapped (each with its own
    rate) must still miss the cache, or each rate would update the other group's parameters."""
    from monarch_dsl.compiler.hyper import Hyper
    from monarch_dsl.mesh_fn import _settings_key

    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.SGD(
        [{"params": a.parameters(), "lr": 0.1}, {"params": b.parameters()}], lr=0.2
    )
    lifted = (Hyper("opt", 0, "lr"), Hyper("opt", 1, "lr"))
    before = _settings_key({}, {"opt": opt}, lifted)
    opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = 0.05, 0.07
    assert _settings_key({}, {"opt": opt}, lifted) == before  # rates: inputs of the plan
    opt.param_groups.reverse()
    assert _settings_key({}, {"opt": opt}, lifted) != before
