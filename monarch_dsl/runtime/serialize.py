"""Pickling for the control plane.

cloudpickle, so that classes and functions defined in ``__main__``, inside a function or in a
notebook cell travel by value. Pickle protocol 5 with out-of-band buffers, so a CPU tensor's
bytes are sent straight from its memory (no copy into the pickle stream) and land in a buffer of
their own on the other side.
"""

from __future__ import annotations

import copyreg
import marshal
import math
import pickle
import sys
import threading
import types
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import cloudpickle

from monarch_dsl.isa import dtype_name

# Plain dicts, not ChainMaps: the C pickler looks the type of every object up in its
# dispatch_table, and a ChainMap lookup runs Python code (it made pickling 4x slower).
_fast_table: dict = dict(copyreg.dispatch_table)
_cloud_table: dict = {**copyreg.dispatch_table, **cloudpickle.Pickler.dispatch_table}


def _reduce_code(code: types.CodeType):
    """A code object sent by value, as ``marshal`` writes it: its file name kept. (cloudpickle
    3.1.3 writes ``<dynamic-code>`` instead, and a remote traceback, a worker's ``breakpoint()``
    and every error naming the user's ``file:line`` would lose the file of a class or function
    defined in ``__main__``.) Both sides run the same Python version, as cloudpickle's own
    code objects already require."""
    return marshal.loads, (marshal.dumps(code),)


_cloud_table[types.CodeType] = _reduce_code


