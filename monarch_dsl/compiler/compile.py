"""The pass pipeline: capture → plan → propagate (+ insert) → pipeline → schedule → check.

Each pass is its own module (``Plan -> Plan``, recorded in ``plan.passes``); this file only
strings them together and turns the user's placement spec into per-input placements.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from monarch_dsl.compiler.capture import Captured, capture, to_plan, used_objects
from monarch_dsl.compiler.hyper import capture_lifted
from monarch_dsl.compiler.plan import Placement, Plan, PlanError, Replicate, Shard, record_pass
from monarch_dsl.compiler.propagate import propagate

R = Replicate()


def arg_leaf_names(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor leaf of the arguments, named as the plan names its
    inputs: the parameter's name, or ``name.i`` for the i-th leaf of a pytree."""
    import inspect

    import torch.utils._pytree as pytree

    bound = inspect.signature(fn).bind(*args, **kwargs)
    out: list[tuple[str, torch.Tensor]] = []
    for pname, value in bound.arguments.items():
        for i, leaf in enumerate(pytree.tree_flatten(value)[0]):
            if isinstance(leaf, torch.Tensor):
                out.append((pname if leaf is value else f"{pname}.{i}", leaf))
    return out


def normalize_placements(
    spec: dict[str, Any] | None,
    dims: tuple[str, ...],
    known: list[str],
    data_parallel: str | None,
    arg_names: list[str],
) -> dict[str, tuple[Placement, ...]]:
    """``{"x": {"dp": Shard(0)}, "w": Replicate()}`` → ``{"x": (S(0), R, ...)}``; names are
    the function's arguments (``x``, or ``x.0`` for a pytree's leaves: a spec for ``x``
    applies to all its leaves) and the qualified names of the parameters it uses."""
    out: dict[str, tuple[Placement, ...]] = {}
    if data_parallel is not None:
        if data_parallel not in dims:
            raise ValueError(
                f"data_parallel={data_parallel!r} is not a dim of the mesh (dims {dims})"
            )
        for a in arg_names:
            out[a] = tuple(Shard(0) if d == data_parallel else R for d in dims)
    for name, value in (spec or {}).items():
        # An argument's name covers its pytree leaves (x.0, x.1); a parameter's name is exact
        # (its optimizer state, "<param>.exp_avg", follows it by shape instead).
        targets = [
            k
            for k in known
            if k == name or (k.startswith(name + ".") and k[len(name) + 1 :].isdigit())
        ]
        if not targets:
            raise ValueError(
                f"placements: {name!r} is not an argument or a parameter of the step "
                f"(known: {', '.join(known[:12])}{', ...' if len(known) > 12 else ''})"
            )
        if isinstance(value, Placement):
            pl = tuple(value for _ in dims)
        elif isinstance(value, dict):
            for d, p in value.items():
                if d not in dims:
                    raise ValueError(
                        f"placements[{name!r}]: {d!r} is not a dim of the mesh (dims {dims})"
                    )
                if not isinstance(p, Placement):
                    raise TypeError(
                        f"placements[{name!r}][{d!r}]: expected md.Shard(d), md.Replicate() or "
                        f"md.Partial(op), got {p!r}"
                    )
            pl = tuple(value.get(d, R) for d in dims)
        else:
            raise TypeError(
                f"placements[{name!r}]: expected a placement or {{dim: placement}}, got {value!r}"
            )
        for t in targets:
            out[t] = pl
    return out


def state_placements(
    captured: Captured, given: dict[str, tuple[Placement, ...]], ndims: int
) -> dict[str, tuple[Placement, ...]]:
    """Optimizer state and gradients follow their parameter when they have its shape."""
    out = dict(given)
    shapes = {n: tuple(v.shape) for n, v in zip(captured.input_names, captured.input_values)}
    for name, kind in zip(captured.input_names, captured.input_kinds):
        if kind == "state" and name not in out:
            param = name.rpartition(".")[0]
            if param in out and shapes.get(param) == shapes[name]:
                out[name] = out[param]
            else:
                out[name] = (R,) * ndims
    return out


FULLY_SHARD = "_md_fully_shard"  # the mesh dim md.fully_shard set on a parameter
RESHARD = "_md_reshard_after_forward"  # md.fully_shard's reshard_after_forward, on a parameter


def fully_sharded(
    fn: Callable[..., Any],
    captured: Captured,
    given: dict[str, tuple[Placement, ...]],
    mesh: tuple[tuple[str, int], ...],
    explicit: dict[str, Any] | None,
) -> tuple[dict[str, str], set[str]]:
    """{parameter: mesh dim} of the parameters ``md.fully_shard`` marked, now laid out
    ``Shard(0)`` over that dim in ``given`` (unless ``placements=`` names them, or dim 0 does
    not divide by the dim's size: those stay as they are, whole); and those of them kept
    gathered from the forward to the backward pass (``reshard_after_forward=False``)."""
    dims = [d for d, _ in mesh]
    sizes = dict(mesh)
    modules, _ = used_objects(fn)
    marked: dict[str, str] = {}
    kept: set[str] = set()
    for mname, mod in modules.items():
        for pname, p in mod.named_parameters():
            dim = getattr(p, FULLY_SHARD, None)
            if dim is not None:
                marked.setdefault(f"{mname}.{pname}", dim)
                if not getattr(p, RESHARD, True):
                    kept.add(f"{mname}.{pname}")
    shapes = {n: tuple(v.shape) for n, v in zip(captured.input_names, captured.input_values)}
    out: dict[str, str] = {}
    for name, dim in marked.items():
        shape = shapes.get(name)
        if dim not in sizes or shape is None or name in (explicit or {}):
            continue
        if not shape or shape[0] % sizes[dim]:
            continue
        pl = list(given.get(name, (R,) * len(dims)))
        m = dims.index(dim)
        if not pl[m].is_replicate() and pl[m] != Shard(0):
            continue
        pl[m] = Shard(0)
        given[name] = tuple(pl)
        out[name] = dim
    return out, kept & set(out)


