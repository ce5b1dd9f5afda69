"""Shared-memory collectives (cpp/shm.cpp, monarch_dsl/runtime/shm.py): results against torch,
concurrent groups, timeouts, and no /dev/shm leaks after a normal exit or a SIGKILL.

The processes are plain spawned ``multiprocessing`` workers. The C++ runtime is loaded prebuilt,
never built here."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback

import pytest
import torch

import monarch_dsl as md
from monarch_dsl.runtime import shm

PREFIX = "md_shmtest"

pytestmark = pytest.mark.skipif(
    shm.core() is None,
    reason=f"the C++ runtime with ShmGroup is not built ({shm.unavailable_reason()}); "
    "run `python -m monarch_dsl._build`",
)

OPS = ("sum", "avg", "max", "min", "prod")
DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16)
SMALL = 64 << 10  # a 64 KiB segment per rank, so that most tensors below are chunked


def _name(tag: str) -> str:
    return f"/{PREFIX}.{os.getpid()}.{tag}.{time.monotonic_ns()}"


def _leaks() -> list[str]:
    return shm.segments(PREFIX)


def _input(rank: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if op == "prod":
        x = x.sign() * (1 + x.abs() / 10)  # keep products in range
        return x.to(dtype) if dtype.is_floating_point else x.sign().to(dtype)
    return (x * 100).to(dtype)


def _reference(size: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    xs = torch.stack([_input(r, n, dtype, op) for r in range(size)])
    acc = xs.double() if dtype in (torch.float32, torch.bfloat16) else xs
    out = {
        "sum": lambda: acc.sum(0),
        "avg": lambda: acc.mean(0),
        "max": lambda: acc.amax(0),
        "min": lambda: acc.amin(0),
        "prod": lambda: acc.prod(0),
    }[op]()
    return out.to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    tol = 2e-2 if a.dtype == torch.bfloat16 else 1e-5
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol * 1000)  # inputs ~ 100


def _run(size: int, target: str, *args, timeout: float = 120.0) -> list:
    """Run ``target(rank, size, *args)`` in ``size`` spawned processes; their (rank, result)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(target, r, size, queue, *args)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [r for r in results if isinstance(r, str)]
    assert not errors, "\n".join(errors)
    return sorted(results)


def _entry(target: str, rank: int, size: int, queue, *args) -> None:
    try:
        queue.put((rank, globals()[target](rank, size, *args)))
    except BaseException:  # noqa: BLE001
        queue.put(f"rank {rank}:\n{traceback.format_exc()}")


