"""All-reduce between local processes: the shared-memory path vs gloo (issue 5, benchmark 2).

    python benchmarks/shm_collectives.py [--ranks 2 4] [--sizes 4096 1048576 67108864] [--reps N]

Each configuration spawns `ranks` processes that make both a gloo group and a shared-memory
group (monarch_dsl.runtime.shm.ShmProcessGroup, the same object the executor uses) over one
TCPStore, then time in-place float32 all-reduces of each size on both, alternating, after a
barrier; the time of one all-reduce is the slowest rank's, and the table shows the median over
the repetitions. Targets: shared memory >= 10x gloo at 4 KiB and >= 3x at 64 MiB. Needs the
C++ runtime built with ShmGroup (`python -m monarch_dsl._build`).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import time

TARGETS = {4096: 10.0, 64 << 20: 3.0}


def _worker(rank, size, port, sizes, reps, queue):
    import torch
    import torch.distributed as dist

    from monarch_dsl.runtime import shm

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
    group = shm.ShmProcessGroup(dist.PrefixStore("shm", store), rank, size, timeout)
    out = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        times = {"gloo": [], "shm": []}
        for i in range(reps + 2):  # two warm-ups
            for name, g in (("gloo", gloo), ("shm", group)):
                group.barrier()
                t = time.perf_counter()
                g.allreduce([x]).wait()
                dt = time.perf_counter() - t
                if i >= 2:
                    times[name].append(dt)
        # sum of ones over `size` ranks, repeated (reps + 2) * 2 times: powers of `size`
        assert float(x[0]) == float(size) ** ((reps + 2) * 2), float(x[0])
        out[nbytes] = times
    queue.put((rank, out))
    group.barrier()


def run(size: int, sizes: list[int], reps: int) -> dict[int, dict[str, float]]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, size, store.port, sizes, reps, queue))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    table = {}
    for nbytes in sizes:
        row = {}
        for name in ("gloo", "shm"):
            per_rep = [max(results[r][nbytes][name][i] for r in range(size)) for i in range(reps)]
            row[name] = statistics.median(per_rep)
        table[nbytes] = row
    return table


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 1 << 20, 64 << 20])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    from monarch_dsl.runtime import shm

    if shm.core() is None:
        raise SystemExit(f"shared-memory collectives unavailable: {shm.unavailable_reason()}")
    print(f"{'ranks':>5} {'size':>7} {'gloo':>10} {'shm':>10} {'speed-up':>9} {'target':>7}")
    for size in args.ranks:
        table = run(size, args.sizes, args.reps)
        for nbytes, row in table.items():
            ratio = row["gloo"] / row["shm"]
            target = TARGETS.get(nbytes)
            mark = (
                ""
                if target is None
                else f">={target:.0f}x " + ("ok" if ratio >= target else "MISS")
            )
            print(
                f"{size:>5} {_fmt_size(nbytes):>7} {row['gloo'] * 1e3:>8.3f}ms "
                f"{row['shm'] * 1e3:>8.3f}ms {ratio:>8.1f}x {mark}"
            )


if __name__ == "__main__":
    main()
