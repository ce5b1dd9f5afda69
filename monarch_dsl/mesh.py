"""Meshes: n-dimensional arrays of global ranks with named dims (pure values, no processes).

A ``Mesh`` is the one vocabulary for placement in monarch_dsl: user code, plans, the runtime and
error messages all speak of dims by name and size. It holds a read-only, row-major numpy array of
global ranks, so slices of slices, and flattening a non-contiguous slice, need no special cases.

Every operation builds its result through ``Mesh._derive``, which ``ProcMesh`` overrides so that
the same algebra gives meshes over the same processes.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Mesh", "all_coords", "coords_of_index", "index_of_coords"]


# ---- row-major coordinates over a tuple of sizes (the one place this arithmetic lives) ------


def coords_of_index(index: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """The coordinates of flat row-major position ``index`` in a grid of ``sizes`` (the last
    dim varies fastest): ``(1, 2)`` for 5 in ``(2, 3)``."""
    coords: list[int] = []
    for size in reversed(sizes):
        index, coord = divmod(index, size)
        coords.append(coord)
    return tuple(reversed(coords))


def index_of_coords(coords: Sequence[int], sizes: Sequence[int]) -> int:
    """The flat row-major position of ``coords`` in a grid of ``sizes``: 5 for ``(1, 2)`` in
    ``(2, 3)``."""
    index = 0
    for coord, size in zip(coords, sizes):
        index = index * size + coord
    return index


def all_coords(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every coordinate tuple of a grid of ``sizes``, in row-major order."""
    return list(itertools.product(*(range(n) for n in sizes)))


def _check_name(name: object, what: str = "a dim name") -> str:
    """Return ``name`` if it is an ASCII Python identifier, else raise."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, got {type(name).__name__} {name!r}")
    if not (name.isidentifier() and name.isascii()):
        raise ValueError(f"{what} must be an ASCII Python identifier, got {name!r}")
    return name


def _check_size(name: str, size: object) -> int:
    """Return ``size`` as an int if it is a valid size (an int >= 1) for dim ``name``."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise TypeError(f"size of dim {name!r} must be an int, got {type(size).__name__} {size!r}")
    if size < 1:
        raise ValueError(f"size of dim {name!r} must be >= 1, got {size}")
    return int(size)


