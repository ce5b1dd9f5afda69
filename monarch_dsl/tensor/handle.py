"""``md.Tensor``: the controller's handle on a tensor that lives on every rank of a mesh.

The handle keeps only a description (shape, stride, dtype, storage offset), its mesh, its
engine, its ref (the workers' name for the value) and its stream; torch ops on it go through
``dispatch.py``. Its own operations that are not torch ops -- ``reduce``, ``reduce_``,
``to_mesh`` -- are here too.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from monarch_dsl import isa
from monarch_dsl.frames import user_line
from monarch_dsl.tensor.active import check_usable
from monarch_dsl.tensor.engine import Engine

META_CACHE_MAX = 100_000  # entries each of the controller's shape caches keeps at most


class Tensor(torch.Tensor):
    """A handle on a tensor that lives on every rank of a mesh: ``.mesh``, ``.shape``,
    ``.dtype``, ``.device``, ``.stream``. Torch ops on it run on the workers."""

    _md_desc: tuple  # ("T", shape, stride, dtype, storage offset): for caches
    _md_mesh: Any
    _md_mesh_id: int
    _md_ref: int
    _md_stream: str
    # ("borrowed" | "lent", Borrow), ("dropped", file:line) or ("known", local value; see
    # known_value); None: a plain tensor
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
            desc = ("T", *describe(meta))
        if cls is Tensor:
            t = maker(desc, engine.device)[1]()
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
        return new_meta(self._md_desc[1:])

    __torch_function__ = torch._C._disabled_torch_function_impl
    # __torch_dispatch__ is set by dispatch.py, which builds on this class.

    @property
    def data(self) -> torch.Tensor:
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value: Any) -> None:
        _set_data(self, value)

    @property
    def mesh(self) -> Any:
        return self._md_mesh

    @property
    def stream(self) -> str:
        return self._md_stream

    def reduce(self, dims: Any = (), reduction: str = "sum", scatter: bool = False) -> Tensor:
        """A collective over the mesh dims ``dims`` (a name or tuple; ``()`` = all)."""
        return reduce_tensor(self, dims, reduction, scatter, in_place=False, line=user_line())

    def reduce_(self, dims: Any = (), reduction: str = "sum", scatter: bool = False) -> Tensor:
        return reduce_tensor(self, dims, reduction, scatter, in_place=True, line=user_line())

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

    def numpy(self, *, force: bool = False):  # noqa: ARG002 - torch's signature
        raise TypeError(
            "numpy() needs the tensor's value, which lives on the workers: fetch it first, "
            "e.g. md.inspect(t).numpy()"
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
        if other is None or isinstance(other, str):  # (False, as for a local tensor)
            return NotImplemented
        return torch.eq(self, other)

    def __ne__(self, other):
        if other is None or isinstance(other, str):
            return NotImplemented
        return torch.ne(self, other)

    def __format__(self, spec: str) -> str:
        if not spec:
            return repr(self)
        raise TypeError(
            f"formatting a mesh tensor with {spec!r} needs its value, which lives on the "
            f"workers: fetch it first, e.g. f'{{md.inspect(t).item():{spec}}}'"
        )

    # Torch's own versions of these read the tensor's local storage, which a handle has not:
    # some crashed the process (share_memory_, apply_).
    def share_memory_(self):
        raise _no_storage("share_memory_()")

    def is_shared(self) -> bool:
        raise _no_storage("is_shared()")

    def apply_(self, callable):  # noqa: A002 - torch's signature
        raise _no_storage("apply_()")

    def pin_memory(self, device=None):  # noqa: ARG002 - torch's signature
        raise _no_storage("pin_memory()")

    def untyped_storage(self):
        raise _no_storage("untyped_storage()")

    def storage(self):
        raise _no_storage("storage()")

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

    def __deepcopy__(self, memo: dict) -> Tensor:
        """A copy on the same mesh and stream, made on the workers (``clone``), as DTensor's
        deepcopy: ``copy.deepcopy(model)`` of a model on a mesh (an EMA copy, a reference) is a
        model on the mesh. A parameter's copy is a parameter with its ``requires_grad``, and its
        ``.grad`` is copied too, as torch copies a local tensor's."""
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                "copy.deepcopy: only an md.Tensor that autograd did not make (a graph leaf) can be "
                "copied, as with a local tensor; detach() it first"
            )
        with torch.no_grad():
            new = self.clone()
        new.requires_grad_(self.requires_grad)
        if self.__dict__.get("_is_param"):
            new.__dict__["_is_param"] = True  # what nn.Parameter(t) sets on a subclass
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "an md.Tensor is a handle on values that live on the workers; it cannot be pickled "
            "(use md.fetch / md.inspect to get a local copy)"
        )


def _no_storage(what: str) -> TypeError:
    return TypeError(
        f"{what} needs the tensor's local storage, but a mesh tensor's data lives on the "
        "workers: fetch a local copy first (md.inspect(t) / md.fetch)"
    )


