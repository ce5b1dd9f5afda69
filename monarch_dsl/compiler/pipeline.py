"""Passes for pipelines: micro-batches (GPipe), and stages with transfers between them.

``microbatch``: propagation ran with an extra mesh dim ``mb`` of size M over which every
batch argument is ``Shard(0)``; so it already knows which values are per micro-batch (sharded
or partial over ``mb``) and where micro-batches must be combined (gradient accumulation and
the loss are Partial over ``mb`` and were given an ``all_reduce`` over it). This pass makes
``mb`` sequential: an instruction on per-micro-batch values is repeated for each micro-batch
(its values renamed ``name.mbK``), a communication over ``mb`` becomes a local op on the
copies (all_reduce → a running sum of the copies, over M for a mean; all_gather → cat;
shard_local → slice, ...), and the instructions are ordered as GPipe runs them: the forward
of every micro-batch, then the backward of every micro-batch, then the update (an instruction
waiting for its inputs, and for the reads and writes in place of storage it shares that come
before it in the plan). A gradient's sum over the micro-batches (Partial over ``dp`` still:
``propagate`` reduces over ``mb`` first) grows as each micro-batch's part is made and is
complete with the last one, not in the update, so its one all-reduce can be issued then.

``split_stages``: each instruction runs on the ranks of its pipeline stage (``on pp=i``): the
stage the user's ``md.pipeline_stage(i)`` markers gave it while tracing (backward ops: the
stage of the forward op they differentiate), else one inferred along its use-def chains: the
latest stage of its inputs, or the stage of its first user, propagated to a fixed point; what
is connected to no staged value goes with the parameter it reads or whose optimizer state it
makes, else on stage 0 (``_infer_stages``). A value used on a stage other than its own is
sent there (``send`` / ``recv`` over ``pp``) just before its first use on that stage — in the
forward (activations) and the backward (their gradients).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable
from typing import Any

from monarch_dsl.compiler.ops import ALIASING, FOREACH, base_name, written
from monarch_dsl.compiler.plan import (
    COMM_OPS,
    LOCAL_OPS,
    MB,
    FreshNames,
    Instr,
    Partial,
    Plan,
    PlanError,
    Replicate,
    Shard,
    TensorType,
    Var,
    record_pass,
    rename_vars,
)

R = Replicate()


# ---- micro-batches ---------------------------------------------------------------------------


def microbatch(plan: Plan) -> Plan:
    """Unroll the ``mb`` dim (see the module docstring)."""
    t0 = time.perf_counter()
    dims = plan.dims
    if MB not in dims:
        return plan
    m_index = dims.index(MB)
    M = plan.sizes[m_index]
    notes = plan.notes or {}
    phase_of = _phases(plan)

    def drop(t: TensorType) -> TensorType:
        pl = t.placements[:m_index] + t.placements[m_index + 1 :]
        return t._replace(placements=pl)

    def per_mb(t: TensorType) -> bool:
        return t.shape is not None and not t.placements[m_index].is_replicate()

    def copy_type(t: TensorType) -> TensorType:
        p = t.placements[m_index]
        if isinstance(p, Shard):
            assert t.shape is not None  # (a sharded value is a tensor)
            shape = list(t.shape)
            shape[p.dim] //= M
            t = t._replace(shape=tuple(shape))
        return drop(t)

    def name(v: str, m: int) -> str:
        return f"{v}.mb{m}"

    types = plan.types()
    split: dict[str, bool] = {}  # value -> has copies
    inputs = tuple(i._replace(type=drop(i.type)) for i in plan.inputs)
    groups: dict[str, list[list[Instr]]] = {"forward": [], "backward": [], "update": []}
    prologue: list[Instr] = []
    stage_notes = dict(notes.get("stage", {}))

    program: list[Instr] = []  # the plan's order, each instruction's copies in a row

    def add(phase: str, copies: list[Instr]) -> None:
        groups.setdefault(phase, []).append(copies)
        program.extend(copies)

    # Inputs sharded over mb: one slice per micro-batch, before anything else.
    for i in plan.inputs:
        p = i.type.placements[m_index]
        if isinstance(p, Shard):
            assert i.type.shape is not None  # (a sharded value is a tensor)
            split[i.name] = True
            length = i.type.shape[p.dim] // M
            t = copy_type(i.type)
            for m in range(M):
                prologue.append(
                    Instr(
                        (name(i.name, m),),
                        "aten.slice.Tensor",
                        (Var(i.name), p.dim, m * length, (m + 1) * length),
                        (),
                        (t,),
                        reason=f"micro-batch {m} of %{i.name}",
                    )
                )
        elif not p.is_replicate():
            raise PlanError(f"input {i.name!r}: {p} over micro-batches is not supported")

    early = _EarlyUpdate({i.name for i in plan.inputs})
    for ins in plan.body:
        uses = ins.uses()
        mb_comm = (ins.op in COMM_OPS or ins.op in LOCAL_OPS) and MB in (ins.kw("dims") or ())
        repeat = any(split.get(u, False) for u in uses) or any(per_mb(t) for t in ins.types)
        phase = early.phase(ins, phase_of.get(id(ins), "update"), mb_comm or repeat)
        if mb_comm:
            add(phase, _combine(ins, uses, M, split, types, name, drop, copy_type))
            for o, t in zip(ins.outs, ins.types):
                split[o] = per_mb(t)
            continue
        if not repeat:
            add(phase, [dataclasses.replace(ins, types=tuple(drop(t) for t in ins.types))])
            for o in ins.outs:
                split[o] = False
            continue
        copies = []
        for m in range(M):
            renames = {u: name(u, m) for u in uses if split.get(u, False)}
            outs = tuple(name(o, m) for o in ins.outs)
            copies.append(
                Instr(
                    outs,
                    ins.op,
                    rename_vars(ins.args, renames),
                    tuple((k, rename_vars(v, renames)) for k, v in ins.kwargs),
                    tuple(copy_type(t) if per_mb(t) else drop(t) for t in ins.types),
                    ins.stream,
                    ins.on,
                    ins.loc,
                    ins.reason,
                )
            )
            if ins.outs and ins.outs[0] in stage_notes:
                stage_notes[outs[0]] = stage_notes[ins.outs[0]]
        for o in ins.outs:
            split[o] = True
        add(phase, copies)

    # GPipe order: forward of each micro-batch, backward of each, then the rest. The update's
    # early part goes first in the backward: it waits there (_order_by_dependencies) until
    # its inputs are made, and runs right after.
    body: list[Instr] = list(prologue)
    for phase in ("forward", "backward"):
        chunks = groups.get(phase, [])
        if phase == "backward":
            body.extend(ins for copies in groups.get(EARLY, []) for ins in copies)
        singles_done: set[int] = set()
        for m in range(M):
            for k, copies in enumerate(chunks):
                if len(copies) == M:
                    body.append(copies[m])
                elif k not in singles_done and m == 0:
                    body.extend(copies)
                    singles_done.add(k)
    for phase, chunks in groups.items():
        if phase not in ("forward", "backward", EARLY):
            for copies in chunks:
                body.extend(copies)
    body = _order_by_dependencies(body, {i.name for i in inputs}, prologue + program)
    outputs = []
    for output in plan.outputs:
        if split.get(output.var, False):
            raise PlanError(
                f"the result {output.name!r} differs per micro-batch; return a value combined "
                "over the batch (a loss's mean) or a parameter's state"
            )
        outputs.append(output)
    mesh = tuple(x for x in plan.mesh if x[0] != MB)
    notes = {**notes, "stage": stage_notes}
    out = plan.replace(
        mesh=mesh,
        inputs=inputs,
        body=tuple(body),
        outputs=tuple(outputs),
        micro_batches=M,
        notes=notes,
    )
    return record_pass(out, "microbatch", t0)


def _combine(
    ins: Instr,
    uses: list[str],
    M: int,
    split: dict[str, bool],
    types: dict[str, TensorType],
    name: Callable[[str, int], str],
    drop: Callable[[TensorType], TensorType],
    copy_type: Callable[[TensorType], TensorType],
) -> list[Instr]:
    """A communication over ``mb`` as local ops on the micro-batch copies: a reduction over
    the micro-batches is the sum (or mean) of the copies, a gather their ``cat``, a local
    chunk one slice per copy; a reduce-scatter or an all-to-all is the reduction or the
    gather, then the slices. ``mb`` is the innermost mesh dim (``compile_step`` appends it),
    so its chunk of a tensor dim is a slice of this rank's part."""
    src = uses[0]
    t_out = drop(ins.types[0])
    copies = [Var(name(src, m)) if split.get(src) else Var(src) for m in range(M)]
    op = ins.op
    why = f"micro-batches of %{src} combined" + (f" ({ins.reason})" if ins.reason else "")

    def instr(
        outs: tuple[str, ...], aten: str, args: tuple[Any, ...], t: TensorType, reason: str = why
    ) -> Instr:
        return Instr(outs, aten, args, (), (t,), ins.stream, ins.on, ins.loc, reason)

    def reduced(out: str, how: str, t: TensorType) -> list[Instr]:
        # A running sum, one add per micro-batch after the first: each add runs as soon as
        # its micro-batch's copy is made (_order_by_dependencies), and the copies die one by
        # one (a stack of all M and its sum held M + 1 at once and moved twice the bytes).
        assert t.shape is not None  # (a reduction over micro-batches is of a tensor)
        steps, acc = [], copies[0]
        for m in range(1, M):
            last = m == M - 1 and how == "sum"
            made = out if last else f"{out}.acc{m}"
            steps.append(instr((made,), "aten.add.Tensor", (acc, copies[m]), t))
            acc = Var(made)
        if how != "sum":
            steps.append(instr((out,), "aten.div.Tensor", (acc, M), t))
        return steps

    def sliced(whole: str, dim: int) -> list[Instr]:
        # One slice per micro-batch, in global sizes: ``lower`` rescales a micro-batch slice
        # to this rank's part of a tensor dim other mesh dims shard too.
        t = copy_type(ins.types[0])
        assert t_out.shape is not None  # (a slice is of a tensor)
        length = t_out.shape[dim] // M
        return [
            instr(
                (name(ins.outs[0], m),),
                "aten.slice.Tensor",
                (Var(whole), dim, m * length, (m + 1) * length),
                t,
                f"micro-batch {m} of %{whole}" + (f" ({ins.reason})" if ins.reason else ""),
            )
            for m in range(M)
        ]

    if op == "all_reduce" and len(uses) == 1 and ins.kw("op") in ("sum", "avg"):
        return reduced(ins.outs[0], ins.kw("op"), t_out)
    if op == "all_gather":
        return [instr(ins.outs, "aten.cat.default", (copies, ins.kw("dim")), t_out)]
    if op == "shard_local" and not split.get(src):
        return sliced(src, ins.kw("dim"))
    if op == "reduce_scatter" and ins.kw("op") in ("sum", "avg"):
        whole = f"{ins.outs[0]}.mbsum"
        return reduced(whole, ins.kw("op"), t_out) + sliced(whole, ins.kw("dim"))
    if op == "all_to_all":
        whole = f"{ins.outs[0]}.mbcat"
        cat_dim = ins.kw("cat_dim")
        return [
            instr((whole,), "aten.cat.default", (copies, cat_dim), t_out),
            *sliced(whole, ins.kw("split_dim")),
        ]
    if op == "partial_local" and not split.get(src):
        # Partial(sum): the value in micro-batch 0's copy, zeros in the others (whose sum it
        # is); any other op: the value in every copy.
        t = copy_type(ins.types[0])
        return [
            instr(
                (name(ins.outs[0], m),),
                "aten.zeros_like.default" if ins.kw("op") == "sum" and m else "aten.alias.default",
                (Var(src),),
                t,
            )
            for m in range(M)
        ]
    raise PlanError(
        f"{op} over micro-batches is not supported yet (value %{src}, {types[src].placements})",
        ins.loc,
    )


