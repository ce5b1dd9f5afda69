"""Measured timelines of compiled steps (``step.timeline``, ``monarch_dsl/measured.py``): what
the workers' C++ runtime did in one call, step by step, as the simulator's events."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import local_mesh

import monarch_dsl as md
from monarch_dsl import _core, measured
from monarch_dsl.tensor import sync

sys.path.insert(0, str(Path(__file__).parent))
from compiler_helpers import mse_step  # noqa: E402

pytestmark = pytest.mark.procs
needs_cpp = pytest.mark.skipif(
    _core.worker_native() is None, reason="a measured timeline needs the C++ runtime"
)


pm = local_mesh({"dp": 2})


def done(pm, out):
    """``out`` fetched and every rank done (a fetch waits for the rank it reads only)."""
    md.inspect(out)
    sync(pm, 60)


def _training():
    """The plain training step every test here compiles (seeded model, SGD with momentum)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    return mse_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _step():
    return md.mesh_fn(_training(), data_parallel="dp")


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


@needs_cpp
def test_a_measured_call_has_every_step_of_the_plan_on_every_rank(pm):
    step, (x, y) = _step(), _batch()
    with pm.activate():
        step(x, y)
        step(x, y)  # (compiled again for the state on the workers)
        report = step.timeline(x, y)
        after = md.inspect(step(x, y)).item()
    simulated = list(step.cache.values())[-1].plan.simulate()  # the plan of the later calls
    assert report.profile == "measured" and report.peak_memory == {}
    assert {e.rank for e in report.events} == {0, 1}
    for r in (0, 1):
        mine = [e for e in report.events if e.rank == r]
        assert all(0.0 <= e.start <= e.end for e in mine)
        # every compute step and collective the simulator plays, measured once, by name
        for kind in ("compute", "comm"):
            want = Counter(e.name for e in simulated.events if e.rank == r and e.kind == kind)
            got = Counter(e.name for e in mine if e.kind == kind)
            if kind == "comm":
                assert got.pop("failure flag") == 1  # (the runtime's, not a plan step)
            assert got == want, kind
        # one thread: its events do not overlap
        main = sorted((e.start, e.end) for e in mine if e.stream == "main")
        assert all(a[1] <= b[0] for a, b in zip(main, main[1:]))
    assert report.step_time > 0 and 0 < report.compute_time <= report.step_time
    assert report.per_stream[(0, "main")] > 0
    assert {e["pid"] for e in report.trace()["traceEvents"]} == {0, 1}
    # the measured call was a real one: the next call continues from it
    assert after == pytest.approx(_losses_of_n_calls(x, y, 4)[-1], abs=1e-5)


def _losses_of_n_calls(x, y, n):
    fn = _training()
    return [fn(x, y).item() for _ in range(n)]


@needs_cpp
def test_record_gives_one_report_per_call_of_the_step_and_leaves_out_other_steps(pm):
    step, (x, y) = _step(), _batch()
    other = md.mesh_fn(lambda a: a * 2, data_parallel="dp")
    with pm.activate():
        step(x, y)
        step(x, y)  # (compiled again for the state on the workers)
        with step.record() as rec:
            losses = [step(x, y) for _ in range(3)]  # back to back, as in training
            doubled = other(x)  # another step's plan, run in the block: not in the reports
        got = [md.inspect(loss).item() for loss in losses]
        assert torch.equal(md.inspect(doubled), x * 2)
        assert _recording(pm) == [False, False]  # recording stopped with the block
        with pytest.raises(ValueError, match="inside"), step.record() as failed:
            step(x, y)
            raise ValueError("inside")  # the block's own error, as it is
        assert failed.reports == [] and _recording(pm) == [False, False]
    assert len(rec.reports) == len(rec.starts) == 3
    for k in range(2):  # a call's next starts after it ended on some rank (each runs in order)
        ends = [max(e.end for e in rec.reports[k].events if e.rank == r) for r in (0, 1)]
        assert rec.starts[k + 1] - rec.starts[k] >= min(ends) > 0
    simulated = list(step.cache.values())[-1].plan.simulate()
    want = Counter(e.name for e in simulated.events if e.rank == 0 and e.kind == "compute")
    for report in rec.reports:
        assert {e.rank for e in report.events} == {0, 1}
        assert min(e.start for e in report.events) == 0.0  # each call from its own start
        mine = Counter(e.name for e in report.events if e.rank == 0 and e.kind == "compute")
        assert mine == want  # the step's plan only: the other step's op is not in it
    # the recorded calls were real ones: the 3rd to 5th of the training
    assert got == pytest.approx(_losses_of_n_calls(x, y, 5)[2:], abs=1e-5)


