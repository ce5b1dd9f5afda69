"""Gradient reduction in a data-parallel pipeline (pure: no processes): with micro-batches, each
gradient is accumulated over the micro-batches first and all-reduced once over ``dp``, in
buckets per stage on the ``comms`` stream; the loss is reduced once."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import monarch_dsl as md

sys.path.insert(0, str(Path(__file__).parent))
from compiler_helpers import (  # noqa: E402
    mse_batches,
    mse_step,
    simulate_both,
    simulate_training,
    two_stages,
    two_stages_sgd,
)

MESH = (("dp", 2), ("pp", 2))
STAGE0, STAGE1 = (("pp", 0),), (("pp", 1),)
TINY = 1e-5  # MiB: about 10 bytes, less than any gradient here (the smallest is 64 bytes)


def _compile(bucket_cap_mb: float) -> md.Plan:
    model, opt, step_of = two_stages_sgd()
    step = md.mesh_fn(
        step_of(model, opt), data_parallel="dp", micro_batches=4, bucket_cap_mb=bucket_cap_mb
    )
    x, y = mse_batches(1)[0]
    return step.compile(x, y, mesh=md.Mesh.from_string("dp=2,pp=2"))


def _all_reduces(plan: md.Plan) -> tuple[list, list]:
    """(gradient all-reduces, the loss's), as instructions. The loss's all-reduce rides in
    the last stage's gradient bucket (summed, then divided: the loss's instruction is that
    division): the bucket is given here without it."""
    [out0] = [o.var for o in plan.outputs if o.name == "out0"]
    [loss] = [ins for ins in plan.body if out0 in ins.outs]
    riders = set(loss.uses()) if loss.op == "aten.div.Tensor" else set()
    grads = []
    for ins in plan.body:
        if ins.op != "all_reduce" or ins is loss:
            continue
        keep = [k for k, o in enumerate(ins.outs) if o not in riders]
        grads.append(
            dataclasses.replace(
                ins,
                outs=tuple(ins.outs[k] for k in keep),
                args=tuple(ins.args[k] for k in keep),
                types=tuple(ins.types[k] for k in keep),
                reason=ins.reason.split("; and the step's result")[0],
            )
        )
    return grads, [loss]


def test_one_bucket_per_stage_on_the_comms_stream():
    plan = _compile(25)
    grads, loss = _all_reduces(plan)
    # Was: 16 gradient all-reduces (one per parameter and micro-batch) and 4 for the loss, all
    # on the main stream. Now each stage's two gradients go in one bucket, the loss in one.
    assert len(grads) == 2
    assert sorted(ins.on for ins in grads) == [STAGE0, STAGE1]
    for ins in grads:
        assert ins.stream == "comms" and ins.kw("dims") == ("dp",) and ins.kw("op") == "sum"
        assert len(ins.outs) == 2 and "gradient bucket" in ins.reason
    # One value per parameter, each its micro-batches' sum: nothing is reduced per micro-batch.
    assert sorted(o for ins in grads for o in ins.outs) == sorted(
        o.var for o in plan.outputs if o.kind == "grad"
    )
    assert not any(".mb" in v.name for ins in grads for v in ins.args)
    # The loss's average rides in the last stage's bucket: summed there, divided after.
    assert len(loss) == 1 and loss[0].on == STAGE1 and loss[0].op == "aten.div.Tensor"
    [bucket1] = [ins for ins in plan.body if ins.stream == "comms" and ins.on == STAGE1]
    assert bucket1.outs[-1] == loss[0].uses()[0] and "the step's result" in bucket1.reason
    # Overlap: the last stage's bucket is issued before the first stage's backward is done.
    body = plan.body
    bucket1 = next(i for i, ins in enumerate(body) if ins.stream == "comms" and ins.on == STAGE1)
    last_mm0 = max(
        i for i, ins in enumerate(body) if ins.op == "aten.mm.default" and ins.on == STAGE0
    )
    assert bucket1 < last_mm0
    plan.check()


def test_tiny_buckets_one_all_reduce_per_parameter():
    grads, loss = _all_reduces(_compile(TINY))
    assert len(grads) == 4 and all(len(ins.outs) == 1 for ins in grads)
    assert [ins.on for ins in grads].count(STAGE0) == 2
    # Each on the comms stream as soon as its gradient is accumulated, except the first
    # layer's weight: its last micro-batch's contribution is the last thing the backward pass
    # computes and the first thing the update needs, so there is nothing to overlap it with.
    on_main = [ins for ins in grads if ins.stream == "main"]
    assert [ins.on for ins in on_main] == [STAGE0]
    assert [ins.types[0].shape for ins in on_main] == [(32, 16)]
    assert len(loss) == 1


@pytest.mark.parametrize("bucket_cap_mb", [25, TINY], ids=["default", "tiny"])
def test_parity_with_one_process(bucket_cap_mb):
    model, ref, losses, ref_losses, plans = simulate_training(
        two_stages_sgd,
        MESH,
        mse_batches(),
        micro_batches=4,
        data_parallel="dp",
        bucket_cap_mb=bucket_cap_mb,
    )
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"parameter {name}")
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)
    for plan in plans:
        plan.check()
        assert any(ins.stream == "comms" for ins in plan.body)


# ---- Adam and AdamW on a pipeline: each parameter's optimizer state (exp_avg, exp_avg_sq, the
# step counter) is made on its parameter's stage ------------------------------------------------


@pytest.mark.parametrize("opt_type", [torch.optim.Adam, torch.optim.AdamW], ids=["adam", "adamw"])
@pytest.mark.parametrize("mesh, dp", [((("pp", 2),), None), (MESH, "dp")], ids=["pp2", "dp2xpp2"])
def test_adam_parity_with_one_process(opt_type, mesh, dp):
    model, ref, losses, ref_losses, plans = simulate_training(
        two_stages(opt_type, lr=0.01), mesh, mse_batches(), micro_batches=4, data_parallel=dp
    )
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.state_dict(), ref.state_dict(), **close)
    torch.testing.assert_close(losses, [loss.detach() for loss in ref_losses], **close)
    for plan in plans:
        plan.check()
        # The second layer's update and all its state live on stage 1 only: the stage-1
        # parameters are read nowhere else.
        for ins in plan.body:
            if any(u.startswith("model.second.") for u in ins.uses()):
                assert dict(ins.on)["pp"] == 1, ins
        # Only activations and their gradients cross stages (four micro-batches each way).
        assert sum(ins.op == "send" for ins in plan.body) == 8


def test_weight_shared_across_stages_is_refused():
    """A parameter genuinely read on two stages and updated on one is still refused."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            with md.pipeline_stage(0):
                h = torch.relu(self.lin(x))
            with md.pipeline_stage(1):
                return self.lin(h)

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = md.mesh_fn(mse_step(model, opt), micro_batches=4)
    x, y = mse_batches(1)[0]
    with pytest.raises(md.PlanError, match="used on pipeline stages \\[0, 1\\]"):
        step.compile(x, y, mesh=md.Mesh.from_string("pp=2"))