def _rebuild_tensor(buf, dtype_name, shape, requires_grad):
    import torch

    dtype = getattr(torch, dtype_name)
    if shape and shape[0] == -1:  # this rank's rows of a PerRank (maybe none)
        row = math.prod(shape[1:]) * dtype.itemsize
        shape = (len(buf) // row, *shape[1:])
    if len(buf):
        t = torch.frombuffer(buf, dtype=dtype)
        t = t.view(*shape) if shape else t.view(())
    else:  # a factory: made here even under pm.activate() (which would make it on the mesh)
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            t = torch.empty(shape, dtype=dtype)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_tensor(t):
    wire = getattr(t, "_md_wire", None)
    if wire is not None:  # a snapshot: its bytes and layout taken when it was made
        return _rebuild_tensor, (pickle.PickleBuffer(wire[0]), wire[1], wire[2], False)
    if not _in_plain_memory(t):
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    # (a plain tensor's own ops outside any mesh dispatch mode; a subclass's through its own)
    with local_ops() if _plain(t) else nullcontext():
        array = _array_of(t.detach())  # its bytes, straight from the tensor's memory
    # (the dtype by name: a short string in the stream, not a pickled torch.dtype)
    name = dtype_name(t.dtype)
    return _rebuild_tensor, (pickle.PickleBuffer(array), name, tuple(t.shape), t.requires_grad)


def _plain(t: Any) -> bool:
    """A tensor of torch's own class (a Parameter too), not a subclass with its own rules."""
    import torch

    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _in_plain_memory(t: Any) -> bool:
    """Its values are its CPU memory as it is: dense, not quantized, no lazy conjugate or
    negation (then ``_array_of`` reads them)."""
    import torch

    return (
        t.is_cpu
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
    )


def _array_of(t: Any) -> Any:
    """A numpy array on the memory of ``t`` (in plain memory, no autograd), contiguous first;
    as bytes for a dtype numpy lacks (bfloat16)."""
    import torch

    if not t.is_contiguous():
        t = t.contiguous()
    try:
        return t.numpy()
    except TypeError:
        return t.reshape(-1).view(torch.uint8).numpy()


_have_tensor_reducer = False


_python_key: Any = None


def local_ops() -> Any:
    """A context in which torch ops skip the Python dispatch key: for ops on local tensors
    while the controller sends them. Under ``pm.activate()`` every op, a local tensor's too,
    goes through the mesh's dispatch mode first (``tensor/dispatch.MeshMode``): a tensor's
    ``detach()`` took 18 us there, ``numpy()`` 25 (1 outside; under this, with the guard's own
    cost, about 5)."""
    global _python_key
    import torch

    if _python_key is None:
        _python_key = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
    return torch._C._ExcludeDispatchKeyGuard(_python_key)


def snapshot(t: Any) -> Any:
    """A copy of a local tensor that is sent later (a call's argument, ``md.to_mesh``'s value:
    the caller may change the original in the meantime), contiguous, made by this thread
    alone.

    - One ``memcpy`` here (numpy's copy of the tensor's memory), not ``clone()``: a large clone
      runs on torch's intra-op (OpenMP) threads, which wake for it and then spin waiting for
      more work. On a controller whose host's cores also run its workers that took 2.3 ms of
      CPU per 512 KiB copy issued every 2 ms, where the memcpy takes 0.4 ms.
    - Its torch ops under ``local_ops`` (no mesh dispatch mode): a small tensor's copy under
      ``pm.activate()`` took 52 us through the mode, 8.5 so.

    Tensors numpy cannot hold (bfloat16) are copied as bytes; others not in plain CPU memory
    (a GPU's, sparse, quantized, a lazy conjugate) by ``clone()``.

    The copy keeps what pickling it needs (its bytes as numpy, its dtype's name, its shape)
    in ``_md_wire``, so that sending it costs the sender no torch op (``_reduce_tensor``): a
    compiled step's local batch is sent every call, and the tensor reducer's checks and its
    ``numpy()`` took 5 us of the 8 a small tensor's pickling cost. Nothing changes a snapshot
    after it is made (it is the controller's private copy)."""
    import torch

    if not _plain(t):  # a subclass: its own ops and rules
        return t.detach().clone(memory_format=torch.contiguous_format)
    with local_ops():
        if t.requires_grad:
            t = t.detach()
        if not _in_plain_memory(t):
            return t.clone(memory_format=torch.contiguous_format)
        array = _array_of(t).copy()
        out = torch.from_numpy(array)
        if out.dtype != t.dtype:  # (copied as bytes)
            out = out.view(t.dtype).view(t.shape)
    out._md_wire = (array, dtype_name(t.dtype), tuple(t.shape))
    return out


class PerRank:
    """A local tensor whose rows are split among ranks: each worker is sent its own rows
    only (a data-parallel step's batch: the controller sends the batch once in all, not once
    per rank). ``whole`` is a ``snapshot``; ``rows[rank]`` is that rank's ``(start, stop)``
    (ranks it lacks get no rows). Pickled, it is a placeholder for one out-of-band buffer
    that the sender fills per rank (``transport.for_rank``); it arrives as that rank's part,
    a tensor of its own."""

    __slots__ = ("whole", "rows", "_row_bytes")

    def __init__(self, whole: Any, rows: dict[int, tuple[int, int]]):
        # (shapes only: no torch op, which would go through a mesh's dispatch mode)
        row = math.prod(whole.shape[1:]) * whole.element_size() if whole.dim() else 0
        if not (hasattr(whole, "_md_wire") and row):
            raise ValueError("PerRank: the whole must be a snapshot with rows of some size")
        self.whole, self.rows, self._row_bytes = whole, rows, row

    def part(self, rank: int) -> Any:
        """Rank ``rank``'s rows (a view of the whole)."""
        start, stop = self.rows.get(rank, (0, 0))
        with local_ops():
            return self.whole[start:stop]

    def nbytes(self, rank: int) -> int:
        start, stop = self.rows.get(rank, (0, 0))
        return (stop - start) * self._row_bytes

    def buffer(self, rank: int) -> memoryview:
        """The bytes rank ``rank`` is sent."""
        start, stop = self.rows.get(rank, (0, 0))
        flat = self.whole._md_wire[0].reshape(-1).view("uint8")  # (a view: no copy)
        return memoryview(flat)[start * self._row_bytes : stop * self._row_bytes]


class _PerRankSlot:
    """Where a ``PerRank`` is in a message's out-of-band buffers (see ``dumps``)."""

    __slots__ = ("per_rank",)

    def __init__(self, per_rank: PerRank):
        self.per_rank = per_rank


_slot_marker: Any = None


def _reduce_per_rank(p: PerRank):
    global _slot_marker
    import numpy

    if _slot_marker is None:
        _slot_marker = numpy.empty(0, dtype=numpy.uint8)
    # The pickler hands this buffer to the buffer callback next (the first item of the
    # arguments, saved right after this returns): the callback takes the PerRank instead.
    _pending.per_rank = p
    wire = p.whole._md_wire
    return _rebuild_tensor, (pickle.PickleBuffer(_slot_marker), wire[1], (-1, *wire[2][1:]), False)


class _Pending(threading.local):
    per_rank: PerRank | None = None


_pending = _Pending()


def _out_of_band(buffers: list) -> Callable[[pickle.PickleBuffer], None]:
    """The pickler's buffer callback: a buffer's memory, or a PerRank's slot."""

    def callback(b: pickle.PickleBuffer) -> None:
        p = _pending.per_rank
        if p is not None:
            _pending.per_rank = None
            buffers.append(_PerRankSlot(p))
        else:
            buffers.append(b.raw())

    return callback


def _ensure_tensor_reducer() -> None:
    global _have_tensor_reducer
    torch = sys.modules.get("torch")
    if torch is not None:
        _fast_table[torch.Tensor] = _reduce_tensor
        _cloud_table[torch.Tensor] = _reduce_tensor
        _have_tensor_reducer = True


_fast_table[PerRank] = _cloud_table[PerRank] = _reduce_per_rank


class _CloudPickler(cloudpickle.Pickler):
    dispatch_table = _cloud_table


class _FastPickler(pickle.Pickler):
    dispatch_table = _fast_table


class _Sink:
    """A minimal file for the pickler: collects written chunks."""

    __slots__ = ("parts",)

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, b) -> int:
        self.parts.append(b)
        return len(b)


