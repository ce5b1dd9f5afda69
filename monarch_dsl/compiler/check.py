"""``check_plan``: prove, before any rank starts, that a plan can run as written.

The plan is one global program. Each rank runs, in program order, the instructions whose
``on`` filter matches its coordinates; its ``main`` and ``comms`` streams run concurrently.
The checker works in four passes, each of which can rely on the ones before it:

1. structure and data flow, one instruction at a time (one rank mask per ``on`` filter, so
   "defined on every rank that uses it" is a bit test);
2. collective matching, per communicator (stream, dims, group);
3. point-to-point matching, per (sender, receiver, stream);
4. a simulation of every rank and stream with blocking semantics, which finds deadlocks.

Every pass is linear in instructions x ranks. The first violation raises ``PlanError`` at the
instruction's ``loc``; the message names the instruction, what was expected and what was found.
"""

from __future__ import annotations

from collections import deque
from typing import Any, TypeAlias

from monarch_dsl.compiler.plan import (
    DTYPE_NAMES,
    IMPLEMENTATIONS,
    INPUT_KINDS,
    LOCAL_OPS,
    OUTPUT_KINDS,
    PARTIAL_OPS,
    STREAMS,
    Instr,
    Plan,
    PlanError,
    Shard,
    TensorType,
)
from monarch_dsl.mesh import all_coords, index_of_coords

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
P2P = ("send", "recv")
# A collective's signature: kind, dims, op, tensor dims, local inputs ((shape, dtype), ...).
Signature: TypeAlias = tuple[
    str, tuple[str, ...], Any, tuple[Any, ...], tuple[tuple[tuple[int, ...], str], ...]
]
# For communication over some dims: each rank's group id, and each group's ranks.
Groups: TypeAlias = tuple[list[int], list[list[int]]]
On: TypeAlias = tuple[tuple[str, int], ...]
# Tensor-dim kwargs each collective takes.
TENSOR_DIM_KWARGS = {
    "all_reduce": (),
    "reduce_scatter": ("dim",),
    "all_gather": ("dim",),
    "all_to_all": ("split_dim", "cat_dim"),
}


def check_plan(plan: Plan) -> None:
    """Raise ``PlanError`` unless every invariant below holds; return None if they all do.

    Structure
      - mesh: dims are distinct non-empty names, sizes are ints >= 1; micro_batches >= 1.
      - kinds: input kinds are ``INPUT_KINDS``, output kinds ``OUTPUT_KINDS``.
      - stream: every instruction's stream is one of ``STREAMS``.
      - on-filter: ``on`` names mesh dims, each at most once, with indices in range.
      - types: one ``TensorType`` per out; a tensor type has one placement per mesh dim, and
        each ``Shard(d)`` has 0 <= d < the tensor's rank.
    Data flow
      - ssa: every name (input or out) is defined once.
      - def-before-use: every value an instruction uses is an input or an out of an earlier
        instruction, defined on every rank that runs the user (a value made under ``on pp=0``
        does not exist on pp=1).
      - outputs: every output names a defined value.
    Communication, per instruction
      - comm-dims: ``dims`` (communication and local redistribution) is a non-empty tuple of
        distinct mesh dims.
      - comm-kwargs: ``op`` is one of ``PARTIAL_OPS`` for all_reduce / reduce_scatter; ``dim``,
        ``split_dim``, ``cat_dim`` are dims of the input tensor.
      - comm-values: a collective reads tensors and returns one value per input (several only
        for a bucketed all_reduce) of the same global shape and dtype.
      - divisible: the local size of reduce_scatter's ``dim`` and all_to_all's ``split_dim``
        divides by the group size.
      - p2p-kwargs: send / recv name one dim d, run under ``on d=i``, and ``peer`` is another
        index of d; send reads one value, recv reads none and makes one.
    Communication, across ranks
      - collective-match: the ranks of every group (ranks sharing their coordinates off
        ``dims``) issue the same sequence of collectives over it on each stream: same kind,
        dims, op, tensor dims, local input shapes and dtypes.
      - whole-group: no collective's ``on`` filter names one of its own dims (only part of
        its group would run that instruction).
      - p2p-match: on each (sender, receiver, stream) the k-th send meets the k-th recv, whose
        type has the sent value's shape and dtype; no send or recv is left over.
      - deadlock-free: running every rank and stream with blocking semantics (a collective
        completes when its whole group reached it, a send when its recv is reached and vice
        versa, a use of a value from another stream waits for its definition) finishes. If it
        gets stuck, the message lists the cycle of waits.
    """
    _Checker(plan).run()


