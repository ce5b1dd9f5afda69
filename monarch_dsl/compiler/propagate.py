"""Pass: propagate placements through the plan and insert the communication they need.

Every op has a rule that lists its candidate strategies: for one mesh dim, the placements its
tensor inputs must have and the placements its outputs then get. For each mesh dim the pass
takes the candidate whose input redistributions cost the fewest bytes (ties: the first
listed), inserts those redistributions before the op (all_reduce, reduce_scatter,
all_gather, all_to_all, or a local chunk), and records the op's output placements. An op
without a rule runs replicated, with a warning naming the op and what gathering costs.

Redistributions of a value are reused until the value (or anything sharing its storage) is
written in place. Where several mesh dims shard one tensor dim, the leftmost mesh dim is the
outer chunk; a redistribution is ordered (gathering an inner mesh dim first where needed) so
that every step keeps that nesting, and no strategy splits a tensor dim into uneven parts.

With micro-batches, the batch is also sharded over a virtual mesh dim ``mb`` (``MB``) whose
"ranks" run one after another on the same devices, so a reduction over it is a local sum
(``pipeline.microbatch`` makes it one). A value Partial over ``mb`` and over real dims (a
weight's gradient, the loss) is reduced over ``mb`` first: the micro-batches' partial
contributions are accumulated locally, the sum stays Partial over the real dims, and it is
all-reduced once instead of once per micro-batch.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
import warnings
from typing import Any, NamedTuple

from monarch_dsl.compiler.cost import nbytes, redistribute_cost
from monarch_dsl.compiler.ops import ALIASING, base_name, written
from monarch_dsl.compiler.plan import (
    MB,
    FreshNames,
    Instr,
    Partial,
    Placement,
    Plan,
    PlanError,
    Replicate,
    Shard,
    TensorType,
    Var,
    format_placements,
    record_pass,
)

R = Replicate()


class Strategy(NamedTuple):
    """Inputs' required placements (one per tensor input, in ``Instr.uses()`` order; None:
    whatever it has) and the outputs' placements (one per out)."""

    ins: tuple[Placement | None, ...]
    outs: tuple[Placement, ...]


# ---- op families -----------------------------------------------------------------------------