_TENSOR_DATA = torch._C.TensorBase.data  # torch's .data (get: a detached view; set: set_data)


def _set_data(t: Tensor, value: Any) -> None:
    """``t.data = value``, as torch's ``Module._apply`` converts a module (``model.half()``,
    ``.to(torch.bfloat16)``, ``.double()``) and ``vector_to_parameters`` fills one: ``t``
    becomes a handle on ``value``'s data (on the workers, an alias of it under a ref of its
    own), keeping its own autograd state; its old value is deleted where nothing else holds
    it. Torch's setter alone changed the handle's shape and dtype but not its ref: the
    workers went on with the old value."""
    if not isinstance(value, Tensor):
        raise TypeError(
            f"the data of a mesh tensor can be set only to a mesh tensor, got "
            f"{type(value).__name__} (put it on the mesh first with md.to_mesh)"
        )
    if value._md_engine is not t._md_engine or value._md_mesh != t._md_mesh:
        raise TypeError(
            f"the data of a mesh tensor on {t._md_mesh!r} cannot be set to a tensor on "
            f"{value._md_mesh!r} (move it with t.to_mesh(...))"
        )
    check_usable(t, ".data =", 0, write=True)
    check_usable(value, ".data =", 1, write=False)
    if t._md_state is not None and t._md_state[0] == "lent":  # (its ref is the borrow's)
        raise TypeError(
            ".data = on a tensor lent to another stream: drop the borrow first, and set the "
            "data of the tensor it lends"
        )
    with torch.no_grad():
        new = torch.ops.aten.alias.default(value)  # (an instruction: a ref of its own)
    follow(t, new._md_desc[1:])  # (the wrapper's shape, stride and dtype)
    old = (t._md_ref, t._md_stream)
    state = t.__dict__
    for name in ("_md_mesh", "_md_mesh_id", "_md_ref", "_md_stream"):
        state[name] = new.__dict__[name]
    state.pop("_md_state", None)  # (an alias: not a value the controller knows)
    new.__dict__["_md_engine"] = None  # its ref is t's now: its __del__ deletes nothing
    t._md_engine.dead.append(old)  # engine.delete, as __del__ does


def follow(t: Tensor, desc: tuple) -> None:
    """An op changed ``t``'s shape or layout in place on the workers (``x.unsqueeze_(0)``,
    ``x.t_()``, ``x.resize_(n)``, ``out=`` of another shape, ATen's own ``as_strided_``), or
    ``t.data = v`` made it another value's: the handle takes the new ``desc`` (shape, stride,
    dtype, storage offset) too."""
    # (in dispatch, set_data would come back to it; under inference_mode the wrapper, whose
    # dispatch keys set_data copies, would be an inference tensor)
    with torch._C._DisableTorchDispatch(), torch.inference_mode(False):
        _TENSOR_DATA.__set__(t, maker(("T", *desc), t._md_engine.device)[1]())
    t.__dict__["_md_desc"] = ("T", *desc)
    state = t._md_state
    if state is not None and state[0] == "lent":  # the workers' value is the origin's too
        follow(state[1].origin, desc)


def describe(t: torch.Tensor) -> tuple:
    """(shape, stride, dtype, storage offset) of ``t``: a handle's ``_md_desc`` after "T"."""
    return (tuple(t.shape), t.stride(), t.dtype, t.storage_offset())


# (description, device) -> (device, a maker of md.Tensor wrappers of that description): the
# arguments of _make_wrapper_subclass, bound once (leaving out default strides and offset).
_makers: dict[tuple, tuple] = {}


def maker(desc: tuple, device: torch.device) -> tuple:
    """(device, a function making a bare ``md.Tensor`` wrapper of ``desc`` on ``device``)."""
    found = _makers.get((desc, device))
    if found is None:
        _, shape, stride, dtype, offset = desc
        kwargs: dict[str, Any] = {"dtype": dtype, "device": device}
        if offset or tuple(stride) != contiguous_strides(shape):
            kwargs["strides"] = stride
            kwargs["storage_offset"] = offset
        found = (
            device,
            functools.partial(torch.Tensor._make_wrapper_subclass, Tensor, shape, **kwargs),
        )
        if len(_makers) < META_CACHE_MAX:
            _makers[(desc, device)] = found
    return found


