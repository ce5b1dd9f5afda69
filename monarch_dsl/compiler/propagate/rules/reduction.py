"""Reductions over dims: a shard of a reduced dim gives a Partial result, of a kept dim a
shard."""

from __future__ import annotations

from monarch_dsl.compiler.plan import Instr, Partial, Shard
from monarch_dsl.compiler.propagate.registry import (
    Ctx,
    R,
    Strategy,
    aten,
    divisible,
    first_input_as_is,
    norm_dim,
    rule,
)

# The reductions, and the Partial op a shard of a reduced dim leaves.
REDUCE = {"sum": "sum", "mean": "avg", "amax": "max", "amin": "min"}


@rule(*aten(REDUCE))
def rule_reduce(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    return _reduce(ins, c, name)


@rule("prims.sum")
def rule_prims_sum(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    return _reduce(ins, c, "prims_sum")


@rule("prims.var")
def rule_prims_var(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    return [
        s for s in _reduce(ins, c, "prims_var") if not any(isinstance(p, Partial) for p in s.ins)
    ]


def _reduce(ins: Instr, c: Ctx, name: str) -> list[Strategy]:
    """``name``: the aten op's, or ``prims_<name>`` (prims reductions never keep the reduced
    dims, and ``prims.sum`` of an empty list of dims reduces none)."""
    x = c.ins[0]
    nd = len(x.shape or ())
    args = list(ins.args[1:])
    kwargs = dict(ins.kwargs)
    dims = args[0] if args else kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0 and name != "prims_sum"):
        dims = list(range(nd))
    if isinstance(dims, int):
        dims = [dims]
    dims = sorted(norm_dim(d, nd) for d in dims)
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
        if not divisible(x, d, c.n):
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
    return first_input_as_is(cands, c)
