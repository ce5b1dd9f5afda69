"""Runs a compiled plan's ``Program`` on this worker (the ``RunPlan`` instruction).

Compute steps call aten ops; communication uses the executor's gloo groups, one per
(stream, mesh slice). Steps on the ``comms`` stream are issued asynchronously and waited for
at their result's first use, so a bucket's all-reduce overlaps the rest of the backward pass.

Failures never hang the mesh: a rank whose input failed, or whose step failed, computes
nothing more but still takes part in every communication (with zeros); a flag all-reduce over
the whole mesh after the run (an input or a step failed somewhere?) makes every rank agree,
and then all ranks mark the outputs failed. (One flag per run, not also one before it: a
failed input is rare, and the flag costs every step a round of the group.)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from monarch_dsl import _core, isa
from monarch_dsl.compiler.interpret import local_part, shard_cuts
from monarch_dsl.compiler.lower import core_steps, run_step, shard_local
from monarch_dsl.isa import Program, Slot, collectives
from monarch_dsl.mesh import index_of_coords
from monarch_dsl.runtime import exchange
from monarch_dsl.runtime.failure import PLAN_COMMUNICATION, Failure

if TYPE_CHECKING:
    from monarch_dsl.runtime.executor import ReferenceExecutor


_OTHER_FAILED = "an input or a step failed on another rank"


class PlanRunner:
    """One per worker; ``run`` executes a RunPlan on the calling stream thread."""

    def __init__(self, executor: ReferenceExecutor) -> None:
        self.ex = executor  # through its public interface: refs, failures, groups
        self.programs: dict[int, tuple[Program, list]] = {}
        self.core = _core.worker_native()  # the C++ runtime, or None: compute runs in Python
        self.compiled: dict[tuple, Any] = {}  # (plan, mesh, coords, stream) -> CompiledPlan
        self.calls: dict[tuple, _Call] = {}  # (plan, mesh id, stream) -> _Call
        # the device is the host's (where a local argument sent with a call arrives)
        self.on_cpu = torch.device(executor.device).type == "cpu"
        # Runs so far, and the CPU seconds of their steps (the C++ run, or the Python one):
        # what a run costs beyond them is the runtime's per call (``monarch-dsl calibrate``).
        self.runs = 0
        self.steps_cpu = 0.0
        # While a controller measures a step's timeline (``measured.py``): each C++ run's
        # record, (plan, stream, [(step, kind, start, end), ...], its failure or None), for the
        # measurement ``_trace_token``; None when not tracing.
        self.traces: list[tuple[int, str, list, str | None]] | None = None
        self._trace_token: str | None = None
        self._trace_events = 0
        self._traces_lock = threading.Lock()

    MAX_TRACE_EVENTS = 200_000  # recorded at most (a controller that never took them)

    def start_trace(self, token: str) -> None:
        """Record the C++ runs from now on, for ``take_trace(token)``."""
        if self.core is None:
            raise RuntimeError(
                "a measured timeline needs the C++ runtime in the workers (MD_EXECUTOR is "
                f"'python', or it is not built: {_core.unavailable_reason()})"
            )
        if torch.device(self.ex.device).type != "cpu":
            # (the steps' host times would be their launches; the device's work would all
            # land where the run synchronizes)
            raise RuntimeError(
                f"a measured timeline records host times: not on {self.ex.device} workers yet"
            )
        with self._traces_lock:
            if self.traces is not None:
                raise RuntimeError("a timeline is already being measured on this worker")
            self.traces, self._trace_token, self._trace_events = [], token, 0

    def take_trace(self, token: str) -> list[tuple[int, str, list, str | None]] | None:
        """The runs recorded since ``start_trace(token)``, and stop recording; None where
        this worker is not recording for ``token`` (its start was refused, or another
        measurement's is under way: left as it is)."""
        with self._traces_lock:
            if self._trace_token != token:
                return None
            got, self.traces, self._trace_token = self.traces, None, None
        return got

    def define(self, ins: isa.DefinePlan) -> None:
        # (each step's slots whose pending collectives are finished before it runs)
        self.programs[ins.plan] = (ins.program, isa.settles(ins.program), ins.placements)

    def _compiled(
        self, plan: int, program: Program, mesh, coords: tuple[int, ...], run_stream: str
    ) -> Any:
        """The C++ program of ``plan`` for the rank at ``coords`` of ``mesh``: its compute
        steps, and its communication with the groups it uses (made here, in step order, as the
        Python path makes them at first use; every member makes them in the same order). One
        per mesh of ranks: its groups, and its failure flag's (``set_agree``), are the mesh's."""
        key = (plan, tuple(mesh.ranks), tuple(mesh.sizes), coords, run_stream)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.core.CompiledPlan(core_steps(program, coords, self.ex.device), Slot)
            for k, step in enumerate(program.steps):
                if isinstance(step, isa.Comm) and step.runs_on(coords):
                    self._set_comm(compiled, k, step, mesh, coords, run_stream)
            compiled.set_uses([list(u) for u in self.programs[plan][1]])
            self.compiled[key] = compiled
        return compiled

    def _set_comm(self, compiled, k: int, step: isa.Comm, mesh, coords, run_stream: str) -> None:
        group, index, size, peer = None, 0, 1, -1
        if isinstance(step, (isa.ShardLocal, isa.PartialLocal)):
            d = step.dims[0]
            index, size = coords[d], mesh.sizes[d]
        elif isinstance(step, (isa.Send, isa.Recv)):
            group, peer = self._pair(step, mesh, coords, run_stream)
        else:
            group, index, size = self._group(mesh, coords, step.dims, _groups_of(run_stream, step))
        compiled.set_comm(
            k,
            step,
            group=group,
            index=index,
            size=size,
            peer=peer,
            async_=step.stream != "main",
            slot_type=Slot,
        )

    # ---- groups --------------------------------------------------------------------------
    def _pair(self, step, mesh, coords, run_stream: str) -> tuple[Any, int]:
        """The group of this rank and the peer of send/recv ``step``, and the peer's index in
        it."""
        d = step.dims[0]
        mine = mesh.ranks[index_of_coords(coords, mesh.sizes)]
        other = mesh.ranks[index_of_coords(coords[:d] + (step.peer,) + coords[d + 1 :], mesh.sizes)]
        members = sorted((mine, other))
        return self.ex.process_group(members, _groups_of(run_stream, step)), members.index(other)

    def _group(self, mesh, coords, dims, stream):
        """The group along mesh dims ``dims`` through this rank (at ``coords``)."""
        return self.ex.group_along(mesh, coords, dims, stream)

    # ---- the run -------------------------------------------------------------------------
    def _call(self, ins: isa.RunPlan, mesh) -> _Call:
        """What every run of ``ins.plan`` on ``mesh`` and ``ins.stream`` reuses (worked out at
        its first run: a compiled step's call costs this rank a few microseconds per Python
        line it runs, on cores it may share with the controller)."""
        ex = self.ex
        program, _, placements = self.programs[ins.plan]
        coords = ex.coords_in(mesh)
        compiled = (
            self._compiled(ins.plan, program, mesh, coords, ins.stream) if self.core else None
        )
        world, _, size = self._group(mesh, coords, tuple(range(len(mesh.dims))), ins.stream)
        if compiled is not None and size > 1:  # the failure flag, in the C++ run
            compiled.set_agree(world)
        call = _Call(mesh, program, coords, compiled, world, placements)
        self.calls[(ins.plan, ins.mesh, ins.stream)] = call
        return call

    def run(self, ins: isa.RunPlan) -> None:
        ex = self.ex
        mesh = ex.meshes[ins.mesh]
        call = self.calls.get((ins.plan, ins.mesh, ins.stream))
        if call is None or call.mesh is not mesh:
            try:
                call = self._call(ins, mesh)
            except Exception as e:  # noqa: BLE001 - the C++ program or a group could not be
                # made: the outputs fail with it (a fetch says why)
                program = self.programs[ins.plan][0]
                self._split(ins, ex.coords_in(mesh), program.sizes, self.programs[ins.plan][2])
                failure = ex.root_failure(ins.loc, PLAN_COMMUNICATION, e)
                ex.fail([r for r in ins.outputs if r >= 0], failure, root=True)
                return
        program, coords, sizes = call.program, call.coords, call.program.sizes
        self._split(ins, coords, sizes, call.placements)
        values = ex.values_of(ins.inputs)  # (-1: sent with the call, or None)
        if ins.values:  # (numbers, the last inputs)
            values = [*values, *ins.values]
        failure: Failure | None = None
        for k, v in enumerate(values):
            if isinstance(v, Failure):
                failure, values[k] = failure or v, None  # (nothing is computed: see run_plan)
        compiled = call.compiled
        if compiled is not None:
            env: Any = self.core.Env(program.n_slots)
            env.set_many(program.inputs, values)  # None: a pipeline stage's, on other ranks
        else:
            env = [None] * program.n_slots
            for slot, v in zip(program.inputs, values):
                env[slot] = v
        for k, whole in ins.sent:  # a local argument sent with the call: this rank's part
            if not (self.on_cpu and whole.is_cpu):  # (a cold .to() that does nothing: ~10 us)
                whole = whole.to(ex.device)
            cuts = call.cuts(k) if compiled is not None else None
            if cuts is None:
                env[program.inputs[k]] = local_part(whole, call.placements[k], coords, sizes)
            else:
                env.set_part(program.inputs[k], whole, cuts)
        for k, part in ins.parts:  # this rank's rows of a local argument: a tensor of its own
            if not (self.on_cpu and part.is_cpu):
                part = part.to(ex.device)
            env[program.inputs[k]] = part
        own = False
        try:
            self.runs += 1
            cpu0 = time.thread_time()
            if compiled is not None:  # the whole run in C++, without the GIL
                traced = self.traces is not None
                compiled.set_trace(traced)  # (the program's own flag: it may serve two calls)
                failed = compiled.run_plan(env, ex.device, failure is not None)
                self.steps_cpu += time.thread_time() - cpu0 - compiled.last_agree_cpu()
                if failed == compiled.OTHER_FAILED:
                    failure = Failure(ex.rank, ins.loc, "plan", _OTHER_FAILED, "")
                elif failed >= 0 and failure is None:
                    bad = program.steps[failed] if failed < len(program.steps) else None
                    loc = (bad.loc if bad is not None else "") or ins.loc
                    op = bad.op if bad is not None else PLAN_COMMUNICATION
                    failure, own = Failure(ex.rank, loc, op, compiled.last_error(), ""), True
                if traced:
                    why = None
                    if failure is not None:
                        why = f"{failure.op} at {failure.line}: {failure.error}"
                    self._keep_trace(ins, compiled.last_trace(), why)
            else:
                failure, own = self._run_python(
                    program, self.programs[ins.plan][1], env, mesh, coords, ins, failure
                )
                self.steps_cpu += time.thread_time() - cpu0
                failure = self._agree(call.world, failure, ins, _OTHER_FAILED)
        except Exception as e:  # noqa: BLE001 - a communication raised (a peer died): the
            # outputs fail with it, so a fetch says why instead of finding no value
            if failure is None:
                failure, own = ex.root_failure(ins.loc, PLAN_COMMUNICATION, e), True
        if failure is not None:
            ex.fail([r for r in ins.outputs if r >= 0], failure, root=own)
            return
        for slot, ref in zip(program.outputs, ins.outputs):
            if ref >= 0:  # (-1: state updated in place; its input's ref holds it)
                ex.refs[ref] = env[slot]

    def _keep_trace(self, ins: isa.RunPlan, trace: list, failure: str | None) -> None:
        with self._traces_lock:
            if self.traces is None:
                return
            self.traces.append((ins.plan, ins.stream, trace, failure))
            self._trace_events += len(trace)
            if self._trace_events > self.MAX_TRACE_EVENTS:  # nobody takes them: stop
                self.traces = self._trace_token = None

    def _split(
        self, ins: isa.RunPlan, coords: tuple[int, ...], sizes: tuple[int, ...], placements
    ) -> None:
        """This rank's parts of the whole values ``ins`` splits (by the plan's ``placements``
        of its inputs), as the refs it names."""
        refs = self.ex.refs
        for whole, local, i in ins.split:
            v = refs.get(whole)
            if isinstance(v, Failure) or v is None:
                refs[local] = v
            else:
                refs[local] = local_part(v, placements[i], coords, sizes)

    def _run_python(self, program, uses, env, mesh, coords, ins, failure=None):
        """The reference executor's run of the steps: (the first failure or None, whether
        this rank's own step failed). ``failure``: an input's (nothing is computed)."""
        ex = self.ex
        own = False
        pending: dict[int, Any] = {}
        for k, step in enumerate(program.steps):
            if not step.runs_on(coords):
                continue
            for s in uses[k]:
                if s in pending:
                    pending.pop(s)()
            try:
                if isinstance(step, isa.Comm):
                    self._comm(step, env, mesh, coords, pending, failure is not None, ins.stream)
                elif failure is None:
                    run_step(step, env, ex.device)
            except Exception as e:  # noqa: BLE001 - the user's op failed on this rank
                if failure is None:
                    failure = ex.root_failure(step.loc or ins.loc, step.op, e)
                    own = True
            for s in step.frees:
                if s in pending:
                    pending.pop(s)()
                env[s] = None
        for finish in list(pending.values()):
            finish()
        return failure, own

    def _agree(self, group, failure, ins, why):
        if exchange.any_failed(group, failure is not None, self.ex.device) and failure is None:
            return Failure(self.ex.rank, ins.loc, "plan", why, "")
        return failure

    def _comm(
        self, step: isa.Comm, env, mesh, coords, pending, failed: bool, run_stream: str
    ) -> None:
        dtype = getattr(torch, step.dtype)

        def value(i: int) -> torch.Tensor:
            v = env[step.args[i].index] if isinstance(step.args[i], Slot) else None
            if failed or not isinstance(v, torch.Tensor):
                shape = step.shapes[i] if i < len(step.shapes) else ()
                return torch.zeros(shape, dtype=dtype, device=self.ex.device)
            return v

        if isinstance(step, isa.ShardLocal):
            d = step.dims[0]
            env[step.outs[0]] = shard_local(value(0), step.dim, coords[d], mesh.sizes[d])
            return
        if isinstance(step, isa.PartialLocal):
            d = step.dims[0]
            v = value(0)
            env[step.outs[0]] = v if step.reduce != "sum" or coords[d] == 0 else torch.zeros_like(v)
            return
        if isinstance(step, (isa.Send, isa.Recv)):
            group, peer = self._pair(step, mesh, coords, run_stream)
            if isinstance(step, isa.Send):
                group.send([value(0).contiguous()], peer, 0).wait()
            else:
                buf = torch.empty(step.shapes[0], dtype=dtype, device=self.ex.device)
                group.recv([buf], peer, 0).wait()
                env[step.outs[0]] = buf
            return
        group, index, n = self._group(mesh, coords, step.dims, _groups_of(run_stream, step))
        c = collectives.of_step(step, [value(i) for i in range(len(step.args))], n)
        result = exchange.start(group, index, n, c)

        def finish() -> None:
            out = result()
            for slot, v in zip(step.outs, out if isinstance(step, isa.AllReduce) else [out]):
                env[slot] = v

        self._issue(step, finish, pending)

    @staticmethod
    def _issue(step, finish, pending) -> None:
        if step.stream == "main":
            finish()
        else:
            once = _Once(finish)  # one for all of a bucket's results
            for slot in step.outs:
                pending[slot] = once


def _groups_of(run_stream: str, step) -> str:
    """The stream whose groups ``step`` of a plan run on stream ``run_stream`` uses. The whole plan
    runs on ``run_stream``'s thread: its ``main`` steps take their place in that stream's order and
    use its groups; its other streams' steps (``comms``, started and waited for later) get
    groups of their own, never a user stream's -- a user's ``md.Stream("comms")`` runs its
    collectives on another thread at the same time, and two threads on one group mix up their
    messages."""
    return run_stream if step.stream == "main" else f"plan/{run_stream}/{step.stream}"


@dataclass
class _Call:
    """A plan's runs on one mesh and stream: this rank's coordinates, its C++ program (None:
    the Python path), the group over the whole mesh (the failure flag's) and the placements
    of the program's inputs (its ``DefinePlan``'s)."""

    mesh: Any  # the isa.DefineMesh (a new definition under the same id is a new _Call)
    program: Program
    coords: tuple[int, ...]
    compiled: Any
    world: Any
    placements: tuple[Any, ...]
    _cuts: dict[int, Any] = field(default_factory=dict)

    def cuts(self, k: int) -> list[tuple[int, int, int]] | None:
        """How ``Env.set_part`` cuts this rank's part of input ``k`` out of the whole:
        ``shard_cuts``; None where the part is zeros (``local_part`` makes them)."""
        got = self._cuts.get(k, False)
        if got is False:
            cuts, zeros = shard_cuts(self.placements[k], self.coords, self.program.sizes)
            got = self._cuts[k] = None if zeros else cuts
        return got


class _Once:
    """A finish function shared by a bucket's outputs: runs the first time any is needed."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()