def _dump(pickler_cls, obj) -> tuple[bytes, list[memoryview]]:
    """``obj`` pickled by a new pickler of ``pickler_cls``: (the stream, its out-of-band
    buffers).

    A new pickler per message (about 1 us), not one kept per thread and reset with
    ``clear_memo()``: a kept pickler's memo holds every object of the last message until the
    next one, often the last reference to its tensors, and ``clear_memo()`` then frees them.
    Freeing a tensor releases the GIL (torch's tensor dealloc), so another thread runs while
    the memo is half cleared, and its garbage collection walks that pickler's memo (which it
    traverses) into the objects just freed: the controller died of SIGSEGV, now and then,
    while issuing compiled calls (CPython 3.11's ``PyMemoTable_Clear`` zeroes the table only
    after its loop). A pickler that is dropped is untracked before its memo is freed."""
    buffers: list[Any] = []
    sink = _Sink()
    try:
        pickler_cls(sink, protocol=5, buffer_callback=_out_of_band(buffers)).dump(obj)
    finally:
        _pending.per_rank = None
    payload = sink.parts[0] if len(sink.parts) == 1 else b"".join(sink.parts)
    return payload, buffers


def dumps(obj: Any) -> tuple[bytes, list[Any]]:
    """Serialize ``obj``; returns the pickle bytes and the out-of-band buffers (memoryviews,
    and a ``_PerRankSlot`` for each ``PerRank``: ``transport.for_rank`` fills it).

    The C pickler is tried first (about 4x faster than cloudpickle for a small message). It
    pickles classes and functions by reference, which the receiver cannot resolve for objects
    of ``__main__`` or of a function's locals: those fail here or leave ``__main__`` in the
    stream, and then the message is pickled again with cloudpickle, which sends them by value.
    """
    if not _have_tensor_reducer:
        _ensure_tensor_reducer()
    try:
        payload, buffers = _dump(_FastPickler, obj)
        if b"__main__" not in payload:
            return payload, buffers
    except (pickle.PicklingError, AttributeError, TypeError):
        pass
    return _dump(_CloudPickler, obj)


def loads(payload, buffers=()) -> Any:
    return pickle.loads(payload, buffers=buffers)
