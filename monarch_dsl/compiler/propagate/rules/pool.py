"""Pooling, upsampling and pixel shuffles of ``(N, C, *spatial)`` tensors: each sample's
channels are worked on alone, so a shard of the batch (or, but for the shuffles, of the
channels) passes through, forward and backward; the average pools' and the upsamplings'
backward ops are linear in the incoming gradient, so a Partial one passes too."""

from __future__ import annotations

from monarch_dsl.compiler.ops import UPSAMPLES
from monarch_dsl.compiler.plan import Instr, Partial, Placement, Shard
from monarch_dsl.compiler.propagate.registry import (
    Ctx,
    R,
    Strategy,
    first_input_as_is,
    rule,
    valid,
)

_SPATIAL = {"1d": 1, "2d": 2, "3d": 3}
_POOLS = [
    f"{kind}{n}d{suffix}"
    for kind in ("max_pool", "avg_pool", "_adaptive_avg_pool", "adaptive_max_pool")
    for n in (1, 2, 3)
    for suffix in ("", "_with_indices", "_backward", "_with_indices_backward")
]
_UPSAMPLES = [f"{op}{suffix}" for op in UPSAMPLES for suffix in ("", "_backward")]
_SHUFFLES = ["pixel_shuffle", "pixel_unshuffle", "channel_shuffle"]
# linear in the incoming gradient (the max pools' backward too, but its indices are per rank)
_LINEAR = ("avg_pool", "upsample_", "_upsample_")


@rule(*(f"aten.{n}" for n in _POOLS + _UPSAMPLES + _SHUFFLES))
def rule_pool(ins: Instr, c: Ctx, name: str, inplace: bool) -> list[Strategy]:
    """Every tensor input and output, which have the same leading dims, sharded alike on the
    batch dim (or a channel dim, but for the shuffles): the inputs are the tensor, or the
    gradient and the tensor (and a max pool's indices), all of them (N, C, *spatial)."""
    spatial = next((v for k, v in _SPATIAL.items() if k in name), 2)
    shapes = [t.shape for t in c.ins] + [t.shape for t in c.outs]
    if any(s is None for s in shapes):
        return [Strategy((R,) * len(c.ins), (R,) * len(c.outs))]
    nd = min(len(s) for s in shapes if s is not None)  # (a 0-d placeholder: no shard)
    lead = max(0, nd - spatial)
    if "shuffle" in name:
        lead = min(lead, 1)
    cands = [Strategy((R,) * len(c.ins), (R,) * len(c.outs))]
    for d in range(lead):
        outs: tuple[Placement, ...] = tuple(Shard(d) for _ in c.outs)
        cands.append(Strategy(tuple(Shard(d) for _ in c.ins), outs))
    if name.endswith("_backward") and name.startswith(_LINEAR):
        for op in ("sum", "avg"):
            p = Partial(op)
            req = (p,) + (R,) * (len(c.ins) - 1)
            cands.append(Strategy(req, (p,) * len(c.outs)))
    return [s for s in first_input_as_is(cands, c) if valid(s, c)]
