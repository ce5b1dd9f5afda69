"""Convolutions: ``convolution`` and its backward, sharded along the batch (data parallel)."""

from __future__ import annotations

from monarch_dsl.compiler.ops import convolution_flags
from monarch_dsl.compiler.plan import Instr, Partial, Placement, Shard
from monarch_dsl.compiler.propagate.registry import (
    Ctx,
    R,
    Strategy,
    first_input_as_is,
    rule,
    valid,
)


@rule("aten.convolution", "aten.convolution_backward")
def rule_convolution(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    """convolution(x, w, b?, ...) -> out; its backward (grad, x, w, ...) -> (grad_x, grad_w,
    grad_b). Each sample is convolved alone (transposed or grouped too), so a batch shard of x
    gives a batch shard of the output, and of the input's gradient, while the weight's and
    bias's gradients are sums over the samples: Partial sums of each rank's shard."""
    k = len(c.ins)
    cands = [Strategy((R,) * k, (R,) * len(c.outs))]
    req: tuple[Placement, ...]
    if name == "convolution":  # x, then the weight and the bias whole
        cands.append(Strategy((Shard(0),) + (R,) * (k - 1), (Shard(0),)))
    else:  # grad and x sharded alike, the weight whole
        # (an output the mask leaves out is a placeholder: replicated)
        _, made = convolution_flags(name, ins.args)

        def outs(*ps: Placement) -> tuple[Placement, ...]:
            return tuple(p if m else R for p, m in zip(ps, made))

        req = (Shard(0), Shard(0)) + (R,) * (k - 2)
        cands.append(Strategy(req, outs(Shard(0), Partial("sum"), Partial("sum"))))
        # linear in the incoming gradient
        req = (Partial("sum"),) + (R,) * (k - 1)
        cands.append(Strategy(req, outs(Partial("sum"), Partial("sum"), Partial("sum"))))
    return [s for s in first_input_as_is(cands, c) if valid(s, c)]
