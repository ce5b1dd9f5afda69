"""``md.DistributedDataParallel``: torch DDP's semantics, driven from one controller.

A training loop written for ``torch.nn.parallel.DistributedDataParallel`` runs after changing
the import and the process setup: the model and the data are made under ``pm.activate()``
(each rank's batch with ``md.distribute(batch, {"dp": md.Shard(0)})``), then
``ddp = md.DistributedDataParallel(model)`` and the loop is unchanged.

What it does, as torch's reducer does:

- At construction, every parameter and buffer (not the buffers with
  ``broadcast_buffers=False``) is broadcast from the first rank along ``dim``
  (one flat all-reduce per dtype, the other ranks contributing zeros), after checking that every
  rank holds the same parameter shapes (an error names the parameter and the ranks' shapes).
- Gradients are averaged over ``dim`` in buckets of ``bucket_cap_mb`` (the first one 1 MiB, as
  torch's ``_DEFAULT_FIRST_BUCKET_BYTES``), parameters in reverse registration order at first and,
  from the second iteration, in the order their gradients arrived in the first. A parameter's
  post-accumulate-grad hook marks it ready; a bucket whose parameters are all ready is flattened
  on the main stream and all-reduced on a ``comms`` stream (borrowed, so the rest of the backward
  pass keeps running on the workers' main stream meanwhile). A callback queued on autograd's
  engine runs at the end of ``backward()``: it waits for the buckets (drops the borrows) and
  writes the averages into ``.grad``. Flattening and writing back are one instruction each
  per bucket (``monarch_dsl::flatten_scale`` / ``unflatten_into``, ``runtime/kernels.py``):
  Triton kernels on CUDA workers, torch on CPU ones.
- A parameter that got no gradient in a backward pass is an error raised by that
  ``backward()`` naming the parameters (torch says only that some exist, at the next forward),
  unless ``find_unused_parameters=True``: then its bucket is reduced without it, and its
  ``.grad`` is left as it was.
- ``no_sync()`` accumulates gradients locally; the next forward and backward outside it
  reduce the sums. As in torch's reducer, what decides is the wrapper's forwards: a backward
  counts (its gradients are averaged) if a forward of this wrapper with grad enabled outside
  ``no_sync()`` ran since the last backward that counted. So a second backward through the
  same graph (``retain_graph=True``), or one through ``ddp.module(x)`` alone, accumulates
  locally; an evaluation forward under ``no_grad()`` between a forward and its backward
  changes nothing.
- ``forward_sync_buffers`` (default True) re-broadcasts buffers from the first rank at the
  start of a forward that follows one with grad enabled outside ``no_sync()`` (and of the
  first); torch's older ``broadcast_buffers`` does the same, and ``broadcast_buffers=False``
  also leaves each rank's buffers as they are at construction (torch 2.13's rules).
- ``nn.SyncBatchNorm`` layers (``convert_sync_batchnorm``) normalize with the statistics of
  the whole batch over ``dim`` (``_MeshSyncBatchNorm``); on the controller torch's own would
  silently be a per-rank BatchNorm.
- ``join()`` is accepted and runs its block: ranks cannot have uneven inputs here, since each
  runs every step the controller issues.

On CPU workers, a gradient of ``IN_PLACE_BYTES`` (1 MiB) or more is not copied into its
bucket: it is averaged where it is, by an all-reduce of its own on the comms stream (the copy
in and the copy back cost more than the instruction: 8 x Linear(1024) on 2 cores, 25% faster
a step). Its ``.grad`` stays the same tensor, whatever ``gradient_as_bucket_view`` says.

``gradient_as_bucket_view=True``: at the end of each backward, ``.grad`` becomes a view of its
bucket's reduced buffer, as in torch, instead of the average being copied into the ``.grad``
tensor it had (the default, which keeps each ``.grad`` the same tensor, as torch's default
does). Nothing is copied back on the workers (6.7 ms a step per rank for 8 x Linear(1024) on
the 2-core machine); the controller issues an instruction per parameter instead of one per
bucket. Unlike torch's, the buffer is new at each backward: a ``.grad`` taken before it keeps
the values it had.

``replay=True`` (ours; the default): a step the loop repeats is recorded and replayed
(``tensor/replay.py``): from the third time an identical step (the same ops on inputs of the
same shapes; floats such as a learning rate may change) is issued, the workers are sent one
plan run for it instead of its instructions, and run it as a compiled plan. Each ``forward()``
starts a new batch of instructions, and batches are sent when the next step starts or the
program waits for a value (not a moment after they start; at the latest 0.1 s after).
``replay=False`` keeps every step of this wrapper eager.

Accepted for compatibility, with no effect because the single controller makes them moot:
``static_graph`` (the graph is seen whole), ``init_sync`` (the broadcast is one collective),
``check_reduction``, ``output_device``, ``device_ids`` of one device (each worker uses its own
device), and ``dim=0`` in torch's sense (the batch dim; our batches are already per rank).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from monarch_dsl import tensor as _tensor
from monarch_dsl.remote import remote as _remote_fn
from monarch_dsl.runtime import kernels as _kernels  # noqa: F401 - registers the bucket ops

FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
# On CPU workers, a gradient of at least this many bytes is averaged where it is (an in-place
# all-reduce of its own) instead of copied into its bucket's flat buffer and back: on the
# 2-core machine those two copies cost 6.7 ms each per rank per step for 8 x Linear(1024),
# more than an instruction per gradient (113-118 -> 88-90 ms a step, interleaved), while
# 4 x Linear(64) with every gradient in place went 11.3 -> 12.1 ms: small ones stay bucketed.
# On GPUs a copy costs microseconds and one collective per bucket is what pays: all bucketed.
IN_PLACE_BYTES = 1024 * 1024


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is out of autograd already (a gradient, unless made with
    ``create_graph=True``), else ``t.detach()``."""
    return t.detach() if t.requires_grad else t


