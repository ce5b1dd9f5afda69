"""Measured timelines of compiled steps (``MeshFunction.timeline``): what each worker's C++
runtime did in one call, step by step, as the simulator's events (``md.SimEvent``) in an
``md.SimReport``, so that a measured call and ``plan.simulate()`` can be laid side by side and
shown the same way (``display``, a Perfetto trace, a PNG).

One call of the step runs with recording on (``CompiledPlan.set_trace``): each worker notes,
on the thread that runs the plan, when each of its steps started and ended (``CLOCK_MONOTONIC``:
one clock for the processes of a host). Kinds, as the simulator's:

- ``compute``: an op (stream ``main``);
- ``comm``: a collective on ``main``, or the start of one on another stream (its name; on a
  link that does not overlap compute, such as shared memory, the start is the whole
  collective, as the simulator models it), and the failure flag's all-reduce at the end of
  every run over several ranks (``failure flag``);
- ``wait``: ``main`` waiting for collectives started earlier (before the step that uses their
  results: ``wait <op>``; after the last step: ``wait end``).

Time 0 is the first event on the host (ranks on other hosts: their own host's first event).
What the events do not show: the call's path to the workers before the run (the controller's
message, the worker picking it up), which ``plan.simulate`` counts in its ``step_time`` only
through the profile's per-call terms in ``steady_step_time``."""

from __future__ import annotations

import socket
import weakref
from typing import Any

from monarch_dsl.actor import Actor, endpoint
from monarch_dsl.compiler.simulate import SimEvent, SimReport, summarize
from monarch_dsl.tensor import Engine

TIMEOUT = 120.0  # seconds for each wait (the call's run included)

_KINDS = {0: "compute", 1: "comm", 2: "wait", 3: "comm"}
# id(mesh) -> its _Recorder, while the mesh lives (by identity: equal meshes can be two)
_recorders: dict[int, Any] = {}


class _Recorder(Actor):
    """In every worker of the mesh: turns the plan runner's recording on and hands back what
    it recorded."""

    @endpoint
    def start(self) -> None:
        _plans().start_trace()

    @endpoint
    def take(self) -> tuple[str, list]:
        return socket.gethostname(), _plans().take_trace()


def _plans() -> Any:
    from monarch_dsl.runtime import worker

    assert worker.current is not None, "not in a worker"
    return worker.current.executor().plans()


def measure(mf: Any, pm: Any, args: tuple, kwargs: dict) -> SimReport:
    """Run ``mf(*args, **kwargs)`` once on ``pm`` with recording on; its events."""
    engine = Engine.of(pm)
    recorder = _recorders.get(id(pm))
    if recorder is None:  # (one per mesh: an actor lives as long as its processes)
        recorder = _recorders[id(pm)] = pm.spawn("md-timeline", _Recorder)
        weakref.finalize(pm, _recorders.pop, id(pm), None)
    engine.sync(TIMEOUT)  # earlier calls are done: only this one is recorded
    recorder.start.call().get(TIMEOUT)
    try:
        mf(*args, **kwargs)
        engine.sync(TIMEOUT)
    finally:
        got = recorder.take.call().get(TIMEOUT).values()
    by_id = {pid: c for c in mf.cache.values() for eid, pid in c.ids.items() if eid == id(engine)}
    zero: dict[str, float] = {}  # time 0 of each host: its first event
    for host, runs in got:
        for _, _, trace in runs:
            zero[host] = min([zero.get(host, float("inf")), *(start for _, _, start, _ in trace)])
    events: list[SimEvent] = []
    for rank, (host, runs) in enumerate(got):
        if len(runs) != 1 or runs[0][0] not in by_id:
            raise RuntimeError(
                f"{mf.__name__}.timeline: rank {rank} recorded {len(runs)} runs of this step's "
                "plan, not one (another call of it on this mesh at the same time?)"
            )
        plan, _, trace = runs[0]
        events += _events(rank, by_id[plan].program, trace, zero[host])
    return summarize(events, range(len(got)), profile="measured")


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
