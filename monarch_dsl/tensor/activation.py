"""``with pm.activate():`` -- torch calls create tensors on every rank of the mesh and run
there -- and ``pm.rank(dims)``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from monarch_dsl import isa
from monarch_dsl.errors import SupervisionError
from monarch_dsl.frames import user_line
from monarch_dsl.runtime import controller
from monarch_dsl.tensor.active import active_mesh, current_stream, mesh_stack
from monarch_dsl.tensor.dispatch import MeshMode
from monarch_dsl.tensor.engine import Engine
from monarch_dsl.tensor.handle import Tensor


@contextlib.contextmanager
def activate(mesh: Any) -> Iterator[Any]:
    """``with pm.activate():`` -- torch calls create and run on every rank of ``mesh``."""
    if mesh.job.stopped:
        raise RuntimeError("this process mesh has been stopped")
    stack = mesh_stack()
    stack.append(mesh)
    real_seed = torch.manual_seed

    def manual_seed(seed: int):
        engine = Engine.of(mesh)
        engine.append(engine.mesh_id(mesh), isa.Seed(int(seed), user_line()))
        return real_seed(seed)

    torch.manual_seed = manual_seed
    failing = False
    try:
        # Autograd on mesh tensors runs in the calling thread: the engine would hand a CUDA
        # mesh tensor's backward to a device thread of this process's own GPUs (by the tensor's
        # device index, which the controller's view has none of: an internal assert in
        # torch, seen on an H200), yet the work is only recorded here and runs on the workers.
        with MeshMode(mesh), torch.autograd.set_multithreading_enabled(False):
            yield mesh
    except BaseException:
        failing = True
        raise
    finally:
        torch.manual_seed = real_seed
        stack.pop()
        engine = Engine.of_job(mesh.job)
        if engine is not None:
            try:
                if failing:  # the error leaving the block is the one to see
                    with controller.quietly():
                        engine.flush()
                else:
                    engine.flush()
            except SupervisionError:
                if not failing:
                    raise


def mesh_rank(mesh: Any, dims: Any) -> Tensor:
    """``mesh.rank(dims)``: each rank's coordinate along ``dims``, as an int64 mesh tensor."""
    if active_mesh() is None:
        raise RuntimeError(
            "mesh.rank(...) gives a mesh tensor and needs an active mesh: "
            "`with pm.activate(): r = pm.rank('gpu')`"
        )
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    for d in dims:
        if d not in mesh.dims:
            raise KeyError(f"rank({d!r}): the mesh has dims {mesh.dims}")
    engine = Engine.of(mesh)
    mid = engine.mesh_id(mesh)
    ref = engine.new_ref()
    stream = current_stream()
    out = Tensor(torch.empty((), dtype=torch.int64, device="meta"), mesh, engine, ref, stream)
    engine.append(
        mid,
        isa.CallOp(
            "aten::scalar_tensor.default",
            (isa.MeshCoord(mid, dims),),
            {"dtype": torch.int64, "device": isa.WORKER_DEVICE},
            (ref,),
            stream,
            user_line(),
        ),
    )
    return out
