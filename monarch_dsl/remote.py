"""``@md.remote``: a Python function that runs on every rank of the active mesh."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from monarch_dsl import isa
from monarch_dsl.frames import user_line
from monarch_dsl.runtime import serialize
from monarch_dsl.tensor import Engine, Tensor, active_mesh, check_usable, current_stream

MAX_LEARNT_OUTPUTS = 64  # tensor outputs a function without a propagator may return

# The remote functions by their payload: the simulator (``md.Simulator``), which runs no
# function, finds a ``CallFunction``'s propagator here.
_by_payload: weakref.WeakValueDictionary[bytes, RemoteFunction] = weakref.WeakValueDictionary()


def function_of(payload: bytes) -> RemoteFunction | None:
    """The remote function whose ``CallFunction`` carries ``payload`` (None: unknown here)."""
    return _by_payload.get(payload)


class RemoteFunction:
    """Call it under ``pm.activate()`` with mesh tensors (and plain values); it runs on every
    rank and returns mesh tensors (or a pytree of them) of the shapes ``propagate`` gives --
    called with meta tensors of the arguments' shapes -- or, without ``propagate``, of the
    shapes a first run on the workers gave (cached per argument shapes)."""

    def __init__(self, fn: Callable, propagate: Callable | None):
        if not callable(fn):
            raise TypeError(f"@md.remote decorates a function, got {type(fn).__name__}")
        if propagate is not None and not callable(propagate):
            raise TypeError(f"propagate must be callable, got {type(propagate).__name__}")
        self.fn = fn
        self.propagate = propagate
        self._pickled: bytes | None = None
        self._shapes: dict[Any, tuple] = {}
        functools.update_wrapper(self, fn)

    def _payload(self) -> bytes:
        if self._pickled is None:
            payload, buffers = serialize.dumps(self.fn)
            if buffers:
                raise TypeError("a remote function must not close over tensors")
            self._pickled = payload
            _by_payload[payload] = self
        return self._pickled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        mesh = active_mesh()
        stream = current_stream()
        for i, x in enumerate(flat):
            if isinstance(x, Tensor):
                check_usable(x, self.__name__, i, write=False)
                if mesh is None:
                    mesh = x.mesh
                elif x.mesh != mesh:
                    raise TypeError(
                        f"{self.__name__}: argument #{i} is on {x.mesh!r}, not on {mesh!r}"
                    )
            elif isinstance(x, torch.Tensor):
                raise TypeError(
                    f"{self.__name__}: argument #{i} is a local tensor; put it on the mesh "
                    f"first with md.to_mesh"
                )
        if mesh is None:
            raise RuntimeError(f"{self.__name__}: a remote function needs an active mesh")
        engine = Engine.of(mesh)
        line = user_line()
        worker_flat = [isa.Ref(x._md_ref) if isinstance(x, Tensor) else x for x in flat]
        wargs, wkwargs = pytree.tree_unflatten(worker_flat, spec)
        key = (
            torch.get_default_dtype(),  # (the learnt outputs' dtypes may follow it)
            *((x._md_desc if isinstance(x, Tensor) else repr(x)) for x in flat),
        )
        shapes_to = shapes_rank = -1
        future = None
        if self.propagate is not None:
            metas = [x._md_meta if isinstance(x, Tensor) else x for x in flat]
            margs, mkwargs = pytree.tree_unflatten(metas, spec)
            out = self.propagate(*margs, **mkwargs)
            leaves, out_spec = pytree.tree_flatten(out)
            described = [
                (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves
            ]
        elif key in self._shapes:
            described, out_spec = self._shapes[key]
        else:  # learn the output shapes from a first run (one round trip, then cached)
            shapes_rank = mesh.ranks[0]
            shapes_to, future = engine.job.expect(
                (shapes_rank,), lambda values: values[0], whole_job=True
            )
        # Output refs: known now when the shapes are known; else one per possible tensor
        # output, decided after the first run (the worker assigns refs in output order).
        if future is None:
            outs = tuple(engine.new_ref() if type(d) is tuple else None for d in described)
        else:
            outs = tuple(engine.new_ref() for _ in range(MAX_LEARNT_OUTPUTS))
        engine.append(
            engine.mesh_id(mesh),
            isa.CallFunction(
                self._payload(),
                wargs,
                wkwargs,
                outs,
                shapes_to,
                shapes_rank,
                engine.mesh_id(mesh),
                stream,
                line,
            ),
        )
        if future is None:
            return self._wrap(described, out_spec, outs, mesh, engine, stream)
        refs = outs
        engine.flush()
        leaves, spec_text = future.get()
        out_spec = pytree.treespec_loads(spec_text)
        described = [(tuple(x[0]), x[1]) if type(x) is tuple else x for x in leaves]
        self._shapes[key] = (described, out_spec)
        n = sum(type(d) is tuple for d in described)
        if n > len(refs):
            for ref in refs:
                engine.delete(ref, stream)
            raise TypeError(
                f"{self.__name__} returned {n} tensors; without propagate= at most "
                f"{MAX_LEARNT_OUTPUTS} are supported (give a propagator)"
            )
        for unused in refs[n:]:
            engine.delete(unused, stream)
        it = iter(refs)
        outs = tuple(next(it) if type(d) is tuple else None for d in described)
        return self._wrap(described, out_spec, outs, mesh, engine, stream)

    @staticmethod
    def _wrap(described, out_spec, outs, mesh, engine, stream) -> Any:
        results = []
        for d, ref in zip(described, outs):
            if type(d) is tuple:
                shape, dtype = d
                meta = torch.empty(shape, dtype=dtype, device="meta")
                results.append(Tensor(meta, mesh, engine, ref, stream))
            else:
                results.append(d)
        return pytree.tree_unflatten(results, out_spec)


def remote(fn: Callable | None = None, *, propagate: Callable | None = None) -> Any:
    """``@md.remote`` or ``@md.remote(propagate=fn)``."""
    if fn is None:
        return lambda f: RemoteFunction(f, propagate)
    return RemoteFunction(fn, propagate)
