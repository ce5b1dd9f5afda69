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
- a compute step costs its roofline time for its op family plus the dispatch overhead; where
  the profile measured the rates with operands in the cache too (``DeviceProfile.warm``), by
  how much of its input is still in the cache when it runs (``warm_fractions``).

Shapes: a ``Compute`` step names slots, not shapes, so the simulator is given each slot's local
shape and dtype (``SlotType``) beside the program. For a compiled plan they come from the
plan's types (``slot_types``: the slot numbering ``lower`` gives). The communication steps'
own ``shapes`` are not needed.

Memory (per rank, in program order, as the C++ runtime, ``cpp/program.cpp``, allocates it
in a steady state of calls): resident when a call starts are the inputs (parameters,
optimizer state, batch) on the ranks that use them, the previous call's outputs (the caller's
handles; a state output the next call takes as an input is counted once, as that input) and
the buffers the runtime keeps between runs (``kept_buffers``: each all-reduce's result, a
bucket's flat tensor, unless the bucket's own tensors take it, ``_reduces_in_place``, or --
where its group shares memory -- its block of shared memory, two halves that the steps
making its arguments write into, ``block_all_reduces``; the result of a step with an
``out=`` overload up to ``PLANNED_BYTES``, unless the caller holds it or the step writes
into a block). The parameters of one pipeline stage live on its ranks only (``mesh_fn`` puts
them there). Each step's outputs
are allocated, except into a kept buffer or a block; views and in-place ops
(``ops.ALIASING``, an in-place op's result; an op with an in-place twin whose first argument
dies at the step, as ``relu_`` for ``relu``; an all-reduce whose arguments die at it) share
their input's storage; a storage is released when the last slot on it is freed
(``frees``); a collective off ``main`` holds its arguments until its result is first used.
``SimReport.peak_memory`` is the peak per rank, ``resident_memory`` the resident part.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from monarch_dsl import isa
from monarch_dsl.compiler import timeline
from monarch_dsl.compiler.interpret import groups, sent_rows
from monarch_dsl.compiler.lower import lower, slot_numbers
from monarch_dsl.compiler.ops import ALIASING, FOREACH, base_name, convolution_flags
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
    ``"compute"``, ``"comm"`` or ``"wait"`` (the stream stands still for a value); in
    ``md.Simulator``'s timelines also ``"overhead"`` (a compiled call's cost to a rank beyond
    its steps), ``"host"`` (an async device's launches) and ``"controller"`` (rank -1)."""

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
    stream), waits excluded; ``peak_memory`` per rank, of which ``resident_memory`` is live
    when the call starts (see the module's docstring)."""

    events: list[SimEvent]
    step_time: float
    peak_memory: dict[int, int]
    compute_time: float
    comm_time: float
    exposed_comm_time: float
    per_stream: dict[tuple[int, str], float] = field(default_factory=dict)
    profile: str = ""
    resident_memory: dict[int, int] = field(default_factory=dict)

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

    def totals(self) -> str:
        """One line: the step time, compute, communication (exposed), the peak memory of the
        busiest rank and the profile."""
        ms = 1e3
        peak = max(self.peak_memory.values(), default=None)  # (none measured)
        return (
            f"step {self.step_time * ms:.3f} ms, compute {self.compute_time * ms:.3f} ms, "
            f"comm {self.comm_time * ms:.3f} ms (exposed {self.exposed_comm_time * ms:.3f} ms)"
            + (f", peak memory {peak / 2**20:.2f} MiB" if peak is not None else "")
            + (f", profile {self.profile}" if self.profile else "")
        )

    def __str__(self) -> str:
        # (print(report): the totals, not every event -- repr() keeps them all)
        return f"SimReport: {self.totals()}; {len(self.events)} events (display() shows them)"

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
        print(self.timeline(width), file=out)
        print(self.totals(), file=out)
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
    base, _ = base_name(name)
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
    profile's ``matmul_passes`` says so; a 2-D matmul: the profile's measured shapes, where it
    has them; a pointwise op the profile measured, ``elementwise``: the longer of its bytes'
    time and its elements'), plus the dispatch overhead."""
    fam = family(step.name)
    if fam == "view":
        return profile.dispatch_overhead
    ins = [types[s.index] for s in isa.leaves((step.args, step.kwargs), Slot)]
    outs = [types[o] for o in step.outs]
    moved = sum(nbytes(t) for t in ins) + sum(nbytes(t) for t in outs)
    eff = profile.efficiency.get(fam, profile.efficiency.get("other", 1.0))
    seconds = moved / (profile.bandwidth(moved) * eff)
    if fam == "pointwise" and profile.elementwise and outs and outs[0][0] is not None:
        arithmetic = profile.elementwise_seconds(base_name(step.name)[0], math.prod(outs[0][0]))
        if arithmetic is not None:  # (the longer of its bytes' time and its elements')
            seconds = max(seconds, arithmetic)
    conv = _conv_flops(step, ins, outs)
    if conv:  # (at the rate of a matmul of as many flops: what im2col or oneDNN make of it)
        eff = profile.efficiency.get("matmul", eff)
        seconds = max(seconds, conv / (profile.matmul_flops_per_second(conv, outs[-1][1]) * eff))
    if fam == "matmul" and outs and outs[0][0] is not None:
        base, _ = base_name(step.name)
        at = 1 if base in ("addmm", "baddbmm", "addbmm") else 0  # (after the added term)
        first = ins[at][0] if len(ins) > at else None
        k = first[-1] if first else 1  # the contracted dim of the left matrix
        flops = 2 * math.prod(outs[0][0]) * k
        if len(outs[0][0]) == 2:  # a measured shape table, where the profile has one
            measured = profile.matmul_seconds(outs[0][0][0], k, outs[0][0][1], outs[0][1])
            if measured is not None:
                return measured + profile.dispatch_overhead
        arithmetic = flops / (profile.matmul_flops_per_second(flops, outs[0][1]) * eff)
        if profile.matmul_passes:
            made = sum(nbytes(t) for t in outs)
            seconds = profile.matmul_memory_seconds(moved - made, made, eff) + arithmetic
        else:
            seconds = max(seconds, arithmetic)
    return seconds + profile.dispatch_overhead


def _conv_flops(step: isa.Compute, ins: Sequence[SlotType], outs: Sequence[SlotType]) -> float:
    """The flops of a ``convolution`` (2 per multiply-add: each element of the output, or of
    the input when transposed, takes a weight's slice of ``C_in / groups x kernel``) or of
    its backward (that once for the input's gradient and once for the weight's, as its output
    mask asks); 0 for other ops or unknown shapes."""
    base, _ = base_name(step.name)
    if base not in ("convolution", "convolution_backward") or len(ins) < 2:
        return 0.0
    backward = base == "convolution_backward"
    x, w = (ins[1], ins[2]) if backward and len(ins) > 2 else (ins[0], ins[1])
    transposed, mask = convolution_flags(base, step.args)
    out = ins[0] if backward else (outs[0] if outs else None)
    big = x if transposed else out
    if big is None or big[0] is None or w[0] is None or not w[0]:
        return 0.0
    once = 2.0 * math.prod(big[0]) * math.prod(w[0]) / w[0][0]
    return once * (mask[0] + mask[1]) if backward else once


# A gradient bucket's all-reduce in a block of shared memory every rank maps (cpp/shm.cpp
# all_reduce_shared): costed by the link's factor for this kind (``Link.factors``, measured by
# ``monarch-dsl calibrate``), the all-reduce's otherwise.
BLOCK_KIND = "all_reduce_block"


def traffic(kind: str, nbytes: float, n: int) -> tuple[float, int]:
    """What collective ``kind`` (``isa.Comm.kind``) over ``n`` ranks moves per rank and in
    how many rounds, for ``nbytes`` (the whole value's: an all-gather's output, the input of
    the others): ring all-reduce 2(n-1)/n of them in 2(n-1) rounds; all-gather,
    reduce-scatter, all-to-all (n-1)/n in n-1 rounds; send/recv all, in one."""
    if kind in ("send", "recv"):
        return nbytes, 1
    if kind in ("all_reduce", BLOCK_KIND):
        return 2 * (n - 1) / n * nbytes, 2 * (n - 1)
    return (n - 1) / n * nbytes, n - 1


def comm_time(
    step: isa.Comm,
    types: Sequence[SlotType],
    n: int,
    profile: DeviceProfile,
    cross_host: bool,
    kind: str | None = None,
) -> float:
    """Alpha-beta time of a communication over ``n`` ranks (``traffic``) on the profile's link
    for that group size, times the link's measured factor for its kind (``Link.factors``;
    ``kind``: another than the step's, ``BLOCK_KIND``). Local redistributions copy through
    memory."""
    ins = sum(nbytes(types[s.index]) for s in isa.leaves(step.args, Slot))
    outs = sum(nbytes(types[o]) for o in step.outs)
    if isinstance(step, (isa.ShardLocal, isa.PartialLocal)):
        return outs / (profile.bandwidth(outs) * profile.efficiency["pointwise"])
    if isinstance(step, (isa.Send, isa.Recv)):
        return profile.link(cross_host, 2).time(*traffic(step.kind, max(ins, outs), 2), "send")
    if n <= 1:
        return profile.dispatch_overhead
    whole = outs if isinstance(step, isa.AllGather) else ins
    kind = kind or step.kind
    return profile.link(cross_host, n).time(*traffic(kind, whole, n), kind)


def steady_step_time(
    step_time: float,
    profile: DeviceProfile,
    inputs: int,
    local_bytes: Sequence[float] = (),
    ranks: int = 1,
    outputs: int = 0,
) -> float:
    """Seconds per call of a compiled step called back to back, from one call's simulated
    ``step_time`` (``plan.simulate()``, the steps alone). The controller issues a call while
    the workers run the one before, so the slower sets the pace: the controller's CPU per call
    (``plan_issue``, ``plan_issue_per_input`` per tensor input of the plan, parameters and
    state included, ``plan_issue_per_output`` per result the call hands the caller
    (``call_results``), and each argument passed as a local torch tensor,
    ``local_bytes`` of it sent to each of ``ranks`` workers over the ``"controller"`` link:
    the whole, or a rank's rows where each is sent its own (a data-parallel batch,
    ``sent_bytes``)) or a rank's (``step_time + plan_overhead``, and ``receiving`` its
    bytes of the local arguments).
    Where the controller and the ``ranks`` ranks of a host share fewer cores
    (``host_cores``), CPU time sets it too: the time their CPU takes with the cores shared
    fairly (``cpu_bound``)."""
    controller = call_issue(profile, inputs, outputs, local_bytes, ranks)
    worker = step_time + profile.plan_overhead + receiving(profile, local_bytes)
    return max(controller, worker, cpu_bound(controller, [worker] * ranks, profile))


def call_issue(
    profile: DeviceProfile,
    inputs: int,
    outputs: int = 0,
    local_bytes: Sequence[float] = (),
    ranks: int = 1,
) -> float:
    """The controller's CPU seconds for one call of a compiled step (see ``steady_step_time``;
    ``md.Simulator`` charges a ``RunPlan`` this too)."""
    seconds = (
        profile.plan_issue
        + profile.plan_issue_per_input * inputs
        + profile.plan_issue_per_output * outputs
    )
    return seconds + sending(profile, local_bytes, ranks)


def call_results(plan: Plan) -> int:
    """The results of a call of ``plan`` that cost the controller a new handle every call (and
    its delete when the next call replaces it): its outputs of kind ``out`` (the function's
    result). A gradient or optimizer state the step keeps takes over the handle of the call
    before (``mesh_fn``'s run: the workers bind the new value to the old ref), so it costs no
    handle after the first call (``steady_step_time``'s ``outputs``)."""
    return sum(1 for o in plan.outputs if o.kind == "out")


def sent_bytes(plan: Plan, args: Sequence[torch.Tensor]) -> list[float]:
    """For a call of ``plan`` with local tensor arguments ``args``: per argument, the bytes
    each rank is sent (on average): its own rows where the ranks' parts are runs of rows
    (``sent_rows``: a data-parallel batch), else the whole (``steady_step_time``'s
    ``local_bytes``)."""
    out: list[float] = []
    for i, a in zip([i for i in plan.inputs if i.kind == "arg"], args, strict=True):
        rows = sent_rows(i.type, plan.sizes)
        nbytes: float = a.numel() * a.element_size()
        if rows is not None:
            nbytes = nbytes * sum(stop - start for start, stop in rows) / len(rows) / a.shape[0]
        out.append(nbytes)
    return out


def sending(profile: DeviceProfile, local_bytes: Sequence[float], ranks: int) -> float:
    """The controller's CPU seconds for sending local tensors (a compiled call's local
    arguments, ``md.to_mesh``'s value) of which each of ``ranks`` workers is sent
    ``local_bytes`` (on average: a rank's rows of a batch; the whole otherwise): the
    ``"controller"`` link's time for the bytes sent in all, per tensor (copying it, encoding
    the message, the socket writes; measured by ``monarch-dsl calibrate``)."""
    link = profile.links.get("controller")
    if link is None:
        return 0.0
    return sum(link.time(b * ranks, 1) for b in local_bytes)


def receiving(profile: DeviceProfile, local_bytes: Sequence[float]) -> float:
    """A worker's seconds for taking in ``local_bytes`` of local tensors the controller sent:
    the bytes at the ``"controller"`` link's bandwidth (the socket reads; the per-message part
    is the worker's overhead per instruction or call, ``eager_op_overhead`` /
    ``plan_overhead``)."""
    link = profile.links.get("controller")
    if link is None or link.bandwidth <= 0:
        return 0.0
    return sum(local_bytes) / link.bandwidth


def cpu_bound(controller: float, ranks: Sequence[float], profile: DeviceProfile) -> float:
    """The wall time in which a host's controller (``controller`` CPU seconds) and its ranks
    (each busy for its seconds of ``ranks``) all run, where they are more processes than the
    host's ``host_cores`` and must share them (a rank waiting in a shared-memory collective
    spins, so its busy time is CPU time); 0 where each has a core of its own (or
    ``host_cores`` is unknown). The OS shares the cores fairly among the processes that can
    run: ``processor_sharing``. The one contention rule of compiled steps
    (``steady_step_time``) and eager programs (``simulate_eager.py``)."""
    if profile.host_cores and len(ranks) + 1 > profile.host_cores:
        return processor_sharing([controller, *ranks], profile.host_cores)
    return 0.0


def processor_sharing(demands: Sequence[float], cores: int) -> float:
    """When the last of processes needing ``demands`` CPU seconds is done on ``cores`` cores
    shared fairly (Linux's CFS, as a fluid): while ``n`` can run, each runs at ``min(1,
    cores / n)`` of a core; the smallest demand is met first, then the rest share the cores.
    Their CPU over the cores where the demands are alike; more where one is larger than the
    rest: 2 ranks of 1.2 ms and a controller of 2 ms on 2 cores take 1.8 ms at 2/3 of a core
    each, then the controller's last 0.8 ms alone: 2.6 ms, not (2 + 2.4) / 2 = 2.2 (a
    controller issuing eager ops one by one, measured 2.7)."""
    t = got = 0.0
    left = sorted(max(0.0, d) for d in demands)
    for i, d in enumerate(left):
        t += (d - got) / min(1.0, cores / (len(left) - i))
        got = d
    return t


# The results the C++ runtime writes again in later runs instead of allocating them
# (cpp/program.cpp's kPlannedBytes): a step with an out= overload whose result has at most
# these bytes.
PLANNED_BYTES = 64 << 10


@functools.cache
def _schemas(name: str) -> tuple[Any, Any] | None:
    """The op ``name`` (``"aten.mm.default"``) and its overload packet, or None."""
    ns, _, rest = name.partition(".")
    base, _, overload = rest.rpartition(".")
    packet = getattr(getattr(torch.ops, ns, None), base, None)
    op = getattr(packet, overload, None) if packet is not None else None
    return (op, packet) if op is not None else None


def _makes_one_tensor(schema: Any) -> bool:
    """One fresh (non-aliasing) tensor returned by a functional op that is not a view."""
    returns = schema.returns
    name = schema.name
    return (
        len(returns) == 1
        and isinstance(returns[0].type, torch.TensorType)
        and returns[0].alias_info is None
        and not schema.is_mutable
        and "view" not in name
        and "alias" not in name
    )


def _same_formals(a: Any, b: Any) -> bool:
    """Names, kinds and types alike (``same_formals`` in cpp/program.cpp): ``div.out`` is no
    out= overload of ``div.Scalar``, whose ``other`` is a Scalar, not a Tensor."""
    return all(
        x.name == y.name and x.kwarg_only == y.kwarg_only and x.type == y.type for x, y in zip(a, b)
    )


@functools.cache
def writes_out(name: str) -> bool:
    """Whether the C++ runtime writes step ``name``'s result into the result of its last run
    (``out_variant`` in cpp/program.cpp): the op's ``out`` overload takes its arguments plus
    ``out`` and has a kernel of a device of its own."""
    found = _schemas(name)
    if found is None or not _makes_one_tensor(found[0]._schema):
        return False
    op, packet = found
    if "out" not in packet.overloads():
        return False
    out = packet.out._schema
    if not any(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"{out.name}.out", key)
        for key in ("CPU", "CUDA")
    ):
        return False
    formals, out_formals = op._schema.arguments, out.arguments
    return (
        len(out_formals) == len(formals) + 1
        and out_formals[-1].is_out
        and _same_formals(formals, out_formals)
    )