@md.remote(propagate=lambda seconds: torch.zeros((), dtype=torch.int64))
def busy_for(seconds):
    """Work of the main stream that takes ``seconds`` (a long step, as far as waits go)."""
    time.sleep(seconds)
    return torch.zeros((), dtype=torch.int64)


@needs_cpp
def test_a_record_block_longer_than_the_recorders_timeout_is_waited_for(pm, monkeypatch):
    """The waits for the block's own calls are the user's work, as md.sync's: no timeout
    (a dead worker ends them), however long the steps run; only the recorder's calls have
    one."""
    step, (x, y) = _step(), _batch()
    with pm.activate():
        done(pm, step(x, y))
        done(pm, step(x, y))
        monkeypatch.setattr(measured, "TIMEOUT", 1.0)  # (its own calls take milliseconds)
        with step.record() as rec:
            busy_for(2.5)  # on every rank, before the step: the block ends 2.5 s later
            loss = step(x, y)
        assert len(rec.reports) == 1 and torch.isfinite(md.inspect(loss))


@needs_cpp
def test_record_of_more_calls_than_a_worker_keeps_says_so(pm):
    step, (x, y) = _step(), _batch()
    peek = pm.spawn("peek", _Peek)
    with pm.activate():
        done(pm, step(x, y))
        peek.slice(dp=1).cap.call(10).get()  # (a call of this step has more events)
        try:
            with pytest.raises(RuntimeError, match="rank 1 stopped recording.*fewer calls"):
                with step.record():
                    step(x, y)
                    step(x, y)
        finally:
            peek.cap.call(None).get()
        assert _recording(pm) == [False, False]
        with step.record() as rec:
            step(x, y)
    assert len(rec.reports) == 1


@needs_cpp
def test_display_of_a_measured_call_says_no_peak_memory(pm, capsys):
    step, (x, y) = _step(), _batch()
    with pm.activate():
        step(x, y)
        report = step.timeline(x, y)
    report.display(path=None)
    out = capsys.readouterr().out
    assert "profile measured" in out and "peak memory" not in out


@needs_cpp
def test_two_timelines_at_once_the_second_is_refused_and_the_first_is_unharmed(pm):
    step, (x, y) = _step(), _batch()
    with pm.activate():
        done(pm, step(x, y))  # (done before the other measurement starts)
        recorder = pm.spawn("other-timeline", measured._Recorder)
        recorder.start.call("other").get()  # another controller's measurement, under way
        try:
            with pytest.raises(md.ActorError, match="already being measured"):
                step.timeline(x, y)
            done(pm, step(x, y))
        finally:
            runs = recorder.take.call("other").get().values()
        # the other measurement has its runs: the refused timeline took nothing from it
        assert [len(r) for _, r in runs] == [1, 1]
        report = step.timeline(x, y)  # and recording works again
    assert {e.rank for e in report.events} == {0, 1}


@needs_cpp
def test_a_timeline_refused_on_one_rank_leaves_no_rank_recording(pm):
    step, (x, y) = _step(), _batch()
    with pm.activate():
        done(pm, step(x, y))
        recorder = pm.spawn("other-timeline", measured._Recorder)
        recorder.slice(dp=0).start.call("other").get()  # rank 0 only is busy
        try:
            with pytest.raises(md.ActorError, match="already being measured"):
                step.timeline(x, y)  # started on rank 1, refused on rank 0
        finally:
            recorder.slice(dp=0).take.call("other").get()
        assert _recording(pm) == [False, False]
        report = step.timeline(x, y)
    assert {e.rank for e in report.events} == {0, 1}


@needs_cpp
def test_a_timeline_of_a_call_that_fails_says_so(pm):
    @md.mesh_fn(data_parallel="dp", placements={"idx": md.Replicate()})
    def pick(x, idx):
        return torch.index_select(x, 1, idx).sum(1)

    x = torch.randn(8, 16)
    with pm.activate():
        md.inspect(pick(x, torch.tensor([1])))
        with pytest.raises(
            md.RemoteError,
            match=r"index_select.default at tests/test_measured.py:\d+ failed on worker rank 0",
        ):
            pick.timeline(x, torch.tensor([99]))  # index out of range on the workers
        assert _recording(pm) == [False, False]
        md.inspect(pick(x, torch.tensor([1])))  # the mesh still runs it