EARLY = "early update"


class _EarlyUpdate:
    """Which instructions of the update run with the backward pass instead: the update's
    per-micro-batch work (the optimizer reading a gradient that is still one partial sum per
    micro-batch, and the accumulation of those sums over the micro-batches). Run as soon as
    its inputs are, an accumulated gradient is ready when its last micro-batch's backward is,
    and its all-reduce can overlap the rest of the backward pass (``schedule``).

    Only pure instructions whose inputs are made before the update (or by an instruction run
    early) qualify, and none that reads storage the update has already written in place:
    run earlier, it must still see the same values."""

    def __init__(self, inputs: set[str]) -> None:
        self.before_update = set(inputs)  # values made before the update, or early
        self.root: dict[str, str] = {}  # value -> the value whose storage it shares
        self.written: set[str] = set()  # roots the update has written in place so far

    def phase(self, ins: Instr, phase: str, per_micro_batch: bool) -> str:
        """``ins``'s phase (``EARLY`` for what runs early); given in program order."""
        uses = ins.uses()
        name, inplace = base_name(ins.op) if "." in ins.op else (ins.op, False)
        roots = [self.root.get(u, u) for u in uses]
        if (
            phase == "update"
            and per_micro_batch
            and not inplace
            and all(u in self.before_update for u in uses)
            and not any(r in self.written for r in roots)
        ):
            phase = EARLY
        if phase != "update":
            self.before_update.update(ins.outs)
        else:
            self.written.update(self.root.get(w, w) for w in written(ins))
        if roots and (name in ALIASING or inplace):
            for o in ins.outs:
                self.root[o] = roots[0]
        return phase