POINTWISE = set(
    "add sub mul div neg pow exp log sqrt rsqrt reciprocal relu gelu tanh sigmoid erf "
    "abs sign where clamp clamp_min clamp_max maximum minimum eq ne lt le gt ge "
    "logical_not masked_fill sin cos silu square expm1 log1p lerp addcmul addcdiv fill "
    "copy clone detach alias lift_fresh_copy _to_copy threshold_backward gelu_backward "
    "native_dropout bernoulli rsub sgn floor ceil round trunc "
    "frac isnan logical_and logical_or bitwise_not type_as contiguous "
    "convert_element_type".split()
)
# Linear in a Partial(sum/avg) input: op(P) is P when the other tensor inputs are Replicate.
# (clone is not: a gradient's clone in an optimizer makes it whole, where DDP would have.)
LINEAR_UNARY = set(
    "neg detach alias lift_fresh_copy _to_copy contiguous copy convert_element_type".split()
)
LINEAR_ADD = {"add", "sub"}  # all tensor inputs Partial with the same op
LINEAR_SCALE = {"mul", "div"}  # exactly one Partial tensor input (div: the numerator)
LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}
FACTORY = {"scalar_tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "tensor"}
REDUCE = {"sum": "sum", "mean": "avg", "amax": "max", "amin": "min"}


# ---- rules -----------------------------------------------------------------------------------


class Ctx(NamedTuple):
    ins: list[TensorType]  # types of the tensor inputs, Instr.uses() order
    outs: tuple[TensorType, ...]
    n: int  # size of the mesh dim


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _divisible(t: TensorType, d: int, n: int) -> bool:
    return t.shape is not None and 0 <= d < len(t.shape) and t.shape[d] % n == 0 and t.shape[d] > 0


def rule_pointwise(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    outs = c.outs
    out = outs[0]
    ond = len(out.shape or ())
    k = len(c.ins)
    cands: list[Strategy] = []
    # Shard along an output dim: inputs that have the dim (not broadcast) are sharded too.
    shard_cands = []
    for od in range(ond):
        if not _divisible(out, od, c.n):
            continue
        req = []
        for t in c.ins:
            tnd = len(t.shape or ())
            d = od - (ond - tnd)
            if d >= 0 and t.shape[d] == out.shape[od]:
                req.append(Shard(d))
            else:
                req.append(R)
        shard_cands.append(
            Strategy(
                tuple(req), tuple(Shard(od) if o.shape and len(o.shape) == ond else R for o in outs)
            )
        )
    rep = Strategy((R,) * k, (R,) * len(outs))
    partial = []
    for op in ("sum", "avg"):
        p = Partial(op)
        if name in LINEAR_UNARY and k == 1:
            partial.append(Strategy((p,), (p,) * len(outs)))
        elif name in LINEAR_ADD and k >= 1 and _plain_scalars(ins):
            partial.append(Strategy((p,) * k, (p,)))
        elif name in LINEAR_SCALE and k >= 1:
            positions = [0] if name == "div" else range(k)
            for i in positions:
                partial.append(Strategy(tuple(p if j == i else R for j in range(k)), (p,)))
    # Ties go to the candidate that follows the first input, then to replicating.
    first = c.ins[0].placements if c.ins else None
    ordered = shard_cands + partial + [rep]
    if first is not None:
        ordered.sort(key=lambda s: 0 if s.ins and s.ins[0] == first else 1 if s is rep else 2)
    cands = ordered
    if inplace:
        # The mutated value keeps its placement: only strategies that leave it be.
        cands = [s for s in cands if s.ins[0] == first]
    return cands


def _plain_scalars(ins: Instr) -> bool:
    """add/sub of Partials stays Partial only without a scalar term (alpha scales are fine)."""
    return all(isinstance(a, Var) for a in ins.args)


def rule_like(ins: Instr, c: Ctx) -> list[Strategy]:
    cands = [Strategy((None,), (R,))]
    out = c.outs[0]
    for d in range(len(out.shape or ())):
        if _divisible(out, d, c.n):
            cands.append(Strategy((Shard(d),), (Shard(d),)))
    cands.sort(key=lambda s: 0 if s.ins[0] == c.ins[0].placements else 1)
    return [Strategy((s.ins[0],), s.outs) if s.ins[0] is not None else s for s in cands]


def rule_mm(c: Ctx, batch: bool) -> list[Strategy]:
    a, b = c.ins
    o = 1 if batch else 0
    cands = [
        Strategy((R, R), (R,)),
        Strategy((Shard(o), R), (Shard(o),)),
        Strategy((R, Shard(o + 1)), (Shard(o + 1),)),
        Strategy((Shard(o + 1), Shard(o)), (Partial("sum"),)),
    ]
    for op in ("sum", "avg"):
        cands += [
            Strategy((Partial(op), R), (Partial(op),)),
            Strategy((R, Partial(op)), (Partial(op),)),
        ]
    if batch:
        cands.append(Strategy((Shard(0), Shard(0)), (Shard(0),)))
    return [s for s in cands if _valid(s, c)]


def _valid(s: Strategy, c: Ctx) -> bool:
    for p, t in zip(s.ins, c.ins):
        if isinstance(p, Shard) and not _divisible(t, p.dim, c.n):
            return False
    for p, t in zip(s.outs, c.outs):
        if isinstance(p, Shard) and not _divisible(t, p.dim, c.n):
            return False
    return True


def rule_reduce(ins: Instr, c: Ctx, name: str) -> list[Strategy]:
    x = c.ins[0]
    nd = len(x.shape or ())
    args = list(ins.args[1:])
    kwargs = dict(ins.kwargs)
    dims = args[0] if args else kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0 and name != "prims_sum"):
        dims = list(range(nd))
    if isinstance(dims, int):
        dims = [dims]
    dims = sorted(_norm(d, nd) for d in dims)
    keepdim = (
        bool(args[1])
        if len(args) > 1 and isinstance(args[1], bool)
        else bool(kwargs.get("keepdim", False))
    )
    if name.startswith("prims"):
        keepdim = False
    op = REDUCE.get(name.removeprefix("prims_"), None)
    cands = [Strategy((R,), (R,) * len(c.outs))]
    for d in range(nd):
        if not _divisible(x, d, c.n):
            continue
        if d in dims:
            if op is not None:
                cands.append(Strategy((Shard(d),), (Partial(op),)))
        else:
            od = d if keepdim else d - sum(1 for r in dims if r < d)
            cands.append(Strategy((Shard(d),), (Shard(od),) * len(c.outs)))
    if op in ("sum", "avg"):
        for p in ("sum", "avg"):
            cands.append(Strategy((Partial(p),), (Partial(p),)))
    cands.sort(key=lambda s: 0 if s.ins[0] == x.placements else 1)
    return cands


def _view_map(src: tuple[int, ...], dst: tuple[int, ...], d: int, n: int) -> int | None:
    """The dim of ``dst`` that a shard of ``src`` along ``d`` becomes under a reshape, or None
    if the shard does not stay a contiguous block."""
    prefix = 1
    for s in src[:d]:
        prefix *= s
    if src[d] % n:
        return None
    acc = 1
    for od, s in enumerate(dst):
        if acc == prefix and s % n == 0 and s > 0:
            return od
        acc *= s
        if acc > prefix:
            return None
    return None


def rule_view(ins: Instr, c: Ctx, name: str) -> list[Strategy]:
    x = c.ins[0]
    out = c.outs[0]
    src, dst = tuple(x.shape or ()), tuple(out.shape or ())
    nd = len(src)
    cands = [Strategy((R,) + (None,) * (len(c.ins) - 1), (R,) * len(c.outs))]
    if name not in ("_softmax", "_log_softmax"):
        for op in ("sum", "avg", "max", "min"):
            pl = (Partial(op),) + (None,) * (len(c.ins) - 1)
            cands.append(Strategy(pl, (Partial(op),) * len(c.outs)))
    for d in range(nd):
        if not _divisible(x, d, c.n):
            continue
        od = _map_dim(ins, name, src, dst, d, c.n)
        if od is None:
            continue
        cands.append(Strategy((Shard(d),) + (None,) * (len(c.ins) - 1), (Shard(od),) * len(c.outs)))
    cands = [s for s in cands if _valid(s, c)]
    cands.sort(key=lambda s: 0 if s.ins[0] == x.placements else 1)
    return cands


def _map_dim(ins: Instr, name: str, src, dst, d: int, n: int) -> int | None:
    nd = len(src)
    args = ins.args
    if name in ("view", "_unsafe_view", "reshape", "flatten", "unflatten"):
        return _view_map(src, dst, d, n)
    if name in ("t", "transpose"):
        a, b = (0, 1) if name == "t" else (_norm(args[1], nd), _norm(args[2], nd))
        return b if d == a else a if d == b else d
    if name == "permute":
        perm = [_norm(p, nd) for p in args[1]]
        return perm.index(d)
    if name in ("expand", "broadcast_to"):
        od = d + len(dst) - nd
        return od if src[d] == dst[od] else None
    if name == "broadcast_in_dim":
        return list(args[2])[d]
    if name == "unsqueeze":
        u = _norm(args[1], nd + 1)
        return d if d < u else d + 1
    if name == "squeeze":
        sq = args[1] if len(args) > 1 else [i for i, s in enumerate(src) if s == 1]
        sq = [_norm(s, nd) for s in ([sq] if isinstance(sq, int) else sq) if src[_norm(s, nd)] == 1]
        return d - sum(1 for s in sq if s < d)
    if name in ("split", "split_with_sizes", "chunk"):  # (x, size(s) / chunks, dim)
        dim = _norm(args[2] if len(args) > 2 else dict(ins.kwargs).get("dim", 0), nd)
        return None if dim == d else d
    if name in ("slice", "narrow"):  # (x, dim, start, end / length)
        dim = _norm(args[1] if len(args) > 1 else dict(ins.kwargs).get("dim", 0), nd)
        return None if dim == d else d
    if name == "select":
        dim = _norm(args[1], nd)
        return None if dim == d else (d - 1 if d > dim else d)
    if name in ("_softmax", "_log_softmax"):
        dim = _norm(args[1], nd)
        return None if dim == d else d
    return None


def rule_cat(ins: Instr, c: Ctx) -> list[Strategy]:
    k = len(c.ins)
    nd = len(c.outs[0].shape or ())
    dim = _norm(ins.args[1] if len(ins.args) > 1 else dict(ins.kwargs).get("dim", 0), nd)
    cands = [Strategy((R,) * k, (R,))]
    for d in range(nd):
        if d != dim and all(_divisible(t, d, c.n) for t in c.ins):
            cands.append(Strategy((Shard(d),) * k, (Shard(d),)))
    for op in ("sum", "avg"):
        cands.append(Strategy((Partial(op),) * k, (Partial(op),)))
    cands.sort(key=lambda s: 0 if s.ins[0] == c.ins[0].placements else 1)
    return cands


def rule_nll(ins: Instr, c: Ctx, backward: bool) -> list[Strategy]:
    # forward: (input, target[, weight]) -> (loss, total_weight)
    # backward: (grad_out, input, target[, weight], total_weight) -> grad_input
    k = len(c.ins)
    reduction = ins.args[3] if not backward else ins.args[4]
    x = c.ins[1] if backward else c.ins[0]
    cands = [Strategy((R,) * k, (R,) * len(c.outs))]
    if x.shape and len(x.shape) == 2 and _divisible(x, 0, c.n):
        if not backward:
            loss = {0: Shard(0), 1: Partial("avg"), 2: Partial("sum")}[reduction]
            req = (Shard(0), Shard(0)) + (R,) * (k - 2)
            cands.append(Strategy(req, (loss, Partial("sum"))))
        else:
            g = Shard(0) if reduction == 0 else R
            req = (g, Shard(0), Shard(0)) + (R,) * (k - 3)
            cands.append(Strategy(req, (Shard(0),)))
    cands.sort(key=lambda s: 0 if s.ins[0] == c.ins[0].placements else 1)
    return cands


def rule_layer_norm(ins: Instr, c: Ctx, backward: bool) -> list[Strategy]:
    """native_layer_norm(x, shape, w, b, eps) -> (out, mean, rstd); its backward
    (grad, x, shape, mean, rstd, w, b, mask) -> (grad_x, grad_w, grad_b). Sharding a batch dim
    (not a normalized one) keeps everything sharded, and the weight's gradients partial."""
    x = c.ins[1] if backward else c.ins[0]
    nd = len(x.shape or ())
    normalized = len(ins.args[2] if backward else ins.args[1])
    k = len(c.ins)
    cands = [Strategy((R,) * k, (R,) * len(c.outs))]
    for d in range(nd - normalized):
        if not _divisible(x, d, c.n):
            continue
        if not backward:  # x, then weight and bias whole
            cands.append(Strategy((Shard(d),) + (R,) * (k - 1), (Shard(d),) * 3))
        else:  # grad, x, mean, rstd sharded alike; weight and bias whole
            req = (Shard(d), Shard(d), Shard(d), Shard(d)) + (R,) * (k - 4)
            cands.append(Strategy(req, (Shard(d), Partial("sum"), Partial("sum"))))
    if backward:  # linear in the incoming gradient
        req = (Partial("sum"),) + (R,) * (k - 1)
        cands.append(Strategy(req, (Partial("sum"),) * 3))
    cands.sort(key=lambda s: 0 if s.ins[0] == c.ins[0].placements else 1)
    return [s for s in cands if _valid(s, c)]


def rule_embedding(ins: Instr, c: Ctx, backward: bool) -> list[Strategy]:
    if not backward:  # (weight[V, D], indices) -> out[..., D]
        w, idx = c.ins
        out = c.outs[0]
        cands = [Strategy((R, R), (R,))]
        for d in range(len(idx.shape or ())):
            if _divisible(idx, d, c.n):
                cands.append(Strategy((R, Shard(d)), (Shard(d),)))
        if _divisible(w, 1, c.n):
            cands.append(Strategy((Shard(1), R), (Shard(len(out.shape) - 1),)))
    else:  # (grad[..., D], indices, num_weights, ...) -> grad_weight[V, D]
        g, idx = c.ins
        cands = [Strategy((R, R), (R,))]
        by_freq = len(ins.args) > 4 and bool(ins.args[4])  # counts must be the whole batch's
        for d in range(len(idx.shape or ())):
            if _divisible(idx, d, c.n) and not by_freq:
                cands.append(Strategy((Shard(d), Shard(d)), (Partial("sum"),)))
        if _divisible(g, len(g.shape) - 1, c.n):
            cands.append(Strategy((Shard(len(g.shape) - 1), R), (Shard(1),)))
    cands.sort(key=lambda s: 0 if s.ins[0] == c.ins[0].placements else 1)
    return [s for s in cands if _valid(s, c)]


VIEWS = set(
    "view _unsafe_view reshape t transpose permute expand broadcast_to broadcast_in_dim "
    "unsqueeze squeeze split split_with_sizes chunk slice narrow select _softmax "
    "_log_softmax".split()
)


def strategies(ins: Instr, c: Ctx) -> list[Strategy] | None:
    """Candidate strategies of ``ins`` on one mesh dim, or None if the op has no rule."""
    ns = ins.op.split(".")[0]
    name, inplace = base_name(ins.op)
    if ns == "prims":
        if name == "sum":
            return rule_reduce(ins, c, "prims_sum")
        if name == "var":
            return [
                s
                for s in rule_reduce(ins, c, "prims_var")
                if not any(p.is_partial() for p in s.ins)
            ]
        if name == "broadcast_in_dim":
            return rule_view(ins, c, name)
        if name in ("div", "mul", "add", "sub", "neg", "convert_element_type", "sqrt", "rsqrt"):
            return rule_pointwise(ins, c, name, False)
        return None
    if not c.ins:
        return [Strategy((), (R,) * len(c.outs))] if name in FACTORY else None
    if name in LIKE:
        return rule_like(ins, c)
    if name in ("mm",):
        return rule_mm(c, batch=False)
    if name == "bmm":
        return rule_mm(c, batch=True)
    if name in REDUCE:
        return rule_reduce(ins, c, name)
    if name == "cat":
        return rule_cat(ins, c)
    if name == "nll_loss_forward":
        return rule_nll(ins, c, backward=False)
    if name == "nll_loss_backward":
        return rule_nll(ins, c, backward=True)
    if name == "native_layer_norm":
        return rule_layer_norm(ins, c, backward=False)
    if name == "native_layer_norm_backward":
        return rule_layer_norm(ins, c, backward=True)
    if name == "embedding":
        return rule_embedding(ins, c, backward=False)
    if name == "embedding_dense_backward":
        return rule_embedding(ins, c, backward=True)
    if name == "_local_scalar_dense":
        return [Strategy((R,), (R,))]
    if name in VIEWS:
        return rule_view(ins, c, name)
    if name in POINTWISE:
        return rule_pointwise(ins, c, name, inplace)
    return None


# ---- the pass --------------------------------------------------------------------------------


def propagate(
    plan: Plan,
    placements: dict[str, tuple[Placement, ...]],
    out_placements: dict[str, tuple[Placement, ...]] | None = None,
    pipeline_dim: str | None = None,
    gather: dict[str, str] | None = None,
) -> Plan:
    """Placements for every value, starting from ``placements`` of the inputs (by input name;
    missing: Replicate on every dim), with the communication they need inserted. The
    function's results get ``out_placements`` (by output name; default Replicate); a
    gradient kept after the step is its reduced version when the step made one.

    ``gather``: {input: mesh dim} of parameters kept sharded over that dim between steps
    (``md.fully_shard``): the forward and backward passes use them whole -- gathered at their
    first use, once, whatever the cost model would prefer -- so the batch stays sharded and
    their gradients are reduce-scattered back to their layout for the update."""
    t0 = time.perf_counter()
    sizes = plan.sizes
    types: dict[str, TensorType] = {}
    inputs = []
    for i in plan.inputs:
        pl = placements.get(i.name, (R,) * len(sizes))
        t = i.type._replace(placements=tuple(pl))
        _check_input(i.name, t, plan)
        types[i.name] = t
        inputs.append(i._replace(type=t))
    st = _State(plan, types)
    st.gather = {n: plan.dims.index(d) for n, d in (gather or {}).items()}
    st.phase = (plan.notes or {}).get("phase", {}) if isinstance(plan.notes, dict) else {}
    if pipeline_dim in plan.dims:  # stages, not data: everything is whole along it
        st.flat_dims.add(plan.dims.index(pipeline_dim))
    for ins in plan.body:
        st.step(ins)
    outputs = []
    for o in plan.outputs:
        var = o.var
        t = st.types[var]
        if o.kind == "out" and t.shape is not None:
            want = (out_placements or {}).get(o.name, (R,) * len(plan.sizes))
            if tuple(want) != t.placements:
                var = st.redistribute(
                    var,
                    tuple(want),
                    Instr((), f"the result {o.name}", (), (), (), loc=st.loc_of.get(var, "")),
                )
        elif o.kind == "state" and t.shape is not None and o.name.rpartition(".")[0] in st.gather:
            # Optimizer state made in the step (SGD's momentum buffer, cloned from a gradient
            # the cost model kept whole) of a fully sharded parameter: kept sharded like it.
            param = types[o.name.rpartition(".")[0]]
            if param.shape == t.shape and param.placements != t.placements:
                var = st.redistribute(
                    var,
                    param.placements,
                    Instr(
                        (), f"the sharded state {o.name}", (), (), (), loc=st.loc_of.get(var, "")
                    ),
                )
        elif o.kind == "grad" and t.shape is not None:
            # Laid out like its parameter (DDP's grads are whole and averaged): usually the
            # optimizer already made it so, and this costs nothing.
            param = types.get(o.name.removesuffix(".grad"))
            want = param.placements if param is not None else (R,) * len(plan.sizes)
            if tuple(want) != t.placements:
                var = st.redistribute(
                    var,
                    tuple(want),
                    Instr((), f"the gradient {o.name}", (), (), (), loc=st.loc_of.get(var, "")),
                )
        outputs.append(o._replace(var=var))
    out = plan.replace(inputs=tuple(inputs), body=tuple(st.body), outputs=tuple(outputs))
    return record_pass(out, "propagate", t0)


def _check_input(name: str, t: TensorType, plan: Plan) -> None:
    product: dict[int, int] = {}  # tensor dim -> the product of the mesh dims sharding it
    for (dim, n), p in zip(plan.mesh, t.placements):
        if isinstance(p, Shard):
            nd = len(t.shape or ())
            if not 0 <= p.dim < nd:
                raise PlanError(
                    f"placement of {name!r} on {dim!r}: Shard({p.dim}) but the tensor has "
                    f"{nd} dims (shape {list(t.shape or ())})"
                )
            if t.shape[p.dim] % n:
                raise PlanError(
                    f"placement of {name!r} on {dim!r}: Shard({p.dim}) needs dim {p.dim} "
                    f"(size {t.shape[p.dim]}) divisible by the mesh dim's size {n}"
                )
            product[p.dim] = product.get(p.dim, 1) * n
            if t.shape[p.dim] % product[p.dim]:
                raise PlanError(
                    f"placement of {name!r}: dim {p.dim} (size {t.shape[p.dim]}) is sharded "
                    f"over several mesh dims, up to {dim!r}, and needs to be divisible by the "
                    f"product of their sizes ({product[p.dim]})"
                )


class _State:
    def __init__(self, plan: Plan, types: dict[str, TensorType]) -> None:
        self.plan = plan
        self.types = types
        self.body: list[Instr] = []
        self.cache: dict[tuple[str, int, Placement], str] = {}  # (value, dim, placement) -> value
        self.root: dict[str, str] = {}
        self.canon: dict[str, str] = {}
        self.loc_of: dict[str, str] = {}
        self.flat_dims: set[int] = set()  # mesh dims along which everything is Replicate
        self.names = FreshNames(set(types) | {o for i in plan.body for o in i.outs})
        self.gather: dict[str, int] = {}  # fully sharded parameters: gathered for use
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
                [t._replace(placements=t.placements[m]) for t in in_types],  # type: ignore[arg-type]
                tuple(t._replace(placements=R) for t in ins.types),  # type: ignore[arg-type]
                n,
            )
            if n == 1 or m in self.flat_dims:
                cands = [Strategy(tuple(R for _ in current), tuple(R for _ in ins.outs))]
            else:
                cands = strategies(ins, ctx)
            if cands is None:
                fallback = True
                cands = [Strategy((R,) * len(uses), (R,) * len(ins.outs))]
            best, best_cost = None, None
            for s in cands:
                if not self._fits(s, m, in_types, required, ins.types, out_pl):
                    continue  # nested shards that do not divide: infinite cost
                c = 0.0
                for t, want in zip(in_types, s.ins):
                    if want is not None:
                        c += redistribute_cost(t.placements[m], want, t, n)
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
            for i, want in enumerate(best.ins):
                if want is not None:
                    required[i][m] = want
            for j, p in enumerate(best.outs):
                out_pl[j].append(p)
        if fallback:
            gathered = sum(
                nbytes(t)
                for t, cur in zip(in_types, current)
                if any(not p.is_replicate() for p in cur)
            )
            warnings.warn(
                f"no sharding rule for {ins.op} (at {ins.loc or 'unknown'}): it runs "
                f"replicated on every rank, after gathering {gathered / 2**20:.2f} MiB of inputs",
                stacklevel=2,
            )
        # Redistribute the inputs that need it, use by use: one value used twice may be
        # wanted two ways (x * x with x Partial: one use made whole, the other kept).
        names = []
        writes = written(ins)  # the first uses: ins.uses() is in argument order
        for i, (u, t, want) in enumerate(zip(uses, in_types, required)):
            if tuple(want) == t.placements:
                names.append(u)
                continue
            if i < len(writes):
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
        # Storage roots, and what a write in place invalidates.
        if name in ALIASING and uses:
            for o in ins.outs:
                self.root[o] = self.root.get(uses[0], uses[0])
        if name in ("detach", "alias") and uses:  # the same value under another name
            self.canon[ins.outs[0]] = self.canon.get(uses[0], uses[0])
        if writes:
            roots = {self.root.get(w, w) for w in writes}
            for o in ins.outs:
                self.root[o] = self.root.get(writes[0], writes[0])
            self.cache = {
                k: v for k, v in self.cache.items() if self.root.get(k[0], k[0]) not in roots
            }
            for o in ins.outs:  # a new value: not the same as what it was written from
                self.canon.pop(o, None)

    def _gathered(self, ins: Instr) -> Instr:
        """``ins`` reading the whole of each fully sharded parameter it uses (forward and
        backward only: the optimizer updates each rank's shard)."""
        if ins.outs and self.phase.get(ins.outs[0], "forward") == "update":
            return ins
        uses = ins.uses()
        if not any(u in self.gather for u in uses):
            return ins
        writes = set(written(ins))
        names = []
        for u in uses:
            m = self.gather.get(u)
            pl = self.types[u].placements
            if m is None or u in writes or pl[m].is_replicate():
                names.append(u)
                continue
            want = tuple(R if k == m else p for k, p in enumerate(pl))
            names.append(self.redistribute(u, want, ins))
        it = iter(names)
        return dataclasses.replace(
            ins,
            args=_rename_uses(ins.args, it),
            kwargs=tuple((k, _rename_uses(v, it)) for k, v in ins.kwargs),
        )

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
        One mesh dim at a time: reductions first, then gathers, then local chunks, in an order
        (with detours through Replicate where needed) in which every step is correct when
        several mesh dims shard the same tensor dim (see ``_moves``)."""
        t = self.types[var]
        cur = list(t.placements)
        first = self._reduced_first(cur, want)
        order = sorted(range(len(want)), key=lambda m: (_order(cur[m], want[m]), m != first))
        moves = _moves(t, tuple(cur), tuple(want), self.plan.sizes, order)
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
            for step_op, kwargs, after in _steps(cur[m], target, self.plan.dims[m]):
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
                name = out
            self.cache[key] = name
        return name

    def _reduced_first(self, cur: list[Placement], want: tuple[Placement, ...]) -> int | None:
        """The micro-batch dim, if ``cur`` is Partial over it and it is to be reduced: summing
        the micro-batches' contributions is local, and it commutes with the other reductions
        when they all are sums or means (not with a max)."""
        if MB not in self.plan.dims:
            return None
        mb = self.plan.dims.index(MB)
        reduced = [m for m, (p, w) in enumerate(zip(cur, want)) if p.is_partial() and p != w]
        if mb not in reduced or any(cur[m].op not in ("sum", "avg") for m in reduced):
            return None
        return mb


def _order(src: Placement, dst: Placement) -> int:
    if src == dst:
        return 3
    if src.is_partial():
        return 0
    if src.is_shard():
        return 1
    return 2


# ---- nested shards ---------------------------------------------------------------------------
#
# When several mesh dims shard one tensor dim, the mesh dims are applied left to right: the
# leftmost is the outer chunk (``lower.shard_local`` / ``interpret.local_value``, as DTensor
# does). A step on one mesh dim only sees that dim's group, so it is correct only if it
# leaves that order intact:
#   - taking mesh dim m off tensor dim a (all_gather, all_to_all's source) concatenates the
#     group's chunks: they are consecutive only if m is the innermost dim sharding a;
#   - putting m on tensor dim b (shard_local, reduce_scatter, all_to_all's target) chunks
#     the local value: m becomes the innermost dim sharding b, so no mesh dim right of m may
#     shard b already, and the local size must divide evenly.
# ``_moves`` orders the steps so that each is correct, gathering an inner dim first (and
# sharding it again afterwards) when no order of the direct steps is.


def _local_shape(
    shape: tuple[int, ...], pl: tuple[Placement, ...], sizes: tuple[int, ...], skip: int
) -> list[int]:
    """The shape each rank holds under ``pl``, ignoring mesh dim ``skip``."""
    local = list(shape)
    for k, (p, n) in enumerate(zip(pl, sizes)):
        if k != skip and isinstance(p, Shard) and 0 <= p.dim < len(local):
            local[p.dim] //= n
    return local


def _nests(
    shape: tuple[int, ...] | None,
    pl: tuple[Placement, ...],
    m: int,
    dst: Placement,
    sizes: tuple[int, ...],
) -> bool:
    """Whether changing mesh dim ``m`` of a value laid out as ``pl`` to ``dst``, by a step on
    ``m``'s group alone, gives the value laid out as ``pl`` with ``dst`` on ``m``."""
    src = pl[m]
    if src == dst or sizes[m] == 1:
        return True

    def inner(d: int) -> bool:  # a mesh dim right of m already shards tensor dim d
        return any(
            isinstance(pl[k], Shard) and pl[k].dim == d and sizes[k] > 1
            for k in range(m + 1, len(pl))
        )

    if isinstance(src, Shard) and inner(src.dim):
        return False
    if isinstance(dst, Shard):
        if inner(dst.dim):
            return False
        local = _local_shape(tuple(shape or ()), pl, sizes, m)
        if not 0 <= dst.dim < len(local) or local[dst.dim] % sizes[m]:
            return False
    return True


