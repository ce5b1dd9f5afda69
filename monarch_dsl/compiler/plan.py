"""The compiled plan: what ``@md.mesh_fn`` produces, prints, parses, checks and lowers.

A ``Plan`` is a straight-line program over named values (``%name``) for a mesh with named
dims. Every value has a global type (shape and dtype of the whole tensor, as the user's
function sees it) and a placement per mesh dim: how the whole tensor is laid out over that dim.
Each instruction is one ``Instr``: an aten op, or a communication the compiler inserted
(``COMM_OPS``), or a local redistribution (``LOCAL_OPS``). Instructions carry the stream they
run on, the ranks they run on (``on``: a pipeline stage, empty for all ranks), the user's
``file:line`` and, for communication, why it is there.

Text form (``str(plan)`` / ``Plan.parse``) is in ``compiler/text.py``; the grammar is
``grammar/plan.lark``. Only the fields that are printed take part in equality, so
``Plan.parse(str(p)) == p``.
"""

from __future__ import annotations

import functools
import math
import textwrap
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypedDict

from monarch_dsl.errors import PlanError as PlanError  # re-exported: the compiler raises it
from monarch_dsl.isa import leaves

# ---- placements ------------------------------------------------------------------------------

PARTIAL_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Placement:
    """How a tensor is laid out over one mesh dim. Use ``Shard``, ``Replicate``, ``Partial``."""

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@dataclass(frozen=True)
class Shard(Placement):
    """Split along tensor dim ``dim`` into equal contiguous chunks, chunk i on index i."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim): dim must be an int, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"

    __repr__ = __str__


@dataclass(frozen=True)
class Replicate(Placement):
    """Every index holds the whole tensor."""

    def __str__(self) -> str:
        return "R"

    __repr__ = __str__


@dataclass(frozen=True)
class Partial(Placement):
    """Every index holds a partial value; the whole tensor is their ``op`` (sum/avg/max/min)."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise ValueError(f"Partial(op): op must be one of {PARTIAL_OPS}, got {self.op!r}")

    def __str__(self) -> str:
        return f"P({self.op})"

    __repr__ = __str__


def format_placements(placements: tuple[Placement, ...], dims: tuple[str, ...]) -> str:
    """``{dp: S(0), tp: R}``: one placement per mesh dim, labelled with the dim's name (a
    placement beyond ``dims`` is printed unlabelled). How plans print a value's layout, and
    how the compiler's messages and reasons word one."""
    items = []
    for i, p in enumerate(placements):
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise TypeError(f"cannot print placement {p!r}: expected Shard, Replicate or Partial")
        items.append((f"{dims[i]}: " if i < len(dims) else "") + str(p))
    return "{" + ", ".join(items) + "}"


# The virtual mesh dim of micro-batches: ``compile_step`` adds it to the mesh when a step runs
# in several micro-batches, ``propagate`` shards the batch over it (its "ranks" run one after
# another on the same devices), and ``pipeline.microbatch`` unrolls it.
MB = "mb"


# ---- types -----------------------------------------------------------------------------------

# Short dtype names used in the text form.
DTYPE_NAMES = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "b8",
    "complex64": "c64",
}


