"""Distributed tensors from one controller (SPEC §3, eager mode).

``with pm.activate():`` torch calls create ``md.Tensor`` handles: the controller keeps only
shape and dtype (a meta tensor) and records each op as a plan instruction (``compiler/ir.py``)
in a batch; batches go to the workers lazily -- when a value is fetched, when the batch is big,
a moment after it started, or at ``stop()`` -- so the controller never pays a round trip per
op. The workers run the instructions (``runtime/executor.py``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from monarch_dsl.compiler import ir
from monarch_dsl.errors import RemoteError
from monarch_dsl.frames import user_line
from monarch_dsl.mesh import Mesh
from monarch_dsl.runtime import controller
from monarch_dsl.runtime.future import Future
from monarch_dsl.runtime.messages import RunBatch, SetupCollectives

__all__ = [
    "Borrow",
    "RemoteError",
    "Stream",
    "Tensor",
    "fetch",
    "get_active_stream",
    "inspect",
    "reduce",
    "reduce_",
    "show",
    "to_mesh",
]

BATCH_MAX = 1000  # instructions; more are sent at once
EXTENSION = "tensor"  # the engine's name in its job's extensions

# =============================================================================== engine


_AFTER_DELETES = (ir.Fetch, ir.RunPlan)


class Engine:
    """The tensor engine of one process allocation (a controller Job)."""

    def __init__(self, job: controller.Job):
        self.job = job
        self.ranks = tuple(range(job.world))
        self.batch: list[tuple[int, Any]] = []
        self.held = False  # a flush is due a moment from now (see append)
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.dead: list[tuple[int, str]] = []  # (ref, stream) of collected tensors
        self.refs = itertools.count(1)
        self.meshes: dict[tuple, int] = {}
        self.store: Any = None
        # What handles report as .device: the workers' device type (their data lives there).
        types = {hello.device for hello in job.hellos.values()}
        self.device = torch.device("cuda" if types == {"cuda"} else "cpu")
        self.batches_sent = 0

    @classmethod
    def of(cls, mesh: Any) -> Engine:
        """The engine of ``mesh``'s allocation; made on first use, when it registers with
        the job: ``ProcMesh.stop`` then waits (``sync``) for what it sent."""
        job = mesh._job
        engine = job.extensions.get(EXTENSION)
        if engine is None:
            engine = job.extensions[EXTENSION] = cls(job)
            job.before_stop.append(engine.sync)
        return engine

    @staticmethod
    def of_job(job: controller.Job) -> Engine | None:
        """The engine of ``job``, or None if no mesh of it was ever used for tensors."""
        return job.extensions.get(EXTENSION)

    # ---- batching --------------------------------------------------------------------------
    def append(self, mesh: int, ins: Any) -> None:
        # No lock for an op: list.append is atomic, and flush takes the items it found from
        # the front of the same list, so one appended meanwhile stays for the next batch.
        batch = self.batch
        # A fetch or barrier comes after the deletes of tensors that died before it; so does a
        # plan run (its caller holds every tensor it uses), so that the state a step replaced
        # (the last step's gradients) is freed before the step runs, not at the next flush:
        # its memory, an all-reduce's buffer, is reused.
        if self.dead and type(ins) in _AFTER_DELETES:
            with self.lock:
                self._append_deletes()
                batch.append((mesh, ins))
        else:
            batch.append((mesh, ins))
        if len(batch) >= BATCH_MAX:
            self.flush()
        elif not self.held:  # flush clears it before taking the items: none is left behind
            self.held = True
            try:
                controller.flusher().hold(self)  # sent at the latest a moment from now
            except BaseException:
                self.held = False
                raise

    def flush(self) -> None:
        # The caller's thread and the flusher thread both flush: taking a batch and sending it
        # happen under one lock, so batches go out in the order they were taken.
        with self.send_lock:
            with self.lock:
                self.held = False
                self._append_deletes()
                batch = self.batch
                if not batch:
                    return
                items = tuple(batch)
                del batch[: len(items)]
            if self.job.stopped or self.job.stopping:
                return
            self.batches_sent += 1
            self.job.post(self.ranks, RunBatch(items))

    def mesh_id(self, mesh: Mesh) -> int:
        mid = mesh.__dict__.get("_md_mesh_id")
        if mid is not None:
            return mid
        mid = mesh.__dict__["_md_mesh_id"] = self._mesh_id(mesh)
        return mid

    def _mesh_id(self, mesh: Mesh) -> int:
        key = (mesh.dims, tuple(mesh.ranks))
        mid = self.meshes.get(key)
        if mid is None:
            mid = self.meshes[key] = len(self.meshes)
            sizes = tuple(mesh.sizes.values())
            self.append(-1, ir.DefineMesh(mid, mesh.dims, sizes, key[1]))
        return mid

    def rank_mesh_id(self, rank: int) -> int:
        """The id of the one-rank mesh of ``rank`` (for instructions only it runs)."""
        key = ((), (rank,))
        mid = self.meshes.get(key)
        if mid is None:
            mid = self.meshes[key] = len(self.meshes)
            self.append(-1, ir.DefineMesh(mid, (), (), (rank,)))
        return mid

    def ensure_collectives(self) -> None:
        if self.store is None:
            import torch.distributed as dist

            host = "127.0.0.1"
            if self.job.address.startswith("tcp:"):
                host = self.job.address[4:].rpartition(":")[0].strip("[]")
            self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            self.flush()
            self.job.post(self.ranks, SetupCollectives(host, self.store.port))

    def sync(self, timeout: float | None = None) -> None:
        """Wait until every worker has run what was sent so far (their failure reports have
        then arrived); ``TimeoutError`` after ``timeout`` seconds."""
        if self.job.stopped:
            return
        call_id, fut = self.job.expect(self.ranks, None, whole_job=True)
        self.append(-1, ir.Fetch(call_id, -1, "main", user_line()))
        self.flush()
        fut.get(timeout)

    def new_ref(self) -> int:
        return next(self.refs)

    def delete(self, ref: int, stream: str = "main") -> None:
        """From ``Tensor.__del__``, so from any thread and in the middle of anything (a garbage
        collection): no locks, no sending; the next batch carries the deletion."""
        self.dead.append((ref, stream))

    def _append_deletes(self) -> None:
        """Deletes of collected tensors: after every instruction issued while they lived, and
        before a fetch or barrier issued after they died. Holds the lock."""
        by_stream: dict[str, list[int]] = {}
        for ref, stream in self._take_dead():
            by_stream.setdefault(stream, []).append(ref)
        for stream, refs in by_stream.items():
            self.batch.append((-1, ir.Delete(tuple(refs), stream)))

    def _take_dead(self) -> list[tuple[int, str]]:
        dead = []
        while True:
            try:
                dead.append(self.dead.pop())
            except IndexError:
                return dead


# =============================================================================== tensors


class Tensor(torch.Tensor):
    """A handle on a tensor that lives on every rank of a mesh: ``.mesh``, ``.shape``,
    ``.dtype``, ``.device``, ``.stream``. Torch ops on it run on the workers."""

    _md_desc: tuple  # ("T", shape, stride, dtype, storage offset): for caches
    _md_mesh: Any
    _md_mesh_id: int
    _md_ref: int
    _md_stream: str
    # ("borrowed" | "lent", Borrow) or ("dropped", file:line); None: a plain tensor
    _md_state: tuple | None = None
    _md_engine: Engine = None  # type: ignore[assignment]  # None: __new__ failed (see __del__)

    @staticmethod
    def __new__(
        cls,
        meta: torch.Tensor | None,
        mesh: Any,
        engine: Engine,
        ref: int,
        stream: str,
        desc: tuple | None = None,
    ):
        """From a meta tensor, or (the fast path) from its description alone."""
        if desc is None:
            desc = ("T", *_desc(meta))
        if cls is Tensor:
            t = _maker(desc, engine.device)[1]()
        else:
            _, shape, stride, dtype, offset = desc
            t = torch.Tensor._make_wrapper_subclass(
                cls, shape, strides=stride, storage_offset=offset, dtype=dtype, device=engine.device
            )
        t.__dict__ = {
            "_md_desc": desc,
            "_md_mesh": mesh,
            "_md_mesh_id": engine.mesh_id(mesh),
            "_md_engine": engine,
            "_md_ref": ref,
            "_md_stream": stream,
        }
        return t

    @property
    def _md_meta(self) -> torch.Tensor:
        """A meta tensor of this tensor's shape, stride and dtype (for shape propagation)."""
        return _new_meta(self._md_desc[1:])

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def mesh(self) -> Any:
        return self._md_mesh

    @property
    def stream(self) -> str:
        return self._md_stream

    def reduce(self, dims: Any = (), reduction: str = "sum", scatter: bool = False) -> Tensor:
        """A collective over the mesh dims ``dims`` (a name or tuple; ``()`` = all)."""
        return _reduce(self, dims, reduction, scatter, in_place=False, line=user_line())

    def reduce_(self, dims: Any = (), reduction: str = "sum", scatter: bool = False) -> Tensor:
        return _reduce(self, dims, reduction, scatter, in_place=True, line=user_line())

    def to_mesh(self, mesh: Any) -> Tensor:
        """A copy of this tensor on ``mesh`` (e.g. the next pipeline stage): the rank at each
        coordinate receives from the rank at the same coordinate here; dims and sizes must
        match. The copy is independent of the source."""
        return _transfer(self, mesh, user_line())

    def tolist(self):
        raise TypeError(
            "tolist() needs the tensor's value, which lives on the workers: fetch it first, "
            "e.g. md.inspect(t).tolist()"
        )

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: ARG002 - torch's signature
        return (
            f"md.Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, mesh={self._md_mesh!r}, "
            f"stream={self._md_stream!r})"
        )

    # torch's binary operators turn a TypeError into NotImplemented (and Python then says only
    # "unsupported operand"); these keep our message (local tensor, other mesh, ...).
    def __add__(self, other):
        return torch.add(self, other)

    def __sub__(self, other):
        return torch.sub(self, other)

    def __mul__(self, other):
        return torch.mul(self, other)

    def __truediv__(self, other):
        return torch.div(self, other)

    def __floordiv__(self, other):
        return torch.floor_divide(self, other)

    def __mod__(self, other):
        return torch.remainder(self, other)

    def __pow__(self, other):
        return torch.pow(self, other)

    def __matmul__(self, other):
        return torch.matmul(self, other)

    def __and__(self, other):
        return torch.bitwise_and(self, other)

    def __or__(self, other):
        return torch.bitwise_or(self, other)

    def __xor__(self, other):
        return torch.bitwise_xor(self, other)

    def __lt__(self, other):
        return torch.lt(self, other)

    def __le__(self, other):
        return torch.le(self, other)

    def __gt__(self, other):
        return torch.gt(self, other)

    def __ge__(self, other):
        return torch.ge(self, other)

    def __eq__(self, other):
        return torch.eq(self, other)

    def __ne__(self, other):
        return torch.ne(self, other)

    def __iadd__(self, other):
        return self.add_(other)

    def __isub__(self, other):
        return self.sub_(other)

    def __imul__(self, other):
        return self.mul_(other)

    def __itruediv__(self, other):
        return self.div_(other)

    __hash__ = torch.Tensor.__hash__

    def __del__(self) -> None:
        engine = self._md_engine
        if engine is not None:
            engine.dead.append((self._md_ref, self._md_stream))  # engine.delete, inlined

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "an md.Tensor is a handle on values that live on the workers; it cannot be pickled "
            "(use md.fetch / md.inspect to get a local copy)"
        )


