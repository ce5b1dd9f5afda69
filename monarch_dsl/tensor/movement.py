"""Data onto and across meshes: ``md.to_mesh`` (local data copied to every rank, or mesh
tensors moved to another mesh), ``md.reduce`` / ``md.reduce_`` over a pytree, and the
per-rank placements ``md.distribute`` builds on."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from monarch_dsl import isa
from monarch_dsl.frames import user_line
from monarch_dsl.runtime.messages import RunBatch
from monarch_dsl.runtime.serialize import snapshot
from monarch_dsl.tensor.active import check_usable, current_stream
from monarch_dsl.tensor.engine import Engine
from monarch_dsl.tensor.handle import KNOWN_MAX_NUMEL, Tensor, reduce_tensor


def lift(value: torch.Tensor, mesh: Any) -> Tensor:
    """A local tensor (``torch.tensor(data)`` under activation) copied to every rank."""
    engine = Engine.of(mesh)
    ref = engine.new_ref()
    meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    out = Tensor(meta, mesh, engine, ref, current_stream())
    if value.numel() <= KNOWN_MAX_NUMEL and value.device.type == "cpu":
        out._md_state = ("known", value.detach().clone())
    engine.append(
        engine.mesh_id(mesh),
        isa.CallOp(
            "aten::_to_copy.default",
            (snapshot(value),),
            {"device": isa.WORKER_DEVICE},
            (ref,),
            current_stream(),
            user_line(),
        ),
    )
    return out


def from_local_per_rank(values: list[torch.Tensor], mesh: Any, line: str) -> Tensor:
    """A mesh tensor whose value on the ``i``-th rank of ``mesh`` (``mesh.ranks`` order) is
    ``values[i]``: each worker is sent its own value only (after everything issued before).
    The handle has ``values[0]``'s shape and dtype (values of other shapes, e.g. uneven chunks,
    are each rank's own; fetch gives them)."""
    engine = Engine.of(mesh)
    mid = engine.mesh_id(mesh)
    ref = engine.new_ref()
    stream = current_stream()
    first = values[0]
    meta = torch.empty_strided(first.shape, first.stride(), dtype=first.dtype, device="meta")
    out = Tensor(meta, mesh, engine, ref, stream)
    engine.flush()  # what was issued before goes first, on every worker
    with engine.send_lock:
        for rank, value in zip(mesh.ranks, values, strict=True):
            item = isa.CallOp(
                "aten::_to_copy.default",
                (value.detach().contiguous(),),
                {"device": isa.WORKER_DEVICE},
                (ref,),
                stream,
                line,
            )
            engine.job.post([rank], RunBatch(((mid, item),)))
    return out


def narrow_per_rank(t: Tensor, ranges: list, shape: tuple, line: str) -> Tensor:
    """A new mesh tensor holding, on the ``i``-th rank of ``t.mesh``, a copy of ``t``'s value
    there narrowed to ``ranges[i]`` (``[(tensor dim, (start, length)), ...]``). The handle has
    ``shape`` (the first rank's)."""
    check_usable(t, "distribute", 0, write=False)
    mesh, engine = t._md_mesh, t._md_engine
    stream = t._md_stream
    meta = torch.empty(shape, dtype=t.dtype, device="meta")
    ref = engine.new_ref()
    out = Tensor(meta, mesh, engine, ref, stream)
    for rank, steps in zip(mesh.ranks, ranges, strict=True):
        mid = engine.rank_mesh_id(rank)
        src = t._md_ref
        temps = []
        for k, (d, (start, length)) in enumerate(steps or [(0, (0, shape[0] if shape else 0))]):
            last = k == max(len(steps), 1) - 1
            dst = ref if last else engine.new_ref()
            if not steps:  # nothing sharded on this rank's path: a plain copy
                call = isa.CallOp("aten::clone.default", (isa.Ref(src),), {}, (dst,), stream, line)
            else:
                call = isa.CallOp(
                    "aten::narrow_copy.default",
                    (isa.Ref(src), d, start, length),
                    {},
                    (dst,),
                    stream,
                    line,
                )
            engine.append(mid, call)
            if not last:
                temps.append(dst)
            src = dst
        if temps:
            engine.append(mid, isa.Delete(tuple(temps), stream))
    return out


def to_mesh(obj: Any, mesh: Any) -> Any:
    """Put local data on ``mesh``: a local tensor or a pytree of them is copied to every rank;
    an ``nn.Module`` gets its parameters and buffers on the mesh (returned, changed in place);
    mesh tensors are copied to ``mesh`` with ``Tensor.to_mesh``."""
    if isinstance(obj, torch.nn.Module):
        # a parameter or buffer in several places (tied embedding and output weights, a layer
        # used twice) is moved once and stays one tensor: keyed by the local tensor's id
        done: dict[int, Any] = {}
        for module in obj.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    if id(p) not in done:
                        moved = to_mesh(p.detach(), mesh)
                        done[id(p)] = (p, torch.nn.Parameter(moved, p.requires_grad))
                    module._parameters[name] = done[id(p)][1]
            for name, b in list(module._buffers.items()):
                if b is not None:
                    if id(b) not in done:
                        done[id(b)] = (b, to_mesh(b, mesh))
                    module._buffers[name] = done[id(b)][1]
        return obj
    if isinstance(obj, Tensor):
        return obj.to_mesh(mesh)
    if isinstance(obj, torch.Tensor):
        out = lift(obj, mesh)
        if obj.requires_grad:
            out.requires_grad_(True)
        return out
    return pytree.tree_map(lambda x: to_mesh(x, mesh) if isinstance(x, torch.Tensor) else x, obj)


def reduce(tree: Any, dims: Any = (), reduction: str = "sum", scatter: bool = False) -> Any:
    """``t.reduce(...)`` for every mesh tensor of a pytree (other leaves are kept)."""
    line = user_line()
    return pytree.tree_map(
        lambda t: (
            reduce_tensor(t, dims, reduction, scatter, False, line) if isinstance(t, Tensor) else t
        ),
        tree,
    )


class _SumOver(torch.autograd.Function):
    """``t.reduce(dims, "sum")`` that autograd goes through. Every rank's result is the sum of
    every rank's ``t``, so each rank's loss depends on each rank's ``t``: the gradient of a
    rank's ``t`` is the sum over the ranks of the result's gradients (torch's
    ``torch.distributed.nn.functional.all_reduce``)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, dims: Any, line: str) -> Tensor:  # type: ignore[override]
        ctx.dims, ctx.line = dims, line
        return reduce_tensor(t, dims, "sum", False, False, line)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        return reduce_tensor(grad, ctx.dims, "sum", False, False, ctx.line), None, None


def sum_over(t: Tensor, dims: Any) -> Tensor:
    """The sum of ``t`` over the mesh ``dims``, differentiable (see ``_SumOver``)."""
    return _SumOver.apply(t, dims, user_line())


def reduce_(tree: Any, dims: Any = (), reduction: str = "sum", scatter: bool = False) -> Any:
    """``t.reduce_(...)`` for every mesh tensor of a pytree; returns the tree."""
    line = user_line()
    for t in pytree.tree_leaves(tree):
        if isinstance(t, Tensor):
            reduce_tensor(t, dims, reduction, scatter, True, line)
    return tree
