"""The simulator: a back end of the instruction set that runs a lowered program with costs
instead of data (``plan.simulate()``, ``plan.memory()``).

It walks the ``isa.Program`` the workers would run, every rank at once (as
``compiler/interpret.py`` does), and keeps per rank a clock per stream and the time each slot
is ready:

- a step starts when its stream is free and its inputs are ready, so a ``comms``-stream
  collective's results are waited for at their first use on ``main`` (as the runtime does; the
  time ``main`` stands still is a ``"wait"`` event);
- a collective starts when every member of its group has reached it, and all of them end
  together, after the alpha-beta time of the profile's link (``compiler/profile.py``); on a
  link that does not overlap compute (``Link.overlap``: shared memory, run in the issuing
  thread), a ``comms``-stream collective also holds ``main`` while it runs;
- a send is buffered: it costs the sender the transfer, and its receiver gets the value when
  both the send has ended and the receiver has reached the recv;
- a compute step costs its roofline time for its op family plus the dispatch overhead.

Shapes: a ``Compute`` step names slots, not shapes, so the simulator is given each slot's local
shape and dtype (``SlotType``) beside the program. For a compiled plan they come from the
plan's types (``slot_types``: the slot numbering ``lower`` gives). The communication steps'
own ``shapes`` are not needed.

Memory (per rank, in program order, as a caching allocator sees it): the inputs (parameters,
optimizer state, batch) are resident on the ranks that use them; each step's outputs are
allocated; views and in-place ops (``ops.ALIASING``, an in-place op's result) share their
input's storage; a storage is released when the last slot on it is freed (``frees``); a
bucketed all-reduce holds its flat buffer while it runs. The peak per rank is reported.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from monarch_dsl import isa
from monarch_dsl.compiler import timeline
from monarch_dsl.compiler.interpret import groups
from monarch_dsl.compiler.lower import lower
from monarch_dsl.compiler.ops import ALIASING, FOREACH, base_name
from monarch_dsl.compiler.plan import IMPLEMENTATIONS, Plan, PlanError, itemsize
from monarch_dsl.compiler.profile import DeviceProfile, ProfileLike
from monarch_dsl.isa import Program, Slot
from monarch_dsl.mesh import all_coords

# A slot's local shape (None: not a tensor) and dtype (a torch dtype's name).
SlotType = tuple[tuple[int, ...] | None, str]
Coords = tuple[int, ...]

MATMUL = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear"}
REDUCTION = set(
    "sum mean amax amin max min var std norm prod argmax argmin logsumexp cumsum softmax "
    "_softmax log_softmax _log_softmax _softmax_backward_data _log_softmax_backward_data "
    "native_layer_norm native_layer_norm_backward nll_loss_forward nll_loss_backward "
    "_foreach_norm".split()
)
OTHER = set(
    "cat stack index index_put gather scatter scatter_add embedding embedding_dense_backward "
    "convolution convolution_backward sort topk copy _to_copy clone".split()
)


@dataclass(frozen=True)
class SimEvent:
    """One step on one rank's stream: ``start`` / ``end`` in seconds; ``kind`` is
    ``"compute"``, ``"comm"`` or ``"wait"`` (the stream stands still for a value)."""

    rank: int
    stream: str
    name: str
    start: float
    end: float
    kind: str


@dataclass(frozen=True)
class SimReport:
    """What a simulated run predicts. Times in seconds, memory in bytes; ``compute_time``,
    ``comm_time`` and ``exposed_comm_time`` are the busiest rank's (comm not hidden behind
    compute on another stream of its rank is exposed); ``per_stream``: busy seconds per (rank,
    stream), waits excluded."""

    events: list[SimEvent]
    step_time: float
    peak_memory: dict[int, int]
    compute_time: float
    comm_time: float
    exposed_comm_time: float
    per_stream: dict[tuple[int, str], float] = field(default_factory=dict)
    profile: str = ""

    def trace(self) -> dict[str, Any]:
        """The events in the Chrome / Perfetto ``traceEvents`` JSON format: one complete
        (``"ph": "X"``) event per ``SimEvent``, process = rank, thread = stream (0 main, 1
        comms, ...), microseconds."""
        streams = sorted({e.stream for e in self.events}, key=lambda s: (s != "main", s))
        tid = {s: i for i, s in enumerate(streams)}
        return {
            "traceEvents": [
                {
                    "name": e.name,
                    "cat": e.kind,
                    "ph": "X",
                    "ts": e.start * 1e6,
                    "dur": (e.end - e.start) * 1e6,
                    "pid": e.rank,
                    "tid": tid[e.stream],
                    "args": {"stream": e.stream},
                }
                for e in self.events
            ],
            "displayTimeUnit": "ms",
            "otherData": {"profile": self.profile, "step_time_s": self.step_time},
        }

    def save_trace(self, path: str | os.PathLike[str]) -> str:
        """Write ``trace()`` to ``path`` (open it in ui.perfetto.dev or chrome://tracing);
        returns the path."""
        with open(path, "w") as f:
            json.dump(self.trace(), f)
        return os.fspath(path)

    def timeline(self, width: int = 72) -> str:
        """The terminal timeline: a row of ``width`` cells per rank and stream
        (``compiler/timeline.py``)."""
        return timeline.text(self.events, width)

    def display(
        self, path: str | os.PathLike[str] | None = "md-sim", width: int = 72, file: Any = None
    ) -> dict[str, str]:
        """Print the timeline and the totals, and write ``{path}.json`` (a Perfetto /
        chrome://tracing trace) and ``{path}.png`` (a picture of the timeline; needs
        matplotlib, else said and skipped). ``path=None`` writes no files. Returns the paths
        written, by kind (``"trace"``, ``"png"``)."""
        out = sys.stdout if file is None else file
        ms = 1e3
        print(self.timeline(width), file=out)
        print(
            f"step {self.step_time * ms:.3f} ms, compute {self.compute_time * ms:.3f} ms, "
            f"comm {self.comm_time * ms:.3f} ms (exposed {self.exposed_comm_time * ms:.3f} ms), "
            f"peak memory {max(self.peak_memory.values(), default=0) / 2**20:.2f} MiB"
            + (f", profile {self.profile}" if self.profile else ""),
            file=out,
        )
        if path is None:
            return {}
        written = {"trace": self.save_trace(f"{os.fspath(path)}.json")}
        print(f"trace: {written['trace']} (open in ui.perfetto.dev or chrome://tracing)", file=out)
        try:
            written["png"] = timeline.save_png(self.events, f"{os.fspath(path)}.png", self.profile)
            print(f"timeline: {written['png']}", file=out)
        except ImportError as e:
            print(f"timeline PNG skipped: {e}", file=out)
        return written


def nbytes(t: SlotType) -> int:
    shape, dtype = t
    if shape is None:
        return 0
    return math.prod(shape) * itemsize(dtype)


def family(name: str) -> str:
    """The op family of an aten op (``aten.mm.default`` -> ``"matmul"``): ``"view"`` (no
    work), or a key of ``DeviceProfile.efficiency``."""
    base, _ = base_name(name) if "." in name else (name, False)
    if base in ALIASING:
        return "view"
    if base in MATMUL:
        return "matmul"
    if base in REDUCTION:
        return "reduction"
    if base in OTHER:
        return "other"
    return "pointwise"


def compute_time(step: isa.Compute, types: Sequence[SlotType], profile: DeviceProfile) -> float:
    """The roofline time of a compute step: flops (matmuls: 2mnk) and bytes moved (its tensor
    inputs read, outputs written) against the profile's rates at this size (a measured
    matmul or bandwidth curve, else the peaks; for a matmul their max, or their sum where the
    profile's ``matmul_passes`` says so), plus the dispatch overhead."""
    fam = family(step.name)
    if fam == "view":
        return profile.dispatch_overhead
    ins = [types[s.index] for s in isa.leaves((step.args, step.kwargs), Slot)]
    outs = [types[o] for o in step.outs]
    moved = sum(nbytes(t) for t in ins) + sum(nbytes(t) for t in outs)
    eff = profile.efficiency.get(fam, profile.efficiency.get("other", 1.0))
    seconds = moved / (profile.bandwidth(moved) * eff)
    if fam == "matmul" and outs and outs[0][0] is not None:
        base, _ = base_name(step.name)
        at = 1 if base in ("addmm", "baddbmm", "addbmm") else 0  # (after the added term)
        first = ins[at][0] if len(ins) > at else None
        k = first[-1] if first else 1  # the contracted dim of the left matrix
        flops = 2 * math.prod(outs[0][0]) * k
        arithmetic = flops / (profile.matmul_flops_per_second(flops, outs[0][1]) * eff)
        if profile.matmul_passes:
            made = sum(nbytes(t) for t in outs)
            seconds = profile.matmul_memory_seconds(moved - made, made, eff) + arithmetic
        else:
            seconds = max(seconds, arithmetic)
    return seconds + profile.dispatch_overhead


def traffic(kind: str, nbytes: float, n: int) -> tuple[float, int]:
    """What collective ``kind`` (``isa.Comm.kind``) over ``n`` ranks moves per rank and in
    how many rounds, for ``nbytes`` (the whole value's: an all-gather's output, the input of
    the others): ring all-reduce 2(n-1)/n of them in 2(n-1) rounds; all-gather,
    reduce-scatter, all-to-all (n-1)/n in n-1 rounds; send/recv all, in one."""
    if kind in ("send", "recv"):
        return nbytes, 1
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes, 2 * (n - 1)
    return (n - 1) / n * nbytes, n - 1


def comm_time(
    step: isa.Comm, types: Sequence[SlotType], n: int, profile: DeviceProfile, cross_host: bool
) -> float:
    """Alpha-beta time of a communication over ``n`` ranks (``traffic``) on the profile's link
    for that group size. Local redistributions copy through memory."""
    ins = sum(nbytes(types[s.index]) for s in isa.leaves(step.args, Slot))
    outs = sum(nbytes(types[o]) for o in step.outs)
    if isinstance(step, (isa.ShardLocal, isa.PartialLocal)):
        return outs / (profile.bandwidth(outs) * profile.efficiency["pointwise"])
    if isinstance(step, (isa.Send, isa.Recv)):
        return profile.link(cross_host, 2).time(*traffic(step.kind, max(ins, outs), 2))
    if n <= 1:
        return profile.dispatch_overhead
    whole = outs if isinstance(step, isa.AllGather) else ins
    return profile.link(cross_host, n).time(*traffic(step.kind, whole, n))


def steady_step_time(
    step_time: float,
    profile: DeviceProfile,
    inputs: int,
    local_bytes: Sequence[int] = (),
    ranks: int = 1,
) -> float:
    """Seconds per call of a compiled step called back to back, from one call's simulated
    ``step_time`` (``plan.simulate()``, the steps alone). The controller issues a call while
    the workers run the one before, so the slower sets the pace: the controller's CPU per call
    (``plan_issue``, ``plan_issue_per_input`` per tensor input of the plan, parameters and
    state included, and each argument passed as a local torch tensor, ``local_bytes``, sent
    to every one of ``ranks`` workers over the ``"controller"`` link) or a rank's
    (``step_time + plan_overhead``). Where the controller and the ``ranks`` ranks of a host
    share fewer cores (``host_cores``), CPU time sets it too: (the controller's + every
    rank's) / cores."""
    controller = profile.plan_issue + profile.plan_issue_per_input * inputs
    link = profile.links.get("controller")
    if link is not None:
        controller += sum(link.time(b * ranks, 1) for b in local_bytes)
    worker = step_time + profile.plan_overhead
    return max(controller, worker, cpu_bound(controller, [worker] * ranks, profile))


def cpu_bound(controller: float, ranks: Sequence[float], profile: DeviceProfile) -> float:
    """The least wall time in which a host's controller (``controller`` CPU seconds) and its
    ranks (each busy for its seconds of ``ranks``) can all run, where they are more processes
    than the host's ``host_cores`` and must share them: their CPU seconds over the cores (a
    rank waiting in a shared-memory collective spins, so its busy time is CPU time); 0 where
    each has a core of its own (or ``host_cores`` is unknown). The one contention rule of
    compiled steps (``steady_step_time``) and eager programs (``simulate_eager.py``)."""
    if profile.host_cores and len(ranks) + 1 > profile.host_cores:
        return (controller + sum(ranks)) / profile.host_cores
    return 0.0


class _Memory:
    """One rank's allocations: storages by id, the slots on each, the live total and peak."""

    def __init__(self) -> None:
        self.root: dict[int, int] = {}  # slot -> storage
        self.refs: dict[int, int] = defaultdict(int)  # storage -> slots on it
        self.size: dict[int, int] = {}  # storage -> bytes
        self.live = 0
        self.peak = 0

    def new(self, slot: int, size: int) -> None:
        self.root[slot] = slot
        self.size[slot] = size
        self.refs[slot] += 1
        self.live += size

    def alias(self, slot: int, of: int) -> None:
        r = self.root.get(of, of)
        if r not in self.size:  # (a slot never defined: count it as its own)
            self.new(slot, 0)
            return
        self.root[slot] = r
        self.refs[r] += 1

    def free(self, slot: int) -> None:
        r = self.root.pop(slot, None)
        if r is None:
            return
        self.refs[r] -= 1
        if self.refs[r] == 0:
            self.live -= self.size.pop(r)

    def mark(self, extra: int = 0) -> None:
        self.peak = max(self.peak, self.live + extra)


def _allocate(step: isa.Step, types: Sequence[SlotType], mem: _Memory) -> None:
    """The storage of ``step``'s outputs: shared with its input for views and in-place ops,
    new otherwise (a bucket's flat buffer counts while it runs)."""
    if isinstance(step, isa.Compute):
        base, inplace = base_name(step.name) if "." in step.name else (step.name, False)
        if inplace and base.startswith(FOREACH) and step.args:
            targets = [s.index for s in isa.leaves(step.args[0], Slot)]
            for o, t in zip(step.outs, targets):
                mem.alias(o, t)
            for o in step.outs[len(targets) :]:
                mem.new(o, nbytes(types[o]))
            mem.mark()
            return
        first = isa.leaves(step.args, Slot)[:1]
        if first and (inplace or base in ALIASING):
            mem.alias(step.outs[0], first[0].index)
            for o in step.outs[1:]:
                mem.new(o, nbytes(types[o]))
            mem.mark()
            return
    for o in step.outs:
        mem.new(o, nbytes(types[o]))
    flat = 0
    if isinstance(step, isa.AllReduce) and len(step.args) > 1:
        flat = sum(nbytes(types[s.index]) for s in isa.leaves(step.args, Slot))
    mem.mark(flat)


def simulate_program(
    program: Program,
    types: Sequence[SlotType],
    profile: ProfileLike = None,
    host_of: Callable[[Coords, int], int] | None = None,
) -> SimReport:
    """Run ``program`` on every rank with costs instead of values. ``types[slot]``: each slot's
    local shape and dtype. ``host_of(coords, rank)``: the host of a rank (default: by the
    profile's ``ranks_per_host``, or the coordinate along a mesh dim named ``host``)."""
    prof = DeviceProfile.get(profile)
    if len(types) != program.n_slots:
        raise ValueError(f"{len(types)} slot types for a program of {program.n_slots} slots")
    sizes = program.sizes
    ranks = all_coords(sizes)
    index = {c: i for i, c in enumerate(ranks)}
    if host_of is None:
        if "host" in program.dims:
            h = program.dims.index("host")
            host_of = lambda c, r: c[h]  # noqa: E731
        else:
            host_of = lambda c, r: r // prof.ranks_per_host  # noqa: E731
    hosts = {c: host_of(c, index[c]) for c in ranks}
    mem: dict[Coords, _Memory] = {c: _Memory() for c in ranks}
    # An input lives on the ranks whose steps use it (a pipeline stage's parameters on that
    # stage), or everywhere if no step does.
    homes: dict[int, set[Coords]] = {s: set() for s in program.inputs}
    for step in program.steps:
        for u in step.uses():
            if u in homes:
                homes[u].update(c for c in ranks if step.runs_on(c))
    for c in ranks:
        for s in program.inputs:
            if c in homes[s] or not homes[s]:
                mem[c].new(s, nbytes(types[s]))
        mem[c].mark()
    events: list[SimEvent] = []
    play_program(program, types, prof, index, hosts, {c: 0.0 for c in ranks}, events, mem)
    return _report(events, {index[c]: mem[c].peak for c in ranks}, prof.name)


def play_program(
    program: Program,
    types: Sequence[SlotType],
    prof: DeviceProfile,
    rank_of: dict[Coords, int],
    hosts: dict[Coords, int],
    begin: dict[Coords, float],
    events: list[SimEvent],
    mem: dict[Coords, _Memory],
    stream_of: Callable[[str], str] = lambda s: s,
) -> dict[Coords, float]:
    """The timeline of one run of ``program``, appended to ``events``: every rank at
    ``coords`` (its rank ``rank_of[coords]`` in the events, its host ``hosts[coords]``)
    starts at ``begin[coords]`` with its inputs ready then; its allocations go to
    ``mem[coords]``; ``stream_of`` names the events' streams. Returns when each rank's last
    step ends (``simulate_program`` runs one from 0; ``md.Simulator`` continues an eager
    timeline with it)."""
    ranks = list(begin)
    free_at: dict[tuple[Coords, str], float] = {}
    ready: dict[Coords, list[float]] = {c: [begin[c]] * program.n_slots for c in ranks}
    mail: dict[tuple[Coords, Coords], deque[float]] = defaultdict(deque)

    def reached(c: Coords, step: isa.Step) -> float:
        at = free_at.get((c, step.stream), begin[c])
        return max([at, *(ready[c][u] for u in step.uses())])

    def record(c: Coords, step: isa.Step, start: float, end: float, kind: str) -> None:
        idle = free_at.get((c, step.stream), begin[c])
        stream = stream_of(step.stream)
        if step.stream == "main" and start > idle:
            events.append(SimEvent(rank_of[c], stream, f"wait {step.op}", idle, start, "wait"))
        events.append(SimEvent(rank_of[c], stream, step.op, start, end, kind))
        free_at[(c, step.stream)] = end
        for o in step.outs:
            ready[c][o] = end

    for step in program.steps:
        active = [c for c in ranks if step.runs_on(c)]
        if isinstance(step, isa.COLLECTIVES):
            for group in groups(active, step.dims):
                cross = len({hosts[c] for c in group}) > 1
                # A link that does not overlap compute runs the collective in main's thread.
                blocking = not prof.link(cross, len(group)).overlap and step.stream != "main"
                start = max(
                    max(reached(c, step), free_at.get((c, "main"), begin[c]) if blocking else 0.0)
                    for c in group
                )
                end = start + comm_time(step, types, len(group), prof, cross)
                for c in group:
                    record(c, step, start, end, "comm")
                    if blocking:
                        free_at[(c, "main")] = end
        elif isinstance(step, (isa.Send, isa.Recv)):
            d = step.dims[0]
            for c in active:
                peer = c[:d] + (step.peer,) + c[d + 1 :]
                start = reached(c, step)
                cost = comm_time(step, types, 2, prof, hosts[c] != hosts[peer])
                if isinstance(step, isa.Send):
                    mail[(c, peer)].append(start + cost)
                    record(c, step, start, start + cost, "comm")
                else:
                    sent = mail[(peer, c)].popleft() if mail[(peer, c)] else start + cost
                    record(c, step, start, max(start, sent), "comm")
        elif isinstance(step, (isa.ShardLocal, isa.PartialLocal)):
            for c in active:
                start = reached(c, step)
                record(c, step, start, start + comm_time(step, types, 1, prof, False), "compute")
        elif isinstance(step, isa.Compute):
            cost = compute_time(step, types, prof)
            for c in active:
                start = reached(c, step)
                record(c, step, start, start + cost, "compute")
        else:
            raise TypeError(f"the simulator has no handler for {type(step).__name__}")
        for c in active:
            _allocate(step, types, mem[c])
            for s in step.frees:
                mem[c].free(s)
    return {c: max([begin[c], *(t for (r, _), t in free_at.items() if r == c)]) for c in ranks}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _uncovered(xs: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """The length of the (disjoint, sorted) ``xs`` outside the (disjoint, sorted) ``cover``."""
    total = 0.0
    for a, b in xs:
        overlap = sum(max(0.0, min(b, d) - max(a, c)) for c, d in cover)
        total += (b - a) - overlap
    return total


def _report(events: list[SimEvent], peak: dict[int, int], profile: str) -> SimReport:
    busy = [e for e in events if e.kind != "wait"]
    per_stream: dict[tuple[int, str], float] = defaultdict(float)
    for e in busy:
        per_stream[(e.rank, e.stream)] += e.end - e.start
    compute, comm, exposed = 0.0, 0.0, 0.0
    for r in peak:
        mine = [e for e in busy if e.rank == r]
        comp = _union([(e.start, e.end) for e in mine if e.kind == "compute"])
        com = _union([(e.start, e.end) for e in mine if e.kind == "comm"])
        compute = max(compute, _length(comp))
        comm = max(comm, _length(com))
        exposed = max(exposed, _uncovered(com, comp))
    step = max((e.end for e in events), default=0.0) - min((e.start for e in events), default=0.0)
    return SimReport(events, step, peak, compute, comm, exposed, dict(per_stream), profile)


def slot_types(plan: Plan) -> list[SlotType]:
    """Each slot's local shape and dtype, in the numbering ``lower`` gives the plan's values:
    the inputs, then every instruction's results in order."""
    sizes = plan.sizes
    out: list[SlotType] = []
    for i in plan.inputs:
        out.append((i.type.local_shape(sizes) if i.type.shape is not None else None, i.type.dtype))
    for ins in plan.body:
        if len(ins.types) != len(ins.outs):
            raise PlanError(
                f"{ins.op}: {len(ins.outs)} results but {len(ins.types)} types", ins.loc
            )
        for t in ins.types:
            out.append((t.local_shape(sizes) if t.shape is not None else None, t.dtype))
    return out


def _check_mesh(plan: Plan, mesh: Any) -> None:
    """``mesh`` (an ``md.Mesh``, or ((dim, size), ...)) must be the one the plan was compiled
    for."""
    if mesh is None:
        return
    if hasattr(mesh, "dims") and hasattr(mesh, "sizes") and isinstance(mesh.sizes, dict):
        spec = tuple((d, mesh.sizes[d]) for d in mesh.dims)
    else:
        spec = tuple((str(d), int(n)) for d, n in mesh)
    if spec != plan.mesh:
        raise ValueError(
            f"plan {plan.name!r} was compiled for mesh {dict(plan.mesh)}, not {dict(spec)}: "
            "compile it for that mesh (step.compile(..., mesh=...)) to simulate it there"
        )


def simulate_plan(plan: Plan, mesh: Any = None, profile: ProfileLike = None) -> SimReport:
    """``plan.simulate()``: one call of the compiled step, every rank, with ``profile``'s costs
    (a built-in name, a path, a ``DeviceProfile``; None: ``"cpu-local"``)."""
    _check_mesh(plan, mesh)
    return simulate_program(lower(plan), slot_types(plan), profile)


def plan_memory(plan: Plan) -> dict[int, int]:
    """``plan.memory()``: the peak bytes per rank (row-major index) of one call."""
    return simulate_plan(plan).peak_memory


IMPLEMENTATIONS["simulate"] = simulate_plan
IMPLEMENTATIONS["memory"] = plan_memory

__all__ = [
    "SimEvent",
    "SimReport",
    "SlotType",
    "simulate_program",
    "simulate_plan",
    "plan_memory",
    "slot_types",
    "compute_time",
    "comm_time",
    "steady_step_time",
    "cpu_bound",
    "traffic",
    "family",
]
