"""How well the simulator predicts this machine: predicted vs measured step time and memory.

    monarch-dsl calibrate                 # once: measures this machine into "cpu-local"
    python benchmarks/simulator.py        # about 3 minutes on a 2-core machine
    python benchmarks/simulator.py --runs 3   # each case measured 3 times in turn: medians
    python benchmarks/simulator.py --profile my.json --only ddp
    python benchmarks/simulator.py --calibrate --runs 3   # calibrate first, in this run

For each case the same step is (1) simulated with the device profile (``plan.simulate`` for a
compiled step, ``md.Simulator`` for an eager program; no processes) and (2) run on 2 local
worker processes through the C++ runtime, timed in blocks of consecutive calls (each block
ends with ``md.inspect`` of its last result, so all of its work is done; medians of the
blocks). Cases:

- ``ddp big``: 8 x (Linear(1024) + ReLU), data parallel over dp=2, 32 samples per rank, SGD
  (the DDP benchmark's big model, compiled);
- ``ddp tiny``: 4 x (Linear(64) + ReLU), the same (its tiny model);
- ``fsdp big``: the big model under ``md.fully_shard`` (parameters, gradients and momentum
  sharded over dp=2; each weight gathered for use and again for the backward pass, each
  gradient reduce-scattered); ``..., kept gathered``: ``reshard_after_forward=False``;
- ``megatron tp=2``: Linear(512, 2048) + ReLU + Linear(2048, 512), column- then row-parallel
  over tp=2 (one all-reduce forward, one backward), batch 64, SGD;
- ``pipeline pp=2``: two stages of 2 x (Linear(512) + ReLU), 4 micro-batches of 16, SGD;
- ``eager ...``: programs of eager ops on the mesh (``with pm.activate()``), simulated on
  ``md.Simulator`` (when it exists in this version): the time per step of a loop on state made
  once before it (the model put on the mesh, as a training loop does; measured: blocks of
  steps, each ending when the workers have run its last one; predicted: the simulated clock
  from the end of the same warm-up to the last step's end), which on a host with
  fewer cores than ranks + controller is at least the time they take sharing the cores
  fairly, as a compiled step's (``compiler/simulate.py:cpu_bound``); ``md.DDP tiny, ...``:
  the DDP benchmark's tiny model under ``md.DistributedDataParallel``, its step replayed
  (the default; md.Simulator replays it too) and with ``replay=False``.

Where an eager step's CPU goes (the table after the first): per step, the controller's CPU
(all its threads, ``process_time``) against the simulator's issue clock, and the busier
worker's (all its threads, from ``/proc``) against its simulated busy time and collective
waits: what tells a miss of the controller's model from one of the workers'.

The last lines also give the compiled cases' errors without the cache model (every operand
from memory, as before the profile measured the rates with operands in the cache: a step of
the pipeline, whose weights stay in the cache between micro-batches, was over-predicted by
about 20% every time so).

Memory (compiled cases): the bytes of the tensors each worker allocates, byte exact, from
torch's profiler (``profile_memory``: each CPU allocation and free on the worker's main stream
thread, where the C++ runtime runs a plan, collectives included, and where the arguments are
copied; started through ``@md.remote`` functions before the case's state is on the workers;
only blocks allocated since then count). Measured: the peak over 3 calls in a steady state
(after 3 calls; each call's result fetched before the next: calls issued back to back also
hold the next call's argument copies briefly beside the last call's) above the bytes live
when a call starts, plus each rank's rows of the local arguments sent to it by rows (a
data-parallel batch): they arrive in the buffers of the call's message, not allocations of
torch's, which the profiler does not see; the worker holds them for the whole call, and the
bytes are known exactly (``rows_bytes``). Predicted: ``plan.simulate()``'s ``peak_memory -
resident_memory`` (such a part is one of the plan's inputs, live for the whole call; a local
argument sent whole is copied to the rank's part out of the message, whose buffer is the
transport's and counted on neither side). Also printed: what
stays between calls, predicted (``resident_memory``) and measured (live at the calls' start;
the first call's plan, compiled from the local modules and then replaced by the plan for the
state on the workers, keeps no buffers: a plan keeps them from its second run). Resident set
size (``VmHWM``) is no reference: it counts
pages and allocator caches, and the profiler's own memory.

Printed per case: predicted, measured, error ((predicted - measured) / measured). Goals (issue
13): median |error| <= 10%, max <= 25% for time; within 10% for memory (the peak in a call).

Where a compiled call's time goes (the last table): per rank, the seconds in compute steps, in
communication (collectives on ``main``, the starts of the others, the runtime's failure flag)
and waiting for started collectives, and the run's span, predicted (``plan.simulate``) and
measured (``step.record()``: the C++ runtime's record of calls, step by step; the median of the
last 3 of 8 calls issued back to back, as the timed blocks issue them, after each case's
timed blocks -- not a call from idle workers, ``step.timeline``, whose first collective holds
the ranks' start skew). The call's time beyond the span is the path to the workers (the
controller, the message, the worker taking it up). This is what tells a compute miss (the
machine's speed, the cache model) from a communication one.

Per call in a loop (the table before it): the same predictions against the median time from
one recorded call's start to the next's (``rec.starts``), calls back to back. A block's mean
counts every call the host stretched (on a shared 2-core host, single calls run 2-4x their
median while other work runs); the median call is the machine's typical speed. The goal is
stated on the blocks' means; this says how much of a miss is the host's stalls.

The machine's drift: before each run, both workers time one shape of the profile's matmul grid
(``PROBE``, as calibration measured it: every rank at once, through operand sets) and the run
prints that time over the profile's (``speed probe``). On a shared host this moves by tens of
percent within minutes, and every compute-bound case moves with it; the errors are not
corrected by it, it says how far the machine was from the one the profile measured. The
``bandwidth probe`` does the same for memory-bound work (``a + b`` of ``ADD_PROBE`` float32
elements per operand, against the profile's bandwidth curve): the shared-memory all-reduces and
the eager cases' small ops move with the memory system, which drifts apart from the cores.
``--calibrate`` measures the machine first, in the same run (``monarch-dsl calibrate``'s
measurement, about 3 minutes; not saved), so the profile is the machine as it was minutes
ago rather than hours. On this 2-core machine that helped once and not the next time: a
profile calibrated 80 minutes earlier under-predicted the tiny step by 25%, one calibrated just
before was within 5% of it, every term alike (the controller's CPU per call, the workers', the
steps'), and the whole table had median 5.9%, max 19.6%; the next calibrate-then-measure gave
14.4% and 36.3% (tiny -36%), the speed probe at 0.77-0.90x: the machine drifts within minutes.

The host's steal: this machine is a VM, and its host takes CPU time from it (``steal`` in
``/proc/stat``), 30-50% for minutes at a time on 2026-11-29. Every timed block, recorded loop
and probe is taken ``calibrate.unstolen``: again (up to ``STEAL_RETRIES`` times) while the
host took more than ``STEAL_MAX`` of the CPU during it, the least stolen kept; the last lines
say how much was stolen from the blocks kept. A neighbour on the host also slows memory and
compute without any steal: the probes still show that.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("MONARCH_DSL_QUIET", "1")
# The workers' profiler: no log lines (5 still let kineto's "USDT" ones by, 2 per trace), and
# not c10's warning that blocks allocated before a trace have no free event (we know).
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from eager_step import thread_cpu  # noqa: E402  (benchmarks/: the script's own directory)
from torch import nn  # noqa: E402

import monarch_dsl as md  # noqa: E402
from monarch_dsl.calibrate import STEAL_MAX, STEAL_RETRIES, unstolen  # noqa: E402
from monarch_dsl.compiler.interpret import sent_rows  # noqa: E402
from monarch_dsl.compiler.simulate import call_results, sent_bytes, steady_step_time  # noqa: E402

BLOCK_SECONDS = 0.5
# The share of the CPU the host took from this VM (steal) in each block and probe kept: one
# above calibrate.STEAL_MAX is measured again, up to STEAL_RETRIES times (calibrate.unstolen).
STOLEN: list[float] = []


@dataclass
class Case:
    name: str
    dim: str  # the mesh dim the case runs over (2 ranks)
    make: Callable[[], tuple[md.mesh_fn, tuple[torch.Tensor, ...]]]


def _mlp(width: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def _step_of(model: nn.Module, opt: torch.optim.Optimizer):
    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _ddp(width: int, layers: int, fully_shard: bool = False, reshard: bool = True):
    """The data-parallel case's step; ``fully_shard``: under ``md.fully_shard``."""

    def make():
        torch.manual_seed(0)
        model = _mlp(width, layers)
        if fully_shard:
            md.fully_shard(model, reshard_after_forward=reshard)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        step = md.mesh_fn(_step_of(model, opt), data_parallel="dp")
        return step, (torch.randn(64, width), torch.randn(64, width))

    return make