def test_bucket_reason_names_the_placement_change_and_the_reading_ops():
    """Like every other collective's reason: which placement change, for which ops (here
    Adam's, which read each gradient twice: exp_avg's lerp_ and exp_avg_sq's addcmul_)."""
    model, opt, step_of = two_stages(torch.optim.Adam, lr=0.01)()
    step = md.mesh_fn(step_of(model, opt), data_parallel="dp", micro_batches=4)
    x, y = mse_batches(1)[0]
    plan = step.compile(x, y, mesh=md.Mesh.from_string("dp=2,pp=2"))
    grads, _ = _all_reduces(plan)
    assert len(grads) == 2
    for ins in grads:
        srcs = ", ".join("%" + v for v in ins.uses())
        ops = [[r.op for r in plan.body if o in r.uses()] for o in ins.outs]
        assert all(found == ["aten.lerp_.Scalar", "aten.addcmul_.default"] for found in ops)
        assert ins.reason.endswith(
            "(2 tensors, 0.00 MiB): {dp: P(sum), pp: R} -> {dp: R, pp: R} for "
            f"aten.lerp_.Scalar, aten.addcmul_.default: {srcs} made whole for the optimizer "
            "update"
        ), ins.reason


# ---- ordering the micro-batches' instructions: writes in place into shared storage ------------