class _Checker:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.body = plan.body
        self.types: dict[str, TensorType] = {}
        # Filled by the structure pass: the ranks each instruction runs on.
        self.ranks_of: list[list[int]] = []
        self.defined_at: dict[str, int] = {}  # value -> defining instruction (-1: input)

    def run(self) -> None:
        self.check_mesh()
        self.check_inputs()
        self.check_body()
        self.check_outputs()
        self.check_collectives()
        pairs = self.check_p2p()
        self.simulate(pairs)

    # ---- errors ------------------------------------------------------------------------------

    def fail(self, i: int, message: str) -> PlanError:
        return PlanError(f"{self.what(i)}: {message}", loc=self.body[i].loc)

    def what(self, i: int) -> str:
        return f"instruction {i} `{_fmt_instr(self.body[i])}`"

    def rank(self, r: int) -> str:
        return "(" + ", ".join(f"{d}={c}" for d, c in zip(self.plan.dims, self.coords[r])) + ")"

    # ---- mesh, inputs, outputs ----------------------------------------------------------------

    def check_mesh(self) -> None:
        plan = self.plan
        names = [d for d, _ in plan.mesh]
        for d, n in plan.mesh:
            if not isinstance(d, str) or not d:
                raise PlanError(
                    f"plan {plan.name}: mesh dim names must be non-empty strings, "
                    f"found {d!r} in mesh {plan.mesh!r}"
                )
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise PlanError(
                    f"plan {plan.name}: mesh dim {d} must have an int size >= 1, found {n!r}"
                )
        if len(set(names)) != len(names):
            raise PlanError(f"plan {plan.name}: mesh dims must be distinct, found {names}")
        if not isinstance(plan.micro_batches, int) or plan.micro_batches < 1:
            raise PlanError(
                f"plan {plan.name}: micro_batches must be an int >= 1, found {plan.micro_batches!r}"
            )
        self.dim_index = {d: k for k, d in enumerate(names)}
        self.sizes = plan.sizes
        self.coords = all_coords(self.sizes)
        self.all_mask = (1 << len(self.coords)) - 1
        self._on_cache: dict[On, tuple[list[int], int]] = {}
        self._group_cache: dict[tuple[str, ...], Groups] = {}

    def mesh_str(self) -> str:
        return ", ".join(f"{d}={n}" for d, n in self.plan.mesh) or "()"

    def check_inputs(self) -> None:
        for inp in self.plan.inputs:
            where = f"input %{inp.name}"
            if inp.kind not in INPUT_KINDS:
                raise PlanError(f"{where}: kind must be one of {INPUT_KINDS}, found {inp.kind!r}")
            if inp.name in self.types:
                raise PlanError(f"{where}: defined twice (two inputs of that name)")
            problem = self.type_problem(inp.type)
            if problem:
                raise PlanError(f"{where}: {problem}")
            self.types[inp.name] = inp.type
            self.defined_at[inp.name] = -1

    def check_outputs(self) -> None:
        for out in self.plan.outputs:
            where = f"output {out.name} = %{out.var}"
            if out.kind not in OUTPUT_KINDS:
                raise PlanError(f"{where}: kind must be one of {OUTPUT_KINDS}, found {out.kind!r}")
            if out.var not in self.types:
                raise PlanError(
                    f"{where}: %{out.var} is not defined (no input or instruction makes it)"
                )

    def type_problem(self, t: Any) -> str:
        """What is wrong with ``t`` as a value's type, or ''."""
        if not isinstance(t, TensorType):
            return f"expected a TensorType, found {t!r}"
        if t.shape is None:
            return ""
        if len(t.placements) != len(self.sizes):
            return (
                f"expected one placement per mesh dim ({self.mesh_str()}), found "
                f"{len(t.placements)}: {t.placements!r}"
            )
        for p in t.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < len(t.shape):
                return (
                    f"placement {p} shards tensor dim {p.dim}, but the tensor "
                    f"{_fmt_type(t)} has dims 0..{len(t.shape) - 1}"
                )
        return ""

    # ---- pass 1: structure and data flow ------------------------------------------------------

    def on_ranks(self, i: int) -> tuple[list[int], int]:
        """The ranks instruction ``i`` runs on and their bit mask (validates ``on``)."""
        on = self.body[i].on
        hit = self._on_cache.get(on)
        if hit is not None:
            return hit
        seen = set()
        for item in on:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise self.fail(i, f"expected on as ((dim, index), ...), found {on!r}")
            d, idx = item
            if d not in self.dim_index:
                raise self.fail(
                    i, f"on names dim {d!r}, which is not a mesh dim; the mesh is {self.mesh_str()}"
                )
            if d in seen:
                raise self.fail(i, f"on names dim {d} twice")
            seen.add(d)
            n = self.sizes[self.dim_index[d]]
            if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < n:
                raise self.fail(i, f"on {d}={idx!r} is out of range; expected 0 <= index < {n}")
        want = [(self.dim_index[d], idx) for d, idx in on]
        ranks = [r for r, c in enumerate(self.coords) if all(c[k] == idx for k, idx in want)]
        mask = 0
        for r in ranks:
            mask |= 1 << r
        self._on_cache[on] = (ranks, mask)
        return ranks, mask

    def check_body(self) -> None:
        body = self.body
        first_def: dict[str, int] = {}
        for i, ins in enumerate(body):
            for o in ins.outs:
                first_def.setdefault(o, i)
        masks: dict[str, int] = dict.fromkeys(self.types, self.all_mask)
        self.uses = [ins.uses() for ins in body]
        for i, ins in enumerate(body):
            if ins.stream not in STREAMS:
                raise self.fail(i, f"stream must be one of {STREAMS}, found {ins.stream!r}")
            ranks, mask = self.on_ranks(i)
            self.ranks_of.append(ranks)
            if len(ins.types) != len(ins.outs):
                raise self.fail(
                    i, f"expected one type per out ({len(ins.outs)}), found {len(ins.types)}"
                )
            for v in self.uses[i]:
                if v not in masks:
                    later = first_def.get(v)
                    if later is not None:
                        raise self.fail(
                            i, f"uses %{v} before its definition (instruction {later} defines it)"
                        )
                    raise self.fail(i, f"uses %{v}, which is never defined")
                missing = mask & ~masks[v]
                if missing:
                    r = (missing & -missing).bit_length() - 1
                    j = self.defined_at[v]
                    raise self.fail(
                        i,
                        f"uses %{v} on rank {self.rank(r)}, where it is not "
                        f"defined: %{v} exists only {_fmt_on(body[j].on)} "
                        f"({self.what(j)}), but this instruction runs "
                        f"{_fmt_on(ins.on)}",
                    )
            for o, t in zip(ins.outs, ins.types):
                if o in masks:
                    j = self.defined_at[o]
                    first = "an input" if j < 0 else self.what(j)
                    raise self.fail(
                        i,
                        f"defines %{o} again; it is already defined by {first} "
                        "(every name is defined once)",
                    )
                problem = self.type_problem(t)
                if problem:
                    raise self.fail(i, f"type of %{o}: {problem}")
                masks[o] = mask
                self.defined_at[o] = i
                self.types[o] = t
            if ins.op in COLLECTIVES or ins.op in P2P or ins.op in LOCAL_OPS:
                self.check_comm_kwargs(i, ins)

    def check_comm_kwargs(self, i: int, ins: Instr) -> None:
        dims = ins.kw("dims")
        if not isinstance(dims, (tuple, list)) or not dims:
            raise self.fail(
                i,
                f"expected dims= a non-empty tuple of mesh dims (of "
                f"{self.mesh_str()}), found {dims!r}",
            )
        for d in dims:
            if d not in self.dim_index:
                raise self.fail(
                    i, f"dims names {d!r}, which is not a mesh dim; the mesh is {self.mesh_str()}"
                )
        if len(set(dims)) != len(dims):
            raise self.fail(i, f"dims must be distinct, found {tuple(dims)!r}")
        if ins.op in P2P:
            self.check_p2p_kwargs(i, ins, dims)
        elif ins.op in COLLECTIVES:
            self.check_collective_kwargs(i, ins, dims)

    def check_p2p_kwargs(self, i: int, ins: Instr, dims: Any) -> None:
        if len(dims) != 1:
            raise self.fail(
                i, f"{ins.op} goes along one mesh dim: expected dims=(d,), found {tuple(dims)!r}"
            )
        d = dims[0]
        on = dict(ins.on)
        if d not in on:
            raise self.fail(
                i,
                f"{ins.op} over {d} must run on one index of {d}: expected "
                f"on {d}=<index>, found {_fmt_on(ins.on)}",
            )
        peer, n = ins.kw("peer"), self.sizes[self.dim_index[d]]
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise self.fail(i, f"expected peer= an index of {d}, found {peer!r}")
        if not 0 <= peer < n:
            raise self.fail(i, f"peer={peer} is out of range: {d} has indices 0..{n - 1}")
        if peer == on[d]:
            raise self.fail(
                i,
                f"peer={peer} is this instruction's own index on {d}; "
                f"expected another index of {d}",
            )
        n_uses = len(self.uses[i])
        if ins.op == "send" and n_uses != 1:
            raise self.fail(i, f"send reads one value, found {n_uses}")
        if ins.op == "recv" and (n_uses != 0 or len(ins.outs) != 1):
            raise self.fail(
                i,
                f"recv reads nothing and makes one value; found {n_uses} "
                f"inputs and {len(ins.outs)} outs",
            )

    def check_collective_kwargs(self, i: int, ins: Instr, dims: Any) -> None:
        op = ins.op
        uses = self.uses[i]
        n_in = len(uses)
        if (op == "all_reduce" and (n_in < 1 or n_in != len(ins.outs))) or (
            op != "all_reduce" and (n_in != 1 or len(ins.outs) != 1)
        ):
            raise self.fail(
                i,
                f"{op} reads tensors and makes one value per tensor (one "
                f"tensor, except a bucketed all_reduce); found {n_in} inputs and "
                f"{len(ins.outs)} outs",
            )
        if op in ("all_reduce", "reduce_scatter") and ins.kw("op") not in PARTIAL_OPS:
            raise self.fail(i, f"expected op= one of {PARTIAL_OPS}, found {ins.kw('op')!r}")
        group = 1
        for d in dims:
            group *= self.sizes[self.dim_index[d]]
        for v, out, tout in zip(uses, ins.outs, ins.types):
            tin = self.types[v]
            if tin.shape is None:
                raise self.fail(i, f"{op} needs a tensor, but %{v} is not one ({tin.dtype})")
            if tout.shape != tin.shape or tout.dtype != tin.dtype:
                raise self.fail(
                    i,
                    f"a collective keeps the global shape and dtype: expected "
                    f"%{out} to be {_fmt_type(tin)} like %{v}, found "
                    f"{_fmt_type(tout)}",
                )
            ndim = len(tin.shape)
            for k in TENSOR_DIM_KWARGS[op]:
                t_dim = ins.kw(k)
                if not isinstance(t_dim, int) or isinstance(t_dim, bool) or not (0 <= t_dim < ndim):
                    raise self.fail(
                        i,
                        f"expected {k}= a dim of %{v} {_fmt_type(tin)} "
                        f"(0..{ndim - 1}), found {t_dim!r}",
                    )
            split = {"reduce_scatter": "dim", "all_to_all": "split_dim"}.get(op)
            if split is not None:
                t_dim = ins.kw(split)
                local = tin.local_shape(self.sizes)
                if local[t_dim] % group:
                    raise self.fail(
                        i,
                        f"{op} splits tensor dim {t_dim} of %{v} into {group} "
                        f"chunks (the group over {tuple(dims)!r}), but each rank "
                        f"holds {local[t_dim]} along it (local shape "
                        f"{list(local)}); expected a multiple of {group}",
                    )

    # ---- pass 2: collectives ------------------------------------------------------------------

    def groups(self, dims: tuple[str, ...]) -> Groups:
        """For communication over ``dims``: each rank's group id, and each group's ranks."""
        hit = self._group_cache.get(dims)
        if hit is not None:
            return hit
        rest = [k for k in range(len(self.sizes)) if self.plan.dims[k] not in dims]
        ids: dict[tuple[int, ...], int] = {}
        group_of: list[int] = []
        members: list[list[int]] = []
        for r, c in enumerate(self.coords):
            key = tuple(c[k] for k in rest)
            if key not in ids:
                ids[key] = len(members)
                members.append([])
            group_of.append(ids[key])
            members[ids[key]].append(r)
        self._group_cache[dims] = (group_of, members)
        return group_of, members

    def signature(self, i: int) -> Signature:
        ins = self.body[i]
        ins_types = tuple(
            (self.types[v].local_shape(self.sizes), self.types[v].dtype) for v in self.uses[i]
        )
        return (
            ins.op,
            tuple(ins.kw("dims")),
            ins.kw("op"),
            tuple(ins.kw(k) for k in TENSOR_DIM_KWARGS[ins.op]),
            ins_types,
        )

    def check_collectives(self) -> None:
        # (stream, dims) -> rank -> the collectives it issues there, in order.
        seqs: dict[tuple[str, tuple[str, ...]], dict[int, list[int]]] = {}
        for i, ins in enumerate(self.body):
            if ins.op in COLLECTIVES:
                per_rank = seqs.setdefault((ins.stream, tuple(ins.kw("dims"))), {})
                for r in self.ranks_of[i]:
                    per_rank.setdefault(r, []).append(i)
        sigs: dict[int, Signature] = {}

        def sig(i: int) -> Signature:
            if i not in sigs:
                sigs[i] = self.signature(i)
            return sigs[i]

        for (stream, dims), per_rank in seqs.items():
            _, members = self.groups(dims)
            for group in members:
                # Compare every rank with the one that issues the most.
                ref = max(group, key=lambda r: len(per_rank.get(r, ())))
                ref_seq = per_rank.get(ref, [])
                for r in group:
                    seq = per_rank.get(r, [])
                    for k, (a, b) in enumerate(zip(ref_seq, seq)):
                        if a != b and sig(a) != sig(b):
                            raise self.collective_mismatch(stream, dims, k, ref, a, r, b)
                    if len(seq) < len(ref_seq):
                        raise self.collective_missing(stream, dims, len(seq), ref, ref_seq, r)
        for i, ins in enumerate(self.body):
            if ins.op in COLLECTIVES:
                own = [d for d, _ in ins.on if d in ins.kw("dims")]
                if own:
                    raise self.fail(
                        i,
                        f"{ins.op} over {tuple(ins.kw('dims'))!r} runs only "
                        f"{_fmt_on(ins.on)}: its on filter names its own dim "
                        f"{own[0]}, so only part of each group runs this "
                        "instruction; expected an on filter over other dims only",
                    )

    def collective_mismatch(
        self, stream: str, dims: tuple[str, ...], k: int, r1: int, i1: int, r2: int, i2: int
    ) -> PlanError:
        s1, s2 = self.signature(i1), self.signature(i2)
        fields = ("kind", "dims", "op", "tensor dims", "local inputs")
        diff = ", ".join(
            f"{f} {_fmt_sig(x)} vs {_fmt_sig(y)}" for f, x, y in zip(fields, s1, s2) if x != y
        )
        i = max(i1, i2)
        return self.fail(
            i,
            f"collectives over {dims!r} on stream {stream} do not match across "
            f"the group: the {_nth(k)} one of rank {self.rank(r1)} is "
            f"{self.what(i1)}{_at(self.body[i1])}, but the {_nth(k)} one of rank "
            f"{self.rank(r2)} is {self.what(i2)}{_at(self.body[i2])}; they differ in {diff}. "
            "Every rank of a "
            "group must issue the same collectives in the same order"
            f"{self.own_dim_hint(i1, i2)}",
        )

    def collective_missing(
        self, stream: str, dims: tuple[str, ...], k: int, r1: int, seq1: list[int], r2: int
    ) -> PlanError:
        i = seq1[k]
        return self.fail(
            i,
            f"rank {self.rank(r1)} issues this as its {_nth(k)} collective over "
            f"{dims!r} on stream {stream}, but rank {self.rank(r2)} of its group "
            f"issues only {k} there, so {self.rank(r1)} would wait forever"
            f"{self.own_dim_hint(i)}",
        )

    def own_dim_hint(self, *instrs: int) -> str:
        for i in instrs:
            ins = self.body[i]
            own = [d for d, _ in ins.on if d in ins.kw("dims")]
            if own:
                return (
                    f" (instruction {i} runs only {_fmt_on(ins.on)}, an on filter on its "
                    f"own dim {own[0]}; a collective must run on its whole group)"
                )
        return ""

    # ---- pass 3: send / recv ------------------------------------------------------------------

    def check_p2p(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Match sends with recvs; returns (rank, instr) -> the partner's (rank, instr)."""
        sends: dict[tuple[int, int, str], list[int]] = {}  # (from rank, to rank, stream)
        recvs: dict[tuple[int, int, str], list[int]] = {}
        for i, ins in enumerate(self.body):
            if ins.op not in P2P:
                continue
            k = self.dim_index[ins.kw("dims")[0]]
            peer = ins.kw("peer")
            for r in self.ranks_of[i]:
                c = self.coords[r]
                other = index_of_coords(c[:k] + (peer,) + c[k + 1 :], self.sizes)
                if ins.op == "send":
                    sends.setdefault((r, other, ins.stream), []).append(i)
                else:
                    recvs.setdefault((other, r, ins.stream), []).append(i)
        pairs: dict[tuple[int, int], tuple[int, int]] = {}
        for key in sorted(set(sends) | set(recvs)):
            src, dst, stream = key
            s, v = sends.get(key, []), recvs.get(key, [])
            for k, (a, b) in enumerate(zip(s, v)):
                sent = self.types[self.uses[a][0]]
                got = self.body[b].types[0]
                if (sent.shape, sent.dtype) != (got.shape, got.dtype):
                    raise self.fail(
                        b,
                        f"the {_nth(k)} recv on rank {self.rank(dst)} from "
                        f"{self.rank(src)} on stream {stream} meets {self.what(a)}"
                        f"{_at(self.body[a])}; expected the recv's type to be the sent "
                        f"value's, {_fmt_type(sent)}, found {_fmt_type(got)}",
                    )
                pairs[(src, a)] = (dst, b)
                pairs[(dst, b)] = (src, a)
            if len(s) > len(v):
                raise self.fail(
                    s[len(v)],
                    f"this is the {_nth(len(v))} send from rank "
                    f"{self.rank(src)} to {self.rank(dst)} on stream {stream}, but "
                    f"{self.rank(dst)} posts only {len(v)} matching recv(s) there: "
                    "the send has no recv",
                )
            if len(v) > len(s):
                raise self.fail(
                    v[len(s)],
                    f"this is the {_nth(len(s))} recv on rank "
                    f"{self.rank(dst)} from {self.rank(src)} on stream {stream}, "
                    f"but {self.rank(src)} issues only {len(s)} matching send(s) "
                    "there: the recv has no send",
                )
        return pairs

    # ---- pass 4: deadlock ---------------------------------------------------------------------

    def simulate(self, pairs: dict[tuple[int, int], tuple[int, int]]) -> None:
        body, n_streams = self.body, len(STREAMS)
        sidx = {s: k for k, s in enumerate(STREAMS)}
        n_ranks = len(self.coords)
        # A node is one rank's stream: r * n_streams + stream index.
        lists: list[list[int]] = [[] for _ in range(n_ranks * n_streams)]
        for i, ranks in enumerate(self.ranks_of):
            s = sidx[body[i].stream]
            for r in ranks:
                lists[r * n_streams + s].append(i)
        # Per instruction: kind (0 local, 1 collective, 2 p2p) and its waits on other streams
        # (stream index, latest defining instruction there).
        kind = [1 if ins.op in COLLECTIVES else 2 if ins.op in P2P else 0 for ins in body]
        xdeps: list[list[tuple[int, int]]] = []
        for ins, uses in zip(body, self.uses):
            latest: dict[int, int] = {}
            for v in uses:
                j = self.defined_at[v]
                if j >= 0 and body[j].stream != ins.stream:
                    s2 = sidx[body[j].stream]
                    latest[s2] = max(latest.get(s2, -1), j)
            xdeps.append(sorted(latest.items()))
        groups = {
            i: self.groups(tuple(ins.kw("dims"))) for i, ins in enumerate(body) if kind[i] == 1
        }

        pc = [0] * len(lists)
        arrived = [False] * len(lists)  # waiting at the communication at its pc
        counts: dict[tuple[int, int], int] = {}
        queued = [True] * len(lists)
        queue = deque(range(len(lists)))

        def done(node: int, j: int) -> bool:
            seq, p = lists[node], pc[node]
            return p >= len(seq) or seq[p] > j

        def wake(r: int) -> None:
            for node in range(r * n_streams, (r + 1) * n_streams):
                if not queued[node]:
                    queued[node] = True
                    queue.append(node)

        def step(node: int) -> None:
            arrived[node] = False
            pc[node] += 1
            wake(node // n_streams)

        while queue:
            node = queue.popleft()
            queued[node] = False
            seq, r = lists[node], node // n_streams
            while pc[node] < len(seq) and not arrived[node]:
                i = seq[pc[node]]
                if xdeps[i] and any(not done(r * n_streams + s2, j) for s2, j in xdeps[i]):
                    break  # woken when that stream moves
                if kind[i] == 0:
                    step(node)
                elif kind[i] == 1:
                    group_of, members = groups[i]
                    key = (i, group_of[r])
                    counts[key] = counts.get(key, 0) + 1
                    arrived[node] = True
                    if counts[key] == len(members[group_of[r]]):
                        s = node % n_streams
                        for m in members[group_of[r]]:
                            step(m * n_streams + s)
                else:
                    q, j = pairs[(r, i)]
                    other = q * n_streams + node % n_streams
                    arrived[node] = True
                    if arrived[other] and lists[other][pc[other]] == j:
                        step(node)
                        step(other)

        stuck = [node for node in range(len(lists)) if pc[node] < len(lists[node])]
        if stuck:
            raise self.deadlock(stuck, lists, pc, arrived, kind, xdeps, groups, pairs)

    def deadlock(
        self,
        stuck: list[int],
        lists: list[list[int]],
        pc: list[int],
        arrived: list[bool],
        kind: list[int],
        xdeps: list[list[tuple[int, int]]],
        groups: dict[int, Groups],
        pairs: dict[tuple[int, int], tuple[int, int]],
    ) -> PlanError:
        n_streams = len(STREAMS)

        def at(node: int) -> int:
            return lists[node][pc[node]]

        def where(node: int) -> str:
            r, s = divmod(node, n_streams)
            i = at(node)
            loc = self.body[i].loc
            return f"rank {self.rank(r)} stream {STREAMS[s]} at {self.what(i)}" + (
                f" (at {loc})" if loc else ""
            )

        def waits_for(node: int) -> tuple[int, str]:
            r, s = divmod(node, n_streams)
            i = at(node)
            if not arrived[node]:
                for s2, j in xdeps[i]:
                    other = r * n_streams + s2
                    seq = lists[other]
                    if pc[other] < len(seq) and seq[pc[other]] <= j:
                        value = next(o for o in self.body[j].outs if o in self.uses[i])
                        return other, (
                            f"waits for %{value}, which instruction {j} defines on its stream "
                            f"{STREAMS[s2]}{_at(self.body[j])}"
                        )
            if kind[i] == 1:
                group_of, members = groups[i]
                for m in members[group_of[r]]:
                    other = m * n_streams + s
                    if not (arrived[other] and at(other) == i):
                        return other, (
                            f"waits for rank {self.rank(m)} of its group to reach this collective"
                        )
            q, j = pairs[(r, i)]
            partner = "recv" if self.body[i].op == "send" else "send"
            return q * n_streams + s, (
                f"waits for rank {self.rank(q)} to reach the matching {partner}, instruction {j}"
                f"{_at(self.body[j])}"
            )

        # Follow the waits from the first stuck node until one repeats: that is the cycle.
        path: list[tuple[int, str]] = []
        seen: dict[int, int] = {}
        node = stuck[0]
        while node not in seen:
            seen[node] = len(path)
            nxt, why = waits_for(node)
            path.append((node, why))
            node = nxt
        cycle = path[seen[node] :]
        lines = [f"  {where(n)}\n    {why}" for n, why in cycle]
        first = at(cycle[0][0])
        return PlanError(
            f"deadlock: {len(stuck)} rank stream(s) can never finish (a collective waits for its "
            "whole group, a send for its recv and a recv for its send); they wait in a "
            "cycle:\n" + "\n".join(lines) + "\n  ... and back to the first",
            loc=self.body[first].loc,
        )


# ---- formatting --------------------------------------------------------------------------------


def _fmt_instr(ins: Instr) -> str:
    args = [repr(a) for a in ins.args] + [f"{k}={v!r}" for k, v in ins.kwargs]
    text = f"{ins.op}({', '.join(args)})"
    if ins.outs:
        text = ", ".join(f"%{o}" for o in ins.outs) + " = " + text
    if len(text) > 120:
        text = text[:117] + "..."
    if ins.on:
        text += " " + _fmt_on(ins.on)
    if ins.stream != "main":
        text += f" [{ins.stream}]"
    return text


def _at(ins: Instr) -> str:
    return f" (at {ins.loc})" if ins.loc else ""


def _fmt_sig(value: Any) -> str:
    """One field of a collective's signature, for a message."""
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        # local inputs: ((shape, dtype), ...)
        return ", ".join(f"{DTYPE_NAMES.get(d, d)}[{', '.join(map(str, s))}]" for s, d in value)
    return repr(value)


def _fmt_on(on: On) -> str:
    return "on " + ", ".join(f"{d}={i}" for d, i in on) if on else "on every rank"


def _fmt_type(t: TensorType) -> str:
    dtype = DTYPE_NAMES.get(t.dtype, t.dtype)
    if t.shape is None:
        return f"scalar {dtype}"
    return f"{dtype}[{', '.join(map(str, t.shape))}]"


def _nth(k: int) -> str:
    """``k`` counted from 0, as an English ordinal counted from 1."""
    n = k + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


IMPLEMENTATIONS["check"] = check_plan
