"""The instruction set every back end executes (the bottom layer: it imports nothing from the
package). Two parts, one closed set of node types each:

- **Instructions** (``INSTRUCTIONS``): what the controller sends a worker, in batches, in order
  per stream. Eager tensor ops are ``CallOp`` / ``CallFunction`` / ``Reduce`` / ``Transfer``;
  values are named by ``Ref`` (an int id in the worker's ref table); ``Fetch``, ``Delete``,
  ``Seed``, borrows (``BorrowBegin`` / ``BorrowEnd``: events between streams), meshes
  (``DefineMesh``) and compiled plans (``DefinePlan`` once, then ``RunPlan`` per call).
- **Steps** (``STEPS``): a compiled plan lowered for the ranks (``Program``, made by
  ``compiler/lower.py``): ``Compute`` (one aten op) and one type per communication kind --
  ``AllReduce``, ``AllGather``, ``ReduceScatter``, ``AllToAll``, ``Send``, ``Recv`` -- and the
  local redistributions ``ShardLocal`` / ``PartialLocal``. Values are named by ``Slot`` (an
  index into the run's environment).

Back ends: the Python reference executor and plan runner (``runtime/executor.py``,
``runtime/plan_runner.py``), the C++ executor and program (``cpp/``), and the in-process
interpreter (``compiler/interpret.py``); the simulators run steps (``compiler/simulate.py``)
and instructions (``compiler/simulate_eager.py``) with costs instead of values.
``tests/test_isa.py`` (``tests/test_simulate.py`` for the steps' simulator) fails when a kind
has no handler in one of them. The semantics of each collective,
for every Python back end, are ``isa/collectives.py``; the torch op a ``CallOp`` or a
``Compute`` names, ``isa/opnames.py``.

Every instruction and step carries the stream it runs on and the user's ``file:line`` that
made it (``loc``, on instructions and steps alike), so a runtime error points back at the
user's code. Arguments are pytrees of plain values, ``Ref``s / ``Slot``s; ``WORKER_DEVICE``
stands for the worker's device (``cuda:<local index>`` or ``cpu``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple


def dtype_name(dtype: Any) -> str:
    """The name instructions and steps give a torch dtype: ``torch.float32`` -> ``"float32"``
    (``getattr(torch, name)`` is the dtype again)."""
    return str(dtype).removeprefix("torch.")


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
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outs: tuple[int | None, ...]
    stream: str
    loc: str


class CallFunction(NamedTuple):
    """``outs = fn(*args, **kwargs)`` for a Python function (``@md.remote``), cloudpickled in
    ``fn``. ``shapes_to`` >= 0: rank ``shapes_rank`` also sends the outputs' shapes and dtypes
    to the controller as the reply to that call id (the first run of a function without a
    propagator)."""

    fn: bytes
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outs: tuple[int | None, ...]
    shapes_to: int
    shapes_rank: int
    mesh: int  # md.current_rank() inside fn is the point in this mesh
    stream: str
    loc: str


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
    loc: str


class Transfer(NamedTuple):
    """Point-to-point copies: for each (from rank, to rank) pair, the value of ``src`` on the
    first lands in ``out`` on the second (``to_mesh``, pipeline transfers)."""

    src: int
    out: int
    pairs: tuple[tuple[int, int], ...]
    shape: tuple[int, ...]
    dtype: str
    stream: str
    loc: str


class Fetch(NamedTuple):
    """Send a CPU copy of ``ref`` (or its error) to the controller, as the reply to
    ``call_id``; ``ref`` -1 replies None (a barrier: everything before it has run)."""

    call_id: int
    ref: int
    stream: str
    loc: str


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
    loc: str


class BorrowEnd(NamedTuple):
    """The borrow of ``dst`` ends: ``stream`` forgets it and signals ``event``; ``origin``
    waits for that before its next instruction."""

    dst: int
    origin: str
    stream: str
    event: int
    loc: str


class Seed(NamedTuple):
    """``torch.manual_seed(seed)`` on the worker."""

    seed: int
    loc: str


class DefineMesh(NamedTuple):
    """Name a mesh for later instructions: ``ranks`` (allocation ranks, row-major) with dims
    ``dims`` of sizes ``sizes``."""

    mesh: int
    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]


class DefinePlan(NamedTuple):
    """Keep the lowered program ``program`` as plan ``plan``; ``placements``: per input of
    the program, its placements (how a whole value a ``RunPlan`` splits or sends is cut into
    this rank's part). Sent once, not with every call."""

    plan: int
    program: Program
    placements: tuple[Any, ...] = ()


class RunPlan(NamedTuple):
    """Run plan ``plan`` on mesh ``mesh``: ``inputs`` are the refs of this rank's inputs (its
    shards), ``outputs`` the refs its results get. ``split``: (whole ref, local ref, input
    index) — a whole value sent by the controller; this rank keeps its part of it (by that
    input's placements, from the plan's ``DefinePlan``) as the local ref before the run.
    ``sent``: (input index, whole value) — a local tensor argument sent with the call: this
    rank's part of it (by that input's placements) is the input for this run only (its entry
    of ``inputs`` is -1; no ref is made, so nothing is deleted after). ``parts``: (input
    index, part) — a local tensor argument whose ranks' parts are runs of its rows: each
    worker is sent its own part only, the input for this run (on the controller the value is
    a ``serialize.PerRank``). ``values``: plain values (numbers) of the program's inputs after
    those ``inputs`` names, in order (a replayed eager batch's floats, ``tensor/replay.py``)."""

    plan: int
    mesh: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    split: tuple[tuple[int, int, int], ...]
    stream: str
    loc: str
    sent: tuple[tuple[int, Any], ...] = ()
    parts: tuple[tuple[int, Any], ...] = ()
    values: tuple[Any, ...] = ()


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
    return [r.id for r in leaves(value, Ref)]


def leaves(value: Any, kind: type) -> list[Any]:
    """The ``kind`` objects in a pytree of arguments (tuples, lists, dict values), in order."""
    out: list[Any] = []
    _collect(value, kind, out)
    return out


def _collect(value: Any, kind: type, out: list[Any]) -> None:
    if isinstance(value, kind):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, kind, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, kind, out)


