"""The cost model: what a value weighs and what moving it between placements costs.

``propagate`` picks, for each op and mesh dim, the strategy whose input redistributions cost
the least, and the redistribution planner the cheapest sequence of steps; ``schedule`` sizes
gradient buckets with ``nbytes``. Nothing here depends on the passes.
"""

from __future__ import annotations

from monarch_dsl.compiler.plan import Placement, Replicate, Shard, TensorType, itemsize


def nbytes(t: TensorType) -> float:
    """The size of the whole tensor of type ``t`` in bytes (a scalar: one element)."""
    n = 1
    for s in t.shape or ():
        n *= s
    return n * itemsize(t.dtype)


def redistribute_cost(src: Placement, dst: Placement, t: TensorType, n: int) -> float:
    """Bytes each rank sends to go from ``src`` to ``dst`` on a dim of size ``n`` (whole
    tensor size G): all_gather and reduce_scatter ~G(n-1)/n, all_reduce twice that. A
    reduce-scatter is priced as an all-reduce so that a Partial result is made whole unless
    sharding it saves more later (the Megatron pattern keeps its single all-reduce)."""
    if src == dst or n == 1:
        return 0.0
    g = nbytes(t) * (n - 1) / n + 1.0  # + 1: any communication beats none at equal bytes
    if isinstance(src, Replicate):
        # A local chunk is free. Making a value Partial is free too, but it only defers a
        # reduction: priced just above one, so a whole value is preferred.
        return 0.0 if isinstance(dst, Shard) else 2 * g + 1
    if isinstance(src, Shard):
        if isinstance(dst, Shard):
            return g / n  # all_to_all
        return g  # all_gather (then a local op for Partial)
    # Partial
    return 2 * g