def _subclass_dispatch(cls, func, types, args=(), kwargs=None):
    return _dispatch(func, args, kwargs or {}, None)


# torch.Tensor.__init_subclass__ wraps a subclass's __torch_dispatch__ in
# torch._disable_dynamo, which costs ~50 us per op here -- more than everything else the
# controller does for an op. md.Tensor never runs under torch.compile, so set it unwrapped.
Tensor.__torch_dispatch__ = classmethod(_subclass_dispatch)


# =============================================================================== dispatch

_state = threading.local()


def _active_mesh() -> Any:
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


def active_mesh() -> Any:
    """The mesh of the innermost ``with pm.activate():`` of this thread, or None."""
    return _active_mesh()


_FACTORY_DEVICE_OPS = {"aten::lift_fresh", "aten::lift_fresh_copy"}
# Ops that turn a tensor into a Python value (t.item(), bool(t), ...): not on a mesh tensor.
_NEEDS_VALUE = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"}


def _dispatch(func, args: tuple, kwargs: dict, active: Any) -> Any:
    """Record ``func(*args, **kwargs)`` for the workers; return handles of its outputs.

    The fast path covers flat arguments (tensors, scalars, lists of scalars) of an op seen
    before with the same shapes: no pytree walks, no meta execution."""
    info = _func_info.get(id(func))
    if info is None:
        info = _new_func_info(func)
    pointwise = info[1]  # the output's shape cannot depend on a scalar's value
    stream = _current_stream() if _streams_used else "main"
    mesh = first = None
    key: Any = [id(func)]
    wargs = []
    for a in args:
        kind = type(a)
        if kind in _SCALAR_TYPES:  # for a pointwise op only the type matters (type promotion)
            key.append(kind if pointwise else a)
            wargs.append(a)
        elif isinstance(a, Tensor):
            if a._md_state is not None or a._md_stream != stream:
                return _dispatch_general(func, args, kwargs, active)  # checks, with details
            if first is None:
                first, mesh = a, a._md_mesh
            elif a._md_mesh is not mesh and a._md_mesh != mesh:
                return _dispatch_general(func, args, kwargs, active)  # raises, with the details
            key.append(a._md_desc)
            wargs.append(_tuple_new(ir.Ref, (a._md_ref,)))
        elif isinstance(a, torch.device) or (
            isinstance(a, (torch.Tensor, list, tuple, dict)) and _holds_tensor(a)
        ):
            return _dispatch_general(func, args, kwargs, active)  # (devices are rewritten)
        else:
            key.append(tuple(a) if isinstance(a, list) else a)
            wargs.append(a)
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, (torch.Tensor, torch.device, list, tuple, dict, torch.Generator)):
                return _dispatch_general(func, args, kwargs, active)
        key.extend(kwargs.items())
    if mesh is None:
        return _dispatch_general(func, args, kwargs, active)
    key = tuple(key)
    try:
        hit = _fast_cache.get(key)
    except TypeError:  # an unhashable argument: no caching
        key = hit = None
    if hit is None:
        return _dispatch_general(func, args, kwargs, active, fast_key=key)
    return _emit(hit, args, first, mesh, tuple(wargs), kwargs, stream, 3)