def _check_index(value: object, size: int, where: str) -> int:
    """Return ``value`` as a position in ``range(size)`` (negative counts from the end)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"index into {where} must be an int, got {type(value).__name__} {value!r}")
    if not -size <= value < size:
        raise IndexError(f"index {value} is out of range for {where}")
    return int(value) % size


def _check_unique(dims: Sequence[str], context: str = "") -> None:
    """Raise ``ValueError`` if a name occurs twice in ``dims``."""
    repeated = [d for i, d in enumerate(dims) if d in dims[:i]]
    if repeated:
        names = ", ".join(repr(d) for d in dict.fromkeys(repeated))
        prefix = f"{context}: " if context else ""
        raise ValueError(f"{prefix}dim names must be unique, found {names} twice in {dims}")


def _format_slice(s: slice) -> str:
    text = ":".join("" if v is None else str(v) for v in (s.start, s.stop, s.step))
    return text.removesuffix(":")


class Mesh:
    """An n-dimensional array of global ranks with named dims, row-major.

    ``Mesh({"host": 2, "gpu": 4})`` or ``Mesh(host=2, gpu=4)`` holds ranks 0..7; slicing,
    splitting, renaming and flattening give new meshes over (some of) the same ranks.
    """

    __slots__ = ("_dims", "_ranks")

    _dims: tuple[str, ...]
    _ranks: np.ndarray

    def __init__(self, sizes: Mapping[str, int] | None = None, /, **kwargs: int) -> None:
        if isinstance(sizes, str):
            raise TypeError(
                f"Mesh() takes a mapping of dim sizes, got the str {sizes!r}; "
                "to parse text use Mesh.from_string"
            )
        if sizes is not None and kwargs:
            raise TypeError("Mesh() takes sizes as a mapping or as keywords, not both")
        if sizes is None:
            sizes = kwargs
        elif not isinstance(sizes, Mapping):
            raise TypeError(
                f"Mesh() takes a mapping of dim sizes such as {{'host': 2, 'gpu': 4}}, "
                f"got {type(sizes).__name__} {sizes!r}"
            )
        dims = tuple(_check_name(name) for name in sizes)
        shape = tuple(_check_size(name, size) for name, size in sizes.items())
        ranks = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
        self._set(dims, ranks)

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def _from_array(cls, dims: tuple[str, ...], ranks: np.ndarray) -> Mesh:
        """A mesh over ``ranks`` (an int array with one axis per dim), without copying it."""
        mesh = object.__new__(cls)
        mesh._set(tuple(dims), ranks)
        return mesh

    def _set(self, dims: tuple[str, ...], ranks: np.ndarray) -> None:
        for name in dims:
            _check_name(name)
        _check_unique(dims)
        ranks = np.asarray(ranks, dtype=np.int64)
        if ranks.ndim != len(dims):
            raise ValueError(
                f"a mesh with dims {dims} needs a {len(dims)}-d array of ranks, "
                f"got shape {ranks.shape}"
            )
        ranks = ranks.view()  # our own view, so freezing it leaves the caller's array alone
        ranks.setflags(write=False)
        self._dims = dims
        self._ranks = ranks

    def _derive(self, dims: tuple[str, ...], ranks: np.ndarray) -> Mesh:
        """Build the result of an operation on this mesh (``ProcMesh`` keeps its processes)."""
        return Mesh._from_array(dims, ranks)

    # ---- shape ------------------------------------------------------------------------------

    @property
    def dims(self) -> tuple[str, ...]:
        """The dim names, in order."""
        return self._dims

    @property
    def sizes(self) -> dict[str, int]:
        """``{name: size}`` in dim order."""
        return dict(zip(self._dims, self._ranks.shape, strict=True))

    @property
    def ndim(self) -> int:
        """The number of dims."""
        return len(self._dims)

    def __len__(self) -> int:
        return int(self._ranks.size)

    def _axis(self, dim: str) -> int:
        """The position of ``dim`` in ``self.dims``; ``KeyError`` if there is none."""
        try:
            return self._dims.index(dim)
        except ValueError:
            raise KeyError(f"mesh {self} has no dim {dim!r}; its dims are {self._dims}") from None

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """The size of ``dim``: a name, a tuple of names (their product) or None (all ranks)."""
        if dim is None:
            return len(self)
        if isinstance(dim, str):
            return int(self._ranks.shape[self._axis(dim)])
        if isinstance(dim, (tuple, list)):
            for d in dim:
                if not isinstance(d, str):
                    raise TypeError(f"size() takes dim names, got {type(d).__name__} {d!r}")
            return math.prod(self.size(d) for d in dim)
        raise TypeError(
            f"size() takes a dim name, a tuple of names or None, got {type(dim).__name__} {dim!r}"
        )

    @property
    def ranks(self) -> list[int]:
        """The global ranks of this mesh, row-major."""
        return self._ranks.reshape(-1).tolist()

    # ---- algebra ----------------------------------------------------------------------------

    def rename(self, **renames: str) -> Mesh:
        """The same ranks with dims renamed: ``m.rename(host="dp", gpu="tp")``."""
        for old in renames:
            self._axis(old)
        for new in renames.values():
            _check_name(new, "a new dim name")
        dims = tuple(renames.get(d, d) for d in self._dims)
        _check_unique(dims, f"rename of {self._dims} to {dims}")
        return self._derive(dims, self._ranks)

    def split(self, **kwargs: Sequence[str] | int) -> Mesh:
        """Split dims into several, row-major: ``m.split(gpu=("dp", "tp"), tp=2)``.

        A tuple value names the dims that replace a dim; an int value gives the size of a new dim.
        One size per split may be left out and is inferred.
        """
        splits: dict[str, tuple[str, ...]] = {}
        sizes: dict[str, int] = {}
        for key, value in kwargs.items():
            if isinstance(value, (tuple, list)):
                self._axis(key)
                if not value:
                    raise ValueError(f"split({key}=()) needs at least one new dim name")
                splits[key] = tuple(_check_name(n, "a new dim name") for n in value)
            elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                sizes[key] = _check_size(key, value)
            else:
                raise TypeError(
                    f"split() takes dim=(new, names, ...) or new_dim=size, "
                    f"got {key}={value!r} ({type(value).__name__})"
                )
        if not splits:
            raise ValueError(
                f"split() needs a dim to split, e.g. split(gpu=('dp', 'tp'), tp=2); got {kwargs}"
            )
        dims = tuple(n for d in self._dims for n in splits.get(d, (d,)))
        _check_unique(dims, f"split of {self._dims} into {dims}")
        unused = [n for n in sizes if not any(n in names for names in splits.values())]
        if unused:
            raise ValueError(
                f"split() got sizes for {', '.join(f'{n}={sizes[n]}' for n in unused)}, "
                f"which is not a new dim of any split (new dims: {dims})"
            )
        shape: list[int] = []
        for dim, size in zip(self._dims, self._ranks.shape, strict=True):
            if dim not in splits:
                shape.append(size)
                continue
            names = splits[dim]
            unknown = [n for n in names if n not in sizes]
            known = math.prod(sizes[n] for n in names if n in sizes)
            where = f"split of dim {dim!r} (size {size}) into {names}"
            if len(unknown) > 1:
                raise ValueError(
                    f"{where}: can infer at most one size, but {unknown} have none; "
                    f"give sizes for all but one, e.g. {unknown[0]}=..."
                )
            if unknown and size % known:
                raise ValueError(f"{where}: {size} is not divisible by {known}")
            if not unknown and known != size:
                raise ValueError(f"{where}: the sizes multiply to {known}, expected {size}")
            shape.extend(sizes.get(n, size // known) for n in names)
        return self._derive(dims, self._ranks.reshape(shape))

    def flatten(self, name: str) -> Mesh:
        """All dims merged into one dim ``name``, row-major (any mesh, slices included)."""
        return self._derive((_check_name(name),), self._ranks.reshape(-1))

    def slice(self, **index: int | slice) -> Mesh:
        """Select along dims: ``m.slice(host=0, gpu=slice(0, 2))``.

        An int picks one position and drops the dim (negative ints count from the end);
        a ``slice`` keeps the dim (steps allowed) and must select at least one position.
        """
        shape = self._ranks.shape
        selection: list[int | slice] = [slice(None)] * self.ndim
        for dim, value in index.items():
            axis = self._axis(dim)
            if isinstance(value, slice):
                try:
                    chosen = range(shape[axis])[value]
                except ValueError:
                    raise ValueError(f"slice step of dim {dim!r} must not be zero") from None
                except TypeError:
                    raise TypeError(
                        f"slice bounds of dim {dim!r} must be ints or None, got {value}"
                    ) from None
                if not chosen:
                    raise ValueError(
                        f"slice {dim}=[{_format_slice(value)}] selects nothing "
                        f"from dim {dim!r} of size {shape[axis]}"
                    )
                selection[axis] = value
            elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                selection[axis] = _check_index(
                    value, shape[axis], f"dim {dim!r} of size {shape[axis]}"
                )
            else:
                raise TypeError(
                    f"slice() takes dim=int or dim=slice(...), "
                    f"got {dim}={value!r} ({type(value).__name__})"
                )
        dims = tuple(d for d, s in zip(self._dims, selection, strict=True) if isinstance(s, slice))
        return self._derive(dims, self._ranks[tuple(selection)])

    def rank(self, dims: str | Sequence[str] = ()) -> Any:
        """A mesh tensor holding each rank's coordinate along ``dims``; needs an active mesh."""
        raise RuntimeError(
            f"mesh.rank({dims!r}) gives a mesh tensor, so it needs an active mesh: "
            "call it inside `with pm.activate():` on a ProcMesh"
        )

    # ---- coordinates ------------------------------------------------------------------------

    def points(self) -> list[dict[str, int]]:
        """The coordinates of every position, row-major: ``[{"host": 0, "gpu": 0}, ...]``."""
        return [dict(zip(self._dims, c, strict=True)) for c in all_coords(self._ranks.shape)]

    def coords_of(self, index: int) -> dict[str, int]:
        """The coordinates of flat row-major position ``index`` (negative counts from the end)."""
        flat = _check_index(index, len(self), f"the {len(self)} positions of mesh {self}")
        return dict(zip(self._dims, coords_of_index(flat, self._ranks.shape), strict=True))

    def index_of(self, **coords: int) -> int:
        """The flat row-major position of ``coords``, which must name every dim."""
        for dim in coords:
            self._axis(dim)
        missing = [d for d in self._dims if d not in coords]
        if missing:
            raise ValueError(
                f"index_of() needs a coordinate for every dim of {self._dims}, missing {missing}"
            )
        checked = [
            _check_index(coords[dim], size, f"dim {dim!r} of size {size}")
            for dim, size in zip(self._dims, self._ranks.shape, strict=True)
        ]
        return index_of_coords(checked, self._ranks.shape)

    # ---- text -------------------------------------------------------------------------------

    def to_table(self) -> str:
        """A plain-text table of the global ranks laid out by coordinates.

        Columns are the last dim; rows are the leading dims, labelled with their coordinates::

                    gpu=0  gpu=1  gpu=2  gpu=3
            host=0      0      1      2      3
            host=1      4      5      6      7
        """
        if self.ndim == 0:
            return f"rank\n{int(self._ranks):>4}"
        *lead, last = self._dims
        header = [f"{last}={j}" for j in range(self._ranks.shape[-1])]
        rows = self._ranks.reshape(-1, self._ranks.shape[-1]).tolist()
        labels = [
            ",".join(f"{d}={int(c)}" for d, c in zip(lead, point, strict=True))
            for point in all_coords(self._ranks.shape[:-1])
        ]
        label_width = max(map(len, labels)) if lead else 0
        widths = [max(len(h), *(len(str(r[j])) for r in rows)) for j, h in enumerate(header)]

        def line(label: str, cells: Sequence[object]) -> str:
            parts = [label.ljust(label_width)] if lead else []
            parts += [str(c).rjust(w) for c, w in zip(cells, widths, strict=True)]
            return "  ".join(parts).rstrip()

        return "\n".join(
            [line("", header)] + [line(lab, row) for lab, row in zip(labels, rows, strict=True)]
        )

    def _is_canonical(self) -> bool:
        """Whether the ranks are 0..n-1 in row-major order (then ``str`` leaves them out)."""
        return bool(np.array_equal(self._ranks.reshape(-1), np.arange(len(self))))

    def __str__(self) -> str:
        shape = (
            ",".join(f"{d}={s}" for d, s in zip(self._dims, self._ranks.shape, strict=True)) or "()"
        )
        if self._is_canonical():
            return shape
        return f"{shape} ranks=[{','.join(map(str, self.ranks))}]"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    @classmethod
    def from_string(cls, text: str) -> Mesh:
        """Parse the text ``str(mesh)`` gives, e.g. ``"host=2,gpu=4"`` or ``"a=2 ranks=[1,5]"``."""
        if not isinstance(text, str):
            raise TypeError(f"Mesh.from_string() takes a str, got {type(text).__name__}")
        import lark.exceptions

        from monarch_dsl.grammar import explain, parser

        try:
            tree = parser("mesh").parse(text)
        except lark.exceptions.UnexpectedInput as e:
            raise ValueError(f"cannot parse mesh {text!r} {explain(e, text, 'mesh')}") from None
        try:
            return cls._from_tree(tree)
        except ValueError as e:
            raise ValueError(f"invalid mesh {text!r}: {e}") from None

    @staticmethod
    def _from_tree(tree: Any) -> Mesh:
        """The mesh of a parsed ``mesh`` rule of ``plan.lark`` (plans reuse this)."""
        dims_tree, *ranks_tree = tree.children
        dims = tuple(str(d.children[0]) for d in dims_tree.children)
        _check_unique(dims)
        shape = tuple(
            _check_size(name, int(d.children[1]))
            for name, d in zip(dims, dims_tree.children, strict=True)
        )
        n = math.prod(shape)
        if not ranks_tree:
            return Mesh._from_array(dims, np.arange(n, dtype=np.int64).reshape(shape))
        ranks = [int(r) for r in ranks_tree[0].children]
        if len(ranks) != n:
            raise ValueError(f"its dims have {n} positions but ranks=[...] lists {len(ranks)}")
        if len(set(ranks)) != len(ranks):
            repeated = sorted(r for r, count in Counter(ranks).items() if count > 1)
            raise ValueError(f"ranks must be distinct, found {repeated} more than once")
        return Mesh._from_array(dims, np.array(ranks, dtype=np.int64).reshape(shape))

    # ---- value semantics --------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return self._dims == other._dims and np.array_equal(self._ranks, other._ranks)

    def __hash__(self) -> int:
        return hash((self._dims, self._ranks.shape, self._ranks.tobytes()))