def _phases(plan: Plan) -> dict[int, str]:
    """Each instruction's phase: recorded while tracing; an inserted communication takes the
    phase of the next instruction that has one (it was inserted for that instruction)."""
    recorded = (plan.notes or {}).get("phase", {})
    out: dict[int, str] = {}
    pending: list[Instr] = []
    for ins in plan.body:
        ph = recorded.get(ins.outs[0]) if ins.outs else None
        if ph is None:
            pending.append(ins)
            continue
        for p in pending:
            out[id(p)] = ph
        pending = []
        out[id(ins)] = ph
    for p in pending:
        out[id(p)] = "update"
    return out


def _order_by_dependencies(
    body: list[Instr], available: set[str], program: list[Instr]
) -> list[Instr]:
    """``body`` in its order, except that an instruction waits until its inputs are defined
    and until the accesses to the storage it reads or writes that come before it in
    ``program`` (the same instructions in an order that runs them correctly one after the
    other) are done (``_memory_dependencies``).

    Whatever a defined value (or a done instruction) lets go runs right after it, in sweeps
    in body order: those later in the body than the instruction that freed them in the same
    sweep, the others in the next one. Each instruction is looked at once per input or
    access it waits for."""
    done = set(available)
    ran = [False] * len(body)
    out: list[Instr] = []
    # What each instruction waits for: values (by name) and instructions (by body index).
    waiters: dict[str | int, list[int]] = {}
    missing: dict[int, int] = {}  # waiting instruction -> how many of those are not there yet
    after = _memory_dependencies(body, program)

    def release(key: str | int, k: int, sweep: list[int], following: list[int]) -> None:
        for w in waiters.pop(key, ()):
            missing[w] -= 1
            if not missing[w]:
                del missing[w]
                heapq.heappush(sweep if w > k else following, w)

    def run(first: int) -> None:
        sweep: list[int] = [first]
        following: list[int] = []
        while sweep:
            while sweep:
                k = heapq.heappop(sweep)
                out.append(body[k])
                ran[k] = True
                for o in body[k].outs:
                    done.add(o)
                    release(o, k, sweep, following)
                release(k, k, sweep, following)
            sweep, following = following, []

    for k, ins in enumerate(body):
        need: set[str | int] = {u for u in ins.uses() if u not in done}
        need.update(j for j in after.get(k, ()) if not ran[j])
        if not need:
            run(k)
            continue
        missing[k] = len(need)
        for u in need:
            waiters.setdefault(u, []).append(k)
    if missing:
        names = sorted({u for k in missing for u in body[k].uses() if u not in done})
        raise PlanError(f"internal: values never defined after micro-batching: {names[:5]}")
    return out


