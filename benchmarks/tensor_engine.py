"""Tensor engine benchmark: controller cost of eager ops, and reduce bandwidth.

    python benchmarks/tensor_engine.py

1. Controller time per eager op: 10,000 small ops (``y = x + 1`` on an 8-element tensor) on a
   2-process mesh, then one fetch. Reported as the controller thread's CPU time per op (what
   the controller spends; the workers run on the same 2 cores, so wall time also shows them)
   and wall time per op, beside the same ops run locally in eager torch. Median of 5 runs.
2. ``t.reduce_("gpu")`` (an in-place sum all-reduce through the tensor engine) at 1, 16 and
   64 MiB on 2 worker processes, beside a raw ``all_reduce`` on the very same gloo process
   group in the same processes (timed inside the workers by an actor). Algorithmic bandwidth
   (bytes / time), median of 5 runs of several reduces each; the ratio is the target's.

3. Local data sent to the workers: the controller's CPU (all its threads, ``process_time``) per
   ``md.to_mesh(t)`` of a local tensor and per call of a compiled step with a local argument
   sharded over the ranks (a batch; the block's CPU, the 2 ms between calls and the last
   call's wait included, over its calls), at 512 KiB and 4 MiB, on 2 worker processes. Each
   copies the tensor when it is called (the caller may change it before the message leaves):
   with ``serialize.snapshot`` (one thread) beside torch's ``clone()`` (the peer, on torch's
   intra-op threads; with it the call sends the whole batch to every rank, as before
   ``PerRank``), calls 2 ms apart as in a loop that does other work between them, blocks
   alternating; median of 5 blocks. ``whole to each rank``: the compiled call with the
   snapshot, but the whole batch sent to every rank (each keeping its part), beside the same
   call sending each rank its own rows (``serialize.PerRank``).

Targets (issue 3): <= 30 us of controller time per eager op; reduce >= 90% of the raw
all-reduce bandwidth at 64 MiB.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("MONARCH_DSL_QUIET", "1")

import torch  # noqa: E402

import monarch_dsl as md  # noqa: E402
from monarch_dsl import tensor as md_tensor  # noqa: E402
from monarch_dsl.runtime import worker  # noqa: E402

OPS = 10_000
RUNS = 5
SIZES_MIB = (1, 16, 64)


class RawAllReduce(md.Actor):
    """Times all_reduce on the tensor engine's own group for the 'gpu' dim (shared memory
    between the processes of one host, gloo otherwise)."""

    @md.endpoint
    def run(self, numel: int, reps: int) -> float:
        ex = worker.current._executor
        group = next(g for key, g in ex.groups.items() if key[0] == "main" and len(key) == 3)
        t = torch.ones(numel)
        group.allreduce([t]).wait()  # warm up
        start = time.perf_counter()
        for _ in range(reps):
            group.allreduce([t]).wait()
        return (time.perf_counter() - start) / reps


def eager_ops(pm) -> tuple[list[float], list[float], list[float]]:
    cpu, wall, local = [], [], []
    with pm.activate():
        x = torch.ones(8)
        md.inspect(x + 1)  # warm the caches
        for _ in range(RUNS):
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(OPS):
                y = x + 1
            c1 = time.thread_time()
            md.inspect(y)
            w1 = time.perf_counter()
            cpu.append((c1 - c0) / OPS * 1e6)
            wall.append((w1 - w0) / OPS * 1e6)
    lx = torch.ones(8)
    for _ in range(RUNS):
        t0 = time.perf_counter()
        for _ in range(OPS):
            y = lx + 1
        local.append((time.perf_counter() - t0) / OPS * 1e6)
    return cpu, wall, local


def reduce_bandwidth(pm, mib: int) -> tuple[float, float]:
    numel = mib * (1 << 20) // 4
    reps = max(4, 256 // mib)  # >= 4: one sync round trip must not weigh on the 64 MiB figure
    raw_actor = pm.spawn(f"raw{mib}", RawAllReduce)
    md_bw, raw_bw = [], []
    with pm.activate():
        t = torch.ones(numel)
        t.reduce_("gpu")
        md_tensor.sync(pm)  # groups exist and are warm
        for _ in range(RUNS):
            start = time.perf_counter()
            for _ in range(reps):
                t.reduce_("gpu")
            md_tensor.sync(pm)
            md_bw.append(numel * 4 * reps / (time.perf_counter() - start) / 1e9)
            secs = max(raw_actor.run.call(numel, reps).get().values())
            raw_bw.append(numel * 4 / secs / 1e9)
        del t
    return statistics.median(md_bw), statistics.median(raw_bw)


SEND_KIB = (512, 4096)
SEND_CALLS = 20


def send_local(pm, kib: int) -> dict[str, tuple[float, float]]:
    """(to_mesh, compiled call) controller CPU ms each, for snapshot, clone and (the call
    only) the snapshot sent whole to each rank."""
    from monarch_dsl.runtime.serialize import snapshot
    from monarch_dsl.tensor import movement

    mesh_fn_module = sys.modules["monarch_dsl.mesh_fn"]  # (md.mesh_fn is the function)
    rows = mesh_fn_module._rows
    variants = {  # name: (the copy, each rank's rows)
        "snapshot": (snapshot, rows),
        "clone": (lambda t: t.detach().clone(), rows),  # (no wire form: sent whole)
        "whole": (snapshot, lambda *args: None),
    }
    value = torch.randn(2, kib * 256 // 2)  # kib KiB of float32, outside pm.activate()
    out = {"x": {"gpu": md.Shard(0)}}
    step = md.mesh_fn(lambda x: x * 2, placements=out, out_placements={"out0": out["x"]})
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in variants}
    try:
        with pm.activate():
            md.inspect(step(value))
            for _ in range(RUNS):
                for name, (copy, rows_of) in variants.items():
                    movement.snapshot = mesh_fn_module.snapshot = copy
                    mesh_fn_module._rows = rows_of
                    sends = (lambda: md.to_mesh(value, pm), lambda: step(value))
                    for kind, send in enumerate(sends):
                        if name == "whole" and kind == 0:
                            continue
                        c0 = time.process_time()  # (sleeping takes none: what runs meanwhile)
                        for _ in range(SEND_CALLS):
                            result = send()
                            time.sleep(0.002)  # (the loop's other work)
                        md.inspect(result[:1])
                        cpu = time.process_time() - c0
                        times[name][kind].append(cpu / SEND_CALLS * 1e3)
    finally:
        movement.snapshot = mesh_fn_module.snapshot = snapshot
        mesh_fn_module._rows = rows
    return {
        k: (statistics.median(a) if a else float("nan"), statistics.median(b))
        for k, (a, b) in times.items()
    }


def main() -> None:
    pm = md.this_host().spawn_procs({"gpu": 2})
    try:
        cpu, wall, local = eager_ops(pm)
        rows = [
            (
                "eager op, controller CPU (us/op)",
                statistics.median(cpu),
                statistics.median(local),
                "<= 30 us",
                statistics.median(cpu) <= 30,
            ),
            (
                "eager op, wall incl. workers (us/op)",
                statistics.median(wall),
                statistics.median(local),
                "-",
                None,
            ),
        ]
        for mib in SIZES_MIB:
            mine, raw = reduce_bandwidth(pm, mib)
            ok = mine >= 0.9 * raw if mib == 64 else None
            rows.append(
                (
                    f"reduce_ {mib} MiB, 2 procs (GB/s)",
                    mine,
                    raw,
                    ">= 90% raw" if mib == 64 else "-",
                    ok,
                )
            )
        for kib in SEND_KIB:
            sent = send_local(pm, kib)
            for kind, what in enumerate(("md.to_mesh", "compiled call")):
                rows.append(
                    (
                        f"{what}, {kib} KiB local (ctl CPU ms)",
                        sent["snapshot"][kind],
                        sent["clone"][kind],
                        "-",
                        None,
                    )
                )
            rows.append(
                (
                    f"  ... whole to each rank, {kib} KiB",
                    sent["snapshot"][1],
                    sent["whole"][1],
                    "-",
                    None,
                )
            )
    finally:
        pm.stop()
    print(
        f"{'metric':40s} {'monarch_dsl':>12s} {'peer':>12s} {'ratio':>7s}  {'target':>10s}  check"
    )
    for name, mine, peer, target, ok in rows:
        check = "-" if ok is None else ("PASS" if ok else "MISS")
        print(f"{name:40s} {mine:12.2f} {peer:12.2f} {mine / peer:7.2f}  {target:>10s}  {check}")
    print(
        "peer: local eager torch for ops; for reduce, a raw all_reduce on the same group "
        "(shared memory between processes of one host); for local data sent, the same with "
        "the copy made by torch's clone() (intra-op threads) instead of serialize.snapshot "
        "(and the call's batch sent whole to each rank); 'whole to each rank': the call "
        "with the snapshot, its batch sent whole to each rank instead of each its rows."
    )
    print(f"eager runs (controller CPU us/op): {', '.join(f'{c:.1f}' for c in cpu)}")


if __name__ == "__main__":
    main()
