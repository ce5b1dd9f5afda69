"""Tensors kept by name on a persistent mesh: ``md.pin(t, "w")`` and ``pm.pinned("w")``.

A persistent mesh (``spawn_procs(name=, persistent=True)``, ``md.attach``; proc_mesh.py) keeps
its workers, their actors and the tensors pinned here when its controller goes away. Pinning
runs a remote function on the tensor's ranks that stores each rank's local tensor, with the
mesh it lives on, in ``runtime.worker.pinned``; ``pm.pinned`` (proc_mesh.py) reads back what
is there and runs ``load`` to give the tensor a handle of the current controller."""

from __future__ import annotations

from typing import Any

import torch

from monarch_dsl.remote import remote
from monarch_dsl.tensor import Tensor


def _keep(t: torch.Tensor, name: str, dims: tuple, sizes: tuple, ranks: tuple) -> None:
    from monarch_dsl.runtime import worker

    worker.pinned[name] = (t, tuple(dims), tuple(sizes), tuple(ranks))


def _drop(name: str) -> None:
    from monarch_dsl.runtime import worker

    worker.pinned.pop(name, None)


def load(name: str) -> torch.Tensor:
    """(On a worker) the tensor pinned as ``name``."""
    from monarch_dsl.runtime import worker

    return worker.pinned[name][0]


_keep_remote = remote(_keep, propagate=lambda t, name, dims, sizes, ranks: None)
_drop_remote = remote(_drop, propagate=lambda name: None)


def pin(t: Any, name: str) -> None:
    """Keep mesh tensor ``t`` on its workers under ``name``: ``pm.pinned(name)`` gets it back,
    from this controller or, on a persistent mesh, from a later one (``md.attach``). Pinning
    another tensor under the same name replaces it; ``md.unpin(mesh, name)`` forgets it."""
    if not isinstance(t, Tensor):
        raise TypeError(f"md.pin keeps a mesh tensor, got {type(t).__name__}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"md.pin needs a non-empty name, got {name!r}")
    mesh = t.mesh
    sizes = tuple(mesh.sizes.values())
    with mesh.activate():
        _keep_remote(t, name, tuple(mesh.dims), sizes, tuple(int(r) for r in mesh.ranks))


def unpin(mesh: Any, name: str) -> None:
    """Forget the tensor pinned as ``name`` on the workers of ``mesh``."""
    with mesh.activate():
        _drop_remote(name)


def loader(shape: tuple, dtype: torch.dtype) -> Any:
    """The remote function that gives a pinned tensor of ``shape``/``dtype`` a handle."""
    return remote(load, propagate=lambda name: torch.empty(shape, dtype=dtype, device="meta"))


__all__ = ["pin", "unpin"]