@functools.cache
def runs_in_place(name: str) -> bool:
    """Whether step ``name`` has an in-place twin the C++ runtime runs instead, when its first
    argument dies at the step (``inplace_variant`` in cpp/program.cpp: ``relu`` as ``relu_``;
    only for an op without an ``out`` overload it uses)."""
    found = _schemas(name)
    if found is None or writes_out(name):
        return False
    op, _ = found
    schema = op._schema
    if not _makes_one_tensor(schema) or not schema.arguments:
        return False
    ns, _, rest = name.partition(".")
    base, _, overload = rest.rpartition(".")
    twin = _schemas(f"{ns}.{base}_.{overload}")
    if twin is None:
        return False
    formals, twin_formals = schema.arguments, twin[0]._schema.arguments
    first = twin_formals[0] if twin_formals else None
    return (
        len(twin_formals) == len(formals)
        and _same_formals(formals, twin_formals)
        and first is not None
        and first.alias_info is not None
        and first.alias_info.is_write
        and isinstance(first.type, torch.TensorType)
    )


class _Memory:
    """One rank's allocations: storages by id, the slots on each, the live total and peak.
    ``kept``: step index -> the storage (a negative id) of the buffer the runtime keeps for
    that step's result; ``pending``: a collective's result slot -> its arguments, held until
    that result is first used."""

    def __init__(self) -> None:
        self.root: dict[int, int] = {}  # slot -> storage
        self.refs: dict[int, int] = defaultdict(int)  # storage -> slots on it
        self.size: dict[int, int] = {}  # storage -> bytes
        self.live = 0
        self.peak = 0
        self.kept: dict[int, int] = {}
        self.pending: dict[int, list[int]] = {}
        self.made_by: dict[int, int] = {}  # slot -> the compute step that wrote it
        self.reduced_in_place: set[int] = set()  # all-reduce steps whose arguments took it
        # all-reduce steps reduced in a block (block_all_reduces): step -> its kept storage,
        # and each compute step writing its result there -> that all-reduce step
        self.blocks: dict[int, int] = {}
        self.block_makers: dict[int, int] = {}
        self._holders = -(1 << 40)  # ids of hold()'s references, below the kept buffers'

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

    def keep_buffers(self, sizes: dict[int, int], makers: dict[int, int]) -> None:
        """Allocate the buffers the runtime keeps between calls: step k's (``sizes``: step ->
        bytes) as storage -(k + 1); ``makers``: each compute step that writes its result into
        a block of shared memory -> that block's all-reduce step (among ``sizes``)."""
        for k, size in sizes.items():
            self.new(-(k + 1), size)
            self.kept[k] = -(k + 1)
        self.block_makers = makers
        self.blocks = {k: -(k + 1) for k in set(makers.values())}

    def hold(self, results: Sequence[int], args: Sequence[int]) -> None:
        """Keep the storages of ``args`` until one of ``results`` is used (``settle``)."""
        keys = []
        for a in args:
            self._holders -= 1
            self.alias(self._holders, a)
            keys.append(self._holders)
        for r in results:
            self.pending[r] = keys

    def settle(self, slot: int) -> None:
        keys = self.pending.pop(slot, None)
        if keys is None:
            return
        for r in [r for r, k in self.pending.items() if k is keys]:
            del self.pending[r]
        for k in keys:
            self.free(k)

    def held_alone(self, slot: int) -> bool:
        """Whether nothing but ``slot`` (and a kept buffer) holds ``slot``'s storage."""
        r = self.root.get(slot)
        return r is not None and self.refs[r] == 1 + (r < 0)

    def mark(self, extra: int = 0) -> None:
        self.peak = max(self.peak, self.live + extra)