# ======================================================================= lowered plan steps


class Slot(NamedTuple):
    """A value of a plan run: an index into the run's environment."""

    index: int  # type: ignore[assignment]  # (the field shadows tuple.index, on purpose)


On = tuple[tuple[int, int], ...]  # (mesh dim index, index along it): the ranks that run a step


@dataclass(frozen=True, kw_only=True)
class Step:
    """What every step has: ``outs`` (slots it defines), ``on`` (it runs on the ranks whose
    coordinate along dim ``d`` is ``i`` for each ``(d, i)``; empty: on all), ``stream``,
    ``loc`` (the user's file:line) and ``frees`` (slots whose last use it is)."""

    kind: ClassVar[str]
    args: tuple[Any, ...] = ()
    outs: tuple[int, ...] = ()
    on: On = ()
    stream: str = "main"
    loc: str = ""
    frees: tuple[int, ...] = ()

    @property
    def op(self) -> str:
        """What the step does, for messages: an aten op's name or the communication kind."""
        return self.kind

    def uses(self) -> tuple[int, ...]:
        """The slots the step reads."""
        return tuple(s.index for s in leaves(self.args, Slot))

    def runs_on(self, coords: tuple[int, ...]) -> bool:
        return all(coords[d] == i for d, i in self.on)


@dataclass(frozen=True, kw_only=True)
class Compute(Step):
    """``outs = aten_op(*args, **kwargs)``; ``name`` is the overload's name,
    ``aten.mm.default``. A ``device`` kwarg means the executing worker's device."""

    kind: ClassVar[str] = "compute"
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def op(self) -> str:
        return self.name

    def uses(self) -> tuple[int, ...]:
        return tuple(s.index for s in leaves((self.args, self.kwargs), Slot))


@dataclass(frozen=True, kw_only=True)
class Comm(Step):
    """A communication or local redistribution over mesh dims ``dims`` (indices). ``shapes``
    and ``dtype`` (a torch dtype's name) are the arguments' local ones: a rank whose earlier
    step failed takes part with zeros of them, so no peer waits forever."""

    dims: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str = "float32"