# ---------------------------------------------------------------- workers (module level: spawn)
def _collectives(rank: int, size: int, name: str) -> list[str]:
    torch.set_num_threads(1)
    g = shm.core().ShmGroup(name, rank, size, SMALL, 60.0, 4096)
    bad = []
    for n in (0, 1, 5, 1000, 50_000):  # 50_000 elements > the 32 KiB half segment: chunked
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                x = _input(rank, n, dtype, op)
                # the same reduction from pieces read where they are (a gradient bucket):
                # bit-identical to the all-reduce of their flat copy
                pieces = list(x.clone().tensor_split([n // 3, n // 3 + 1]))
                out = torch.empty(n, dtype=dtype)
                g.all_reduce_into(out, pieces, op)
                # and left in the pieces themselves (a bucket that takes its own result)
                own = [p.clone() for p in x.tensor_split([n // 2, n // 2 + 1])]
                g.all_reduce_pieces(own, op)
                g.all_reduce(x, op)
                if not _close(x, _reference(size, n, dtype, op)):
                    bad.append(f"all_reduce {op} {dtype} n={n}")
                if not torch.equal(out, x):
                    bad.append(f"all_reduce_into {op} {dtype} n={n}")
                if not torch.equal(torch.cat(own), x):
                    bad.append(f"all_reduce_pieces {op} {dtype} n={n}")
            x = _input(rank, n, dtype, "sum")
            got = g.all_gather(x)
            if not torch.equal(got, torch.stack([_input(r, n, dtype, "sum") for r in range(size)])):
                bad.append(f"all_gather {dtype} n={n}")
            for op in ("sum", "max"):
                full = [_input(r, n * size, dtype, op) for r in range(size)]
                out = torch.empty(n, dtype=dtype)
                g.reduce_scatter(
                    out,
                    list(full[rank].chunk(size)) if n else [torch.empty(0, dtype=dtype)] * size,
                    op,
                )
                stacked = torch.stack(full).double()
                red = stacked.sum(0) if op == "sum" else stacked.amax(0)
                want = red.to(dtype)[rank * n : (rank + 1) * n]
                if not _close(out, want):
                    bad.append(f"reduce_scatter {op} {dtype} n={n}")
            root = size - 1
            b = _input(root, n, dtype, "sum") if rank == root else torch.zeros(n, dtype=dtype)
            g.broadcast(b, root)
            if not torch.equal(b, _input(root, n, dtype, "sum")):
                bad.append(f"broadcast {dtype} n={n}")
    # send/recv through a 4 KiB ring: small and large messages, in order, both directions
    peer = rank ^ 1
    if peer < size:
        msgs = [torch.arange(k, dtype=torch.float32) + 1000 * rank for k in (3, 70_000, 0, 17)]
        if rank % 2 == 0:
            for i, m in enumerate(msgs):
                g.send(m, peer, i)
        for i, m in enumerate(msgs):
            buf = torch.empty_like(m)
            g.recv(buf, peer, i)
            if not torch.equal(buf, m - 1000 * rank + 1000 * peer):
                bad.append(f"recv {i} from {peer}")
        if rank % 2 == 1:
            for i, m in enumerate(msgs):
                g.send(m, peer, i)
    g.barrier()
    g.close()
    return bad


def _wrapper(rank: int, size: int, port: int) -> list[str]:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    group = shm.make_group(dist.PrefixStore("md/main/all", store), list(range(size)), rank, timeout)
    bad = []
    if not isinstance(group, shm.ShmProcessGroup):
        return [f"make_group gave {group!r}"]
    x = torch.full((1000,), float(rank + 1))
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    group.allreduce([x], opts).wait()
    if not torch.all(x == size):
        bad.append("allreduce max")
    flag = torch.tensor([rank], dtype=torch.int32)
    group.allreduce([flag]).wait()
    if int(flag) != sum(range(size)):
        bad.append("allreduce int32 sum")
    outs = [torch.empty(3) for _ in range(size)]
    group.allgather([outs], [torch.full((3,), float(rank))]).wait()
    if not all(torch.all(o == r) for r, o in enumerate(outs)):
        bad.append("allgather")
    out = torch.empty(4)
    ropts = dist.ReduceScatterOptions()
    ropts.reduceOp = dist.ReduceOp.SUM
    group.reduce_scatter([out], [[torch.full((4,), float(j)) for j in range(size)]], ropts).wait()
    if not torch.all(out == rank * size):
        bad.append("reduce_scatter")
    # all-to-all goes through gloo (made lazily, by every member at the same call)
    src = torch.arange(size, dtype=torch.float32) + 10 * rank
    dst = torch.empty_like(src)
    group.alltoall_base(dst, src, [], []).wait()
    if not torch.equal(dst, torch.tensor([10.0 * r + rank for r in range(size)])):
        bad.append("alltoall_base")
    # a non-contiguous tensor falls back to gloo too
    nc = torch.ones(4, 4).t()
    group.allreduce([nc]).wait()
    if not torch.all(nc == size):
        bad.append("allreduce non-contiguous")
    # send/recv as the executor's transfer does it: post both, then wait
    if size >= 2 and rank < 2:
        peer = 1 - rank
        if rank == 0:
            works = [
                group.send([torch.tensor([1])], peer, 0),
                group.send([torch.arange(1_500_000.0)], peer, 1),
            ]  # larger than the ring
        else:
            flag, buf = torch.zeros(1, dtype=torch.int64), torch.empty(1_500_000)
            works = [group.recv([flag], peer, 0), group.recv([buf], peer, 1)]
        for w in works:
            w.wait()
        if rank == 1 and not (int(flag) == 1 and torch.equal(buf, torch.arange(1_500_000.0))):
            bad.append("send/recv")
    group.barrier()
    group.close()
    return bad


def _threads(rank: int, size: int, names: list[str]) -> list[str]:
    torch.set_num_threads(1)
    groups = [shm.core().ShmGroup(n, rank, size, SMALL, 60.0, 4096) for n in names]
    bad = []

    def work(i, g):
        for it in range(60):
            n = 10 + it * 997  # some chunked
            x = torch.full((n,), float(rank + 1 + i * 100 + it))
            g.all_reduce(x, "sum")
            want = sum(float(r + 1 + i * 100 + it) for r in range(size))
            if not torch.all(x == want):
                bad.append(f"group {i} iteration {it}")

    threads = [threading.Thread(target=work, args=(i, g)) for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return bad


def _timeout(rank: int, size: int, name: str, done, started) -> str:
    started.wait(60)  # both interpreters are up: the 1 s timeout is the all-reduce's to hit
    g = shm.core().ShmGroup(name, rank, size, SMALL, 1.0, 4096)
    if rank == 1:  # attached, alive, but never joins the all-reduce (until rank 0 is done)
        done.wait(60)
        return ""
    t = time.monotonic()
    try:
        g.all_reduce(torch.ones(10), "sum")
    except RuntimeError as e:
        return f"{time.monotonic() - t:.1f} {e}"
    finally:
        done.set()
    return "no error"


def _killed(rank: int, size: int, name: str, ready) -> str:
    g = shm.core().ShmGroup(name, rank, size, SMALL, 30.0, 4096)
    g.all_reduce(torch.ones(10), "sum")
    ready.put(os.getpid())
    if rank == 1:
        time.sleep(60)  # killed meanwhile
        return ""
    t = time.monotonic()
    try:
        g.all_reduce(torch.ones(10), "sum")
    except RuntimeError as e:
        return f"{time.monotonic() - t:.1f} {e}"
    return "no error"


# ---------------------------------------------------------------- tests
@pytest.mark.procs
@pytest.mark.parametrize("size", [2, 4])
def test_collectives_match_torch(size):
    before = _leaks()
    results = _run(size, "_collectives", _name(f"c{size}"), timeout=300)
    assert [bad for _, bad in results] == [[]] * size
    assert _leaks() == before  # unlinked once all attached; closed by every rank


@pytest.mark.procs
@pytest.mark.parametrize("size", [2, 3])
def test_process_group_wrapper(size):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    before = shm.segments()
    results = _run(size, "_wrapper", store.port)
    assert [bad for _, bad in results] == [[]] * size
    assert shm.segments() == before


@pytest.mark.procs
def test_two_groups_used_from_two_threads():
    names = [_name("t0"), _name("t1")]
    results = _run(2, "_threads", names)
    assert [bad for _, bad in results] == [[], []]
    assert _leaks() == []


@pytest.mark.procs
def test_timeout_names_the_group_and_the_late_rank():
    name = _name("timeout")
    ctx = mp.get_context("spawn")
    (_, err), _ = _run(2, "_timeout", name, ctx.Event(), ctx.Barrier(2))
    seconds, _, message = err.partition(" ")
    assert name in message and "timed out" in message and "rank(s) 1" in message, message
    assert "all_reduce" in message
    assert float(seconds) < 3.0
    assert _leaks() == []


def test_attach_timeout_when_a_member_never_comes():
    name = _name("alone")
    with pytest.raises(RuntimeError, match="timed out") as e:
        shm.core().ShmGroup(name, 0, 2, SMALL, 0.5, 4096)
    assert name in str(e.value)
    with pytest.raises(RuntimeError, match="rank 0 to create"):
        shm.core().ShmGroup(_name("nobody"), 1, 2, SMALL, 0.3, 4096)
    assert _leaks() == []


def test_overlapping_pieces_of_an_in_place_all_reduce_are_refused():
    # (a byte in two pieces would be written by one and read again, reduced, by the other)
    g = shm.core().ShmGroup(_name("overlap"), 0, 1, SMALL, 5.0, 4096)
    try:
        x = torch.ones(8)
        with pytest.raises(ValueError, match="overlap"):
            g.all_reduce_pieces([x[:5], x[3:]])
        with pytest.raises(ValueError, match="overlap"):
            g.all_reduce_pieces([x, x])
        g.all_reduce_pieces([x[:4], x[4:]])  # (side by side: fine)
        assert torch.equal(x, torch.ones(8))
    finally:
        g.close()
    assert _leaks() == []


@pytest.mark.procs
def test_no_leak_and_a_clear_error_after_sigkill():
    ctx = mp.get_context("spawn")
    queue, ready = ctx.Queue(), ctx.Queue()
    name = _name("kill")
    procs = [
        ctx.Process(target=_entry, args=("_killed", r, 2, queue, name, ready)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        pids = {ready.get(timeout=60), ready.get(timeout=60)}
        assert pids == {p.pid for p in procs}
        assert _leaks() == []  # the name is gone as soon as both attached
        os.kill(procs[1].pid, signal.SIGKILL)
        rank, err = queue.get(timeout=30)
        assert rank == 0
        seconds, _, message = err.partition(" ")
        assert "rank 1" in message and "exited" in message, message
        assert float(seconds) < 5.0  # noticed the death, did not wait for the 30 s timeout
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert _leaks() == []


@pytest.mark.procs
def test_no_leak_when_every_member_is_killed():
    """Both members SIGKILLed mid-way: the segment was unlinked at attach, so nothing stays."""
    ctx = mp.get_context("spawn")
    queue, ready = ctx.Queue(), ctx.Queue()
    name = _name("killall")
    procs = [
        ctx.Process(target=_entry, args=("_killed", r, 2, queue, name, ready)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        ready.get(timeout=60)
        ready.get(timeout=60)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
    finally:
        for p in procs:
            p.join(10)
    assert _leaks() == []


def test_sweep_removes_names_of_dead_creators():
    proc = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    proc.start()
    proc.join()
    path = os.path.join(shm.SHM_DIR, f"{PREFIX}.{proc.pid}.stale")
    live = os.path.join(shm.SHM_DIR, f"{PREFIX}.{os.getpid()}.live")
    for p in (path, live):
        open(p, "w").close()
    try:
        assert shm.sweep_stale(PREFIX) == [os.path.basename(path)]
        assert os.path.exists(live)
    finally:
        for p in (path, live):
            if os.path.exists(p):
                os.unlink(p)


def test_make_group_declines_non_cpu_and_single_members(monkeypatch):
    assert shm.make_group(None, [0], 0, datetime.timedelta(seconds=1)) is None
    assert shm.make_group(None, [0, 1], 0, datetime.timedelta(seconds=1), "meta") is None
    monkeypatch.setenv("MD_SHM", "0")
    assert shm.make_group(None, [0, 1], 0, datetime.timedelta(seconds=1)) is None


@md.remote(propagate=lambda: torch.zeros((), dtype=torch.bool))
def _uses_shared_memory():
    from monarch_dsl.runtime import shm, worker

    groups = worker.current.executor().groups.values()
    return torch.tensor(any(isinstance(g, shm.ShmProcessGroup) for g in groups))


def _worker_segments(pids) -> list[str]:
    """/dev/shm names made by these processes (names carry their creator's pid)."""
    return [n for n in shm.segments() if int(n.split(".")[1]) in pids]


@pytest.mark.procs
def test_the_tensor_engine_reduces_through_shared_memory_on_one_host():
    pm = md.this_host().spawn_procs({"gpu": 2})
    try:
        with pm.activate():
            x = torch.ones(1000) * (pm.rank("gpu") + 1)
            total = md.inspect(x.reduce("gpu", "sum"))
            with md.Stream("comms").activate():  # a second stream: a second group
                md.inspect(torch.ones(10).reduce("gpu", "sum"))
            uses = bool(md.inspect(_uses_shared_memory()))
        torch.testing.assert_close(total, torch.full((1000,), 3.0))
        assert uses
        pids = set(pm._job.pids.values())
        assert len(pids) == 2
    finally:
        pm.stop()
    assert _worker_segments(pids) == []  # nothing left in /dev/shm after stop()
