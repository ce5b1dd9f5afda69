"""Shared by the compiler tests: train a model with a compiled step in the in-process mesh
simulation and with plain torch, and compare."""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

import monarch_dsl as md
from monarch_dsl import _core
from monarch_dsl.compiler.compile import compile_step
from monarch_dsl.compiler.interpret import simulate_values
from monarch_dsl.compiler.lower import lower
from monarch_dsl.compiler.plan import Plan


def write_back(captured, outs, after, modules, optimizers) -> None:
    """Put a simulated step's results into the local modules and optimizers."""
    named = {}
    for mname, mod in modules.items():
        for pname, p in mod.named_parameters():
            named[f"{mname}.{pname}"] = p
        for bname, b in mod.named_buffers():
            named[f"{mname}.{bname}"] = b
    with torch.no_grad():
        for name, kind, v in zip(captured.input_names, captured.input_kinds, after):
            if kind in ("param", "buffer"):
                named[name].copy_(v)
        for oname, kind, v in zip(captured.output_names, captured.output_kinds, outs):
            if kind == "state":
                pname, _, key = oname.rpartition(".")
                for opt in optimizers:
                    if any(named[pname] is q for g in opt.param_groups for q in g["params"]):
                        opt.state[named[pname]][key] = v.clone()
            elif kind == "grad":
                named[oname.removesuffix(".grad")].grad = v.clone()


def simulate_training(make, mesh, batches, steps=3, **options):
    """``make()`` -> (model, optimizer, step_of(model, opt) -> fn(x, y)). Trains one copy
    compiled for ``mesh`` (((dim, size), ...); simulated in this process, ``options`` as for
    ``@md.mesh_fn``) and one in plain torch; returns both models, the losses of both and the
    plans."""
    model, opt, step_of = make()
    ref_model = copy.deepcopy(model)
    accepted = inspect.signature(type(opt)).parameters
    ref_opt = type(opt)(
        ref_model.parameters(), **{k: v for k, v in opt.defaults.items() if k in accepted}
    )
    fn, ref_fn = step_of(model, opt), step_of(ref_model, ref_opt)
    losses, ref_losses, plans = [], [], []
    for i in range(steps):
        x, y = batches[i]
        plan, c = compile_step(fn, (x, y), {}, mesh, **options)
        text = str(plan)  # every compiled plan prints and parses back exactly
        assert Plan.parse(text) == plan and str(Plan.parse(text)) == text
        plans.append(plan)
        outs, after = simulate_both(plan, c.input_values)
        write_back(c, outs, after, {"model": model}, [opt])
        losses.append(outs[0])
        ref_losses.append(ref_fn(x, y))
    return model, ref_model, losses, ref_losses, plans


def simulate_both(plan, values: list) -> tuple[list, list]:
    """``simulate_values`` of ``plan`` on ``values`` with the Python reference executor's
    compute and, differentially, with the C++ runtime's (on copies): the two must give the
    very same outputs and updated inputs. Returns the reference's (``values`` updated)."""
    program = lower(plan)
    copies = [v.clone() if isinstance(v, torch.Tensor) else v for v in values]
    outs, after = simulate_values(plan, program, values)
    cpp_outs, cpp_after = simulate_values(plan, program, copies, core=_core.require())
    for a, b in zip(outs + after, cpp_outs + cpp_after, strict=True):
        assert torch.equal(a, b), "the C++ executor differs from the reference executor"
    return outs, after


# ---- models and steps shared by the simulated (test_compiler.py) and worker (test_mesh_fn.py)
# parity tests ----------------------------------------------------------------------------------


def mse_step(model, opt):
    """A training step: one optimizer step on the mean squared error; returns the loss."""

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def cross_entropy_step(model, opt):
    """A training step for a [batch, seq, classes] output and [batch, seq] class targets."""

    def step(x, y):
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss

    return step


# Megatron placements of ``nn.Sequential(Linear(16, 32), GELU(), Linear(32, 16))`` (named
# ``model`` in the step): column parallel, then row parallel.
MEGATRON_MLP = {
    "model.0.weight": {"tp": md.Shard(0)},
    "model.0.bias": {"tp": md.Shard(0)},
    "model.2.weight": {"tp": md.Shard(1)},
}


class TwoStages(nn.Module):
    """A two-stage pipeline: ``Linear + ReLU`` on stage 0, ``Linear`` on stage 1."""

    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.second = nn.Linear(32, 16)

    def forward(self, x):
        with md.pipeline_stage(0):
            h = self.first(x)
        with md.pipeline_stage(1):
            return self.second(h)


def two_stages(opt_cls=torch.optim.SGD, **opt_kwargs):
    """A ``make`` for ``simulate_training``: a seeded ``TwoStages``, ``opt_cls(**opt_kwargs)``
    (``lr=0.1`` when none are given), and ``mse_step``."""

    def make():
        torch.manual_seed(0)
        model = TwoStages()
        return model, opt_cls(model.parameters(), **(opt_kwargs or {"lr": 0.1})), mse_step

    return make


two_stages_sgd = two_stages(torch.optim.SGD, lr=0.1, momentum=0.9)  # SGD with momentum


def mse_batches(n=3, shape=(8, 16)):
    """``n`` (x, y) batches of ``shape`` (seeded) for ``mse_step``."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)) for _ in range(n)]


class Block(nn.Module):
    """A transformer block: attention + MLP + layer norms."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = F.softmax((q @ k.transpose(-2, -1)) * (d // h) ** -0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def block_batches(n=3, seed=2):
    """``n`` (x [4, 8, 16], class targets [4, 8]) batches for ``Block``."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 8, 16, generator=g), torch.randint(0, 16, (4, 8), generator=g))
        for _ in range(n)
    ]