def _in_place_arg(step: isa.Compute, types: Sequence[SlotType], mem: _Memory) -> int | None:
    """The slot step runs in place on (``runs_in_place``), or None: its first argument, used
    once, dying at the step, held by nothing else, and like the result."""
    if len(step.outs) != 1 or not step.args or not isinstance(step.args[0], Slot):
        return None
    a = step.args[0].index
    uses = sum(s.index == a for s in isa.leaves((step.args, step.kwargs), Slot))
    if a not in step.frees or uses != 1 or types[a] != types[step.outs[0]]:
        return None
    if not mem.held_alone(a) or not runs_in_place(step.name):
        return None
    return a


def _reduces_in_place(step: isa.AllReduce, types: Sequence[SlotType], mem: _Memory) -> bool:
    """Whether the runtime leaves an all-reduce's result in its arguments (cpp/program.cpp's
    ``reduces_in_place``, the same rule): each argument dies at the step, is used once, is
    the only slot on its storage (but for the buffer the runtime keeps for the compute step
    that wrote it, when it is that step's result itself) and covers all of it; one dtype. (On
    a backend other than shared memory a bucket of several tensors is reduced through a flat
    copy for the time of the collective, which this does not count.)"""
    args = isa.leaves(step.args, Slot)
    if not args or len(args) != len(step.args) or len(args) != len(step.outs):
        return False
    slots = [a.index for a in args]
    if len({types[a][1] for a in slots}) != 1:
        return False
    for a in slots:
        if a not in step.frees or slots.count(a) != 1 or not mem.held_alone(a):
            return False
        r = mem.root[a]
        if mem.size.get(r) != nbytes(types[a]) or (r < 0 and mem.made_by.get(a) != -r - 1):
            return False
    return True


