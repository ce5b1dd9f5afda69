"""The redistribution planner: which steps take a value from one layout to another.

``redistribution`` orders the changes, one mesh dim at a time: reductions first, then
gathers, then local chunks (and, where several mesh dims shard one tensor dim, an order, with
detours through Replicate where needed, in which every step keeps the shards nested: see
below); ``steps`` gives the instructions that make one change (all_reduce, reduce_scatter,
all_gather, all_to_all, or a local chunk). Inserting them is the pass's
(``propagate.state``).
"""

from __future__ import annotations

import heapq
from typing import Any, TypeAlias

from monarch_dsl.compiler.cost import redistribute_cost
from monarch_dsl.compiler.plan import MB, Partial, Placement, Replicate, Shard, TensorType

R = Replicate()

# One instruction of a redistribution: (op, kwargs, the placement it makes).
RedistStep: TypeAlias = tuple[str, tuple[tuple[str, Any], ...], Placement]


def redistribution(
    t: TensorType, want: tuple[Placement, ...], sizes: tuple[int, ...], dims: tuple[str, ...]
) -> list[tuple[int, Placement]] | None:
    """The changes ``(mesh dim, placement)``, in order, that lay out a value of type ``t``
    (laid out as ``t.placements``) as ``want`` on a mesh of ``dims`` with ``sizes``; None if
    the mesh dims sharding one of its tensor dims do not divide it evenly."""
    cur = tuple(t.placements)
    first = _reduced_first(cur, want, dims)
    order = sorted(range(len(want)), key=lambda m: (_order(cur[m], want[m]), m != first))
    return _moves(t, cur, tuple(want), sizes, order)


def _reduced_first(
    cur: tuple[Placement, ...], want: tuple[Placement, ...], dims: tuple[str, ...]
) -> int | None:
    """The micro-batch dim, if ``cur`` is Partial over it and it is to be reduced: summing
    the micro-batches' contributions is local, and it commutes with the other reductions
    when they all are sums or means (not with a max)."""
    if MB not in dims:
        return None
    mb = dims.index(MB)
    reduced = {
        m: p.op for m, (p, w) in enumerate(zip(cur, want)) if isinstance(p, Partial) and p != w
    }
    if mb not in reduced or any(op not in ("sum", "avg") for op in reduced.values()):
        return None
    return mb


def _order(src: Placement, dst: Placement) -> int:
    if src == dst:
        return 3
    if src.is_partial():
        return 0
    if src.is_shard():
        return 1
    return 2


# ---- nested shards ---------------------------------------------------------------------------
#
# When several mesh dims shard one tensor dim, the mesh dims are applied left to right: the
# leftmost is the outer chunk (``lower.shard_local`` / ``interpret.local_value``, as DTensor
# does). A step on one mesh dim only sees that dim's group, so it is correct only if it
# leaves that order intact:
#   - taking mesh dim m off tensor dim a (all_gather, all_to_all's source) concatenates the
#     group's chunks: they are consecutive only if m is the innermost dim sharding a;
#   - putting m on tensor dim b (shard_local, reduce_scatter, all_to_all's target) chunks
#     the local value: m becomes the innermost dim sharding b, so no mesh dim right of m may
#     shard b already, and the local size must divide evenly.
# ``_moves`` orders the steps so that each is correct, gathering an inner dim first (and
# sharding it again afterwards) when no order of the direct steps is.


def _local_shape(
    shape: tuple[int, ...], pl: tuple[Placement, ...], sizes: tuple[int, ...], skip: int
) -> list[int]:
    """The shape each rank holds under ``pl``, ignoring mesh dim ``skip``."""
    local = list(shape)
    for k, (p, n) in enumerate(zip(pl, sizes)):
        if k != skip and isinstance(p, Shard) and 0 <= p.dim < len(local):
            local[p.dim] //= n
    return local


