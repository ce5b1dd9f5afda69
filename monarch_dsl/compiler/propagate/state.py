"""The pass's state as it walks the plan: one instruction at a time, the strategy on each mesh
dim, the redistributions its inputs need inserted before it, and its outputs' placements.

Redistributions of a value are reused until the value (or anything sharing its storage) is
written in place.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import monarch_dsl.compiler.propagate.rules  # noqa: F401  (registers the rules)
from monarch_dsl.compiler.cost import nbytes, redistribute_cost
from monarch_dsl.compiler.ops import ALIASING, base_name, written, written_uses
from monarch_dsl.compiler.plan import (
    FreshNames,
    Instr,
    Partial,
    Placement,
    Plan,
    PlanError,
    Shard,
    TensorType,
    Var,
    format_placements,
)
from monarch_dsl.compiler.propagate.redistribute import redistribution, steps
from monarch_dsl.compiler.propagate.registry import Ctx, DimType, R, Strategy, strategies


class State:
    """The plan being rewritten: ``body`` so far, every value's type (with its placements),
    and what the redistributions inserted so far can be reused for."""

    def __init__(self, plan: Plan, types: dict[str, TensorType]) -> None:
        self.plan = plan
        self.types = types
        self.body: list[Instr] = []
        self.cache: dict[tuple[str, int, Placement], str] = {}  # (value, dim, placement) -> value
        self.root: dict[str, str] = {}
        # A value redistribute() made -> the storage (root) of the value it is a copy of.
        self.copy_of: dict[str, str] = {}
        self.canon: dict[str, str] = {}
        self.loc_of: dict[str, str] = {}
        self.flat_dims: set[int] = set()  # mesh dims along which everything is Replicate
        self.names = FreshNames(set(types) | {o for i in plan.body for o in i.outs})
        self.gather: dict[str, int] = {}  # fully sharded parameters: gathered for use
        self.kept: set[str] = set()  # ... kept gathered from the forward to the backward pass
        # A forward gather of a fully sharded parameter, or a view of one: (the parameter, the
        # views from the gather), for the backward pass to remake on its own gather.
        self.derived: dict[str, tuple[str, tuple[Instr, ...]]] = {}
        self.forward_gathered: list[str] = []  # fully sharded parameters, in forward order
        self.backward_gathered: set[str] = set()
        self.remade: dict[tuple[str, str], str] = {}  # (view, new gather) -> the view remade
        self.phase: dict[str, str] = {}  # by an instruction's first out (capture's notes)

    def fresh(self, base: str) -> str:
        """A new value's name: ``base_<n>``, numbered through the plan."""
        return self.names.fresh(base, numbered=True)

    def step(self, ins: Instr) -> None:
        if self.gather:
            ins = self._gathered(ins)
        sizes = self.plan.sizes
        uses = ins.uses()
        name, inplace = base_name(ins.op)
        in_types = [self.types[u] for u in uses]
        current = [list(t.placements) for t in in_types]
        out_pl: list[list[Placement]] = [[] for _ in ins.outs]
        required: list[list[Placement]] = [list(p) for p in current]
        fallback = False
        for m, n in enumerate(sizes):
            ctx = Ctx(
                [DimType(t.shape, t.dtype, t.placements[m]) for t in in_types],
                tuple(DimType(t.shape, t.dtype, R) for t in ins.types),
                n,
            )
            cands: list[Strategy] | None
            if n == 1 or m in self.flat_dims:
                cands = [Strategy(tuple(R for _ in current), tuple(R for _ in ins.outs))]
            else:
                cands = strategies(ins, ctx)
            if cands is None:
                # said when an input is sharded on this dim (gathered whole onto every rank,
                # the work done on each); a Partial one is summed first, as any op without a
                # linear rule needs (the gradients' all-reduce before clip_grad_norm_'s norms)
                fallback = fallback or any(isinstance(p[m], Shard) for p in current)
                cands = [Strategy((R,) * len(uses), (R,) * len(ins.outs))]
            best, best_cost = None, None
            for s in cands:
                if not self._fits(s, m, in_types, required, ins.types, out_pl):
                    continue  # nested shards that do not divide: infinite cost
                c = 0.0
                for t, w in zip(in_types, s.ins):
                    if w is not None:
                        c += redistribute_cost(t.placements[m], w, t, n)
                if best_cost is None or c < best_cost:
                    best, best_cost = s, c
            if best is None and inplace:
                raise PlanError(
                    f"{ins.op} writes in place into a value whose placement on "
                    f"{self.plan.dims[m]!r} ({current[0][m]}) it cannot keep",
                    ins.loc,
                )
            if best is None:
                raise PlanError(
                    f"{ins.op}: no strategy on {self.plan.dims[m]!r} whose shards divide its "
                    f"tensors evenly (inputs {[list(t.shape or ()) for t in in_types]} laid out "
                    f"as {', '.join(self._layout(r) for r in required)})",
                    ins.loc,
                )
            for i, w in enumerate(best.ins):
                if w is not None:
                    required[i][m] = w
            for j, p in enumerate(best.outs):
                out_pl[j].append(p)
        if fallback:
            gathered = sum(
                nbytes(t)
                for t, cur in zip(in_types, current)
                if any(isinstance(p, Shard) for p in cur)
            )
            warnings.warn(
                f"no sharding rule for {ins.op} (at {ins.loc or 'unknown'}): it runs "
                f"replicated on every rank, after gathering {gathered / 2**20:.2f} MiB of inputs",
                stacklevel=2,
            )
        # Redistribute the inputs that need it, use by use: one value used twice may be
        # wanted two ways (x * x with x Partial: one use made whole, the other kept).
        names = []
        at = written_uses(ins)
        writes = [uses[i] for i in at]
        for i, (u, t, want) in enumerate(zip(uses, in_types, required)):
            if tuple(want) == t.placements:
                names.append(u)
                continue
            if i in at:
                raise PlanError(
                    f"{ins.op} writes in place into %{u}, whose placement "
                    f"{self._layout(t.placements)} would have to change to {self._layout(want)}",
                    ins.loc,
                )
            names.append(self.redistribute(u, tuple(want), ins))
        it = iter(names)
        new_args = _rename_uses(ins.args, it)
        new_kwargs = tuple((k, _rename_uses(v, it)) for k, v in ins.kwargs)
        types = tuple(
            t._replace(placements=tuple(pl))
            if t.shape is not None
            else t._replace(placements=tuple(R for _ in pl))
            for t, pl in zip(ins.types, out_pl)
        )
        new = Instr(
            ins.outs, ins.op, new_args, new_kwargs, types, ins.stream, ins.on, ins.loc, ins.reason
        )
        if ins.op == "aten.nll_loss_forward.default" and any(
            p == Partial("avg") for p in types[0].placements
        ):
            self._mean_loss(new)
            return
        self.body.append(new)
        for o, t in zip(ins.outs, types):
            self.types[o] = t
            self.loc_of[o] = ins.loc
        new_uses = new.uses()
        if (
            name in ALIASING
            and len(ins.outs) == 1
            and len(new_uses) == 1
            and new_uses[0] in self.derived
            and self._phase(ins) == "forward"
        ):
            param, chain = self.derived[new_uses[0]]
            self.derived[ins.outs[0]] = (param, (*chain, new))
        # Storage roots, and what a write in place invalidates. A view's storage is that of
        # the value it was made from here: a copy where its input had to be laid out anew.
        if name in ALIASING and new_uses:
            for o in ins.outs:
                self.root[o] = self.root.get(new_uses[0], new_uses[0])
        if name in ("detach", "alias") and uses:  # the same value under another name
            self.canon[ins.outs[0]] = self.canon.get(uses[0], uses[0])
        if writes:
            roots = {self.root.get(w, w) for w in writes}
            for value in writes:
                copy = self.root.get(value, value)
                source = self.copy_of.get(copy)
                if source is not None:
                    made = self.loc_of.get(source)
                    raise PlanError(
                        f"{ins.op} writes in place into %{value}, a view of %{source}"
                        f"{f' (made at {made})' if made else ''} as it was laid out anew "
                        f"({self._layout(self.types[copy].placements)}) for an "
                        f"earlier op: the write would not reach %{source} itself (write into "
                        "it before the view, or into a clone)",
                        ins.loc,
                    )
            for o in ins.outs:
                self.root[o] = self.root.get(writes[0], writes[0])
            self.cache = {
                k: v for k, v in self.cache.items() if self.root.get(k[0], k[0]) not in roots
            }
            for o in ins.outs:  # a new value: not the same as what it was written from
                self.canon.pop(o, None)

    def _phase(self, ins: Instr) -> str:
        return self.phase.get(ins.outs[0], "forward") if ins.outs else "forward"

    def _gathered(self, ins: Instr) -> Instr:
        """``ins`` reading the whole of each fully sharded parameter it uses (forward and
        backward only: the optimizer updates each rank's shard). In the backward pass, a
        parameter that reshards after forward (``_reshards``) is gathered again, and the views
        of its forward gather that ``ins`` reads are remade on the new one."""
        phase = self._phase(ins)
        if phase == "update":
            return ins
        uses = ins.uses()
        backward = phase == "backward"
        if not any(u in self.gather or (backward and u in self.derived) for u in uses):
            return ins
        writes = set(written(ins))
        names = []
        for u in uses:
            if backward and u in self.derived and self._reshards(self.derived[u][0]):
                names.append(self._remade(u, ins))
                continue
            m = self.gather.get(u)
            pl = self.types[u].placements
            if m is None or u in writes or pl[m].is_replicate():
                names.append(u)
                continue
            want = tuple(R if k == m else p for k, p in enumerate(pl))
            if backward and self._reshards(u):
                names.append(self._gather_again(u, want, ins))
                continue
            name = self.redistribute(u, want, ins)
            if not backward and name != u:
                self.derived.setdefault(name, (u, ()))
                if u not in self.forward_gathered:
                    self.forward_gathered.append(u)
            names.append(name)
        it = iter(names)
        return dataclasses.replace(
            ins,
            args=_rename_uses(ins.args, it),
            kwargs=tuple((k, _rename_uses(v, it)) for k, v in ins.kwargs),
        )

    def _reshards(self, param: str) -> bool:
        """Whether the backward pass gathers ``param`` again rather than keep its forward
        gather: it was gathered in the forward pass, is not kept (``reshard_after_forward``),
        and is not of the module gathered last (FSDP keeps the root's last module too: the
        backward pass starts with it)."""
        if param in self.kept or param not in self.forward_gathered:
            return False
        return param.rpartition(".")[0] != self.forward_gathered[-1].rpartition(".")[0]

    def _gather_again(self, param: str, want: tuple[Placement, ...], user: Instr) -> str:
        """``param`` gathered for the backward pass: once, not the forward's gather."""
        m = self.gather[param]
        if param not in self.backward_gathered:
            self.backward_gathered.add(param)
            self.cache.pop((self.canon.get(param, param), m, R), None)
            start = len(self.body)
            name = self.redistribute(param, want, user)
            for k in range(start, len(self.body)):
                ins = self.body[k]
                why = f"gathered again for the backward pass (reshard after forward): {ins.reason}"
                self.body[k] = dataclasses.replace(ins, reason=why)
            return name
        return self.redistribute(param, want, user)

    def _remade(self, view: str, user: Instr) -> str:
        """The forward gather ``view`` is (or a view of it), remade on the backward pass's
        gather of its parameter."""
        param, chain = self.derived[view]
        m = self.gather[param]
        pl = self.types[param].placements
        name = self._gather_again(param, tuple(R if k == m else p for k, p in enumerate(pl)), user)
        for v in chain:
            key = (v.outs[0], name)
            if key not in self.remade:
                out = self.fresh(base_name(v.op)[0])
                it = iter([name])
                self.body.append(
                    dataclasses.replace(
                        v,
                        outs=(out,),
                        args=_rename_uses(v.args, it),
                        kwargs=tuple((k, _rename_uses(x, it)) for k, x in v.kwargs),
                        reason=f"the view %{v.outs[0]} of the gathered %{param}, remade",
                    )
                )
                self.types[out] = v.types[0]
                self.loc_of[out] = v.loc
                self.root[out] = self.root.get(name, name)
                self.remade[key] = out
            name = self.remade[key]
        return name

    def _layout(self, placements: list[Placement] | tuple[Placement, ...]) -> str:
        return format_placements(tuple(placements), self.plan.dims)

    def _fits(
        self,
        s: Strategy,
        m: int,
        in_types: list[TensorType],
        required: list[list[Placement]],
        out_types: tuple[TensorType, ...],
        out_pl: list[list[Placement]],
    ) -> bool:
        """Whether strategy ``s`` on mesh dim ``m`` keeps every shard even: a tensor dim it
        shards may be sharded by other mesh dims too (the inputs' placements decided so far,
        the outputs' on the mesh dims before ``m``), and each rank's part must divide."""
        sizes = self.plan.sizes
        pairs = [(t, w, r) for t, w, r in zip(in_types, s.ins, required)]
        pairs += [(t, w, pl) for t, w, pl in zip(out_types, s.outs, out_pl)]
        for t, w, others in pairs:
            if not isinstance(w, Shard) or t.shape is None or not 0 <= w.dim < len(t.shape):
                continue
            n = sizes[m]
            for k, p in enumerate(others):
                if k != m and isinstance(p, Shard) and p.dim == w.dim:
                    n *= sizes[k]
            if t.shape[w.dim] % n:
                return False
        return True

    def _mean_loss(self, ins: Instr) -> None:
        """A mean nll_loss of a sharded batch: the mean of the ranks' means is the batch's mean
        only if every rank counts the same targets (not with ignore_index or class weights).
        So: each rank's sum and total weight, both made whole, then their quotient."""
        loss, total = ins.outs
        t_loss, t_total = ins.types
        args = list(ins.args)
        args[3] = 2  # reduction: sum
        part = tuple(Partial("sum") if p == Partial("avg") else p for p in t_loss.placements)
        local_sum, local_total = self.fresh(f"{loss}.sum"), self.fresh(f"{total}.local")
        self.body.append(
            Instr(
                (local_sum, local_total),
                ins.op,
                tuple(args),
                ins.kwargs,
                (t_loss._replace(placements=part), t_total),
                ins.stream,
                ins.on,
                ins.loc,
                "the loss's sum and count on each rank (a mean is taken of the whole batch)",
            )
        )
        self.types[local_sum] = t_loss._replace(placements=part)
        self.types[local_total] = t_total
        whole = (R,) * len(part)
        s = self.redistribute(local_sum, whole, ins)
        n = self.redistribute(local_total, whole, ins)
        self.body.append(
            Instr(
                (loss,),
                "aten.div.Tensor",
                (Var(s), Var(n)),
                (),
                (t_loss._replace(placements=whole),),
                ins.stream,
                ins.on,
                ins.loc,
            )
        )
        self.body.append(
            Instr(
                (total,),
                "aten.alias.default",
                (Var(n),),
                (),
                (t_total._replace(placements=whole),),
                ins.stream,
                ins.on,
                ins.loc,
            )
        )
        self.types[loss] = t_loss._replace(placements=whole)
        self.types[total] = t_total._replace(placements=whole)
        self.loc_of[loss] = self.loc_of[total] = ins.loc

    def redistribute(self, var: str, want: tuple[Placement, ...], user: Instr) -> str:
        """Insert what turns ``var`` into placements ``want``; returns the new value's name.
        The steps are the planner's (``redistribute.redistribution``); each (mesh dim,
        placement) change of a value is made once and reused until the value is written in
        place."""
        t = self.types[var]
        cur = list(t.placements)
        moves = redistribution(t, want, self.plan.sizes, self.plan.dims)
        if moves is None:
            raise PlanError(
                f"{user.op} needs %{var} ({list(t.shape or ())}) laid out as "
                f"{self._layout(want)}, but the mesh dims sharding one of its tensor dims do "
                f"not divide it evenly (it is {self._layout(cur)}, mesh {dict(self.plan.mesh)})",
                user.loc,
            )
        name = var
        for m, target in moves:
            key = (self.canon.get(name, name), m, target)
            if key in self.cache:
                name = self.cache[key]
                cur[m] = target
                continue
            before = tuple(cur)
            for step_op, kwargs, after in steps(cur[m], target, self.plan.dims[m]):
                cur[m] = after
                tt = t._replace(placements=tuple(cur))
                out = self.fresh(step_op)
                reason = f"{self._layout(before)} -> {self._layout(cur)} of %{var} for {user.op}"
                stream = "main"
                self.body.append(
                    Instr(
                        (out,),
                        step_op,
                        (Var(name),),
                        kwargs,
                        (tt,),
                        stream,
                        user.on,
                        user.loc,
                        reason,
                    )
                )
                self.types[out] = tt
                self.copy_of[out] = self.copy_of.get(name, self.root.get(name, name))
                name = out
            self.cache[key] = name
        return name


def _rename_uses(value: Any, names: Any) -> Any:
    """``value`` with its Vars, in ``Instr.uses()`` order, named by the next of ``names``."""
    if isinstance(value, Var):
        return Var(next(names))
    if isinstance(value, (list, tuple)):
        return type(value)(_rename_uses(v, names) for v in value)
    return value