def _allocate(k: int, step: isa.Step, types: Sequence[SlotType], mem: _Memory) -> None:
    """The storage of step ``k``'s outputs: shared with its input for views and in-place ops
    (an all-reduce's arguments take its result where ``_reduces_in_place``), the buffer the
    runtime keeps for it (``mem.kept``), else new; a multi-tensor all-reduce's results are
    views of one flat tensor; an all-reduce in a block of shared memory (``mem.blocks``) and
    the steps that make its arguments there (``mem.block_makers``): views of the block."""
    kept = mem.kept.get(k)
    if k in mem.blocks:  # (its results: views of the block, as its makers' are)
        for o in step.outs:
            mem.alias(o, mem.blocks[k])
        mem.reduced_in_place.add(k)
        mem.mark()
        return
    if k in mem.block_makers:
        for o in step.outs:
            mem.made_by[o] = k
            mem.alias(o, mem.blocks[mem.block_makers[k]])
        mem.mark()
        return
    if isinstance(step, isa.AllReduce) and _reduces_in_place(step, types, mem):
        for o, a in zip(step.outs, isa.leaves(step.args, Slot)):
            mem.alias(o, a.index)
        mem.reduced_in_place.add(k)
        mem.mark()
        return
    if isinstance(step, isa.Compute):
        for o in step.outs:
            mem.made_by[o] = k
        base, inplace = base_name(step.name)
        if inplace and base.startswith(FOREACH) and step.args:
            targets = [s.index for s in isa.leaves(step.args[0], Slot)]
            for o, t in zip(step.outs, targets):
                mem.alias(o, t)
            for o in step.outs[len(targets) :]:
                mem.new(o, nbytes(types[o]))
            mem.mark()
            return
        first = isa.leaves(step.args, Slot)[:1]
        at = _in_place_arg(step, types, mem) if kept is None else None
        if first and (inplace or base in ALIASING) or at is not None:
            mem.alias(step.outs[0], first[0].index)
            for o in step.outs[1:]:  # (split's, unbind's: views too)
                if base in ALIASING:
                    mem.alias(o, first[0].index)
                else:
                    mem.new(o, nbytes(types[o]))
            mem.mark()
            return
    if kept is not None:
        for o in step.outs:
            mem.alias(o, kept)
    elif isinstance(step, isa.AllReduce) and len(step.outs) > 1:
        mem.new(step.outs[0], sum(nbytes(types[o]) for o in step.outs))
        for o in step.outs[1:]:
            mem.alias(o, step.outs[0])
    else:
        for o in step.outs:
            mem.new(o, nbytes(types[o]))
    mem.mark()


