"""Shared-memory collectives for CPU tensors of ranks on one host (the C++ ``ShmGroup``).

:class:`ShmProcessGroup` presents the part of ``dist.ProcessGroupGloo``'s interface the
executors use (``allreduce``, ``allgather``, ``reduce_scatter``, ``broadcast``, ``send``,
``recv``, ``alltoall_base``, ``barrier``; each returns a work with ``wait()``). It runs a
collective through shared memory when the tensors are contiguous CPU tensors of a dtype the
C++ side reduces, and through a gloo group of the same members otherwise (made lazily, on the
first such call -- every member reaches it, since matched collectives agree on device, dtype
and size).

When shared memory is chosen (:func:`make_group`): the group's members are all on this host
(each member publishes its host id -- hostname and boot id -- in the group's store prefix and
reads the others'), the executor's device is the CPU, ``MD_SHM`` is not ``0``, and the C++
runtime is built with ``ShmGroup``.

By size, measured with benchmarks/shm_collectives.py (2 cores; gloo's times vary by up to 3x
between runs), float32 all-reduce medians of one run, 2 MiB segment per rank::

    ranks  size      gloo       shm    speed-up
        2  4 KiB    3.55 ms   0.047 ms   75x
        2  1 MiB    3.72 ms   0.149 ms   25x
        2  64 MiB  45.1 ms    5.75 ms     7.8x
        4  4 KiB    7.66 ms   0.239 ms   32x
        4  1 MiB    4.71 ms   0.427 ms   11x
        4  64 MiB 112 ms     19.5 ms      5.7x

Shared memory wins at every size measured, so SIZE_LIMIT is unbounded by default;
``MD_SHM_SIZE_LIMIT`` caps it where a machine measures otherwise. At 64 MiB both are bound by
memory bandwidth: shared memory moves each byte about four times (in, reduce, out), in chunks
small enough to stay in the cache between those steps.

Segments: rank 0 creates ``/dev/shm/md_shm.<pid>.<token>``; the name is unlinked as soon as
every member has attached, so the memory lives only as long as the processes that map it (no
leak after ``stop()`` or a crash). A creator killed inside that short window leaves a name
whose pid is dead; :func:`sweep_stale` (run before each creation) removes such names.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from monarch_dsl import _core

PREFIX = "md_shm"
SHM_DIR = "/dev/shm"
# Bytes per rank of a group's segment (two halves: a collective moves data in chunks of half
# this per rank, so any size works); and per send/recv direction. Chunks that stay in the
# cache between copy-in, reduce and copy-out beat big ones: at 64 MiB, 2 MiB per rank took
# 5.7-9.1 ms (2 ranks) and 18-20 ms (4 ranks) where 8 MiB took 15.5 ms and 36 ms.
CAPACITY = int(os.environ.get("MD_SHM_CAPACITY", 2 << 20))
RING = int(os.environ.get("MD_SHM_RING", 4 << 20))
# Use shared memory up to this many bytes per tensor (gloo above). See the table above.
SIZE_LIMIT = int(os.environ.get("MD_SHM_SIZE_LIMIT", 1 << 62))

_DTYPES = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
}
_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.PRODUCT: "prod",
}


def core() -> Any:
    """The C++ module providing ``ShmGroup``, or None (see :func:`unavailable_reason`). Only
    loads a prebuilt runtime; never builds it."""
    return _core.native()


def unavailable_reason() -> str | None:
    return _core.unavailable_reason()


def enabled() -> bool:
    return os.environ.get("MD_SHM", "1") != "0" and core() is not None


def host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def segment_name(prefix: str = PREFIX) -> str:
    return f"/{prefix}.{os.getpid()}.{secrets.token_hex(6)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def segments(prefix: str = PREFIX) -> list[str]:
    """Names of this prefix's segments in /dev/shm."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "."))
    except OSError:
        return []


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Unlink segments whose creator (the pid in the name) is gone; returns their names."""
    gone = []
    for name in segments(prefix):
        try:
            pid = int(name.split(".")[1])
        except (IndexError, ValueError):
            continue
        if not _alive(pid):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                gone.append(name)
            except OSError:
                pass
    return gone


class _Done:
    """A finished work (shared-memory collectives complete before they return)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class _Pending:
    """A send handed to the group's sender thread."""

    def __init__(self, future: Future):
        self.future = future

    def wait(self, timeout: Any = None) -> bool:
        self.future.result()
        return True

    def is_completed(self) -> bool:
        return self.future.done()


_DONE = _Done()