def _emit(
    hit: tuple,
    args: tuple,
    first: Tensor,
    mesh: Any,
    wargs: tuple,
    kwargs: dict,
    stream: str,
    depth: int,
) -> Any:
    """The fast path's end: the output handle and the instruction, from the cache entry
    ``hit``; ``first`` is the first tensor argument, ``wargs`` the arguments for the workers.
    The user's line is looked for from ``depth`` frames up (the frames below are ours)."""
    op, out = hit
    engine = first._md_engine  # mesh's engine
    if type(out) is int:  # the op returns its input #out (in place)
        result = args[out]
        outs = (result._md_ref,)
    else:
        ref = next(engine.refs)
        desc, device, make = out
        if device is engine.device:  # Tensor(None, mesh, engine, ref, stream, desc), inlined
            result = make()
            result.__dict__ = {
                "_md_desc": desc,
                "_md_mesh": mesh,
                "_md_mesh_id": first._md_mesh_id,
                "_md_engine": engine,
                "_md_ref": ref,
                "_md_stream": stream,
            }
        else:
            result = Tensor(None, mesh, engine, ref, stream, desc)
        outs = (ref,)
    engine.append(
        first._md_mesh_id,
        _tuple_new(ir.CallOp, (op, wargs, kwargs, outs, stream, user_line(depth))),
    )
    return result


_tuple_new = tuple.__new__  # a named tuple without the Python-level __new__ of its class


def _holds_tensor(a: Any) -> bool:
    return isinstance(a, torch.Tensor) or any(
        isinstance(x, torch.Tensor) for x in pytree.tree_leaves(a)
    )


_SCALAR_TYPES = frozenset((int, float, bool, complex))

# id(op overload) -> (the op overload, whether it is pointwise); the op is kept so that its
# id is not reused (and the fast cache's keys, which hold that id, stay its own).
_func_info: dict[int, tuple[Any, bool]] = {}


def _new_func_info(func) -> tuple[Any, bool]:
    info = _func_info[id(func)] = (func, torch.Tag.pointwise in getattr(func, "tags", ()))
    return info


# (id(func), argument descriptions) -> (op name, output): (the description of a single new
# output tensor, the device and the wrapper maker of ``_maker``), or the index of the input
# an in-place op returns.
_fast_cache: dict[tuple, tuple] = {}


