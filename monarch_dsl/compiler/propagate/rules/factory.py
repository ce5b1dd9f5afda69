"""Tensors made from nothing (factories), from another's shape (``*_like``), and a scalar
read out of one."""

from __future__ import annotations

from monarch_dsl.compiler.plan import Instr, Shard
from monarch_dsl.compiler.propagate.registry import (
    Ctx,
    R,
    Strategy,
    aten,
    divisible,
    first_input_as_is,
    rule,
)

FACTORY = {"scalar_tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "tensor"}
LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}


@rule(*aten(FACTORY), factory=True)
def rule_factory(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    return [Strategy((), (R,) * len(c.outs))]


@rule(*aten(LIKE))
def rule_like(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    cands = [Strategy((None,), (R,))]
    out = c.outs[0]
    for d in range(len(out.shape or ())):
        if divisible(out, d, c.n):
            cands.append(Strategy((Shard(d),), (Shard(d),)))
    cands = first_input_as_is(cands, c)
    return [Strategy((s.ins[0],), s.outs) if s.ins[0] is not None else s for s in cands]


@rule("aten.new_zeros", "aten.new_ones", "aten.new_empty", "aten.new_full")
def rule_new(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    """``x.new_zeros(size)``: a tensor of its own shape, one value throughout, whatever ``x``
    is (it gives only its dtype and device): made whole on every rank, ``x`` as it is, no
    communication (slicing's backward then scatters each rank's part into its zeros)."""
    return [Strategy((None,), (R,))]


@rule("aten._local_scalar_dense")
def rule_local_scalar(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    return [Strategy((R,), (R,))]
