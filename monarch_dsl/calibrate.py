"""``monarch-dsl calibrate``: measure this machine into the ``"cpu-local"`` device profile.

Everything is measured on real local workers, through the runtime the steps use:

- **Compute** (on a mesh of the smallest ``--ranks``, every rank at once, each with the
  intra-op threads a worker has): ops in a C++ ``CompiledPlan`` (``_core``), timed in the
  workers, the slower rank's median. Each run cycles through up to ``OPERAND_SETS`` sets of
  inputs (``operand_sets``), so large operands come from memory, as a layer's weights do in a
  training step, and small ones from the cache. A tiny op's time is the
  dispatch overhead in a loop of one op (the rates below are net of it; the profile's
  ``dispatch_overhead`` is a step's CPU in a compiled plan called as a training loop calls
  it: see ``_calls``). ``a + b`` of each size gives the ``bandwidth_curve`` (bytes read and
  written / s): the caches make that rate depend on the size several-fold, so one number
  would be wrong for most ops. The "pointwise" efficiency is then 1 by construction;
  "reduction" (``sum``) and "other" (``clone``) are their rate over the curve's at the same
  sizes (median). Square float32 matmuls, thin ones (n/32 x n x n: a batch through a
  layer) and wide ones (n x n/32 x n: a weight's gradient over a small batch) give the
  ``matmul_curve`` (FLOP/s of the arithmetic by FLOPs), ``matmul_passes`` and
  ``matmul_output_passes`` (``fit_matmul``); float64 / bfloat16 / float16 at one size give
  their peaks relative to float32's. Rates are work / (time - dispatch overhead), as the
  simulator adds the overhead back (``compiler/simulate.py:compute_time``).
  The adds and the matmul grid are measured a second time with the operands in the cache
  (``WARM_KINDS``: cycling through at most a quarter of the last-level cache, all ranks
  together), where the first measurement cycled through more: the profile's ``warm_*`` tables
  and ``cache_bytes``, for steps whose data is still in the cache (a small model's weights
  between micro-batches; ``DeviceProfile.warm``).
- **Overheads seen from the controller** (same mesh): eager programs (``EAGER_TERMS``: ``y =
  x + 1``, ``reduce_``, a borrow and its drop, ``autograd.grad`` of a chain of ops,
  ``md.grad_generator`` over a chain of layers), each run on the mesh (the controller's CPU,
  all its threads, and the workers') and on an ``md.Simulator`` (how often it charges each
  term, and the program's own Python it measured as it ran there), give the controller's CPU
  per instruction beyond that Python (``controller_measured``; ``controller_overhead``,
  ``controller_reduce``, ``controller_borrow``, ``controller_backward``,
  ``controller_switch``: each program's CPU less what the terms before it explain) and the
  workers' per eager op beyond its compute (``eager_op_overhead``); where the ranks and the
  controller share the cores, ``WAIT_OPS`` ops then a ``reduce_``, its workers' CPU against
  the simulator's, gives the workers' wait in an eager collective (``collective_wait``:
  their CPU beyond the model's over their work in the batch before it); what a
  call of a compiled step costs beyond its steps, called back to back while the ranks are
  busy (``_calls``, ``_call_costs``): the controller's CPU per call, per input and per result,
  a local argument's sending, the workers' ``plan_overhead``
  (``compiler/simulate.py:steady_step_time``), and ``dispatch_overhead``: a step's CPU in a
  plan of ``PLAN_STEPS`` tiny steps called back to back (1.6-2.3x the loop of one op on a
  2-core EPYC, whose cores the controller and the other rank share meanwhile; on a GPU, its
  launch: 1.2x the loop on an H200).
- **Collectives** (a mesh of each ``--ranks`` size): float32 all-reduces of several sizes,
  each a communication step of a ``CompiledPlan`` run by ``run_plan`` on the group the
  runtime gives plan collectives on this host (``Executor.process_group``: shared memory,
  ``runtime/shm.py``) and on that group's gloo group (what the runtime falls back to, and
  what another host uses), alternating, after a barrier; an all-reduce is a bucket of
  ``BUCKET_PIECES`` tensors, as data-parallel steps reduce gradients (each its own tensor,
  dying at the step: reduced in place, as a step's gradients are). One repetition's time is
  the slowest rank's, and the median over repetitions is kept. Alpha (seconds per round) and
  beta (bytes/s per rank) are fitted by least squares of the relative error over the
  simulator's model, ``alpha * rounds + traffic / beta`` (``compiler/simulate.py:traffic``),
  per backend and group size: ``links["shm@4"]`` for 4 ranks, ``links["shm"]`` the smallest
  size's (4 ranks on 2 cores are not 2 ranks: each gets half a core); each link also keeps
  beta at each measured size (``Link.curve``: through the caches, one beta misses by up to
  50%), and shared memory's says it does not overlap compute (``Link.overlap``). All-gathers,
  reduce-scatters and send/recv pairs are measured too and shown beside the link's
  prediction (``FIT_KINDS``); each kind's ratio to it, by size, is the link's factor for
  that kind (``Link.factors``).

The machine should be otherwise idle: the CPU time other processes took while calibrating is
measured (``/proc/stat``) and, above ``BUSY_WARNING``, said in the table and the notes. On a
virtual machine the host takes CPU time from it unseen (``steal`` in ``/proc/stat``: tens of
percent for minutes on a shared host): each measurement (a compute or collective one, a
round of an eager or replayed program, a block of compiled calls) during which it took more
than ``STEAL_MAX`` of the CPU is taken again, up to ``STEAL_RETRIES`` times, and the least
stolen kept (:func:`unstolen`); a compute or collective one still stolen is taken once more
after the rest of its mesh's (``_Takes``). The table says how much was stolen.

``run(quick=False, ranks=(2, 4)) -> DeviceProfile``; :func:`measure` also returns what was
measured, :func:`table` prints it. ``--quick``: small sizes and few repetitions (seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils import _pytree as pytree

from monarch_dsl.actor import Actor, endpoint
from monarch_dsl.compiler.profile import BUILTIN, DeviceProfile, Link, calibrated_path
from monarch_dsl.compiler.simulate import BLOCK_KIND, PLANNED_BYTES, traffic
from monarch_dsl.runtime.memory import size_text as _size

# ---- what is measured ----------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Sizes and repetitions: matmuls (square, n x n x n), pointwise ops (float32 elements),
    collectives (float32 bytes: an all-reduce's tensor, an all-gather's output)."""

    matmul: tuple[int, ...]
    thin: tuple[int, ...]  # n/32 x n x n matmuls (matmul_passes)
    wide: tuple[int, ...]  # n x n/32 x n matmuls (matmul_output_passes)
    shapes: tuple[tuple[int, ...], ...]  # m, k and n sizes of a grid of m x k x n matmuls
    pointwise: tuple[int, ...]
    comm: tuple[int, ...]
    reps: int  # timed repetitions of each measurement (after a warm-up)
    run_seconds: float  # the length of one timed run of a compute measurement
    dtypes: bool  # float64 / bfloat16 / float16 peaks (else float32's ratios below)
    eager_ops: int  # eager ops in a row (controller_overhead; the other terms' as long)
    plan_calls: int  # compiled-step calls in a row (plan_overhead, ...)
    elementwise: tuple[str, ...] = ()  # pointwise ops timed per element (ELEMENTWISE_NUMEL)
    dtype_size: int = 256  # the matmul size at which other dtypes are compared with float32
    # turns of the eager programs, each running every program once (medians): on a shared
    # host the CPU an op takes drifts by tens of percent within minutes, and every program
    # sees the same drift
    eager_rounds: int = 9


FULL = Settings(
    matmul=(32, 64, 128, 256, 512, 1024),
    thin=(512, 1024, 2048),
    wide=(512, 1024, 2048),
    # (a batch of 16 rows to 1024, through layers 64 to 2048 wide, and a weight's gradient over
    # a batch of 16 to 2048 rows, k: DeviceProfile.matmul_shapes)
    shapes=((16, 64, 256, 1024), (16, 64, 256, 1024, 2048), (64, 256, 1024, 2048)),
    # (not larger: an output above glibc's mmap threshold, 32 MiB, is mapped and faulted in
    # anew at every op, which measures the allocator, not the memory)
    pointwise=(1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22),
    comm=(4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20),
    reps=7,
    run_seconds=0.03,
    dtypes=True,
    eager_ops=1000,
    plan_calls=200,
    elementwise=("tanh", "sigmoid", "exp", "gelu", "silu", "erf", "sin", "cos"),
)
QUICK = Settings(
    matmul=(32, 256),
    thin=(512,),
    wide=(512,),
    shapes=((16, 256), (64, 512), (64, 512)),
    pointwise=(1 << 14, 1 << 20),
    comm=(4 << 10, 1 << 20),
    reps=3,
    run_seconds=0.005,
    dtypes=False,
    eager_ops=300,
    plan_calls=30,
    elementwise=("tanh",),
    eager_rounds=3,
)
# --device cuda: one GPU. Larger sizes (a GPU reaches its rates only there: a 1024^3 matmul is
# still mostly launch); other dtypes at 4096, where bfloat16's tensor cores are busy. Small
# matmuls too: below 256^3 a GPU's matmul takes about as long whatever its size (a launch, not
# work: ``DeviceProfile.small_op_floor``), and a small model's steps are made of them.
CUDA = Settings(
    matmul=(32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
    thin=(),  # (a GPU's matmuls are a roofline: no matmul_passes to fit)
    wide=(),
    shapes=(),
    pointwise=(1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26),
    comm=(),
    reps=7,
    run_seconds=0.03,
    dtypes=True,
    eager_ops=1000,
    plan_calls=200,
    dtype_size=4096,
)
CUDA_QUICK = dataclasses.replace(
    CUDA,
    matmul=(64, 2048),
    pointwise=(1 << 16, 1 << 22),
    reps=3,
    run_seconds=0.005,
    dtypes=False,
    eager_ops=300,
    plan_calls=30,
    eager_rounds=3,
)
DEVICES = ("cpu", "cuda")
OPERAND_SETS = 16  # distinct inputs a compute measurement cycles through (operand_sets)
DTYPE_SIZE = FULL.dtype_size
# Without a measurement (--quick): other dtypes' peaks as the placeholder's ratios.
DTYPE_RATIOS = {"float64": 0.5, "bfloat16": 0.5, "float16": 0.2}
BACKENDS = ("shm", "gloo")
# An all-reduce is measured as a gradient bucket of this many tensors (what moves the most bytes
# in a data-parallel step: the C++ runtime reduces the pieces where they are into one buffer).
BUCKET_PIECES = 8
# Measured a second time with the operands in the cache (``DeviceProfile.warm_*``): the adds of
# the bandwidth curve and the matmul grid, each cycling through at most a quarter of the
# last-level cache with all ranks together, where their first measurement cycled through more.
WARM_KINDS = ("add ", "mm ")
WARM_BELOW = 0.85  # a warm time counts where it is below this share of the cold one (_profile)
BUSY_WARNING = 0.15  # of the CPU taken by other processes: the measurements are suspect
STEAL_MAX = 0.05  # of the CPU the host took from this VM in a measurement: it is taken again
STEAL_RETRIES = 3  # ... at most this many more times (the least stolen is kept)
# What alpha and beta are fitted from: all-reduces (what data-parallel and tensor-parallel
# steps do). All-gathers, reduce-scatters and send/recv are measured too: through shared
# memory they cost more per call than an all-reduce of as much traffic (an all-gather
# allocates and concatenates its output; a send goes through a ring), and one alpha and beta
# fitted to all the kinds fit none of them. Each other kind's ratio of measured to fitted
# time, by size, is the link's factor for it (``Link.factors``).
FIT_KINDS = ("all_reduce",)


def check_ranks(ranks: Iterable[int], what: str = "ranks") -> tuple[int, ...]:
    """The group sizes to measure collectives at, sorted and without repeats; each an int >= 2
    (``TypeError`` / ``ValueError`` otherwise, naming the argument ``what``)."""
    out = []
    for n in ranks:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{what}: expected integers >= 2, got {n!r}")
        if n < 2:
            raise ValueError(f"{what}: a collective needs at least 2 ranks, got {n}")
        out.append(n)
    if not out:
        raise ValueError(f"{what}: give at least one group size, e.g. 2,4")
    return tuple(sorted(set(out)))


def parse_ranks(text: str) -> tuple[int, ...]:
    """``--ranks 2,4`` -> (2, 4) (``ValueError`` with what was wrong)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(
            f"--ranks: expected comma-separated integers >= 2 (e.g. 2,4), got {text!r}"
        )
    return check_ranks((int(p) for p in parts), "--ranks")


# ---- in the workers -------------------------------------------------------------------------


def _program(op: str, args: tuple, n_args: int, sets: int, count: int) -> Any:
    """``count`` compute steps ``op(*args)``, the ``j``-th on the ``j % sets``-th of ``sets``
    sets of ``n_args`` inputs (``args`` names the first set's); each result is kept until
    ``sets`` steps later, so the results cycle through ``sets`` buffers as the inputs do: a
    large one is written to memory the caches no longer hold, as a training step's weight
    gradients (each its own buffer, 32 MiB of them in an 8 x Linear(1024)) are. (Freed at
    once, the next result got the same, cached, buffer: a 1024 x 32 x 1024 matmul's 4 MiB
    result took 1.0 ms so, 1.4-2.2 ms into 12 buffers in turn, on a 2-core EPYC.)"""
    from monarch_dsl import isa

    def shifted(v: Any, by: int) -> Any:
        return isa.Slot(v.index + by) if isinstance(v, isa.Slot) else v

    n_inputs = n_args * sets
    steps = tuple(
        isa.Compute(
            name=op,
            args=tuple(shifted(a, (j % sets) * n_args) for a in args),
            outs=(n_inputs + j,),
            frees=(n_inputs + j - sets,) if j >= sets else (),
        )
        for j in range(count)
    )
    return isa.Program(op, (), (), steps, n_inputs + count, tuple(range(n_inputs)), (), (), ())


def _set_bytes(spec: OpSpec) -> int:
    """The bytes of one set of ``spec``'s inputs (``Probe.compute``'s)."""
    return sum(math.prod(s) for s in spec.shapes) * getattr(torch, spec.dtype).itemsize


def operand_sets(set_bytes: int, span: int) -> int:
    """How many distinct sets of inputs a compute measurement cycles through: ``OPERAND_SETS``,
    or fewer where they would take more than ``span`` bytes (twice the last-level cache). Small
    operands then stay in the cache and large ones come from memory, as in a training step,
    where an op's large inputs (a layer's weights) were last touched a whole pass ago."""
    return max(1, min(OPERAND_SETS, span // max(1, set_bytes)))


def cache_span(base: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Twice the last-level cache (Linux sysfs: the largest of ``base``'s ``index*/size``),
    else 64 MiB. Other entries there (``uevent``) and unreadable ones are skipped, so the
    answer does not depend on the order the directory lists them in."""
    best = 0
    try:
        entries = os.listdir(base)
    except OSError:
        entries = []
    for index in entries:
        if not index.startswith("index"):
            continue
        try:
            with open(os.path.join(base, index, "size")) as f:
                text = f.read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return 2 * best if best else 64 << 20


