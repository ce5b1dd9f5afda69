"""The primitives of ``isa/collectives.py`` on a torch.distributed group (gloo, NCCL, or the
shared-memory group), and the failure flag every collective instruction agrees on first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from monarch_dsl.isa import collectives
from monarch_dsl.isa.collectives import Exchange

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


def begin(group: Any, index: int, n: int, exchange: Exchange) -> Callable[[], Any]:
    """Start ``exchange`` on ``group`` (this rank is member ``index`` of ``n``); returns a
    function that waits for it and gives its result."""
    kind, payload = exchange.kind, exchange.payload
    if kind == "all_reduce":
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[exchange.op]
        work = group.allreduce([payload], opts)
        result: Any = payload
    elif kind == "all_gather":
        result = [torch.empty_like(payload) for _ in range(n)]
        work = group.allgather([result], [payload])
    elif kind == "reduce_scatter":
        result = torch.empty_like(payload[index])
        ropts = dist.ReduceScatterOptions()
        ropts.reduceOp = _OPS[exchange.op]
        work = group.reduce_scatter([result], [payload], ropts)
    elif kind == "all_to_all":
        result = torch.empty_like(payload)
        work = group.alltoall_base(result, payload, [], [])
    else:
        raise ValueError(f"unknown exchange {kind!r}")

    def wait() -> Any:
        work.wait()
        return result

    return wait


def start(group: Any, index: int, n: int, collective: collectives.Collective) -> Callable[[], Any]:
    """Start ``collective`` on ``group``; returns a function that finishes it and gives its
    result."""
    exchange, finish = collectives.start(collective)
    wait = begin(group, index, n, exchange)
    return lambda: finish(wait())


def run(group: Any, index: int, n: int, collective: collectives.Collective) -> Any:
    """``collective``'s result on ``group``, waited for."""
    return start(group, index, n, collective)()


def any_failed(group: Any, failed: bool, device: Any) -> bool:
    """Whether any member of ``group`` failed (this one: ``failed``): a one-int all-reduce
    every member takes part in, so a failure never leaves a peer waiting in the collective
    that follows, and all agree on failing its result. A group of one rank has nobody to
    agree with: no collective (on a GPU, the flag's ``item()`` would wait for every kernel
    queued so far, so a one-GPU worker could not queue the next call's kernels while the GPU
    runs this one's)."""
    if group.size() == 1:
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    group.allreduce([flag], opts).wait()
    return bool(flag.item())