def contiguous_strides(shape: Any) -> tuple:
    """The strides of a contiguous tensor of ``shape``, as torch gives them (a size of 0 or 1
    counts as 1), worked out here rather than by a meta op (the dispatch mode's, under
    activation)."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def new_meta(desc: tuple) -> torch.Tensor:
    """A meta tensor of ``desc`` (shape, stride, dtype, storage offset)."""
    shape, stride, dtype, offset = desc
    t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return t if not offset else t.as_strided(shape, stride, offset)


def contiguous_desc(shape: tuple, dtype: torch.dtype) -> tuple:
    """The description ("T", shape, stride, dtype, offset) of a contiguous tensor: what the
    workers make for a compiled step's results and arguments' parts, and for ``reduce()`` and
    ``to_mesh()`` whatever the input's layout (the collectives' outputs and the received
    copies are contiguous; a copy between a rank and itself is made so). Worked out here, not
    by a meta op: under activation every meta op goes through the dispatch mode, ~200 us of
    controller CPU a ``reduce()``."""
    return ("T", shape, contiguous_strides(shape), dtype, 0)


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


def known_value(x: Any) -> Any:
    """The value the controller knows ``x`` has on every rank, or None."""
    state = x._md_state if isinstance(x, Tensor) else None
    return state[1] if state is not None and state[0] == "known" else None


def forget_known(t: Tensor) -> None:
    """``t``'s value is no longer known (something the controller does not compute wrote it)."""
    if known_value(t) is not None:
        t._md_state = None


def _transfer(t: Tensor, dest: Any, line: str) -> Tensor:
    """``t.to_mesh(dest)``: rank at coordinates c of ``t.mesh`` sends to the rank at c of
    ``dest``."""
    check_usable(t, "to_mesh", 0, write=False)
    src = t._md_mesh
    if dest.job is not src.job:
        raise TypeError("to_mesh between process meshes of different allocations is not supported")
    if dict(src.sizes) != dict(dest.sizes):
        raise ValueError(
            f"to_mesh needs the same dims and sizes on both meshes: {src.sizes} vs {dest.sizes}"
        )
    engine = t._md_engine
    engine.ensure_collectives()
    src_ranks = [src.ranks[src.index_of(**p)] for p in dest.points()]  # in dest's order
    pairs = tuple(zip(src_ranks, dest.ranks))
    ref = engine.new_ref()
    _, shape, _, dtype_, _ = t._md_desc
    shape = tuple(shape)
    desc = contiguous_desc(shape, dtype_)
    out = Tensor(None, dest, engine, ref, t._md_stream, desc)
    dtype = isa.dtype_name(dtype_)
    engine.append(-1, isa.Transfer(t._md_ref, ref, pairs, shape, dtype, t._md_stream, line))
    return out


def reduce_tensor(t: Tensor, dims: Any, reduction: str, scatter: bool, in_place: bool, line: str):
    """``t.reduce(...)`` (``t.reduce_(...)`` when ``in_place``), issued at ``line``."""
    if not isinstance(t, Tensor):
        raise TypeError(f"reduce needs an md.Tensor, got {type(t).__name__}")
    check_usable(t, "reduce_" if in_place else "reduce", 0, write=in_place)
    if in_place:
        forget_known(t)  # the ranks' values are combined: no longer what the controller computed
    mesh = t._md_mesh
    if isinstance(dims, str):
        dims = (dims,)
    dims = tuple(dims) or tuple(mesh.dims)
    for d in dims:
        if d not in mesh.dims:
            raise KeyError(f"reduce over {d!r}: the tensor's mesh has dims {mesh.dims}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"reduce over {dims}: a dim is named twice")
    if reduction not in isa.REDUCTIONS:
        raise ValueError(f"reduction must be one of {isa.REDUCTIONS}, got {reduction!r}")
    n = mesh.size(dims)
    # Shapes from the handle's description, a new output's from contiguous_desc: no meta op here
    # (under activation every one goes through the dispatch mode, ~95% of the controller's
    # time for a reduce_ when it made them).
    _, shape, _, dtype_, _ = t._md_desc
    shape = tuple(shape)
    if reduction == "avg" and not (dtype_.is_floating_point or dtype_.is_complex):
        raise TypeError(f"reduction 'avg' needs a floating point tensor, got {dtype_}")
    if scatter and (not shape or shape[0] % n):
        what = "stack+scatter (all-to-all)"
        if reduction != "stack":
            what = f"{reduction}+scatter (reduce-scatter)"
        raise ValueError(f"{what} over {dims} needs dim 0 divisible by {n}, got shape {shape}")
    if reduction == "stack":
        out_shape = shape if scatter else (n, *shape)
    elif scatter:
        out_shape = (shape[0] // n, *shape[1:])
    else:
        out_shape = shape
    if in_place and out_shape != shape:
        raise ValueError(
            f"reduce_ with {reduction}{'+scatter' if scatter else ''} changes the shape "
            f"{shape} -> {out_shape}; use the out-of-place reduce()"
        )
    engine = t._md_engine
    engine.ensure_collectives()
    if in_place:
        out, ref = t, t._md_ref
    else:
        ref = engine.new_ref()
        out = Tensor(None, mesh, engine, ref, t._md_stream, contiguous_desc(out_shape, dtype_))
    dtype = isa.dtype_name(dtype_)
    engine.append(
        t._md_mesh_id,
        isa.Reduce(
            t._md_ref,
            ref,
            t._md_mesh_id,
            dims,
            reduction,
            scatter,
            shape,
            dtype,
            t._md_stream,
            line,
        ),
    )
    return out