@dataclass(frozen=True)
class OpSpec:
    """One compute measurement: ``op`` (``aten.mm.default``) on inputs of ``shapes`` and
    ``dtype``, ``args`` naming them by slot (``isa.Slot``)."""

    label: str
    op: str
    args: tuple
    shapes: tuple[tuple[int, ...], ...]
    dtype: str = "float32"


class Probe(Actor):
    """Times compute steps and communication steps of ``CompiledPlan``s in a worker."""

    def __init__(self, members: list[int]) -> None:
        self.members = list(members)  # the mesh's global ranks (its group's members)
        self._group: Any = None

    def _group_and_core(self) -> tuple[Any, Any, Any]:
        """The worker's executor, its C++ runtime, and the mesh's process group (None on a
        mesh of one rank)."""
        from monarch_dsl import _core
        from monarch_dsl.runtime import worker

        assert worker.current is not None
        ex = worker.current.executor()
        core = _core.worker_native()
        if core is None:
            raise RuntimeError(
                "calibration needs the C++ runtime in the workers (MD_EXECUTOR is 'python', "
                f"or it is not built: {_core.unavailable_reason()})"
            )
        if self._group is None and len(self.members) > 1:
            self._group = ex.process_group(self.members, "calibrate")
        return ex, core, self._group

    def _barrier(self) -> None:
        if len(self.members) == 1:  # (no group: a one-GPU mesh would make an NCCL one)
            return
        _, _, group = self._group_and_core()
        work = group.barrier()
        if work is not None:
            work.wait()

    @endpoint
    def cpu_seconds(self) -> float:
        """The CPU time this worker process has used (all its threads)."""
        return time.process_time()

    @endpoint
    def plan_cpu(self) -> tuple[int, float, float]:
        """Plan runs so far, their steps' CPU seconds, and this process's CPU seconds."""
        ex, _, _ = self._group_and_core()
        runner = ex.plans()
        return runner.runs, runner.steps_cpu, time.process_time()

    @endpoint
    def backends(self) -> list[str]:
        """The backends this mesh's plan collectives can use: shared memory (when the runtime
        chose it for this group) and gloo."""
        from monarch_dsl.runtime.shm import ShmProcessGroup

        _, _, group = self._group_and_core()
        return ["shm", "gloo"] if isinstance(group, ShmProcessGroup) else ["gloo"]

    @endpoint
    def device_info(self) -> dict[str, Any]:
        """The worker's device: ``type``, and for a GPU its ``name``, ``memory`` (bytes) and
        ``span`` (twice its L2 cache: ``cache_span``'s)."""
        ex, _, _ = self._group_and_core()
        if ex.device.type != "cuda":
            return {"type": ex.device.type}
        props = torch.cuda.get_device_properties(ex.device)
        l2 = getattr(props, "L2_cache_size", 0) or 32 << 20
        return {
            "type": "cuda",
            "name": props.name,
            "memory": float(props.total_memory),
            "span": 2 * l2,
        }

    @endpoint
    def compute(self, spec: OpSpec, reps: int, run_seconds: float, span: int) -> float:
        """Median seconds per op of ``spec``, in runs of about ``run_seconds`` through
        ``operand_sets(..., span)`` sets of inputs, on the worker's device (a GPU's runs end
        when its kernels have: ``torch.cuda.synchronize``)."""
        from monarch_dsl.compiler.lower import core_steps
        from monarch_dsl.isa import Slot

        ex, core, _ = self._group_and_core()
        dtype = getattr(torch, spec.dtype)
        sets = operand_sets(_set_bytes(spec), span)
        device = ex.device
        inputs = [torch.randn(s, device=device).to(dtype) for _ in range(sets) for s in spec.shapes]
        cuda = device.type == "cuda"

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(device)

        def timed(count: int) -> Callable[[], float]:
            program = _program(spec.op, spec.args, len(spec.shapes), sets, count)
            compiled = core.CompiledPlan(core_steps(program, None, ex.device), Slot)

            def run() -> float:
                env = core.Env(program.n_slots)
                for i, t in enumerate(inputs):
                    env[i] = t
                sync()
                start = time.perf_counter()
                failed = compiled.run(env, 0, count)
                sync()
                seconds = time.perf_counter() - start
                if failed != -1:
                    raise RuntimeError(f"{spec.label}: {compiled.last_error()}")
                return seconds

            return run

        self._barrier()
        one = timed(1)
        first = min(one() for _ in range(3))  # (the first allocates its buffer)
        count = max(2 * sets, min(5000, round(run_seconds / max(first, 1e-7))))
        run = timed(count)
        run()
        return statistics.median(run() for _ in range(reps)) / count

    @endpoint
    def comm(self, backend: str, kind: str, nbytes: int, reps: int, span: int) -> list[float]:
        """Seconds of each of ``reps`` runs (after two warm-ups) of one ``kind`` step
        (``all_reduce``: a float32 tensor of ``nbytes``; ``all_gather``: an output of
        ``nbytes``; ``reduce_scatter``: an input of ``nbytes``; ``send``: the first rank to
        the second; ``BLOCK_KIND``: the all-reduce of a bucket in a block of shared memory,
        its time from the plan's record of the step, or none where the ranks could not have
        a block) on ``backend``, each after a
        barrier, on the next of ``operand_sets(..., span)`` inputs (a gradient bucket's
        tensors were last touched a while ago)."""
        from monarch_dsl import isa
        from monarch_dsl.isa import Slot

        ex, core, group = self._group_and_core()
        g = group if backend == "shm" or not hasattr(group, "gloo") else group.gloo()
        n = len(self.members)
        assert worker_rank() in self.members
        index = self.members.index(worker_rank())
        numel = max(1, nbytes // 4)
        common = dict(dims=(0,), dtype="float32")
        peer = -1
        pieces = 1
        before: list[Any] = []  # the collective plan's steps before it (None: run by copies)
        copies = None  # the steps making the all-reduce's arguments
        if kind in ("all_reduce", BLOCK_KIND):  # a bucket: BUCKET_PIECES tensors, as one
            pieces = BUCKET_PIECES if numel >= BUCKET_PIECES else 1
            part = numel // pieces
            # (slots: the set's pieces, their copies made in C++, the results. The copies die
            # at the step and nothing else holds them: it reduces them in place, as a training
            # step's gradients -- cpp/program.cpp reduces_in_place. A tensor Python has held
            # keeps a reference there.)
            step: Any = isa.AllReduce(
                args=tuple(Slot(pieces + k) for k in range(pieces)),
                outs=tuple(range(2 * pieces, 3 * pieces)),
                frees=tuple(range(pieces, 2 * pieces)),
                shapes=((part,),) * pieces,
                **common,
            )
            x = torch.ones(part * pieces)
            copy = [
                isa.Compute(name="aten.clone.default", args=(Slot(k),), outs=(pieces + k,))
                for k in range(pieces)
            ]
            if kind == BLOCK_KIND:
                # (the copies in the plan itself, as negations, whose out= overload the runtime
                # writes with (clone's is no kernel of a device): they make the arguments, so
                # from its third run on they write them into a block of shared memory, which
                # the all-reduce reduces where it lies -- cpp/program.cpp set_up_block)
                before = [dataclasses.replace(c, name="aten.neg.default") for c in copy]
            else:
                copies = core.CompiledPlan(copy, Slot)
                before = [None] * pieces
        elif kind == "all_gather":
            part = max(1, numel // n)
            step = isa.AllGather(args=(Slot(0),), outs=(1,), shapes=((part,),), **common)
            x = torch.ones(part)
        elif kind == "reduce_scatter":  # a whole gradient in, this rank's shard out
            whole = max(1, numel // n) * n
            step = isa.ReduceScatter(args=(Slot(0),), outs=(1,), shapes=((whole,),), **common)
            x = torch.ones(whole)
        elif kind == "send":
            if index > 1:  # (only the first two ranks take part)
                return []
            cls = isa.Send if index == 0 else isa.Recv
            peer = 1 - index
            step = cls(
                args=(Slot(0),) if index == 0 else (),
                outs=() if index == 0 else (1,),
                peer=peer,
                shapes=((numel,),),
                **common,
            )
            x = torch.ones(numel)
        else:
            raise ValueError(f"unknown collective {kind!r}")
        inputs = [x] + [x.clone() for _ in range(operand_sets(x.nbytes, span) - 1)]
        slots = 3 * pieces if kind in ("all_reduce", BLOCK_KIND) else 2
        program = isa.Program(kind, ("r",), (n,), (step,), slots, (0,), (), (), ())
        compiled = core.CompiledPlan([*before, None], Slot)
        compiled.set_comm(
            len(before), step, group=g, index=index, size=n, peer=peer, async_=False,
            slot_type=Slot,
        )  # fmt: skip
        compiled.set_trace(kind == BLOCK_KIND)
        times: list[float] = []
        in_block: list[bool] = []
        for i in range(reps + 2):
            env = core.Env(program.n_slots)
            for k, piece in enumerate(inputs[i % len(inputs)].chunk(pieces)):
                env[k] = piece
            if copies is not None and copies.run(env, 0, pieces) != -1:
                raise RuntimeError(f"{kind} on {backend}: {copies.last_error()}")
            self._barrier()
            start = time.perf_counter()
            failed = compiled.run_plan(env, ex.device, False)
            seconds = time.perf_counter() - start
            if failed != -1:
                raise RuntimeError(f"{kind} on {backend}: {compiled.last_error()}")
            # (pieces up to PLANNED_BYTES are the copying steps' kept buffers: those are held)
            if copies is not None and part * 4 > PLANNED_BYTES and compiled.reduced_in_place() != 1:
                raise RuntimeError(f"{kind} on {backend}: the bucket was not reduced in place")
            if kind == BLOCK_KIND:  # (the step alone: not the copies before it)
                if i >= 2:
                    in_block.append(compiled.reduced_shared() == 1)
                seconds = sum(e - b for k, what, b, e in compiled.last_trace() if what == 1)
            if i >= 2:
                times.append(seconds)
        if kind == BLOCK_KIND and not any(in_block):
            return []  # (no block on any rank: MD_SHM_BLOCKS=0, or over MD_SHM_SIZE_LIMIT)
        if kind == BLOCK_KIND and not all(in_block):
            raise RuntimeError(f"{kind} on {backend}: the bucket was not in a block every run")
        return times


def comm_seconds(kind: str, got: Iterable[list[float]]) -> float | None:
    """One ``Probe.comm`` measurement from every rank's seconds per run: the median over the
    runs of the slowest rank's time -- for ``BLOCK_KIND``, of the fastest's: the rank that came
    last (the others' record holds their wait for it); None where no rank has one (a block
    could not be had)."""
    ranks = [r for r in got if r]
    if not ranks:
        return None
    pick = min if kind == BLOCK_KIND else max
    return statistics.median(pick(r[k] for r in ranks) for k in range(len(ranks[0])))


def worker_rank() -> int:
    from monarch_dsl.runtime import worker

    assert worker.current is not None
    return worker.current.rank


# ---- on the controller ----------------------------------------------------------------------


@dataclass
class Calibration:
    """What :func:`measure` found: the profile, and the measurements behind it."""

    profile: DeviceProfile
    compute_ranks: int
    matmul: dict[int, float] = field(default_factory=dict)  # size -> seconds per op
    dtypes: dict[str, float] = field(default_factory=dict)  # dtype -> FLOP/s at dtype_size
    pointwise: dict[str, dict[int, float]] = field(default_factory=dict)  # op -> numel -> s
    eager_wall: float = 0.0  # seconds per eager op, until the workers are done
    # compiled steps of _calls: seconds per call, the controller's CPU per call, the steps' time
    calls: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    loop_dispatch: float = 0.0  # an op's dispatch in a loop of that op (the rates' net of it)
    # (backend, n, kind, nbytes) -> seconds (median of the slowest rank's)
    comm: dict[tuple[str, int, str, int], float] = field(default_factory=dict)
    fit_error: dict[tuple[str, int], float] = field(default_factory=dict)  # max |relative|
    seconds: float = 0.0
    dtype_size: int = DTYPE_SIZE  # the matmul size of ``dtypes``
    device: str = "cpu"  # what was measured (``DEVICES``)
    others_busy: float | None = None  # the share of the CPU other processes took meanwhile
    # the share of the CPU the host took from this VM (steal): over the whole run, and the
    # most of a CPU in one measurement kept (``unstolen``)
    steal: float | None = None
    steal_kept: float | None = None


class Progress:
    """A progress bar on stderr, redrawn in place (``\\r``); silent when stderr is not a
    terminal, or when ``quiet``."""

    def __init__(self, total: int, quiet: bool = False, stream: Any = None) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream or sys.stderr
        self.on = not quiet and self.stream.isatty()
        self.start = time.monotonic()

    def step(self, label: str) -> None:
        self.done = min(self.total, self.done + 1)
        self.show(label)

    def show(self, label: str) -> None:
        if not self.on:
            return
        width = 30
        filled = round(width * self.done / self.total)
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self.start
        text = f"\rcalibrate [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {label}"
        self.stream.write(text[:100].ljust(100))
        self.stream.flush()

    def close(self) -> None:
        if self.on:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()


@contextlib.contextmanager
def _quiet_spawn() -> Iterator[None]:
    """Spawn without the workers-ready lines (the progress bar says what happens)."""
    old = os.environ.get("MONARCH_DSL_QUIET")
    os.environ["MONARCH_DSL_QUIET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["MONARCH_DSL_QUIET"]
        else:
            os.environ["MONARCH_DSL_QUIET"] = old


ELEMENTWISE_NUMEL = 1 << 16  # (256 KiB of float32 in, as much out: the caches serve it)


def _compute_specs(s: Settings) -> list[OpSpec]:
    from monarch_dsl.isa import Slot

    ab = (Slot(0), Slot(1))
    specs = [OpSpec("dispatch", "aten.add.Tensor", ab, ((1,), (1,)))]
    specs += [OpSpec(f"matmul {n}", "aten.mm.default", ab, ((n, n), (n, n))) for n in s.matmul]
    specs += [
        OpSpec(f"thin matmul {n}", "aten.mm.default", ab, ((max(1, n // 32), n), (n, n)))
        for n in s.thin
    ]
    specs += [
        OpSpec(
            f"wide matmul {n}", "aten.mm.default", ab, ((n, max(1, n // 32)), (max(1, n // 32), n))
        )
        for n in s.wide
    ]
    if s.shapes:
        specs += [
            OpSpec(f"mm {m}x{k}x{n}", "aten.mm.default", ab, ((m, k), (k, n)))
            for m, k, n in itertools.product(*s.shapes)
        ]
    if s.dtypes:
        n = s.dtype_size
        specs += [
            OpSpec(f"matmul {n} {d}", "aten.mm.default", ab, ((n, n), (n, n)), d)
            for d in DTYPE_RATIOS
        ]
    specs += [
        OpSpec(f"elementwise {op}", f"aten.{op}.default", (Slot(0),), ((ELEMENTWISE_NUMEL,),))
        for op in s.elementwise
    ]
    for numel in s.pointwise:
        specs += [
            OpSpec(f"add {numel}", "aten.add.Tensor", ab, ((numel,), (numel,))),
            OpSpec(f"sum {numel}", "aten.sum.default", (Slot(0),), ((numel,),)),
            OpSpec(f"clone {numel}", "aten.clone.default", (Slot(0),), ((numel,),)),
        ]
    return specs


def _comm_tasks(s: Settings, n: int, backends: Sequence[str]) -> list[tuple[str, str, int]]:
    tasks = []
    kinds = ("all_reduce", "all_gather", "reduce_scatter") + (("send",) if n == 2 else ())
    for kind in (*kinds, BLOCK_KIND):
        for nbytes in s.comm:
            for b in backends:  # alternating, so drift of the machine hits both alike
                if kind != BLOCK_KIND or b == "shm":  # (blocks: shared memory's)
                    tasks.append((b, kind, nbytes))
    return tasks


def check_arguments(device: str, ranks: Iterable[int] | None) -> tuple[int, ...] | None:
    """The group sizes to measure collectives at for ``device`` (``DEVICES``): ``ranks``
    checked (``check_ranks``; None: 2 and 4), or for ``"cuda"`` None (``ranks`` must be None
    or empty, and torch must see a GPU). ``ValueError`` / ``TypeError`` / ``RuntimeError``
    naming what is wrong, before any process starts."""
    if device not in DEVICES:
        raise ValueError(f"--device: expected one of {', '.join(DEVICES)}, got {device!r}")
    if device != "cuda":
        return check_ranks((2, 4) if ranks is None else ranks)
    if ranks:
        raise ValueError(
            "--ranks: collectives are not measured with --device cuda (compute and "
            "overheads on one GPU; the links are the built-in profile's)"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            "--device cuda: torch sees no CUDA GPU here (torch "
            f"{torch.__version__}, CUDA {torch.version.cuda or 'not built in'})"
        )
    return None


def measure(
    quick: bool = False,
    ranks: Iterable[int] | None = (2, 4),
    progress: bool = True,
    device: str = "cpu",
) -> Calibration:
    """Start local meshes, measure (see the module's docstring), return the profile and the
    measurements. ``progress``: a bar on stderr (when it is a terminal).

    ``device="cuda"``: the ``"cuda-local"`` profile of this machine's GPU, measured on one
    CUDA worker (compute at GPU sizes, ``CUDA``; the overheads as on a CPU). Collectives are
    not measured (``ranks`` must be None or empty: one GPU cannot run NCCL between ranks);
    the profile keeps the links of the built-in profile of that GPU (``gpu_base``)."""
    sizes = check_arguments(device, ranks)
    if sizes is None:
        s = CUDA_QUICK if quick else CUDA
        return _measure(s, (1,), {"MD_DEVICE": "cuda"}, progress, quick)
    return _measure(QUICK if quick else FULL, sizes, None, progress, quick)


def _measure(
    s: Settings,
    sizes: tuple[int, ...],
    env: dict[str, str] | None,
    progress: bool,
    quick: bool,
) -> Calibration:
    """:func:`measure` on meshes of ``sizes`` ranks (compute and overheads on the first; with
    ``env``, the workers' environment); a first size of 1 is a GPU's calibration (its
    profile: ``_gpu_profile``; on CPU workers too, which is how it is tested without a GPU)."""
    from monarch_dsl.proc_mesh import this_host

    gpu = sizes[0] == 1
    specs = _compute_specs(s)
    span = cache_span()
    info: dict[str, Any] = {}
    total = len(specs) + 2 + sum(len(_comm_tasks(s, n, BACKENDS)) + 1 for n in sizes)
    bar = Progress(total, quiet=not progress)
    started = time.monotonic()
    busy0, mine0, steal0 = _busy_seconds(), time.process_time(), steal_seconds()
    stolen: list[float] = []  # the share of the CPU the host took in each measurement kept
    workers_cpu = 0.0
    per_op: dict[str, float] = {}
    warm: dict[str, float] = {}  # (WARM_KINDS) label -> seconds, operands in the cache
    comm: dict[tuple[str, int, str, int], float] = {}
    eager: dict[str, float] = {}
    worker_op = eager_wall = wait_cpu = 0.0
    calls: dict[str, tuple[Any, float, float, float, float]] = {}
    try:
        for i, n in enumerate(sizes):
            bar.show(f"starting {n} workers")
            with _quiet_spawn():
                pm = this_host().spawn_procs({"r": n}, env=env)
            try:
                bar.step(f"{n} workers up")
                _set_up_collectives(pm)
                probe = pm.spawn("calibrate", Probe, list(pm.ranks))
                if gpu:
                    info = probe.device_info.call().get().values()[0]
                    span = info.get("span", span)
                if i == 0:
                    eager, worker_op, eager_wall, wait_cpu = _eager_costs(pm, probe, s, stolen)
                    eager.update(_replay_costs(pm, s, stolen))
                    bar.step("eager ops")
                    calls = _calls(pm, s.plan_calls, s.reps, probe, stolen)
                    bar.step("compiled step calls")
                backends = probe.backends.call().get().values()[0] if n > 1 else []
                takes = _Takes(stolen)
                warm_as_cold: list[str] = []  # (operands that fit: their warm time is the cold)
                if i == 0:
                    warm_span = 0 if gpu else cache_span() // 2 // (4 * n)
                    for spec in specs:
                        bar.show(spec.label)

                        def cold(got: dict, label: str = spec.label) -> None:
                            per_op[label] = max(got.values())

                        takes.take(cold, _ask, probe.compute, spec, s.reps, s.run_seconds, span)
                        if warm_span and spec.label.startswith(WARM_KINDS):
                            size = _set_bytes(spec)
                            if operand_sets(size, warm_span) < operand_sets(size, span):
                                bar.show(f"{spec.label}, operands in the cache")

                                def hot(got: dict, label: str = spec.label) -> None:
                                    warm[label] = max(got.values())

                                takes.take(
                                    hot,
                                    _ask,
                                    probe.compute,
                                    *(spec, s.reps, s.run_seconds, warm_span),
                                )
                            else:  # (measured so already: its operands fit)
                                warm_as_cold.append(spec.label)
                        bar.step(spec.label)
                tasks = _comm_tasks(s, n, BACKENDS)
                for backend, kind, nbytes in tasks:
                    label = f"{kind} {backend} {n} ranks {_size(nbytes)}"
                    if backend in backends:
                        bar.show(label)

                        def timed(got: Any, key: tuple = (backend, n, kind, nbytes)) -> None:
                            seconds = comm_seconds(key[2], got.values())
                            if seconds is not None:  # (none: a block could not be had)
                                comm[key] = seconds

                        takes.take(timed, _ask, probe.comm, backend, kind, nbytes, s.reps, span)
                    bar.step(label)
                if takes.later:
                    bar.show(f"{len(takes.later)} measurements the host took CPU from, again")
                takes.again()
                for label in warm_as_cold:
                    warm[label] = per_op[label]
                workers_cpu += sum(probe.cpu_seconds.call().get().values())
            finally:
                pm.stop()
    finally:
        bar.close()
    if gpu:
        cal = _gpu_profile(s, per_op, eager, quick, info)
    else:
        cal = _profile(s, sizes, per_op, comm, eager, quick, warm)
    cal.eager_wall = eager_wall
    cal.loop_dispatch = cal.profile.dispatch_overhead
    if calls:
        cal.profile = _call_costs(cal.profile, calls, sizes[0])
        if gpu:  # a GPU computes: its ranks do not share the host's cores for it
            cal.profile = _replace(cal.profile, host_cores=0)
        cal.calls = {
            k: (t, c, plan.simulate(profile=cal.profile).step_time)
            for k, (plan, t, c, _, _) in calls.items()
        }
    # (after the dispatch overhead is final: an eager op's worker CPU is the two together)
    cal.profile = _replace(
        cal.profile, eager_op_overhead=max(0.0, worker_op - cal.profile.dispatch_overhead)
    )
    if cal.profile.host_cores and sizes[0] + 1 > cal.profile.host_cores:
        wait = fit_collective_wait(cal.profile, sizes[0], wait_cpu, _wait_reps(s))
        cal.profile = _replace(cal.profile, collective_wait=wait)
    cal.seconds = time.monotonic() - started
    busy1, steal1 = _busy_seconds(), steal_seconds()
    if busy0 is not None and busy1 is not None:
        ours = time.process_time() - mine0 + workers_cpu
        others = max(0.0, busy1 - busy0 - ours)
        cal.others_busy = others / (cal.seconds * (os.cpu_count() or 1))
        if cal.others_busy > BUSY_WARNING:
            note = (
                f"; other processes took {cal.others_busy:.0%} of the CPU meanwhile: "
                "suspect, calibrate again on an idle machine"
            )
            cal.profile = _replace(cal.profile, notes=cal.profile.notes + note)
    if steal0 is not None and steal1 is not None and len(steal0) == len(steal1):
        cal.steal = sum(b - a for a, b in zip(steal0, steal1)) / (cal.seconds * len(steal0))
        cal.steal_kept = max(stolen, default=0.0)
        if cal.steal_kept > STEAL_MAX:
            note = (
                f"; the host took up to {cal.steal_kept:.0%} of a CPU from a measurement "
                "even after it was taken again: suspect, calibrate again"
            )
            cal.profile = _replace(cal.profile, notes=cal.profile.notes + note)
    return cal


def _cpu_lines() -> list[list[int]] | None:
    """The ``cpu`` lines of ``/proc/stat`` (Linux; jiffies): the whole machine's, then each
    CPU's; or None."""
    try:
        with open("/proc/stat") as f:
            return [[int(v) for v in line.split()[1:]] for line in f if line.startswith("cpu")]
    except (OSError, ValueError):
        return None


def steal_seconds() -> list[float] | None:
    """Per CPU, the seconds the host has taken from this virtual machine since boot
    (``steal`` in ``/proc/stat``: time the CPU wanted to run while the host ran something
    else); None where it cannot be read."""
    lines = _cpu_lines()
    if not lines or len(lines) < 2 or any(len(f) < 8 for f in lines):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return [f[7] / tick for f in lines[1:]]


T = TypeVar("T")


def unstolen(
    measure: Callable[..., T],
    *args: Any,
    retries: int = STEAL_RETRIES,
    stolen: list[float] | None = None,
) -> T:
    """``measure(*args)``, taken again (at most ``retries`` more times) while the host took
    more than ``STEAL_MAX`` of a CPU during it (the most stolen one's: a measurement may run
    on a few CPUs of many) and at least two clock ticks (one tick is 10 ms: a share of a short
    measurement); the least stolen measurement. ``stolen``: gets the share stolen during the
    one returned (where it can be read)."""
    best: tuple[float, T] | None = None
    tick = 1 / os.sysconf("SC_CLK_TCK")
    for _ in range(retries + 1):
        s0, t0 = steal_seconds(), time.perf_counter()
        got = measure(*args)
        s1, wall = steal_seconds(), time.perf_counter() - t0
        if s0 is None or s1 is None or len(s0) != len(s1) or wall <= 0:
            if best is None:  # (no steal to read: not a VM, or not Linux)
                return got
            break
        most = max(b - a for a, b in zip(s0, s1))
        share = most / wall
        if best is None or share < best[0]:
            best = (share, got)
        if share <= STEAL_MAX or most < 2 * tick - 1e-9:
            break
    assert best is not None
    if stolen is not None:
        stolen.append(best[0])
    return best[1]


class _Takes:
    """Measurements taken ``unstolen``, each handed to its ``store``; the share the host took
    from each kept goes to ``shares``. One still above ``STEAL_MAX`` after its retries is
    taken once more by ``again()`` (after the rest of a mesh's measurements: the host's busy
    spells last minutes), and the less stolen of the two kept."""

    def __init__(self, shares: list[float]) -> None:
        self.shares = shares
        self.later: list[tuple[float, Callable[[Any], None], Callable[..., Any], tuple]] = []

    def take(self, store: Callable[[Any], None], measure: Callable[..., Any], *args: Any) -> None:
        kept: list[float] = []
        store(unstolen(measure, *args, stolen=kept))
        if kept and kept[0] > STEAL_MAX:
            self.later.append((kept[0], store, measure, args))
        else:
            self.shares.extend(kept)

    def again(self) -> None:
        later, self.later = self.later, []
        for share, store, measure, args in later:
            kept: list[float] = []
            got = unstolen(measure, *args, stolen=kept)
            if kept and kept[0] < share:
                store(got)
                share = kept[0]
            self.shares.append(share)


def _ask(endpoint: Any, *args: Any) -> Any:
    """Every rank's answer to ``endpoint.call(*args)``."""
    return endpoint.call(*args).get()


def _busy_seconds() -> float | None:
    """CPU seconds all processes of this machine have used since boot (Linux ``/proc/stat``),
    or None."""
    lines = _cpu_lines()
    if not lines:
        return None
    fields = lines[0]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return (sum(fields[:7]) - idle) / os.sysconf("SC_CLK_TCK")  # (not steal: the host's)


def run(
    quick: bool = False,
    ranks: Iterable[int] | None = (2, 4),
    progress: bool = False,
    device: str = "cpu",
) -> DeviceProfile:
    """Measure this machine (:func:`measure`) and return its ``"cpu-local"`` profile, or with
    ``device="cuda"`` its ``"cuda-local"`` one (not saved: ``save(profile)`` makes it the one
    that name gives)."""
    check_arguments(device, ranks)  # (before measure: its errors are the same from here)
    return measure(quick, ranks, progress, device).profile


def _call_costs(
    p: DeviceProfile,
    calls: dict[str, tuple[Any, float, float, float, float]],
    n: int,
) -> DeviceProfile:
    """``p`` with what a call of a compiled step costs beyond its steps
    (``compiler/simulate.py:steady_step_time``), from the calls of ``_calls``. The controller:
    its CPU per call (``plan_issue``, ``plan_issue_per_input`` from 14 more inputs,
    ``plan_issue_per_output`` from 14 more results, the ``"controller"`` link from the local
    arguments: latency + the bytes sent in all / bandwidth), each against the median of the
    cases issued alike (``BASE_LIKE``). ``dispatch_overhead``: the busiest worker's CPU in the
    steps of the ``"plan steps"`` case over its steps, where measured and more than the loop
    of one op (a step's CPU in a plan: on a CPU worker its time, on a GPU's
    its launch, which sets a small step's pace there: on an H200 the calls of 200 ``add``s took
    5.7 us an add, the loop 4.9). The
    workers: where their cores are shared with the controller, their CPU per call beyond the
    plan's steps, measured in them (median of the cases); else, with the ranks busy, calls of
    the chain once and twice took ``w + chain`` and ``w + 2 chain`` (the overhead measured,
    not the simulator's guess of the chain taken off), where ``w`` is ``plan_overhead``."""
    t = {k: v for k, (_, v, _, _, _) in calls.items()}
    cpu = {k: c for k, (_, _, c, _, _) in calls.items()}
    workers = {k: w for k, (_, _, _, w, _) in calls.items()}
    # The base case's CPU: the median of the cases the controller issues alike (3 inputs, 1
    # result, nothing local; their steps differ), each a median of noisy runs.
    base = statistics.median(cpu[k] for k in BASE_LIKE)
    per_input = max(0.0, (cpu[f"+{MORE} inputs"] - base) / MORE)
    per_output = max(0.0, (cpu[f"+{MORE} results"] - base) / MORE)
    issue = max(0.0, base - 3 * per_input - per_output)
    dispatch = p.dispatch_overhead
    if calls["plan steps"][4] > 0:
        dispatch = max(dispatch, calls["plan steps"][4] / PLAN_STEPS)
    cost = {b: cpu[f"local {_size(b)}"] - base for b in LOCAL_ARG_BYTES}
    small, large = LOCAL_ARG_BYTES
    # (each rank is sent its own row of z: the bytes sent in all are z's)
    slope = (cost[large] - cost[small]) / (large - small)
    bandwidth = 1 / slope if slope > 0 else 1e12
    latency = max(0.0, cost[small] - small / bandwidth)
    w = 2 * t["base"] - t["double"]
    cores = os.cpu_count() or 1
    if n + 1 > cores and any(workers.values()):
        # Cores shared: what a worker spends beyond the steps is CPU, measured in the workers
        # (their CPU per call less the steps' CPU: no difference of two large times).
        w = statistics.median(workers.values())
    elif n + 1 > cores:  # a call took (controller + n * (chain + w)) / cores
        w = (cores * w - cpu["base"]) / n
    links = {**p.links, "controller": Link(latency, bandwidth)}
    return _replace(
        p,
        plan_overhead=max(0.0, w),
        plan_issue=issue,
        plan_issue_per_input=per_input,
        plan_issue_per_output=per_output,
        dispatch_overhead=dispatch,
        host_cores=cores,
        links=links,
    )


def _set_up_collectives(pm: Any) -> None:
    """Give the workers the store their process groups meet at (as the first collective of a
    mesh's tensor engine does)."""
    from monarch_dsl.tensor.engine import Engine

    engine = Engine.of(pm)
    engine.ensure_collectives()
    engine.sync()


def _replace(p: DeviceProfile, **changes: Any) -> DeviceProfile:
    return dataclasses.replace(p, **changes)


# Eager programs that each add one term of the controller's cost per instruction
# (``compiler/simulate_eager.py``), in the order they are solved: (name, the term).
EAGER_TERMS = (
    ("y = x + 1", "op"),
    ("reduce_", "reduce"),
    ("borrow, drop", "borrow"),
    ("autograd.grad", "backward"),
    ("grad_generator", "switch"),
)
EAGER_CHAIN = 8  # ops in the chain the backward programs differentiate
WAIT_OPS = 32  # eager ops before each reduce of the program that measures collective_wait
WAIT = f"{WAIT_OPS} ops, reduce_"  # that program (fit_collective_wait)
# Repetitions of each program: ``Settings.eager_ops`` over these (about as long each).
EAGER_DIVISOR = {"op": 1, "reduce": 4, "borrow": 4, "backward": 16, "switch": 32}


def _eager_setup(name: str, mesh: Any) -> Any:
    """The state of eager program ``name`` on ``mesh`` (tiny tensors: the workers' compute is
    negligible, the controller's work is what is measured)."""
    from monarch_dsl.tensor import Stream
    from monarch_dsl.tensor.movement import to_mesh

    if name == "autograd.grad":
        return to_mesh(torch.ones(8), mesh).requires_grad_()
    if name == "grad_generator":
        return [to_mesh(torch.ones(8), mesh).requires_grad_() for _ in range(EAGER_CHAIN)]
    if name == "borrow, drop":
        return to_mesh(torch.ones(8), mesh), Stream("calibrate")
    return to_mesh(torch.ones(8), mesh)


def _eager_body(name: str, state: Any, dim: str, n: int) -> Any:
    """``n`` repetitions of eager program ``name``; returns a mesh tensor to wait for."""
    from monarch_dsl.grads import grad_generator

    if name == "y = x + 1":
        for _ in range(n):
            y = state + 1
        return y
    if name == "reduce_":
        for _ in range(n):
            state.reduce_(dim, "avg")
        return state
    if name == "borrow, drop":
        x, stream = state
        for _ in range(n):
            _, borrow = stream.borrow(x)
            borrow.drop()
        return x
    if name == "autograd.grad":  # a chain of multiplications and its backward pass
        for _ in range(n):
            h = state
            for _ in range(EAGER_CHAIN):
                h = h * 1.5
            (g,) = torch.autograd.grad(h.sum(), [state])
        return g
    if name == WAIT:  # WAIT_OPS ops, then a reduce_ over dim
        for _ in range(n):
            for _ in range(WAIT_OPS):
                state = state * 1.0
            state.reduce_(dim, "avg")
        return state
    if name == "grad_generator":  # a chain of layers; each gradient used as it comes
        for _ in range(n):
            h = state[0]
            for w in state[1:]:
                h = h * w
            for g in grad_generator(h.sum(), reversed(state)):
                y = g + 1
        return y
    raise ValueError(f"unknown eager program {name!r}")


def _eager_costs(
    pm: Any, probe: Any, s: Settings, stolen: list[float]
) -> tuple[dict[str, float], float, float, float]:
    """The controller's CPU seconds for each term of ``EAGER_TERMS``, the workers' CPU
    seconds per eager op (``y = x + 1``), the wall seconds per op until all ran, and the
    workers' CPU seconds (their mean) per repetition of program ``WAIT`` (``WAIT_OPS`` ops,
    then a ``reduce_``; ``fit_collective_wait``), measured where the ranks and the
    controller are more processes than the cores (0 otherwise).

    Each program of ``EAGER_TERMS`` is run on ``pm`` (the controller's CPU, all its threads,
    and the workers' over ``n`` repetitions) and on an ``md.Simulator`` (how many times it
    charges each term for the same repetitions, and the program's own Python it measured:
    ``simulate_eager.Issued.python``); each program's CPU less that Python and what the terms
    solved before it explain, over the times it charges its own term, is that term (what the
    controller spends beyond the Python it runs: a profile's ``controller_measured``). The
    programs take turns (``Settings.eager_rounds`` rounds; medians; each run ``unstolen``, its
    share stolen added to ``stolen``)."""
    from monarch_dsl.simulator import Simulator
    from monarch_dsl.tensor import inspect

    n = pm.sizes["r"]
    sim = Simulator(hosts=1, gpus=n, profile=BUILTIN["cpu-local"])  # (counts, its Python)
    counts: dict[str, dict[str, int]] = {}
    python: dict[str, float] = {}  # the program's own Python, measured as it is simulated
    reps_n = {term: max(4, s.eager_ops // EAGER_DIVISOR[term]) for _, term in EAGER_TERMS}
    reps_n["wait"] = _wait_reps(s)
    try:
        for name, term in EAGER_TERMS:
            with sim.mesh.activate():
                state = _eager_setup(name, sim.mesh)
                inspect(_eager_body(name, state, "gpu", 2))
                before, py0 = dict(sim.job.sim.charged), sim.job.sim.python
                inspect(_eager_body(name, state, "gpu", reps_n[term]))
                counts[term] = {k: v - before[k] for k, v in sim.job.sim.charged.items()}
                python[term] = sim.job.sim.python - py0
    finally:
        sim.mesh.stop()

    programs = list(EAGER_TERMS)
    if n + 1 > (os.cpu_count() or 1):  # (collective_wait: only where the cores are shared)
        programs.append((WAIT, "wait"))
    cpu: dict[str, list[float]] = {term: [] for _, term in programs}
    workers: dict[str, list[float]] = {term: [] for _, term in programs}
    wall: dict[str, list[float]] = {term: [] for _, term in programs}
    with pm.activate():
        states = {}
        for name, term in programs:
            states[term] = _eager_setup(name, pm)
            inspect(_eager_body(name, states[term], "r", 2))

        def one(name: str, term: str) -> tuple[float, float, list[float]]:
            w0 = probe.cpu_seconds.call().get().values()
            start, c0 = time.perf_counter(), time.process_time()
            inspect(_eager_body(name, states[term], "r", reps_n[term]))
            took, wall_s = time.process_time() - c0, time.perf_counter() - start
            w1 = probe.cpu_seconds.call().get().values()
            return took, wall_s, [b - a for a, b in zip(w0, w1)]

        for _ in range(s.eager_rounds):
            for name, term in programs:
                took, wall_s, used = unstolen(one, name, term, stolen=stolen)
                cpu[term].append(took)
                wall[term].append(wall_s)
                # (an op: the busier worker's; the wait: the workers' mean, as the model's)
                workers[term].append(statistics.mean(used) if term == "wait" else max(used))
    terms: dict[str, float] = {}
    for _, term in EAGER_TERMS:
        explained = python[term] + sum(terms[k] * counts[term][k] for k in terms)
        got = statistics.median(cpu[term])
        terms[term] = max(0.0, (got - explained) / max(1, counts[term][term]))
    worker_op = statistics.median(workers["op"]) / reps_n["op"]
    wall_op = statistics.median(wall["op"]) / reps_n["op"]
    wait = workers.get("wait")
    wait_cpu = statistics.median(wait) / reps_n["wait"] if wait else 0.0
    return terms, worker_op, wall_op, wait_cpu


# Replayed programs (``tensor/replay.py``): runs of ``k`` ops each, for two ``k``; the
# controller's CPU per run of the two gives its cost per replayed instruction
# (``controller_replayed``) and per run (``replay_issue``).
REPLAY_OPS = (2, 32)


def _replay_body(engine: Any, state: Any, k: int, n: int) -> Any:
    """``n`` steps of ``k`` ops each (``y = y + 1`` from ``state``), each cut as
    ``md.DistributedDataParallel.forward`` cuts a step: from the third on, each is replayed
    as one plan run. Returns the last ``y``; the engine is left cut with no signature."""
    y = state
    for _ in range(n):
        engine.cut(("calibrate", k))
        y = state
        for _ in range(k):
            y = y + 1
    engine.cut(None)
    return y


def _replay_costs(pm: Any, s: Settings, stolen: list[float]) -> dict[str, float]:
    """``{"replayed": seconds per instruction, "replay": per run}``: the controller's CPU (all
    its threads) for the programs ``_replay_body`` with each of ``REPLAY_OPS``, on ``pm`` and
    on an ``md.Simulator`` (how many instructions and runs it charges: it must replay every
    step, and the workers nearly every one); each program's CPU less its Python measured in
    the simulator, solved as two equations in the two unknowns ({} where a program was not
    replayed: the profile then charges replayed instructions as eager ones)."""
    from monarch_dsl.simulator import Simulator
    from monarch_dsl.tensor import inspect
    from monarch_dsl.tensor.engine import Engine

    reps = {k: max(8, s.eager_ops // k) for k in REPLAY_OPS}
    counts: dict[int, tuple[int, int]] = {}  # k -> (instructions replayed, runs) per program
    python: dict[int, float] = {}  # k -> the program's own Python, measured in the simulator
    sim = Simulator(hosts=1, gpus=pm.sizes["r"], profile=BUILTIN["cpu-local"])
    try:
        engine = Engine.of(sim.mesh)
        engine.start_replay()
        with sim.mesh.activate():
            for k in REPLAY_OPS:
                state = _eager_setup("y = x + 1", sim.mesh)
                inspect(_replay_body(engine, state, k, 3))
                before, py0 = dict(sim.job.sim.charged), sim.job.sim.python
                inspect(_replay_body(engine, state, k, reps[k]))
                after = sim.job.sim.charged
                python[k] = sim.job.sim.python - py0
                counts[k] = (
                    after["replayed"] - before["replayed"],
                    after["replay"] - before["replay"],
                )
    finally:
        sim.mesh.stop()
    if any(runs != reps[k] for k, (_, runs) in counts.items()):
        return {}
    cpu: dict[int, list[float]] = {k: [] for k in REPLAY_OPS}
    engine = Engine.of(pm)
    replay = engine.start_replay()
    try:
        with pm.activate():
            states = {k: _eager_setup("y = x + 1", pm) for k in REPLAY_OPS}
            for k in REPLAY_OPS:
                inspect(_replay_body(engine, states[k], k, 3))

            def one(k: int) -> tuple[float, int]:
                c0, runs0 = time.process_time(), replay.replayed
                inspect(_replay_body(engine, states[k], k, reps[k]))
                return time.process_time() - c0, replay.replayed - runs0

            replayed = 0  # (of the takes kept)
            for _ in range(s.eager_rounds):
                for k in REPLAY_OPS:
                    took, runs = unstolen(one, k, stolen=stolen)
                    cpu[k].append(took)
                    replayed += runs
    finally:
        engine.stop_replay()
    if replayed < 0.9 * s.eager_rounds * sum(reps.values()):  # (a step's batch split: rare)
        return {}
    (i1, r1), (i2, r2) = (counts[k] for k in REPLAY_OPS)
    c1, c2 = (statistics.median(cpu[k]) - python[k] for k in REPLAY_OPS)  # (beyond its Python)
    det = i1 * r2 - i2 * r1
    if det == 0:
        return {}
    per_ins = (c1 * r2 - c2 * r1) / det
    per_run = (i1 * c2 - i2 * c1) / det
    # Beyond the measured Python a replayed instruction costs little (describing it at the
    # flush), and the machine's noise can solve it to <= 0: then nothing beyond its Python,
    # stored as 1 ns (0 would read as uncalibrated: charged as an eager instruction).
    return {"replayed": max(per_ins, 1e-9), "replay": max(per_run, 0.0)}


def _wait_reps(s: Settings) -> int:
    """Repetitions of program ``WAIT`` in a measurement (as long as the other programs')."""
    return max(4, s.eager_ops // 64)


def fit_collective_wait(p: DeviceProfile, ranks: int, measured: float, n: int) -> float:
    """``collective_wait`` (``compiler/simulate_eager.py``) from ``measured``, the workers' CPU
    seconds (their mean) per repetition of program ``WAIT`` on ``ranks`` ranks sharing the
    host's cores with the controller: what it is beyond the busy time the simulator gives the
    same program with profile ``p`` (its ``collective_wait`` taken as 0), over the work in
    the batch window before each collective (``window_work``); ``n`` repetitions simulated."""
    from monarch_dsl.simulator import Simulator
    from monarch_dsl.tensor import inspect

    sim = Simulator(hosts=1, gpus=ranks, profile=_replace(p, collective_wait=0.0))
    try:
        with sim.mesh.activate():
            state = _eager_setup(WAIT, sim.mesh)
            inspect(_eager_body(WAIT, state, "gpu", 2))
            job = sim.job.sim
            busy0, window0 = job.busy(), list(job.window_work)
            inspect(_eager_body(WAIT, state, "gpu", n))
            busy = statistics.mean(b - a for a, b in zip(busy0, job.busy())) / n
            window = statistics.mean(b - a for a, b in zip(window0, job.window_work)) / n
    finally:
        sim.mesh.stop()
    return max(0.0, (measured - busy) / window) if window > 0 else 0.0


LOCAL_ARG_BYTES = (8 << 10, 512 << 10)  # local tensor arguments' sizes (the controller link)
BUSY_MATMULS = 16  # 128^3 matmuls that keep the ranks busy in a measured call (about 1 ms)
MORE = 14  # the inputs and results a call's case adds to the base case
PLAN_STEPS = 200  # tiny steps of the plan whose steps' CPU gives a step's dispatch overhead
BASE_LIKE = ("base", "double", "plan steps")  # cases the controller issues alike


def _calls(
    pm: Any, calls: int, reps: int, probe: Any = None, stolen: list[float] | None = None
) -> dict[str, tuple[Any, float, float, float, float]]:
    """Compiled steps that keep every rank busy (a chain of ``BUSY_MATMULS`` 128^3 matmuls,
    as a training step does, so that what the controller and the workers spend on a call
    competes with the compute for the cores, as it does then), each with its seconds per call,
    called ``calls`` times in a row, the controller's CPU seconds per call (all its
    threads: issuing, sending, receiving) and, with ``probe``, the busiest worker's CPU
    seconds per call beyond the plan's steps (all its threads: receiving the call, the plan
    runner's Python, the failure-flag round) and in them (medians of ``reps``, the steps
    taking turns). ``"base"``: the chain, then ``+ z.sum()`` of a small sharded mesh tensor
    ``z`` (its sum: an all-reduce of one number); ``"double"``: twice the chain;
    ``"+14 inputs"``: 14 more (replicated) mesh tensors added in; ``"+14 results"``: 14 more
    results (``z * i``: a handle each, deleted when the next call replaces it, as a step's
    results are; ``simulate.call_results``); ``"local N"``: ``z`` a local tensor of N
    bytes, sent with each call as a batch passed to a data-parallel step is (each worker its
    own row);
    ``"plan steps"``: no chain, ``PLAN_STEPS`` additions to ``z`` (a step's CPU). Each block
    of calls is ``unstolen``, its share stolen added to ``stolen``."""
    from monarch_dsl.compiler.plan import Shard
    from monarch_dsl.mesh import Mesh
    from monarch_dsl.mesh_fn import mesh_fn
    from monarch_dsl.parallel.distribute import distribute
    from monarch_dsl.tensor import inspect

    def chain(times: int, results: int = 0) -> Callable[..., Any]:
        def step(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, *more: torch.Tensor):
            for _ in range(times * BUSY_MATMULS):
                x = x @ w
            x = x + z.sum()
            for m in more:
                x = x + m
            return (x, *(z * (i + 2) for i in range(results))) if results else x

        return step

    def steps(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        for _ in range(PLAN_STEPS):
            z = z + 1
        return z

    n = pm.sizes["r"]
    size = 128
    x, w = torch.randn(n * size, size), torch.randn(size, size) / size**0.5
    # x and z sharded (a batch, as data_parallel lays it out), the others replicated
    placements = {"x": {"r": Shard(0)}, "z": {"r": Shard(0)}}
    out = {"out0": {"r": Shard(0)}}
    cases: dict[str, tuple[Any, list[torch.Tensor], list[torch.Tensor]]] = {}
    # Local tensors are made here, not under pm.activate() (a factory there makes a mesh
    # tensor: the "local N" cases would pass one, and measure no sending).
    z, more = torch.ones(n, 2), [torch.ones(size) for _ in range(MORE)]
    local_args = {b: torch.ones(n, b // 4 // n) for b in LOCAL_ARG_BYTES}
    with pm.activate():
        mx, mw = distribute(x, {"r": Shard(0)}), distribute(w, {})
        mz, mmore = distribute(z, {"r": Shard(0)}), [distribute(m, {}) for m in more]
        for key, fn, args, local in (
            ("base", chain(1), [mx, mw, mz], [x, w, z]),
            ("double", chain(2), [mx, mw, mz], [x, w, z]),
            (f"+{MORE} inputs", chain(1), [mx, mw, mz, *mmore], [x, w, z, *more]),
            (f"+{MORE} results", chain(1, MORE), [mx, mw, mz], [x, w, z]),
            ("plan steps", steps, [mx, mw, mz], [x, w, z]),
        ):
            step = mesh_fn(fn, placements=placements, out_placements=out)
            cases[key] = (step, args, local)
        for nbytes in LOCAL_ARG_BYTES:
            step = mesh_fn(chain(1), placements=placements, out_placements=out)
            zb = local_args[nbytes]
            cases[f"local {_size(nbytes)}"] = (step, [mx, mw, zb], [x, w, zb])
        times: dict[str, list[float]] = {k: [] for k in cases}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        workers: dict[str, list[float]] = {k: [] for k in cases}
        in_steps: dict[str, list[float]] = {k: [] for k in cases}

        def workers_cpu() -> list[tuple[int, float, float]]:
            return list(probe.plan_cpu.call().get().values()) if probe is not None else []

        for step, args, _ in cases.values():
            inspect(pytree.tree_leaves(step(*args))[0])

        def one(step: Any, args: list[Any]) -> tuple[float, float, list, list]:
            w0 = workers_cpu()
            start, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                result = step(*args)
            inspect(pytree.tree_leaves(result)[0])
            took = time.perf_counter() - start
            return took / calls, (time.process_time() - cpu0) / calls, w0, workers_cpu()

        for _ in range(reps):
            for key, (step, args, _) in cases.items():
                took, used, w0, w1 = unstolen(one, step, args, stolen=stolen)
                times[key].append(took)
                cpu[key].append(used)
                if w0:  # each worker's CPU per run beyond its steps, and in them
                    runs = [max(1, b[0] - a[0]) for a, b in zip(w0, w1)]
                    workers[key].append(
                        max((b[2] - a[2] - b[1] + a[1]) / r for a, b, r in zip(w0, w1, runs))
                    )
                    in_steps[key].append(max((b[1] - a[1]) / r for a, b, r in zip(w0, w1, runs)))
    mesh = Mesh({"r": n})
    return {
        key: (
            step.compile(*local, mesh=mesh),
            statistics.median(times[key]),
            statistics.median(cpu[key]),
            statistics.median(workers[key]) if workers[key] else 0.0,
            statistics.median(in_steps[key]) if in_steps[key] else 0.0,
        )
        for key, (step, _, local) in cases.items()
    }


def _curve(points: Iterable[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """(work, seconds) -> a rate curve ((work, work/s), ...) by increasing work, whose time is
    non-decreasing in the work: a point measured slower than a larger one is lowered to the
    larger one's time (a small op's time is the noisier: one descheduling or late peer is
    most of it)."""
    out: list[tuple[float, float]] = []
    bound = math.inf
    for work, seconds in sorted(points, reverse=True):
        bound = min(bound, seconds)
        out.append((float(work), work / bound))
    return tuple(reversed(out))


def _net(seconds: float, dispatch: float) -> float | None:
    """An op's time less the dispatch overhead, or None where the overhead is most of it (the
    rate would be noise)."""
    return seconds - dispatch if seconds > 1.25 * dispatch else None


def fit_matmul(
    square: dict[int, float],
    thin: dict[int, float],
    dispatch: float,
    memory: DeviceProfile,
    wide: dict[int, float] | None = None,
) -> tuple[tuple[tuple[float, float], ...], float, float]:
    """The matmul curve (FLOP/s of the arithmetic by FLOPs), ``matmul_passes`` and
    ``matmul_output_passes`` from the seconds of square (n x n x n), thin (n/32 x n x n) and
    wide (n x n/32 x n) float32 matmuls: each time is the dispatch overhead + the arithmetic
    + the memory traffic (``memory``'s bandwidth curve, the inputs ``passes`` times, the
    output ``output_passes`` times); the square ones, mostly arithmetic, give the curve, the
    thin ones, whose input traffic is a larger share, the passes, the wide ones, whose
    output is, the output passes. A few rounds: each depends a little on the others."""
    passes = out_passes = 1.0
    curve: tuple[tuple[float, float], ...] = ()

    def fitted(times: dict[int, float], shape: Callable[[int], tuple[int, int, int]], of_ins: bool):
        """The passes (over the inputs, else the output) that make each time the model's."""
        estimates = []
        for n, t in times.items():
            m, k, c = shape(n)
            flops = 2.0 * m * k * c
            rest = t - dispatch - flops / p.matmul_flops_per_second(flops, "float32")
            ins, out = 4.0 * (m * k + k * c), 4.0 * m * c
            if rest > 0:  # passes * ins + out_passes * out = rest * bandwidth (at those bytes)
                memory_bytes = rest * p.bandwidth(passes * ins + out_passes * out)
                if of_ins:
                    estimates.append((memory_bytes - out_passes * out) / ins)
                else:
                    estimates.append((memory_bytes - passes * ins) / out)
        return statistics.median(estimates) if estimates else 1.0

    for _ in range(8):
        p = dataclasses.replace(memory, matmul_passes=passes, matmul_output_passes=out_passes)
        points = []
        for n, t in square.items():
            net = _net(t - p.matmul_memory_seconds(8.0 * n * n, 4.0 * n * n, 1.0), dispatch)
            if net is not None:
                points.append((2.0 * n**3, net))
        if not points:  # (all dispatch-bound: a machine faster than the sizes measured)
            n, t = max(square.items())
            points.append((2.0 * n**3, t))
        curve = _curve(points)
        p = dataclasses.replace(p, matmul_curve=curve, peak_flops={"float32": curve[-1][1]})
        passes = min(8.0, max(1.0, fitted(thin, lambda n: (max(1, n // 32), n, n), True)))
        if wide:
            shape = lambda n: (n, max(1, n // 32), n)  # noqa: E731
            out_passes = min(16.0, max(1.0, fitted(wide, shape, False)))
    return curve, passes, out_passes


def beta_by_size(
    alpha: float, points: Sequence[tuple[int, float, float]]
) -> tuple[tuple[float, float], ...]:
    """Beta at each measured size, given alpha: (traffic, traffic / (seconds - alpha *
    rounds)) for points (rounds, traffic, seconds) whose time is not mostly latency (there,
    beta would be noise); empty with fewer than 2 such points (one beta then serves)."""
    net = [(b, t - alpha * r) for r, b, t in points if b > 0 and t - alpha * r > 0.25 * t]
    return _curve(net) if len(net) >= 2 else ()


def fit_link(points: Sequence[tuple[int, float, float]]) -> tuple[Link, float]:
    """Alpha and beta of ``alpha * rounds + traffic / beta`` for points (rounds, traffic bytes,
    seconds), by least squares of the relative error; and the largest relative error left."""
    # Minimize sum((alpha * r / t + g * b / t - 1)^2) over alpha, g = 1 / beta.
    rows = [(r / t, b / t) for r, b, t in points]
    saa = sum(a * a for a, _ in rows)
    sbb = sum(b * b for _, b in rows)
    sab = sum(a * b for a, b in rows)
    sa = sum(a for a, _ in rows)
    sb = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    alpha = g = 0.0
    if det > 1e-12 * saa * sbb:
        alpha, g = (sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det
    if alpha <= 0:  # no latency to see: fit the bandwidth alone
        alpha, g = 0.0, sb / sbb
    if g <= 0:  # no bandwidth to see: fit the latency alone
        alpha, g = sa / saa, 1e-15
    link = Link(latency=alpha, bandwidth=1 / g)
    worst = max(abs(link.time(b, r) / t - 1) for r, b, t in points)
    return link, worst


@dataclass
class _Compute:
    """The compute part of a profile, fitted from the per-op times (``_fit_compute``)."""

    dispatch: float
    pointwise: dict[str, dict[int, float]]
    bandwidth_curve: tuple[tuple[float, float], ...]
    matmul: dict[int, float]
    matmul_curve: tuple[tuple[float, float], ...]
    matmul_passes: float
    matmul_output_passes: float
    peaks: dict[str, float]
    dtypes: dict[str, float]
    efficiency: dict[str, float]


def bandwidth_curve(add: dict[int, float], dispatch: float) -> tuple[tuple[float, float], ...]:
    """Bytes/s of an ``a + b`` by the bytes it moves (12 per element), from its seconds per op
    by element count ``add``, net of the ``dispatch`` overhead (all dispatch-bound: the
    largest one's, gross)."""
    points = []
    for numel, t in add.items():
        net = _net(t, dispatch)
        if net is not None:
            points.append((12 * numel, net))
    if not points:
        numel, t = max(add.items())
        points.append((12 * numel, t))
    return _curve(points)


def _fit_compute(s: Settings, per_op: dict[str, float], roofline: bool) -> _Compute:
    """Dispatch overhead, bandwidth curve, matmul curve, dtype peaks and family efficiencies
    from the times of ``_compute_specs(s)``. ``roofline``: a matmul's time is the max of its
    arithmetic and its memory traffic (a GPU's kernels stream operands beside the arithmetic:
    ``matmul_passes`` 0, the curve from the square matmuls' times less the dispatch); else
    ``fit_matmul``'s sum (a CPU's BLAS packs its inputs first)."""
    dispatch = per_op["dispatch"]
    pointwise: dict[str, dict[int, float]] = {op: {} for op in ("add", "sum", "clone")}
    for op in pointwise:
        for numel in s.pointwise:
            pointwise[op][numel] = per_op[f"{op} {numel}"]
    moved = {"add": 12, "sum": 4, "clone": 8}  # bytes per element read and written
    bw_curve = bandwidth_curve(pointwise["add"], dispatch)
    probe = DeviceProfile("cpu-local", {}, 1.0, {}, dispatch, {}, bandwidth_curve=bw_curve)
    matmul = {n: per_op[f"matmul {n}"] for n in s.matmul}
    if roofline:
        points = [(2.0 * n**3, _net(t, dispatch)) for n, t in matmul.items()]
        kept = [(f, t) for f, t in points if t is not None]
        if not kept:  # (all dispatch-bound)
            n, t = max(matmul.items())
            kept = [(2.0 * n**3, t)]
        mm_curve, passes, out_passes = _curve(kept), 0.0, 1.0
    else:
        thin = {n: per_op[f"thin matmul {n}"] for n in s.thin}
        wide = {n: per_op[f"wide matmul {n}"] for n in s.wide}
        mm_curve, passes, out_passes = fit_matmul(matmul, thin, dispatch, probe, wide)
    f32 = max(rate for _, rate in mm_curve)
    peaks = {"float32": f32}
    dtypes = {}
    n = s.dtype_size
    for d, ratio in DTYPE_RATIOS.items():
        label = f"matmul {n} {d}"
        if label in per_op:
            dtypes[d] = 2.0 * n**3 / per_op[label]
            f32_there = 2.0 * n**3 / per_op[f"matmul {n}"]
            peaks[d] = f32 * dtypes[d] / f32_there
        else:
            peaks[d] = f32 * ratio

    def efficiency(op: str) -> float:
        ratios = []
        for numel, t in pointwise[op].items():
            net = _net(t, dispatch)
            if net is not None:
                b = moved[op] * numel
                ratios.append(b / net / probe.bandwidth(b))
        return statistics.median(ratios) if ratios else 1.0

    return _Compute(
        dispatch=dispatch,
        pointwise=pointwise,
        bandwidth_curve=bw_curve,
        matmul=matmul,
        matmul_curve=mm_curve,
        matmul_passes=passes,
        matmul_output_passes=out_passes,
        peaks=peaks,
        dtypes=dtypes,
        efficiency={
            "matmul": 1.0,
            "pointwise": 1.0,
            "reduction": efficiency("sum"),
            "other": efficiency("clone"),
        },
    )


def gpu_base(name: str) -> DeviceProfile:
    """The built-in profile of the GPU called ``name`` (``torch.cuda.get_device_name``): what
    a ``"cuda-local"`` profile keeps of it (links, GPUs per host); H100's for any other."""
    lowered = name.lower()
    for key in ("h200", "h100"):
        if key in lowered:
            return BUILTIN[key]
    return BUILTIN["h100"]


def _gpu_profile(
    s: Settings, per_op: dict[str, float], eager: dict[str, float], quick: bool, info: dict
) -> Calibration:
    """The ``"cuda-local"`` profile from one GPU worker's measurements: its compute
    (``_fit_compute``, roofline) and overheads; links and GPUs per host from ``gpu_base``
    (one GPU: nothing to measure them with)."""
    c = _fit_compute(s, per_op, roofline=True)
    name = info.get("name", "no GPU (CPU workers)")
    base = gpu_base(name)
    profile = dataclasses.replace(
        base,
        name="cuda-local",
        peak_flops=c.peaks,
        memory_bandwidth=c.bandwidth_curve[-1][1],
        efficiency=c.efficiency,
        dispatch_overhead=c.dispatch,
        memory_capacity=info.get("memory", base.memory_capacity),
        controller_overhead=eager.get("op", base.controller_overhead),
        controller_reduce=eager.get("reduce", base.controller_reduce),
        controller_borrow=eager.get("borrow", base.controller_borrow),
        controller_backward=eager.get("backward", base.controller_backward),
        controller_switch=eager.get("switch", base.controller_switch),
        controller_replayed=eager.get("replayed", 0.0),
        replay_issue=eager.get("replay", 0.0),
        controller_measured="op" in eager,  # (the terms are beyond the measured Python)
        matmul_curve=c.matmul_curve,
        bandwidth_curve=c.bandwidth_curve,
        matmul_passes=0.0,
        small_op_floor=True,
        notes=(
            f"calibrated by `monarch-dsl calibrate --device cuda{' --quick' if quick else ''}`"
            f" on {datetime.date.today().isoformat()}: {name}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}; compute on one GPU worker; links (not measured: one "
            f"GPU) as the built-in {base.name!r}"
        ),
    )
    return Calibration(
        profile=profile,
        compute_ranks=1,
        matmul=c.matmul,
        dtypes=c.dtypes,
        pointwise=c.pointwise,
        dtype_size=s.dtype_size,
        device="cuda",
    )


def _compute_part(seconds: float, dispatch: float, macs: int, peaks: dict[str, float]) -> float:
    """A matmul's measured ``seconds`` less the dispatch overhead, and at least its time at
    the float32 peak (a tiny one on a busy machine can measure under the overhead; 0 would
    make it free)."""
    return max(seconds - dispatch, 2 * macs / peaks["float32"])


def _profile(
    s: Settings,
    sizes: tuple[int, ...],
    per_op: dict[str, float],
    comm: dict[tuple[str, int, str, int], float],
    eager: dict[str, float],
    quick: bool,
    warm: dict[str, float] | None = None,
) -> Calibration:
    c = _fit_compute(s, per_op, roofline=False)
    # A warm time counts only where it is clearly below the cold one (WARM_BELOW): operands in
    # the cache are never slower than from memory, and a difference within the machine's drift
    # between the two measurements (a 2-core EPYC's speed moves by tens of percent within
    # minutes; half the grid came out slower warm) is no difference -- the smaller of two
    # noisy times would bias every compute-bound shape low.
    warm = {
        label: t if t < WARM_BELOW * per_op[label] else per_op[label]
        for label, t in (warm or {}).items()
    }
    warm_add = {n: warm[f"add {n}"] for n in s.pointwise if f"add {n}" in warm}
    grid = list(itertools.product(*s.shapes))
    warm_grid = all(f"mm {m}x{k}x{n}" in warm for m, k, n in grid)
    links: dict[str, Link] = {}
    errors: dict[tuple[str, int], float] = {}
    for backend in BACKENDS:
        for n in sizes:
            points = [
                (*_rounds_traffic(kind, nbytes, n), t)
                for (b, m, kind, nbytes), t in comm.items()
                if b == backend and m == n and kind in FIT_KINDS
            ]
            if len(points) < 2:
                continue
            link, worst = fit_link(points)
            # shared memory runs in the issuing thread (cpp/shm.cpp): it never hides under compute
            link = Link(
                link.latency,
                link.bandwidth,
                overlap=backend != "shm",
                curve=beta_by_size(link.latency, points),
            )
            link = dataclasses.replace(link, factors=_kind_factors(link, backend, n, comm))
            links[f"{backend}@{n}"] = link
            errors[(backend, n)] = worst
            links.setdefault(backend, link)  # the smallest group size's, for any other
    placeholder = BUILTIN["cpu-local"]
    for kind, link in placeholder.links.items():
        links.setdefault(kind, link)
    if f"shm@{sizes[0]}" in links:
        links["nccl_intra"] = links["shm"]  # (no NCCL on a CPU: as the placeholder, shm)
    intra = "shm" if any(k.startswith("shm@") for k in links) else "gloo"
    cpu = _cpu_name()
    profile = DeviceProfile(
        name="cpu-local",
        peak_flops=c.peaks,
        memory_bandwidth=c.bandwidth_curve[-1][1],
        efficiency=c.efficiency,
        dispatch_overhead=c.dispatch,
        links=links,
        intra_host=intra,
        inter_host="gloo",
        ranks_per_host=placeholder.ranks_per_host,
        memory_capacity=_memory_bytes(),
        controller_overhead=eager.get("op", placeholder.controller_overhead),
        controller_reduce=eager.get("reduce", 0.0),
        controller_borrow=eager.get("borrow", 0.0),
        controller_backward=eager.get("backward", 0.0),
        controller_switch=eager.get("switch", 0.0),
        controller_replayed=eager.get("replayed", 0.0),
        replay_issue=eager.get("replay", 0.0),
        controller_measured="op" in eager,  # (the terms are beyond the measured Python)
        matmul_curve=c.matmul_curve,
        bandwidth_curve=c.bandwidth_curve,
        matmul_passes=c.matmul_passes,
        matmul_output_passes=c.matmul_output_passes,
        matmul_shapes=tuple(
            (m, k, n, _compute_part(per_op[f"mm {m}x{k}x{n}"], c.dispatch, m * k * n, c.peaks))
            for m, k, n in grid
        ),
        cache_bytes=cache_span() // 2 if warm else 0,
        warm_bandwidth_curve=(
            bandwidth_curve(warm_add, c.dispatch) if len(warm_add) == len(s.pointwise) else ()
        ),
        warm_matmul_shapes=(
            tuple(
                (m, k, n, _compute_part(warm[f"mm {m}x{k}x{n}"], c.dispatch, m * k * n, c.peaks))
                for m, k, n in grid
            )
            if warm and warm_grid and grid
            else ()
        ),
        elementwise=tuple(
            (op, max(0.0, per_op[f"elementwise {op}"] - c.dispatch) / ELEMENTWISE_NUMEL)
            for op in s.elementwise
        ),
        notes=(
            f"calibrated by `monarch-dsl calibrate{' --quick' if quick else ''}` on "
            f"{datetime.date.today().isoformat()}: {cpu}, {os.cpu_count()} cores, torch "
            f"{torch.__version__}; compute measured on {sizes[0]} ranks at once, "
            f"{_worker_threads(sizes[0])} thread(s) each"
        ),
    )
    return Calibration(
        profile=profile,
        compute_ranks=sizes[0],
        matmul=c.matmul,
        dtypes=c.dtypes,
        pointwise=c.pointwise,
        dtype_size=s.dtype_size,
        comm=comm,
        fit_error=errors,
    )


def _kind_factors(
    link: Link, backend: str, n: int, comm: dict[tuple[str, int, str, int], float]
) -> tuple[tuple[str, tuple[tuple[float, float], ...]], ...]:
    """Per collective kind not fitted (``FIT_KINDS``) measured on ``backend`` over ``n``
    ranks: its measured time over ``link``'s alpha-beta time, by traffic (``Link.factors``)."""
    ratios: dict[str, list[tuple[float, float]]] = {}
    for (b, m, kind, nbytes), t in comm.items():
        if b == backend and m == n and kind not in FIT_KINDS:
            r, moved = _rounds_traffic(kind, nbytes, n)
            ratios.setdefault(kind, []).append((max(moved, 1.0), t / link.time(moved, r)))
    return tuple((kind, tuple(sorted(v))) for kind, v in sorted(ratios.items()))


def _rounds_traffic(kind: str, nbytes: int, n: int) -> tuple[int, float]:
    moved, rounds = traffic(kind, nbytes, 2 if kind == "send" else n)
    return rounds, moved


def _worker_threads(n: int) -> int:
    """The intra-op threads a worker of an ``n``-rank local mesh has (runtime/worker.py)."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"] or 1)
    return max(1, (os.cpu_count() or 1) // n)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def table(cal: Calibration) -> str:
    """What was measured and what was fitted, as text."""
    p = cal.profile
    out = [f"{p.notes}", ""]
    out.append("matmul, float32, n x n x n     time/op    GFLOP/s")
    for n, t in cal.matmul.items():
        out.append(f"  n = {n:<5d}                 {_us(t):>10s}   {2 * n**3 / t / 1e9:8.1f}")
    for d, rate in cal.dtypes.items():
        out.append(f"  n = {cal.dtype_size:<5d} {d:<16s} {'':>10s}   {rate / 1e9:8.1f}")
    if p.matmul_passes:
        out.append(
            f"  memory passes (thin and wide matmuls): inputs {p.matmul_passes:.2f}, "
            f"output {p.matmul_output_passes:.2f}"
        )
    if p.matmul_shapes:
        sizes = [sorted({row[d] for row in p.matmul_shapes}) for d in range(3)]
        out.append(f"  m x k x n, {len(p.matmul_shapes)} shapes (matmul_shapes): GFLOP/s")
        for m in sizes[0]:
            rates = [
                f"{2 * a * b * c / t / 1e9 if t else 0:.0f}"
                for a, b, c, t in p.matmul_shapes
                if a == m
            ]
            out.append(f"    m = {m:<5d} " + " ".join(f"{r:>4s}" for r in rates))
        out.append(f"    (k, n) in turn over {sizes[1]} x {sizes[2]}")
    out.append("")
    out.append("memory-bound ops, float32     bytes moved   add GB/s   sum GB/s  clone GB/s")
    for numel in cal.pointwise["add"]:
        row = [f"{numel * 4 * 3 / (1 << 20):8.2f} MiB"]
        for op, per in (("add", 12), ("sum", 4), ("clone", 8)):
            row.append(f"{per * numel / cal.pointwise[op][numel] / 1e9:9.1f}")
        out.append(f"  {numel:>10d} elements  " + "  ".join(row))
    if p.has_warm:
        out.extend(_warm_table(cal))
    e = p.efficiency
    out.append(
        f"  efficiency vs the add curve: reduction (sum) {e['reduction']:.2f}, "
        f"other (clone) {e['other']:.2f}"
    )
    if p.elementwise:
        out.append(
            "  arithmetic, ns per element (elementwise): "
            + ", ".join(f"{op} {t * 1e9:.2f}" for op, t in p.elementwise)
        )
    out.append("")
    out.append("overheads")
    out.append(f"  dispatch, per op of a compiled plan (C++)   {_us(p.dispatch_overhead):>10s}")
    out.append(f"    (in a loop of one op                      {_us(cal.loop_dispatch):>10s})")
    beyond = ", beyond its own Python" if p.controller_measured else ""
    out.append(f"  eager programs: the controller's CPU (all its threads) per instruction{beyond}")
    for label, value in (
        ("an op (controller_overhead)", p.controller_overhead),
        ("a reduce (controller_reduce)", p.controller_reduce),
        ("a borrow or its drop (controller_borrow)", p.controller_borrow),
        ("+ a backward node (controller_backward)", p.controller_backward),
        ("+ the issuing thread changed (controller_switch)", p.controller_switch),
        ("an instruction replayed (controller_replayed)", p.controller_replayed),
        ("a replayed step's run (replay_issue)", p.replay_issue),
    ):
        out.append(f"    {label:<48s} {_us(value):>10s}")
    out.append(f"  a worker, per eager op beyond its compute    {_us(p.eager_op_overhead):>10s}")
    out.append(f"  eager op, wall per op until the workers ran {_us(cal.eager_wall):>10s}")
    if p.collective_wait:
        out.append(
            f"  a worker's wait in an eager collective: {p.collective_wait:.2f} x its work in "
            "the batch before it (collective_wait)"
        )
    out.append("  compiled steps, called back to back: per call, the controller's CPU, the steps")
    for key, (t, c, steps) in cal.calls.items():
        out.append(f"    {key:<14s} {_us(t):>10s} {_us(c):>10s} {_us(steps):>10s}")
    out.append(
        f"  a call: controller {_us(p.plan_issue)} + {_us(p.plan_issue_per_input)} per input "
        f"+ {_us(p.plan_issue_per_output)} per result; workers {_us(p.plan_overhead)} "
        "(plan_overhead)"
    )
    c = p.links.get("controller")
    if c is not None:
        out.append(
            f"  a local tensor argument: {_us(c.latency)} + the bytes sent in all at "
            f"{c.bandwidth / 1e9:.2f} GB/s"
        )
    out.append("")
    if cal.device == "cuda":
        out.append(
            "links: not measured (NCCL needs a GPU per rank; this was one): "
            + ", ".join(
                f"{k} {_us(v.latency)} + {v.bandwidth / 1e9:.0f} GB/s"
                for k, v in sorted(p.links.items())
                if k != "controller"
            )  # fmt: skip
        )
    else:
        out.extend(_links_table(cal))
    out.append("")
    busy = (
        ""
        if cal.others_busy is None
        else f"; other processes took {cal.others_busy:.0%} of the CPU"
    )
    if cal.steal is not None and cal.steal_kept is not None:
        busy += (
            f"; the host took {cal.steal:.0%} of it (steal), at most {cal.steal_kept:.0%} "
            f"of a CPU in a measurement kept (above {STEAL_MAX:.0%}: measured again)"
        )
    out.append(f"measured in {cal.seconds:.0f} s{busy}")
    if cal.others_busy is not None and cal.others_busy > BUSY_WARNING:
        out.append("WARNING: the machine was busy: calibrate again when it is idle")
    if cal.steal_kept is not None and cal.steal_kept > STEAL_MAX:
        out.append("WARNING: the host took CPU time from measurements: calibrate again")
    return "\n".join(out)


def _warm_table(cal: Calibration) -> list[str]:
    """The table's rows for operands in the cache: the add's rate by size, and how much faster
    the matmul grid's shapes ran (``DeviceProfile.warm``)."""
    p = cal.profile
    warm = p.warm()
    out = [f"  operands in the cache ({p.cache_bytes / (1 << 20):.0f} MiB, shared by the ranks):"]
    rates = [
        f"{n * 12 / (1 << 20):.2f} MiB {warm.bandwidth(n * 12) / 1e9:.1f}"
        for n in cal.pointwise["add"]
    ]
    out.append("    add GB/s: " + ", ".join(rates))
    if p.warm_matmul_shapes:
        faster = [
            (a, b, c, cold / hot)
            for (a, b, c, cold), (*_, hot) in zip(p.matmul_shapes, p.warm_matmul_shapes)
            if hot > 0 and cold > 0
        ]
        a, b, c, most = max(faster, key=lambda row: row[3])
        median = statistics.median(row[3] for row in faster)
        out.append(
            f"    matmul grid: {median:.2f}x faster (median), up to {most:.2f}x ({a}x{b}x{c})"
        )
    return out


def _links_table(cal: Calibration) -> list[str]:
    """The table's links and collectives: fitted alpha and beta, measured vs fitted."""
    p = cal.profile
    out = []
    out.append(
        f"links: alpha (per round), beta (bytes/s per rank), fitted on {', '.join(FIT_KINDS)};"
        " the link keeps beta by size (the 'fitted' column below)"
    )
    out.append("  backend  ranks   alpha        beta   alpha-beta's worst error beta by size, GB/s")
    for (backend, n), worst in sorted(cal.fit_error.items()):
        link = p.links[f"{backend}@{n}"]
        by_size = ", ".join(f"{_size(b)}: {r / 1e9:.1f}" for b, r in link.curve)
        out.append(
            f"  {backend:<7s}  {n:>5d}  {_us(link.latency):>8s}  {link.bandwidth / 1e9:7.2f} GB/s"
            f"   {worst:6.1%}                 {by_size}"
        )
    out.append("")
    out.append("collectives: measured vs the fitted link, x the link's factor for the kind")
    out.append("  backend  ranks  kind            size      measured   fitted x factor")
    for (backend, n, kind, nbytes), t in sorted(cal.comm.items()):
        key = f"{backend}@{n if kind != 'send' else 2}"
        fitted = ""
        if key in p.links:
            r, b = _rounds_traffic(kind, nbytes, n)
            plain = p.links[key].time(b, r)  # (all-reduces', the fitted kind's: no factor)
            fitted = f"{_us(plain)} x {p.links[key].time(b, r, kind) / plain:.2f}"
        size = _size(nbytes)
        out.append(f"  {backend:<7s}  {n:>5d}  {kind:<14s}  {size:>8s}  {_us(t):>10s}   {fitted}")
    return out


def _us(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.2f} us"


def save(profile: DeviceProfile, path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``profile`` (by default to ``calibrated_path(profile.name)``: what ``"cpu-local"``
    or ``"cuda-local"`` names from then on), creating the directory; atomically, so a reader
    never sees half a file."""
    target = Path(path) if path is not None else calibrated_path(profile.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    profile.save(tmp)
    os.replace(tmp, target)
    return target


__all__ = [
    "run",
    "measure",
    "table",
    "save",
    "Calibration",
    "check_ranks",
    "check_arguments",
    "parse_ranks",
    "gpu_base",
]
