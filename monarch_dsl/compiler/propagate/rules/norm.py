"""Normalization: ``native_layer_norm`` and its backward."""

from __future__ import annotations

from monarch_dsl.compiler.plan import Instr, Partial, Placement, Shard
from monarch_dsl.compiler.propagate.registry import (
    Ctx,
    R,
    Strategy,
    divisible,
    first_input_as_is,
    rule,
    valid,
)


@rule("aten.native_layer_norm", "aten.native_layer_norm_backward")
def rule_layer_norm(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    """native_layer_norm(x, shape, w, b, eps) -> (out, mean, rstd); its backward
    (grad, x, shape, mean, rstd, w, b, mask) -> (grad_x, grad_w, grad_b). Sharding a batch dim
    (not a normalized one) keeps everything sharded, and the weight's gradients partial."""
    backward = name == "native_layer_norm_backward"
    x = c.ins[1] if backward else c.ins[0]
    nd = len(x.shape or ())
    normalized = len(ins.args[2] if backward else ins.args[1])
    k = len(c.ins)
    cands = [Strategy((R,) * k, (R,) * len(c.outs))]
    req: tuple[Placement, ...]
    for d in range(nd - normalized):
        if not divisible(x, d, c.n):
            continue
        if not backward:  # x, then weight and bias whole
            cands.append(Strategy((Shard(d),) + (R,) * (k - 1), (Shard(d),) * 3))
        else:  # grad, x, mean, rstd sharded alike; weight and bias whole
            req = (Shard(d), Shard(d), Shard(d), Shard(d)) + (R,) * (k - 4)
            cands.append(Strategy(req, (Shard(d), Partial("sum"), Partial("sum"))))
    if backward:  # linear in the incoming gradient
        req = (Partial("sum"),) + (R,) * (k - 1)
        cands.append(Strategy(req, (Partial("sum"),) * 3))
    return [s for s in first_input_as_is(cands, c) if valid(s, c)]