def _memory_dependencies(body: list[Instr], program: list[Instr]) -> dict[int, list[int]]:
    """For each instruction (by ``body`` index), the instructions that must run before it
    because of storage shared through writes in place: a write comes after every earlier (in
    ``program``) read and write of the storage, a read after the earlier write. A storage is
    a value and everything that aliases it (views, ``detach``, the result of a write in
    place); making a view reads nothing. E.g. ``cat([detach.mb0, detach.mb1])`` before
    ``relu_.mb0`` (which writes the storage of ``detach.mb0``): the cat waits for micro-batch
    1's ``detach``, and ``relu_.mb0`` must wait for the cat.

    Dependencies point backwards in ``program``, which is also an order of the inputs'
    definitions, so with them the order has no cycle."""
    index = {id(ins): k for k, ins in enumerate(body)}
    root: dict[str, str] = {}
    last_write: dict[str, int] = {}
    readers: dict[str, list[int]] = {}  # storage -> its readers since its last write
    after: dict[int, list[int]] = {}
    for ins in program:
        k = index[id(ins)]
        uses, targets = ins.uses(), written(ins)
        name = base_name(ins.op)[0] if "." in ins.op else ins.op
        if uses and name in ALIASING:
            for o in ins.outs:
                root[o] = root.get(uses[0], uses[0])
            continue
        writes = {root.get(w, w) for w in targets}
        if targets:
            for o in ins.outs:  # the written value, under a new name
                root[o] = root.get(targets[0], targets[0])
        deps: set[int] = set()
        for r in {root.get(u, u) for u in uses} - writes:
            if r in last_write:
                deps.add(last_write[r])
            readers.setdefault(r, []).append(k)
        for r in writes:
            if r in last_write:
                deps.add(last_write[r])
            deps.update(readers.pop(r, ()))
            last_write[r] = k
        deps.discard(k)
        if deps:
            after[k] = sorted(deps)
    return after


