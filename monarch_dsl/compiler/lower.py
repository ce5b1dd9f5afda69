"""Lowering: a plan becomes a ``Program`` every rank can run.

The program is the plan with names replaced by slot numbers, sizes rewritten to each rank's
local shapes (a ``view`` of a sharded value views the shard; views run as ``reshape``:
``_AS_RESHAPE``), and, per step, the slots whose last use it is (so memory goes as soon as it
can). Steps that only rename a value are left
out: a ``detach`` (the workers record no autograd history) and a transpose back are their
argument (the same slot; ``_aliases``), and a view nobody uses is not made. It is plain data
(picklable): the controller sends it to the workers once, then only "run program k with these
refs".

The steps are the instruction set's (``isa.STEPS``). ``run_step`` executes one compute step;
communication steps are run by the back end (``isa/collectives.py`` says what each computes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TypedDict

import torch

from monarch_dsl import isa
from monarch_dsl.compiler.ops import ALIASING, UPSAMPLES, base_name
from monarch_dsl.compiler.plan import COMM_OPS, LOCAL_OPS, Instr, Plan, PlanError, Shard, Var
from monarch_dsl.isa import Compute, On, Program, Slot, Step
from monarch_dsl.isa.opnames import resolve_op

# Ops whose argument ``index`` is a size: rewritten to the output's local shape.
_SIZE_ARG = {
    "view": 1,
    "_unsafe_view": 1,
    "reshape": 1,
    "expand": 1,
    "broadcast_to": 1,
    "broadcast_in_dim": 1,
    "new_zeros": 1,
    "new_empty": 1,
    "new_ones": 1,
    "new_full": 1,
    "zeros": 0,
    "ones": 0,
    "empty": 0,
    "full": 0,
    "rand": 0,
    "randn": 0,
    # an upsampling's backward: ``input_size``, the whole (N, C, *spatial) of its result
    **{f"{op}_backward": 2 for op in UPSAMPLES},
}


# Views lowered as ``reshape``: the same view where the argument's strides allow it, else a
# copy. A traced view is legal for the strides its argument had while tracing; on a rank, the
# argument can be laid out otherwise when the plan changed what produced it -- a collective's
# result can be contiguous where the traced value was a transposed view, and an op such as CPU
# attention lays its result out after its inputs. nn.MultiheadAttention's
# ``permute(2, 0, 1, 3).contiguous().view(...)`` is traced without the ``contiguous`` (a no-op
# there) and its ``view`` failed on the workers.
_AS_RESHAPE = {"aten.view.default", "aten._unsafe_view.default"}


class _StepFields(TypedDict):
    """What every step has (``isa.Step``'s fields)."""

    args: tuple[Any, ...]
    outs: tuple[int, ...]
    on: On
    stream: str
    loc: str
    frees: tuple[int, ...]


class _CommFields(_StepFields):
    """What every communication step has (``isa.Comm``'s fields)."""

    dims: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str


def _aliases(plan: Plan) -> dict[str, str]:
    """The results lowering leaves out, each with the value it is: a ``detach``'s, its
    argument (a view of all of it, sharing its storage, only without autograd history, which
    the workers never record), and a ``transpose`` of a ``transpose`` of the same two dims,
    the inner one's argument (the same shape and strides: autograd's weight gradients are
    ``t(t(mm))``). Not one on another stream than its argument's producer (its place in that
    stream's order could matter), nor of a value defined twice (an error ``lower`` reports)."""
    stream = {i.name: "main" for i in plan.inputs}
    transposed: dict[str, tuple[str, frozenset[Any]]] = {}  # result -> (argument, its dims)
    alias: dict[str, str] = {}
    for ins in plan.body:
        arg = ins.args[0] if ins.args else None
        if (
            isinstance(arg, Var)
            and not ins.kwargs
            and len(ins.outs) == 1
            and ins.outs[0] not in stream
            and stream.get(arg.name) == ins.stream
        ):
            if ins.op == "aten.detach.default" and len(ins.args) == 1:
                alias[ins.outs[0]] = alias.get(arg.name, arg.name)
            elif ins.op == "aten.transpose.int" and len(ins.args) == 3:
                dims = frozenset(ins.args[1:])
                if all(isinstance(d, int) and d >= 0 for d in ins.args[1:]):
                    inner = transposed.get(alias.get(arg.name, arg.name))
                    if inner is not None and inner[1] == dims:
                        alias[ins.outs[0]] = alias.get(inner[0], inner[0])
                    else:
                        transposed[ins.outs[0]] = (arg.name, dims)
        for o in ins.outs:
            stream.setdefault(o, ins.stream)
    return alias


def _is_view(op: str) -> bool:
    """Whether ``op`` only makes a view (``ops.ALIASING``, not in place): nothing to run
    where its result is never used."""
    if op in COMM_OPS or op in LOCAL_OPS or op.count(".") < 2:
        return False
    name, in_place = base_name(op)
    return name in ALIASING and not in_place


def slot_numbers(plan: Plan) -> tuple[dict[str, int], int]:
    """Each value's slot in ``lower``'s program, and how many slots there are: the inputs,
    then every instruction's results in order; a left-out result (``_aliases``) has its
    value's."""
    return _numbered(plan, _aliases(plan))


def _numbered(plan: Plan, alias: dict[str, str]) -> tuple[dict[str, int], int]:
    slots: dict[str, int] = {}
    for i in plan.inputs:
        slots[i.name] = len(slots)
    n = len(slots)
    for ins in plan.body:
        for o in ins.outs:
            if o in slots:
                raise PlanError(f"%{o} is defined twice", ins.loc)
            if o in alias:
                slots[o] = slots[alias[o]]
            else:
                slots[o] = n
                n += 1
    return slots, n


def lower(plan: Plan) -> Program:
    """The per-rank program of ``plan``."""
    alias = _aliases(plan)
    slots, n_slots = _numbered(plan, alias)
    defined = {i.name for i in plan.inputs}

    def root(name: str) -> str:
        return alias.get(name, name)

    types = plan.types()
    sizes = plan.sizes
    dim_index = {d: i for i, d in enumerate(plan.dims)}
    keep = {root(o.var) for o in plan.outputs} | {i.name for i in plan.inputs}
    # No step: an alias, or a view whose value nothing after it uses (then its uses are
    # none: a chain of unused views goes whole, from the last).
    skip: set[int] = set()
    used: set[str] = set()
    for k in range(len(plan.body) - 1, -1, -1):
        ins = plan.body[k]
        if ins.outs and (
            ins.outs[0] in alias
            or (_is_view(ins.op) and not any(root(o) in used or root(o) in keep for o in ins.outs))
        ):
            skip.add(k)
            continue
        used.update(root(u) for u in ins.uses())
    last_use: dict[str, int] = {}  # by value (an alias's uses are its value's)
    for k, ins in enumerate(plan.body):
        if k not in skip:
            for u in ins.uses():
                last_use[root(u)] = k
    frees_at: dict[int, list[str]] = {}
    for name, k in last_use.items():
        if name not in keep:
            frees_at.setdefault(k, []).append(name)
    steps: list[Step] = []
    for k, ins in enumerate(plan.body):
        defined.update(ins.outs)
        if k in skip:
            continue
        # Values defined but never used: free right after.
        dead = [o for o in ins.outs if o not in last_use and o not in keep]

        def conv(value: Any, ins: Instr = ins) -> Any:
            if isinstance(value, Var):
                if value.name not in defined:
                    raise PlanError(f"%{value.name} is used before it is defined", ins.loc)
                return Slot(slots[value.name])
            if isinstance(value, (list, tuple)):
                return type(value)(conv(v, ins) for v in value)
            return value

        args = list(conv(ins.args))
        kwargs = {k2: conv(v) for k2, v in ins.kwargs}
        common: _StepFields = {
            "args": tuple(args),
            "outs": tuple(slots[o] for o in ins.outs),
            "on": tuple((dim_index[d], i) for d, i in ins.on),
            "stream": ins.stream,
            "loc": ins.loc,
            "frees": tuple(slots[n] for n in frees_at.get(k, [])) + tuple(slots[o] for o in dead),
        }
        if ins.op in COMM_OPS or ins.op in LOCAL_OPS:
            # The arguments' local shapes (a failed rank sends zeros of them, so the group's
            # sizes agree); a recv has none: its result's.
            uses = ins.uses()
            ts = tuple(types[u] for u in uses) if uses else ins.types
            comm: _CommFields = {
                **common,
                "dims": tuple(dim_index[d] for d in kwargs.get("dims", ())),
                "shapes": tuple(t.local_shape(sizes) for t in ts),
                "dtype": ts[0].dtype,
            }
            steps.append(_comm_step(ins.op, kwargs, comm))
            continue
        name = ins.op.split(".")[1]
        if name == "slice" and len(args) >= 4 and ins.reason.startswith("micro-batch"):
            # A slice along a sharded dim (a micro-batch of a data-parallel shard): the same
            # fraction of this rank's part.
            src = types[ins.uses()[0]]
            assert src.shape is not None  # (a slice is of a tensor)
            d = args[1] % len(src.shape)
            f = 1
            for p, n in zip(src.placements, sizes):
                if isinstance(p, Shard) and p.dim == d:
                    f *= n
            if f > 1:
                args[2], args[3] = args[2] // f, args[3] // f
        if name in _SIZE_ARG and ins.types and ins.types[0].shape is not None:
            idx = _SIZE_ARG[name]
            local = list(ins.types[0].local_shape(sizes))
            if idx < len(args):
                args[idx] = local
            elif "size" in kwargs:
                kwargs["size"] = local
        common["args"] = tuple(args)
        op = "aten.reshape.default" if ins.op in _AS_RESHAPE else ins.op
        steps.append(Compute(name=op, kwargs=kwargs, **common))
    outputs = tuple(slots[o.var] for o in plan.outputs)
    out_types = [types[o.var] for o in plan.outputs]
    return Program(
        plan.name,
        plan.dims,
        sizes,
        tuple(steps),
        n_slots,
        tuple(range(len(plan.inputs))),
        outputs,
        tuple(t.local_shape(sizes) if t.shape is not None else None for t in out_types),
        tuple(t.dtype for t in out_types),
    )


def _comm_step(op: str, kw: dict[str, Any], common: _CommFields) -> Step:
    """The typed step of a communication or local redistribution ``op`` with the plan's
    options ``kw`` (plan.Instr's kwargs)."""
    if op == "all_reduce":
        return isa.AllReduce(reduce=kw.get("op", "sum"), **common)
    if op == "all_gather":
        return isa.AllGather(dim=kw.get("dim", 0), **common)
    if op == "reduce_scatter":
        return isa.ReduceScatter(reduce=kw.get("op", "sum"), dim=kw.get("dim", 0), **common)
    if op == "all_to_all":
        return isa.AllToAll(split_dim=kw["split_dim"], cat_dim=kw["cat_dim"], **common)
    if op == "send":
        return isa.Send(peer=kw["peer"], **common)
    if op == "recv":
        return isa.Recv(peer=kw["peer"], **common)
    if op == "shard_local":
        return isa.ShardLocal(dim=kw["dim"], **common)
    if op == "partial_local":
        return isa.PartialLocal(reduce=kw.get("op", "sum"), **common)
    raise PlanError(f"unknown communication {op!r}", common["loc"])


class Env(Protocol):
    """A rank's value slots: a list, or the C++ runtime's ``_core.Env``."""

    def __getitem__(self, slot: int, /) -> Any: ...
    def __setitem__(self, slot: int, value: Any, /) -> None: ...


def resolve(value: Any, env: Env) -> Any:
    if isinstance(value, Slot):
        return env[value.index]
    if isinstance(value, (list, tuple)) and value and not isinstance(value, torch.Size):
        return type(value)(resolve(v, env) for v in value)
    return value


def run_step(step: Compute, env: Env, device: Any = None) -> None:
    """Run a compute step on this rank's slots ``env`` (results written into ``env``)."""
    args = resolve(step.args, env)
    kwargs = {k: resolve(v, env) for k, v in step.kwargs.items()}
    if device is not None and "device" in kwargs:
        kwargs["device"] = device
    result = resolve_op(step.name)(*args, **kwargs)
    if not step.outs:  # (an op that only writes its arguments)
        return
    if len(step.outs) == 1:
        # (an op that returns a list returns one of one here: unbind of a dim of size 1)
        env[step.outs[0]] = result[0] if isinstance(result, (list, tuple)) else result
    else:
        for slot, value in zip(step.outs, result):
            env[slot] = value


def shard_view(value: torch.Tensor, dim: int, index: int, n: int) -> torch.Tensor:
    """Part ``index`` of ``value`` cut in ``n`` along ``dim`` (``chunk``'s parts), a view.
    Shards are exact (``TensorType.local_shape``), and then one ``narrow``: ``chunk`` makes a
    view of every part (each ~1.5 us of a worker's CPU per call of a compiled step)."""
    size = value.shape[dim]
    if size % n:
        return value.chunk(n, dim)[index]
    return value.narrow(dim, index * (size // n), size // n)


def shard_local(value: torch.Tensor, dim: int, index: int, n: int) -> torch.Tensor:
    return shard_view(value, dim, index, n).contiguous()


def core_steps(program: Program, coords: tuple[int, ...] | None, device: Any) -> list[Any]:
    """The steps of ``program`` as ``_core.CompiledPlan`` takes them: the compute steps of the rank
    at ``coords`` (None: of every rank), a ``device`` kwarg made ``device`` (if not None), and
    None for the others (communication steps come by ``set_comm``)."""
    steps: list[Any] = []
    for step in program.steps:
        if not isinstance(step, Compute) or (coords is not None and not step.runs_on(coords)):
            steps.append(None)
        elif device is not None and "device" in step.kwargs:
            steps.append(dataclasses.replace(step, kwargs={**step.kwargs, "device": device}))
        else:
            steps.append(step)
    return steps
