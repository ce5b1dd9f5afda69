"""Values back to the controller: ``md.fetch`` (a future of one rank's value), ``md.inspect``,
``md.show``, and ``sync`` (wait until the workers have run what was sent)."""

from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

from monarch_dsl import isa
from monarch_dsl.frames import user_line
from monarch_dsl.runtime.future import Future
from monarch_dsl.tensor.active import check_usable
from monarch_dsl.tensor.engine import Engine
from monarch_dsl.tensor.handle import Tensor


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
        check_usable(t, "fetch", 0, write=False)  # raises
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
    engine.append(engine.rank_mesh_id(rank), isa.Fetch(call_id, t._md_ref, t._md_stream, line))
    engine.flush()
    return fut


def inspect(obj: Any, **coords: int) -> Any:
    """``fetch(obj, **coords).get()``."""
    return fetch(obj, **coords).get()


def sync(mesh: Any, timeout: float | None = None) -> None:
    """Wait until every worker of ``mesh``'s allocation has run what was sent so far (their
    failure reports have then arrived); ``TimeoutError`` after ``timeout`` seconds."""
    engine = Engine.of_job(mesh.job)
    if engine is not None:
        engine.sync(timeout)


def show(obj: Any, **coords: int) -> None:
    """Print one rank's value of ``obj`` with its coordinates."""
    value = inspect(obj, **coords)
    where = ", ".join(f"{d}={c}" for d, c in coords.items()) or "first rank"
    print(f"[{where}] {value}")
