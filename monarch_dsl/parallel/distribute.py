"""``md.distribute``: lay a local tensor (or pytree) out over a mesh by placements.

The single-controller counterpart of DTensor's ``distribute_tensor`` and of a
``DistributedSampler``: ``md.distribute(batch, {"dp": md.Shard(0)})`` gives rank ``dp=i`` the
``i``-th ``torch.chunk`` of ``batch`` along dim 0; ``Replicate()`` (the default for every dim not
named) gives every rank the whole value. Several sharded mesh dims nest in the mesh's dim
order, the leftmost the outer chunk (as the compiler lays them out). Chunks are
``torch.chunk``'s: uneven sizes are allowed, and a rank past the last chunk holds an empty one.
Each worker is sent only its own part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from monarch_dsl import tensor as _tensor
from monarch_dsl.compiler.plan import Partial, Placement, Replicate, Shard
from monarch_dsl.frames import user_line


def distribute(obj: Any, placements: Any, mesh: Any = None) -> Any:
    """``obj`` (a local tensor or a pytree of them; other leaves are kept) laid out over
    ``mesh`` (default: the active mesh) by ``placements``: ``{dim: md.Shard(d) |
    md.Replicate()}`` (dims not named are replicated), a sequence of one placement per mesh
    dim (DTensor's form), or one placement for a 1-D mesh. Returns mesh tensors holding each
    rank's part; bad placements raise before anything is sent."""
    line = user_line()
    mesh = _mesh(mesh)
    by_dim = _placements(placements, mesh)
    leaves, spec = pytree.tree_flatten(obj)
    for leaf in leaves:
        if isinstance(leaf, _tensor.Tensor) and (
            leaf.mesh.job is not mesh.job or tuple(leaf.mesh.ranks) != tuple(mesh.ranks)
        ):
            raise ValueError(f"md.distribute: a tensor on mesh {leaf.mesh}, not on {mesh}")
        if isinstance(leaf, torch.Tensor):
            for dim, p in by_dim.items():
                if isinstance(p, Shard) and not -leaf.dim() <= p.dim < max(leaf.dim(), 1):
                    raise ValueError(
                        f"md.distribute: Shard({p.dim}) over {dim!r} needs a tensor with dim "
                        f"{p.dim}, got shape {tuple(leaf.shape)}"
                    )
    out = []
    for x in leaves:
        if isinstance(x, _tensor.Tensor):
            out.append(_slice_on_mesh(x, by_dim, mesh, line))
        elif isinstance(x, torch.Tensor):
            out.append(_distribute_one(x, by_dim, mesh, line))
        else:
            out.append(x)
    return pytree.tree_unflatten(out, spec)


def _mesh(mesh: Any) -> Any:
    if mesh is None:
        mesh = _tensor.active_mesh()
        if mesh is None:
            raise RuntimeError(
                "md.distribute needs a mesh: pass mesh=, or call it under `with pm.activate():`"
            )
    if not hasattr(mesh, "_job"):
        raise TypeError(f"md.distribute needs a process mesh, got {type(mesh).__name__}")
    return mesh


def _placements(placements: Any, mesh: Any) -> dict[str, Placement]:
    """``{dim: placement}`` for every dim of ``mesh``, checked."""
    if isinstance(placements, Placement):
        if len(mesh.dims) != 1:
            raise ValueError(
                f"one placement is for a 1-D mesh; this mesh has dims {mesh.dims}: "
                f"pass {{dim: placement}}"
            )
        placements = {mesh.dims[0]: placements}
    elif isinstance(placements, (list, tuple)):
        if len(placements) != len(mesh.dims):
            raise ValueError(
                f"{len(placements)} placements for a mesh with {len(mesh.dims)} dims {mesh.dims}"
            )
        placements = dict(zip(mesh.dims, placements))
    elif not isinstance(placements, Mapping):
        raise TypeError(
            "placements must be {dim: md.Shard(d) | md.Replicate()}, a sequence of one per "
            f"mesh dim, or one placement; got {type(placements).__name__}"
        )
    out: dict[str, Placement] = {}
    for dim in placements:
        if dim not in mesh.dims:
            raise KeyError(f"placement for {dim!r}: the mesh has dims {mesh.dims}")
    for dim in mesh.dims:
        p = placements.get(dim, Replicate())
        if isinstance(p, Partial):
            raise ValueError(f"md.distribute cannot make a Partial value (over {dim!r})")
        if not isinstance(p, (Shard, Replicate)):
            raise TypeError(f"placement for {dim!r} must be md.Shard or md.Replicate, got {p!r}")
        out[dim] = p
    return out


def _distribute_one(x: torch.Tensor, by_dim: dict[str, Placement], mesh: Any, line: str):
    x = x.detach()
    if all(isinstance(p, Replicate) for p in by_dim.values()):
        return _tensor.to_mesh(x, mesh)
    values = []
    for point in mesh.points():
        part = x
        for dim in mesh.dims:  # leftmost mesh dim = outer chunk
            p = by_dim[dim]
            if isinstance(p, Shard):
                part = _chunk(part, p.dim % max(x.dim(), 1), mesh.size(dim), point[dim])
        values.append(part.clone())
    return _tensor.from_local_per_rank(values, mesh, line)


def _ranges(shape: tuple[int, ...], by_dim: dict, mesh: Any, point: dict) -> dict[int, tuple]:
    """{tensor dim: (start, length)} of the rank at ``point``: ``torch.chunk`` nested in the
    mesh's dim order."""
    ranges: dict[int, tuple[int, int]] = {}
    for dim in mesh.dims:
        p = by_dim[dim]
        if isinstance(p, Shard):
            d = p.dim % max(len(shape), 1)
            start, length = ranges.get(d, (0, shape[d]))
            size = -(-length // mesh.size(dim)) if length else 0  # torch.chunk's chunk size
            lo = min(point[dim] * size, length)
            ranges[d] = (start + lo, min(size, length - lo))
    return ranges


def _slice_on_mesh(t: Any, by_dim: dict, mesh: Any, line: str) -> Any:
    """A mesh tensor (the same value on every rank, e.g. made under activation) laid out by
    placements: each rank keeps its part (``narrow_copy`` there; nothing is sent but the
    instruction)."""
    if all(isinstance(p, Replicate) for p in by_dim.values()):
        return t
    shape = tuple(t.shape)
    per_rank = [_ranges(shape, by_dim, mesh, point) for point in mesh.points()]
    first = list(shape)
    for d, (_, length) in per_rank[0].items():
        first[d] = length
    return _tensor.narrow_per_rank(t, [list(r.items()) for r in per_rank], tuple(first), line)


def _chunk(x: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    """``torch.chunk(x, n, dim)[i]``, or an empty slice past the last chunk."""
    chunks = torch.chunk(x, n, dim)
    if i < len(chunks):
        return chunks[i]
    return x.narrow(dim, x.shape[dim], 0)