def _dispatch_general(func, args: tuple, kwargs: dict, active: Any, fast_key=None) -> Any:
    name = func._schema.name
    op = f"{name}.{func._overloadname}"
    flat, spec = pytree.tree_flatten((args, kwargs))
    mesh = None
    first = None
    local = None
    for i, x in enumerate(flat):
        if isinstance(x, Tensor):
            if mesh is None:
                mesh, first = x._md_mesh, i
            elif x._md_mesh != mesh:
                raise TypeError(
                    f"{op}: arguments on two meshes: argument #{first} is on {mesh!r}, "
                    f"argument #{i} on {x._md_mesh!r} (move one with t.to_mesh(...))"
                )
        elif isinstance(x, torch.Tensor) and local is None:
            local = i
    for x in flat:
        if isinstance(x, torch.Generator):
            # Its state would be copied to the workers whenever the batch is sent, and the
            # generator here would not advance: each run could draw different numbers.
            raise TypeError(
                f"{op}: a torch.Generator cannot drive an op on the mesh (the workers draw "
                "from their own generators; seed them with torch.manual_seed under "
                "activation), and under pm.activate() this op runs on the mesh. Make data "
                "from a local generator before activating, then md.distribute / md.to_mesh it"
            )
    if name in _FACTORY_DEVICE_OPS and mesh is None and active is not None:
        return _lift(flat[local], active)
    if mesh is None:
        mesh = active
    if local is not None:
        raise TypeError(
            f"{op}: argument #{local} is a local tensor (shape {tuple(flat[local].shape)}) but "
            f"this op runs on the mesh {mesh!r}: put it on the mesh first with "
            f"md.to_mesh(t, mesh)"
        )
    if first is not None:
        written = {id(args[i]) for i, _ in _written_args(func) if i < len(args)}
        written |= {id(kwargs[n]) for _, n in _written_args(func) if n in kwargs}
        for i, x in enumerate(flat):
            if isinstance(x, Tensor):
                _check_usable(x, op, i, write=id(x) in written)
    engine = Engine.of(mesh)
    meta_flat = []
    worker_flat = []
    for x in flat:
        if isinstance(x, Tensor):
            meta_flat.append(x._md_meta)
            worker_flat.append(ir.Ref(x._md_ref))
        elif isinstance(x, torch.device):
            meta_flat.append(torch.device("meta"))
            worker_flat.append(ir.WORKER_DEVICE)
        else:
            meta_flat.append(x)
            worker_flat.append(x)
    worker_args, worker_kwargs = pytree.tree_unflatten(worker_flat, spec)
    if first is None:  # a factory: make it on meta here, on the worker's device there
        worker_kwargs["device"] = ir.WORKER_DEVICE
    known = _known_inputs(func, flat) if first is not None else None
    if name in _NEEDS_VALUE:
        if known is not None:  # the controller knows the value: nothing to ask the workers
            local_args, local_kwargs = pytree.tree_unflatten(known, spec)
            return func(*local_args, **local_kwargs)
        raise TypeError(
            f"{op} needs the tensor's value, which lives on the workers: fetch it first, e.g. "
            f"md.inspect(t).item() (or md.inspect(t, **coords) for another rank)"
        )
    out_leaves, out_spec = _output_meta(func, op, flat, meta_flat, spec, first is None)
    outs: list[int | None] = []
    results = []
    for leaf in out_leaves:
        if isinstance(leaf, _Alias):  # an in-place op returning its input
            same = flat[leaf.index]
            outs.append(same._md_ref)
            results.append(same)
            continue
        if not isinstance(leaf, torch.Tensor):
            results.append(leaf)
            continue
        ref = engine.new_ref()
        outs.append(ref)
        results.append(Tensor(leaf, mesh, engine, ref, _current_stream()))
    mid = engine.mesh_id(mesh)
    engine.append(
        mid, ir.CallOp(op, worker_args, worker_kwargs, tuple(outs), _current_stream(), user_line())
    )
    if first is not None:
        _track_known(func, args, kwargs, flat, spec, known, out_leaves, results)
        if known is not None:
            fast_key = None  # the fast path would skip the tracking
    if fast_key is not None and out_spec.is_leaf() and len(_fast_cache) < _META_CACHE_MAX:
        leaf = out_leaves[0]
        if isinstance(leaf, _Alias):
            same = flat[leaf.index]
            _fast_cache[fast_key] = (op, next(j for j, a in enumerate(args) if a is same))
        elif isinstance(leaf, torch.Tensor):
            desc = results[0]._md_desc
            _fast_cache[fast_key] = (op, (desc, *_maker(desc, engine.device)))
    return pytree.tree_unflatten(results, out_spec)


# ---- values the controller knows ----------------------------------------------------------
# A small tensor made here from a constant (``torch.tensor(0.0)`` under activation: an
# optimizer's step count) has the same value on every rank, and so has every deterministic op
# whose tensor inputs are all such tensors. The controller keeps that value beside the handle
# (``_md_state = ("known", local tensor)``), computes it along, and answers ``.item()`` from it
# without asking the workers (torch's Adam/AdamW call ``step_t.item()`` every step). It stops
# being known -- never stale -- when anything the controller does not compute writes it (an op
# with an unknown input, a reduce), when a view of it is taken (a write through the view would
# not be seen), or when it is borrowed.
KNOWN_MAX_NUMEL = 16


def _known(x: Any) -> Any:
    state = x._md_state if isinstance(x, Tensor) else None
    return state[1] if state is not None and state[0] == "known" else None


def _known_inputs(func, flat: list) -> list | None:
    """``flat`` with each mesh tensor replaced by its known value, or None if one is not known
    (or the op is random)."""
    if torch.Tag.nondeterministic_seeded in func.tags:
        return None
    out = []
    for x in flat:
        if isinstance(x, Tensor):
            value = _known(x)
            if value is None:
                return None
            out.append(value)
        elif isinstance(x, torch.device):
            out.append(torch.device("cpu"))
        else:
            out.append(x)
    return out