def _megatron():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    placements = {
        "model.0.weight": {"tp": md.Shard(0)},
        "model.0.bias": {"tp": md.Shard(0)},
        "model.2.weight": {"tp": md.Shard(1)},
    }
    step = md.mesh_fn(_step_of(model, opt), placements=placements)
    return step, (torch.randn(64, 512), torch.randn(64, 512))


class _TwoStages(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.first, self.second = _mlp(width, 2), _mlp(width, 2)

    def forward(self, x):
        with md.pipeline_stage(0):
            h = self.first(x)
        with md.pipeline_stage(1):
            return self.second(h)


def _pipeline():
    torch.manual_seed(0)
    model = _TwoStages(512)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = md.mesh_fn(_step_of(model, opt), micro_batches=4)
    return step, (torch.randn(64, 512), torch.randn(64, 512))


CASES = [
    Case("ddp big", "dp", _ddp(1024, 8)),
    Case("ddp tiny", "dp", _ddp(64, 4)),
    Case("fsdp big", "dp", _ddp(1024, 8, fully_shard=True)),
    Case("fsdp big, kept gathered", "dp", _ddp(1024, 8, fully_shard=True, reshard=False)),
    Case("megatron tp=2", "tp", _megatron),
    Case("pipeline pp=2", "pp", _pipeline),
]


# ---- eager programs: the same function on md.Simulator's mesh and on the workers ------------


def eager_ddp_setup(mesh):
    """A hand-written data-parallel step's state: 4 x Linear(512) on the mesh, a batch of 32,
    a comms stream."""
    torch.manual_seed(0)
    model = md.to_mesh(nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]), mesh)
    return model, md.Stream("comms"), torch.randn(32, 512)


