"""Torch ops on mesh tensors: ``__torch_dispatch__`` records each op as a plan instruction
for the workers and returns handles of its outputs, with their shapes from ``meta.py``.

The fast path covers an op seen before with the same argument descriptions: its output is
made from the cached description, with no pytree walk and no meta execution. Values the
controller knows (see ``handle.known_value``) are computed along here.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from monarch_dsl import isa
from monarch_dsl.frames import user_line
from monarch_dsl.isa.opnames import written_args
from monarch_dsl.tensor import active as _active
from monarch_dsl.tensor.active import check_usable, current_stream
from monarch_dsl.tensor.engine import Engine
from monarch_dsl.tensor.handle import (
    KNOWN_MAX_NUMEL,
    META_CACHE_MAX,
    Tensor,
    follow,
    forget_known,
    known_value,
    maker,
)
from monarch_dsl.tensor.meta import Alias, output_meta
from monarch_dsl.tensor.movement import lift

_FACTORY_DEVICE_OPS = {"aten::lift_fresh", "aten::lift_fresh_copy"}
# Ops that turn a tensor into a Python value (t.item(), bool(t), ...): not on a mesh tensor.
_NEEDS_VALUE = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero", "aten::allclose"}


def _dispatch(func, args: tuple, kwargs: dict, active: Any) -> Any:
    """Record ``func(*args, **kwargs)`` for the workers; return handles of its outputs.

    The fast path covers flat arguments (tensors, scalars, lists of scalars, lists of
    tensors) of an op seen before with the same shapes: no pytree walks, no meta execution."""
    info = _func_info.get(id(func))
    if info is None:
        info = _new_func_info(func)
    pointwise = info[1]  # the output's shape cannot depend on a scalar's value
    stream = current_stream() if _active.streams_used else "main"
    mesh = first = None
    # (output dtypes depend on the default dtype: factories, type promotion)
    key: Any = [id(func), _default_dtype()]
    wargs = []
    for a in args:
        kind = type(a)
        if kind in _SCALAR_TYPES:  # for a pointwise op only the type matters (type promotion)
            key.append(kind if pointwise else (kind, a))  # (3 == 3.0 == True: typed)
            wargs.append(a)
        elif isinstance(a, Tensor) or (
            (kind is list or kind is tuple) and a and isinstance(a[0], Tensor)
        ):  # a mesh tensor, or a list of them (torch.cat, the bucket ops, _foreach_*)
            alone = isinstance(a, Tensor)
            for t in (a,) if alone else a:
                if not isinstance(t, Tensor) or t._md_state is not None or t._md_stream != stream:
                    return _dispatch_general(func, args, kwargs, active)  # checks, with details
                if first is None:
                    first, mesh = t, t._md_mesh
                elif t._md_mesh is not mesh and (
                    t._md_mesh != mesh or t._md_engine is not first._md_engine
                ):
                    return _dispatch_general(func, args, kwargs, active)  # raises, with details
            if alone:
                key.append(a._md_desc)
                wargs.append(_tuple_new(isa.Ref, (a._md_ref,)))
            else:
                key.append((kind, *(t._md_desc for t in a)))
                wargs.append(kind(_tuple_new(isa.Ref, (t._md_ref,)) for t in a))
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
        key.extend((k, type(v), v) for k, v in kwargs.items())  # (typed: 1 == 1.0 == True)
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
    if out is None or type(out) is _WrittenLists:  # the op returns nothing (it writes its
        result = None  # arguments)
        outs: tuple = ()
        if out:
            for i in out:
                _increment_version(args[i])
    elif type(out) is int:  # the op returns its input #out (in place)
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
        _tuple_new(isa.CallOp, (op, wargs, kwargs, outs, stream, user_line(depth))),
    )
    return result


_tuple_new = tuple.__new__  # a named tuple without the Python-level __new__ of its class


class _WrittenLists(tuple):
    """The positions of the lists of tensors an op writes (``torch._foreach_add_``): their
    autograd version counters are bumped here. Torch bumps a single tensor's that an op writes
    in place (autograd then refuses a backward pass that needs its old value), not those of a
    list's tensors on a tensor subclass: a backward pass ran on the changed values instead."""


_increment_version = torch._C._increment_version
_default_dtype = torch.get_default_dtype


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
# output tensor, the device and the wrapper maker of ``handle.maker``), the index of the input
# an in-place op returns, or None for an op that returns nothing.
_fast_cache: dict[tuple, tuple] = {}


