"""Pass: gradient all-reduces in buckets on the communication stream.

Every ``all_reduce`` on the main stream whose input is ready well before it is needed (a
gradient, made whole for the optimizer) is a candidate. Taken in the order their inputs
become ready (the backward pass produces the last layer's gradients first), they are
grouped into buckets of at most ``bucket_cap_mb`` (like DDP's), and each bucket becomes one
multi-tensor ``all_reduce`` on the ``comms`` stream, placed right after its last gradient is
computed — so it runs while the rest of the backward pass does. The first use of each result
waits for it (a cross-stream use; the runtime waits on the collective's handle). Its reason
names, like the reasons ``propagate`` gives, the placement change and the ops that read the
results: ``gradient bucket 1/2 (2 tensors, 0.01 MiB): {dp: P(sum)} -> {dp: R} for
aten.lerp_.Scalar, aten.addcmul_.default: %g1, %g2 made whole for the optimizer update``.

A result's all-reduce (the loss the step returns, an average over ``dp``: nothing in the step
reads it) rides in the last bucket of its ranks, group and dtype that goes out after its value
is ready: summed there with the gradients, and divided by the group's size where it was. One
collective per step fewer (on shared memory a sync point of the ranks; on NCCL a launch).

Buckets are formed per group of ranks that issue the reduction: in a pipeline, each stage's
ranks bucket their own stage's gradients (``on pp=i``; a data-parallel group lies within one
stage, so every rank of it issues the same buckets). With micro-batches a gradient's partial
sums are first accumulated over the micro-batches (``propagate``, ``pipeline.microbatch``):
its one all-reduce is ready when its last micro-batch's backward is.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from monarch_dsl.compiler.cost import nbytes
from monarch_dsl.compiler.ops import ALIASING, base_name, written
from monarch_dsl.compiler.plan import (
    FreshNames,
    Instr,
    Plan,
    TensorType,
    Var,
    format_placements,
    record_pass,
)


def schedule(plan: Plan, bucket_cap_mb: float = 25) -> Plan:
    t0 = time.perf_counter()
    body = list(plan.body)
    defined_at: dict[str, int] = {i.name: -1 for i in plan.inputs}
    first_use: dict[str, int] = {}
    readers: dict[str, dict[str, None]] = {}  # value -> the ops that read it, in order
    root: dict[str, str] = {}
    for k, ins in enumerate(body):
        uses = ins.uses()
        for u in uses:
            first_use.setdefault(u, k)
            readers.setdefault(u, {})[ins.op] = None
        for o in ins.outs:
            defined_at[o] = k
        name, inplace = base_name(ins.op) if "." in ins.op else (ins.op, False)
        if uses and (name in ALIASING or inplace):
            for o in ins.outs:
                root[o] = root.get(uses[0], uses[0])
    writes: dict[str, list[int]] = {}
    for k, ins in enumerate(body):
        for w in written(ins):
            writes.setdefault(root.get(w, w), []).append(k)

    candidates: list[tuple[int, int]] = []  # (ready, index)
    results: list[tuple[int, int]] = []  # (ready, index): all-reduces of results only
    scatters: list[
        tuple[int, int]
    ] = []  # reduce-scatters of gradients (fully sharded parameters): moved one by one
    sources: dict[int, str] = {}
    for k, ins in enumerate(body):
        if ins.op not in ("all_reduce", "reduce_scatter") or ins.stream != "main":
            continue
        if len(ins.outs) != 1:
            continue
        src = ins.uses()[0]
        # detach/alias only rename a value: reduce the one they come from, as soon as it is
        # ready (the backward pass made it; the optimizer's detach comes much later).
        while defined_at.get(src, -1) >= 0:
            producer = body[defined_at[src]]
            if producer.op not in _RENAMES or len(producer.outs) != 1:
                break
            src = producer.uses()[0]
        ready = defined_at[src]
        if ins.outs[0] not in first_use:  # a result of the step only: nothing waits for it
            if ins.op == "all_reduce" and ins.kw("op") in ("sum", "avg"):
                results.append((ready, k))  # (it may ride in a gradient bucket: below)
                sources[k] = src
            continue
        r = root.get(src, src)
        # Not movable above a write into the same storage.
        if any(ready < w < k for w in writes.get(r, [])):
            continue
        if ins.op == "reduce_scatter":
            if k - ready >= 2:  # a gradient, ready well before the update needs it
                scatters.append((ready, k))
                sources[k] = src
            continue
        candidates.append((ready, k))
        sources[k] = src

    # Per group of ranks and kind of reduction (``_key``), in the order the gradients are ready.
    groups: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    for ready, k in sorted(candidates):
        groups.setdefault(_key(body[k]), []).append((ready, k))
    cap = bucket_cap_mb * 2**20
    buckets = [b for group in groups.values() for b in _buckets(group, body, first_use, cap)]
    # One all-reduce alone, needed right after its input is ready, has nothing to overlap with
    # (in a bucket with others it still saves a collective).
    buckets = [b for b in buckets if len(b) > 1 or b[0][1] - b[0][0] >= 2]
    buckets.sort(key=lambda b: b[-1])  # in the order they go out

    moved = {k for b in buckets for _, k in b} | {k for _, k in scatters}
    types = plan.types()
    insert_after: dict[int, list[Instr]] = {}
    riders = _riders(results, buckets, body, sources, root, writes)
    if riders:  # (names for the sums of averages that ride)
        names = FreshNames([i.name for i in plan.inputs] + [o for ins in body for o in ins.outs])
    moved |= {k for ks in riders.values() for k in ks}
    for ready, k in scatters:
        ins = body[k]
        args = (Var(sources[k]), *ins.args[1:])  # the gradient itself (not its later detach)
        why = ins.reason.replace(f"of %{ins.uses()[0]} ", f"of %{sources[k]} ", 1)
        reason = f"sharded gradient, as soon as it is ready: {why}"
        insert_after.setdefault(ready, []).append(
            dataclasses.replace(ins, args=args, stream="comms", reason=reason)
        )
    insert_before, prefetched = _prefetch(body, plan, first_use)
    moved |= prefetched
    for bi, bucket in enumerate(buckets):
        members = [body[k] for _, k in bucket]
        first = members[0]
        srcs = [sources[k] for _, k in bucket]
        mib = sum(nbytes(m.types[0]) for m in members) / 2**20
        reason = (
            f"gradient bucket {bi + 1}/{len(buckets)} ({len(members)} tensors, {mib:.2f} MiB): "
            f"{_why(members, srcs, readers, types, plan.dims)} made whole for the optimizer update"
        )
        b_outs = [o for m in members for o in m.outs]
        b_args = [Var(s) for s in srcs]
        member_types = [m.types[0] for m in members]
        for k in riders.get(bi, ()):
            # A result's all-reduce (the step's loss) rides in the bucket: one collective
            # fewer per step. An average is summed there and divided where it was.
            ins = body[k]
            result = ins.outs[0]
            if ins.kw("op") != first.kw("op"):
                n = math.prod(dict(plan.mesh)[d] for d in ins.kw("dims"))
                summed = names.fresh(f"{result}_sum")
                insert_after.setdefault(k, []).append(
                    Instr(
                        (result,),
                        "aten.div.Tensor",
                        (Var(summed), n),
                        (),
                        ins.types,
                        "main",
                        ins.on,
                        ins.loc,
                        f"the average of %{sources[k]} over {'/'.join(ins.kw('dims'))}, "
                        f"summed in gradient bucket {bi + 1}/{len(buckets)}",
                    )
                )
                result = summed
            b_outs.append(result)
            b_args.append(Var(sources[k]))
            member_types.append(ins.types[0])
            reason += f"; and the step's result %{sources[k]} ({ins.reason})"
        instr = Instr(
            tuple(b_outs),
            "all_reduce",
            tuple(b_args),
            first.kwargs,
            tuple(member_types),
            "comms",
            first.on,
            first.loc,
            reason,
        )
        insert_after.setdefault(max(r for r, _ in bucket), []).append(instr)
    if not moved:
        return record_pass(plan, "schedule", t0)
    out: list[Instr] = list(insert_after.get(-1, []))
    for k, ins in enumerate(body):
        out.extend(insert_before.get(k, []))
        if k not in moved:
            out.append(ins)
        out.extend(insert_after.get(k, []))
    return record_pass(plan.replace(body=tuple(out)), "schedule", t0)


def _prefetch(
    body: list[Instr], plan: Plan, first_use: dict[str, int]
) -> tuple[dict[int, list[Instr]], set[int]]:
    """Parameter all-gathers (``md.fully_shard``: a plan input gathered whole for the forward
    pass, and again for the backward pass) on the comms stream, each issued one ahead: the
    first where it was, the next one where the first is first used, and so on -- so the next
    layer's parameters travel while this layer computes. The backward pass's gathers are
    issued no earlier than the backward pass starts (the forward pass's gathered copies are
    freed by then). Returns (instructions to insert before each index, indices moved)."""
    inputs = {i.name for i in plan.inputs if i.kind == "param"}
    gathers = [
        k
        for k, ins in enumerate(body)
        if ins.op == "all_gather"
        and ins.stream == "main"
        and not ins.on
        and len(ins.outs) == 1
        and ins.uses()[0] in inputs
        and ins.outs[0] in first_use
    ]
    phase = (plan.notes or {}).get("phase", {})
    backward = next(
        (k for k, ins in enumerate(body) if ins.outs and phase.get(ins.outs[0]) == "backward"),
        len(body),
    )
    insert_before: dict[int, list[Instr]] = {}
    for n, k in enumerate(gathers):
        at = k if n == 0 else min(k, first_use[body[gathers[n - 1]].outs[0]])
        if k > backward:
            at = max(at, backward)
        ins = body[k]
        reason = f"prefetched parameter: {ins.reason}"
        insert_before.setdefault(at, []).append(
            dataclasses.replace(ins, stream="comms", reason=reason)
        )
    return insert_before, set(gathers)


_RENAMES = ("aten.detach.default", "aten.alias.default")


def _why(
    members: list[Instr],
    srcs: list[str],
    readers: dict[str, dict[str, None]],
    types: dict[str, TensorType],
    dims: tuple[str, ...],
) -> str:
    """The placement change and the ops that read the results, as ``propagate`` words a
    collective's reason, for each group of a bucket's gradients that share both:
    ``{dp: P(sum)} -> {dp: R} for aten.clone.default: %a, %b``, groups joined by ``; ``."""
    groups: dict[str, list[str]] = {}
    for m, src in zip(members, srcs):
        before = format_placements(types[src].placements, dims)
        change = f"{before} -> {format_placements(m.types[0].placements, dims)}"
        ops = ", ".join(readers[m.outs[0]])
        groups.setdefault(f"{change} for {ops}", []).append("%" + src)
    return "; ".join(f"{key}: {', '.join(vs)}" for key, vs in groups.items())


def _buckets(
    group: list[tuple[int, int]], body: list[Instr], first_use: dict[str, int], cap: float
) -> list[list[tuple[int, int]]]:
    """(ready, index) of one group's all-reduces, in buckets of about ``cap`` bytes."""
    buckets: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    size = 0.0
    for ready, k in group:
        # A bucket goes out after its last gradient: all its results must be needed later.
        needed = min((first_use[body[j].outs[0]] for _, j in current), default=len(body))
        if current and (size >= cap or ready >= needed):
            buckets.append(current)
            current, size = [], 0.0
        current.append((ready, k))
        size += nbytes(body[k].types[0])
    if current:
        buckets.append(current)
    return buckets