def kept_buffers(
    program: Program, types: Sequence[SlotType], coords: Coords, held: Sequence[int] = ()
) -> dict[int, int]:
    """Step index -> bytes of the buffer the C++ runtime keeps between runs for that step's
    result on the rank at ``coords``: every all-reduce's (its flat result: the runtime keeps
    two, one of them the previous call's result while the caller holds it); a compute step's
    whose op ``writes_out`` a result of at most ``PLANNED_BYTES`` that is not one of ``held``
    (results the caller holds across the next run: the runtime allocates those anew)."""
    out: dict[int, int] = {}
    held_set = set(held)
    for k, step in enumerate(program.steps):
        if not step.runs_on(coords):
            continue
        size = sum(nbytes(types[o]) for o in step.outs)
        if isinstance(step, isa.AllReduce):
            out[k] = size
        elif (
            isinstance(step, isa.Compute)
            and len(step.outs) == 1
            and 0 < size <= PLANNED_BYTES
            and step.outs[0] not in held_set
            and writes_out(step.name)
        ):
            out[k] = size
    return out


def simulate_program(
    program: Program,
    types: Sequence[SlotType],
    profile: ProfileLike = None,
    host_of: Callable[[Coords, int], int] | None = None,
    held: Sequence[int] | None = None,
    args: Sequence[int] = (),
) -> SimReport:
    """Run ``program`` on every rank with costs instead of values. ``types[slot]``: each slot's
    local shape and dtype. ``host_of(coords, rank)``: the host of a rank (default: by the
    profile's ``ranks_per_host``, or the coordinate along a mesh dim named ``host``).
    ``held``: the output slots whose previous values the caller holds while a call runs
    (default: every output; not those the next call takes as inputs). ``args``: the inputs
    that come with the call (its arguments, on every rank: not resident between calls)."""
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
    # An input lives on the ranks of the steps that use it where they all run on the same
    # ranks (a pipeline stage's parameters on that stage), else everywhere (also where no
    # step uses it): the runtime's rule (``mesh_fn._homes``: a buffer two stages of three
    # read is lifted onto the whole mesh, the middle stage's ranks too).
    users: dict[int, set[frozenset[Coords]]] = {s: set() for s in program.inputs}
    for step in program.steps:
        for u in step.uses():
            if u in users:
                users[u].add(frozenset(c for c in ranks if step.runs_on(c)))
    homes = {s: set(next(iter(on))) if len(on) == 1 else set() for s, on in users.items()}
    held = program.outputs if held is None else held
    resident: dict[int, int] = {}
    for c in ranks:
        inputs = [s for s in program.inputs if c in homes[s] or not homes[s] or s in args]

        def one_host(k: int, c: Coords = c) -> bool:  # (step k's group of c shares memory)
            step = program.steps[k]
            if not isinstance(step, isa.AllReduce):
                return False
            active = [r for r in ranks if step.runs_on(r)]
            return prof.intra_host == "shm" and any(
                c in g and len({hosts[r] for r in g}) == 1 for g in groups(active, step.dims)
            )

        kept, held_bytes, makers = _steady(program, types, c, inputs, held, one_host)
        m = mem[c]
        m.keep_buffers(kept, makers)
        m.live += held_bytes  # (freed by no step of this call)
        for s in inputs:
            if s not in args:
                m.new(s, nbytes(types[s]))
        resident[index[c]] = m.live
        for s in inputs:
            if s in args:
                m.new(s, nbytes(types[s]))
        m.mark()
    events: list[SimEvent] = []
    play_program(program, types, prof, index, hosts, {c: 0.0 for c in ranks}, events, mem)
    peak = {index[c]: mem[c].peak for c in ranks}
    report = summarize(events, peak, peak, prof.name)
    return dataclasses.replace(report, resident_memory=resident)


