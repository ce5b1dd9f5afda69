"""Actors: ``class A(md.Actor)`` with ``@md.endpoint`` methods, spawned on a process mesh."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from monarch_dsl.errors import SupervisionError
from monarch_dsl.mesh import Mesh
from monarch_dsl.runtime.context import Point, current_rank
from monarch_dsl.runtime.future import Future, flush_before_blocking
from monarch_dsl.runtime.messages import CallEndpoint, SpawnActor

if TYPE_CHECKING:
    from monarch_dsl.proc_mesh import ProcMesh

__all__ = ["Actor", "ActorMesh", "ValueMesh", "endpoint", "current_rank"]

_actor_ids = itertools.count(1)


class Actor:
    """Base class of actors. Methods marked ``@md.endpoint`` can be called from the controller;
    an instance lives in each worker of the mesh it was spawned on."""


def endpoint(fn: Callable) -> Callable:
    """Mark an actor method (sync or ``async``) as callable from the controller."""
    if not callable(fn):
        raise TypeError(f"@md.endpoint decorates a method, got {type(fn).__name__}")
    fn.__md_endpoint__ = True
    return fn


def _endpoints(cls: type) -> dict[str, Callable]:
    return {
        name: fn
        for name in dir(cls)
        if getattr(fn := getattr(cls, name, None), "__md_endpoint__", False)
    }


class ValueMesh:
    """One value per actor of a mesh, from ``ep.call()``."""

    def __init__(self, mesh: Mesh, values: list):
        self._mesh = mesh
        self._values = values

    @property
    def dims(self) -> tuple[str, ...]:
        return self._mesh.dims

    @property
    def sizes(self) -> dict[str, int]:
        return self._mesh.sizes

    def item(self, **coords: int) -> Any:
        """The value at ``coords`` (every dim named); no coords for a single value."""
        if not coords:
            if len(self._values) != 1:
                raise ValueError(
                    f"item() without coordinates needs a single value; this ValueMesh has "
                    f"{len(self._values)} ({self._mesh.sizes}): name every dim, e.g. "
                    f"item({', '.join(f'{d}=0' for d in self.dims)})"
                )
            return self._values[0]
        return self._values[self._mesh.index_of(**coords)]

    def items(self) -> Iterator[tuple[Point, Any]]:
        dims, sizes = self._mesh.dims, tuple(self._mesh.sizes.values())
        for i, v in enumerate(self._values):
            yield Point.of_index(i, dims, sizes), v

    def values(self) -> list:
        return list(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ValueMesh):
            return NotImplemented
        return (
            self.dims == other.dims and self.sizes == other.sizes and self._values == other._values
        )

    def __repr__(self) -> str:
        body = ", ".join(f"{dict(p)}: {v!r}" for p, v in itertools.islice(self.items(), 8))
        more = ", ..." if len(self) > 8 else ""
        return f"ValueMesh({{{body}{more}}})"


class ActorMesh:
    """An actor spawned on every process of a mesh (or a slice of such a mesh).

    ``am.<endpoint>.call(...)`` and friends; slicing like a mesh: ``am.slice(gpu=1)``.
    """

    def __init__(self, cls: type, name: str, actor_id: int, procs: ProcMesh, shape: Mesh):
        self._cls = cls
        self._name = name
        self._actor_id = actor_id
        self._procs = procs  # the processes (global ranks) of this (sliced) actor mesh
        self._shape = shape  # the mesh it was spawned on: points are positions in it
        self._job_ranks = tuple(procs.ranks)
        self._endpoints = _endpoints(cls)
        self._rr = itertools.count()

    # ---- mesh-like -------------------------------------------------------------------------
    @property
    def dims(self) -> tuple[str, ...]:
        return self._procs.dims

    @property
    def sizes(self) -> dict[str, int]:
        return self._procs.sizes

    def __len__(self) -> int:
        return len(self._procs)

    def _derived(self, procs: ProcMesh) -> ActorMesh:
        return ActorMesh(self._cls, self._name, self._actor_id, procs, self._shape)

    def slice(self, **index: int | slice) -> ActorMesh:
        return self._derived(self._procs.slice(**index))

    def rename(self, **renames: str) -> ActorMesh:
        return self._derived(self._procs.rename(**renames))

    def split(self, **kwargs: Any) -> ActorMesh:
        return self._derived(self._procs.split(**kwargs))

    def flatten(self, name: str) -> ActorMesh:
        return self._derived(self._procs.flatten(name))

    # ---- endpoints -------------------------------------------------------------------------
    def __getattr__(self, name: str) -> EndpointRef:
        if name.startswith("__"):
            raise AttributeError(name)
        fn = self._endpoints.get(name)
        if fn is None:
            known = ", ".join(sorted(self._endpoints)) or "none"
            if hasattr(self._cls, name):
                raise AttributeError(
                    f"{self._cls.__name__}.{name} is not an endpoint (mark it with "
                    f"@md.endpoint); endpoints: {known}"
                )
            raise AttributeError(
                f"{self._cls.__name__} has no endpoint {name!r}; endpoints: {known}"
            )
        return EndpointRef(self, name, fn)

    def _point_of(self, job_rank: int) -> Point:
        """The actor's point (in the mesh it was spawned on) of the process ``job_rank``."""
        spawned = self._shape
        i = spawned.ranks.index(job_rank)
        return Point.of_index(i, spawned.dims, tuple(spawned.sizes.values()))

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name!r} {self._cls.__name__} {self._procs.sizes}>"