def _nests(
    shape: tuple[int, ...] | None,
    pl: tuple[Placement, ...],
    m: int,
    dst: Placement,
    sizes: tuple[int, ...],
) -> bool:
    """Whether changing mesh dim ``m`` of a value laid out as ``pl`` to ``dst``, by a step on
    ``m``'s group alone, gives the value laid out as ``pl`` with ``dst`` on ``m``."""
    src = pl[m]
    if src == dst or sizes[m] == 1:
        return True

    def inner(d: int) -> bool:  # a mesh dim right of m already shards tensor dim d
        return any(
            isinstance(p, Shard) and p.dim == d and sizes[k] > 1
            for k, p in enumerate(pl[m + 1 :], m + 1)
        )

    if isinstance(src, Shard) and inner(src.dim):
        return False
    if isinstance(dst, Shard):
        if inner(dst.dim):
            return False
        local = _local_shape(tuple(shape or ()), pl, sizes, m)
        if not 0 <= dst.dim < len(local) or local[dst.dim] % sizes[m]:
            return False
    return True


def _moves(
    t: TensorType,
    cur: tuple[Placement, ...],
    want: tuple[Placement, ...],
    sizes: tuple[int, ...],
    order: list[int],
) -> list[tuple[int, Placement]] | None:
    """The changes ``(mesh dim, placement)``, in order, that take a value of type ``t`` from
    ``cur`` to ``want``, each correct with nested shards; None if there are none (shards
    that do not divide). The direct changes in ``order`` when they are all correct (with no
    mesh dim sharding a tensor dim another one shards, always); otherwise the cheapest
    sequence, detours through Replicate included (ties: fewest steps, then ``order``)."""
    direct = [(m, want[m]) for m in order if cur[m] != want[m]]
    pl = cur
    for m, p in direct:
        if not _nests(t.shape, pl, m, p, sizes):
            break
        pl = pl[:m] + (p,) + pl[m + 1 :]
    else:
        return direct
    if t.shape is None:
        return direct
    rank = {m: k for k, m in enumerate(order)}
    # (cost, steps, path: (rank in order, a detour, mesh dim, placement) per step, push count,
    # placements)
    heap: list[
        tuple[float, int, tuple[tuple[int, bool, int, Placement], ...], int, tuple[Placement, ...]]
    ] = [(0.0, 0, (), 0, cur)]
    done: set[tuple[Placement, ...]] = set()
    pushed = 0
    while heap:
        c, k, path, _, pl = heapq.heappop(heap)
        if pl in done:
            continue
        if pl == want:
            return [(m, p) for _, _, m, p in path]
        done.add(pl)
        for m in order:
            targets = [want[m]]
            if isinstance(pl[m], Shard) and not want[m].is_replicate():
                targets.append(R)  # out of the way of another mesh dim's step
            for p in targets:
                if p == pl[m] or not _nests(t.shape, pl, m, p, sizes):
                    continue
                local = t._replace(shape=tuple(_local_shape(tuple(t.shape), pl, sizes, m)))
                nxt = pl[:m] + (p,) + pl[m + 1 :]
                if nxt in done:
                    continue
                pushed += 1
                step = (rank[m], p != want[m], m, p)  # (compared by the first two only)
                c2 = c + redistribute_cost(pl[m], p, local, sizes[m])
                heapq.heappush(heap, (c2, k + 1, path + (step,), pushed, nxt))
    return None


def steps(src: Placement, dst: Placement, dim: str) -> list[RedistStep]:
    """The instructions (op, kwargs, resulting placement) from ``src`` to ``dst`` on the mesh
    dim named ``dim``."""
    dims = ("dims", (dim,))
    if isinstance(src, Partial):
        if isinstance(dst, Shard) and src.op in ("sum", "avg"):
            return [("reduce_scatter", (dims, ("op", src.op), ("dim", dst.dim)), dst)]
        first: RedistStep = ("all_reduce", (dims, ("op", src.op)), R)
        return [first] + ([] if dst == R else steps(R, dst, dim))
    if isinstance(src, Shard):
        if isinstance(dst, Shard):
            return [("all_to_all", (dims, ("split_dim", dst.dim), ("cat_dim", src.dim)), dst)]
        first = ("all_gather", (dims, ("dim", src.dim)), R)
        return [first] + ([] if dst == R else steps(R, dst, dim))
    # Replicate
    if isinstance(dst, Shard):
        return [("shard_local", (dims, ("dim", dst.dim)), dst)]
    assert isinstance(dst, Partial)  # (a change: not Replicate again)
    return [("partial_local", (dims, ("op", dst.op)), dst)]