def _moves(
    t: TensorType,
    cur: tuple[Placement, ...],
    want: tuple[Placement, ...],
    sizes: tuple[int, ...],
    order: list[int],
) -> list[tuple[int, Placement]] | None:
    """The changes ``(mesh dim, placement)``, in order, that take a value of type ``t`` from
    ``cur`` to ``want``, each correct with nested shards; None if there are none (shards
    that do not divide). The direct changes in ``order`` when they are all correct (with no
    mesh dim sharding a tensor dim another one shards, always); otherwise the cheapest
    sequence, detours through Replicate included (ties: fewest steps, then ``order``)."""
    direct = [(m, want[m]) for m in order if cur[m] != want[m]]
    pl = cur
    for m, p in direct:
        if not _nests(t.shape, pl, m, p, sizes):
            break
        pl = pl[:m] + (p,) + pl[m + 1 :]
    else:
        return direct
    if t.shape is None:
        return direct
    rank = {m: k for k, m in enumerate(order)}
    heap: list[tuple[float, int, tuple, int, tuple[Placement, ...]]] = [(0.0, 0, (), 0, cur)]
    done: set[tuple[Placement, ...]] = set()
    pushed = 0
    while heap:
        c, k, path, _, pl = heapq.heappop(heap)
        if pl in done:
            continue
        if pl == want:
            return [(m, p) for _, _, m, p in path]
        done.add(pl)
        for m in order:
            targets = [want[m]]
            if isinstance(pl[m], Shard) and not want[m].is_replicate():
                targets.append(R)  # out of the way of another mesh dim's step
            for p in targets:
                if p == pl[m] or not _nests(t.shape, pl, m, p, sizes):
                    continue
                local = t._replace(shape=tuple(_local_shape(tuple(t.shape), pl, sizes, m)))
                nxt = pl[:m] + (p,) + pl[m + 1 :]
                if nxt in done:
                    continue
                pushed += 1
                step = (rank[m], p != want[m], m, p)  # (compared by the first two only)
                c2 = c + redistribute_cost(pl[m], p, local, sizes[m])
                heapq.heappush(heap, (c2, k + 1, path + (step,), pushed, nxt))
    return None


