"""Memory budgets of CPU workers (SPEC §8): an allocation that would get a worker killed by the
kernel's out-of-memory killer fails instead, in the worker, as a recoverable error (a
``RemoteError`` for a tensor command, an ``ActorError`` for an endpoint), like a CUDA OOM.

How: a CPU worker limits its own private writable memory (``RLIMIT_DATA``; Linux counts every
private writable mapping in it since 4.7: the heap, anonymous ``mmap``, thread stacks) to what
it has mapped when it starts serving (its *baseline*: the interpreter, torch, what ``setup()``
did) plus its *budget*. Past that, ``mmap`` and ``brk`` fail with ENOMEM before a page exists,
so every allocator says so in its own way and nothing is killed: torch's
``DefaultCPUAllocator`` raises (the eager op or remote function fails), numpy and Python raise
``MemoryError``.

Why a limit on the process and not a hook in torch's CPU allocator:

- it bounds every allocator -- tensors, numpy arrays, Python objects, the transport's receive
  buffers -- where a hook would see tensors only and leave the rest to the OOM killer;
- it refuses untouched memory (``torch.empty``) exactly as touched memory, at the allocation;
- it works the same under ``MD_EXECUTOR=python`` and in a worker without the native module
  (the C++ runtime only starts its stream threads outside it, below).

Why ``RLIMIT_DATA`` and not ``RLIMIT_AS`` (the address space): ``RLIMIT_AS`` also counts what
can never be memory of this worker's own -- shared libraries' code, glibc's 64 MiB arena
reservation per thread (``PROT_NONE``), shared-memory groups' segments (mapped whole by every
member, their pages exist once). Measured with torch 2.13: an idle worker maps 630 MiB of
address space but 220 MiB of data (160 MiB resident); a thread costs the address space up to
72 MiB (its stack and a malloc arena) and the data 8 MiB (its stack); an 8-rank shared-memory
group maps 272 MiB in every member, none of it data. Under ``RLIMIT_AS``, 8 workers with a
256 MiB budget each had no room left for their first shared-memory group.

What it still costs: everything private a worker maps after its start counts against the
budget, the runtime's own included, but for the stacks of the executors' stream threads: where
the budget has no room left for one, the limit grows by its size (``start_thread`` here,
``start_thread`` in cpp/streams.cpp), so a worker whose budget is used up still starts a
stream. A reply that finds no room left is sent again with ``GRACE`` bytes more (``grace``);
a fetch whose copy does not fit is that fetch's error. Not covered: other threads (gloo's,
asyncio's for async endpoints) fail to start as errors of what needed them; libgomp exits the
process when it cannot start the OpenMP threads of a parallel region (only where a worker runs
several torch threads, and only for a stream's first parallel op made with its budget used
up); a message from the controller bigger than what is left (``md.to_mesh`` of a local tensor
over the budget) cannot be received: the worker exits, saying so; a worker filled to its last
pages (allocating in ever smaller pieces until one fails) cannot even run the Python of its
own replies. Shared mappings (``share_memory_()``, ``/dev/shm``) do not count.

Never on CUDA workers: their host memory is not what runs out first, and CUDA maps memory of
its own that must not fail.

The budget: ``spawn_procs(memory_limit=bytes)``; by default the host's ``MemAvailable``
(/proc/meminfo) when the mesh spawns, divided among the mesh's workers on this host, so the
workers of one mesh together cannot touch more than was available. ``memory_limit=0`` turns it
off. Workers get it in ``MONARCH_DSL_MEMORY_LIMIT`` (bytes, ``0``: off); an externally launched
worker (``monarch-dsl worker``) reads the same variable, and without it takes its host's
``MemAvailable`` divided by ``LOCAL_WORLD_SIZE``; ``RemoteHosts.spawn_procs(memory_limit=)``
sets it on every worker once they joined (``Configure``).
"""

from __future__ import annotations

import contextlib
import numbers
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

ENV = "MONARCH_DSL_MEMORY_LIMIT"
# Room beyond the budget, while the runtime reports that the budget is used up (``grace``).
GRACE = 16 << 20
# What the limit grows by for a thread of the runtime's that has no room left (start_thread):
# its stack (glibc's default, RLIMIT_STACK: 8 MiB) and guard page, with room to spare.
STACK_ROOM = 9 << 20
SETTING = "spawn_procs(memory_limit=...)"


# --------------------------------------------------------------------------- the controller