class EndpointRef:
    """``am.ep``: the ways of calling one endpoint on an actor mesh."""

    def __init__(self, am: ActorMesh, name: str, fn: Callable):
        self._am = am
        self._name = name
        self._fn = fn

    def _check(self, args: tuple, kwargs: dict) -> None:
        """Reject bad arguments here, before anything is sent."""
        lo, hi = _positional_range(self._fn)
        if not kwargs and lo <= len(args) + 1 <= hi:
            return  # the common case, without the cost of Signature.bind
        sig = _signature(self._fn)
        try:
            sig.bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self._am._cls.__name__}.{self._name}{sig}: {e}") from None

    def _msg(self, args: tuple, kwargs: dict) -> Callable[[int], CallEndpoint]:
        actor_id, name = self._am._actor_id, self._name
        return lambda call_id: CallEndpoint(call_id, actor_id, name, args, kwargs)

    def _send(self, ranks, args, kwargs, finish, on_item=None) -> Future:
        self._check(args, kwargs)
        job = self._am._procs.job
        return job.request(ranks, self._msg(args, kwargs), finish, on_item, self._am._point_of)

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh]:
        """Call on every actor; the future holds a ValueMesh of the replies."""
        am = self._am
        mesh = am._procs
        return self._send(am._job_ranks, args, kwargs, lambda values: ValueMesh(mesh, values))

    def call_one(self, *args: Any, **kwargs: Any) -> Future:
        """Call the single actor of a one-actor mesh."""
        if len(self._am) != 1:
            raise ValueError(
                f"call_one needs a mesh of exactly one actor; this one has {len(self._am)} "
                f"({self._am.sizes}): slice it first, or use call()/choose()"
            )
        return self._send(self._am._job_ranks, args, kwargs, lambda values: values[0])

    def choose(self, *args: Any, **kwargs: Any) -> Future:
        """Call one actor of the mesh (round robin over the live ones)."""
        am = self._am
        job = am._procs.job
        ranks = am._job_ranks
        alive = [r for r in ranks if r not in job.dead] or list(ranks)
        rank = alive[next(am._rr) % len(alive)]
        return self._send((rank,), args, kwargs, lambda values: values[0])

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Call on every actor without waiting; errors are printed by the workers."""
        self._check(args, kwargs)
        self._am._procs.job.post(self._am._job_ranks, self._msg(args, kwargs)(-1))

    def stream(self, *args: Any, **kwargs: Any) -> ReplyStream:
        """Call on every actor; iterate (or ``async for``) the replies as they arrive."""
        replies: queue.SimpleQueue = queue.SimpleQueue()

        def on_item(rank: int, value: Any, exc: BaseException | None) -> None:
            replies.put((value, exc))

        self._send(self._am._job_ranks, args, kwargs, None, on_item)
        return ReplyStream(replies, len(self._am))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"call an endpoint through .call(), .call_one(), .choose(), .broadcast() or "
            f".stream(): e.g. am.{self._name}.call_one(...).get()"
        )


class ReplyStream:
    """Replies in arrival order: ``for v in stream`` or ``async for v in stream``."""

    def __init__(self, replies: queue.SimpleQueue, count: int):
        self._replies = replies
        self._left = count

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._left == 0:
            raise StopIteration
        flush_before_blocking()
        value, exc = self._replies.get()  # every reply, error or death arrives here
        self._left -= 1
        if exc is not None:
            raise exc
        return value

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        if self._left == 0:
            raise StopAsyncIteration
        flush_before_blocking()
        value, exc = await asyncio.get_running_loop().run_in_executor(None, self._replies.get)
        self._left -= 1
        if exc is not None:
            raise exc
        return value


_signatures: dict[Callable, inspect.Signature] = {}


def _signature(fn: Callable) -> inspect.Signature:
    sig = _signatures.get(fn)
    if sig is None:
        sig = _signatures[fn] = inspect.signature(fn)
    return sig


_ranges: dict[Callable, tuple[int, int]] = {}


def _positional_range(fn: Callable) -> tuple[int, int]:
    """How many positional arguments (self included) ``fn`` accepts, as (min, max); (1, 0)
    (never true) when a keyword-only parameter is required."""
    r = _ranges.get(fn)
    if r is None:
        P = inspect.Parameter
        params = list(_signature(fn).parameters.values())
        positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        lo = sum(p.default is P.empty for p in positional)
        hi = 1 << 30 if any(p.kind is P.VAR_POSITIONAL for p in params) else len(positional)
        if any(p.kind is P.KEYWORD_ONLY and p.default is P.empty for p in params):
            lo, hi = 1, 0
        r = _ranges[fn] = (lo, hi)
    return r


def reserve_ids(upto: int) -> None:
    """Actor ids up to ``upto`` are taken (by the actors of a persistent mesh just attached):
    new actors get higher ones."""
    global _actor_ids
    nxt = next(_actor_ids)
    _actor_ids = itertools.count(max(nxt, upto + 1))


def spawn(procs: ProcMesh, name: str, cls: type, args: tuple, kwargs: dict) -> ActorMesh:
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"spawn needs a subclass of md.Actor, got {cls!r}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"spawn needs a non-empty actor name, got {name!r}")
    try:
        _signature(cls).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{cls.__name__}{_signature(cls)}: {e}") from None
    except ValueError:
        pass  # no signature available (builtin __init__): let the worker decide
    actor_id = next(_actor_ids)
    dims, sizes, ranks = procs.dims, tuple(procs.sizes.values()), tuple(procs.ranks)
    fut = procs.job.request(
        ranks,
        lambda call_id: SpawnActor(call_id, actor_id, name, cls, args, kwargs, dims, sizes, ranks),
    )
    am = ActorMesh(cls, name, actor_id, procs, procs)
    fut.get()
    return am


__all__ += ["EndpointRef", "ReplyStream", "SupervisionError"]