class _Bucket:
    """Parameters reduced together (one dtype), in the order they are laid out flat."""

    def __init__(self, index: int, params: list[int]):
        self.index = index
        self.params = params
        self.flat: Any = None  # while its reduce is in flight: the flat buffer
        self.borrows: list = []  # ... and the borrows of it and of the gradients reduced alone
        self.present: list[int] = []  # the parameters in the flat buffer (unused ones left out)


class DistributedDataParallel(nn.Module):
    """``module`` replicated over the mesh dim ``dim`` with gradients averaged in buckets; see
    the module docstring. ``mesh``: the module's parameters' mesh (default: the active one)."""

    def __init__(
        self,
        module: nn.Module,
        mesh: Any = None,
        dim: Any = "dp",
        bucket_cap_mb: float | None = 25,
        broadcast_buffers: bool | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        device_ids: Any = None,
        output_device: Any = None,
        process_group: Any = None,
        device_mesh: Any = None,
        init_sync: bool = True,
        check_reduction: bool = False,
        forward_sync_buffers: bool | None = None,
        replay: bool = True,
        **unsupported: Any,
    ):
        super().__init__()
        if unsupported:
            names = ", ".join(sorted(unsupported))
            raise TypeError(
                f"md.DistributedDataParallel does not support {names} (torch DDP keywords "
                "without a single-controller meaning yet)"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if bucket_cap_mb is None:
            bucket_cap_mb = 25
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        _check_devices(device_ids, output_device)
        mesh = _resolve_mesh(mesh, process_group, device_mesh)
        dim = _resolve_dim(dim, mesh)
        self.module = module
        self.mesh, self.dim = mesh, dim
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        # torch 2.13's rule: forward_sync_buffers (default True) re-broadcasts buffers in
        # forward and leaves the broadcast at construction on; the older broadcast_buffers
        # (used where forward_sync_buffers is not given) does both, so =False keeps each
        # rank's buffers at construction too.
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_buffers = bool(forward_sync_buffers), True
        else:
            init_buffers = self.forward_sync_buffers = (
                True if broadcast_buffers is None else bool(broadcast_buffers)
            )
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        # As torch's reducer: buffers are broadcast in a forward that follows one with grad
        # enabled outside no_sync() (or the first), and gradient hooks only count in a
        # backward whose forward went through this wrapper with grad enabled outside
        # no_sync() -- a second backward through the same graph (retain_graph=True), or a
        # backward through ``ddp.module(x)``, accumulates locally as in torch.
        self.require_forward_param_sync = True
        self._expect_hooks = False

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "md.DistributedDataParallel: the module has no parameter that requires grad"
            )
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        cpu = self._params[0].device.type == "cpu"
        self._alone = {
            i for i, p in enumerate(self._params)
            if cpu and p.numel() * p.element_size() >= IN_PLACE_BYTES
        }  # fmt: skip
        _check_on_mesh(named, list(module.named_buffers()), mesh)
        _sync_batch_norms(module, mesh, dim)
        self._comms = _tensor.Stream("comms")
        if init_sync:
            _verify_shapes(named, mesh, dim)
            buffers = [b for _, b in module.named_buffers()] if init_buffers else []
            _broadcast([p for _, p in named] + buffers, mesh, dim)
        self._buckets = self._assign([len(self._params) - 1 - i for i in range(len(self._params))])
        self._bucket_of = {i: b for b in self._buckets for i in b.params}
        self._rebuilt = False
        self._arrivals: list[int] = []
        self._ready: set[int] = set()
        self._waiting: dict[int, int] = {}  # bucket index -> parameters not ready yet
        self._callback_queued = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self._params)
        ]
        # Record and replay of repeated steps (tensor/replay.py): each forward starts a batch.
        self._replay = replay
        self._first: Any = None  # this rank is the first along dim (for broadcast_buffers)
        self._engine = _tensor.Engine.of(mesh)
        if replay:
            self._engine.start_replay()
            weakref.finalize(self, self._engine.stop_replay)

    # ---- the parts a loop sees ---------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._replay:
            # (the inputs' shapes tell steps apart: a plan's ops keep their shapes' buffers)
            self._engine.cut(
                tuple(
                    (x.shape, x.dtype) if isinstance(x, torch.Tensor) else type(x)
                    for x in pytree.tree_leaves((args, kwargs))
                )
            )
        else:
            # A step is a batch of its own here too (not replayed: another wrapper may replay
            # on this engine): the tensors the last step left are deleted as this one
            # starts, not when a batch of several steps ends (the workers' peak memory).
            self._engine.cut(None)
        if self.require_forward_param_sync and self.forward_sync_buffers:
            buffers = [b for _, b in self.module.named_buffers()]
            if buffers:
                if self._first is None:  # (made once: its instruction is one a plan lacks)
                    with _tensor.activate(self.mesh):
                        self._first = self.mesh.rank(self.dim) == 0
                _broadcast(buffers, self.mesh, self.dim, self._first)
        out = self.module(*args, **kwargs)
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.require_forward_param_sync = synced
        if synced:  # (only a counted backward disarms: an eval forward between keeps it)
            self._expect_hooks = True
        return out

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name of ``forward_sync_buffers``."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = bool(value)

    @contextlib.contextmanager
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Iterator[None]:
        """torch's context for ranks with uneven numbers of batches. Here every rank runs every
        step the controller issues, so inputs cannot be uneven: the block just runs."""
        yield

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        raise NotImplementedError(
            "md.DistributedDataParallel has no communication hooks yet; the buckets' all-reduce "
            "is fixed (average over the mesh dim)"
        )

    @property
    def bucket_sizes(self) -> list[int]:
        """Parameters per bucket, in the order buckets are reduced."""
        return [len(b.params) for b in self._buckets]

    @property
    def bucket_names(self) -> list[list[str]]:
        """The parameters' names in each bucket, in the order buckets are reduced."""
        return [[self._names[i] for i in b.params] for b in self._buckets]

    # ---- buckets -----------------------------------------------------------------------------
    def _assign(self, order: list[int]) -> list[_Bucket]:
        """Buckets over parameters in ``order``: one dtype each, the first up to 1 MiB, the
        others up to ``bucket_cap_mb`` (a bucket holds at least one parameter)."""
        buckets: list[_Bucket] = []
        open_: dict[torch.dtype, tuple[list[int], int]] = {}
        for i in order:
            p = self._params[i]
            size = p.numel() * p.element_size()
            params, used = open_.get(p.dtype, ([], 0))
            cap = FIRST_BUCKET_BYTES if not buckets else self.bucket_cap_bytes
            cap = min(cap, self.bucket_cap_bytes)
            if params and used + size > cap:
                buckets.append(_Bucket(len(buckets), params))
                params, used = [], 0
            open_[p.dtype] = (params + [i], used + size)
        for params, _ in open_.values():
            if params:
                buckets.append(_Bucket(len(buckets), params))
        return buckets

    def _hook(self, i: int):
        # The hook holds the wrapper weakly: autograd keeps a parameter's hooks where the
        # garbage collector cannot see them, so parameter -> hook -> wrapper -> parameter
        # would keep a dropped wrapper, and its parameters on the workers, alive for good.
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            self = ref()
            if self is None:
                return
            if not self._expect_hooks:
                return  # (no_sync(), or a backward that no forward of ours armed)
            if not self._callback_queued:
                self._callback_queued = True
                self._ready.clear()
                self._waiting = {b.index: len(b.params) for b in self._buckets}
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            if i in self._ready:
                return  # a parameter used twice gets one hook call per accumulation
            self._ready.add(i)
            if not self._rebuilt:
                self._arrivals.append(i)
            bucket = self._bucket_of[i]
            self._waiting[bucket.index] -= 1
            if self._waiting[bucket.index] == 0:
                self._launch(bucket)

        return hook

    def _launch(self, bucket: _Bucket) -> None:
        """Flatten the bucket's gradients on the main stream, average them over ``dim`` on the
        comms stream."""
        present = [i for i in bucket.params if self._params[i].grad is not None]
        for i in present:  # a large gradient on a CPU worker: averaged where it is
            if i in self._alone:
                bucket.borrows.append(self._reduce(self._params[i].grad))
        bucket.present = [i for i in present if i not in self._alone]
        if not bucket.present:
            return
        # (a gradient that needs no detach gets none: each is an instruction on the controller
        # and the workers, 8 of an eager step's 91 for 4 x Linear(64))
        grads = [_detached(self._params[i].grad) for i in bucket.present]
        # one instruction; a CUDA worker runs a Triton kernel (runtime/kernels.py)
        bucket.flat = torch.ops.monarch_dsl.flatten_scale(grads, 1.0)
        bucket.borrows.append(self._reduce(bucket.flat))

    def _reduce(self, t: torch.Tensor) -> Any:
        """Average ``t`` over ``dim`` in place on the comms stream; the borrow to drop."""
        lent, borrow = self._comms.borrow(t, mutable=True)
        with self._comms.activate():
            lent.reduce_(self.dim, "avg")
        return borrow

    def _finish(self) -> None:
        """End of backward: reduce what is left, write the averages back, check for unused
        parameters, rebuild the buckets after the first iteration."""
        self._callback_queued = False
        self._expect_hooks = False  # until the next forward
        unused = [i for i in range(len(self._params)) if i not in self._ready]
        if unused and self.find_unused_parameters:
            for b in self._buckets:
                if self._waiting.get(b.index, 0) > 0:
                    self._launch(b)
        for b in self._buckets:
            for borrow in b.borrows:
                borrow.drop()  # the main stream waits here for the bucket's reduces
            flat, b.flat, b.borrows = b.flat, None, []
            if flat is None:
                continue
            with torch.no_grad():
                params = [self._params[i] for i in b.present]
                if self.gradient_as_bucket_view:
                    # .grad becomes the bucket's views: no copy back on the workers (6.7 ms a
                    # step per rank for 8 x Linear(1024) here), an instruction per parameter
                    views = flat.split([p.numel() for p in params])
                    for p, v in zip(params, views):
                        p.grad = v.view(p.shape)
                else:
                    torch.ops.monarch_dsl.unflatten_into(flat, [p.grad for p in params], 1.0)
        if unused and not self.find_unused_parameters:
            names = ", ".join(f"module.{self._names[i]}" for i in unused)
            raise RuntimeError(
                f"md.DistributedDataParallel: {len(unused)} parameter(s) received no gradient in "
                f"this backward pass: {names}. Their gradients were not averaged. If they are "
                "unused on purpose, pass find_unused_parameters=True (or set requires_grad=False "
                "on them)."
            )
        if not self._rebuilt and len(self._arrivals) == len(self._params):
            # torch's Reducer rebuilds its buckets once, from the first iteration's order
            self._buckets = self._assign(self._arrivals)
            self._bucket_of = {i: b for b in self._buckets for i in b.params}
            self._rebuilt = True