def _riders(
    results: list[tuple[int, int]],
    buckets: list[list[tuple[int, int]]],
    body: list[Instr],
    sources: dict[int, str],
    root: dict[str, str],
    writes: dict[str, list[int]],
) -> dict[int, list[int]]:
    """Which all-reduces of results only (``results``: (ready, index)) go in which bucket
    (its index): each in the last bucket of its ranks, group and dtype that goes out after
    its value is ready, if nothing writes the value after it is ready, summing as the bucket does --
    a sum, or an average (divided after). None where no such bucket: it stays where it was."""
    out: dict[int, list[int]] = {}
    for ready, k in results:
        ins = body[k]
        key = _key(ins)
        src = sources[k]
        r = root.get(src, src)
        for bi in range(len(buckets) - 1, -1, -1):
            first = body[buckets[bi][0][1]]
            at = max(rd for rd, _ in buckets[bi])  # where the bucket goes out
            theirs = _key(first)
            if (key[0], key[1], key[3]) != (theirs[0], theirs[1], theirs[3]):  # (not the op)
                continue
            if first.kw("op") != "sum" and first.kw("op") != ins.kw("op"):
                continue
            # Nothing may write the value once it is ready: the bucket reads it where it
            # goes out, and on the comms stream until the result's first use.
            if ready <= at and not any(w > ready for w in writes.get(r, [])):
                out.setdefault(bi, []).append(k)
            break
    return out


def _key(ins: Instr) -> tuple[Any, ...]:
    """What the all-reduces of one bucket share: the ranks that issue it (a pipeline stage's,
    by ``on``), the group, the reduction and the dtype."""
    return (ins.on, ins.kw("dims"), ins.kw("op"), ins.types[0].dtype)
