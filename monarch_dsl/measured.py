"""Measured timelines of compiled steps (``MeshFunction.timeline`` for one call,
``MeshFunction.record`` for every call in a block): what each worker's C++ runtime did in a
call, step by step, as the simulator's events (``md.SimEvent``) in an
``md.SimReport``, so that a measured call and ``plan.simulate()`` can be laid side by side and
shown the same way (``display``, a Perfetto trace, a PNG).

Calls of the step run with recording on (``CompiledPlan.set_trace``): each worker notes,
on the thread that runs the plan, when each of its steps started and ended (``CLOCK_MONOTONIC``:
one clock for the processes of a host). Kinds, as the simulator's:

- ``compute``: an op (stream ``main``);
- ``comm``: a collective on ``main``, or the start of one on another stream (its name; on a
  link that does not overlap compute, such as shared memory, the start is the whole
  collective, as the simulator models it), and the failure flag's all-reduce at the end of
  every run over several ranks (``failure flag``);
- ``wait``: ``main`` waiting for collectives started earlier (before the step that uses their
  results: ``wait <op>``; after the last step: ``wait end``).

CPU workers only, for now: on a GPU the host's times would be the steps' launches (the
device's work would all land where the run synchronizes), so workers on one refuse.

A ``timeline`` call starts from idle workers (earlier calls are waited for first, so that
only this one is recorded): each rank's start includes its taking up the call after a wait,
and ranks can start apart (a rank that starts later shows as the other's longer first
collective). Calls issued back to back in a ``record`` block, as in training, overlap that
with the call before: each is recorded as it runs in a training loop.

Time 0 of a call is its first event on the host (ranks on other hosts: their own host's
first event). What the events do not show: the call's path to the workers before the run
(the controller's message, the worker picking it up), which ``plan.simulate`` counts in its
``step_time`` only through the profile's per-call terms in ``steady_step_time``."""

from __future__ import annotations

import itertools
import os
import socket
from typing import Any

import torch.utils._pytree as pytree

from monarch_dsl.actor import Actor, endpoint
from monarch_dsl.compiler.simulate import SimEvent, SimReport, summarize
from monarch_dsl.runtime.plan_runner import PlanRunner
from monarch_dsl.simulator import SimJob
from monarch_dsl.tensor import Engine, Tensor, inspect

TIMEOUT = 120.0  # seconds for each of the recorder's own calls
# (The waits for the user's calls, before and after a record() block, have no timeout, as
# md.sync has none: however long a block's steps run, a dead worker ends them with an error.)

_KINDS = {0: "compute", 1: "comm", 2: "wait", 3: "comm"}


class _Recorder(Actor):
    """In every worker of the mesh: turns the plan runner's recording on for one measurement
    (its token) and hands back what it recorded."""

    @endpoint
    def start(self, token: str) -> None:
        _plans().start_trace(token)

    @endpoint
    def take(self, token: str) -> tuple[str, list | None]:
        return socket.gethostname(), _plans().take_trace(token)


def _plans() -> Any:
    from monarch_dsl.runtime import worker

    assert worker.current is not None, "not in a worker"
    return worker.current.executor().plans()


# One recorder per job and ranks (an actor lives as long as its processes), dropped when the
# job stops.
_recorders: dict[tuple[int, tuple[int, ...]], Any] = {}
_tokens = itertools.count()


def _recorder(engine: Any, pm: Any) -> Any:
    job = engine.job
    key = (id(job), tuple(pm.ranks))
    recorder = _recorders.get(key)
    if recorder is None:
        if not any(k[0] == id(job) for k in _recorders):
            job.before_stop.append(lambda _timeout: _forget(id(job)))
        recorder = _recorders[key] = pm.spawn("md-timeline", _Recorder)
    return recorder


def _forget(job: int) -> None:
    for key in [k for k in _recorders if k[0] == job]:
        del _recorders[key]


class Recording:
    """``step.record()``: every call of the step while the ``with`` block runs, recorded by
    every worker, as one ``md.SimReport`` per call in ``reports`` (set when the block ends),
    and ``starts``: when each call started (its first event on the first rank's host, in
    seconds of that host's ``CLOCK_MONOTONIC``), so ``starts[k + 1] - starts[k]`` is what call
    ``k`` took in the loop, its path to the workers included. Calls issued back to back in
    the block run as in training: each after the one before, not from idle workers
    (``step.timeline`` records one call from idle)."""

    def __init__(self, mf: Any, pm: Any) -> None:
        self.mf, self.pm = mf, pm
        self.reports: list[SimReport] = []
        self.starts: list[float] = []
        self._engine: Any = None

    def __enter__(self) -> Recording:
        mf, pm = self.mf, self.pm
        engine = Engine.of(pm)
        if isinstance(engine.job, SimJob):
            raise RuntimeError(
                f"{mf.__name__}: a measured timeline records calls on worker processes; on "
                f"md.Simulator, {mf.__name__}.compile(...).simulate() is the call's predicted "
                "timeline"
            )
        self._recorder = _recorder(engine, pm)
        engine.sync()  # earlier calls are done: only the block's are recorded
        self._token = f"{os.getpid()}:{next(_tokens)}"
        self._engine = engine
        try:
            self._recorder.start.call(self._token).get(TIMEOUT)
        except BaseException:  # (some ranks may have started: they stop)
            self._recorder.take.call(self._token).get(TIMEOUT)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                self._engine.sync()  # the block's calls are done
        finally:
            got = list(self._recorder.take.call(self._token).get(TIMEOUT).values())
        if exc_type is None:
            self.reports, self.starts = _reports(self.mf, self._engine, got)