def eager_ddp(state, steps: int):
    """The step, ``steps`` times: forward and backward (``grad_generator``), each gradient
    averaged over ``gpu`` on a comms stream and the borrow dropped when the next gradient is
    there, then an SGD update. Returns the last loss."""
    model, comms, x = state
    params = list(reversed(list(model.parameters())))
    loss = None
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        pending, grads = None, []
        for grad in md.grad_generator(loss, params):
            if pending is not None:
                pending.drop()
            lent, pending = comms.borrow(grad, mutable=True)
            with comms.activate():
                lent.reduce_("gpu", "avg")
            grads.append(grad)
        pending.drop()
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(g, alpha=0.01)
    return loss


def eager_ops_setup(mesh):
    torch.manual_seed(0)
    return md.to_mesh(torch.randn(64, 64) / 8, mesh), md.to_mesh(torch.randn(64, 64), mesh)


def eager_ops(state, steps: int):
    """Small eager ops, ``steps`` times: a chain of 16 matmuls + tanh on 64 x 64 and one
    all-reduce -- where the controller's cost per op shows. Returns the last value."""
    w, h = state
    for _ in range(steps):
        for _ in range(16):
            h = torch.tanh(h @ w)
        h = h.reduce("gpu", "avg")
    return h


def md_ddp_setup(mesh, replay: bool = True):
    """``md.DistributedDataParallel`` of 4 x (Linear(64) + ReLU) over ``gpu``, its SGD and a
    batch of 32 a rank (``benchmarks/ddp.py``'s tiny model); ``replay``: the wrapper's."""
    torch.manual_seed(0)
    model = md.to_mesh(_mlp(64, 4), mesh)
    ddp = md.DistributedDataParallel(model, dim="gpu", replay=replay)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = md.distribute((torch.randn(64, 64), torch.randn(64, 64)), {"gpu": md.Shard(0)}, mesh)
    return ddp, opt, x, y


def md_ddp(state, steps: int):
    """The DDP benchmark's loop body, ``steps`` times: zero_grad, forward, MSE, backward (its
    buckets all-reduced), SGD step. Returns the last loss."""
    ddp, opt, x, y = state
    loss = None
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
    return loss


# name: (its state, made once on the mesh; its steps on that state)
EAGER = {
    "eager ddp": (eager_ddp_setup, eager_ddp),
    "eager small ops": (eager_ops_setup, eager_ops),
    # (md.DistributedDataParallel replays the repeated step: md.Simulator does too)
    "md.DDP tiny, replayed": (md_ddp_setup, md_ddp),
    "md.DDP tiny, no replay": (functools.partial(md_ddp_setup, replay=False), md_ddp),
}