def _dispatch_general(func, args: tuple, kwargs: dict, active: Any, fast_key=None) -> Any:
    name = func._schema.name
    op = f"{name}.{func._overloadname}"
    flat, spec = pytree.tree_flatten((args, kwargs))
    mesh = None
    first = None
    local = None
    owner = None  # the engine (allocation) of the first tensor argument
    for i, x in enumerate(flat):
        if isinstance(x, Tensor):
            if mesh is None:
                mesh, first, owner = x._md_mesh, i, x._md_engine
            elif x._md_mesh != mesh or x._md_engine is not owner:
                two = " of two allocations" if x._md_mesh == mesh else ""
                raise TypeError(
                    f"{op}: arguments on two meshes{two}: argument #{first} is on {mesh!r}, "
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
        return lift(flat[local], active)
    if mesh is None:
        mesh = active
    if local == 1 and first == 0 and name == "aten::copy_" and isinstance(args[1], torch.Tensor):
        # A mesh tensor written with a local value (module.load_state_dict of a local
        # checkpoint): the value is sent to every rank, as md.to_mesh would.
        return _dispatch_general(func, (args[0], lift(args[1], mesh), *args[2:]), kwargs, active)
    if local is not None:
        raise TypeError(
            f"{op}: argument #{local} is a local tensor (shape {tuple(flat[local].shape)}) but "
            f"this op runs on the mesh {mesh!r}: put it on the mesh first with "
            f"md.to_mesh(t, mesh)"
        )
    if first is not None:
        written = _written(func, args, kwargs)
        written_ids = {id(x) for x in written}
        for i, x in enumerate(flat):
            if isinstance(x, Tensor):
                check_usable(x, op, i, write=id(x) in written_ids)
    engine = Engine.of(mesh)
    meta_flat = []
    worker_flat = []
    for x in flat:
        if isinstance(x, Tensor):
            meta_flat.append(x._md_meta)
            worker_flat.append(isa.Ref(x._md_ref))
        elif isinstance(x, torch.device):
            meta_flat.append(torch.device("meta"))
            worker_flat.append(isa.WORKER_DEVICE)
        else:
            meta_flat.append(x)
            worker_flat.append(x)
    worker_args, worker_kwargs = pytree.tree_unflatten(worker_flat, spec)
    if first is None:  # a factory: make it on meta here, on the worker's device there
        worker_kwargs["device"] = isa.WORKER_DEVICE
    known = _known_inputs(func, flat) if first is not None else None
    if name in _NEEDS_VALUE:
        if known is not None:  # the controller knows the value: nothing to ask the workers
            local_args, local_kwargs = pytree.tree_unflatten(known, spec)
            return func(*local_args, **local_kwargs)
        raise TypeError(
            f"{op} needs the tensor's value, which lives on the workers: fetch it first, e.g. "
            f"md.inspect(t).item() (or md.inspect(t, **coords) for another rank)"
        )
    out_leaves, out_spec = output_meta(func, op, flat, meta_flat, spec, first is None)
    outs: list[int | None] = []
    results = []
    for leaf in out_leaves:
        if isinstance(leaf, Alias):  # an in-place op returning its input
            same = flat[leaf.index]
            if leaf.desc is not None:  # (its shape or layout changed: the handle follows)
                follow(same, leaf.desc)
            outs.append(same._md_ref)
            results.append(same)
            continue
        if not isinstance(leaf, torch.Tensor):
            results.append(leaf)
            continue
        ref = engine.new_ref()
        outs.append(ref)
        results.append(Tensor(leaf, mesh, engine, ref, current_stream()))
    mid = engine.mesh_id(mesh)
    engine.append(
        mid, isa.CallOp(op, worker_args, worker_kwargs, tuple(outs), current_stream(), user_line())
    )
    lists = _WrittenLists(
        i for i, _ in written_args(func) if i < len(args) and isinstance(args[i], (list, tuple))
    )
    for i in lists:
        _increment_version(args[i])
    if first is not None:
        _track_known(func, written, flat, spec, known, out_leaves, results)
        if known is not None:
            fast_key = None  # the fast path would skip the tracking
    if fast_key is not None and out_spec.is_leaf() and len(_fast_cache) < META_CACHE_MAX:
        leaf = out_leaves[0]
        if isinstance(leaf, Alias):
            if leaf.desc is not None:  # (the fast path would not change the handle)
                return pytree.tree_unflatten(results, out_spec)
            same = flat[leaf.index]
            _fast_cache[fast_key] = (op, next(j for j, a in enumerate(args) if a is same))
        elif isinstance(leaf, torch.Tensor):
            desc = results[0]._md_desc
            _fast_cache[fast_key] = (op, (desc, *maker(desc, engine.device)))
        elif leaf is None and not outs:
            _fast_cache[fast_key] = (op, lists or None)
    return pytree.tree_unflatten(results, out_spec)


# ---- values the controller knows (see handle.known_value) ---------------------------------


def _known_inputs(func, flat: list) -> list | None:
    """``flat`` with each mesh tensor replaced by its known value, or None if one is not known
    (or the op is random)."""
    if torch.Tag.nondeterministic_seeded in func.tags:
        return None
    out = []
    for x in flat:
        if isinstance(x, Tensor):
            value = known_value(x)
            if value is None:
                return None
            out.append(value)
        elif isinstance(x, torch.device):
            out.append(torch.device("cpu"))
        else:
            out.append(x)
    return out


def _written(func, args: tuple, kwargs: dict) -> list:
    """The arguments ``func`` writes: in-place and out= tensors, each tensor of a written
    list (``torch._foreach_add_``)."""
    written = [args[i] for i, _ in written_args(func) if i < len(args)]
    written += [kwargs[n] for _, n in written_args(func) if n in kwargs]
    return [t for w in written for t in (w if isinstance(w, (list, tuple)) else (w,))]


def _track_known(func, written, flat, spec, known, out_leaves, results) -> None:
    """``written``: the tensors ``func`` writes (``_written``)."""
    is_view = not written and any(r.alias_info is not None for r in func._schema.returns)
    if known is None or is_view:
        for x in flat:  # written by what the controller does not compute, or viewed
            if isinstance(x, Tensor) and (is_view or any(x is w for w in written)):
                forget_known(x)
        return
    local_args, local_kwargs = pytree.tree_unflatten(known, spec)
    try:
        value = func(*local_args, **local_kwargs)  # writes the known inputs it writes
    except Exception:  # noqa: BLE001 - the workers will say what is wrong; forget the inputs
        for x in flat:
            if isinstance(x, Tensor):
                forget_known(x)
        return
    values = pytree.tree_leaves(value)
    for leaf, result, v in zip(out_leaves, results, values):
        if isinstance(leaf, Alias) or not isinstance(result, Tensor):
            continue
        if isinstance(v, torch.Tensor) and v.numel() <= KNOWN_MAX_NUMEL:
            result._md_state = ("known", v)


# ---- the two ways in: md.Tensor arguments, and factory ops under pm.activate() -------------


def _subclass_dispatch(cls, func, types, args=(), kwargs=None):
    return _dispatch(func, args, kwargs or {}, None)


# torch.Tensor.__init_subclass__ wraps a subclass's __torch_dispatch__ in
# torch._disable_dynamo, which costs ~50 us per op here -- more than everything else the
# controller does for an op. md.Tensor never runs under torch.compile, so set it unwrapped.
Tensor.__torch_dispatch__ = classmethod(_subclass_dispatch)


class MeshMode(TorchDispatchMode):
    """Active under ``pm.activate()``: factory ops create mesh tensors."""

    def __init__(self, mesh: Any):
        super().__init__()
        self.mesh = mesh

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ in torch._disable_dynamo: ~50 us per op here
        # (see Tensor.__torch_dispatch__ above); nothing here runs under torch.compile.
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
            if func._schema.name in _FACTORY_DEVICE_OPS and not _from_storage_code():
                return _dispatch(func, args, kwargs, self.mesh)
            return func(*args, **kwargs)  # local tensors stay local
        if _is_factory(func) and not _from_storage_code():
            return _dispatch(func, args, kwargs, self.mesh)
        return func(*args, **kwargs)  # no tensors in or out (profiler marks and such)


_STORAGE_FILE = torch.storage.__file__


def _from_storage_code() -> bool:
    """Whether the op was called by torch's storage code, which makes a tensor on the spot to
    copy a local storage (``copy.deepcopy`` of a local tensor under ``pm.activate()``): that
    tensor stays local, as storages are (a mesh tensor has none)."""
    frame = sys._getframe(2)  # (this function's caller is MeshMode.__torch_dispatch__)
    return frame.f_code.co_filename == _STORAGE_FILE


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
