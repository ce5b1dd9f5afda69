"""Record and replay of a repeated eager step (issue 11, item 2): an eager training loop stops
paying, on every step, for encoding and sending each instruction and for the workers decoding
and preparing each op.

``md.DistributedDataParallel`` turns it on for its engine (``Engine.start_replay``) and cuts
the instruction stream at each ``forward()``. While such a step is issued, its batch is not
sent a moment after it starts: it goes when the next forward starts, when the program fetches
a value or waits for anything (``before_block``), when it is full, or at the latest
``controller.LAZY_DELAY`` (0.1 s) after it started. So a loop's batches are its steps (or a
step's parts between the fetches it makes), the same from one step to the next.

Each batch is described without its ref numbers (``_Segment``): refs made in the batch are
named by the order they are made, refs from before it by the order they are first used. A
float where an op takes a ``Scalar`` or a ``float`` (a learning rate, AdamW's bias
corrections, which change every step) is not part of the description but an input of the
plan, sent with each run (``RunPlan.values``); the other values the instructions hold are
(``1`` and ``1.0`` apart). Deletes of refs made in the batch are part of it; mesh
definitions go before the run. The first time a description is seen, the batch goes as it is; the
second time, it is lowered into an ``isa.Program`` -- the eager instructions made compute and
all-reduce steps over slots -- sent once (``DefinePlan``), and from then on a batch with that
description is sent as one ``RunPlan``: the refs it reads, the refs it leaves, and the deletes
of older refs it carries. The workers run it as a compiled plan (the C++ runtime's
``CompiledPlan``, or the Python plan runner): no decoding, no per-op preparation, and its
values freed at their last use. The plan holds the batch up to its first fetch or its first
instruction a plan cannot hold (a kind other than ops, reduces, borrows, deletes and mesh
definitions; an op on a stream other than ``main``; a value that is not a plain one; the end
of a borrow begun before the batch); the rest goes as it is, after the run. A batch whose
plan cannot be made (a reduce of a value from before the batch, a view of a reduced value
read after the reduce, a program the C++ runtime refuses: checked on the controller) goes as
it is; after ``GIVE_UP`` such batches or batches not seen before in a row, replay stops for
the engine.

What the workers compute is what the eager instructions compute, with the plans' failure
rule: an op that fails on one rank fails every value the run leaves on every rank (refs made,
and refs from before it that an op writes): on that rank with the op's error at the user's
``file:line``, on the others as failed on another rank. The shapes of the values a batch
reads are not in its description; the signature ``Engine.cut`` is given (the shapes of the
step's inputs) is: a step on a batch of another shape gets a plan of its own (a plan's ops
keep buffers of the shapes they saw).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from monarch_dsl import _core, isa
from monarch_dsl.compiler.lower import core_steps
from monarch_dsl.compiler.ops import ALIASING, base_name
from monarch_dsl.isa.opnames import resolve_op, written_args

log = logging.getLogger("monarch_dsl")

MAX_PLANS = 16  # plans one engine keeps for replay; then only those are replayed
GIVE_UP = 16  # batches in a row neither replayed nor replayable later: replay stops
_SEEN_MAX = 256  # descriptions remembered while waiting for a second sight

# Plan ids, shared with the compiled steps' (mesh_fn.py): one namespace on the workers.
_plan_ids = itertools.count(1)
_plan_ids_lock = threading.Lock()


def new_plan_id() -> int:
    with _plan_ids_lock:
        return next(_plan_ids)


class NotReplayable(Exception):
    """A batch that is sent as it is (the reason, for the tests and the log)."""


class _NoOps(NotReplayable):
    """A batch of deletes and fetches only."""


_PLAIN = frozenset((int, float, bool, str, complex))
_EXACT = frozenset((int, bool, str))  # plain values described as they are
_TORCH_CONSTANTS = (torch.dtype, torch.memory_format, torch.layout)


class _Segment:
    """One batch described without its ref numbers (``key``), with what a replay of it binds:
    the outer refs it reads (``outer``), the refs it makes (``made``), the outer refs deleted
    in it (``outer_deletes``) and its tail (from its first fetch on, sent as it is)."""

    def __init__(self, items: tuple, mesh_shapes: dict[int, tuple], signature: Any = ()):
        self.outer: list[int] = []
        self.made: list[int] = []
        # ref -> its name: a ref made in the batch i >= 0 (the order it was made), one from
        # before it -1 - j (the order it is first read). (In a description every plain value
        # is a (type, value) pair: a bare int is a name.)
        self._index: dict[int, int] = {}
        self.body: list[tuple[int, Any]] = []
        self.outer_deletes: list[tuple[int, str]] = []
        self.tail: list[tuple[int, Any]] = []
        self.head: list[tuple[int, Any]] = []  # mesh definitions, sent first
        self.stop = ""  # why the body ended before the first fetch ("": it did not)
        self.values: list[float] = []  # the floats of Scalar / float arguments, in order
        self.mesh = -1
        deleted_made: list[int] = []
        desc: list[Any] = []
        k = 0
        for k, (mesh, ins) in enumerate(items):  # noqa: B007 - (k: where the tail starts)
            kind = type(ins)
            if kind is isa.Delete:
                for r in ins.refs:
                    name = self._index.get(r, -1)
                    if name >= 0:
                        deleted_made.append(name)
                    else:
                        self.outer_deletes.append((r, ins.stream))
                continue
            if kind is isa.DefineMesh:  # (made at a mesh's first use: sent before the run)
                self.head.append((mesh, ins))
                continue
            if kind is isa.Fetch:
                break
            # The body ends at the first instruction a plan cannot hold: from there on the
            # batch goes as it is, after the run (the next step's data made on the mesh, a
            # remote function, a collective of another kind...).
            if kind not in _BODY:
                self.stop = f"a {kind.__name__} instruction"
                break
            if self.mesh >= 0 and mesh != self.mesh:
                self.stop = "instructions on two meshes"
                break
            marks = (len(self.outer), len(self.made), len(self.values))
            try:
                desc.append(_describe(self, ins))
            except NotReplayable as e:
                self._forget(*marks)  # (what the instruction's description began)
                self.stop = str(e)
                break
            self.mesh = mesh
            self.body.append((mesh, ins))
        else:
            k = len(items)
        self.tail = list(items[k:])
        if not self.body:
            if self.stop:
                raise NotReplayable(self.stop)
            raise _NoOps("no op before the first fetch")
        dims_sizes = mesh_shapes.get(self.mesh)
        if dims_sizes is None:
            raise NotReplayable("an unknown mesh")
        self.dims, self.sizes = dims_sizes
        self.deleted_made = frozenset(deleted_made)  # (names of made refs)
        self.key = (
            signature,
            self.mesh,
            dims_sizes,
            tuple(desc),
            len(self.outer),
            self.deleted_made,
        )

    def _forget(self, outer: int, made: int, values: int) -> None:
        """Back to ``outer`` outer refs, ``made`` made refs and ``values`` lifted floats."""
        for r in self.outer[outer:] + self.made[made:]:
            del self._index[r]
        del self.outer[outer:], self.made[made:], self.values[values:]

    def name(self, ref: int) -> int:
        """The name of a ref the batch reads."""
        name = self._index.get(ref)
        if name is None:
            name = self._index[ref] = -1 - len(self.outer)
            self.outer.append(ref)
        return name

    def make(self, ref: int) -> int:
        """The name of a ref the batch makes (again, for an op in place)."""
        name = self._index.get(ref)
        if name is not None:  # (made again by an op in place; an outer ref stays outer)
            return name
        name = self._index[ref] = len(self.made)
        self.made.append(ref)
        return name


_BODY = frozenset((isa.CallOp, isa.Reduce, isa.BorrowBegin, isa.BorrowEnd))


def _describe(seg: _Segment, ins: Any) -> tuple:
    kind = type(ins)
    if kind is isa.CallOp:
        if ins.stream != "main":
            raise NotReplayable(f"an op on stream {ins.stream!r}")
        lifted, names, _, _ = _liftable(ins.op)
        values = seg.values
        index = seg._index
        args: list[Any] = []
        for i, a in enumerate(ins.args):  # (_freeze, inlined for the common arguments)
            t = type(a)
            if t is isa.Ref:
                name = index.get(a.id)
                args.append(seg.name(a.id) if name is None else name)
            elif t is float and i in lifted:
                values.append(a)
                args.append(_LIFTED)
            elif t is float:
                args.append((t, a.hex()))
            elif t in _EXACT:
                args.append((t, a))
            else:  # (a complex too: by its bits, as _freeze describes it)
                args.append(_freeze(a, seg))
        kwargs: tuple = ()
        if ins.kwargs:
            kwargs = tuple(
                (
                    k,
                    (values.append(a), _LIFTED)[1]
                    if type(a) is float and k in names
                    else _freeze(a, seg),
                )
                for k, a in ins.kwargs.items()
            )
        outs = tuple(None if r is None else seg.make(r) for r in ins.outs)
        return ("op", ins.op, tuple(args), kwargs, outs, ins.loc)
    if kind is isa.Reduce:
        if ins.scatter or ins.reduction not in _ALL_REDUCE or ins.src != ins.out:
            raise NotReplayable("a reduce other than an all-reduce in place")
        if ins.mesh != seg.mesh:
            raise NotReplayable("a reduce over another mesh")
        return (
            "reduce",
            seg.name(ins.src),
            ins.mesh,
            ins.dims,
            ins.reduction,
            ins.shape,
            ins.dtype,
            ins.stream,
            ins.loc,
        )
    if kind is isa.BorrowBegin:
        src = seg.name(ins.src)
        return ("borrow", src, seg.make(ins.dst), ins.origin, ins.stream, seg.make(ins.event))
    # BorrowEnd: of a borrow the batch began (one begun before it ends on the origin stream's
    # wait for the borrowing one, which a plan run would not keep)
    if seg._index.get(ins.dst, -1) < 0:
        raise NotReplayable("the end of a borrow begun before the batch")
    return ("end", seg.name(ins.dst), ins.origin, ins.stream, seg.make(ins.event))


_ALL_REDUCE = frozenset(("sum", "avg", "min", "max", "prod"))
_LIFTED = object()  # a float argument made an input of the plan
_SHAPED_BY_NUMBERS = frozenset(("arange", "range"))  # ops whose floats set their shape


def _liftable(op: str) -> tuple[frozenset[int], frozenset[str], frozenset[int], str]:
    """Where a float argument of ``op`` is an input of the plan (a learning rate, AdamW's
    bias corrections) rather than part of the batch's description: (the positions of those
    arguments, the names of those that are ``Scalar`` or ``float``; of the positions, those
    typed ``Tensor`` where the op has a twin overload taking a ``Scalar`` there, and that
    twin's name). A float where a Tensor goes
    (``div.Tensor(x, 0.5)``: a wrapped number) is lifted only through such a twin
    (``div.Scalar``), which computes the same. The floats of an op whose shape they set
    (``arange(0.0, n)``, any overload) are not lifted."""
    found = _liftable_args.get(op)
    if found is None:
        fn = resolve_op(op)
        args = fn._schema.arguments
        # (arange's and range's numbers set their shape: they stay part of the description)
        shaped = fn._schema.name.partition("::")[2] in _SHAPED_BY_NUMBERS
        lift = [_number_typed(a.type) and not shaped for a in args]
        positions = frozenset(
            i for i, (a, ok) in enumerate(zip(args, lift)) if ok and not a.kwarg_only
        )
        names = frozenset(a.name for a, ok in zip(args, lift) if ok)
        twin_positions: frozenset[int] = frozenset()
        twin = ""
        overload = fn._overloadname
        if "Tensor" in overload:
            head, _, tail = overload.rpartition("Tensor")
            other = getattr(fn.overloadpacket, f"{head}Scalar{tail}", None)
            if other is not None:
                theirs = other._schema.arguments
                if len(theirs) == len(args) and all(
                    x.name == y.name
                    and (
                        str(x.type) == str(y.type)
                        or isinstance(x.type, torch.TensorType)
                        and isinstance(y.type, torch.NumberType)
                    )
                    for x, y in zip(args, theirs)
                ):
                    twin_positions = frozenset(
                        i
                        for i, (x, y) in enumerate(zip(args, theirs))
                        if str(x.type) != str(y.type) and i > 0 and not x.kwarg_only
                    )
                    twin = other._schema.name + "." + other._overloadname
        found = _liftable_args[op] = (positions | twin_positions, names, twin_positions, twin)
    return found


def _written_refs(op: str, args: tuple, kwargs: dict) -> list[int]:
    """The refs the op ``op`` writes in place among ``args`` / ``kwargs`` (by its schema)."""
    found = []
    for i, name in written_args(resolve_op(op)):
        value = args[i] if i < len(args) else kwargs.get(name)
        found.extend(isa.refs_in(value))
    return found


def _number_typed(t: Any) -> bool:
    """``Scalar``, ``float``, ``Scalar?`` or ``float?`` (a double goes there as it is)."""
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, (torch.NumberType, torch.FloatType))


_liftable_args: dict[str, tuple[frozenset[int], frozenset[str], frozenset[int], str]] = {}


def _freeze(x: Any, seg: _Segment) -> Any:
    """``x`` (an instruction's arguments) as a hashable description: refs by their names,
    plain values with their types (``1`` and ``1.0`` differ to an op), floats by their bits."""
    t = type(x)
    if t is isa.Ref:
        return seg.name(x.id)
    if t in _PLAIN:  # (a float by its bits: -0.0 is not 0.0, and NaN is NaN)
        if t is float:
            return (t, x.hex())
        if t is complex:
            return (t, x.real.hex(), x.imag.hex())
        return (t, x)
    if x is None or x is isa.WORKER_DEVICE or isinstance(x, _TORCH_CONSTANTS):
        return x
    if t is tuple or t is list:
        return (t, tuple(_freeze(v, seg) for v in x))
    if t is dict:
        return (dict, tuple((k, _freeze(v, seg)) for k, v in x.items()))
    raise NotReplayable(f"an argument of type {t.__name__}")


# ------------------------------------------------------------------------------ lowering


class _Plan:
    """A lowered batch: the plan's id on the workers, and which of a batch's refs are its
    outputs (("made", i) / ("outer", i), in the program's output order)."""

    def __init__(self, pid: int, program: isa.Program, outputs: list[tuple[str, int]]):
        self.pid = pid
        self.program = program
        self.outputs = outputs


def lower(seg: _Segment, pid: int) -> _Plan:
    """The program of ``seg``'s body: its ops as compute steps, its all-reduces as
    all-reduce steps, over slots (the outer refs it reads first, in order); its outputs are
    the refs it makes and does not delete, and the outer refs it writes in place."""
    n_outer = len(seg.outer)
    n_inputs = n_outer + len(seg.values)  # the outer refs, then the lifted floats
    lifted = itertools.count(n_outer)
    outer = set(seg.outer)
    slot_of: dict[int, int] = {r: i for i, r in enumerate(seg.outer)}
    base: dict[int, int] = {}  # slot -> the slot whose storage it views (not itself a view)
    n = itertools.count(n_inputs)
    steps: list[isa.Step] = []
    lent: dict[int, int] = {}  # borrowing ref -> the ref it borrows
    ended: set[int] = set()
    written_outer: list[int] = []  # outer refs written in place, in order
    reduced: set[int] = set()  # storages all-reduced into a new slot (their views are stale)

    def slot(ref: int) -> int:
        if ref in ended:
            raise NotReplayable("a borrowed ref used after its borrow ended")
        s = slot_of.get(ref)
        if s is None:
            raise NotReplayable(f"ref {ref} read but not made")
        if base.get(s, s) in reduced:
            raise NotReplayable("a view of an all-reduced value read after the reduce")
        return s

    def to_slots(x: Any) -> Any:
        t = type(x)
        if t is isa.Ref:
            return isa.Slot(slot(x.id))
        if t is tuple:
            return tuple(to_slots(v) for v in x)
        if t is list:
            return [to_slots(v) for v in x]
        if t is dict:
            return {k: to_slots(v) for k, v in x.items()}
        if x is isa.WORKER_DEVICE:
            raise NotReplayable("the worker's device as a positional argument")
        return x

    for _, ins in seg.body:
        kind = type(ins)
        if kind is isa.CallOp:
            # the floats _describe lifted, in its order
            lifted_at, names, twin_positions, twin = _liftable(ins.op)
            name = ins.op
            if any(type(ins.args[i]) is float for i in twin_positions if i < len(ins.args)):
                name = twin  # div.Tensor(x, 0.5) -> div.Scalar(x, <input>)
            args = tuple(
                isa.Slot(next(lifted)) if type(a) is float and i in lifted_at else to_slots(a)
                for i, a in enumerate(ins.args)
            )
            for r in _written_refs(name, ins.args, ins.kwargs):  # (ops that return nothing)
                if r in outer and r not in written_outer:
                    written_outer.append(r)
            kwargs = {
                k: isa.Slot(next(lifted))
                if type(a) is float and k in names
                # (core_steps makes it the worker's device)
                else torch.device("cpu")
                if k == "device" and a is isa.WORKER_DEVICE
                else to_slots(a)
                for k, a in ins.kwargs.items()
            }
            name = name.replace("::", ".", 1)  # "aten::t.default" -> "aten.t.default"
            read = isa.leaves(args, isa.Slot)
            view_of = None
            if read and base_name(name)[0] in ALIASING:
                view_of = base.get(read[0].index, read[0].index)
            outs = []
            for r in ins.outs:
                s = next(n)
                outs.append(s)
                if view_of is not None:
                    base[s] = view_of
                if r is None:
                    continue
                old = slot_of.get(r)
                if old is not None:  # written in place: the new slot is the same storage
                    base[s] = base.get(old, old)
                if r in outer and r not in written_outer:
                    written_outer.append(r)
                slot_of[r] = s
            steps.append(
                isa.Compute(
                    args=args,
                    outs=tuple(outs),
                    stream="main",
                    loc=ins.loc,
                    name=name,
                    kwargs=kwargs,
                )
            )
        elif kind is isa.BorrowBegin:
            if ins.origin != "main":
                raise NotReplayable(f"a borrow from stream {ins.origin!r}")
            slot_of[ins.dst] = slot(ins.src)
            lent[ins.dst] = ins.src
        elif kind is isa.BorrowEnd:
            lent.pop(ins.dst, None)
            ended.add(ins.dst)
        else:  # a Reduce in place (of a borrowed ref, or on the main stream)
            if ins.mesh != seg.mesh:
                raise NotReplayable("a reduce over another mesh")
            s = slot(ins.src)
            storage = base.get(s, s)
            if storage < n_outer:
                raise NotReplayable("a reduce of a value from before the batch")
            out = next(n)
            steps.append(
                isa.AllReduce(
                    args=(isa.Slot(s),),
                    outs=(out,),
                    stream=ins.stream,
                    loc=ins.loc,
                    dims=tuple(seg.dims.index(d) for d in ins.dims),
                    shapes=(tuple(ins.shape),),
                    dtype=ins.dtype,
                    reduce=ins.reduction,
                )
            )
            reduced.add(storage)  # (the result may be a new tensor: other views are stale)
            slot_of[ins.src] = out
            if ins.src in lent:
                slot_of[lent[ins.src]] = out
    if lent:
        raise NotReplayable("a borrow still open at the end of the batch")
    outputs: list[tuple[str, int]] = []
    out_slots: list[int] = []
    for i, r in enumerate(seg.made):
        if i in seg.deleted_made or r in ended or r not in slot_of:  # (events have no slot)
            continue
        s = slot_of[r]
        if base.get(s, s) in reduced:
            raise NotReplayable("a view of an all-reduced value outlives the batch")
        outputs.append(("made", i))
        out_slots.append(s)
    for r in written_outer:
        outputs.append(("outer", seg.outer.index(r)))
        out_slots.append(slot_of[r])
    n_slots = next(n)
    last: dict[int, int] = {}  # slot -> the last step that reads or makes it
    for k, step in enumerate(steps):
        for s in (*step.uses(), *step.outs):
            last[s] = k
    keep = set(out_slots)
    frees: dict[int, list[int]] = {}
    for s, k in last.items():
        if s not in keep:
            frees.setdefault(k, []).append(s)
    steps = [
        dataclasses.replace(step, frees=tuple(sorted(frees.get(k, ()))))
        for k, step in enumerate(steps)
    ]
    program = isa.Program(
        name="replay",
        dims=tuple(seg.dims),
        sizes=tuple(seg.sizes),
        steps=tuple(steps),
        n_slots=n_slots,
        inputs=tuple(range(n_inputs)),
        outputs=tuple(out_slots),
        output_shapes=tuple(None for _ in out_slots),
        output_dtypes=tuple("" for _ in out_slots),
    )
    return _Plan(pid, program, outputs)


def _check_builds(program: isa.Program) -> None:
    """``program`` as the workers' C++ runtime will take it (``runtime/plan_runner.py``): a
    program it cannot make would fail every run, and every value each run writes."""
    core = _core.native()
    if core is None:
        return
    try:
        core.CompiledPlan(core_steps(program, None, torch.device("cpu")), isa.Slot)
    except Exception as e:  # noqa: BLE001 - the runtime's reason, as the refusal's
        raise NotReplayable(f"the runtime cannot make the plan ({type(e).__name__}: {e})") from e


# ------------------------------------------------------------------------------ the engine's


class Replay:
    """An engine's replay: ``rewrite`` turns each batch it sends into a plan run when it can
    (see the module docstring). Used under the engine's send lock only."""

    def __init__(self) -> None:
        self.signature: Any = ()  # of the step being issued (Engine.cut): part of each key
        self.users = 0  # md.DistributedDataParallel wrappers that turned it on
        self.active = True
        self.plans: dict[tuple, _Plan] = {}
        self.seen: dict[tuple, int] = {}  # descriptions seen once
        self.refused: dict[tuple, str] = {}  # descriptions that could not be lowered: why
        self.misses = 0  # batches in a row neither replayed nor defined
        self.batches = 0
        self.replayed = 0  # batches sent as a plan run
        self.last_reason = ""  # why the last batch was sent as it is
        # Told of each run made, with the instructions it stands for (md.Simulator's engine:
        # the controller issued them all the same, and is charged for them).
        self.on_run: Callable[[isa.RunPlan, list[Any]], None] | None = None

    def rewrite(
        self, items: tuple, mesh_shapes: dict[int, tuple], default_dtype: str = "float32"
    ) -> tuple:
        """What to send for the batch ``items``: a plan run (with its definition, the second
        time), or ``items`` as they are. ``default_dtype``: the torch default dtype it was
        issued under (a plan's ops keep buffers of the dtypes they saw)."""
        if not self.active or self.signature is None:  # (None: a step not to replay)
            return items
        try:
            return self._rewrite(items, mesh_shapes, default_dtype)
        except Exception:  # noqa: BLE001 - an internal error: the batch goes as it is
            self.active = False
            log.exception("monarch_dsl: eager replay stopped by an internal error")
            return items

    def _rewrite(self, items: tuple, mesh_shapes: dict[int, tuple], default_dtype: str) -> tuple:
        self.batches += 1
        try:
            seg = _Segment(items, mesh_shapes, (self.signature, default_dtype))
            plan = self.plans.get(seg.key)
            out: list[tuple[int, Any]] = list(seg.head)
            if plan is None and seg.key in self.refused:
                raise NotReplayable(self.refused[seg.key])
            if plan is None:
                if len(self.plans) >= MAX_PLANS:
                    raise NotReplayable(f"{MAX_PLANS} plans kept already")
                if seg.key not in self.seen:
                    if len(self.seen) >= _SEEN_MAX:
                        self.seen.clear()
                    self.seen[seg.key] = 1
                    raise NotReplayable("not seen before")
                del self.seen[seg.key]
                try:
                    plan = lower(seg, new_plan_id())
                    _check_builds(plan.program)
                except NotReplayable as e:
                    if len(self.refused) >= _SEEN_MAX:
                        self.refused.clear()
                    self.refused[seg.key] = str(e)
                    raise
                self.plans[seg.key] = plan
                out.append((seg.mesh, isa.DefinePlan(plan.pid, plan.program)))
        except _NoOps:
            return items  # (deletes, a fetch: nothing to replay, nor a miss)
        except NotReplayable as e:
            self.last_reason = str(e)
            self.misses += 1
            if self.misses >= GIVE_UP:
                self.active = False
                log.info(
                    "monarch_dsl: eager replay stopped: %d batches in a row were not "
                    "replayed (the last: %s)",
                    self.misses,
                    e,
                )
            return items
        self.misses = 0
        self.replayed += 1
        made, outer = seg.made, seg.outer
        outputs = tuple(made[i] if kind == "made" else outer[i] for kind, i in plan.outputs)
        loc = seg.body[0][1].loc
        run = isa.RunPlan(
            plan.pid, seg.mesh, tuple(outer), outputs, (), "main", loc, values=tuple(seg.values)
        )
        if self.on_run is not None:
            self.on_run(run, [ins for _, ins in seg.body])
        out.append((seg.mesh, run))
        by_stream: dict[str, list[int]] = {}
        for ref, stream in seg.outer_deletes:
            by_stream.setdefault(stream, []).append(ref)
        out.extend((-1, isa.Delete(tuple(refs), stream)) for stream, refs in by_stream.items())
        out.extend(seg.tail)
        return tuple(out)