def measure_eager(pm, case, blocks: int, steps: int) -> tuple[float, float, float]:
    """Seconds per step: blocks of ``steps`` steps on the state made once (as a training loop
    makes its model once), each block ending when the workers have run its last step; and the
    CPU seconds per step of the controller (all its threads) and of the busier worker (all
    its threads), medians of the blocks."""
    setup, fn = case
    mesh = pm.rename(x="gpu")
    workers = list(pm._job.pids.values())
    times, controller, worker = [], [], []

    def cpu() -> tuple[float, list[float]]:
        return time.process_time(), [sum(thread_cpu(p)) for p in workers]

    def block() -> tuple[float, float, float]:
        gc.collect()
        gc.disable()  # (as _timed: no collection in a block)
        try:
            c0, w0 = cpu()
            t0 = time.perf_counter()
            md.inspect(fn(state, steps))
            took = (time.perf_counter() - t0) / steps
            c1, w1 = cpu()
        finally:
            gc.enable()
        return took, (c1 - c0) / steps, max(b - a for a, b in zip(w0, w1)) / steps

    with mesh.activate():
        state = setup(mesh)
        md.inspect(fn(state, 2))  # warm: shapes cached, the state on the workers
        for _ in range(blocks):
            took, c, w = unstolen(block, stolen=STOLEN)
            times.append(took)
            controller.append(c)
            worker.append(w)
    return statistics.median(times), statistics.median(controller), statistics.median(worker)


def predict_eager(case, profile, steps: int) -> tuple[float, float, float]:
    """The simulated seconds per step: the same steps after the same set-up and warm-up,
    from the simulated clock between the end of the warm-up and of the last step; and the
    controller's CPU seconds per step, and the busier rank's (its busy time and its waits in
    eager collectives on a host short of cores: what the shared-cores bound counts)."""
    setup, fn = case
    sim = md.Simulator(hosts=1, gpus=2, profile=profile)
    job = sim.job.sim

    def cpu() -> tuple[float, list[float]]:
        return job.issued, job.rank_cpu()

    with sim.mesh.activate():
        state = setup(sim.mesh)
        md.inspect(fn(state, 2))
        before = sim.summary().step_time
        c0, w0 = cpu()
        md.inspect(fn(state, steps))
        step = (sim.summary().step_time - before) / steps
        c1, w1 = cpu()
    return step, (c1 - c0) / steps, max(b - a for a, b in zip(w0, w1)) / steps


# ---- the workers' memory -----------------------------------------------------------------------
# Every tensor a worker allocates for a plan run -- compute steps, collectives' buffers, the
# arguments' parts -- is allocated on its main stream's thread (cpp/program.cpp runs the whole
# plan there, collectives included), where remote functions run too. torch's profiler with
# profile_memory reports each CPU allocation and free made on the thread that started it, byte
# exact ([memory] events); a free of a block allocated before it started is not reported, so
# the trace starts before the case's state is put on the workers.

MARK = "md-bench-memory-mark"


def _trace() -> dict:
    """This worker's tracing state (remote functions are sent by value: no module globals)."""
    import types

    return sys.modules.setdefault("_md_bench_memory", types.ModuleType("_md_bench_memory")).__dict__


@md.remote(propagate=lambda: torch.empty(1, dtype=torch.int64, device="meta"))
def start_memory_trace():
    """Start tracing this worker's tensor allocations (on this thread: the main stream's)."""
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    prof.__enter__()
    _trace()["profiler"] = prof
    return torch.zeros(1, dtype=torch.int64)


@md.remote(propagate=lambda: torch.empty(1, dtype=torch.int64, device="meta"))
def mark_memory():
    """Mark the start of the measured calls in the trace."""
    with torch.profiler.record_function(MARK):
        pass
    return torch.zeros(1, dtype=torch.int64)


@md.remote(propagate=lambda: torch.empty(2, dtype=torch.int64, device="meta"))
def stop_memory_trace():
    """Stop tracing; of the tensors allocated since the start (by their addresses: not a block
    of an earlier case freed meanwhile), [the peak bytes live after the mark above those live
    at the mark, the bytes live at the mark]."""
    from torch._C._profiler import _EventType

    prof = _trace().pop("profiler")
    prof.__exit__(None, None, None)
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
        elif e.tag == _EventType.TorchOp and e.name == MARK:
            events.append((e.start_time_ns, None, 0))
    sizes: dict[int, int] = {}
    live, at_mark, peak = 0, None, 0
    for _, ptr, size in sorted(events, key=lambda e: e[0]):
        if ptr is None:
            at_mark = peak = live
        elif size > 0:
            sizes[ptr] = size
            live += size
            peak = max(peak, live)
        else:
            live -= sizes.pop(ptr, 0)
    if at_mark is None:
        raise RuntimeError("stop_memory_trace: no mark_memory in the trace")
    return torch.tensor([peak - at_mark, at_mark])