# ---- checks and collectives ----------------------------------------------------------------------


def _check_devices(device_ids: Any, output_device: Any) -> None:
    if device_ids is not None:
        ids = list(device_ids) if isinstance(device_ids, (list, tuple)) else None
        if ids is None or len(ids) != 1:
            raise ValueError(
                "device_ids: md.DistributedDataParallel drives one device per worker (each "
                "worker uses its own GPU, or the CPU): pass None or a list of one device "
                f"(the per-process idiom device_ids=[local_rank]); got {device_ids!r}"
            )


def refuse_torch_mesh(name: str, value: Any) -> None:
    """A torch process group or device mesh where a monarch_dsl mesh belongs: a TypeError
    saying what to pass instead."""
    if not hasattr(value, "dims"):
        raise TypeError(
            f"{name}: monarch_dsl meshes replace torch process groups and device meshes; "
            f"pass an md ProcMesh (mesh=pm) and the mesh dim (dim='dp'), not a "
            f"{type(value).__name__}"
        )


def _resolve_mesh(mesh: Any, process_group: Any, device_mesh: Any) -> Any:
    for name, value in (("process_group", process_group), ("device_mesh", device_mesh)):
        if value is None:
            continue
        refuse_torch_mesh(name, value)
        if not hasattr(value, "_job"):
            raise TypeError(
                f"{name}: an md ProcMesh (with processes), not a {type(value).__name__}"
            )
        if mesh is not None and value is not mesh:
            raise ValueError(f"both mesh= and {name}= given, and they differ")
        mesh = value
    if mesh is None:
        mesh = _tensor.active_mesh()
    if mesh is None:
        raise RuntimeError(
            "md.DistributedDataParallel needs a mesh: pass mesh=, or construct it under "
            "`with pm.activate():`"
        )
    return mesh


