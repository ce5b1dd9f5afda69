"""Fused scaled dot-product attention (what ``F.scaled_dot_product_attention`` traces to on
CPU), forward and backward: each (batch, head) pair attends alone."""

from __future__ import annotations

from monarch_dsl.compiler.plan import Instr, Placement, Shard
from monarch_dsl.compiler.propagate.registry import (
    Ctx,
    R,
    Strategy,
    first_input_as_is,
    rule,
    valid,
)


@rule(
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward",
)
def rule_sdpa(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    """query, key, value ``(B, H, L, E)`` (and, backward, the gradient and the output, and the
    ``(B, H, L)`` log-sum-exp) sharded alike on the batch or the head dim give outputs sharded
    so; an attention mask is sharded too where it has that dim, else whole (broadcast)."""
    k = len(c.ins)
    main = 6 if name.endswith("_backward") else 3  # the tensors before an optional mask
    cands = [Strategy((R,) * k, (R,) * len(c.outs))]
    q = c.ins[1] if main == 6 else c.ins[0]
    if q.shape is None or len(q.shape) != 4:
        return cands
    for d in (0, 1):
        req: list[Placement] = [Shard(d)] * min(k, main)
        for mask in c.ins[main:]:
            shape = mask.shape or ()
            at = d - (4 - len(shape))  # (the mask broadcasts from the right)
            req.append(Shard(at) if at >= 0 and shape[at] == q.shape[d] else R)
        cands.append(Strategy(tuple(req), tuple(Shard(d) for _ in c.outs)))
    return [s for s in first_input_as_is(cands, c) if valid(s, c)]
