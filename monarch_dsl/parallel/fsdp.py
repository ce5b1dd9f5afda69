"""``md.fully_shard`` (the name of torch's FSDP2 API): parameters, gradients and optimizer
state sharded over a mesh dim, for compiled steps.

``md.fully_shard(model)`` marks each parameter of ``model`` (call it on each layer and then on
the whole model, as with FSDP2, or once on the model: the result is the same). A step compiled
with ``@md.mesh_fn(data_parallel="dp")`` that uses the module then keeps every marked parameter
whose dim 0 divides by the dim's size ``Shard(0)`` over ``dim`` between steps -- with its
gradient and its optimizer state, so each rank holds 1/N of them -- and:

- gathers each parameter whole (``all_gather``) for the forward and backward passes, once, at
  its first use, so the batch stays sharded over ``dim`` as in data parallelism; the schedule
  issues the gather of the next parameter on the ``comms`` stream while the current one is in
  use (prefetch);
- reduce-scatters each gradient back to the parameter's shard, where the optimizer updates it.

Values match unsharded training. A parameter whose dim 0 does not divide stays whole
(replicated, its gradient all-reduced); ``placements=`` given for a parameter takes precedence.
Parameters stay gathered from their forward use to their backward use (FSDP's re-gather in
backward, which saves that memory, is not done yet).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from monarch_dsl import tensor as _tensor
from monarch_dsl.compiler.compile import FULLY_SHARD


def fully_shard(module: nn.Module, mesh: Any = None, dim: str = "dp") -> nn.Module:
    """Mark ``module``'s parameters to be sharded ``Shard(0)`` over the mesh dim ``dim`` in
    compiled steps; returns ``module``. ``mesh`` (optional, or the active mesh) is checked to
    have ``dim``; the step's mesh decides the shards."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    if not isinstance(dim, str):
        raise TypeError(f"dim must name a mesh dim, got {dim!r}")
    mesh = mesh if mesh is not None else _tensor.active_mesh()
    if mesh is not None and dim not in mesh.dims:
        raise KeyError(f"fully_shard over {dim!r}: the mesh has dims {mesh.dims}")
    for p in module.parameters():
        current = getattr(p, FULLY_SHARD, None)
        if current is not None and current != dim:
            raise ValueError(f"a parameter is already fully sharded over {current!r}, not {dim!r}")
        setattr(p, FULLY_SHARD, dim)
    return module
