"""The simulator of eager instructions: the back end of ``md.Simulator`` that executes the
controller's instructions (``isa.INSTRUCTIONS``) with costs instead of data.

Values are meta tensors: each rank has a ref table of them, so every shape and dtype is
torch's own (a ``CallOp`` runs its aten op on the meta tensors of its inputs; ranks whose
inputs are the same meta tensors share one run). The model, per rank:

- **Controller.** The controller's CPU per instruction it issues (``Delete``, ``DefineMesh``
  and ``DefinePlan`` are free): ``controller_overhead``, or ``controller_reduce`` for a
  ``Reduce`` and ``controller_borrow`` for a ``BorrowBegin`` / ``BorrowEnd`` (they build more:
  a reduce's output description, a borrow's bookkeeping), and for a ``RunPlan`` (a compiled
  step's call) ``simulate.call_issue``, as ``steady_step_time`` counts it, where the profile
  measured it (``plan_issue``: per call, input, and result handle made (``call_results``),
  and the local arguments sent);
  ``controller_backward`` more for the
  first instruction each node of autograd's backward pass issues (``Issued.backward``,
  ``Issued.node``: its graph walk and its formula run on the controller too, once a node
  whatever ops the formula issues), and ``controller_switch`` more when the
  thread issuing instructions changed (``Issued.thread``: ``md.grad_generator`` hands each
  gradient from its helper thread to the caller and back). The instructions are issued one
  after another at that pace: one cannot start on a worker before it was issued. With a
  profile's ``controller_measured`` (a calibrated one), the controller's own Python is not
  modelled but measured: each instruction also costs the issuing thread's CPU since its
  previous one as the simulated program ran (``Issued.python``: the user's loop, nn.Module
  calls, the optimizer, autograd's engine, the dispatch into md.Tensor and the handlers,
  which the controller runs the same on a real mesh), and the terms above are then what the
  controller spends beyond that (encoding, sending: calibrated as the rest). Without it, the
  user's Python between ops is not modelled. A replayed batch (``tensor/replay.py``,
  which ``md.Simulator``'s engine runs as the workers' does: ``Replayed``) costs
  ``replay_issue`` for its run and, for each instruction it stands for, its eager cost
  times ``controller_replayed / controller_overhead`` (the controller still issues and
  describes it, and does not encode or send it), plus its autograd terms.
- **Streams.** Each stream of each rank has a clock: an instruction starts when its stream has
  finished the previous one and the controller has issued it, and takes its cost.
- **Local data sent** (``md.to_mesh``'s value, a compiled call's local arguments): the
  controller's ``simulate.sending`` time for the bytes to every rank, and each rank's
  ``simulate.receiving`` time before the instruction's own (the ``"controller"`` link).
- **Compute** (``CallOp``): the roofline time of ``compiler/simulate.compute_time`` for the
  op's input and output shapes (the one cost function of compiled and eager programs) plus
  the profile's ``eager_op_overhead`` (what a worker spends on an eager instruction beyond
  the op: receiving and decoding it, the executor's bookkeeping); a ``CallFunction``
  (``@md.remote``) costs the time to read its inputs and write its outputs, plus the same.
  On an async device (``DeviceProfile.async_device``: a GPU) the stream's host thread has a
  clock of its own: it launches the op in ``host_seconds`` (the dispatch, that overhead and a
  matmul's launches), and the device runs it for the rest of its time once both it has
  finished the ops before and the launch is done; the host thread goes on to the next op
  meanwhile (its launches are ``"host"`` events, on a row ``<stream>:host``). Other
  instructions keep the one clock (the device's); after a collective, a transfer or a
  compiled step the host thread has waited for the device (it reads their failure flags).
  (The shared-cores bound below counts every event's time, device time included: GPU
  profiles set no ``host_cores``.)
- **Collectives** (``Reduce``): start when every member of the group has reached them, end
  together after ``comm_time`` (the alpha-beta model of the profile's link, intra-host or
  inter-host by the mesh dim ``host``) plus ``eager_op_overhead``.
- **Transfers** (``to_mesh``): each pair is a send of ``comm_time``; the receiver has the
  value when both the send has ended and it reached the receive.
- **Borrows.** ``BorrowBegin``: the borrowing stream waits until the origin stream has reached
  the point where the borrow was issued; ``BorrowEnd``: the origin waits, before its next
  instruction, until the borrowing stream has reached the drop. Waits are ``"wait"`` events.
  On a CPU worker each costs ``eager_op_overhead`` on the borrowing stream (an ``"overhead"``
  event: taken in and decoded as any instruction, its events queued on the streams).
- **Compiled steps** (``RunPlan``, a replay's too): the program's timeline
  (``compiler/simulate.play_program``) continues from the stream's clock on each rank; the
  stream is busy until the rank's last step ends, and then for the profile's
  ``plan_overhead`` (an ``"overhead"`` event: taking in the call, the plan runner's
  bookkeeping, the failure-flag round; as ``steady_step_time`` counts it). The program's
  slot shapes come from running its steps on meta tensors; a replay's run runs them on the
  rank's own values and this run's numbers, as its eager instructions would have: what it
  leaves (parameters written in place, views of its inputs) is on the storage it would be
  on.
- **Memory.** A ref's storage is allocated when made; views and in-place results share their
  input's storage (the same meta storage); a storage is freed when the last ref on it is
  deleted. During a compiled step, the program's own peak comes on top of what is live.
- **Shared cores.** Where a host's ranks and the controller are more processes than its
  ``host_cores`` (2 ranks and a controller on 2 cores), they take turns on the cores: the
  step time is at least the time their CPU seconds take with the cores shared fairly
  (``simulate.cpu_bound``, the rule of compiled steps' ``steady_step_time`` too; the
  controller's on the first host: a controller busier than its ranks finishes alone). A bound on
  the report's ``step_time`` rather than a stretched timeline: which process the OS runs
  when is not something the model knows, and the timeline keeps each instruction's own cost.
  On such a host a rank also waits in each eager collective for a peer the OS runs later,
  its CPU spinning: the workers take in a batch of instructions at once (the controller
  sends what it issued in ``batch_window``, or all it holds when the caller waits for a
  fetch), and one runs its part while the other waits for a core. That CPU,
  ``collective_wait`` times the rank's work in the batch before the collective
  (``window_work``: its work on any stream -- its process's CPU, which its peer waits for --
  issued in the ``batch_window`` before it, since the rank's previous collective, compiled
  step on several ranks or fetch), counts in the bound too, not in the timeline.
- ``Fetch`` replies zeros of the value's shape and dtype (a barrier replies None); a failing
  op (a bad shape) fails its outputs as on the workers, and fetching them raises.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from monarch_dsl import isa
from monarch_dsl.compiler.interpret import groups, local_value
from monarch_dsl.compiler.lower import run_step, shard_local
from monarch_dsl.compiler.plan import TensorType
from monarch_dsl.compiler.profile import DeviceProfile
from monarch_dsl.compiler.simulate import (
    SimEvent,
    SimReport,
    SlotType,
    _Memory,
    call_issue,
    comm_time,
    compute_time,
    cpu_bound,
    family,
    play_program,
    receiving,
    sending,
    summarize,
    warm_fractions,
)
from monarch_dsl.isa import Slot, collectives, dtype_name
from monarch_dsl.isa.opnames import resolve_op
from monarch_dsl.mesh import all_coords, coords_of_index, index_of_coords

Failure = tuple[int, str, str, str, str]  # (rank, line, op, error, traceback)
Reply = Callable[[int, int, Any], None]  # (call id, rank, value)
ReplyFailure = Callable[[int, int, Failure], None]  # (call id, rank, failure tuple)
# (a @md.remote function's payload, its args, kwargs, with meta tensors) -> its result
FunctionShapes = Callable[[bytes, tuple[Any, ...], dict[str, Any]], Any]

FREE = (isa.Delete, isa.DefineMesh, isa.DefinePlan)  # cost the controller nothing


class Issued(NamedTuple):
    """How the controller issued an instruction: the ``thread`` that issued it (an id),
    whether autograd's ``backward`` pass did, and whether it is the first (not free) one that
    a node of the pass issued on that thread (``node``: a node's formula issues several,
    ``AddmmBackward0`` a ``t`` and an ``mm`` for each input; the graph walk and the formula's
    Python are the node's; an instruction of the pass outside any node, a final callback's,
    is no node's) -- ``md.Simulator``'s engine records them. ``python``: the issuing thread's
    CPU seconds since its previous instruction, measured as the simulated program ran (the
    user's Python, autograd, the dispatch into md.Tensor and the engine's handlers: what the
    controller runs the same on a real mesh; the simulator's own work left out), which a
    profile with ``controller_measured`` charges."""

    thread: int
    backward: bool
    node: bool = True
    python: float = 0.0


NUMBER = "number"  # the type of a plan input that is a float (RunPlan.values: a replay's)


class Replayed(NamedTuple):
    """A replay's ``RunPlan`` (``tensor/replay.py``): the instructions of the batch it stands
    for, each with how it was issued (``Issued`` or None) -- the controller issued them all
    the same, and described them, but did not encode or send them."""

    body: tuple[tuple[Any, Issued | None], ...]


# The controller's CPU seconds for an instruction are the sum of these terms (``charged``);
# "replayed": an instruction of a replayed batch, "replay": the run that stands for them.
CONTROLLER_TERMS = ("op", "reduce", "borrow", "backward", "switch", "plan", "replayed", "replay")


class Failed(NamedTuple):
    """A failed value: ``failure`` is (rank, line, op, error, traceback), as a worker's."""

    failure: Failure


def _type(x: Any) -> SlotType:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), dtype_name(x.dtype))
    return (None, "")