def check_limit(value: object) -> int | None:
    """``memory_limit`` as given to ``spawn_procs``: bytes (an int >= 0; 0 turns the budget
    off) or None (the default). Raises TypeError or ValueError saying what was expected."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"memory_limit must be a number of bytes (an int; 0 turns the budget off) or None "
            f"for the default, got {value!r}"
        )
    if value < 0:
        raise ValueError(f"memory_limit must be >= 0 bytes (0 turns the budget off), got {value}")
    return int(value)


def _from_env(text: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{where}={text!r}: expected a number of bytes (0 turns the budget off)")
    return value


def _kib_field(path: str, name: str) -> int:
    """The ``name:  N kB`` field of a /proc file in bytes (Linux), 0 where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def host_available() -> int:
    """This host's ``MemAvailable`` in bytes (0 where unknown)."""
    return _kib_field("/proc/meminfo", "MemAvailable")


def default_budget(local_workers: int) -> int:
    """The host's available memory divided among ``local_workers`` (0: off, where unknown)."""
    return host_available() // max(1, local_workers)


def resolve(memory_limit: int | None, env: Mapping[str, str], local_workers: int) -> int:
    """The budget of each of ``local_workers`` workers this controller starts on this host
    (0: off): ``memory_limit`` (already checked), else ``MONARCH_DSL_MEMORY_LIMIT`` of the
    workers' ``env`` or of this process, else the default share."""
    if memory_limit is not None:
        return memory_limit
    text = env.get(ENV, os.environ.get(ENV))
    if text is not None:
        return _from_env(text, ENV)
    return default_budget(local_workers)


# --------------------------------------------------------------------------- the worker

_budget = 0  # bytes; 0: off
_baseline = 0  # the worker's private memory when its budget was first set
_inherited: tuple[int, int] | None = None  # RLIMIT_DATA (soft, hard) before we changed it
_graces = 0  # reports running in a grace()
_grown = 0  # what the limit grew by for the runtime's own threads (start_thread)
_set: int | None = None  # the soft limit _apply set last
_lock = threading.Lock()


def private() -> int:
    """This process's private writable mappings in bytes (``VmData``: what RLIMIT_DATA counts),
    0 where unknown."""
    return _kib_field("/proc/self/status", "VmData")


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
RETAIN_BELOW = 32 << 20  # glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)


def retain_freed_memory() -> bool:
    """Keep freed memory in this process for its next allocations (glibc only; off with
    ``MD_MALLOC_RETAIN=0``). A worker allocates and frees the same multi-MiB tensors every
    step (an all-gathered weight, a gradient before its reduce-scatter), and by default glibc
    gives such memory back to the kernel as it is freed: the next step's first write to each
    page is a page fault. With 8 x Linear(1024) under ``md.fully_shard`` on 2 ranks that was
    1,500-2,100 faults and 16-20 ms of kernel time per step (now 150-600). So: blocks up to
    ``RETAIN_BELOW`` come from the heap, not an ``mmap`` each, and the heap is never trimmed.
    (Not also one arena for all threads, ``M_ARENA_MAX=1``, which took the faults to ~100:
    with it a worker whose budget was used up hung starting a stream, in tests/test_memory.py;
    likely, not confirmed, because its thread's first allocation then needed a 1 MiB mapping
    of the full main heap, where an arena of its own needs 132 KiB.) What a worker holds stays
    at its peak, as torch's CUDA caching allocator keeps it, and counts against its budget.
    Returns whether glibc took the settings."""
    if os.environ.get("MD_MALLOC_RETAIN", "1") == "0":
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, RETAIN_BELOW),  # (fixed: glibc's own adjustment of both ends)
        (_M_TRIM_THRESHOLD, 2**31 - 1),
    )
    return all([bool(mallopt(k, v)) for k, v in settings])


def apply_from_env(device, local_world_size: int) -> None:
    """At a worker's start: its budget from ``MONARCH_DSL_MEMORY_LIMIT``, else its host's
    default share (``resolve``, as the controller that started it). CUDA workers get none (see
    the module's docstring)."""
    if device.type != "cpu":
        return
    set_budget(resolve(None, os.environ, local_world_size))


def set_budget(budget: int) -> None:
    """Limit this process's private memory to its baseline plus ``budget`` bytes (0: lift our
    limit). Never above a limit the process was started with."""
    global _budget, _baseline, _inherited
    import resource

    with _lock:
        if _inherited is None:
            _inherited = resource.getrlimit(resource.RLIMIT_DATA)
            _baseline = private()
        _budget = budget if _baseline else 0
        _apply()


T = TypeVar("T")


@contextlib.contextmanager
def grace():
    """``GRACE`` bytes beyond the budget for the runtime to say the budget is used up: a reply
    that found no room left (a worker used up to its last pages) is sent again in one."""
    global _graces
    with _lock:
        _graces += 1
        if _inherited is not None:
            _apply()
    try:
        yield
    finally:
        with _lock:
            _graces -= 1
            if _inherited is not None:
                _apply()