def _whole_on_size_one(
    given: dict[str, tuple[Placement, ...]],
    gather: dict[str, str],
    mesh: tuple[tuple[str, int], ...],
) -> tuple[dict[str, tuple[Placement, ...]], dict[str, str]]:
    """A mesh dim of size 1 splits nothing: a shard of the value over it, or a partial sum, is
    the whole value. Laid out whole (``Replicate``) along such dims, the inputs need no
    communication there (a one-GPU mesh's step has none; shards would be all-gathered over one
    rank)."""
    ones = [size == 1 for _, size in mesh]
    if not any(ones):
        return given, gather
    whole = {k: tuple(R if one else p for one, p in zip(ones, v)) for k, v in given.items()}
    sizes = dict(mesh)
    return whole, {k: d for k, d in gather.items() if sizes[d] > 1}


def compile_step(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mesh: tuple[tuple[str, int], ...],
    placements: dict[str, Any] | None = None,
    data_parallel: str | None = None,
    out_placements: dict[str, Any] | None = None,
    state: dict[str, torch.Tensor] | None = None,
    state_placement: dict[str, tuple[Placement, ...]] | None = None,
    values: dict[str, torch.Tensor] | None = None,
    bucket_cap_mb: float = 25,
    name: str | None = None,
    micro_batches: int = 1,
    pipeline_dim: str = "pp",
    lift: tuple[Any, ...] = (),
) -> tuple[Plan, Captured]:
    """Compile ``fn`` for ``mesh`` (((dim, size), ...)) on these example arguments.

    ``micro_batches`` > 1: the batch arguments (dim 0) are split into that many micro-batches
    run one after the other (GPipe over the ``pipeline_dim`` stages, if the mesh has it), their
    gradients accumulated before the update. ``lift``: optimizer settings (``hyper.Hyper``) to
    take in as inputs of kind ``hyper`` rather than as constants, where they can be
    (``captured.not_lifted`` says why not)."""
    from monarch_dsl.compiler.pipeline import MB, microbatch, split_stages
    from monarch_dsl.compiler.schedule import schedule

    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if micro_batches > 1:
        if MB in (d for d, _ in mesh):
            raise ValueError(f"the mesh dim name {MB!r} is reserved for micro-batches")
        mesh = tuple(mesh) + ((MB, micro_batches),)
    dims = tuple(d for d, _ in mesh)
    t0 = time.perf_counter()
    if lift:
        captured, why = capture_lifted(fn, args, kwargs, lift, state=state, values=values)
        captured.not_lifted = why
    else:
        captured = capture(fn, args, kwargs, state=state, values=values)
    plan = record_pass(to_plan(captured, mesh, name or fn.__name__), "capture", t0)
    arg_names = [n for n, k in zip(captured.input_names, captured.input_kinds) if k == "arg"]
    real_dims = tuple(d for d in dims if d != MB)
    given = normalize_placements(
        placements, real_dims, captured.input_names, data_parallel, arg_names
    )
    if micro_batches > 1:  # batch arguments split along dim 0, the rest whole
        mb = dims.index(MB)
        given = {k: tuple(v[:mb]) + (R,) + tuple(v[mb:]) for k, v in given.items()}
        for a in arg_names:
            pl = list(given.get(a, (R,) * len(dims)))
            pl[mb] = Shard(0)
            given[a] = tuple(pl)
        state_placement = {
            k: tuple(v[:mb]) + (R,) + tuple(v[mb:]) for k, v in (state_placement or {}).items()
        }
    given.update(state_placement or {})
    gather, kept = fully_sharded(fn, captured, given, mesh, placements)
    given = state_placements(captured, given, len(dims))
    for n, k in zip(captured.input_names, captured.input_kinds):
        if k == "hyper":  # the same value on every rank
            given[n] = (R,) * len(dims)
    outs = None
    if out_placements:
        out_names = [o for o, k in zip(captured.output_names, captured.output_kinds) if k == "out"]
        outs = normalize_placements(out_placements, real_dims, out_names, None, [])
    if outs and micro_batches > 1:
        mb = dims.index(MB)
        outs = {k: tuple(v[:mb]) + (R,) + tuple(v[mb:]) for k, v in outs.items()}
    given, gather = _whole_on_size_one(given, gather, mesh)
    plan = propagate(
        plan, given, outs, pipeline_dim=pipeline_dim, gather=gather, kept_gathered=kept
    )
    plan = microbatch(plan)
    plan = split_stages(plan, pipeline_dim)
    plan = schedule(plan, bucket_cap_mb=bucket_cap_mb)
    t0 = time.perf_counter()
    plan.check()
    plan = record_pass(plan, "check", t0)
    return plan, captured


__all__ = ["compile_step", "normalize_placements", "PlanError"]