# ---- the machine's drift -------------------------------------------------------------------------

PROBE = (256, 1024, 1024)  # m, k, n: a shape of calibration's matmul grid (FULL.shapes)


@md.remote(propagate=lambda: torch.empty(1, dtype=torch.float64, device="meta"))
def probe_matmul():
    """Seconds per float32 ``mm`` of the ``PROBE`` shape on this worker (median of 5 runs of
    20, cycling through operand sets as calibration does)."""
    from monarch_dsl.calibrate import cache_span, operand_sets

    m, k, n = PROBE
    sets = operand_sets(4 * (m * k + k * n), cache_span())
    operands = [(torch.randn(m, k), torch.randn(k, n)) for _ in range(sets)]
    out = torch.empty(m, n)
    return _per_call(lambda i: torch.mm(*operands[i % sets], out=out), 20)


def _per_call(call: Callable[[int], object], calls: int) -> torch.Tensor:
    """Seconds per ``call(i)`` (i = 0, 1, ...): the median of 5 runs of ``calls``, after one
    more to warm up."""
    runs = []
    for _ in range(6):
        t0 = time.perf_counter()
        for i in range(calls):
            call(i)
        runs.append((time.perf_counter() - t0) / calls)
    return torch.tensor([statistics.median(runs[1:])], dtype=torch.float64)


ADD_PROBE = 4 << 20  # float32 elements of each operand of the bandwidth probe's a + b (16 MiB)


@md.remote(propagate=lambda: torch.empty(1, dtype=torch.float64, device="meta"))
def probe_add():
    """Seconds per float32 ``a + b`` of ``ADD_PROBE`` elements on this worker (median of 5 runs
    of 10, cycling through operand sets as calibration's bandwidth curve does)."""
    from monarch_dsl.calibrate import cache_span, operand_sets

    sets = operand_sets(8 * ADD_PROBE, cache_span())
    operands = [(torch.rand(ADD_PROBE), torch.rand(ADD_PROBE)) for _ in range(sets)]
    out = torch.empty(ADD_PROBE)
    return _per_call(lambda i: torch.add(*operands[i % sets], out=out), 10)


def speed_probe(pm, profile) -> float | None:
    """The probe's time on the slower worker (both at once) over the profile's for that shape
    (None where the profile has no grid)."""
    m, k, n = PROBE
    modelled = profile.matmul_seconds(m, k, n, "float32")
    if modelled is None:
        return None
    return unstolen(_slowest, pm, probe_matmul, stolen=STOLEN) / (
        modelled + profile.dispatch_overhead
    )


def _slowest(pm, probe) -> float:
    """A probe's seconds on the slower worker, both running it at once."""
    with pm.activate():
        t = probe()
        return max(md.inspect(t, x=r).item() for r in range(pm.sizes["x"]))


def bandwidth_probe(pm, profile) -> float:
    """The bandwidth probe's time on the slower worker (both at once) over the profile's
    (its bandwidth curve at the bytes moved): memory-bound work, and shared-memory
    collectives, drift apart from the matmul probe's compute."""
    moved = 3 * 4 * ADD_PROBE
    modelled = moved / profile.bandwidth(moved) + profile.dispatch_overhead
    return unstolen(_slowest, pm, probe_add, stolen=STOLEN) / modelled


# ---- measuring ---------------------------------------------------------------------------------


def _timed(run: Callable[[int], None], steps: int) -> float:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        run(steps)
        return (time.perf_counter() - t0) / steps
    finally:
        gc.enable()