def _forget(t: Tensor) -> None:
    if _known(t) is not None:
        t._md_state = None


def _track_known(func, args, kwargs, flat, spec, known, out_leaves, results) -> None:
    written = [args[i] for i, _ in _written_args(func) if i < len(args)]
    written += [kwargs[n] for _, n in _written_args(func) if n in kwargs]
    is_view = not written and any(r.alias_info is not None for r in func._schema.returns)
    if known is None or is_view:
        for x in flat:  # written by what the controller does not compute, or viewed
            if isinstance(x, Tensor) and (is_view or any(x is w for w in written)):
                _forget(x)
        return
    local_args, local_kwargs = pytree.tree_unflatten(known, spec)
    try:
        value = func(*local_args, **local_kwargs)  # writes the known inputs it writes
    except Exception:  # noqa: BLE001 - the workers will say what is wrong; forget the inputs
        for x in flat:
            if isinstance(x, Tensor):
                _forget(x)
        return
    values = pytree.tree_leaves(value)
    for leaf, result, v in zip(out_leaves, results, values):
        if isinstance(leaf, _Alias) or not isinstance(result, Tensor):
            continue
        if isinstance(v, torch.Tensor) and v.numel() <= KNOWN_MAX_NUMEL:
            result._md_state = ("known", v)


# Output metadata by (op, input metadata, other arguments): running an op on meta tensors goes
# through torch's Python reference implementations (hundreds of microseconds); a loop (a
# training step) repeats the same ops on the same shapes, so remember what they gave.
_meta_cache: dict[tuple, tuple] = {}
_META_CACHE_MAX = 100_000


def _key_part(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.storage_offset())
    if isinstance(x, list):
        return ("list", *map(_key_part, x))
    return x


def _output_meta(func, op: str, flat: list, meta_flat: list, spec: Any, factory: bool):
    """The output leaves as meta tensors, non-tensors, or ``_Alias(i)`` for "the input
    flat[i]" (in-place ops); and the output pytree spec."""
    try:
        key = (func, spec, *map(_key_part, meta_flat))
        hash(key)
    except TypeError:
        key = None
    hit = _meta_cache.get(key) if key is not None else None
    if hit is not None:
        leaves, out_spec = hit
        return [_new_meta(x) if type(x) is tuple else x for x in leaves], out_spec
    meta_args, meta_kwargs = pytree.tree_unflatten(meta_flat, spec)
    if factory:
        meta_kwargs["device"] = torch.device("meta")
    try:
        meta_out = func(*meta_args, **meta_kwargs)
    except NotImplementedError as e:
        raise TypeError(
            f"{op} cannot run on mesh tensors eagerly: its output shape is not known without "
            f"the data ({e})"
        ) from None
    out_leaves, out_spec = pytree.tree_flatten(meta_out)
    position = {id(m): i for i, m in enumerate(meta_flat) if isinstance(flat[i], Tensor)}
    leaves: list = []
    cached: list = []
    for leaf in out_leaves:
        if isinstance(leaf, torch.Tensor):
            i = position.get(id(leaf))
            if i is not None:
                leaves.append(_Alias(i))
                cached.append(_Alias(i))
                continue
            cached.append(_desc(leaf))
        else:
            cached.append(leaf)
        leaves.append(leaf)
    if key is not None and len(_meta_cache) < _META_CACHE_MAX:
        _meta_cache[key] = (tuple(cached), out_spec)
    return leaves, out_spec


