"""Run a program on every rank of a mesh inside this process (no workers, no sockets).

Ranks run in lockstep, one step at a time, and collectives are computed from all the ranks'
values directly. Tests use it to check that a compiled plan computes what the function
computes on one device; the multi-process runtime runs the very same ``Program``.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from typing import Any

import torch

from monarch_dsl import isa
from monarch_dsl.compiler.lower import core_steps, resolve, run_step, shard_local, shard_view
from monarch_dsl.compiler.plan import Partial, Placement, Plan, Replicate, Shard, TensorType
from monarch_dsl.isa import Program, Slot, collectives
from monarch_dsl.mesh import all_coords, coords_of_index


def local_value(
    value: torch.Tensor, t: TensorType, coords: tuple[int, ...], sizes: tuple[int, ...]
) -> Any:
    """Rank ``coords``'s part of the whole ``value`` laid out as ``t.placements``."""
    return local_part(value, t.placements, coords, sizes)


def local_part(
    value: Any, placements: tuple[Placement, ...], coords: tuple[int, ...], sizes: tuple[int, ...]
) -> Any:
    """``local_value`` by the placements alone: a tensor of its own (one copy, contiguous)."""
    cuts, zeros = shard_cuts(placements, coords, sizes)
    out = value
    for dim, index, n in cuts:
        out = shard_view(out, dim, index, n)
    if zeros:
        out = torch.zeros_like(out)
    if not isinstance(out, torch.Tensor):
        return out
    return out.clone(memory_format=torch.contiguous_format)


def sent_rows(t: TensorType, sizes: tuple[int, ...]) -> list[tuple[int, int]] | None:
    """For a local argument of whole type ``t`` on a mesh of ``sizes``, where each rank is
    sent its own part: that part as a range of whole rows ``(start, stop)``, ranks in index
    order (``coords_of_index``). None where it is sent whole: some rank's part is not a run
    of rows (a shard of another dim, a ``Partial``'s zeros), every rank's is the whole
    (nothing sharded), or its rows are empty."""
    if not t.shape or not math.prod(t.shape):
        return None
    index = torch.arange(t.shape[0])
    out = []
    for i in range(math.prod(sizes)):
        cuts, zeros = shard_cuts(t.placements, coords_of_index(i, sizes), sizes)
        if zeros or not cuts or any(dim != 0 for dim, _, _ in cuts):
            return None
        part = index
        for dim, k, n in cuts:
            part = shard_view(part, dim, k, n)
        start = int(part[0]) if len(part) else 0
        out.append((start, start + len(part)))
    return out


def shard_cuts(
    placements: tuple[Placement, ...], coords: tuple[int, ...], sizes: tuple[int, ...]
) -> tuple[list[tuple[int, int, int]], bool]:
    """How rank ``coords``'s part of a whole laid out as ``placements`` is cut out of it:
    (dim, index, n) per ``Shard``, in mesh dim order (``shard_view``'s arguments), and whether
    it is zeros (a ``Partial`` sum holds the whole on the first rank of its dim only)."""
    cuts, zeros = [], False
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            cuts.append((p.dim, coords[m], sizes[m]))
        elif isinstance(p, Partial) and p.op == "sum" and coords[m] != 0:
            zeros = True
    return cuts, zeros


def whole_value(parts: dict[tuple[int, ...], Any], t: TensorType, sizes: tuple[int, ...]) -> Any:
    """The whole value from every rank's part (shards joined, partials reduced)."""
    if t.shape is None:
        return parts[next(iter(parts))]
    cur = dict(parts)
    for m in reversed(range(len(sizes))):
        p = t.placements[m]
        merged: dict[tuple[int, ...], Any] = {}
        for c in {k[:m] + k[m + 1 :] for k in cur}:
            group = [cur[c[:m] + (i,) + c[m:]] for i in range(sizes[m])]
            if all(g is None for g in group):  # a pipeline stage's value, on another stage
                merged[c] = None
            elif isinstance(p, Shard):
                merged[c] = torch.cat(group, p.dim)
            elif isinstance(p, Partial):
                merged[c] = collectives.reduce_values(group, p.op)
            else:  # whole everywhere; a pipeline stage's value exists on its stage only
                merged[c] = next((g for g in group if g is not None), None)
        cur = merged
    return cur[()]