@needs_cpp
def test_recording_stops_after_a_timeline(pm):
    step, (x, y) = _step(), _batch()
    with pm.activate():
        step(x, y)
        step.timeline(x, y)
        done(pm, step(x, y))
        assert _recording(pm) == [False, False]
        # the C++ program too: the last (plain) run of the step's plans recorded nothing
        plans = sorted({pid for c in step.cache.values() for pid in c.ids.values()})
        assert pm.spawn("peek", _Peek).last_traces.call(plans).get().values() == [[0], [0]]


def _recording(pm) -> list[bool]:
    return pm.spawn("peek", _Peek).recording.call().get().values()


class _Peek(md.Actor):
    @md.endpoint
    def recording(self):
        return measured._plans().traces is not None

    @md.endpoint
    def cap(self, events):
        """Set this worker's cap on kept events (None: the class's)."""
        runner = measured._plans()
        if events is None:
            runner.__dict__.pop("MAX_TRACE_EVENTS", None)
        else:
            runner.MAX_TRACE_EVENTS = events

    @md.endpoint
    def last_traces(self, plans):
        runner = measured._plans()
        return sorted({len(c.last_trace()) for k, c in runner.compiled.items() if k[0] in plans})


@needs_cpp
@pytest.mark.parametrize("when", ["before a timeline", "inside a record block"])
def test_a_killed_rank_is_named(when):
    pm = md.this_host().spawn_procs({"dp": 2})
    try:
        step, (x, y) = _step(), _batch()
        with pm.activate():
            step(x, y)
            md.inspect(step(x, y))
        t0 = time.monotonic()
        with pytest.raises(md.MonarchError, match="rank 1"), pm.activate():
            if when == "before a timeline":
                os.kill(pm._job.pids[1], signal.SIGKILL)
                step.timeline(x, y)
            else:
                with step.record():
                    step(x, y)
                    os.kill(pm._job.pids[1], signal.SIGKILL)
                    step(x, y)
        assert time.monotonic() - t0 < measured.TIMEOUT / 2  # noticed, not waited out
    finally:
        pm.stop()


def test_on_the_python_executor_a_timeline_is_refused_and_says_why():
    pm = md.this_host().spawn_procs({"dp": 2}, env={"MD_EXECUTOR": "python"})
    try:
        step, (x, y) = _step(), _batch()
        with pm.activate():
            step(x, y)
            with pytest.raises(md.ActorError, match="needs the C.. runtime"):
                step.timeline(x, y)
            md.inspect(step(x, y))  # the mesh still runs the step
    finally:
        pm.stop()


def test_on_the_simulator_a_timeline_points_to_simulate():
    step, (x, y) = _step(), _batch()
    sim = md.Simulator(hosts=1, gpus=2)
    with sim.mesh.rename(gpu="dp").activate():
        step(x, y)
        with pytest.raises(RuntimeError, match=r"compile\(...\).simulate\(\)"):
            step.timeline(x, y)


@needs_cpp
def test_cli_simulate_measure_shows_the_measured_call_beside_the_prediction(tmp_path, capsys):
    from test_cli_plan import _file

    from monarch_dsl.__main__ import main

    path, trace = _file(tmp_path), tmp_path / "t.json"
    args = ["simulate", f"{path}:step", "--arg", "f32[8,16]", "--arg", "f32[8,16]"]
    assert main([*args, "--trace", str(trace), "--width", "30", "--measure"]) == 0
    out = capsys.readouterr().out
    predicted, measured_part = out.split("measured on 2 local CPU workers")
    for part in (predicted, measured_part):
        assert "step time" in part and "communication" in part
        bars = {ln.split("|")[0].strip() for ln in part.splitlines() if ln.startswith("rank ")}
        assert bars >= {"rank 0 main", "rank 1 main"}
    assert "peak memory" in predicted and "peak memory" not in measured_part
    events = json.loads((tmp_path / "t.measured.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1} and {e["cat"] for e in events} >= {"compute"}