def _resolve_dim(dim: Any, mesh: Any) -> str:
    if isinstance(dim, int) and not isinstance(dim, bool):
        if dim != 0:
            raise ValueError(
                f"dim={dim}: torch DDP's dim scatters inputs along a batch dim, which the single "
                "controller does not do (each rank's batch is its own: md.distribute); name the "
                "mesh dim instead, e.g. dim='dp'"
            )
        dim = "dp"
    if not isinstance(dim, str):
        raise TypeError(f"dim must name a mesh dim, got {dim!r}")
    if dim not in mesh.dims:
        if dim == "dp" and len(mesh.dims) == 1:
            return mesh.dims[0]  # a 1-D mesh: its one dim is the data-parallel one
        raise KeyError(f"dim {dim!r}: the mesh has dims {mesh.dims}")
    return dim


def _check_on_mesh(named: list, buffers: list, mesh: Any) -> None:
    for kind, items in (("parameter", named), ("buffer", buffers)):
        for name, t in items:
            if not isinstance(t, _tensor.Tensor):
                raise TypeError(
                    f"{kind} {name!r} is a local tensor: create the model under "
                    "`with pm.activate():` or put it on the mesh with md.to_mesh(model, pm)"
                )
            if t.mesh.job is not mesh.job or tuple(t.mesh.ranks) != tuple(mesh.ranks):
                raise ValueError(
                    f"{kind} {name!r} lives on mesh {t.mesh}, not on the DDP mesh {mesh}"
                )


