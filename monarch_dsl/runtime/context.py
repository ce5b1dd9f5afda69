"""Where am I? ``md.current_rank()`` for code running in a worker."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping

from monarch_dsl.mesh import coords_of_index, index_of_coords


class Point(Mapping[str, int]):
    """Coordinates in a mesh: ``p["gpu"]``, ``p.rank`` (flat, row-major), ``p.sizes``."""

    __slots__ = ("_coords", "_sizes", "rank")

    def __init__(self, coords: dict[str, int], sizes: dict[str, int]):
        self._coords = coords
        self._sizes = sizes
        self.rank = index_of_coords([coords[dim] for dim in sizes], tuple(sizes.values()))

    @classmethod
    def of_index(cls, index: int, dims: tuple[str, ...], sizes: tuple[int, ...]) -> Point:
        return cls(dict(zip(dims, coords_of_index(index, sizes))), dict(zip(dims, sizes)))

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(self._sizes)

    def __getitem__(self, dim: str) -> int:
        try:
            return self._coords[dim]
        except KeyError:
            raise KeyError(f"no dim {dim!r} here; dims are {self.dims}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._coords)

    def __len__(self) -> int:
        return len(self._coords)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Point):
            return self._coords == other._coords and self._sizes == other._sizes
        return dict(self._coords) == other

    def __hash__(self) -> int:
        return hash(tuple(self._coords.items()))

    def __repr__(self) -> str:
        inner = ", ".join(f"{d}={c}" for d, c in self._coords.items())
        return f"Point({inner})"


# The point of the actor whose endpoint is running (or of the process, outside any actor).
_current: contextvars.ContextVar[Point | None] = contextvars.ContextVar("md_point", default=None)
_process_point: Point | None = None


def set_process_point(point: Point) -> None:
    global _process_point
    _process_point = point


def set_current_point(point: Point) -> contextvars.Token[Point | None]:
    """Make ``point`` what ``current_rank()`` gives in this context (while an actor's
    endpoint or a remote function runs); ``reset_current_point(token)`` undoes it."""
    return _current.set(point)


def reset_current_point(token: contextvars.Token[Point | None]) -> None:
    _current.reset(token)


def current_rank() -> Point:
    """The coordinates of the running actor in its actor mesh (or of this worker process in its
    process mesh, outside an endpoint). Only meaningful inside a worker."""
    point = _current.get()
    if point is None:
        point = _process_point
    if point is None:
        raise RuntimeError(
            "md.current_rank() is for code running in a worker (an actor endpoint, a remote "
            "function); the controller has no rank"
        )
    return point