def measure_compiled(
    pm, case: Case, blocks: int
) -> tuple[float, list[int], list[int], dict[str, float]]:
    """Seconds per call (median of ``blocks`` blocks); each rank's peak tensor bytes during
    calls in a steady state above those live when a call starts, and those (what stays
    between calls, above what was there before the case); and where a call's time goes
    (``kinds`` of recorded calls, the median of ``TIMELINES``)."""
    mesh = pm.rename(x=case.dim)
    gc.collect()  # the cases before: their tensors freed on the workers before tracing starts
    step, args = case.make()
    with mesh.activate():
        md.inspect(start_memory_trace())  # before the case's state is on the workers
        # compiles, puts the state on the workers, reaches a steady state (a gradient bucket
        # goes into a block of shared memory at its plan's third run: cpp/program.cpp)
        for _ in range(4):
            out = step(*args)
        md.inspect(out)
        mark_memory()
        for _ in range(3):  # one call at a time (see the docstring)
            md.inspect(step(*args))
        trace = stop_memory_trace()
        ranks = range(mesh.sizes[case.dim])
        traced = [md.inspect(trace, **{case.dim: r}).tolist() for r in ranks]

        def run(n: int) -> None:
            for _ in range(n):
                out = step(*args)
            md.inspect(out)

        one = _timed(run, 3)
        n = max(3, int(BLOCK_SECONDS / max(one, 1e-5)))
        times = [unstolen(_timed, run, n, stolen=STOLEN) for _ in range(blocks)]

        def record() -> Any:
            with step.record() as rec:
                for _ in range(RECORDED):
                    step(*args)
            return rec

        rec = unstolen(record, stolen=STOLEN)
        recorded = [kinds(r) for r in rec.reports[-TIMELINES:]]
    measured = {k: statistics.median(r[k] for r in recorded) for k in recorded[0]}
    # a call's time in the loop: from its start to the next call's (not the block's first)
    s = rec.starts
    measured["call"] = statistics.median(b - a for a, b in zip(s[1:], s[2:]))
    return statistics.median(times), [t[0] for t in traced], [t[1] for t in traced], measured


TIMELINES = 3  # recorded calls per case and run, for where the time goes: the last of
RECORDED = 8  # calls issued back to back in step.record()
KINDS = ("compute", "comm", "wait", "span")


def kinds(report) -> dict[str, float]:
    """Seconds per rank (the mean of the ranks) in each kind of event, and the span of the
    run (first event to last)."""
    ranks = {e.rank for e in report.events}
    out = {k: 0.0 for k in KINDS}
    for e in report.events:
        out[e.kind] += (e.end - e.start) / len(ranks)
    out["span"] = report.step_time
    return out


def predict_compiled(
    case: Case, profile
) -> tuple[tuple[float, list[int], list[int]], float | None, dict[str, float]]:
    """Seconds per call; each rank's predicted peak bytes during a call above those resident
    when it starts, and those; the seconds per call without the cache model (None where
    the profile has none), from the same compiled plan; and the simulated run's ``kinds``."""
    step, args = case.make()
    plan = step.compile(*args, mesh=md.Mesh.from_string(f"{case.dim}=2"))

    def per_call(report, profile) -> float:
        # Called back to back: the controller's per-call work (its inputs, the local arguments
        # it sends) overlaps the workers' run of the call before.
        return steady_step_time(
            report.step_time, profile, len(plan.inputs), sent_bytes(plan, args), ranks=2,
            outputs=call_results(plan),
        )  # fmt: skip

    report = plan.simulate(profile=profile)
    ranks = sorted(report.peak_memory)
    in_call = [report.peak_memory[r] - report.resident_memory[r] for r in ranks]
    parts[case.name] = rows_bytes(plan, args, len(ranks))
    uncached = None
    if profile.has_warm:  # compute as if every operand came from memory (see the docstring)
        cold = dataclasses.replace(profile, cache_bytes=0)
        uncached = per_call(plan.simulate(profile=cold), cold)
    resident = [report.resident_memory[r] for r in ranks]
    return (per_call(report, profile), in_call, resident), uncached, kinds(report)


parts: dict[str, list[int]] = {}  # case: each rank's bytes of its rows of the local arguments


def rows_bytes(plan, args, ranks: int) -> list[int]:
    """Each rank's bytes of the local arguments sent to it by rows (a data-parallel batch:
    ``interpret.sent_rows``). They arrive in the buffers of the call's message, which the
    profiler does not see (not an allocation of torch's): the measured peak adds them, as
    the worker holds them for the whole call."""
    out = [0] * ranks
    for i, a in zip([i for i in plan.inputs if i.kind == "arg"], args, strict=True):
        rows = sent_rows(i.type, plan.sizes)
        if rows is not None:
            row = a[0].numel() * a.element_size()
            for r, (start, stop) in enumerate(rows):
                out[r] += (stop - start) * row
    return out


