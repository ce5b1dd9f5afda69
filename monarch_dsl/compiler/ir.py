"""The instruction set every back end executes: the eager tensor engine sends batches of these,
compiled plans (issue 4) lower to them, the C++ executor (issue 5) and the simulator implement
them.

One small node type per instruction kind, a closed set. Instructions name values by ``Ref``
(an int id in the worker's ref table); each carries the stream it runs on and ``line``, the
user's ``file:line`` that issued it, so any runtime error points back at the user's code.
Arguments are pytrees of plain values and ``Ref``s; ``WORKER_DEVICE`` stands for the worker's
device (``cuda:<local index>`` or ``cpu``).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Ref(NamedTuple):
    """A value in the worker's ref table."""

    id: int

    def __repr__(self) -> str:
        return f"%{self.id}"


class _WorkerDevice:
    """Placeholder for the executing worker's device."""

    def __repr__(self) -> str:
        return "WORKER_DEVICE"

    def __reduce__(self) -> str:
        return "WORKER_DEVICE"


WORKER_DEVICE = _WorkerDevice()


class MeshCoord(NamedTuple):
    """Placeholder argument: the executing rank's coordinate along ``dims`` of mesh ``mesh``
    (several dims combine row-major)."""

    mesh: int
    dims: tuple[str, ...]


class CallOp(NamedTuple):
    """``outs = op(*args, **kwargs)``; ``op`` is an operator name, ``aten::add.Tensor``.
    ``outs`` lists the refs of the tensor outputs, in the order a pytree flatten of the result
    gives them (None for outputs that are not kept)."""

    op: str
    args: tuple
    kwargs: dict
    outs: tuple[int | None, ...]
    stream: str
    line: str


class CallFunction(NamedTuple):
    """``outs = fn(*args, **kwargs)`` for a Python function (``@md.remote``), cloudpickled in
    ``fn``. ``shapes_to`` >= 0: rank ``shapes_rank`` also sends the outputs' shapes and dtypes
    to the controller as the reply to that call id (the first run of a function without a
    propagator)."""

    fn: bytes
    args: tuple
    kwargs: dict
    outs: tuple[int | None, ...]
    shapes_to: int
    shapes_rank: int
    mesh: int  # md.current_rank() inside fn is the point in this mesh
    stream: str
    line: str


class Reduce(NamedTuple):
    """A collective over the mesh dims ``dims`` (names) of the mesh ``mesh`` (its id):
    ``reduction`` in sum/avg/min/max/prod/stack; ``scatter`` makes sum-like ones a
    reduce-scatter over dim 0 and ``stack`` an all-to-all. ``out`` receives the result (it is
    ``src`` for the in-place form)."""

    src: int
    out: int
    mesh: int
    dims: tuple[str, ...]
    reduction: str
    scatter: bool
    shape: tuple[int, ...]  # of src: a rank whose src failed takes part with zeros of it
    dtype: str
    stream: str
    line: str


class Transfer(NamedTuple):
    """Point-to-point copies: for each (from rank, to rank) pair, the value of ``src`` on the
    first lands in ``out`` on the second (``to_mesh``, pipeline transfers)."""

    src: int
    out: int
    pairs: tuple[tuple[int, int], ...]
    shape: tuple[int, ...]
    dtype: str
    stream: str
    line: str


class Fetch(NamedTuple):
    """Send a CPU copy of ``ref`` (or its error) to the controller, as the reply to
    ``call_id``; ``ref`` -1 replies None (a barrier: everything before it has run)."""

    call_id: int
    ref: int
    stream: str
    line: str


class Delete(NamedTuple):
    """Drop these refs from the ref table (the memory goes when nothing else holds it), in
    order with the other instructions of ``stream``."""

    refs: tuple[int, ...]
    stream: str


class BorrowBegin(NamedTuple):
    """Stream ``stream`` borrows ``src`` of stream ``origin`` as ``dst``: it waits until
    ``origin`` has reached this point (event ``event``), then uses the same value."""

    src: int
    dst: int
    origin: str
    stream: str
    event: int
    line: str


class BorrowEnd(NamedTuple):
    """The borrow of ``dst`` ends: ``stream`` forgets it and signals ``event``; ``origin``
    waits for that before its next instruction."""

    dst: int
    origin: str
    stream: str
    event: int
    line: str


class Seed(NamedTuple):
    """``torch.manual_seed(seed)`` on the worker."""

    seed: int
    line: str


class DefineMesh(NamedTuple):
    """Name a mesh for later instructions: ``ranks`` (allocation ranks, row-major) with dims
    ``dims`` of sizes ``sizes``."""

    mesh: int
    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]


class DefinePlan(NamedTuple):
    """Keep the lowered program ``program`` (a ``compiler.lower.Program``) as plan ``plan``."""

    plan: int
    program: Any


class RunPlan(NamedTuple):
    """Run plan ``plan`` on mesh ``mesh``: ``inputs`` are the refs of this rank's inputs (its
    shards), ``outputs`` the refs its results get. ``split``: (whole ref, local ref, input
    index) — a whole value sent by the controller; this rank keeps its part of it (by that
    input's placements) as the local ref before the run."""

    plan: int
    mesh: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    split: tuple[tuple[int, int, int], ...]
    placements: tuple  # per input: its placements (for split)
    stream: str
    line: str


INSTRUCTIONS: tuple[type, ...] = (
    CallOp,
    CallFunction,
    Reduce,
    Transfer,
    Fetch,
    Delete,
    Seed,
    DefineMesh,
    BorrowBegin,
    BorrowEnd,
    DefinePlan,
    RunPlan,
)
REDUCTIONS = ("sum", "avg", "min", "max", "prod", "stack")


def refs_in(value: Any) -> list[int]:
    """The ref ids used in a pytree of arguments."""
    out: list[int] = []
    _collect(value, out)
    return out


def _collect(value: Any, out: list[int]) -> None:
    if isinstance(value, Ref):
        out.append(value.id)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, out)
