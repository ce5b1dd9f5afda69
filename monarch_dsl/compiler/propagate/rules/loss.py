"""Losses: ``nll_loss`` (what ``cross_entropy`` decomposes to) and its backward, sharded
along the batch."""

from __future__ import annotations

from monarch_dsl.compiler.plan import Instr, Partial, Shard
from monarch_dsl.compiler.propagate.registry import (
    Ctx,
    R,
    Strategy,
    divisible,
    first_input_as_is,
    rule,
)


@rule("aten.nll_loss_forward", "aten.nll_loss_backward")
def rule_nll(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    """A sharded batch's loss is Partial (avg for a mean: ``propagate`` makes it exact)."""
    # forward: (input, target[, weight]) -> (loss, total_weight)
    # backward: (grad_out, input, target[, weight], total_weight) -> grad_input
    backward = name == "nll_loss_backward"
    k = len(c.ins)
    reduction = ins.args[3] if not backward else ins.args[4]
    x = c.ins[1] if backward else c.ins[0]
    cands = [Strategy((R,) * k, (R,) * len(c.outs))]
    if x.shape and len(x.shape) == 2 and divisible(x, 0, c.n):
        if not backward:
            loss = {0: Shard(0), 1: Partial("avg"), 2: Partial("sum")}[reduction]
            req = (Shard(0), Shard(0)) + (R,) * (k - 2)
            cands.append(Strategy(req, (loss, Partial("sum"))))
        else:
            g = Shard(0) if reduction == 0 else R
            req = (g, Shard(0), Shard(0)) + (R,) * (k - 3)
            cands.append(Strategy(req, (Shard(0),)))
    return first_input_as_is(cands, c)
