"""Distributed tensors from one controller (SPEC §3, eager mode).

``with pm.activate():`` torch calls create ``md.Tensor`` handles: the controller keeps only
shape and dtype (a meta tensor) and records each op as an instruction (``monarch_dsl/isa``)
in a batch; batches go to the workers lazily -- when a value is fetched, when the batch is big,
a moment after it started, or at ``stop()`` -- so the controller never pays a round trip per
op. The workers run the instructions (``runtime/executor.py``).

The modules, bottom up: ``engine`` (batches, refs, deletes, flushes), ``active`` (each
thread's active mesh and stream; the borrow rules), ``handle`` (``md.Tensor``, its reduce and
to_mesh), ``streams`` (``md.Stream``, borrows), ``meta`` (output shapes, cached),
``movement`` (data onto and across meshes: to_mesh and reduce of pytrees, per-rank
placement), ``dispatch`` (torch ops on mesh tensors), ``activation`` (``pm.activate()``),
``fetching`` (fetch, inspect, sync).
"""

from monarch_dsl.errors import RemoteError
from monarch_dsl.tensor import dispatch as _dispatch  # noqa: F401 - gives md.Tensor its torch ops
from monarch_dsl.tensor.activation import activate, mesh_rank
from monarch_dsl.tensor.active import active_mesh, check_usable, current_stream
from monarch_dsl.tensor.engine import Engine
from monarch_dsl.tensor.fetching import fetch, inspect, show, sync
from monarch_dsl.tensor.handle import Tensor
from monarch_dsl.tensor.movement import (
    from_local_per_rank,
    lift,
    narrow_per_rank,
    reduce,
    reduce_,
    sum_over,
    to_mesh,
)
from monarch_dsl.tensor.streams import Borrow, Stream, get_active_stream

__all__ = [
    "Borrow",
    "Engine",
    "RemoteError",
    "Stream",
    "Tensor",
    "activate",
    "active_mesh",
    "check_usable",
    "current_stream",
    "fetch",
    "from_local_per_rank",
    "get_active_stream",
    "inspect",
    "lift",
    "mesh_rank",
    "narrow_per_rank",
    "reduce",
    "reduce_",
    "show",
    "sum_over",
    "sync",
    "to_mesh",
]
