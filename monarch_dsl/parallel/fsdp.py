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
- frees each gathered parameter after its last forward use and gathers it again for the
  backward pass (``reshard_after_forward=True``, FSDP2's default; the backward pass's gathers
  are prefetched too), except the last module's, which the backward pass starts with;
  ``reshard_after_forward=False`` keeps them gathered from forward to backward (less
  communication, more memory);
- reduce-scatters each gradient back to the parameter's shard, where the optimizer updates it,
  as soon as it is ready, one at a time (the next one waits for the one before), so the whole
  gradient each holds is freed during the backward pass.

Values match unsharded training. A parameter whose dim 0 does not divide stays whole
(replicated, its gradient all-reduced); ``placements=`` given for a parameter takes precedence.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from monarch_dsl import tensor as _tensor
from monarch_dsl.compiler.compile import FULLY_SHARD, RESHARD
from monarch_dsl.parallel.ddp import refuse_torch_mesh


def fully_shard(
    module: nn.Module, mesh: Any = None, dim: str = "dp", *, reshard_after_forward: bool = True
) -> nn.Module:
    """Mark ``module``'s parameters to be sharded ``Shard(0)`` over the mesh dim ``dim`` in
    compiled steps; returns ``module``. ``mesh`` (optional, or the active mesh) is checked to
    have ``dim``; the step's mesh decides the shards. ``reshard_after_forward``: free the
    gathered parameters after the forward pass and gather them again for the backward pass
    (FSDP2's keyword; as there, a parameter keeps what the first call that covered it said:
    call it on each layer, then on the whole model)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    if not isinstance(dim, str):
        raise TypeError(f"dim must name a mesh dim, got {dim!r}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            "reshard_after_forward must be True or False (FSDP2's int, resharding to a "
            f"smaller group, is not supported), got {reshard_after_forward!r}"
        )
    if mesh is not None:
        refuse_torch_mesh("mesh", mesh)
    mesh = mesh if mesh is not None else _tensor.active_mesh()
    if mesh is not None and dim not in mesh.dims:
        raise KeyError(f"fully_shard over {dim!r}: the mesh has dims {mesh.dims}")
    for p in module.parameters():
        current = getattr(p, FULLY_SHARD, None)
        if current is not None and current != dim:
            raise ValueError(f"a parameter is already fully sharded over {current!r}, not {dim!r}")
        if current is None:  # (an outer call leaves an inner call's parameters as they are)
            setattr(p, FULLY_SHARD, dim)
            setattr(p, RESHARD, reshard_after_forward)
    return module