class TensorType(NamedTuple):
    """A value's whole (global) shape and dtype (torch name, ``"float32"``), and its placement
    on each mesh dim, in the mesh's dim order. ``shape`` is None for a non-tensor value (a
    Python scalar an op returned)."""

    shape: tuple[int, ...] | None
    dtype: str
    placements: tuple[Placement, ...]

    def local_shape(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """The shape each rank holds, for mesh dim sizes ``sizes`` (shards are exact)."""
        shape = list(self.shape or ())
        for p, n in zip(self.placements, sizes):
            if isinstance(p, Shard):
                shape[p.dim] //= n
        return tuple(shape)


@functools.cache
def itemsize(dtype: str) -> int:
    """Bytes per element of the torch dtype named ``dtype`` (1 for a name torch lacks)."""
    import torch

    dt = getattr(torch, dtype, None)
    return dt.itemsize if isinstance(dt, torch.dtype) else 1


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# ---- values in instructions ------------------------------------------------------------------


class Var(NamedTuple):
    """A use of the value ``%name`` in an argument."""

    name: str

    def __repr__(self) -> str:
        return f"%{self.name}"


# Argument values are pytrees (tuples, lists) of: Var, None, bool, int, float, str, and the
# torch enums torch.dtype / torch.layout / torch.memory_format / torch.device.

# ---- instructions ----------------------------------------------------------------------------

COMM_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send", "recv")
# Local redistributions: no communication. ``shard_local(%x, dims=(<mesh dim>,), dim=d)``
# keeps this rank's chunk of a replicated value (Replicate -> Shard(d));
# ``partial_local(%x, dims=(<mesh dim>,), op=o)`` turns a replicated value into Partial(o)
# (for sum, index 0 keeps it and the others hold zeros; for avg/max/min all keep it).
LOCAL_OPS = ("shard_local", "partial_local")
STREAMS = ("main", "comms")


@dataclass(frozen=True)
class Instr:
    """``outs = op(*args, **kwargs)``.

    - ``op``: an aten overload name (``"aten.mm.default"``), one of ``COMM_OPS`` or
      ``LOCAL_OPS``. Communication options are kwargs: ``dims`` (tuple of mesh dim names),
      ``op`` (sum/avg/max/min), ``dim`` (the tensor dim gathered or scattered), ``split_dim``
      / ``cat_dim`` (all_to_all), ``peer`` (send/recv: the other stage's index on ``dims[0]``).
    - ``outs``: the names of the results (an op with several results has several); an
      in-place op's result names the mutated value anew.
    - ``types``: one ``TensorType`` per out.
    - ``stream``: one of ``STREAMS``. ``on``: ((dim, index), ...) — only the ranks at those
      coordinates run it (pipeline stages); empty: every rank.
    - ``loc``: the user's ``file:line`` (empty if unknown). ``reason``: why the compiler
      inserted it (communication and local redistribution; empty for the user's own ops).
    """

    outs: tuple[str, ...]
    op: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    types: tuple[TensorType, ...]
    stream: str = "main"
    on: tuple[tuple[str, int], ...] = ()
    loc: str = ""
    reason: str = ""

    @property
    def is_comm(self) -> bool:
        return self.op in COMM_OPS

    def kw(self, name: str, default: Any = None) -> Any:
        for k, v in self.kwargs:
            if k == name:
                return v
        return default

    def uses(self) -> list[str]:
        """Names of the values this instruction reads, in order."""
        return [v.name for v in leaves((self.args, tuple(v for _, v in self.kwargs)), Var)]


def rename_vars(value: Any, renames: dict[str, str]) -> Any:
    """``value`` (an argument: a pytree of tuples and lists) with each ``Var`` whose name is
    in ``renames`` renamed."""
    if isinstance(value, Var):
        return Var(renames.get(value.name, value.name))
    if isinstance(value, (list, tuple)):
        return type(value)(rename_vars(v, renames) for v in value)
    return value


class FreshNames:
    """Names for new values, none of them ``taken`` already (nor given before)."""

    def __init__(self, taken: Iterable[str] = ()) -> None:
        self.taken = set(taken)
        self.counter = 0  # the last number ``fresh(..., numbered=True)`` gave

    def fresh(self, base: str, numbered: bool = False) -> str:
        """``base`` if it is free, else the first free of ``base_1``, ``base_2``, ...; with
        ``numbered``, ``base_<n>`` always, ``n`` counting on from the last numbered name (so
        that the numbers grow through the plan: ``all_reduce_7``)."""
        if numbered:
            i = self.counter
        elif base not in self.taken:
            self.taken.add(base)
            return base
        else:
            i = 0
        while True:
            i += 1
            name = f"{base}_{i}"
            if name not in self.taken:
                break
        if numbered:
            self.counter = i
        self.taken.add(name)
        return name


INPUT_KINDS = ("arg", "param", "buffer", "state", "hyper")
OUTPUT_KINDS = ("out", "state", "grad")


class Input(NamedTuple):
    """A plan input: ``kind`` arg (the function's own argument), param / buffer (of a module
    the function uses, by qualified name), state (optimizer state, ``<param>.<key>``), hyper
    (a 0-dim value worked out from the optimizers' settings at every call: a scheduled
    learning rate, ``compiler/hyper.py``)."""

    name: str
    kind: str
    type: TensorType


class Output(NamedTuple):
    """A plan output: the value ``var`` returned as ``name``. ``kind`` out (the function's
    result, flattened), state (optimizer state created by the step), grad (a parameter's
    ``.grad`` after the step)."""

    name: str
    kind: str
    var: str


class Collective(NamedTuple):
    """One inserted communication, as ``plan.collectives`` lists it."""

    kind: str
    dims: tuple[str, ...]
    reason: str
    loc: str
    value: str  # the value it produces (recv, collectives) or sends (send)
    stream: str


# The text form of a plan and its checker build on this module (compiler/text.py,
# compiler/check.py), and so does the simulator (compiler/simulate.py), so they register
# themselves here -- "format", "parse", "check", "simulate", "memory" -- rather than being
# imported by it; compiler/__init__.py imports them all, so they are always there.
class Implementations(TypedDict, total=False):
    format: Callable[[Plan], str]
    parse: Callable[[str], Plan]
    check: Callable[[Plan], None]
    simulate: Callable[[Plan, Any, Any], Any]  # -> simulate.SimReport
    memory: Callable[[Plan], dict[int, int]]


IMPLEMENTATIONS: Implementations = {}


class PlanNotes(TypedDict, total=False):
    """What ``Plan.notes`` holds: the ``phase`` (forward / backward / update) and pipeline
    ``stage`` of each instruction, by its first out's name (``capture``'s), and the stage of
    each output, by its name (``split_stages``'; None: no instruction makes it)."""

    phase: dict[str, str]
    stage: dict[str, int]
    output_stage: dict[str, int | None]


@dataclass(frozen=True)
class PassRecord:
    """The plan after one pass: ``name`` of the pass, ``seconds`` it took, the plan."""

    name: str
    seconds: float
    plan: Plan


@dataclass(frozen=True)
class Plan:
    """A compiled step for a mesh ``mesh`` (((dim, size), ...)). See the module docstring."""

    name: str
    mesh: tuple[tuple[str, int], ...]
    inputs: tuple[Input, ...]
    body: tuple[Instr, ...]
    outputs: tuple[Output, ...]
    micro_batches: int = 1
    # Not printed, not compared: how the pass pipeline got here, and how to rebuild the
    # function's result from the flat outputs.
    passes: tuple[PassRecord, ...] = field(default=(), compare=False, repr=False)
    out_spec: Any = field(default=None, compare=False, repr=False)
    # Facts passes hand on to later passes (not part of the plan): ``PlanNotes``.
    notes: PlanNotes | None = field(default=None, compare=False, repr=False)

    @property
    def stages(self) -> tuple[PassRecord, ...]:
        """SPEC §5's name for :attr:`passes` (the plan after every pass). The compiler says
        ``passes``: a stage there is a pipeline stage."""
        return self.passes

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.mesh)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.mesh)

    @property
    def collectives(self) -> list[Collective]:
        """Every communication in the plan, in program order."""
        out = []
        for ins in self.body:
            if ins.is_comm:
                value = ins.uses()[0] if ins.op == "send" else ins.outs[0]
                dims = tuple(ins.kw("dims", ()))
                out.append(Collective(ins.op, dims, ins.reason, ins.loc, value, ins.stream))
        return out

    def summary(self) -> str:
        """A plain-text table of the plan for people: its size, then one row per inserted
        communication (kind, mesh dims, stream, the local shape it moves, why, and the user's
        ``file:line``). ``str(plan)`` is the complete text; this is the overview."""
        types = self.types()
        comms = self.collectives
        compute = sum(1 for ins in self.body if not ins.is_comm)
        mesh = ",".join(f"{d}={n}" for d, n in self.mesh)
        head = (
            f"plan {self.name!r} for mesh {mesh}: {len(self.inputs)} inputs, "
            f"{compute} compute instructions, {len(comms)} communications"
        )
        if self.micro_batches > 1:
            head += f", {self.micro_batches} micro-batches"
        rows: list[tuple[str, ...]] = [
            ("#", "kind", "dims", "stream", "moves (per rank)", "why", "where")
        ]
        comm_instrs = [ins for ins in self.body if ins.is_comm]
        for i, (c, ins) in enumerate(zip(comms, comm_instrs)):
            values = ins.uses() if ins.op == "send" else list(ins.outs)
            moved = [t for t in (types.get(v) for v in values) if t and t.shape is not None]
            moves = ""
            if len(moved) == 1 and moved[0].shape:
                t = moved[0]
                shape = "x".join(map(str, t.local_shape(self.sizes)))
                moves = f"{DTYPE_NAMES.get(t.dtype, t.dtype)}[{shape}]"
            elif len(moved) == 1:
                moves = f"{DTYPE_NAMES.get(moved[0].dtype, '?')} scalar"
            elif moved:  # (a bucket: a scalar in it, the loss, counts as a tensor)
                size = sum(math.prod(t.local_shape(self.sizes)) * itemsize(t.dtype) for t in moved)
                moves = f"{len(moved)} tensors, {_bytes(size)}"
            where = c.loc.rsplit("/", 1)[-1]
            rows.append((str(i), c.kind, ",".join(c.dims), c.stream, moves, c.reason, where))
        why = 5  # the reason column, wrapped: bucket reasons list every gradient
        wrapped = [textwrap.wrap(r[why], 60) or [""] for r in rows]
        widths = [max(map(len, col)) for col in zip(*rows)]
        widths[why] = max(len(part) for parts in wrapped for part in parts)
        lines = [head, ""]
        for k, (r, parts) in enumerate(zip(rows, wrapped)):
            for n, part in enumerate(parts):
                cells = [c if n == 0 else "" for c in r]
                cells[why] = part
                lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def types(self) -> dict[str, TensorType]:
        """Every value's type by name (inputs and instruction results)."""
        out = {i.name: i.type for i in self.inputs}
        for ins in self.body:
            out.update(zip(ins.outs, ins.types))
        return out

    def replace(self, **changes: Any) -> Plan:
        from dataclasses import replace

        return replace(self, **changes)

    def __str__(self) -> str:
        return IMPLEMENTATIONS["format"](self)

    @classmethod
    def parse(cls, text: str) -> Plan:
        """The plan whose text is ``text`` (``str(plan)``); a ``PlanSyntaxError`` says where
        it does not parse."""
        return IMPLEMENTATIONS["parse"](text)

    def check(self) -> Plan:
        """Prove the plan cannot hang or mismatch (see ``compiler/check.py``); raises
        ``PlanError`` pointing at the user's line, returns the plan."""
        IMPLEMENTATIONS["check"](self)
        return self

    def simulate(self, mesh: Any = None, profile: Any = None) -> Any:
        """Predict one call of the step without processes (``compiler/simulate.py``): an
        ``md.SimReport`` with the step time, peak memory per rank and the timeline.
        ``mesh``: the mesh it was compiled for (checked; None: that one); ``profile``: an
        ``md.DeviceProfile``, a built-in's name (``"h100"``, ``"h200"``, ``"cpu-local"``,
        the default) or a saved profile's path."""
        return IMPLEMENTATIONS["simulate"](self, mesh, profile)

    def memory(self) -> dict[int, int]:
        """Peak bytes per rank (row-major index) of one call: parameters, gradients, optimizer
        state, activations alive at once, buckets, pipeline buffers."""
        return IMPLEMENTATIONS["memory"](self)


def record_pass(plan: Plan, name: str, t0: float) -> Plan:
    """``plan`` with the pass ``name``, which started at ``time.perf_counter()`` ``t0`` and
    made it, added to ``plan.passes``."""
    record = PassRecord(name, time.perf_counter() - t0, plan)
    return plan.replace(passes=plan.passes + (record,))


class PlanSyntaxError(ValueError):
    """Text that is not a plan: says at which line and column, and what was expected."""