class ShmProcessGroup:
    """A process group over shared memory, with gloo behind it for what it does not cover."""

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        name=None,
        capacity: int = CAPACITY,
        ring: int = RING,
        size_limit: int = SIZE_LIMIT,
    ):
        if core() is None:
            raise RuntimeError(f"shared-memory collectives unavailable: {unavailable_reason()}")
        self.store = store
        self._rank = rank
        self._size = size
        self.timeout = timeout
        self.size_limit = size_limit
        if rank == 0:
            sweep_stale()
            name = name or segment_name()
            store.set("shm/name", name)
        else:
            name = store.get("shm/name").decode()
        self.name = name
        self.shm = core().ShmGroup(name, rank, size, capacity, timeout.total_seconds(), ring)
        self._gloo = None
        self._gloo_lock = threading.Lock()
        self._sender: ThreadPoolExecutor | None = None
        self._last_send: Future | None = None
        self._send_lock = threading.Lock()

    # -------------------------------------------------------------- ProcessGroup-like
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def gloo(self):
        with self._gloo_lock:
            if self._gloo is None:
                self._gloo = dist.ProcessGroupGloo(
                    dist.PrefixStore("gloo", self.store), self._rank, self._size, self.timeout
                )
            return self._gloo

    def _fits(self, *tensors: torch.Tensor) -> bool:
        return all(
            t.device.type == "cpu"
            and t.is_contiguous()
            and t.dtype in _DTYPES
            and t.numel() * t.element_size() <= self.size_limit
            for t in tensors
        )

    @staticmethod
    def _op(opts) -> str | None:
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        for k, v in _OPS.items():
            if op == k:
                return v
        return None

    def allreduce(self, tensors, opts=None):
        if not isinstance(tensors, list | tuple):
            tensors = [tensors]
        op = self._op(opts)
        if (
            op is None
            or not self._fits(*tensors)
            or (op == "avg" and not all(t.is_floating_point() for t in tensors))
        ):
            return self.gloo().allreduce(tensors, opts or dist.AllreduceOptions())
        for t in tensors:
            self.shm.all_reduce(t, op)
        return _DONE

    def allgather(self, output_lists, inputs, opts=None):
        if not self._fits(*inputs, *(t for outs in output_lists for t in outs)):
            return self.gloo().allgather(output_lists, inputs, opts or dist.AllgatherOptions())
        for outs, x in zip(output_lists, inputs):
            self.shm.all_gather_into(list(outs), x)
        return _DONE

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = self._op(opts)
        if op is None or not self._fits(*outputs, *(t for ins in input_lists for t in ins)):
            return self.gloo().reduce_scatter(
                outputs, input_lists, opts or dist.ReduceScatterOptions()
            )
        for out, ins in zip(outputs, input_lists):
            self.shm.reduce_scatter(out, list(ins), op)
        return _DONE

    def broadcast(self, tensors, opts=None):
        root = 0 if opts is None else opts.rootRank
        if not self._fits(*tensors):
            return self.gloo().broadcast(tensors, opts or dist.BroadcastOptions())
        for t in tensors:
            self.shm.broadcast(t, root)
        return _DONE

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.gloo().alltoall_base(
            output, input, output_split_sizes, input_split_sizes, opts or dist.AllToAllOptions()
        )

    def barrier(self, opts=None):
        self.shm.barrier()
        return _DONE

    def send(self, tensors, dst: int, tag: int = 0):
        """Like gloo's: returns at once; ``wait()`` returns when the data is in shared memory
        (in order per direction: messages are matched in the order they are sent)."""
        works = []
        for t in tensors:
            if not self._fits(t):  # both sides see the same dtype and device
                works.append(self.gloo().send([t], dst, tag))
                continue
            with self._send_lock:
                idle = self._last_send is None or self._last_send.done()
                if idle and self.shm.try_send(t, dst, tag):
                    works.append(_DONE)
                    continue
                if self._sender is None:
                    self._sender = ThreadPoolExecutor(1, thread_name_prefix=f"shm-send-{dst}")
                self._last_send = self._sender.submit(self.shm.send, t, dst, tag)
                works.append(_Pending(self._last_send))
        return works[0] if len(works) == 1 else _All(works)

    def recv(self, tensors, src: int, tag: int = 0):
        for t in tensors:
            if self._fits(t):
                self.shm.recv(t, src, tag)
            else:
                self.gloo().recv([t], src, tag).wait()
        return _DONE

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=False)
        self.shm.close()

    def __repr__(self) -> str:
        return f"ShmProcessGroup({self.name}, rank {self._rank} of {self._size})"


class _All:
    def __init__(self, works):
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait()
        return True


def all_local(store, rank: int, size: int) -> bool:
    """Whether every member of the group whose store (prefix) this is runs on this host. Each
    member calls it at the same point (when the group is made): it publishes its host id and
    reads the others'."""
    mine = host_id()
    store.set(f"host/{rank}", mine)
    return all(store.get(f"host/{r}").decode() == mine for r in range(size) if r != rank)


def make_group(
    store,
    members: list[int],
    rank: int,
    timeout: datetime.timedelta,
    device: torch.device | str = "cpu",
) -> ShmProcessGroup | None:
    """A shared-memory group for ``members`` (global ranks; ``store`` already prefixed for this
    (stream, members)), or None where gloo should be used: shared memory disabled or not built,
    a non-CPU device, or a member on another host. Every member must call it."""
    if torch.device(device).type != "cpu" or len(members) < 2 or not enabled():
        return None
    index = members.index(rank)
    shm_store = dist.PrefixStore("shm", store)
    if not all_local(shm_store, index, len(members)):
        return None
    return ShmProcessGroup(shm_store, index, len(members), timeout)