# ---- stages ----------------------------------------------------------------------------------


def split_stages(plan: Plan, dim: str) -> Plan:
    """Put each instruction on its stage's ranks and insert the transfers (module docstring)."""
    t0 = time.perf_counter()
    if dim not in plan.dims:
        return plan
    n_stages = plan.sizes[plan.dims.index(dim)]
    tagged = (plan.notes or {}).get("stage", {})
    if not tagged:
        raise PlanError(
            f"the mesh has a pipeline dim {dim!r} but the step marks no stages: use "
            "`with md.pipeline_stage(i):` around each stage's part of the forward pass"
        )
    for s in set(tagged.values()):
        if s >= n_stages:
            raise PlanError(f"md.pipeline_stage({s}) but {dim!r} has only {n_stages} stages")
    input_names = {i.name for i in plan.inputs}
    stage_of = _infer_stages(plan, tagged)
    stage_of_value = {o: stage_of[k] for k, ins in enumerate(plan.body) for o in ins.outs}

    # A parameter updated on one stage but read on another (weights tied across stages) would
    # go stale on the reader: refused rather than computed wrong.
    readers: dict[str, set[int]] = {}
    for k, ins in enumerate(plan.body):
        for u in ins.uses():
            if u in input_names:
                readers.setdefault(u, set()).add(stage_of[k])
    for k, ins in enumerate(plan.body):
        for w in written(ins):
            stages = readers.get(w, set()) if w in input_names else set()
            if len(stages) < 2:
                continue
            if base_name(ins.op)[0].startswith(FOREACH):  # one op writing every stage's tensors
                tensors = ", ".join("%" + v for v in written(ins))
                raise PlanError(
                    f"{ins.op} updates tensors of several pipeline stages ({tensors}) in one "
                    f"op on stage {stage_of[k]}: construct the optimizer (or utility) with "
                    "foreach=False",
                    ins.loc,
                )
            raise PlanError(
                f"%{w} is used on pipeline stages {sorted(stages)} but updated in "
                f"place on stage {stage_of[k]} only ({ins.op}): weights shared across "
                "stages are not supported; give each stage its own parameter",
                ins.loc,
            )
    body: list[Instr] = []
    received: dict[tuple[str, int], str] = {}
    types = plan.types()
    names = FreshNames(types)
    for k, ins in enumerate(plan.body):
        s = stage_of[k]
        renames = {}
        for u in ins.uses():
            if u in input_names or stage_of_value.get(u, s) == s:
                continue
            key = (u, s)
            if key not in received:
                src = stage_of_value[u]
                new = names.fresh(f"{u}.from{src}")
                t = types[u]
                why = f"%{u} of stage {src} is used on stage {s}"
                body.append(
                    Instr(
                        (),
                        "send",
                        (Var(u),),
                        (("dims", (dim,)), ("peer", s)),
                        (),
                        ins.stream,
                        ((dim, src),),
                        ins.loc,
                        why,
                    )
                )
                body.append(
                    Instr(
                        (new,),
                        "recv",
                        (),
                        (("dims", (dim,)), ("peer", src)),
                        (t,),
                        ins.stream,
                        ((dim, s),),
                        ins.loc,
                        why,
                    )
                )
                received[key] = new
            renames[u] = received[key]
        on = tuple(x for x in ins.on if x[0] != dim) + ((dim, s),)
        body.append(
            Instr(
                ins.outs,
                ins.op,
                rename_vars(ins.args, renames),
                tuple((kk, rename_vars(v, renames)) for kk, v in ins.kwargs),
                ins.types,
                ins.stream,
                on,
                ins.loc,
                ins.reason,
            )
        )
    notes = {
        **(plan.notes or {}),
        "output_stage": {o.name: stage_of_value.get(o.var) for o in plan.outputs},
    }
    return record_pass(plan.replace(body=tuple(body), notes=notes), "split_stages", t0)