def _no_rule_then_relu_(lin):
    def step(x):
        h = lin(x)
        c = torch.cumsum(h.detach(), 0)[-1]  # no rule: joined over the micro-batches (a cat)
        h.relu_()  # in place, after c was taken
        return (h.sum(0) + c).sum()

    return step


def _add_through_alias(lin):
    def step(x):
        h = lin(x)
        d = h.detach()
        c = torch.cumsum(d, 0)[-1]
        h.add_(c)  # waits for c, so for every micro-batch
        return ((d * 2).sum(0) + c).sum()  # d shares h's storage: it reads the sum

    return step


def _write_through_a_view(lin):
    def step(x):
        h = lin(x).detach()
        v = h.view(-1)
        s = torch.cumsum(v.view(h.shape), 0)[-1]  # reads h through views, waits for all
        v.mul_(3)  # writes h, after s was taken
        return (h.sum(0) + s).sum()

    return step


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize(
    "make",
    [_no_rule_then_relu_, _add_through_alias, _write_through_a_view],
    ids=["write-after-read", "read-after-write", "through-a-view"],
)
@pytest.mark.parametrize("dp", [1, 2])
def test_micro_batches_keep_the_order_of_writes_in_place(make, micro_batches, dp):
    """An instruction that waits for every micro-batch (a cat of their copies) ran after a
    micro-batch's write in place into the storage it reads, because ordering only waited
    for inputs to be defined (write-after-read: 32.54 instead of 17.06); a read of an alias
    could likewise run before the write it comes after. Now a write waits for the earlier
    reads of its storage and a read for the earlier write, aliases included."""
    from monarch_dsl.compiler.compile import compile_step

    torch.manual_seed(0)
    step = make(torch.nn.Linear(16, 16))
    x = torch.randn(8, 16)
    with pytest.warns(UserWarning, match="no sharding rule for aten.cumsum"):
        plan, c = compile_step(
            step, (x,), {}, (("dp", dp),), data_parallel="dp", micro_batches=micro_batches
        )
    out = simulate_both(plan, c.input_values)[0][0]
    torch.testing.assert_close(out, step(x).detach(), atol=1e-4, rtol=1e-5)


def test_ordering_a_deep_pipeline_is_fast():
    """24 layers on 4 stages, 8 micro-batches, Adam: the micro-batching pass (ordering
    included) stays far under a second."""

    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(24))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                with md.pipeline_stage(i // 6):
                    x = torch.relu(layer(x))
            return x

    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = md.mesh_fn(mse_step(model, opt), data_parallel="dp", micro_batches=8)
    x, y = mse_batches(1, (64, 32))[0]
    plan = step.compile(x, y, mesh=md.Mesh.from_string("dp=2,pp=4"))
    [unrolled] = [p for p in plan.passes if p.name == "microbatch"]
    assert len(unrolled.plan.body) > 4000 and unrolled.seconds < 1.0, unrolled.seconds


def test_gradients_summed_over_micro_batches_as_each_part_is_made():
    """A gradient's micro-batch parts are folded into a running sum, each as soon as it is
    made (before the next micro-batch's part exists): two copies of a gradient are alive at a
    time, not all M (nor a stack of them)."""
    plan = _compile(25)
    body = plan.body
    assert not any(ins.op == "aten.stack.default" for ins in body)
    made = {o: i for i, ins in enumerate(body) for o in ins.outs}
    grads, _ = _all_reduces(plan)
    summed = [v.name for ins in grads for v in ins.args]  # each gradient's sum, per bucket
    assert len(summed) == 4
    for total in summed:
        chain, value = [], total  # walk the running sum back to micro-batch 0's part
        while True:
            ins = body[made[value]]
            assert ins.op == "aten.add.Tensor" and "micro-batches of" in ins.reason, ins
            acc, part = (a.name for a in ins.args)
            chain.append((made[value], part))
            if acc.endswith(".mb0"):
                break
            value = acc
        chain.reverse()
        assert [p.rsplit(".mb", 1)[1] for _, p in chain] == ["1", "2", "3"], total
        for k, (at, part) in enumerate(chain):
            assert made[part] < at  # added once made ...
            if k + 1 < len(chain):  # ... and before the next micro-batch's part is made
                assert at < made[chain[k + 1][1]], (total, part)
    plan.check()
