"""md.fully_shard: parameters, gradients and optimizer state Shard(0) over dp in compiled steps;
each parameter gathered for use (prefetched on the comms stream) and gathered again for the
backward pass (reshard_after_forward), each gradient reduce-scattered as soon as it is ready,
one in flight at a time; values match unsharded training (simulated in process through both
executors, and on workers), and each rank holds half of the state."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from compiler_helpers import TwoStages, mse_batches, mse_step, simulate_training  # noqa: E402

import monarch_dsl as md
from monarch_dsl import isa
from monarch_dsl.compiler.lower import lower

S = md.Shard


def _sharded_mlp(opt_cls=torch.optim.SGD, **kwargs):
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        md.fully_shard(model)
        return model, opt_cls(model.parameters(), **(kwargs or {"lr": 0.1})), mse_step

    return make


def _trained_like_one_process(make, mesh=(("dp", 2),), **options):
    """Three steps of ``make``'s model compiled over ``mesh`` (data parallel over dp,
    simulated): its parameters and losses match plain torch's. Returns the model and the
    plans."""
    model, ref, losses, ref_losses, plans = simulate_training(
        make, mesh, mse_batches(), data_parallel="dp", **options
    )
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)
    return model, plans


@pytest.mark.parametrize(
    "opt_cls, kwargs",
    [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.AdamW, {"lr": 0.01})],
)
def test_fully_sharded_training_matches_one_process(opt_cls, kwargs):
    model, plans = _trained_like_one_process(_sharded_mlp(opt_cls, **kwargs))
    plan = plans[-1].check()  # (SGD's momentum buffers are inputs from the second step on)
    params = [n for n, _ in model.named_parameters()]
    for i in plan.inputs:
        if i.kind in ("param", "state") and i.type.shape:  # (a 0-dim step count is whole)
            assert i.type.placements == (S(0),), (i.name, i.type)
    gathers = [c for c in plan.collectives if c.kind == "all_gather"]
    scatters = [c for c in plan.collectives if c.kind == "reduce_scatter"]
    # every parameter gathered once (prefetched on comms), every gradient reduce-scattered
    assert len(gathers) == len(params) and all(c.stream == "comms" for c in gathers)
    assert all("prefetched parameter" in c.reason for c in gathers)
    assert len(scatters) == len(params)
    # those the update reads go out on comms as soon as their gradient is ready (one that only
    # makes the .grad kept after the step stays at the end)
    read = [c for c in scatters if "for the gradient" not in c.reason]
    assert all(c.stream == "comms" and "as soon as it is ready" in c.reason for c in read)
    if opt_cls is torch.optim.AdamW:
        assert len(read) == len(params)
    assert not any(c.kind == "all_reduce" and "gradient" in c.reason for c in plan.collectives)
    # the next parameter's gather is issued before the current one is used
    body = plan.plan.body if hasattr(plan, "plan") else plan.body
    order = [k for k, ins in enumerate(body) if ins.op == "all_gather"]
    first_use = {}
    for k, ins in enumerate(body):
        for u in ins.uses():
            first_use.setdefault(u, k)
    assert order[1] < first_use[body[order[0]].outs[0]] + 1


def _deep_mlp(reshard=True, opt_cls=torch.optim.SGD, middle=2, **kwargs):
    """Linear(16, 32), ``middle`` x Linear(32, 32), Linear(32, 16): the middle layers' weights
    are read again in the backward pass."""

    def make():
        torch.manual_seed(0)
        layers = [nn.Linear(16, 32), nn.GELU()]
        for _ in range(middle):
            layers += [nn.Linear(32, 32), nn.GELU()]
        model = nn.Sequential(*layers, nn.Linear(32, 16))
        for layer in model:  # FSDP2's pattern: each layer, then the model
            if isinstance(layer, nn.Linear):
                md.fully_shard(layer, reshard_after_forward=reshard)
        md.fully_shard(model)
        return model, opt_cls(model.parameters(), **(kwargs or {"lr": 0.1})), mse_step

    return make


@pytest.mark.parametrize(
    "opt_cls, kwargs",
    [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.AdamW, {"lr": 0.01})],
)
def test_the_backward_pass_gathers_parameters_again(opt_cls, kwargs):
    _, plans = _trained_like_one_process(_deep_mlp(True, opt_cls, **kwargs))
    plan = plans[-1]
    again = [c for c in plan.collectives if "gathered again for the backward" in c.reason]
    # the weights of the two middle layers (their inputs' gradients need them; the first
    # layer's input needs none; the last layer's stay gathered: backward starts with them)
    assert sorted(c.reason.split("of %")[1].split()[0] for c in again) == [
        "model.2.weight",
        "model.4.weight",
    ]
    assert all(c.stream == "comms" and "prefetched" in c.reason for c in again)
    body = plan.body
    at = {ins.outs[0]: k for k, ins in enumerate(body) if ins.outs}
    for c in again:  # the forward's gather of that weight is no longer read in backward
        gathered = [
            ins.outs[0]
            for ins in body
            if ins.op == "all_gather" and ins.uses() == [c.reason.split("of %")[1].split()[0]]
        ]
        forward, backward = sorted(gathered, key=at.__getitem__)
        readers = [k for k, ins in enumerate(body) if forward in ins.uses()]
        assert max(readers) < at[backward], (forward, backward)
    remade = [ins for ins in body if "remade" in (ins.reason or "")]
    assert len(remade) == 2 and all(ins.op == "aten.transpose.int" for ins in remade)


def test_with_reshard_after_forward_the_peak_does_not_grow_with_depth():
    peaks, gathers = {}, {}
    for reshard in (True, False):
        for middle in (2, 6):
            *_, plans = simulate_training(
                _deep_mlp(reshard, middle=middle), (("dp", 2),), mse_batches(2, (2, 16)),
                steps=2, data_parallel="dp",
            )  # fmt: skip
            report = plans[-1].simulate(profile="h100")
            peaks[reshard, middle] = report.peak_memory[0] - report.resident_memory[0]
            gathers[reshard, middle] = sum(c.kind == "all_gather" for c in plans[-1].collectives)
    # each middle weight gathered again (reshard_after_forward=False: once)
    assert gathers == {(True, 2): 10, (True, 6): 22, (False, 2): 8, (False, 6): 16}
    weight = 32 * 32 * 4  # (the activations, 1 x 32 per rank, are small beside it)
    # kept: every middle weight is held whole at the turn from forward to backward, so 4 more
    # layers peak 4 weights higher
    assert peaks[False, 6] - peaks[False, 2] >= 4 * weight, peaks
    # resharded: only the weights in use and prefetched are held whole, however deep the
    # model; what grows is the sharded gradients, half a weight per layer on each rank
    assert peaks[True, 6] - peaks[True, 2] < 4 * weight / 2 + 1024, peaks
    assert peaks[True, 6] < peaks[False, 6] - 2 * weight, peaks


def test_one_reduce_scatter_in_flight_frees_each_whole_gradient_early():
    model, _, _, _, plans = simulate_training(
        _sharded_mlp(torch.optim.AdamW, lr=0.01), (("dp", 2),), mse_batches(), data_parallel="dp"
    )
    program = lower(plans[-1])
    settles = isa.settles(program)
    scatters = [k for k, s in enumerate(program.steps) if isinstance(s, isa.ReduceScatter)]
    assert len(scatters) == 4
    for a, b in zip(scatters, scatters[1:]):  # each one waits for the one before
        assert program.steps[a].outs[0] in settles[b]
        assert program.steps[a].outs[0] not in program.steps[b].uses()
    assert all(set(settles[k]) == set(s.uses()) for k, s in enumerate(program.steps)
               if k not in scatters[1:])  # fmt: skip


def test_fully_sharded_pipeline_stages_match_one_process():
    """pp=2 x dp=2 with micro-batches: each stage's parameters sharded over its dp ranks."""

    def make():
        torch.manual_seed(0)
        model = md.fully_shard(TwoStages())
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), mse_step

    _, plans = _trained_like_one_process(make, (("pp", 2), ("dp", 2)), micro_batches=2)
    dp = plans[-1].dims.index("dp")
    params = [i for i in plans[-1].inputs if i.kind == "param"]
    assert params and all(i.type.placements[dp] == S(0) for i in params), params


