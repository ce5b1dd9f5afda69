"""Pointwise ops: sharded along any output dim (broadcast inputs whole), and Partial through
the ops that are linear in it."""

from __future__ import annotations

from monarch_dsl.compiler.plan import Instr, Partial, Placement, Shard, Var
from monarch_dsl.compiler.propagate.registry import Ctx, R, Strategy, aten, divisible, rule

POINTWISE = set(
    "add sub mul div neg pow exp log sqrt rsqrt reciprocal relu gelu tanh sigmoid erf "
    "abs sign where clamp clamp_min clamp_max maximum minimum eq ne lt le gt ge "
    "logical_not masked_fill sin cos silu square expm1 log1p lerp addcmul addcdiv fill "
    "copy clone detach alias lift_fresh_copy _to_copy threshold_backward gelu_backward "
    "native_dropout bernoulli rsub sgn floor ceil round trunc "
    "frac isnan logical_and logical_or bitwise_not type_as contiguous "
    "convert_element_type zero "
    # activations and their backward ops (grad and input of one shape), and xlogy (KLDiv)
    "mish mish_backward hardswish hardswish_backward leaky_relu leaky_relu_backward elu "
    "elu_backward softplus softplus_backward hardtanh hardtanh_backward hardsigmoid "
    "hardsigmoid_backward xlogy log_sigmoid_forward log_sigmoid_backward".split()
)
# Linear in a Partial(sum/avg) input: op(P) is P when the other tensor inputs are Replicate.
# (clone is not: a gradient's clone in an optimizer makes it whole, where DDP would have.
# zero is: zeros on every rank sum, or average, to zero -- zero_grad(set_to_none=False) on a
# gradient that is still a per-rank partial, after the update, writes it where it is.)
LINEAR_UNARY = set(
    "neg detach alias lift_fresh_copy _to_copy contiguous copy convert_element_type zero".split()
)
LINEAR_ADD = {"add", "sub"}  # all tensor inputs Partial with the same op
LINEAR_SCALE = {"mul", "div"}  # exactly one Partial tensor input (div: the numerator)
PRIMS_POINTWISE = ("div", "mul", "add", "sub", "neg", "convert_element_type", "sqrt", "rsqrt")


@rule(*aten(POINTWISE), *(f"prims.{n}" for n in PRIMS_POINTWISE))
def rule_pointwise(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    outs = c.outs
    out = outs[0]
    out_shape = out.shape or ()
    ond = len(out_shape)
    k = len(c.ins)
    cands: list[Strategy] = []
    # Shard along an output dim: inputs that have the dim (not broadcast) are sharded too.
    shard_cands = []
    for od in range(ond):
        if not divisible(out, od, c.n):
            continue
        req: list[Placement] = []
        for t in c.ins:
            shape = t.shape or ()
            d = od - (ond - len(shape))
            if d >= 0 and shape[d] == out_shape[od]:
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
    first = c.ins[0].placement if c.ins else None
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