class _Alias:
    """An output that is input ``index`` (of the flattened arguments) itself."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _desc(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.storage_offset())


# (description, device) -> (device, a maker of md.Tensor wrappers of that description): the
# arguments of _make_wrapper_subclass, bound once (leaving out default strides and offset).
_makers: dict[tuple, tuple] = {}


def _maker(desc: tuple, device: torch.device) -> tuple:
    found = _makers.get((desc, device))
    if found is None:
        _, shape, stride, dtype, offset = desc
        kwargs: dict[str, Any] = {"dtype": dtype, "device": device}
        if offset or stride != torch.empty(shape, device="meta").stride():
            kwargs["strides"] = stride
            kwargs["storage_offset"] = offset
        found = (
            device,
            functools.partial(torch.Tensor._make_wrapper_subclass, Tensor, shape, **kwargs),
        )
        if len(_makers) < _META_CACHE_MAX:
            _makers[(desc, device)] = found
    return found


def _new_meta(desc: tuple) -> torch.Tensor:
    shape, stride, dtype, offset = desc
    t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return t if not offset else t.as_strided(shape, stride, offset)


def _lift(value: torch.Tensor, mesh: Any) -> Tensor:
    """A local tensor (``torch.tensor(data)`` under activation) copied to every rank."""
    engine = Engine.of(mesh)
    ref = engine.new_ref()
    meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    out = Tensor(meta, mesh, engine, ref, _current_stream())
    if value.numel() <= KNOWN_MAX_NUMEL and value.device.type == "cpu":
        out._md_state = ("known", value.detach().clone())
    engine.append(
        engine.mesh_id(mesh),
        ir.CallOp(
            "aten::_to_copy.default",
            (value.detach().clone(),),
            {"device": ir.WORKER_DEVICE},
            (ref,),
            _current_stream(),
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
    stream = _current_stream()
    first = values[0]
    meta = torch.empty_strided(first.shape, first.stride(), dtype=first.dtype, device="meta")
    out = Tensor(meta, mesh, engine, ref, stream)
    engine.flush()  # what was issued before goes first, on every worker
    with engine.send_lock:
        for rank, value in zip(mesh.ranks, values, strict=True):
            item = ir.CallOp(
                "aten::_to_copy.default",
                (value.detach().contiguous(),),
                {"device": ir.WORKER_DEVICE},
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
    _check_usable(t, "distribute", 0, write=False)
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
                call = ir.CallOp("aten::clone.default", (ir.Ref(src),), {}, (dst,), stream, line)
            else:
                call = ir.CallOp(
                    "aten::narrow_copy.default",
                    (ir.Ref(src), d, start, length),
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
            engine.append(mid, ir.Delete(tuple(temps), stream))
    return out


class Stream:
    """A named stream of commands: commands on one stream run in order on every worker,
    streams run concurrently. ``md.Stream("comms")``; ``with s.activate():``."""

    def __init__(self, name: str):
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"a stream name must be an identifier, got {name!r}")
        self.name = name

    @contextlib.contextmanager
    def activate(self) -> Iterator[Stream]:
        global _streams_used
        _streams_used = True
        stack = _stream_stack()
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()

    def borrow(self, t: Tensor, mutable: bool = False) -> tuple[Tensor, Borrow]:
        """Lend ``t`` to this stream: returns (the tensor on this stream, the borrow). While
        borrowed, ``t``'s stream may read but not write it (``mutable=False``; this stream may
        only read it too), or not touch it at all (``mutable=True``). ``borrow.drop()`` ends
        it."""
        line = user_line()
        if not isinstance(t, Tensor):
            raise TypeError(f"borrow needs an md.Tensor, got {type(t).__name__}")
        _check_usable(t, "borrow", 0, write=mutable)
        if t._md_stream == self.name:
            raise TypeError(f"borrow: the tensor is already on stream {self.name!r}")
        engine = t._md_engine
        ref = engine.new_ref()
        lent = Tensor(None, t._md_mesh, engine, ref, self.name, t._md_desc)
        borrow = Borrow(t, lent, mutable, line)
        lent._md_state = ("lent", borrow)
        t._md_state = ("borrowed", borrow)
        engine.append(
            t._md_mesh_id,
            ir.BorrowBegin(t._md_ref, ref, t._md_stream, self.name, engine.new_ref(), line),
        )
        return lent, borrow

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("md.Stream", self.name))

    def __repr__(self) -> str:
        return f"md.Stream({self.name!r})"


class Borrow:
    """A tensor lent to another stream; ``drop()`` gives it back."""

    def __init__(self, origin: Tensor, lent: Tensor, mutable: bool, line: str):
        self.origin = origin
        self.lent = lent
        self.mutable = mutable
        self.line = line
        self.dropped_at: str | None = None

    def drop(self) -> None:
        line = user_line()
        if self.dropped_at is not None:
            raise TypeError(f"this borrow was already dropped at {self.dropped_at}")
        self.dropped_at = line
        lent, origin = self.lent, self.origin
        engine = lent._md_engine
        lent._md_state = ("dropped", line)
        origin._md_state = None
        engine.append(
            lent._md_mesh_id,
            ir.BorrowEnd(lent._md_ref, origin._md_stream, lent._md_stream, engine.new_ref(), line),
        )

    def __repr__(self) -> str:
        state = f"dropped at {self.dropped_at}" if self.dropped_at else "active"
        return f"<md.Borrow of {self.origin._md_stream!r} -> {self.lent._md_stream!r}, {state}>"


_MAIN = Stream("main")


def _stream_stack() -> list:
    stack = getattr(_state, "streams", None)
    if stack is None:
        stack = _state.streams = []
    return stack


def get_active_stream() -> Stream:
    """The stream new commands go to (``main`` unless a ``with s.activate():`` says else)."""
    stack = _stream_stack()
    return stack[-1] if stack else _MAIN


def _current_stream() -> str:
    stack = getattr(_state, "streams", None)
    return stack[-1].name if stack else "main"


_streams_used = False  # until a stream is activated, every thread's stream is "main"


def _check_usable(t: Tensor, op: str, i: int, write: bool) -> None:
    """The borrow rules, checked before anything is sent."""
    state = t._md_state
    if state is not None:
        kind, info = state
        if kind == "dropped":
            raise TypeError(
                f"{op}: argument #{i} was a borrowed tensor whose borrow was dropped at "
                f"{info}; it cannot be used any more"
            )
        if kind == "borrowed":
            if info.mutable:
                raise TypeError(
                    f"{op}: argument #{i} is lent to stream {info.lent._md_stream!r} (a mutable "
                    f"borrow at {info.line}); it cannot be used until the borrow is dropped"
                )
            if write:
                raise TypeError(
                    f"{op}: argument #{i} is lent to stream {info.lent._md_stream!r} (borrowed "
                    f"at {info.line}); it can be read but not written until the borrow is "
                    f"dropped"
                )
        if kind == "lent" and write and not info.mutable:
            raise TypeError(
                f"{op}: argument #{i} was borrowed immutably (at {info.line}); borrow it with "
                f"mutable=True to write it"
            )
    stream = _current_stream()
    if t._md_stream != stream:
        raise TypeError(
            f"{op}: argument #{i} is on stream {t._md_stream!r} but the active stream is "
            f"{stream!r}: borrow it (md.Stream({stream!r}).borrow(t)) to use it here"
        )


_written: dict[Any, tuple] = {}


def _written_args(func) -> tuple:
    """Positions and names of the arguments ``func`` writes (in-place and out= ops)."""
    found = _written.get(func)
    if found is None:
        found = _written[func] = tuple(
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    return found


class _MeshMode(TorchDispatchMode):
    """Active under ``pm.activate()``: factory ops create mesh tensors."""

    def __init__(self, mesh: Any):
        super().__init__()
        self.mesh = mesh

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ in torch._disable_dynamo: ~50 us per op here
        # (see Tensor.__torch_dispatch__ below); nothing here runs under torch.compile.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "meta":
            return func(*args, **kwargs)  # shape bookkeeping (ours or the user's) stays here
        for a in args:  # the common case, without walking the arguments' pytree
            if isinstance(a, Tensor):
                return _dispatch(func, args, kwargs, self.mesh)
        flat = pytree.tree_leaves((args, kwargs))
        if any(isinstance(x, Tensor) for x in flat):
            return _dispatch(func, args, kwargs, self.mesh)
        if any(isinstance(x, torch.Tensor) for x in flat):
            if func._schema.name in _FACTORY_DEVICE_OPS:
                return _dispatch(func, args, kwargs, self.mesh)
            return func(*args, **kwargs)  # local tensors stay local
        if _is_factory(func):
            return _dispatch(func, args, kwargs, self.mesh)
        return func(*args, **kwargs)  # no tensors in or out (profiler marks and such)


_factories: dict[Any, bool] = {}


def _is_factory(func) -> bool:
    """An op that makes tensors from nothing: it takes a ``device`` and returns tensors."""
    known = _factories.get(func)
    if known is None:
        schema = func._schema
        known = _factories[func] = any(a.name == "device" for a in schema.arguments) and any(
            "Tensor" in str(r.type) for r in schema.returns
        )
    return known


@contextlib.contextmanager
def activate(mesh: Any) -> Iterator[Any]:
    """``with pm.activate():`` -- torch calls create and run on every rank of ``mesh``."""
    if mesh._job.stopped:
        raise RuntimeError("this process mesh has been stopped")
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(mesh)
    real_seed = torch.manual_seed

    def manual_seed(seed: int):
        engine = Engine.of(mesh)
        engine.append(engine.mesh_id(mesh), ir.Seed(int(seed), user_line()))
        return real_seed(seed)

    torch.manual_seed = manual_seed
    try:
        with _MeshMode(mesh):
            yield mesh
    finally:
        torch.manual_seed = real_seed
        stack.pop()
        engine = Engine.of_job(mesh._job)
        if engine is not None:
            engine.flush()


def mesh_rank(mesh: Any, dims: Any) -> Tensor:
    """``mesh.rank(dims)``: each rank's coordinate along ``dims``, as an int64 mesh tensor."""
    if _active_mesh() is None:
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
    stream = _current_stream()
    out = Tensor(torch.empty((), dtype=torch.int64, device="meta"), mesh, engine, ref, stream)
    engine.append(
        mid,
        ir.CallOp(
            "aten::scalar_tensor.default",
            (ir.MeshCoord(mid, dims),),
            {"dtype": torch.int64, "device": ir.WORKER_DEVICE},
            (ref,),
            stream,
            user_line(),
        ),
    )
    return out