def _steady(
    program: Program,
    types: Sequence[SlotType],
    coords: Coords,
    inputs: Sequence[int],
    held: Sequence[int],
    blocks: Callable[[int], bool] = lambda k: False,
) -> tuple[dict[int, int], int, dict[int, int]]:
    """The buffers the runtime keeps on the rank at ``coords`` (``kept_buffers``), the
    bytes of the previous call's ``held`` outputs there (their storages, found by a run of the
    allocations; not those of the ``inputs``), and, where ``blocks(k)`` (all-reduce step k's
    group shares memory: the runtime's shared-memory collectives, with its defaults -- no
    ``MD_SHM_BLOCKS=0``, no ``MD_SHM_SIZE_LIMIT``), the compute steps that write their
    results into a block of shared memory, each to its all-reduce (``block_all_reduces``:
    such an all-reduce keeps its block, two halves, in place of a result buffer; the
    caller's results of the last call are in one half). A kept compute result the caller
    holds is not kept: the runtime allocates it anew; nor is one of a step that writes into a
    block."""
    kept = kept_buffers(program, types, coords)
    candidates = {k: v for k, v in block_all_reduces(program, types, coords).items() if blocks(k)}

    def dry_run(makers: dict[int, int], sizes: dict[int, int]) -> tuple[_Memory, set[int]]:
        dry = _Memory()
        for s in inputs:
            dry.new(s, nbytes(types[s]))
        dry.keep_buffers({**kept, **sizes}, makers)  # (every block has a maker)
        took = set()
        for k, step in enumerate(program.steps):
            if step.runs_on(coords):
                # (the runtime sets a block up where its second run reduces in place)
                if (
                    k in candidates
                    and not sizes
                    and isinstance(step, isa.AllReduce)
                    and _reduces_in_place(step, types, dry)
                ):
                    took.add(k)
                _allocate(k, step, types, dry)
                for s in step.frees:
                    dry.free(s)
        return dry, took

    dry, took = dry_run({}, {})
    sizes = {k: candidates[k][1] for k in took}
    makers = {m: k for k in took for m in candidates[k][0]}
    if took:
        dry, _ = dry_run(makers, sizes)
    roots = {dry.root[o] for o in held if o in dry.root} - set(inputs)
    taken = {-r - 1 for r in roots if r < 0 and isinstance(program.steps[-r - 1], isa.Compute)}
    taken |= dry.reduced_in_place - set(sizes)  # (the runtime makes no buffer for those)
    in_blocks = {-(k + 1) for k in sizes}  # (the last call's results in a block: kept)
    held_bytes = sum(dry.size[r] for r in roots if r not in in_blocks)
    # (a step that writes into a block lets go of the buffer it kept before it)
    kept = {k: sizes.get(k, v) for k, v in kept.items() if k not in taken and k not in makers}
    return kept, held_bytes, makers