def _err(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="a profile (default: cpu-local)")
    ap.add_argument("--blocks", type=int, default=5, help="timed blocks per case (default 5)")
    ap.add_argument("--only", default=None, help="run the cases whose name has this")
    ap.add_argument(
        "--runs", type=int, default=1,
        help="measure every case this many times, in turn (each case's median is compared: "
        "this machine's speed drifts by tens of percent within minutes)",
    )  # fmt: skip
    ap.add_argument(
        "--calibrate", action="store_true",
        help="measure this machine first, in this run (monarch-dsl calibrate's measurement, "
        "about 3 minutes; not saved), and predict with that profile",
    )  # fmt: skip
    opts = ap.parse_args()
    if opts.runs < 1 or opts.blocks < 1:
        ap.error("--runs and --blocks must be at least 1")
    if opts.calibrate and opts.profile:
        ap.error("--calibrate makes the profile: give it or --profile, not both")
    if opts.calibrate:
        from monarch_dsl import calibrate

        profile = calibrate.run(progress=True)
    else:
        profile = md.DeviceProfile.get(opts.profile)
    cases = [c for c in CASES if opts.only is None or opts.only in c.name]
    eager = {n: fn for n, fn in EAGER.items() if opts.only is None or opts.only in n}
    pm = md.this_host().spawn_procs({"x": 2})
    steps = 20
    # eager programs: (step, controller CPU, the busier worker's CPU) per step, seconds
    eager_cpu: dict[str, tuple[float, float, float]] = {}
    eager_measured: dict[str, list[tuple[float, float, float]]] = {n: [] for n in eager}
    for n, fn in eager.items():
        eager_cpu[n] = predict_eager(fn, profile, steps)
    predicted = {n: (eager_cpu[n][0], None, None) for n in eager}
    # Beside each compiled case: its prediction without the cache model (compiled steps'
    # compute as if every operand came from memory, as before it), so what the model changes is
    # seen on the same runs.
    uncached: dict[str, float] = {}
    where: dict[str, tuple[dict[str, float], list[dict[str, float]]]] = {}  # predicted, runs
    for c in cases:
        predicted[c.name], without, simulated = predict_compiled(c, profile)
        where[c.name] = (simulated, [])
        if without is not None:
            uncached[c.name] = without
    times: dict[str, list[float]] = {n: [] for n in predicted}
    memory: dict[str, tuple] = {}
    speeds: list[float] = []
    bandwidths: list[float] = []
    try:
        for run in range(opts.runs):
            speed = speed_probe(pm, profile)
            if speed is not None:
                speeds.append(speed)
                print(f"  run {run + 1}: speed probe: a {'x'.join(map(str, PROBE))} matmul took "
                      f"{speed:.2f}x the profile's time", file=sys.stderr, flush=True)  # fmt: skip
            bandwidths.append(bandwidth_probe(pm, profile))
            print(f"  run {run + 1}: bandwidth probe: a + b of {ADD_PROBE >> 18} MiB took "
                  f"{bandwidths[-1]:.2f}x the profile's time", file=sys.stderr)  # fmt: skip
            for name, fn in eager.items():
                eager_measured[name].append(measure_eager(pm, fn, opts.blocks, steps))
                times[name].append(eager_measured[name][-1][0])
            for case in cases:
                m_time, m_mem, m_res, m_kinds = measure_compiled(pm, case, opts.blocks)
                times[case.name].append(m_time)
                where[case.name][1].append(m_kinds)
                # (byte exact: once; with the rows each rank was sent, see rows_bytes)
                m_mem = [m + b for m, b in zip(m_mem, parts[case.name], strict=True)]
                memory.setdefault(case.name, (m_mem, m_res))
            for name, got in times.items():
                print(f"  run {run + 1}: {name}: predicted {predicted[name][0] * 1e3:.3f} ms, "
                      f"measured {got[-1] * 1e3:.3f} ms", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        pm.stop()
    rows = []
    for name, (p_time, p_mem, p_res) in predicted.items():
        m_mem, m_res = memory.get(name, (None, None))
        rows.append((name, p_time, statistics.median(times[name]), p_mem, m_mem, p_res, m_res))
    print(f"simulator accuracy, profile {profile.name} ({profile.notes or 'calibrated'}), "
          f"{os.cpu_count()} cores, 2 ranks; measured: median of {opts.runs} run(s)")  # fmt: skip
    print(f"{'case':<24} {'predicted ms':>12} {'measured ms':>12} {'error':>7}   "
          f"{'pred. MiB':>9} {'meas. MiB':>9} {'error':>7}   "
          f"{'resident MiB pred/meas':>22}")  # fmt: skip
    errors, mem_errors = [], []
    for name, pt, mt, pm_, mm, pr, mr in rows:
        e = _err(pt, mt)
        errors.append(abs(e))
        if pm_ is None:
            print(f"{name:<24} {pt * 1e3:12.3f} {mt * 1e3:12.3f} {e:+7.1%}")
            continue
        pmib, mmib = max(pm_) / 2**20, max(mm) / 2**20
        me = _err(pmib, mmib) if mmib > 0 else float("nan")
        mem_errors.append(abs(me))
        print(f"{name:<24} {pt * 1e3:12.3f} {mt * 1e3:12.3f} {e:+7.1%}   "
              f"{pmib:9.3f} {mmib:9.3f} {me:+7.1%}   "
              f"{max(pr) / 2**20:10.3f} /{max(mr) / 2**20:10.3f}")  # fmt: skip
    print(f"time: median |error| {statistics.median(errors):.1%} (goal <= 10%), "
          f"max {max(errors):.1%} (goal <= 25%)")  # fmt: skip
    if uncached:
        off = {n: _err(t, statistics.median(times[n])) for n, t in uncached.items()}
        on = [abs(e) for n, e in zip(predicted, errors) if n not in uncached]
        on += [abs(e) for e in off.values()]
        print(f"without the cache model (profile {profile.cache_bytes >> 20} MiB: "
              f"DeviceProfile.warm): " + ", ".join(f"{n} {e:+.1%}" for n, e in off.items())
              + f"; median |error| {statistics.median(on):.1%}, max {max(on):.1%}")  # fmt: skip
    if speeds:
        print(f"speed probe (the machine's drift since calibration): a {'x'.join(map(str, PROBE))} "
              f"matmul took {min(speeds):.2f}-{max(speeds):.2f}x the profile's time")  # fmt: skip
    if bandwidths:
        print(f"bandwidth probe (memory-bound work's drift): a + b of {ADD_PROBE >> 18} MiB "
              f"took {min(bandwidths):.2f}-{max(bandwidths):.2f}x the profile's time")  # fmt: skip
    if STOLEN:
        over = sum(x > STEAL_MAX for x in STOLEN)
        print(f"the host's steal (CPU time it took from this VM) in the {len(STOLEN)} blocks and "
              f"probes kept: median {statistics.median(STOLEN):.1%}, max {max(STOLEN):.1%}; "
              f"a block above {STEAL_MAX:.0%} was measured again (up to {STEAL_RETRIES} times), "
              f"{over} stayed above")  # fmt: skip
    if mem_errors:
        print(f"memory: median |error| {statistics.median(mem_errors):.1%}, "
              f"max {max(mem_errors):.1%} (goal <= 10%)")  # fmt: skip
    if eager:
        print("where an eager step's CPU goes, ms per step, predicted/measured (measured: all "
              "threads of the process, median of the blocks, then of the runs; predicted: the "
              "controller's issue clock, the busier rank's busy time and collective "
              "waits):")  # fmt: skip
        print(f"{'case':<24}{'wall':>20}{'controller CPU':>20}{'busier worker CPU':>20}")
        for name in eager:
            got = [statistics.median(m[i] for m in eager_measured[name]) for i in range(3)]
            cells = [f"{p * 1e3:8.3f} /{m * 1e3:8.3f}" for p, m in zip(eager_cpu[name], got)]
            print(f"{name:<24}" + "".join(f"{c:>20}" for c in cells))
    if where:
        # The same prediction against the typical call of a loop rather than the blocks'
        # mean: on a shared host, a few calls stretched by the host's other work move a
        # block's mean; the median call does not.
        print(f"per call in a loop (step.record(): the median of the times from one call's "
              f"start to the next's, {RECORDED - 2} per run, calls back to back; then the "
              f"median of the runs), predicted vs measured:")  # fmt: skip
        call_errors = []
        for name, (_, runs) in where.items():
            mc = statistics.median(r["call"] for r in runs)
            e = _err(predicted[name][0], mc)
            call_errors.append(abs(e))
            print(f"{name:<24} {predicted[name][0] * 1e3:12.3f} {mc * 1e3:12.3f} {e:+7.1%}")
        print(f"per call: median |error| {statistics.median(call_errors):.1%}, "
              f"max {max(call_errors):.1%} (compiled cases)")  # fmt: skip
        print(f"where a compiled call's time goes, ms per rank, predicted/measured (measured: "
              f"step.record(), median of the last {TIMELINES} of {RECORDED} calls back to "
              f"back per run, then of the runs; "
              f"comm: collectives on main and starts of the others; span: the run on the "
              f"workers, first step to last)")  # fmt: skip
        print(f"{'case':<24}" + "".join(f"{k:>20}" for k in KINDS))
        for name, (sim, runs) in where.items():
            cells = []
            for k in KINDS:
                got = statistics.median(r[k] for r in runs)
                cells.append(f"{sim[k] * 1e3:8.3f} /{got * 1e3:8.3f}")
            print(f"{name:<24}" + "".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