def to_mesh(obj: Any, mesh: Any) -> Any:
    """Put local data on ``mesh``: a local tensor or a pytree of them is copied to every rank;
    an ``nn.Module`` gets its parameters and buffers on the mesh (returned, changed in place);
    mesh tensors are copied to ``mesh`` with ``Tensor.to_mesh``."""
    if isinstance(obj, torch.nn.Module):
        for module in obj.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    moved = to_mesh(p.detach(), mesh)
                    module._parameters[name] = torch.nn.Parameter(moved, p.requires_grad)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = to_mesh(b, mesh)
        return obj
    if isinstance(obj, Tensor):
        return obj.to_mesh(mesh)
    if isinstance(obj, torch.Tensor):
        out = _lift(obj, mesh)
        if obj.requires_grad:
            out.requires_grad_(True)
        return out
    return pytree.tree_map(lambda x: to_mesh(x, mesh) if isinstance(x, torch.Tensor) else x, obj)


def _transfer(t: Tensor, dest: Any, line: str) -> Tensor:
    """``t.to_mesh(dest)``: rank at coordinates c of ``t.mesh`` sends to the rank at c of
    ``dest``."""
    _check_usable(t, "to_mesh", 0, write=False)
    src = t._md_mesh
    if dest._job is not src._job:
        raise TypeError("to_mesh between process meshes of different allocations is not supported")
    if dict(src.sizes) != dict(dest.sizes):
        raise ValueError(
            f"to_mesh needs the same dims and sizes on both meshes: {src.sizes} vs {dest.sizes}"
        )
    engine = t._md_engine
    engine.ensure_collectives()
    order = [src.dims.index(d) for d in dest.dims]
    src_ranks = src._ranks.transpose(order).reshape(-1).tolist()  # in dest's row-major order
    pairs = tuple(zip(src_ranks, dest.ranks))
    ref = engine.new_ref()
    meta = t._md_meta
    out = Tensor(torch.empty_like(meta), dest, engine, ref, t._md_stream)
    dtype = str(meta.dtype).removeprefix("torch.")
    engine.append(
        -1,
        ir.Transfer(t._md_ref, ref, pairs, tuple(meta.shape), dtype, t._md_stream, line),
    )
    return out


# =============================================================================== collectives


def reduce(tree: Any, dims: Any = (), reduction: str = "sum", scatter: bool = False) -> Any:
    """``t.reduce(...)`` for every mesh tensor of a pytree (other leaves are kept)."""
    line = user_line()
    return pytree.tree_map(
        lambda t: _reduce(t, dims, reduction, scatter, False, line) if isinstance(t, Tensor) else t,
        tree,
    )


def reduce_(tree: Any, dims: Any = (), reduction: str = "sum", scatter: bool = False) -> Any:
    """``t.reduce_(...)`` for every mesh tensor of a pytree; returns the tree."""
    line = user_line()
    for t in pytree.tree_leaves(tree):
        if isinstance(t, Tensor):
            _reduce(t, dims, reduction, scatter, True, line)
    return tree