def or_in_grace(fn: Callable[[], T]) -> T:
    """``fn()``; where that found no room left (MemoryError: a worker used up to its last
    pages), ``fn()`` once more in the grace room. For what the runtime owes its controller: a
    reply, and the failure it reports."""
    try:
        return fn()
    except MemoryError:
        with grace():
            return fn()


def start_thread(thread: threading.Thread) -> None:
    """Start ``thread``, one of the runtime's own (an executor's stream). Its stack is the
    runtime's, not the user's: where the budget has no room left for it, the limit grows by
    ``STACK_ROOM`` (the C++ executor's streams do the same: cpp/streams.cpp)."""
    global _grown
    try:
        thread.start()
        return
    except RuntimeError:  # "can't start new thread"
        with _lock:
            if not _budget:
                raise
            _grown += STACK_ROOM
            _apply()
    thread.start()


def _apply() -> None:
    """RLIMIT_DATA from the budget (under ``_lock``)."""
    global _grown, _set
    import resource

    assert _inherited is not None
    soft, hard = _inherited
    now = resource.getrlimit(resource.RLIMIT_DATA)[0]
    if _set is not None and _set != resource.RLIM_INFINITY and now > _set:
        _grown += now - _set  # grown by cpp/streams.cpp for a stream thread of its own
    if _budget:
        want = _baseline + _budget + _grown + (GRACE if _graces else 0)
        soft = want if soft == resource.RLIM_INFINITY else min(soft, want)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    _set = soft


def inherited_data_limit() -> int:
    """The RLIMIT_DATA soft limit this process started with (before any budget), for the
    processes it starts (``pm.run_spmd``'s ranks on remote hosts): -1 for none."""
    import resource

    soft = _inherited[0] if _inherited is not None else resource.getrlimit(resource.RLIMIT_DATA)[0]
    return -1 if soft == resource.RLIM_INFINITY else int(soft)


def budget() -> int:
    """This worker's budget in bytes (0: none)."""
    return _budget


# How allocators say the limit is reached: torch's CPU allocator (its message names the
# bytes asked), numpy's (a size in its own units), Python's (nothing).
_TORCH = re.compile(r"DefaultCPUAllocator: .*?allocate (\d+) bytes")
_NUMPY = re.compile(r"Unable to allocate (\d+(?:\.\d*)?) ([KMGTPE]?i?B)")
_PYTHON = re.compile(r"^(_Array)?MemoryError\b")


def _asked(error: str) -> str | None:
    """The size an allocation failure ``error`` (``Type: message``) asked for, in words ("" when
    it does not say); None: not an allocation failure."""
    m = _TORCH.search(error)
    if m:
        return size_text(int(m.group(1)))
    m = _NUMPY.search(error)
    if m:  # "8.00 GiB", "400. MiB"
        return f"{float(m.group(1)):g} {m.group(2)}"
    return "" if _PYTHON.match(error) else None


def exceeded(asked: str) -> str:
    """The sentence that says an allocation of ``asked`` exceeded this worker's budget."""
    if asked:
        what = f"asked for {asked}, more than is left"
    else:
        what = "an allocation did not fit in what is left"
    return (
        f"worker memory budget exceeded: {what} of this worker's {size_text(_budget)} budget "
        f"({SETTING})"
    )


def explain(error: str) -> str:
    """A failure's ``error`` text (``Type: message``), saying so when it is this worker's budget
    that an allocation exceeded (the same text for the same failure: the controller matches
    the reports of one failure by it)."""
    if not _budget:
        return error
    asked = _asked(error)
    if asked is None:
        return error
    kind, _, message = error.partition(": ")
    return f"{kind}: {exceeded(asked)}." + (f" {message}" if message else "")


def annotate(exc: BaseException) -> None:
    """Add to ``exc`` (raised in an endpoint) a note saying it exceeded this worker's budget,
    if it is an allocation failure that did (a traceback's last line is its last note)."""
    if not _budget:
        return
    asked = _asked(f"{type(exc).__name__}: {exc}")
    if asked is not None and exceeded(asked) not in getattr(exc, "__notes__", ()):
        exc.add_note(exceeded(asked))


def size_text(nbytes: float) -> str:
    """``nbytes`` in binary units: ``256 MiB``, ``1.5 GiB``."""
    for unit, div in (
        ("PiB", 1 << 50),
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ):
        if nbytes >= div:
            v = nbytes / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{nbytes:.0f} B"