def test_a_parameter_that_does_not_divide_stays_whole():
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 15))  # 15 rows
        md.fully_shard(model)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), mse_step

    batches = [(x, y[:, :15]) for x, y in mse_batches()]
    model, ref, *_, plans = simulate_training(make, (("dp", 2),), batches, data_parallel="dp")
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    types = {i.name: i.type for i in plans[0].inputs}
    assert types["model.0.weight"].placements == (S(0),)
    assert types["model.2.weight"].placements == (md.Replicate(),)


def test_fully_shard_checks_its_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        md.fully_shard(torch.zeros(2))
    model = nn.Linear(4, 4)
    assert md.fully_shard(model) is model
    with pytest.raises(ValueError, match="already fully sharded over 'dp'"):
        md.fully_shard(model, dim="fsdp")
    with pytest.raises(KeyError, match="'dp'"):
        md.fully_shard(nn.Linear(4, 4), mesh=md.Mesh.from_string("tp=2"))
    with pytest.raises(TypeError, match="reshard_after_forward must be True or False"):
        md.fully_shard(nn.Linear(4, 4), reshard_after_forward=2)

    class DeviceMesh:  # (torch's, as FSDP2 takes it: what a user moving over passes)
        mesh_dim_names = ("dp",)

    with pytest.raises(TypeError, match=r"mesh: monarch_dsl meshes replace .* not a DeviceMesh"):
        md.fully_shard(nn.Linear(4, 4), mesh=DeviceMesh())


@pytest.mark.procs
def test_on_workers_each_rank_holds_half_the_state():
    local = _deep_mlp(middle=1)()[0]  # (its middle weight gathered again in backward)
    ref = _deep_mlp(middle=1)()[0]
    opt = torch.optim.AdamW(local.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    step = md.mesh_fn(data_parallel="dp")(mse_step(local, opt))
    batches = mse_batches()
    pm = md.this_host().spawn_procs({"dp": 2})
    try:
        with pm.activate():
            losses = [md.inspect(step(x, y)) for x, y in batches]
            held = {
                name: [tuple(md.inspect(h, dp=r).shape) for r in range(2)]
                for name, (h, t, kind) in step.state.items()
            }
        step.pull()
    finally:
        pm.stop()
    for x, y in batches:
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for a, b in zip(local.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    whole = {f"model.{n}": p for n, p in local.named_parameters()}
    checked = 0
    for name, shapes in held.items():
        base = whole.get(name, whole.get(name.rpartition(".")[0]))
        if base is None or name.endswith(".step"):
            continue
        # parameters, their gradients and their AdamW moments: half of dim 0 on each rank
        assert shapes == [(base.shape[0] // 2, *base.shape[1:])] * 2, (name, shapes)
        checked += 1
    assert checked >= 3 * len(whole), held  # param, exp_avg, exp_avg_sq (and grad) of each
    assert len(losses) == 3