def _reports(mf: Any, engine: Any, got: list) -> tuple[list[SimReport], list[float]]:
    """One report per recorded call of ``mf`` (runs of other plans are left out), from every
    rank's ``(host, runs)``, and each call's start on the first rank's host; a call that
    failed on a rank raises ``_Failed``."""
    by_id = {c.ids[id(engine)]: c for c in mf.cache.values() if id(engine) in c.ids}
    for rank, (_, runs) in enumerate(got):
        if runs is None:  # (its token was dropped: the plan runner's cap on kept events)
            raise RuntimeError(
                f"{mf.__name__}: rank {rank} stopped recording: the block ran more steps than "
                f"a worker keeps ({PlanRunner.MAX_TRACE_EVENTS} events); record fewer calls"
            )
    mine = [[r for r in runs if r[0] in by_id] for _, runs in got]
    if len({len(runs) for runs in mine}) > 1:
        counts = ", ".join(f"rank {k}: {len(runs)}" for k, runs in enumerate(mine))
        raise RuntimeError(
            f"{mf.__name__}: the ranks recorded different numbers of runs of its plans "
            f"({counts}; another call of it on this mesh at the same time?)"
        )
    for rank, runs in enumerate(mine):
        for call, run in enumerate(runs):
            if run[3] is not None:
                raise _Failed(mf.__name__, rank, call, run[3])
    reports, call_starts = [], []
    for call in range(len(mine[0]) if mine else 0):
        zero: dict[str, float] = {}  # time 0 of each host: its first event in this call
        for (host, _), runs in zip(got, mine):
            starts = [start for _, _, start, _ in runs[call][2]]
            zero[host] = min([zero.get(host, float("inf")), *starts])
        events: list[SimEvent] = []
        for rank, ((host, _), runs) in enumerate(zip(got, mine)):
            plan, _, trace, _ = runs[call]
            events += _events(rank, by_id[plan].program, trace, zero[host])
        reports.append(summarize(events, range(len(got)), profile="measured"))
        call_starts.append(zero[got[0][0]])
    return reports, call_starts


class _Failed(RuntimeError):
    def __init__(self, name: str, rank: int, call: int, why: str) -> None:
        super().__init__(
            f"{name}: its call {call + 1} in the block failed on rank {rank}, so its record is "
            f"not the step's: {why}"
        )
        self.rank, self.call, self.why = rank, call, why


def measure(mf: Any, pm: Any, args: tuple, kwargs: dict) -> SimReport:
    """Run ``mf(*args, **kwargs)`` once on ``pm`` with recording on; its events."""
    rec = Recording(mf, pm)
    try:
        with rec:
            out = mf(*args, **kwargs)
    except _Failed as e:
        for leaf in pytree.tree_leaves(out):  # the call's own error (and it is then seen)
            if isinstance(leaf, Tensor):
                inspect(leaf)
        raise RuntimeError(
            f"{mf.__name__}.timeline: the call failed on rank {e.rank}, so its record is not "
            f"the step's: {e.why}"
        ) from None
    if len(rec.reports) != 1:
        raise RuntimeError(
            f"{mf.__name__}.timeline: recorded {len(rec.reports)} runs of this step's plan, "
            "not one (another call of it on this mesh at the same time?)"
        )
    return rec.reports[0]


def _events(rank: int, program: Any, trace: list, zero: float) -> list[SimEvent]:
    steps = program.steps
    out = []
    for k, kind, start, end in trace:
        step = steps[k] if k < len(steps) else None
        what = _KINDS[kind]
        if kind == 3:
            name, stream = "failure flag", "main"
        elif kind == 2:
            name, stream = (f"wait {step.op}" if step is not None else "wait end"), "main"
        else:
            name, stream = step.op, (step.stream if kind == 1 else "main")
        out.append(SimEvent(rank, stream, name, start - zero, end - zero, what))
    return sorted(out, key=lambda e: (e.start, e.end))
