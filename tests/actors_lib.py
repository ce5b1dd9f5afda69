"""Actors used by the tests (importable by the workers, so pickled by reference)."""

import asyncio
import ctypes
import os
import signal
import threading

import monarch_dsl as md


class Counter(md.Actor):
    def __init__(self, start=0):
        self.value = start
        self.gate = None

    @md.endpoint
    def incr(self, by=1):
        self.value += by
        return self.value

    @md.endpoint
    def get(self):
        return self.value

    @md.endpoint
    def where(self):
        p = md.current_rank()
        return p.rank, dict(p)

    @md.endpoint
    def pid(self):
        return os.getpid()

    @md.endpoint
    def ppid(self):
        return os.getppid()

    @md.endpoint
    def fail(self, message="boom"):
        raise ValueError(message)

    @md.endpoint
    async def adouble(self):
        await asyncio.sleep(0)
        return 2 * self.value

    @md.endpoint
    async def wait_gate(self):
        self.gate = self.gate or asyncio.Event()
        await self.gate.wait()
        return "opened"

    @md.endpoint
    async def open_gate(self):
        self.gate = self.gate or asyncio.Event()
        self.gate.set()

    @md.endpoint
    def echo(self, x):
        return x

    @md.endpoint
    def a_lambda(self):
        return lambda: 42  # the C pickler refuses it; cloudpickle sends it by value

    @md.endpoint
    def a_lock(self):
        return threading.Lock()

    @md.endpoint
    def exit_now(self, code=7):
        os._exit(code)

    @md.endpoint
    def segfault(self):
        ctypes.string_at(0)

    @md.endpoint
    def sigkill_self(self):
        os.kill(os.getpid(), signal.SIGKILL)

    def not_an_endpoint(self):
        return 1


class BadInit(md.Actor):
    def __init__(self):
        raise RuntimeError("constructor failed")


class RefTable(md.Actor):
    """Looks into this worker's tensor ref table (what a survivor holds after a death)."""

    @md.endpoint
    def held(self, ref, timeout=10.0):
        """What tensor ref ``ref`` holds once the instruction making it has run: ("failure",
        its Failure tuple), ("tensor", shape), or ("missing", None) if nothing did within
        ``timeout`` s. Then writes ``held-done`` to stderr (what came before is in the pipe)."""
        import sys
        import time

        from monarch_dsl.runtime import worker
        from monarch_dsl.runtime.failure import Failure

        table = worker.current.executor().refs
        deadline = time.monotonic() + timeout
        value = table.get(ref)
        while value is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the stream thread stores it; no event reaches an endpoint
            value = table.get(ref)
        print("held-done", file=sys.stderr, flush=True)
        if isinstance(value, Failure):
            return "failure", value.as_tuple()
        return ("missing", None) if value is None else ("tensor", tuple(value.shape))

    @md.endpoint
    def shapes(self):
        """The shapes of the tensors this worker's ref table holds, sorted."""
        import torch

        from monarch_dsl.runtime import worker

        table = worker.current.executor().refs
        values = [table.get(k) for k in table.keys()]
        return sorted(tuple(v.shape) for v in values if isinstance(v, torch.Tensor))


class Hog(md.Actor):
    """Allocates on request (tests/test_memory.py: the workers' memory budgets)."""

    def __init__(self):
        self.calls = 0

    @md.endpoint
    def allocate(self, numel, touch=True):
        import torch

        self.calls += 1
        t = torch.ones(numel) if touch else torch.empty(numel)
        return t.numel()

    @md.endpoint
    def churn(self, tensors, numel, rounds):
        """``rounds`` x (``tensors`` tensors of ``numel`` float32s made, written, freed):
        (the page faults of this thread meanwhile, the pages written)."""
        import resource

        import torch

        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(rounds):
            held = [torch.ones(numel) for _ in range(tensors)]
            del held
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        return faults, rounds * tensors * numel * 4 // resource.getpagesize()

    @md.endpoint
    def allocate_numpy(self, numel):
        import numpy

        self.calls += 1
        return numpy.ones(numel).size

    @md.endpoint
    def budget(self):
        """(this worker's budget, its RLIMIT_DATA soft limit, its private memory, its pid)."""
        import resource

        from monarch_dsl.runtime import memory

        soft = resource.getrlimit(resource.RLIMIT_DATA)[0]
        return memory.budget(), soft, memory.private(), os.getpid()


class Plans(md.Actor):
    """What the C++ runtime's compiled plans on this worker did in their last run."""

    @md.endpoint
    def reduced_in_place(self, plans: list[int]) -> list[tuple[int, int, int]]:
        """Per compiled plan of ``plans`` on this worker: (its all-reduce steps, how many of
        them its last run did in the tensors they reduce, how many of those in a block of
        shared memory)."""
        from monarch_dsl.runtime import worker

        runner = worker.current.executor().plans()
        return sorted(
            (
                sum(
                    s is not None and s.kind == "all_reduce" for s in runner.programs[k[0]][0].steps
                ),
                c.reduced_in_place(),
                c.reduced_shared(),
            )
            for k, c in runner.compiled.items()
            if k[0] in plans
        )


def shared_last_run(mesh, step) -> list[int]:
    """Per rank of ``mesh``: how many all-reduces the last run of ``step``'s plan on the mesh
    (its last made) reduced in a block of shared memory."""
    last = max(pid for c in step.cache.values() for pid in c.ids.values())
    per_rank = mesh.spawn("plans", Plans).reduced_in_place.call([last]).get().values()
    return [made[0][2] for made in per_rank]