def _steps(src: Placement, dst: Placement, dim: str) -> list[tuple[str, tuple, Placement]]:
    """The instructions (op, kwargs, resulting placement) from ``src`` to ``dst`` on ``dim``."""
    dims = ("dims", (dim,))
    if isinstance(src, Partial):
        if isinstance(dst, Shard) and src.op in ("sum", "avg"):
            return [("reduce_scatter", (dims, ("op", src.op), ("dim", dst.dim)), dst)]
        first = ("all_reduce", (dims, ("op", src.op)), R)
        return [first] + ([] if dst == R else _steps(R, dst, dim))
    if isinstance(src, Shard):
        if isinstance(dst, Shard):
            return [("all_to_all", (dims, ("split_dim", dst.dim), ("cat_dim", src.dim)), dst)]
        first = ("all_gather", (dims, ("dim", src.dim)), R)
        return [first] + ([] if dst == R else _steps(R, dst, dim))
    # Replicate
    if isinstance(dst, Shard):
        return [("shard_local", (dims, ("dim", dst.dim)), dst)]
    return [("partial_local", (dims, ("op", dst.op)), dst)]


def _rename_uses(value: Any, names: Any) -> Any:
    """``value`` with its Vars, in ``Instr.uses()`` order, named by the next of ``names``."""
    if isinstance(value, Var):
        return Var(next(names))
    if isinstance(value, (list, tuple)):
        return type(value)(_rename_uses(v, names) for v in value)
    return value
