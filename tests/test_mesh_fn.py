"""Compiled steps on real workers (gloo): the plan is sent once, then run by every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import monarch_dsl as md

pytestmark = pytest.mark.procs
S = md.Shard


@pytest.fixture(scope="module")
def pm():
    mesh = md.this_host().spawn_procs({"dp": 2, "tp": 2})
    try:
        yield mesh
    finally:
        mesh.stop()


def _train(model, opt, batches):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _batches(n=3):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("layout", ["dp", "dp+tp"])
def test_compiled_training_matches_one_process(pm, layout):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    placements = None
    if layout == "dp+tp":
        placements = {
            "model.0.weight": {"tp": S(0)},
            "model.0.bias": {"tp": S(0)},
            "model.2.weight": {"tp": S(1)},
        }

    @md.mesh_fn(data_parallel="dp", placements=placements)
    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    batches = _batches()
    with pm.activate():
        losses = [step(x, y) for x, y in batches]
        got = [md.inspect(loss).item() for loss in losses]
        # Replicated result: every rank holds the whole value.
        assert md.inspect(losses[-1], dp=1, tp=1).item() == pytest.approx(got[-1])
    step.pull()
    want = _train(ref, ref_opt, batches)
    assert got == pytest.approx(want, abs=1e-5)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"parameter {name}")
    # The first call compiled with fresh optimizer state, the second with the state the first
    # left on the workers; the third reused the second's plan.
    assert step.compiles == 2


def test_failed_step_fails_its_results_and_leaves_workers_usable(pm):
    model = nn.Linear(16, 16)

    @md.mesh_fn(data_parallel="dp", placements={"idx": md.Replicate()})
    def step(x, idx):
        return model(x)[:, 0] + torch.index_select(x, 1, idx).sum(1)

    x = torch.randn(8, 16)
    with pm.activate():
        bad = step(x, torch.tensor([99]))  # index out of range on the workers
        with pytest.raises(md.RemoteError, match="index"):
            md.inspect(bad)
        good = step(x, torch.tensor([1]))
        torch.testing.assert_close(md.inspect(good), model(x)[:, 0] + x[:, 1])
        # A mesh tensor argument is each rank's part: [4, 16] per rank is a [8, 16] batch.
        part = torch.ones(4, 16)
        out = step(part, torch.tensor([1]))
        assert md.inspect(out).shape == (8,)


class TwoStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.second = nn.Linear(32, 16)

    def forward(self, x):
        with md.pipeline_stage(0):
            h = self.first(x)
        with md.pipeline_stage(1):
            return self.second(h)


def test_pipeline_on_workers(pm):
    """dp=2 x pp=2 (the fixture's tp dim is the pipeline dim here), 4 micro-batches."""
    torch.manual_seed(0)
    model = TwoStages()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pipe = pm.rename(tp="pp")

    @md.mesh_fn(data_parallel="dp", micro_batches=4)
    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    batches = _batches()
    with pipe.activate():
        losses = [step(x, y) for x, y in batches]
        got = [md.inspect(loss).item() for loss in losses]  # from the last stage's ranks
        assert losses[0].mesh.sizes == {"dp": 2}
    step.pull()
    assert got == pytest.approx(_train(ref, ref_opt, batches), abs=1e-5)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"parameter {name}")


def test_plan_is_sent_once_then_only_run(pm, monkeypatch):
    from monarch_dsl.compiler import ir
    from monarch_dsl.tensor import Engine

    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @md.mesh_fn(data_parallel="dp")
    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    sent = []
    real = Engine.append
    monkeypatch.setattr(
        Engine, "append", lambda self, m, ins: (sent.append(ins), real(self, m, ins))[1]
    )
    x, y = _batches(1)[0]
    with pm.activate():
        for _ in range(5):
            loss = step(x, y)
        md.inspect(loss)
    kinds = [type(i).__name__ for i in sent]
    # Two plans (before and after the optimizer has state), each defined once; five runs.
    assert kinds.count("DefinePlan") == 2 and kinds.count("RunPlan") == 5
    assert all(not isinstance(i, ir.CallOp) or i.op == "aten::_to_copy.default" for i in sent)
