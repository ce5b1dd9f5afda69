"""Views and other shape ops (and softmax, which keeps the shape): a shard follows its dim to
where the op puts it, unless the op splits, slices or mixes that dim."""

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
    valid,
)

VIEWS = set(
    "view _unsafe_view reshape t transpose permute expand broadcast_to broadcast_in_dim "
    "unsqueeze squeeze split split_with_sizes chunk slice narrow select unbind _softmax "
    "_log_softmax".split()
)


@rule(*aten(VIEWS), "prims.broadcast_in_dim")
def rule_view(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
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
        if not divisible(x, d, c.n):
            continue
        od = _map_dim(ins, name, src, dst, d, c.n)
        if od is None:
            continue
        cands.append(Strategy((Shard(d),) + (None,) * (len(c.ins) - 1), (Shard(od),) * len(c.outs)))
    cands = [s for s in cands if valid(s, c)]
    return first_input_as_is(cands, c)


# Views whose dims do not map one to one (a diagonal, sliding windows): a sharded input is
# made whole, a partial one stays partial (a view of each rank's part is that rank's part of
# the view). Without a rule they ran on a whole copy, and a write through them was refused.
WHOLE_VIEWS = {"diagonal", "unfold"}


@rule(*aten(WHOLE_VIEWS))
def rule_view_whole(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    rest = (None,) * (len(c.ins) - 1)
    cands = [Strategy((R, *rest), (R,) * len(c.outs))]
    for op in ("sum", "avg", "max", "min"):
        cands.append(Strategy((Partial(op), *rest), (Partial(op),) * len(c.outs)))
    return first_input_as_is([s for s in cands if valid(s, c)], c)


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


def _map_dim(
    ins: Instr, name: str, src: tuple[int, ...], dst: tuple[int, ...], d: int, n: int
) -> int | None:
    """The output dim that input dim ``d``'s shard becomes, or None if it cannot stay one."""
    nd = len(src)
    args = ins.args
    if name in ("view", "_unsafe_view", "reshape", "flatten", "unflatten"):
        return _view_map(src, dst, d, n)
    if name in ("t", "transpose"):
        a, b = (0, 1) if name == "t" else (norm_dim(args[1], nd), norm_dim(args[2], nd))
        return b if d == a else a if d == b else d
    if name == "permute":
        perm = [norm_dim(p, nd) for p in args[1]]
        return perm.index(d)
    if name in ("expand", "broadcast_to"):
        od = d + len(dst) - nd
        return od if src[d] == dst[od] else None
    if name == "broadcast_in_dim":
        broadcast_dims: list[int] = list(args[2])
        return broadcast_dims[d]
    if name == "unsqueeze":
        u = norm_dim(args[1], nd + 1)
        return d if d < u else d + 1
    if name == "squeeze":
        sq = args[1] if len(args) > 1 else [i for i, s in enumerate(src) if s == 1]
        sq = [norm_dim(s, nd) for s in ([sq] if isinstance(sq, int) else sq)]
        sq = [s for s in sq if src[s] == 1]
        return d - sum(1 for s in sq if s < d)
    if name in ("split", "split_with_sizes", "chunk"):  # (x, size(s) / chunks, dim)
        dim = norm_dim(args[2] if len(args) > 2 else dict(ins.kwargs).get("dim", 0), nd)
        return None if dim == d else d
    if name in ("slice", "narrow"):  # (x, dim, start, end / length)
        dim = norm_dim(args[1] if len(args) > 1 else dict(ins.kwargs).get("dim", 0), nd)
        return None if dim == d else d
    if name == "select":
        dim = norm_dim(args[1], nd)
        return None if dim == d else (d - 1 if d > dim else d)
    if name == "unbind":  # (x, dim): selects along dim, every one
        dim = norm_dim(args[1] if len(args) > 1 else dict(ins.kwargs).get("dim", 0), nd)
        return None if dim == d else (d - 1 if d > dim else d)
    if name in ("_softmax", "_log_softmax"):
        dim = norm_dim(args[1], nd)
        return None if dim == d else d
    return None


@rule("aten.cat", "aten.stack")
def rule_cat(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    """``cat`` along ``dim``: inputs sharded alike on another dim give that shard; ``stack``
    alike, its new dim ``dim`` of the output shifting the input dims from there on."""
    k = len(c.ins)
    nd = len(c.outs[0].shape or ())
    dim = norm_dim(ins.args[1] if len(ins.args) > 1 else dict(ins.kwargs).get("dim", 0), nd)
    cands = [Strategy((R,) * k, (R,))]
    stack = name == "stack"
    for d in range(nd - 1 if stack else nd):
        od = d + 1 if stack and d >= dim else d
        if (stack or d != dim) and all(divisible(t, d, c.n) for t in c.ins):
            cands.append(Strategy((Shard(d),) * k, (Shard(od),)))
    for op in ("sum", "avg"):
        cands.append(Strategy((Partial(op),) * k, (Partial(op),)))
    return first_input_as_is(cands, c)


@rule("aten.slice_scatter", "aten.select_scatter")
def rule_scatter_into(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    """``slice_scatter(base, src, dim, ...)`` / ``select_scatter(base, src, dim, index)``
    (slicing's and indexing's backward): ``src`` written into ``base`` along ``dim``, so a
    shard of another dim, the same in both, is the output's (``select``'s ``src`` lacks
    ``dim``: its dims from there on are one lower)."""
    nd = len(c.outs[0].shape or ())
    args = list(ins.args[2:])
    dim = norm_dim(args[0] if args else dict(ins.kwargs).get("dim", 0), nd)
    cands = [Strategy((R,) * len(c.ins), (R,))]
    if len(c.ins) != 2:
        return cands
    for d in range(nd):
        if d == dim:
            continue
        sd = d - 1 if name == "select_scatter" and d > dim else d
        cands.append(Strategy((Shard(d), Shard(sd)), (Shard(d),)))
    return [s for s in first_input_as_is(cands, c) if valid(s, c)]