def _infer_stages(plan: Plan, tagged: dict[str, int]) -> list[int]:
    """Each instruction's pipeline stage (the module docstring), in these steps:

    1. The stage tracing recorded (``md.pipeline_stage``; backward ops: their forward op's).
    2. Propagated along the use-def chains, to a fixed point: from producers, an instruction
       with inputs made on a stage takes the latest of their stages; from consumers, one
       whose inputs have none yet takes the stage of its first user (in program order) that
       has one. So a whole chain of untagged instructions follows the staged value at either
       end, e.g. Adam's ``exp_avg_sq = zeros_like(p); mul_(exp_avg_sq, beta2);
       addcmul_(..., grad, grad)`` goes where the gradient is, however long the chain.
    3. What is still unplaced (connected to nothing staged) follows the plan inputs it reads
       and the optimizer state it makes: the stage where an input is first read by a staged
       instruction, and optimizer state (``<param>.<key>``) the stage of its parameter; e.g.
       Adam's step counter, which only its parameter's update relates to. Then step 2 again.
    4. Anything left is on stage 0.
    """
    body = plan.body
    stage: list[int | None] = [tagged.get(ins.outs[0]) if ins.outs else None for ins in body]
    producer = {o: k for k, ins in enumerate(body) for o in ins.outs}
    users: dict[str, list[int]] = {}
    for k, ins in enumerate(body):
        for u in dict.fromkeys(ins.uses()):
            users.setdefault(u, []).append(k)

    def settle() -> None:
        changed = True
        while changed:
            changed = False
            for k, ins in enumerate(body):  # from producers, in program order
                if stage[k] is None:
                    made = [stage[producer[u]] for u in ins.uses() if u in producer]
                    known = [s for s in made if s is not None]
                    if known:
                        stage[k], changed = max(known), True
            for k in reversed(range(len(body))):  # from consumers, in reverse order
                if stage[k] is None:
                    staged = [
                        j for o in body[k].outs for j in users.get(o, ()) if stage[j] is not None
                    ]
                    if staged:
                        stage[k], changed = stage[min(staged)], True

    settle()
    if None in stage:
        kinds = {i.name: i.kind for i in plan.inputs}
        home: dict[str, int] = {}  # input -> the stage of its first staged reader
        for k, ins in enumerate(body):
            s = stage[k]
            for u in ins.uses():
                if u in kinds and s is not None:
                    home.setdefault(u, s)

        def home_of(name: str, state: bool) -> int | None:
            if name in home:
                return home[name]
            param = name.rpartition(".")[0]
            if state and kinds.get(param) == "param":
                return home.get(param)
            return None

        state_made = {o.var: o.name for o in plan.outputs if o.kind == "state"}
        for k, ins in enumerate(body):
            if stage[k] is None:
                found = [home_of(u, kinds[u] == "state") for u in ins.uses() if u in kinds]
                found += [home_of(state_made[o], True) for o in ins.outs if o in state_made]
                known = [s for s in found if s is not None]
                if known:
                    stage[k] = max(known)
        settle()
    return [0 if s is None else s for s in stage]


__all__ = ["microbatch", "split_stages", "MB", "Partial"]
