"""What each collective computes, written once for every Python back end.

A collective is a generator: it prepares this rank's part, yields one *exchange* -- a request
for one of four primitives over the group -- receives that exchange's result, and returns
the collective's result. The back ends differ only in how they carry out the primitives:

- the reference executor and plan runner (``runtime/``): torch.distributed calls on the
  group (``run`` below, or started now and finished later on a stream);
- the in-process interpreter (``compiler/interpret.py``): every member's request at once,
  combined by ``combine`` below.

Primitives (``Exchange.kind``), each over the ``n`` members of a group, member ``i`` giving
``payload``:

- ``all_reduce``: a tensor, the same shape everywhere -> the elementwise reduction (``op``:
  sum max min prod) of all members';
- ``all_gather``: a tensor -> the list of all members' (in member order);
- ``reduce_scatter``: a list of ``n`` tensors -> the reduction of all members' ``i``-th;
- ``all_to_all``: a tensor whose dim 0 splits in ``n`` equal pieces -> piece ``i`` of every
  member's, concatenated along dim 0 in member order.

``avg`` is ``sum`` then a division by ``n`` (gloo and shared memory have no average).
The C++ runtime implements the same collectives in ``cpp/`` (one helper per kind).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, NamedTuple

import torch

from monarch_dsl import isa

REDUCTIONS = ("sum", "avg", "max", "min", "prod")


class Exchange(NamedTuple):
    """One primitive over the group (see the module docstring)."""

    kind: str  # all_reduce all_gather reduce_scatter all_to_all
    payload: Any
    op: str = "sum"  # reductions: sum max min prod


Collective = Generator[Exchange, Any, Any]


def _wire(op: str) -> str:
    if op not in REDUCTIONS:
        raise ValueError(f"unknown reduction {op!r} (expected one of {', '.join(REDUCTIONS)})")
    return "sum" if op == "avg" else op


def all_reduce(tensors: list[torch.Tensor], op: str, n: int, in_place: bool = False) -> Collective:
    """Each of ``tensors`` reduced over the group; several are one bucket: one flat buffer,
    the results views of it. ``in_place``: one contiguous tensor is reduced where it is."""
    wire = _wire(op)
    if len(tensors) == 1:
        t = tensors[0]
        flat = t if in_place and t.is_contiguous() else t.contiguous().clone()
    else:
        flat = torch.cat([t.reshape(-1) for t in tensors])
    flat = yield Exchange("all_reduce", flat, wire)
    if op == "avg":
        flat.div_(n)
    if len(tensors) == 1:
        return [flat]
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def all_gather(x: torch.Tensor, dim: int) -> Collective:
    """The group's values of ``x`` concatenated along ``dim``."""
    parts = yield Exchange("all_gather", x.contiguous())
    return torch.cat(parts, dim)


def stack(x: torch.Tensor) -> Collective:
    """The group's values of ``x`` stacked along a new dim 0."""
    parts = yield Exchange("all_gather", x.contiguous())
    return torch.stack(parts)


def reduce_scatter(x: torch.Tensor, op: str, dim: int, n: int) -> Collective:
    """``x`` reduced over the group; this member's ``1/n`` chunk along ``dim``."""
    chunks = [c.contiguous() for c in x.chunk(n, dim)]
    out = yield Exchange("reduce_scatter", chunks, _wire(op))
    if op == "avg":
        out.div_(n)
    return out


def all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, n: int) -> Collective:
    """``x`` split in ``n`` along ``split_dim``, piece ``j`` to member ``j``; the pieces
    received concatenated along ``cat_dim``."""
    src = x.movedim(split_dim, 0).contiguous()
    out = yield Exchange("all_to_all", src)
    pieces = [p.movedim(0, split_dim) for p in out.chunk(n, 0)]
    return torch.cat(pieces, cat_dim).contiguous()


def of_step(step: isa.Comm, args: list[torch.Tensor], n: int) -> Collective:
    """The collective of a plan's step (one of ``isa.COLLECTIVES``) on this member's values of
    its arguments, in a group of ``n``."""
    if isinstance(step, isa.AllReduce):
        return all_reduce(args, step.reduce, n)
    if isinstance(step, isa.AllGather):
        return all_gather(args[0], step.dim)
    if isinstance(step, isa.ReduceScatter):
        return reduce_scatter(args[0], step.reduce, step.dim, n)
    if isinstance(step, isa.AllToAll):
        return all_to_all(args[0], step.split_dim, step.cat_dim, n)
    raise TypeError(f"not a collective: {type(step).__name__}")


def start(collective: Collective) -> tuple[Exchange, Any]:
    """Run ``collective`` up to its exchange: (the exchange, a function of the exchange's
    result that finishes it and returns the collective's result)."""
    exchange = next(collective)

    def finish(result: Any) -> Any:
        try:
            collective.send(result)
        except StopIteration as stop:
            return stop.value
        raise RuntimeError("a collective asked for a second exchange")

    return exchange, finish


# ---- the in-process primitives --------------------------------------------------------------


def reduce_values(values: list[torch.Tensor], op: str) -> torch.Tensor:
    """The elementwise reduction ``op`` (sum avg max min prod) of same-shaped ``values``."""
    stacked = torch.stack(values)
    if op == "avg":
        return stacked.mean(0)
    if op == "sum":
        return stacked.sum(0)
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    if op == "prod":
        return stacked.prod(0)
    raise ValueError(f"unknown reduction {op!r}")


def combine(exchanges: list[Exchange]) -> list[Any]:
    """Every member's result of one exchange, from every member's request (member order)."""
    kind, op, n = exchanges[0].kind, exchanges[0].op, len(exchanges)
    payloads = [e.payload for e in exchanges]
    if kind == "all_reduce":
        r = reduce_values(payloads, op)
        return [r.clone() for _ in range(n)]
    if kind == "all_gather":
        return [[p.clone() for p in payloads] for _ in range(n)]
    if kind == "reduce_scatter":
        return [reduce_values([p[i] for p in payloads], op) for i in range(n)]
    if kind == "all_to_all":
        return [torch.cat([p.chunk(n, 0)[i] for p in payloads]) for i in range(n)]
    raise ValueError(f"unknown exchange {kind!r}")


def run_together(collectives: list[Collective]) -> list[Any]:
    """Every member's result of one collective run in this process (member order)."""
    started = [start(c) for c in collectives]
    results = combine([e for e, _ in started])
    return [finish(r) for (_, finish), r in zip(started, results, strict=True)]
