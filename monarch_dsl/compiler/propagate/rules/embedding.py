"""Embedding lookups (indexing a table by a tensor of indices) and their backward."""

from __future__ import annotations

from monarch_dsl.compiler.plan import Instr, Partial, Shard
from monarch_dsl.compiler.propagate.registry import (
    Ctx,
    R,
    Strategy,
    divisible,
    first_input_as_is,
    rule,
    valid,
)


@rule("aten.embedding", "aten.embedding_dense_backward")
def rule_embedding(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    """Sharded along the indices (the backward's gradient then Partial), or the table along
    its embedding dim."""
    if name == "embedding":  # (weight[V, D], indices) -> out[..., D]
        w, idx = c.ins
        out = c.outs[0]
        cands = [Strategy((R, R), (R,))]
        for d in range(len(idx.shape or ())):
            if divisible(idx, d, c.n):
                cands.append(Strategy((R, Shard(d)), (Shard(d),)))
        if divisible(w, 1, c.n):
            assert out.shape is not None  # (an embedding is a tensor)
            cands.append(Strategy((Shard(1), R), (Shard(len(out.shape) - 1),)))
    else:  # (grad[..., D], indices, num_weights, ...) -> grad_weight[V, D]
        g, idx = c.ins
        cands = [Strategy((R, R), (R,))]
        by_freq = len(ins.args) > 4 and bool(ins.args[4])  # counts must be the whole batch's
        for d in range(len(idx.shape or ())):
            if divisible(idx, d, c.n) and not by_freq:
                cands.append(Strategy((Shard(d), Shard(d)), (Partial("sum"),)))
        assert g.shape is not None  # (a gradient is a tensor)
        if divisible(g, len(g.shape) - 1, c.n):
            cands.append(Strategy((Shard(len(g.shape) - 1), R), (Shard(1),)))
    return [s for s in first_input_as_is(cands, c) if valid(s, c)]