def _meta(x: Any) -> Any:
    """``x`` with every tensor a meta tensor of its shape and dtype."""
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return x.detach().to("meta")
    return x


def _carried(ins: Any) -> list[int]:
    """The bytes of each local tensor an instruction carries to the workers (``md.to_mesh``'s
    value in a ``CallOp``, a remote function's tensor arguments; not the meta tensors here)."""
    if not isinstance(ins, (isa.CallOp, isa.CallFunction)):
        return []
    return [
        x.numel() * x.element_size()
        for x in pytree.tree_leaves((ins.args, ins.kwargs))
        if isinstance(x, torch.Tensor) and x.device.type != "meta"
    ]


def step_name(op: str) -> str:
    """A ``CallOp``'s dispatcher name as a compute step's (``aten::mm`` -> ``aten.mm.default``)."""
    ns, _, rest = op.partition("::")
    return f"{ns}.{rest if '.' in rest else rest + '.default'}"


def op_time(
    name: str, ins: Sequence[SlotType], outs: Sequence[SlotType], prof: DeviceProfile
) -> float:
    """``compute_time`` of op ``name`` (a step's name) on inputs and outputs of these types."""
    n = len(ins)
    step = isa.Compute(
        name=name, args=tuple(Slot(i) for i in range(n)), outs=tuple(range(n, n + len(outs)))
    )
    return compute_time(step, [*ins, *outs], prof)


