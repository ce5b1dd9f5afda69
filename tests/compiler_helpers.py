"""Shared by the compiler tests: train a model with a compiled step in the in-process mesh
simulation and with plain torch, and compare."""

from __future__ import annotations

import copy
import inspect

import torch

from monarch_dsl import _build
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
        program = lower(plan)
        values = [v.clone() for v in c.input_values]
        outs, after = simulate_values(plan, program, c.input_values)
        # Differential: the C++ runtime's compute gives the very same values.
        cpp_outs, cpp_after = simulate_values(plan, program, values, core=_build.load(build=False))
        for a, b in zip(outs + after, cpp_outs + cpp_after):
            assert torch.equal(a, b), "the C++ executor differs from the reference executor"
        write_back(c, outs, after, {"model": model}, [opt])
        losses.append(outs[0])
        ref_losses.append(ref_fn(x, y))
    return model, ref_model, losses, ref_losses, plans