@torch.no_grad()  # (as on workers: a bucket of gradients must not join an autograd graph)
def run_program(
    program: Program, inputs: dict[tuple[int, ...], list[Any]], core: Any = None
) -> dict[tuple[int, ...], list[Any]]:
    """Run ``program`` on every rank: ``inputs[coords]`` are that rank's input values; returns
    each rank's output values. ``core``: the C++ runtime module, to run the compute steps in
    its ``Program`` (as workers do) instead of in Python."""
    sizes = program.sizes
    ranks = all_coords(sizes)
    if core is not None:
        compiled = core.CompiledPlan(core_steps(program, None, None), Slot)
        envs = {c: core.Env(program.n_slots) for c in ranks}
    else:
        envs = {c: [None] * program.n_slots for c in ranks}
    for c in ranks:
        for slot, v in zip(program.inputs, inputs[c]):
            envs[c][slot] = v
    # (sender, receiver) -> the values sent, in order
    mail: dict[tuple[tuple[int, ...], tuple[int, ...]], deque[torch.Tensor]] = defaultdict(deque)
    for k, step in enumerate(program.steps):
        active = [c for c in ranks if step.runs_on(c)]
        if isinstance(step, isa.COLLECTIVES):
            for group in groups(active, step.dims):
                made = [
                    collectives.of_step(step, [resolve(a, envs[c]) for a in step.args], len(group))
                    for c in group
                ]
                for c, result in zip(group, collectives.run_together(made), strict=True):
                    outs = result if isinstance(step, isa.AllReduce) else [result]
                    for slot, v in zip(step.outs, outs, strict=True):
                        envs[c][slot] = v
        elif isinstance(step, isa.Send):
            d = step.dims[0]
            for c in active:
                to = c[:d] + (step.peer,) + c[d + 1 :]
                mail[(c, to)].append(resolve(step.args[0], envs[c]).clone())
        elif isinstance(step, isa.Recv):
            d = step.dims[0]
            for c in active:
                frm = c[:d] + (step.peer,) + c[d + 1 :]
                envs[c][step.outs[0]] = mail[(frm, c)].popleft()
        elif isinstance(step, isa.ShardLocal):
            d = step.dims[0]
            for c in active:
                v = resolve(step.args[0], envs[c])
                envs[c][step.outs[0]] = shard_local(v, step.dim, c[d], sizes[d])
        elif isinstance(step, isa.PartialLocal):
            d = step.dims[0]
            for c in active:
                v = resolve(step.args[0], envs[c])
                keep = step.reduce != "sum" or c[d] == 0
                envs[c][step.outs[0]] = v if keep else torch.zeros_like(v)
        elif not isinstance(step, isa.Compute):
            raise TypeError(f"the interpreter has no handler for {type(step).__name__}")
        elif core is not None:
            for c in active:
                failed = compiled.run(envs[c], k, k + 1)
                if failed >= 0:
                    raise RuntimeError(f"{step.op} at {step.loc}: {compiled.last_error()}")
            continue  # (the C++ program freed what the step was the last use of)
        else:
            for c in active:
                run_step(step, envs[c])
        for c in active:
            for s in step.frees:
                envs[c][s] = None
    return {c: [envs[c][s] for s in program.outputs] for c in ranks}


def groups(active: list[tuple[int, ...]], dims: tuple[int, ...]) -> list[list[tuple[int, ...]]]:
    """The groups a collective over mesh dims ``dims`` (indices) forms among the ranks
    ``active`` that run it: those that agree on every other coordinate (each sorted)."""
    by_rest: dict[tuple[int, ...], list[tuple[int, ...]]] = defaultdict(list)
    for c in active:
        rest = tuple(x for i, x in enumerate(c) if i not in dims)
        by_rest[rest].append(c)
    return [sorted(g) for g in by_rest.values()]


def simulate_values(
    plan: Plan, program: Program, values: list[Any], core: Any = None
) -> tuple[list[Any], list[Any]]:
    """Run ``plan`` on whole input ``values`` (in input order): shards each input by its
    placement, runs every rank, and joins each output by its placement. Returns the whole
    outputs and the whole inputs after the run (a training step updates them in place)."""
    sizes = plan.sizes
    ranks = all_coords(sizes)
    inputs = {
        c: [local_value(v, i.type, c, sizes) for v, i in zip(values, plan.inputs)] for c in ranks
    }
    outs = run_program(program, inputs, core)
    types = plan.types()
    result = []
    for k, o in enumerate(plan.outputs):
        result.append(whole_value({c: outs[c][k] for c in ranks}, types[o.var], sizes))
    # An input updated in place by a pipeline stage: that stage's copy is the new value.
    home: dict[str, tuple[tuple[str, int], ...]] = {}  # value -> its first on-filtered use's on
    for ins in plan.body:
        for u in ins.uses():
            if u not in home and ins.on:
                home[u] = ins.on
    index = {d: k for k, d in enumerate(plan.dims)}
    after = []
    for k, i in enumerate(plan.inputs):
        on = home.get(i.name, ())
        parts = {c: inputs[c][k] if all(c[index[d]] == v for d, v in on) else None for c in ranks}
        after.append(whole_value(parts, i.type, sizes))
    return result, after


__all__ = [
    "run_program",
    "groups",
    "simulate_values",
    "local_value",
    "local_part",
    "shard_cuts",
    "whole_value",
    "Replicate",
]