@dataclass(frozen=True, kw_only=True)
class AllReduce(Comm):
    """Each of ``args`` reduced over the group (``reduce``: sum avg max min) into the slot of
    ``outs`` at the same position; several arguments are one bucket (one flat buffer)."""

    kind: ClassVar[str] = "all_reduce"
    reduce: str = "sum"


@dataclass(frozen=True, kw_only=True)
class AllGather(Comm):
    """The group's values of ``args[0]`` concatenated along ``dim``."""

    kind: ClassVar[str] = "all_gather"
    dim: int = 0


@dataclass(frozen=True, kw_only=True)
class ReduceScatter(Comm):
    """``args[0]`` reduced over the group, this rank's ``1/n`` chunk of it along ``dim``."""

    kind: ClassVar[str] = "reduce_scatter"
    reduce: str = "sum"
    dim: int = 0


@dataclass(frozen=True, kw_only=True)
class AllToAll(Comm):
    """``args[0]`` split in ``n`` along ``split_dim``, piece ``j`` to member ``j``; the pieces
    received concatenated along ``cat_dim``."""

    kind: ClassVar[str] = "all_to_all"
    split_dim: int = 0
    cat_dim: int = 0


@dataclass(frozen=True, kw_only=True)
class Send(Comm):
    """``args[0]`` to the rank whose coordinate along ``dims[0]`` is ``peer`` (the others as
    this rank's)."""

    kind: ClassVar[str] = "send"
    peer: int


@dataclass(frozen=True, kw_only=True)
class Recv(Comm):
    """``outs[0]`` from the rank whose coordinate along ``dims[0]`` is ``peer``; ``shapes[0]``
    is its shape."""

    kind: ClassVar[str] = "recv"
    peer: int


@dataclass(frozen=True, kw_only=True)
class ShardLocal(Comm):
    """This rank's chunk of ``args[0]`` along ``dim`` (by its coordinate along ``dims[0]``):
    no communication."""

    kind: ClassVar[str] = "shard_local"
    dim: int = 0


@dataclass(frozen=True, kw_only=True)
class PartialLocal(Comm):
    """A replicated ``args[0]`` as a partial value over ``dims[0]``: for ``sum``, the first
    rank keeps it and the others hold zeros; other reductions keep it everywhere."""

    kind: ClassVar[str] = "partial_local"
    reduce: str = "sum"


STEPS: tuple[type[Step], ...] = (
    Compute,
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Send,
    Recv,
    ShardLocal,
    PartialLocal,
)
COLLECTIVES: tuple[type[Comm], ...] = (AllReduce, AllGather, ReduceScatter, AllToAll)


class Program(NamedTuple):
    """A compiled plan lowered for its ranks: the steps in order (each rank runs those whose
    ``on`` it matches), the number of slots, which slots are inputs and outputs, and the
    outputs' local shapes and dtypes."""

    name: str
    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    steps: tuple[Step, ...]
    n_slots: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    output_shapes: tuple[tuple[int, ...] | None, ...]  # local shapes, per output
    output_dtypes: tuple[str, ...]


def settles(program: Program) -> list[tuple[int, ...]]:
    """Per step, the slots whose collectives (started off ``main``, ``Step.stream``) are
    finished before the step runs: the slots it reads, and -- before a ``ReduceScatter`` off
    ``main`` -- the result of the previous one on that stream and ranks (``on``), if nothing
    has read it yet. So at most one reduce-scatter is in flight per stream, as in FSDP: the
    whole (unreduced) gradient each one holds is freed then, not at the optimizer's first read
    of its shard. The runtime and the simulator both finish collectives at these points."""
    out: list[tuple[int, ...]] = []
    # (stream, on) -> the last reduce-scatter's results
    in_flight: dict[tuple[str, tuple[tuple[int, int], ...]], tuple[int, ...]] = {}
    for step in program.steps:
        uses = step.uses()
        read = set(uses)
        for key, outs in list(in_flight.items()):
            if read.intersection(outs):
                del in_flight[key]
        extra: tuple[int, ...] = ()
        if isinstance(step, ReduceScatter) and step.stream != "main":
            key = (step.stream, tuple(step.on))
            extra = tuple(s for s in in_flight.pop(key, ()) if s not in read)
            in_flight[key] = tuple(step.outs)
        out.append(uses + extra)
    return out