def block_all_reduces(
    program: Program, types: Sequence[SlotType], coords: Coords
) -> dict[int, tuple[list[int], int]]:
    """The all-reduces on the rank at ``coords`` that the runtime may reduce in a block of
    shared memory (cpp/program.cpp ``set_up_block``, where the ranks share memory and its run
    reduces in place): step -> the compute steps that write their results there (each the
    step that made an argument's storage, back through views, with an out= overload:
    ``writes_out``; making no other argument, and all of it), and the block's bytes (two
    halves, each argument's place in one 64-byte aligned). Needs one such step."""
    writer: dict[int, int] = {}
    out: dict[int, tuple[list[int], int]] = {}
    for k, step in enumerate(program.steps):
        if not step.runs_on(coords):
            continue
        if isinstance(step, isa.AllReduce):
            args = isa.leaves(step.args, Slot)
            makers = [_storage_maker(program, writer, a.index, k) for a in args]
            made = [
                m
                for m, a in zip(makers, args)
                if m is not None
                and makers.count(m) == 1
                and nbytes(types[program.steps[m].outs[0]]) == nbytes(types[a.index])
            ]
            if made and args and len({types[a.index][1] for a in args}) == 1:
                es = itemsize(types[args[0].index][1])
                align = max(1, 64 // es)
                half = sum(-(-(nbytes(types[a.index]) // es) // align) * align for a in args)
                out[k] = (made, 2 * half * es)
        for o in step.outs:
            writer[o] = k
    return out


def _storage_maker(program: Program, writer: dict[int, int], slot: int, before: int) -> int | None:
    """The compute step that made ``slot``'s storage (``storage_maker`` in cpp/program.cpp):
    back through view ops (``views_first_arg``) to one that ``writes_out``; None where there
    is none."""
    for _ in range(64):
        k = writer.get(slot)
        if k is None or k >= before:
            return None
        step = program.steps[k]
        if not isinstance(step, isa.Compute) or len(step.outs) != 1:
            return None
        if writes_out(step.name):
            return k
        if not step.args or not isinstance(step.args[0], Slot) or not views_first_arg(step.name):
            return None
        slot, before = step.args[0].index, k
    return None


@functools.cache
def views_first_arg(name: str) -> bool:
    """Whether op ``name`` returns one tensor that aliases an argument it does not write
    (``Tensor(a)`` in its schema: transpose, view, detach, to.dtype), the runtime's test
    (``view_of`` in cpp/program.cpp); its first argument, where that is a tensor."""
    found = _schemas(name)
    if found is None:
        return False
    returns = found[0]._schema.returns
    alias = returns[0].alias_info if len(returns) == 1 else None
    return alias is not None and not alias.is_write


# A reuse distance is looked for among at most this many storages touched since (beyond: cold).
REUSE_DEPTH = 4096


def warm_fraction(distance: float, cache: float) -> float:
    """How much of an input last touched ``distance`` bytes ago (the distinct bytes a rank
    touched since) is still in its share ``cache`` of the last-level cache: 1 within a quarter
    of it (where calibration measured the warm rates), 0 from all of it on (its other rates
    cycle through more), log-linear between."""
    if distance <= cache / 4:
        return 1.0
    if distance >= cache:
        return 0.0
    return math.log(cache / distance) / math.log(4)


def warm_fractions(
    program: Program,
    types: Sequence[SlotType],
    prof: DeviceProfile,
    ranks: Sequence[Coords],
    hosts: dict[Coords, int],
) -> dict[Coords, dict[int, float]]:
    """Per rank, each compute step's share of bytes still in the cache when it runs: its
    inputs', and its new results' storages' (the allocator gives a step the storage it gave
    it in the last call, or one as long unused; ``warm_fraction`` of each one's reuse
    distance, weighted by its bytes), in a steady
    state of calls (the program run twice: an input's last touch may be in the call before,
    as a weight's update is before its next forward). A rank's share of the cache: the
    profile's ``cache_bytes`` over the ranks of its host. Storages are followed through
    views and in-place steps as the memory model does (``_allocate``). Empty where the profile
    has no warm rates."""
    if not prof.has_warm:
        return {}
    per_host = Counter(hosts[c] for c in ranks)
    done: dict[tuple[tuple[int, ...], int], dict[int, float]] = {}
    out = {}
    for c in ranks:
        mine = tuple(k for k, step in enumerate(program.steps) if step.runs_on(c))
        share = prof.cache_bytes // per_host[hosts[c]]
        if (mine, share) not in done:
            done[(mine, share)] = _reuse(program, types, mine, share)
        out[c] = done[(mine, share)]
    return out


def _reuse(
    program: Program, types: Sequence[SlotType], mine: Sequence[int], cache: int
) -> dict[int, float]:
    recent: OrderedDict[int, int] = OrderedDict()  # storage -> bytes, the latest last

    def distance(root: int) -> float:
        seen = 0
        for depth, r in enumerate(reversed(recent)):
            if r == root:
                return seen
            seen += recent[r]
            if seen >= cache or depth >= REUSE_DEPTH:
                break
        return math.inf

    def touch(root: int | None, size: int) -> None:
        if root is not None:
            recent.pop(root, None)
            recent[root] = size

    fractions: dict[int, float] = {}
    for call in range(2):
        mem = _Memory()
        for s in program.inputs:
            mem.new(s, nbytes(types[s]))
        for k in mine:
            step = program.steps[k]
            ins = [s.index for s in isa.leaves(step.args, Slot)]
            if isinstance(step, isa.Compute):
                ins += [s.index for s in isa.leaves(step.kwargs, Slot)]
            fresh = [o for o in step.outs if o not in mem.root]
            _allocate(k, step, types, mem)
            made = [o for o in fresh if mem.root.get(o) == o]
            if call == 1 and isinstance(step, isa.Compute):
                weighted = total = 0.0
                for s in ins + made:  # (a new result's storage: where the last call's was)
                    size = nbytes(types[s])
                    r = mem.root.get(s)
                    warm = warm_fraction(distance(r), cache) if r is not None else 0.0
                    weighted += warm * size
                    total += size
                fractions[k] = weighted / total if total else 1.0
            for s in ins + list(step.outs):
                r = mem.root.get(s)
                touch(r, mem.size.get(r, 0) if r is not None else 0)
            for s in step.frees:
                mem.free(s)
    return fractions


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
    warm: dict[Coords, dict[int, float]] | None = None,
) -> dict[Coords, float]:
    """The timeline of one run of ``program``, appended to ``events``: every rank at
    ``coords`` (its rank ``rank_of[coords]`` in the events, its host ``hosts[coords]``)
    starts at ``begin[coords]`` with its inputs ready then; its allocations go to
    ``mem[coords]``; ``stream_of`` names the events' streams; ``warm``: ``warm_fractions``
    of the program on these ranks, where the caller keeps them (computed here else). Returns
    when each rank's last step ends (``simulate_program`` runs one from 0; ``md.Simulator``
    continues an eager timeline with it)."""
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

    settle_at = isa.settles(program)
    if warm is None:
        warm = warm_fractions(program, types, prof, ranks, hosts)
    hot = prof.warm() if warm else prof
    for k, step in enumerate(program.steps):
        active = [c for c in ranks if step.runs_on(c)]
        waits = [s for s in settle_at[k] if s not in step.uses()]
        for c in active:  # the runtime's loop (main's thread) finishes those collectives
            idle = free_at.get((c, "main"), begin[c])
            until = max((ready[c][s] for s in waits), default=idle)
            if until > idle:
                wait = SimEvent(
                    rank_of[c], stream_of("main"), f"wait {step.op}", idle, until, "wait"
                )
                events.append(wait)
                free_at[(c, "main")] = until
        if isinstance(step, isa.COLLECTIVES):
            for group in groups(active, step.dims):
                cross = len({hosts[c] for c in group}) > 1
                # A link that does not overlap compute runs the collective in main's thread.
                blocking = not prof.link(cross, len(group)).overlap and step.stream != "main"
                start = max(
                    max(reached(c, step), free_at.get((c, "main"), begin[c]) if blocking else 0.0)
                    for c in group
                )
                # (a bucket in a block of shared memory on every rank of the group)
                kind = BLOCK_KIND if all(k in mem[c].blocks for c in group) else None
                end = start + comm_time(step, types, len(group), prof, cross, kind)
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
            faster = cost - compute_time(step, types, hot) if warm else 0.0
            for c in active:
                start = reached(c, step)
                seconds = cost - faster * warm[c].get(k, 0.0) if warm else cost
                record(c, step, start, start + seconds, "compute")
        else:
            raise TypeError(f"the simulator has no handler for {type(step).__name__}")
        for c in active:
            m = mem[c]
            for u in settle_at[k]:
                m.settle(u)
            _allocate(k, step, types, m)
            if isinstance(step, isa.COLLECTIVES) and step.stream != "main":
                # started now, finished at its result's first use: it holds its arguments
                m.hold(step.outs, [s.index for s in isa.leaves(step.args, Slot)])
            for s in step.frees:
                m.free(s)
    for c in ranks:
        for slot in list(mem[c].pending):
            mem[c].settle(slot)
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


def summarize(
    events: list[SimEvent],
    ranks: Iterable[int],
    peak: dict[int, int] | None = None,
    profile: str = "",
) -> SimReport:
    """The report of ``events`` on ``ranks``: totals of the busiest rank (see ``SimReport``);
    ``peak``: the memory per rank, where known (a simulated run's; a measured one has none)."""
    busy = [e for e in events if e.kind != "wait"]
    per_stream: dict[tuple[int, str], float] = defaultdict(float)
    for e in busy:
        per_stream[(e.rank, e.stream)] += e.end - e.start
    compute, comm, exposed = 0.0, 0.0, 0.0
    for r in ranks:
        mine = [e for e in busy if e.rank == r]
        comp = _union([(e.start, e.end) for e in mine if e.kind == "compute"])
        com = _union([(e.start, e.end) for e in mine if e.kind == "comm"])
        compute = max(compute, _length(comp))
        comm = max(comm, _length(com))
        exposed = max(exposed, _uncovered(com, comp))
    step = max((e.end for e in events), default=0.0) - min((e.start for e in events), default=0.0)
    return SimReport(events, step, peak or {}, compute, comm, exposed, dict(per_stream), profile)


def slot_types(plan: Plan) -> list[SlotType]:
    """Each slot's local shape and dtype, in the numbering ``lower`` gives the plan's values
    (``lower.slot_numbers``)."""
    sizes = plan.sizes
    slots, n = slot_numbers(plan)
    out: list[SlotType] = [(None, "")] * n
    for i in plan.inputs:
        out[slots[i.name]] = (
            i.type.local_shape(sizes) if i.type.shape is not None else None,
            i.type.dtype,
        )
    for ins in plan.body:
        if len(ins.types) != len(ins.outs):
            raise PlanError(
                f"{ins.op}: {len(ins.outs)} results but {len(ins.types)} types", ins.loc
            )
        for o, t in zip(ins.outs, ins.types):
            out[slots[o]] = (t.local_shape(sizes) if t.shape is not None else None, t.dtype)
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
    program = lower(plan)
    # The previous call's outputs the caller holds while a call runs: not those the next
    # call takes back as inputs (a parameter's gradient, optimizer state): counted there.
    names = {i.name for i in plan.inputs}
    held = [s for s, o in zip(program.outputs, plan.outputs) if o.name not in names]
    args = [s for s, i in zip(program.inputs, plan.inputs) if i.kind in ("arg", "hyper")]
    return simulate_program(program, slot_types(plan), profile, held=held, args=args)


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
    "call_results",
    "kept_buffers",
    "writes_out",
    "runs_in_place",
    "PLANNED_BYTES",
    "call_issue",
    "cpu_bound",
    "processor_sharing",
    "traffic",
    "family",
]