class _Storages(_Memory):
    """One rank's memory (``simulate._Memory``, by ref): a ref shares the storage of any other
    ref on the same meta storage (a view, an in-place result, a borrow)."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[int, int] = {}  # meta storage -> the first ref that was on it

    def add(self, ref: int, value: Any) -> None:
        self.drop(ref)
        if not isinstance(value, torch.Tensor):
            return
        storage = value.untyped_storage()
        on = self.first.get(storage._cdata)
        if on is not None and self.root.get(on, on) in self.size:
            self.alias(ref, on)
        else:
            self.first[storage._cdata] = ref
            self.new(ref, storage.nbytes())
            self.mark()

    def drop(self, ref: int) -> None:
        self.free(ref)


class EagerSimulator:
    """Every rank of an allocation of ``sizes`` (dims ``dims``) executing instructions with
    the costs of ``prof``; ``events`` is the timeline. ``reply`` / ``reply_failure`` answer
    fetches; ``function_shapes`` runs a remote function on meta tensors (its propagator).
    ``batch_window``: the longest the controller holds issued instructions before it sends
    them (``runtime/controller.py``'s ``FLUSH_DELAY``; see ``collective_wait``)."""

    def __init__(
        self,
        dims: tuple[str, ...],
        sizes: tuple[int, ...],
        prof: DeviceProfile,
        reply: Reply,
        reply_failure: ReplyFailure,
        report: Callable[[Failure], None],
        function_shapes: FunctionShapes,
        trace_controller: bool = False,
        batch_window: float = 0.0,
    ):
        self.world = math.prod(sizes)
        self.prof = prof
        self.reply, self.reply_failure, self.on_failure = reply, reply_failure, report
        self.function_shapes = function_shapes
        self.trace_controller = trace_controller
        h = dims.index("host") if "host" in dims else None
        self.host = [
            coords_of_index(r, sizes)[h] if h is not None else r // prof.ranks_per_host
            for r in range(self.world)
        ]
        self.meshes: dict[int, isa.DefineMesh] = {}
        self.plans: dict[int, isa.DefinePlan] = {}
        self.replays: set[int] = set()  # plans a replay runs (tensor/replay.py)
        self.plan_types: dict[tuple[int, tuple[SlotType, ...]], list[SlotType]] = {}
        # (those keys, the ranks that run it) -> simulate.warm_fractions: the same every call
        self.plan_warm: dict[tuple[Any, ...], dict[tuple[int, ...], dict[int, float]]] = {}
        self.refs: list[dict[int, Any]] = [{} for _ in range(self.world)]
        self.memory = [_Storages() for _ in range(self.world)]
        self.clock: dict[tuple[int, str], float] = defaultdict(float)
        # With an async device (``DeviceProfile.async_device``): when each stream's host
        # thread is free to launch its next op (``clock`` is then the device's).
        self.launch: dict[tuple[int, str], float] = defaultdict(float)
        self.floor: dict[tuple[int, str], tuple[float, str]] = {}  # wait for this first
        self.events: list[SimEvent] = []
        self.batch_window = batch_window
        # Per rank: (when issued, seconds) of its work since its previous collective, within
        # the batch window; and the sum, over its collectives, of that work at each.
        self.recent: list[deque[tuple[float, float]]] = [deque() for _ in range(self.world)]
        self.window_work = [0.0] * self.world
        self.issued = 0.0  # when the controller issued the latest instruction
        self.thread: int | None = None  # the thread that issued it
        # How many times each of CONTROLLER_TERMS was charged (calibration attributes measured
        # CPU time to the terms with these counts).
        self.charged: dict[str, int] = dict.fromkeys(CONTROLLER_TERMS, 0)
        self.python = 0.0  # the measured seconds of the instructions issued (Issued.python)
        self.handlers: dict[type, Callable[[Any, list[int]], None]] = {
            isa.CallOp: self.call_op,
            isa.CallFunction: self.call_function,
            isa.Reduce: self.reduce,
            isa.Transfer: self.transfer,
            isa.Fetch: self.fetch,
            isa.Delete: self.delete,
            isa.Seed: lambda ins, ranks: None,
            isa.DefineMesh: self.define_mesh,
            isa.BorrowBegin: self.borrow_begin,
            isa.BorrowEnd: self.borrow_end,
            isa.DefinePlan: self.define_plan,
            isa.RunPlan: self.run_plan,
        }

    # ---- driving ---------------------------------------------------------------------------
    def run(
        self,
        ranks: Sequence[int],
        items: Sequence[tuple[int, Any]],
        issued: Sequence[Issued | Replayed | None] | None = None,
    ) -> None:
        """A batch of (mesh id, instruction) sent to ``ranks``: each runs on those of its
        mesh's ranks (mesh -1: all of ``ranks``). ``issued``: how each was issued (None:
        by one thread, outside a backward pass)."""
        posted = set(ranks)
        for i, (mesh, ins) in enumerate(items):
            handler = self.handlers.get(type(ins))
            if handler is None:
                raise TypeError(f"the simulator has no handler for {type(ins).__name__}")
            if mesh < 0:
                here = sorted(posted)
            else:
                here = [r for r in self.meshes[mesh].ranks if r in posted]
            if not isinstance(ins, FREE):
                how = issued[i] if issued is not None else None
                if isinstance(how, Replayed):
                    self.replays.add(ins.plan)
                start = self.issued
                self.issued += self.controller_cost(ins, how, len(here))
                if self.trace_controller:
                    name = getattr(ins, "op", type(ins).__name__)
                    self.events.append(
                        SimEvent(-1, "controller", name, start, self.issued, "controller")
                    )
            handler(ins, here)

    def controller_cost(self, ins: Any, how: Issued | Replayed | None, ranks: int = 1) -> float:
        """The controller's CPU seconds for issuing ``ins`` to ``ranks`` workers (see the
        module's docstring), counted in ``charged``."""
        if isinstance(how, Replayed):
            return self._replayed_cost(how, ranks)
        term, cost = self._cost(ins, ranks)
        self.charged[term] += 1
        return cost + self._autograd_cost(how) + self._python(how)

    def _python(self, how: Issued | None) -> float:
        """The issuing thread's measured seconds before the instruction (``Issued.python``),
        counted in ``python``; charged where the profile has ``controller_measured``."""
        if how is None:
            return 0.0
        self.python += how.python
        return how.python if self.prof.controller_measured else 0.0

    def _replayed_cost(self, how: Replayed, ranks: int) -> float:
        """A replay's run: ``replay_issue``, and each instruction of the batch it stands for
        at ``controller_replayed / controller_overhead`` of its eager cost, plus its autograd
        terms (uncalibrated, ``controller_replayed`` 0: at its eager cost)."""
        p = self.prof
        self.charged["replay"] += 1
        scale = 1.0
        if p.controller_replayed and p.controller_overhead:  # (an op's share of its cost)
            scale = p.controller_replayed / p.controller_overhead
        cost = p.replay_issue
        for ins, issued in how.body:
            if isinstance(ins, FREE):
                continue
            self.charged["replayed"] += 1
            cost += self._cost(ins, ranks)[1] * scale + self._autograd_cost(issued)
            cost += self._python(issued)
        return cost

    def _autograd_cost(self, how: Issued | None) -> float:
        """``controller_backward`` for the first instruction of a backward node,
        ``controller_switch`` when the issuing thread changed (counted in ``charged``)."""
        if how is None:
            return 0.0
        p, cost = self.prof, 0.0
        if how.backward and how.node:
            self.charged["backward"] += 1
            cost += p.controller_backward
        if self.thread is not None and how.thread != self.thread:
            self.charged["switch"] += 1
            cost += p.controller_switch
        self.thread = how.thread
        return cost

    def _cost(self, ins: Any, ranks: int) -> tuple[str, float]:
        """(the term, the controller's CPU seconds) of issuing ``ins`` eagerly, autograd's
        terms aside."""
        p = self.prof
        if isinstance(ins, isa.Reduce):
            term, cost = "reduce", p.controller_reduce or p.controller_overhead
        elif isinstance(ins, (isa.BorrowBegin, isa.BorrowEnd)):
            term, cost = "borrow", p.controller_borrow or p.controller_overhead
        elif isinstance(ins, isa.RunPlan) and p.plan_issue:  # (calibrated: as a compiled call)
            term = "plan"
            mesh_ranks = self.meshes[ins.mesh].ranks if ins.mesh in self.meshes else []
            ranks = len(mesh_ranks) or 1
            sent = [v.numel() * v.element_size() for _, v in ins.sent]
            if ins.parts:  # each rank its own rows: what a rank is sent, on average
                sent += [sum(v.nbytes(r) for r in mesh_ranks) / ranks for _, v in ins.parts]
            # (a new handle per result; a ref the ranks hold already -- a gradient kept --
            # is bound to the new value: no handle, as simulate.call_results counts)
            held = [self.refs[r] for r in mesh_ranks]
            outputs = sum(1 for o in ins.outputs if o >= 0 and not any(o in h for h in held))
            cost = call_issue(p, len(ins.inputs), outputs, sent, ranks)
        else:
            term, cost = "op", p.controller_overhead
            carried = _carried(ins)
            if carried:  # local tensors in the instruction (md.to_mesh): sent to each rank
                cost += sending(p, carried, ranks)
        return term, cost

    def report(self) -> SimReport:
        peak = {r: self.memory[r].peak for r in range(self.world)}
        out = summarize(list(self.events), peak, peak, self.prof.name)
        # Shared cores: the CPU of each host's ranks (and of the controller, on the first
        # host) over its cores bounds the step time; where they are more processes than its
        # cores, each rank's CPU includes its waits in eager collectives (collective_wait).
        cpu = self.rank_cpu()
        first = min(self.host, default=0)
        bound = 0.0
        for h in set(self.host):
            controller = self.issued if h == first else 0.0
            ranks = [cpu[r] for r in range(self.world) if self.host[r] == h]
            bound = max(bound, cpu_bound(controller, ranks, self.prof))
        if bound > out.step_time:
            out = dataclasses.replace(out, step_time=bound)
        return out

    def rank_cpu(self) -> list[float]:
        """Each rank's CPU seconds so far, as the shared-cores bound counts them: its busy
        time and, where its host's ranks (and the controller, on the first host) are more
        processes than the host's cores, its waits in eager collectives."""
        busy = self.busy()
        first = min(self.host, default=0)
        cores = self.prof.host_cores
        out = []
        for r, h in enumerate(self.host):
            shared = cores and self.host.count(h) + (h == first) > cores
            out.append(
                busy[r] + (self.prof.collective_wait * self.window_work[r] if shared else 0.0)
            )
        return out

    def busy(self) -> list[float]:
        """Each rank's busy seconds so far: its events', waits not counted."""
        busy = [0.0] * self.world
        for e in self.events:
            if e.kind != "wait" and e.rank >= 0:
                busy[e.rank] += e.end - e.start
        return busy

    # ---- time --------------------------------------------------------------------------------
    def _begin(self, r: int, stream: str) -> float:
        """When the next instruction of ``stream`` on rank ``r`` can start (after a borrow
        wait, recorded)."""
        start = max(self.clock[(r, stream)], self.issued)
        waited = self.floor.pop((r, stream), None)
        if waited is not None and waited[0] > start:
            self.events.append(SimEvent(r, stream, waited[1], start, waited[0], "wait"))
            start = waited[0]
        self.clock[(r, stream)] = start
        return start

    def _busy(self, r: int, stream: str, name: str, start: float, end: float, kind: str) -> None:
        self.events.append(SimEvent(r, stream, name, start, end, kind))
        self.clock[(r, stream)] = end
        if kind == "comm" and self.prof.async_device:
            self._synced(r, stream)
        recent = self.recent[r]
        recent.append((self.issued, end - start))
        while recent[0][0] < self.issued - self.batch_window:
            recent.popleft()

    def _synced(self, r: int, stream: str) -> None:
        """The stream's host thread waited for the device (a collective's or a transfer's
        failure flag, a plan's flag round, read on the host): its next launch comes after."""
        at = (r, stream)
        self.launch[at] = max(self.launch[at], self.clock[at])

    def _collective(self, r: int) -> None:
        """Rank ``r`` reaches a collective: its work in the batch window before it, since its
        previous one, is what a peer run later makes it wait for (``collective_wait``)."""
        recent = self.recent[r]
        since = self.issued - self.batch_window
        self.window_work[r] += sum(t for at, t in recent if at >= since)

    def _wait_for(self, r: int, stream: str, until: float, why: str) -> None:
        old = self.floor.get((r, stream))
        if old is None or until > old[0]:
            self.floor[(r, stream)] = (until, why)

    # ---- values ------------------------------------------------------------------------------
    def _set(self, r: int, ref: int | None, value: Any) -> None:
        if ref is None:
            return
        self.refs[r][ref] = value
        self.memory[r].add(ref, value if not isinstance(value, Failed) else None)

    def _resolve(self, r: int, x: Any) -> Any:
        if isinstance(x, isa.Ref):
            v = self.refs[r].get(x.id)
            if v is None:
                return Failed((r, "", "", f"%{x.id} was deleted", ""))
            return v
        if x is isa.WORKER_DEVICE:
            return torch.device("meta")
        if isinstance(x, isa.MeshCoord):
            mesh = self.meshes[x.mesh]
            c = coords_of_index(mesh.ranks.index(r), mesh.sizes)
            sizes = [mesh.sizes[mesh.dims.index(d)] for d in x.dims]
            return index_of_coords([c[mesh.dims.index(d)] for d in x.dims], sizes)
        if isinstance(x, torch.Tensor):
            return _meta(x)
        if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
            return type(x)(self._resolve(r, v) for v in x)
        if isinstance(x, dict):
            return {k: self._resolve(r, v) for k, v in x.items()}
        return x

    def _fail(self, ranks: Sequence[int], outs: Sequence[int | None], failure: Failure) -> None:
        for r in ranks:
            for ref in outs:
                self._set(r, ref, Failed(failure))

    def _root_failure(self, r: int, loc: str, op: str, e: BaseException) -> Failure:
        failure: Failure = (r, loc, op, f"{type(e).__name__}: {e}", "")
        self.on_failure(failure)
        return failure

    def _calls(self, ins: Any, ranks: list[int], run: Callable[..., Any], name: str) -> None:
        """A call (an op or a remote function) on each rank: its result on meta tensors (one
        run per distinct input), its outputs stored, its time on its stream."""
        done: dict[tuple[Any, ...], tuple[list[Any], float, bool] | Failure] = {}
        received = receiving(self.prof, _carried(ins))  # (its local tensors, on each rank)
        for r in ranks:
            args, kwargs = self._resolve(r, ins.args), self._resolve(r, ins.kwargs)
            failed = isa.leaves((args, kwargs), Failed)
            if failed:
                self._fail([r], ins.outs, failed[0].failure)
                continue
            key = tuple(
                id(x) if isinstance(x, torch.Tensor) else repr(x)
                for x in pytree.tree_leaves((args, kwargs))
            )
            if key not in done:
                try:
                    result = run(args, kwargs)
                except Exception as e:  # noqa: BLE001 - the failure is the value now
                    done[key] = self._root_failure(r, ins.loc, name, e)
                else:
                    outs = [_meta(x) for x in pytree.tree_leaves(result)]
                    tensors = [x for x in outs if isinstance(x, torch.Tensor)]
                    ins_t = [
                        _type(x)
                        for x in pytree.tree_leaves((args, kwargs))
                        if isinstance(x, torch.Tensor)
                    ]
                    cost_name = step_name(ins.op) if isinstance(ins, isa.CallOp) else "remote"
                    cost = op_time(cost_name, ins_t, [_type(x) for x in tensors], self.prof)
                    cost += self.prof.eager_op_overhead
                    done[key] = (tensors, cost, family(cost_name) == "matmul")
            got = done[key]
            if isinstance(got[0], list):
                tensors, cost, matmul = got
                for ref, value in zip(ins.outs, tensors):
                    self._set(r, ref, value)
                start = self._begin(r, ins.stream)
                if self.prof.async_device:
                    # the stream's host thread launches it (its host part, after the data it
                    # was sent), then the device runs it (the op's time but the dispatch and
                    # the worker's handling) after what it launched before
                    at = (r, ins.stream)
                    begun = max(self.launch[at], self.issued)
                    launched = begun + received + self.prof.host_seconds(matmul)
                    self.launch[at] = launched
                    # (on a row of its own: the step's span starts with the first launch)
                    self.events.append(
                        SimEvent(r, f"{ins.stream}:host", name, begun, launched, "host")
                    )
                    start = max(start, launched)
                    cost = max(cost - self.prof.host_seconds(False), 0.0)
                else:
                    cost += received
                self._busy(r, ins.stream, name, start, start + cost, "compute")
            else:
                self._fail([r], ins.outs, got)

    # ---- instructions ------------------------------------------------------------------------
    def define_mesh(self, ins: isa.DefineMesh, ranks: list[int]) -> None:
        self.meshes[ins.mesh] = ins

    def define_plan(self, ins: isa.DefinePlan, ranks: list[int]) -> None:
        self.plans[ins.plan] = ins

    def call_op(self, ins: isa.CallOp, ranks: list[int]) -> None:
        op = resolve_op(ins.op)

        def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            with torch.device("meta"):
                return op(*args, **kwargs)

        self._calls(ins, ranks, run, ins.op)

    def call_function(self, ins: isa.CallFunction, ranks: list[int]) -> None:
        result: list[Any] = []

        def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            out = self.function_shapes(ins.fn, args, kwargs)
            result[:] = [out]
            return out

        self._calls(ins, ranks, run, "remote function")
        if ins.shapes_to >= 0 and ins.shapes_rank in ranks:
            value = self.refs[ins.shapes_rank].get(next((o for o in ins.outs if o), -1))
            if isinstance(value, Failed):
                self.reply_failure(ins.shapes_to, ins.shapes_rank, value.failure)
                return
            out = result[0] if result else None
            spec = pytree.treespec_dumps(pytree.tree_structure(out))
            leaves = [
                (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                for x in pytree.tree_leaves(out)
            ]
            self.reply(ins.shapes_to, ins.shapes_rank, (leaves, spec))

    def reduce(self, ins: isa.Reduce, ranks: list[int]) -> None:
        mesh = self.meshes[ins.mesh]
        dims = tuple(mesh.dims.index(d) for d in ins.dims)
        where = {coords_of_index(mesh.ranks.index(r), mesh.sizes): r for r in ranks}
        for group in groups(list(where), dims):
            members = [where[c] for c in group]
            n = len(members)
            values = [self.refs[r].get(ins.src) for r in members]
            failed = [v for v in values if isinstance(v, Failed) or v is None]
            if failed:
                f = failed[0]
                failure = f.failure if f is not None else (members[0], ins.loc, "reduce", "", "")
                self._fail(members, (ins.out,), failure)
                continue
            src = values[0]
            assert src is not None
            shape = tuple(src.shape)
            kind: type[isa.Comm]
            if ins.reduction == "stack" and not ins.scatter:
                kind, out_shape = isa.AllGather, (n, *shape)
            elif ins.reduction == "stack":
                kind, out_shape = isa.AllToAll, shape
            elif ins.scatter:
                kind, out_shape = isa.ReduceScatter, (shape[0] // n, *shape[1:])
            else:
                kind, out_shape = isa.AllReduce, shape
            step = kind(dims=dims, args=(Slot(0),), outs=(1,))
            types = [(shape, ins.dtype), (out_shape, ins.dtype)]
            cross = len({self.host[r] for r in members}) > 1
            cost = comm_time(step, types, n, self.prof, cross) + self.prof.eager_op_overhead
            start = max(self._begin(r, ins.stream) for r in members)
            for r in members:
                self._collective(r)
                self._busy(r, ins.stream, step.kind, start, start + cost, "comm")
                self.recent[r].clear()  # (the next one counts the work after this one)
                if ins.out != ins.src:
                    self._set(r, ins.out, torch.empty(out_shape, dtype=src.dtype, device="meta"))

    def transfer(self, ins: isa.Transfer, ranks: list[int]) -> None:
        sent: list[tuple[int, int, Any, float]] = []
        step = isa.Send(dims=(0,), peer=0, args=(Slot(0),))
        for a, b in ins.pairs:
            if a not in ranks:
                continue
            value = self.refs[a].get(ins.src)
            if isinstance(value, Failed) or value is None:
                sent.append((a, b, value, self.issued))
                continue
            start = self._begin(a, ins.stream)
            cost = comm_time(step, [_type(value)], 2, self.prof, self.host[a] != self.host[b])
            if a != b:
                self._busy(a, ins.stream, "send", start, start + cost, "comm")
            sent.append((a, b, value, start + cost))
        for a, b, value, arrives in sent:
            if b not in ranks:
                continue
            if isinstance(value, Failed) or value is None:
                failure = value.failure if value is not None else (a, ins.loc, "to_mesh", "", "")
                self._fail([b], (ins.out,), failure)
                continue
            start = self._begin(b, ins.stream)
            self._busy(b, ins.stream, "recv", start, max(start, arrives), "comm")
            self._set(b, ins.out, torch.empty_like(value))

    def fetch(self, ins: isa.Fetch, ranks: list[int]) -> None:
        # (the caller waits for it: the controller sends all it holds, to every worker)
        for recent in self.recent:
            recent.clear()
        for r in ranks:
            if ins.ref < 0:  # a barrier: everything before it has run
                self.reply(ins.call_id, r, None)
                continue
            value = self.refs[r].get(ins.ref)
            if value is None:
                self.reply_failure(
                    ins.call_id, r, (r, ins.loc, "fetch", f"%{ins.ref} was deleted", "")
                )
            elif isinstance(value, Failed):
                self.reply_failure(ins.call_id, r, value.failure)
            else:
                self.reply(ins.call_id, r, torch.zeros(value.shape, dtype=value.dtype))

    def delete(self, ins: isa.Delete, ranks: list[int]) -> None:
        for r in ranks:
            for ref in ins.refs:
                self.refs[r].pop(ref, None)
                self.memory[r].drop(ref)

    def borrow_begin(self, ins: isa.BorrowBegin, ranks: list[int]) -> None:
        for r in ranks:
            # The origin signals when it has run what was issued before the borrow (after a
            # wait it had to do first).
            at = max(self.clock[(r, ins.origin)], self.floor.get((r, ins.origin), (0.0, ""))[0])
            self._wait_for(r, ins.stream, at, f"wait borrow from {ins.origin}")
            self._taken_in(r, ins.stream, "borrow", self._begin(r, ins.stream))
            if ins.src in self.refs[r]:
                self._set(r, ins.dst, self.refs[r][ins.src])

    def borrow_end(self, ins: isa.BorrowEnd, ranks: list[int]) -> None:
        for r in ranks:
            at = self._taken_in(r, ins.stream, "drop", self._begin(r, ins.stream))
            self._wait_for(r, ins.origin, at, f"wait borrow by {ins.stream}")
            self.refs[r].pop(ins.dst, None)
            self.memory[r].drop(ins.dst)

    def _taken_in(self, r: int, stream: str, name: str, start: float) -> float:
        """An instruction with no work of its own (a borrow, a drop) still costs rank ``r``
        ``eager_op_overhead`` on ``stream`` (receiving, decoding it, queueing its events on
        the streams' threads: a borrow and its drop measured 30 us of a CPU worker's time,
        two instructions' overhead); when it ends."""
        over = self.prof.eager_op_overhead
        if over <= 0 or self.prof.async_device:  # (a GPU's host thread: not the stream's)
            return start
        self._busy(r, stream, name, start, start + over, "overhead")
        return start + over

    def run_plan(self, ins: isa.RunPlan, ranks: list[int]) -> None:
        defined = self.plans[ins.plan]
        program, placements = defined.program, defined.placements
        mesh = self.meshes[ins.mesh]
        where = {coords_of_index(mesh.ranks.index(r), mesh.sizes): r for r in ranks}
        sizes = program.sizes
        for c, r in where.items():
            for whole, local, i in ins.split:
                v = self.refs[r].get(whole)
                if isinstance(v, torch.Tensor):
                    t = TensorType(tuple(v.shape), "", placements[i])
                    v = local_value(v, t, c, sizes)
                self._set(r, local, v)
        sent = dict(ins.sent)  # local arguments sent with the call
        by_parts = dict(ins.parts)  # (each rank its own rows)
        failed = [
            v
            for r in where.values()
            for ref in ins.inputs
            if isinstance(v := self.refs[r].get(ref), Failed)
        ]
        if failed:
            self._fail(list(where.values()), ins.outputs, failed[0].failure)
            return
        inputs: list[SlotType] = []
        c0 = next(iter(where), None)
        parts = 0  # the bytes of a rank's parts of the local arguments (for this run only)
        for k, ref in enumerate(ins.inputs):
            if k in by_parts and c0 is not None:  # (each rank's part has the same type)
                part = by_parts[k].part(where[c0])
                parts += part.numel() * part.element_size()
                inputs.append(_type(part))
                continue
            if k in sent and c0 is not None:
                v = torch.empty_strided(
                    sent[k].shape, sent[k].stride(), dtype=sent[k].dtype, device="meta"
                )
                t = TensorType(tuple(v.shape), "", placements[k])
                part = local_value(v, t, c0, sizes)
                parts += part.numel() * part.element_size()
                inputs.append(_type(part))
                continue
            # (a pipeline stage's parameter is None on the other stages' ranks)
            held = (self.refs[r].get(ref) for r in where.values())
            value = next((v for v in held if v is not None), None)
            inputs.append(_type(value))
        inputs.extend((None, NUMBER) for _ in ins.values)  # (a replay's numbers)
        key = (ins.plan, tuple(inputs))
        # A replay's run: its steps on the ranks' own values, as the eager instructions ran
        # (its numbers are this run's, which may set a shape; its views and in-place results
        # are on their inputs' storage); ranks holding the same values share one run.
        ran: dict[tuple[int, ...], list[Any]] = {}
        if ins.plan in self.replays:
            used: set[int] = set()  # values an earlier run took (a tensor every rank holds)
            for r in where.values():
                values = [self.refs[r].get(ref) for ref in ins.inputs]
                at = tuple(map(id, values))
                if at in ran:
                    continue
                try:
                    if None in values:
                        missing = ins.inputs[values.index(None)]
                        raise RuntimeError(f"%{missing} is not on rank {r}")
                    # (another run's in-place change of a shape must not apply twice)
                    mine = [
                        torch.ops.aten.alias(v)
                        if isinstance(v, torch.Tensor) and id(v) in used
                        else v
                        for v in values
                    ]
                    used.update(at)
                    ran[at] = program_values(program, [*mine, *ins.values])
                except Exception as err:  # noqa: BLE001 - the program's op failed: its values
                    # fail on every rank (the plans' rule), the mesh goes on
                    failure = self._root_failure(r, ins.loc, "a replayed step", err)
                    self._fail(list(where.values()), ins.outputs, failure)
                    return
        types = self.plan_types.get(key)
        if types is None and ran:
            types = self.plan_types[key] = [_type(v) for v in next(iter(ran.values()))]
        elif types is None:
            types = self.plan_types[key] = program_types(program, inputs)
        # each rank takes in the local arguments first: the whole (and keeps its part), or
        # its own rows
        wholes = [v.numel() * v.element_size() for v in sent.values()]
        begin = {
            c: self._begin(r, ins.stream)
            + receiving(self.prof, wholes + [v.nbytes(r) for v in by_parts.values()])
            for c, r in where.items()
        }
        mem = {c: _Memory() for c in where}
        hosts = {c: self.host[r] for c, r in where.items()}
        placed = (key, tuple(hosts.items()))
        warm = self.plan_warm.get(placed)
        if warm is None:
            warm = self.plan_warm[placed] = warm_fractions(
                program, types, self.prof, list(where), hosts
            )
        first_event = len(self.events)
        ends = play_program(
            program,
            types,
            self.prof,
            where,
            hosts,
            begin,
            self.events,
            mem,
            lambda s: ins.stream if s == "main" else s,
            warm,
        )
        work: dict[int, float] = defaultdict(float)  # each rank's busy seconds in the run
        for e in self.events[first_event:]:
            if e.kind != "wait":
                work[e.rank] += e.end - e.start
        # (a run on several ranks ends with their failure-flag round, a collective: its
        # waits are plan_overhead's, and the next eager collective counts the work after it)
        meets = len(where) > 1
        made_by = {o: step for step in program.steps for o in step.outs}
        for c, r in where.items():
            end = ends[c]
            if self.prof.plan_overhead:  # the rank's cost of a call beyond its steps
                over = self.prof.plan_overhead
                self.events.append(SimEvent(r, ins.stream, "plan", end, end + over, "overhead"))
                end += over
                work[r] += over
            self.clock[(r, ins.stream)] = end
            if self.prof.async_device:
                self._synced(r, ins.stream)
            if meets:
                self.recent[r].clear()
            else:
                self.recent[r].append((self.issued, work[r]))
            own = self.memory[r]
            own.peak = max(own.peak, own.live + parts + mem[c].peak)
            env = ran.get(tuple(id(self.refs[r].get(ref)) for ref in ins.inputs)) if ran else None
            for slot, ref in zip(program.outputs, ins.outputs):
                step = made_by.get(slot)
                shape, dtype = types[slot]
                if ref < 0 or shape is None or (step is not None and not step.runs_on(c)):
                    continue
                if env is not None:
                    if self.refs[r].get(ref) is not env[slot]:  # (written in place: as it is)
                        self._set(r, ref, env[slot])
                    continue
                self._set(r, ref, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))


def program_types(program: isa.Program, inputs: Sequence[SlotType]) -> list[SlotType]:
    """Each slot's local shape and dtype in a run of ``program`` whose inputs have ``inputs``:
    its steps run on meta tensors (a step's first rank's, for a chunk that depends on it)."""
    values = [
        torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        if shape is not None
        else 1.0  # (a number: its value changes no type where it is not a replay's)
        if dtype == NUMBER
        else None
        for shape, dtype in inputs
    ]
    return [_type(v) for v in program_values(program, values)]


def program_values(program: isa.Program, inputs: Sequence[Any]) -> list[Any]:
    """Each slot's value in a run of ``program`` on ``inputs`` (meta tensors, numbers): its
    steps run on them (a step's first rank's, for a chunk that depends on it), so a view or
    an in-place result is on its input's meta storage."""
    env: list[Any] = [None] * program.n_slots
    for slot, value in zip(program.inputs, inputs):
        env[slot] = value
    sizes = program.sizes
    for step in program.steps:
        first = next((c for c in all_coords(sizes) if step.runs_on(c)), None)
        if first is None:
            continue
        args = [env[s.index] for s in isa.leaves(step.args, Slot)]
        if isinstance(step, isa.Compute):
            if step.name == "aten._local_scalar_dense.default":
                # .item() of a tensor (Adam's step size, traced as a tensor): a meta tensor has
                # no value, and the number it feeds (a Scalar argument) changes no type.
                dtype = args[0].dtype
                one = True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
                env[step.outs[0]] = one
                continue
            with torch.device("meta"):
                run_step(step, env, device=torch.device("meta"))
            continue
        if isinstance(step, isa.COLLECTIVES):
            n = math.prod(sizes[d] for d in step.dims)
            made = [collectives.of_step(step, args, n) for _ in range(n)]
            result = collectives.run_together(made)[0]
            outs = result if isinstance(step, isa.AllReduce) else [result]
        elif isinstance(step, isa.Recv):
            dtype = getattr(torch, step.dtype)
            outs = [torch.empty(step.shapes[0], dtype=dtype, device="meta")]
        elif isinstance(step, isa.ShardLocal):
            d = step.dims[0]
            outs = [shard_local(args[0], step.dim, first[d], sizes[d])]
        elif isinstance(step, isa.PartialLocal):
            outs = [args[0]]
        else:
            outs = []
        for slot, value in zip(step.outs, outs):
            env[slot] = value
    return env


__all__ = [
    "EagerSimulator",
    "FREE",
    "Failed",
    "Issued",
    "CONTROLLER_TERMS",
    "program_types",
    "op_time",
    "step_name",
]
