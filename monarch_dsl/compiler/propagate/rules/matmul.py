"""Matrix products: ``mm`` and the batched ``bmm`` (what ``linear`` decomposes to)."""

from __future__ import annotations

from monarch_dsl.compiler.plan import Instr, Partial, Shard
from monarch_dsl.compiler.propagate.registry import Ctx, R, Strategy, rule, valid


@rule("aten.mm", "aten.bmm")
def rule_mm(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    """Row or column parallel, or the contracted dim sharded (a Partial sum); ``bmm`` also
    sharded along the batch."""
    batch = name == "bmm"
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
    return [s for s in cands if valid(s, c)]
