"""Printed plans, compared with golden files (tests/golden/*.plan).

After an intended change to the compiler's output: `pytest tests/test_golden.py
--update-golden`, then review the diff of tests/golden/ like code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import monarch_dsl as md

GOLDEN = Path(__file__).parent / "golden"
S = md.Shard


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def dp_mlp_step() -> md.Plan:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @md.mesh_fn(data_parallel="dp")
    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step.compile(torch.randn(8, 16), torch.randn(8, 16), mesh=md.Mesh.from_string("dp=2"))


def megatron_mlp_tp2() -> md.Plan:
    mlp = _mlp()
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
    return step.compile(x, torch.randn(8, 16), mesh=md.Mesh.from_string("tp=2"))


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


def pipeline_2_stages() -> md.Plan:
    torch.manual_seed(0)
    model = TwoStages()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @md.mesh_fn(micro_batches=2)
    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step.compile(torch.randn(8, 16), torch.randn(8, 16), mesh=md.Mesh.from_string("pp=2"))


CASES = {f.__name__: f for f in (dp_mlp_step, megatron_mlp_tp2, pipeline_2_stages)}
# Plans print the user's file relative to the working directory (as a reader at the shell
# wants it), so the cases compile from the repository root wherever pytest was started. (New
# lines go below the cases: the goldens name the cases' lines.)
REPO = Path(__file__).parent.parent


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_plan(name, request, monkeypatch):
    monkeypatch.chdir(REPO)
    plan = CASES[name]()
    text = str(plan)
    # Deterministic: compiling the same step again prints the very same text.
    assert str(CASES[name]()) == text
    # Two forms, one truth: the text parses back to an equal plan that prints the same.
    parsed = md.Plan.parse(text)
    assert parsed == plan
    assert str(parsed) == text
    path = GOLDEN / f"{name}.plan"
    if request.config.getoption("--update-golden"):
        path.write_text(text + "\n")
        return
    assert path.exists(), f"no golden file {path}: run pytest {__file__} --update-golden"
    want = path.read_text().rstrip("\n")
    assert text == want, f"{name}: the printed plan differs from {path} (see the diff above)"
    plan.check()