@_remote_fn(propagate=lambda *ps: torch.zeros(len(ps), 8, dtype=torch.int64))
def _local_shapes(*params):
    """Each parameter's local (ndim, shape padded to 7) on this rank, on the rank's device (a
    CUDA worker reduces CUDA tensors only)."""
    device = params[0].device if params else None
    out = torch.zeros(len(params), 8, dtype=torch.int64, device=device)
    for k, p in enumerate(params):
        shape = list(p.shape)[:7]
        out[k, 0] = p.dim()
        out[k, 1 : 1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return out


def _verify_shapes(named: list, mesh: Any, dim: str) -> None:
    """Every rank holds the same parameter shapes (torch's
    ``_verify_param_shape_across_processes``); else a ValueError naming the parameter and the
    ranks' shapes."""
    with _tensor.activate(mesh):
        shapes = _local_shapes(*[p.detach() for _, p in named]).reduce(mesh.dims, "stack")
        every = _tensor.fetch(shapes).get()  # [ranks, params, 8], ranks in row-major order
    points = [",".join(f"{d}={c}" for d, c in p.items()) for p in mesh.points()]
    for k, (name, _) in enumerate(named):
        found = [tuple(_shape(every[r, k])) for r in range(every.shape[0])]
        if len(set(found)) > 1:
            seen = "; ".join(f"{pt}: {s}" for pt, s in zip(points, found))
            raise ValueError(
                f"md.DistributedDataParallel: parameter {name!r} has different shapes on "
                f"different ranks ({seen}); DDP needs the same parameters on every rank"
            )


def _shape(row: torch.Tensor) -> list[int]:
    n = int(row[0])
    return [int(v) for v in row[1 : 1 + n]]


def _broadcast(tensors: list, mesh: Any, dim: str, first: Any = None) -> None:
    """Every rank of ``dim`` takes the first rank's values (one flat all-reduce per dtype: the
    first rank's values, zeros elsewhere). ``first``: ``mesh.rank(dim) == 0``, if made."""
    with _tensor.activate(mesh), torch.no_grad():
        if first is None:
            first = mesh.rank(dim) == 0
        by_dtype: dict[torch.dtype, list] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, ts in by_dtype.items():
            work = torch.int64 if dtype == torch.bool else dtype
            flat = torch.cat([t.detach().reshape(-1).to(work) for t in ts])
            flat = torch.where(first, flat, torch.zeros_like(flat))
            flat.reduce_(dim, "sum")
            for t, part in zip(ts, flat.split([math.prod(t.shape) for t in ts])):
                t.detach().copy_(part.view(t.shape).to(dtype))


# ---- SyncBatchNorm ---------------------------------------------------------------------------


def _sync_batch_norms(module: nn.Module, mesh: Any, dim: str) -> None:
    """Each ``nn.SyncBatchNorm`` in ``module`` normalizes with the statistics of the batch over
    ``dim`` (``_MeshSyncBatchNorm``). On the controller torch's own falls back to a per-rank
    BatchNorm without a word (torch.distributed is not initialized here)."""
    for name, m in module.named_modules():
        if type(m) is nn.SyncBatchNorm:  # (a subclass keeps its own forward)
            if m.process_group is not None:
                refuse_torch_mesh(f"SyncBatchNorm {name!r}'s process_group", m.process_group)
            m.__class__ = _MeshSyncBatchNorm
            m._md_dim = dim  # type: ignore[assignment]


class _MeshSyncBatchNorm(nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` over a mesh dim (``md.DistributedDataParallel`` turns each one in
    its module into this; ``isinstance(m, nn.SyncBatchNorm)`` still holds). In training, the
    mean and variance are those of every rank's batch together (ranks' batches of different
    sizes weighed by size), by two sums over the dim that autograd goes through (torch's
    backward all-reduces the same two sums); the running statistics take the unbiased
    variance, as torch's. In eval: torch's own forward (each rank's statistics or the running
    ones, no sync), as torch's."""

    _md_dim: str

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        if not self.training:  # (torch's syncs in training only: eval uses each rank's own)
            return super().forward(input)
        # half-precision input: the statistics in float32, as torch's (and exact counts)
        low = input.dtype in (torch.float16, torch.bfloat16)
        x = input.float() if low else input
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        # the count on each rank from its own rows (md.distribute's chunks may be uneven)
        count = torch.ones_like(x.detach()[:, 0]).sum().reshape(1)
        sums = _tensor.sum_over(torch.cat([x.sum(dims), count]), self._md_dim)
        n = sums[channels]
        mean = sums[:channels] / n
        centered = x - mean.reshape(shape)
        var = _tensor.sum_over((centered * centered).sum(dims), self._md_dim) / n
        out = centered * torch.rsqrt(var + self.eps).reshape(shape)
        if self.weight is not None:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)  # type: ignore[union-attr,operator]
                if self.momentum is None:  # a cumulative average
                    factor = 1.0 / self.num_batches_tracked.to(mean.dtype)  # type: ignore[union-attr]
                else:
                    factor = torch.full_like(n, self.momentum)
                unbiased = var.detach() * n / (n - 1)
                # (torch's order: momentum * batch + (1 - momentum) * running)
                self.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
                self.running_var.mul_(1 - factor).add_(unbiased * factor)  # type: ignore[union-attr]
        return out.to(input.dtype) if low else out