def _reduce(t: Tensor, dims: Any, reduction: str, scatter: bool, in_place: bool, line: str):
    if not isinstance(t, Tensor):
        raise TypeError(f"reduce needs an md.Tensor, got {type(t).__name__}")
    _check_usable(t, "reduce_" if in_place else "reduce", 0, write=in_place)
    if in_place:
        _forget(t)  # the ranks' values are combined: no longer what the controller computed
    mesh = t._md_mesh
    if isinstance(dims, str):
        dims = (dims,)
    dims = tuple(dims) or tuple(mesh.dims)
    for d in dims:
        if d not in mesh.dims:
            raise KeyError(f"reduce over {d!r}: the tensor's mesh has dims {mesh.dims}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"reduce over {dims}: a dim is named twice")
    if reduction not in ir.REDUCTIONS:
        raise ValueError(f"reduction must be one of {ir.REDUCTIONS}, got {reduction!r}")
    n = mesh.size(dims)
    meta = t._md_meta
    if reduction == "avg" and not (meta.is_floating_point() or meta.is_complex()):
        raise TypeError(f"reduction 'avg' needs a floating point tensor, got {meta.dtype}")
    if reduction == "stack":
        if scatter:
            if meta.dim() == 0 or meta.shape[0] % n:
                raise ValueError(
                    f"stack+scatter (all-to-all) over {dims} needs dim 0 divisible by {n}, "
                    f"got shape {tuple(meta.shape)}"
                )
            out_meta = torch.empty_like(meta)
        else:
            out_meta = torch.empty((n, *meta.shape), dtype=meta.dtype, device="meta")
    elif scatter:
        if meta.dim() == 0 or meta.shape[0] % n:
            raise ValueError(
                f"{reduction}+scatter (reduce-scatter) over {dims} needs dim 0 divisible by "
                f"{n}, got shape {tuple(meta.shape)}"
            )
        out_meta = torch.empty(
            (meta.shape[0] // n, *meta.shape[1:]), dtype=meta.dtype, device="meta"
        )
    else:
        out_meta = torch.empty_like(meta)
    if in_place and tuple(out_meta.shape) != tuple(meta.shape):
        raise ValueError(
            f"reduce_ with {reduction}{'+scatter' if scatter else ''} changes the shape "
            f"{tuple(meta.shape)} -> {tuple(out_meta.shape)}; use the out-of-place reduce()"
        )
    engine = t._md_engine
    engine.ensure_collectives()
    if in_place:
        out, ref = t, t._md_ref
    else:
        ref = engine.new_ref()
        out = Tensor(out_meta, mesh, engine, ref, t._md_stream)
    dtype = str(meta.dtype).removeprefix("torch.")
    engine.append(
        t._md_mesh_id,
        ir.Reduce(
            t._md_ref,
            ref,
            t._md_mesh_id,
            dims,
            reduction,
            scatter,
            tuple(meta.shape),
            dtype,
            t._md_stream,
            line,
        ),
    )
    return out


# =============================================================================== fetching


def fetch(obj: Any, **coords: int) -> Future:
    """A future of a local CPU copy of one rank's value of ``obj`` (a mesh tensor or a pytree
    of them): no coords -- the first rank; else every dim of the mesh named."""
    line = user_line()
    if isinstance(obj, Tensor):
        return _fetch_one(obj, coords, line)
    leaves, spec = pytree.tree_flatten(obj)
    futures = [_fetch_one(x, coords, line) if isinstance(x, Tensor) else None for x in leaves]
    return _Gathered(futures, leaves, spec)


class _Gathered(Future):
    """The future of a pytree of fetches."""

    __slots__ = ("_parts",)

    def __init__(self, futures: list, leaves: list, spec: Any):
        super().__init__()
        self._parts = (futures, leaves, spec)

    def get(self, timeout: float | None = None) -> Any:
        if not self.done():
            futures, leaves, spec = self._parts
            try:
                values = [f.get(timeout) if f is not None else x for f, x in zip(futures, leaves)]
                self.set_result(pytree.tree_unflatten(values, spec))
            except TimeoutError:
                raise
            except BaseException as e:  # noqa: BLE001 - the first failure is the result
                self.set_exception(e)
        return super().get(timeout)

    result = get


def _fetch_one(t: Tensor, coords: dict, line: str) -> Future:
    state = t._md_state
    if state is not None and (
        state[0] == "dropped" or (state[0] == "borrowed" and state[1].mutable)
    ):
        _check_usable(t, "fetch", 0, write=False)  # raises
    mesh = t._md_mesh
    if coords:
        missing = [d for d in mesh.dims if d not in coords]
        unknown = [d for d in coords if d not in mesh.dims]
        if unknown or missing:
            raise KeyError(
                f"fetch coordinates must name every dim of {mesh.dims}; "
                f"unknown: {unknown}, missing: {missing}"
            )
        index = mesh.index_of(**coords)
    else:
        index = 0
    rank = mesh.ranks[index]
    engine = t._md_engine
    call_id, fut = engine.job.expect((rank,), lambda values: values[0], whole_job=True)
    engine.append(engine.rank_mesh_id(rank), ir.Fetch(call_id, t._md_ref, t._md_stream, line))
    engine.flush()
    return fut


def inspect(obj: Any, **coords: int) -> Any:
    """``fetch(obj, **coords).get()``."""
    return fetch(obj, **coords).get()


def sync(mesh: Any, timeout: float | None = None) -> None:
    """Wait until every worker of ``mesh``'s allocation has run what was sent so far (their
    failure reports have then arrived); ``TimeoutError`` after ``timeout`` seconds."""
    engine = Engine.of_job(mesh._job)
    if engine is not None:
        engine.sync(timeout)


def show(obj: Any, **coords: int) -> None:
    """Print one rank's value of ``obj`` with its coordinates."""
    value = inspect(obj, **coords)
    where = ", ".join(f"{d}={c}" for d, c in coords.items()) or "first rank"
    print(f"[{where}] {value}")
