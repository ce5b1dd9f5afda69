"""``md.Simulator``: eager programs on a simulated mesh, with costs instead of data
(monarch_dsl/simulator.py over compiler/simulate_eager.py). In-process: no worker starts."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import monarch_dsl as md
from monarch_dsl.compiler.simulate import processor_sharing

sys.path.insert(0, str(Path(__file__).parent))
from compiler_helpers import TwoStages, mse_step  # noqa: E402


def _children() -> set[int]:
    """This process's child processes (Linux)."""
    out: set[int] = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            out.update(int(p) for p in f.read().split())
    return out


def _busy(sim, kind, stream=None, rank=None):
    return [
        e
        for e in sim.events
        if e.kind == kind
        and (stream is None or e.stream == stream)
        and (rank is None or e.rank == rank)
    ]


def test_bad_arguments_raise_before_anything():
    for kw in ({"hosts": 0}, {"gpus": 0}, {"gpus": 2.0}, {"hosts": True}):
        with pytest.raises(ValueError, match="hosts|gpus"):
            md.Simulator(**kw)
    with pytest.raises(ValueError, match="trace_mode"):
        md.Simulator(trace_mode="all")
    with pytest.raises(ValueError, match="profile"):
        md.Simulator(profile="no-such-gpu")
    with pytest.raises(ValueError, match="profile"):
        md.Simulator(profile=3)


def test_ops_give_shapes_and_zero_fetches_and_no_process_starts():
    before = _children()
    sim = md.Simulator(hosts=1, gpus=4)
    assert sim.mesh.dims == ("host", "gpu") and sim.mesh.size() == 4
    with sim.mesh.activate():
        a = torch.rand(8, 16)
        b = torch.ones(16, 4) * 3
        c = (a @ b).relu()
        assert c.shape == (8, 4) and c.dtype == torch.float32
        got = md.inspect(c, host=0, gpu=2)
        tree = md.inspect({"x": c.sum(), "y": b.to(torch.int64)})
    assert got.shape == (8, 4) and not got.any()
    assert tree["x"].shape == () and tree["y"].dtype == torch.int64
    assert _children() == before
    names = {e.name for e in sim.events if e.rank == 3}
    assert {"aten::mm", "aten::relu"} <= {n.split(".")[0] for n in names}
    sim.mesh.stop()  # fine, and nothing to clean up otherwise


def test_a_matmul_costs_more_than_an_add_of_the_same_output():
    sim = md.Simulator(gpus=1)
    with sim.mesh.activate():
        a, b = torch.rand(256, 256), torch.rand(256, 256)
        _ = a @ b
        _ = a + b
    took = {e.name: e.end - e.start for e in _busy(sim, "compute")}
    assert took["aten::mm.default"] > took["aten::add.Tensor"] > 0


def test_a_reduce_is_one_collective_on_every_rank():
    sim = md.Simulator(hosts=2, gpus=2)
    with sim.mesh.activate():
        x = torch.rand(1024)
        x.reduce_("gpu")
        y = x.reduce(("host", "gpu"), "stack")
        assert y.shape == (4, 1024)
    comm = _busy(sim, "comm")
    assert sorted(e.rank for e in comm if e.name == "all_reduce") == [0, 1, 2, 3]
    reduce = [e for e in comm if e.name == "all_reduce"]
    assert len({(e.start, e.end) for e in reduce}) == 1 and reduce[0].end > reduce[0].start
    gather = [e for e in comm if e.name == "all_gather"]
    assert len(gather) == 4 and gather[0].start >= reduce[0].end
    # across hosts is slower than within one (the profile's inter-host link)
    assert gather[0].end - gather[0].start > reduce[0].end - reduce[0].start


def test_mixing_a_simulated_and_another_mesh_raises():
    sim, other = md.Simulator(gpus=2), md.Simulator(gpus=2)
    with sim.mesh.activate():
        x = torch.rand(3)
    with other.mesh.activate():
        y = torch.rand(3)
        with pytest.raises(TypeError, match="mesh"):
            _ = x + y
    assert all(e.rank < 2 for e in other.events)


def test_comms_on_another_stream_overlap_compute():
    sim = md.Simulator(gpus=4)
    comms = md.Stream("comms")
    with sim.mesh.activate():
        g = torch.rand(1 << 16)
        lent, borrow = comms.borrow(g)
        with comms.activate():
            summed = lent.reduce("gpu")
        w = torch.rand(512, 512)
        for _ in range(4):
            w = w @ w  # main computes while comms reduces
        borrow.drop()
        assert md.inspect(summed).shape == (1 << 16,)
    report = sim.summary()
    assert report.comm_time > 0
    assert report.exposed_comm_time < report.comm_time
    assert [e for e in sim.events if e.kind == "wait" and e.stream == "comms"]
    assert report.per_stream[(0, "comms")] > 0 and report.per_stream[(0, "main")] > 0


def test_to_mesh_between_slices_is_a_send_and_a_recv():
    sim = md.Simulator(hosts=2, gpus=2)
    first, second = sim.mesh.slice(host=0), sim.mesh.slice(host=1)
    with first.activate():
        x = torch.rand(64, 64)
    y = x.to_mesh(second)
    with second.activate():
        z = y + 1
    assert md.inspect(z, gpu=1).shape == (64, 64)
    sends = {e.rank for e in _busy(sim, "comm") if e.name == "send"}
    recvs = [e for e in _busy(sim, "comm") if e.name == "recv"]
    assert sends == {0, 1} and {e.rank for e in recvs} == {2, 3}
    send_end = max(e.end for e in _busy(sim, "comm") if e.name == "send")
    assert all(e.end >= send_end for e in recvs)


def test_a_remote_function_takes_its_shapes_from_its_propagator():
    calls = []

    def propagate(x):
        calls.append(x.device.type)
        return torch.empty(x.shape[0], 2), torch.empty(())

    @md.remote(propagate=propagate)
    def split_stats(x):
        raise AssertionError("the simulator runs no function")

    @md.remote
    def double(x):  # no propagator: run on meta tensors
        return x * 2

    sim = md.Simulator(gpus=2)
    with sim.mesh.activate():
        a, b = split_stats(torch.rand(5, 3))
        assert a.shape == (5, 2) and b.shape == ()
        assert md.inspect(a + 1).shape == (5, 2)
        assert md.inspect(double(torch.rand(4))).shape == (4,)
    assert calls and set(calls) == {"meta"}


def test_a_remote_function_that_cannot_run_on_meta_fails_its_outputs_only():
    @md.remote
    def needs_data(x):
        return torch.ones(int(x.sum().item()))  # (data-dependent: no meta run can say)

    sim = md.Simulator(gpus=2)
    with sim.mesh.activate():
        x = torch.ones(3)
        with pytest.raises(md.RemoteError, match="propagate"):
            needs_data(x)
        assert md.inspect(x + 1).shape == (3,)


def test_peak_memory_grows_with_a_bigger_tensor_and_drops_after_del():
    sim = md.Simulator(gpus=2)
    with sim.mesh.activate():
        small = torch.zeros(1000)
        view = small[10:]  # shares small's storage
        first = sim.summary().peak_memory[1]
        big = torch.zeros(100_000)
        second = sim.summary().peak_memory[1]
        assert first >= 4000 and second >= first + 400_000
        del big, view, small
        sim.events  # noqa: B018 - (flushes the deletes)
        live = sim.job.sim.memory[1].live
        assert live < 4000
        _ = torch.zeros(1000)
    assert sim.summary().peak_memory[1] == second  # reused, not grown


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 8))  # fmt: skip


def test_grad_generator_and_an_optimizer_step():
    sim = md.Simulator(gpus=2)
    with sim.mesh.activate():
        model = md.to_mesh(_mlp(), sim.mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loss = model(torch.rand(16, 32)).pow(2).mean()
        params = list(reversed(list(model.parameters())))
        grads = list(md.grad_generator(loss, params))
        assert [g.shape for g in grads] == [p.shape for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        assert md.inspect(model[0].weight).shape == (64, 32)
    assert any("mm" in e.name for e in _busy(sim, "compute"))


def _compiled_mse_step(model, opt):
    @md.mesh_fn(data_parallel="dp")
    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def test_a_compiled_step_continues_the_timeline():
    sim = md.Simulator(gpus=2)
    mesh = sim.mesh.flatten("dp")
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _compiled_mse_step(model, opt)

    with mesh.activate():
        w = torch.rand(256, 256)
        w = w @ w  # eager, before the step
        eager_end = max(e.end for e in sim.events)
        loss = step(torch.rand(8, 32), torch.rand(8, 8))
        assert md.inspect(loss).shape == ()
    events = sim.events
    plan = [e for e in events if e.start >= eager_end and e.kind != "wait"]
    assert any("addmm" in e.name or "mm" in e.name for e in plan)
    assert {e.rank for e in plan if e.name == "all_reduce"} == {0, 1}
    assert min(e.start for e in plan) >= eager_end


def test_a_compiled_call_costs_each_rank_plan_overhead_after_its_steps():
    """A call's cost to a worker beyond its steps (steady_step_time's plan_overhead): an
    "overhead" event on each rank after its last step, which the stream's next work follows."""
    profile = _costed(plan_overhead=2e-3)
    sim = md.Simulator(gpus=2, profile=profile)
    model = _mlp()
    step = _compiled_mse_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with sim.mesh.flatten("dp").activate():
        for _ in range(3):
            loss = step(torch.rand(8, 32), torch.rand(8, 8))
        after = loss + 1  # eager, after the calls
        md.inspect(after)
    for r in range(2):
        over = _busy(sim, "overhead", rank=r)
        assert len(over) == 3 and all(e.end - e.start == pytest.approx(2e-3) for e in over)
        *steps, add = _busy(sim, "compute", rank=r)  # (the last: the eager add)
        assert over[-1].start == pytest.approx(max(e.end for e in steps))
        assert add.start >= over[-1].end


def test_a_pipelined_step_runs_on_the_simulator_with_each_stage_s_parameters_on_its_rank():
    """Each stage's parameters live on its ranks only (as on workers: nothing on the other
    stage's), which the simulator follows from call to call."""
    sim = md.Simulator(gpus=2)
    mesh = sim.mesh.flatten("pp")
    model = TwoStages()
    step = md.mesh_fn(mse_step(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                      micro_batches=2)  # fmt: skip
    x, y = torch.rand(8, 16), torch.rand(8, 16)
    with mesh.activate():
        for _ in range(3):  # (the first call's plan, then the one for the state on the mesh)
            assert md.inspect(step(x, y)).shape == ()
    sends = [e for e in sim.events if e.name in ("send", "recv")]
    assert {e.rank for e in sends} == {0, 1}


def test_a_compiled_adamw_step_under_a_per_step_schedule_runs_on_the_simulator():
    """AdamW's traced update takes .item() of its step size (``_local_scalar_dense``), which a
    meta tensor cannot give: the simulator gives the Scalar argument a stand-in. Its learning
    rate, changed at every step by a scheduler, is an input of the plan (kind hyper), made on
    the CPU whatever default device the simulator has in force: two compiles in five steps."""
    import warnings

    sim = md.Simulator(gpus=2)
    mesh = sim.mesh.flatten("dp")
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    step = _compiled_mse_step(model, opt)

    with mesh.activate(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compiled again"
        for _ in range(5):
            loss = step(torch.rand(8, 32), torch.rand(8, 8))
            sched.step()
        assert md.inspect(loss).shape == ()
    assert step.compiles == 2
    plan = list(step.cache.values())[-1].plan
    assert [i.kind for i in plan.inputs].count("hyper") >= 1
    steps = [e for e in sim.events if e.start > 0 and e.name == "aten.addcdiv_.default"]
    assert len(steps) >= 4 * 2 * 4  # each of 4 parameters' update, on 2 ranks, in 4 runs


def test_a_compiled_call_costs_the_controller_what_steady_step_time_counts():
    """With a calibrated call cost (``plan_issue`` ...), ``md.Simulator`` charges a compiled
    step's call that, not one eager op's ``controller_overhead``."""
    import dataclasses

    from monarch_dsl.compiler.profile import Link
    from monarch_dsl.compiler.simulate import call_issue

    base = md.DeviceProfile.get("cpu-local")
    profile = dataclasses.replace(
        base,
        controller_overhead=1e-6,
        plan_issue=1e-3,
        plan_issue_per_input=1e-4,
        plan_issue_per_output=2e-4,
        links={**base.links, "controller": Link(5e-5, 1e9)},
    )
    sim = md.Simulator(gpus=2, profile=profile)
    mesh = sim.mesh.flatten("dp")
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    step = md.mesh_fn(lambda x: model(x).sum(), data_parallel="dp")
    x = torch.rand(8, 16)
    with mesh.activate():
        md.inspect(step(x))  # (compiles; its parameters go to the workers)
        before = sim.job.sim.issued
        md.inspect(step(x))
        spent = sim.job.sim.issued - before
    # x, the weight and the bias in; the sum out; x (512 bytes) sent to 2 ranks, each its
    # own 4 rows
    want = call_issue(profile, 3, 1, [x.numel() * 4 / 2], ranks=2)
    assert want == pytest.approx(1e-3 + 3e-4 + 2e-4 + 5e-5 + 512 / 1e9)
    fetch = profile.controller_overhead  # (the inspect's Fetch: an op)
    assert spent == pytest.approx(want + fetch)


def test_a_training_steps_kept_gradients_cost_the_controller_no_handle_per_call():
    """A compiled training step returns its loss (a new handle every call) and keeps each
    parameter's gradient, which takes over the handle of the call before: a call is charged
    one result (``call_results``), as ``steady_step_time`` counts it, not one per output."""
    import dataclasses

    from monarch_dsl.compiler.simulate import call_issue, call_results, sent_bytes

    base = md.DeviceProfile.get("cpu-local")
    profile = dataclasses.replace(
        base, controller_overhead=1e-6, plan_issue=1e-3, plan_issue_per_output=2e-4
    )
    sim = md.Simulator(gpus=2, profile=profile)
    mesh = sim.mesh.flatten("dp")
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @md.mesh_fn(data_parallel="dp")
    def step(x, y):  # (zero_grad first: the gradients stay after the step, as in a DDP loop)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    x, y = torch.rand(8, 16), torch.rand(8, 16)
    with mesh.activate():
        md.inspect(step(x, y))  # (compiles; the gradients' handles are made)
        before = sim.job.sim.issued
        md.inspect(step(x, y))
        spent = sim.job.sim.issued - before
    plan = list(step.cache.values())[-1].plan
    assert [o.kind for o in plan.outputs].count("grad") == 2  # (the weight's and the bias's)
    assert call_results(plan) == 1
    want = call_issue(profile, len(plan.inputs), 1, sent_bytes(plan, [x, y]), ranks=2)
    assert spent == pytest.approx(want + profile.controller_overhead)  # (+ the inspect)


def test_a_local_argument_of_a_compiled_step_counts_its_part_in_the_peak():
    """A batch passed as a local tensor arrives with the call; each rank's part of it is
    memory during the run, as much as the same batch passed as mesh tensors (whose parts
    live before and after)."""

    def peak(as_mesh: bool) -> int:
        sim = md.Simulator(gpus=2)
        mesh = sim.mesh.flatten("dp")
        torch.manual_seed(0)
        model = nn.Linear(256, 256)
        step = md.mesh_fn(lambda x: model(x).sum(), data_parallel="dp")
        x = torch.rand(512, 256)  # 512 KiB: 256 KiB a rank
        with mesh.activate():
            arg = md.distribute(x, {"dp": md.Shard(0)}) if as_mesh else x
            md.inspect(step(arg))
        return sim.summary().peak_memory[0]

    assert peak(as_mesh=False) == peak(as_mesh=True)


# ---- the tutorial's lesson: hand-written DDP, three ways -------------------------------------


def _ddp_exposed(variant: str) -> tuple[float, float]:
    """One training step of a hand-written DDP on a simulated 4-GPU host: each gradient
    averaged over ``gpu`` -- (a) on main; (b) on a comms stream, the borrow dropped right after
    the reduce; (c) dropped after the next gradient, so the reduce overlaps its computation.
    Returns (exposed comm, comm) of the simulated step."""
    sim = md.Simulator(hosts=1, gpus=4, profile="h100")
    comms = md.Stream("comms")
    torch.manual_seed(0)
    # Big enough that the GPU's work, not the controller issuing it, sets the pace
    layers = [nn.Linear(4096, 4096) for _ in range(4)]
    model = nn.Sequential(*layers)
    with sim.mesh.activate():
        model = md.to_mesh(model, sim.mesh)
        loss = model(torch.rand(8192, 4096)).pow(2).mean()
        params = list(reversed(list(model.parameters())))
        pending = None
        for grad in md.grad_generator(loss, params):
            if variant == "main":
                grad.reduce_("gpu", "avg")
                continue
            if pending is not None:  # (c): the last reduce overlapped this gradient
                pending.drop()
                pending = None
            lent, borrow = comms.borrow(grad, mutable=True)
            with comms.activate():
                lent.reduce_("gpu", "avg")
            if variant == "drop_now":
                borrow.drop()
            else:
                pending = borrow
        if pending is not None:
            pending.drop()
    report = sim.summary()
    return report.exposed_comm_time, report.comm_time


def test_ddp_overlap_lesson():
    """Moving the reduce to a comms stream is not enough: dropped right away, the borrow makes
    main wait for the reduce before its next op (the next gradient's backward), exactly as a
    reduce on main does -- (b) exposes all of it, as (a). Dropped once the next gradient is
    there, each reduce overlaps that gradient's computation: (c) hides most of it."""
    a, comm_a = _ddp_exposed("main")
    b, comm_b = _ddp_exposed("drop_now")
    c, comm_c = _ddp_exposed("drop_after_next")
    assert comm_a == pytest.approx(comm_b) == pytest.approx(comm_c)
    assert a == pytest.approx(comm_a) and b == pytest.approx(a)
    assert 0 < c < b / 1.5, (a, b, c)


def _costed(**terms) -> md.DeviceProfile:
    """The placeholder CPU profile, its eager controller terms all 0 but ``terms``."""
    import dataclasses

    from monarch_dsl.compiler.profile import BUILTIN

    base = BUILTIN["cpu-local"]
    zero = dict(
        controller_overhead=0.0,
        controller_reduce=0.0,
        controller_borrow=0.0,
        controller_backward=0.0,
        controller_switch=0.0,
        controller_replayed=0.0,
        replay_issue=0.0,
        eager_op_overhead=0.0,
        host_cores=0,
    )
    return dataclasses.replace(base, **{**zero, **terms})


def _controller(profile, program) -> tuple[float, dict[str, int]]:
    """The controller's CPU seconds (its issue clock) for ``program(mesh)`` on 2 simulated
    ranks, and the terms charged."""
    sim = md.Simulator(gpus=2, profile=profile)
    with sim.mesh.activate():
        program(sim.mesh)
    sim.summary()
    return sim.job.sim.issued, dict(sim.job.sim.charged)


def _reduces(mesh):
    x = torch.ones(64)
    for _ in range(3):
        x.reduce_("gpu", "avg")


def _borrows(mesh):
    comms = md.Stream("comms")
    x = torch.ones(64)
    for _ in range(3):
        _, borrow = comms.borrow(x)
        borrow.drop()


def _backward(mesh):
    w = md.to_mesh(torch.ones(8), mesh).requires_grad_()
    h = w
    for _ in range(4):
        h = h * w
    torch.autograd.grad(h.sum(), [w])


def _generator(mesh):
    ws = [md.to_mesh(torch.ones(8), mesh).requires_grad_() for _ in range(4)]
    h = ws[0]
    for w in ws[1:]:
        h = h * w
    for g in md.grad_generator(h.sum(), list(reversed(ws))):
        g + 1


def test_the_controller_is_charged_by_instruction_kind():
    """A reduce costs controller_reduce, a borrow and its drop controller_borrow each, in
    place of controller_overhead (which they cost with 0)."""
    t, charged = _controller(_costed(controller_reduce=1e-3, controller_overhead=1e-6), _reduces)
    assert charged["reduce"] == 3
    assert t == pytest.approx(3e-3 + 1e-6 * charged["op"])
    t, charged = _controller(_costed(controller_overhead=1e-6), _reduces)
    assert t == pytest.approx(1e-6 * (3 + charged["op"]))  # no controller_reduce: an op's
    t, charged = _controller(_costed(controller_borrow=1e-3, controller_overhead=1e-6), _borrows)
    assert charged["borrow"] == 6
    assert t == pytest.approx(6e-3 + 1e-6 * charged["op"])


def test_a_borrow_and_its_drop_cost_each_worker_an_instructions_overhead():
    """A CPU worker takes in a borrow and a drop as any instruction (measured: 30 us a pair,
    two instructions' overhead): each is eager_op_overhead on the borrowing stream, an
    "overhead" event; the origin waits for the drop's end."""
    sim = md.Simulator(gpus=2, profile=_costed(eager_op_overhead=1e-3))
    with sim.mesh.activate():
        _borrows(sim.mesh)
    events = [e for e in sim.events if e.kind == "overhead" and e.rank == 0]
    assert [(e.stream, e.name) for e in events] == [("comms", "borrow"), ("comms", "drop")] * 3
    assert all(e.end - e.start == pytest.approx(1e-3) for e in events)
    assert sim.job.sim.busy()[0] == pytest.approx(6e-3 + 1e-3, rel=0.01)  # (and the ones op)
    free = md.Simulator(gpus=2, profile=_costed())
    with free.mesh.activate():
        _borrows(free.mesh)
    assert not [e for e in free.events if e.kind == "overhead"]


def _burn(seconds: float) -> None:
    """The user's own Python: ``seconds`` of this thread's CPU."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_a_measured_profile_charges_the_controller_the_programs_own_python(monkeypatch):
    """With controller_measured (a calibrated profile), each instruction also costs the issuing
    thread's CPU since the one before, measured as the program runs in the simulator: 30 ms of
    the user's Python between two ops is 30 ms more on the controller's clock. The
    simulator's own work on that thread is not: each batch simulated here also burns 50 ms."""
    from monarch_dsl.compiler.simulate_eager import EagerSimulator

    run = EagerSimulator.run
    threads = set()

    def slow_run(self, *args, **kwargs):
        threads.add(threading.get_ident())
        _burn(0.05)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(EagerSimulator, "run", slow_run)

    def program(mesh):
        x = torch.ones(8) + 1
        md.inspect(x)  # (a batch simulated: its 50 ms are the simulator's)
        _burn(0.03)
        y = x * 2
        md.inspect(y)

    def twice(profile):  # (the first time: the process's first ops, one-time work)
        sim = md.Simulator(gpus=2, profile=profile)
        with sim.mesh.activate():
            program(sim.mesh)
            clock, python = sim.job.sim.issued, sim.job.sim.python
            program(sim.mesh)
        return sim.job.sim.issued - clock, sim.job.sim.python - python

    clock, python = twice(_costed(controller_measured=True))
    assert 0.03 <= clock < 0.05 and clock == python, clock
    clock, python = twice(_costed())
    assert clock == 0.0  # (not charged without the flag)
    assert 0.03 <= python < 0.05  # (measured all the same)
    # every batch was simulated on the program's thread, none on the flusher's
    assert threads == {threading.get_ident()}


def test_a_threads_first_instruction_is_not_measured_against_a_dead_thread_of_its_id():
    """The Python measured before an instruction is its own thread's since that thread's
    last one; a thread's first has none. A new thread often gets a finished one's id
    (grad_generator starts one per call): its 100 ms of Python before its first op are not
    measured against the finished thread's last op."""
    sim = md.Simulator(gpus=2, profile=_costed(controller_measured=True))
    with sim.mesh.activate():
        x = torch.ones(8)
        md.inspect(x)
        ids = []

        def one_op(burn):
            ids.append(threading.get_ident())
            _burn(burn)
            md.inspect(x + 1)

        for burn in (0.0, 0.0, 0.1):  # (the first thread: a thread's one-time work)
            python = sim.job.sim.python
            t = threading.Thread(target=one_op, args=(burn,))
            t.start()
            t.join()
        assert sim.job.sim.python - python < 0.02, ids
        python = sim.job.sim.python
        one_op(0.0)  # (the program's thread: its measured Python since its last op is small)
        assert sim.job.sim.python - python < 0.02


def test_a_simulated_batch_goes_after_flush_delay_of_the_programs_python():
    """md.Simulator sends a batch as the controller does, its deadline (FLUSH_DELAY) read off
    the program's measured Python: ops with 3 ms of the user's Python between them go one
    per batch; the same ops issued back to back go together, when the caller waits."""
    sim = md.Simulator(gpus=2, profile=_costed())
    engine = sim._engine
    with sim.mesh.activate():
        x = torch.ones(8)
        md.inspect(x)
        sent = engine.batches_sent
        for _ in range(4):
            x = x + 1
        md.inspect(x)
        assert engine.batches_sent - sent == 1
        sent = engine.batches_sent
        for _ in range(4):
            x = x + 1
            _burn(0.003)
        assert engine.batches_sent - sent >= 3  # (the last may wait for the fetch)
        md.inspect(x)


def test_the_simulated_job_simulates_its_queue_at_a_wait_or_when_it_is_long(monkeypatch):
    """Batches wait in the simulated job's queue (simulated apart from the program's Python,
    in longer runs) until a call awaits its reply or the queue holds QUEUED_MAX
    instructions; the order is kept."""
    from monarch_dsl import simulator

    monkeypatch.setattr(simulator, "QUEUED_MAX", 40)
    sim = md.Simulator(gpus=2, profile=_costed())
    job = sim.job
    with sim.mesh.activate():
        x = torch.ones(8)
        for _ in range(100):
            x = x + 1
            sim._engine.flush()  # (a batch an op)
            assert job.queued < 40
        assert job.sim.charged["op"] >= 60  # (simulated without a wait)
        assert md.inspect(x).shape == (8,) and job.queued == 0
    assert job.sim.charged["op"] == 101 + 1  # (the fetch too)


def test_a_waiting_program_s_batch_is_sent_and_simulated_on_its_own_thread(monkeypatch):
    """A program that waits (a data loader) holds its batch -- the flusher's wall-clock
    backstop (LAZY_DELAY) never sends a simulated one: it split replayed steps when the
    simulator's own garbage collections ran long -- until it waits for a result; then its
    own thread sends and simulates it, never the flusher's beside the program's Python."""
    from monarch_dsl.compiler.simulate_eager import EagerSimulator
    from monarch_dsl.runtime import controller

    run = EagerSimulator.run
    threads = set()

    def recording(self, *args, **kwargs):
        threads.add(threading.get_ident())
        return run(self, *args, **kwargs)

    monkeypatch.setattr(EagerSimulator, "run", recording)
    sim = md.Simulator(gpus=2, profile=_costed())
    with sim.mesh.activate():
        x = torch.ones(8) + 1
        sent = sim._engine.batches_sent
        time.sleep(3 * controller.LAZY_DELAY)  # (the program waits, past the backstop)
        assert sim._engine.batches_sent == sent and sim._engine.held
        assert md.inspect(x * 2).shape == (8,)
    assert threads == {threading.get_ident()}


def test_backward_and_a_change_of_issuing_thread_cost_the_controller_more():
    """Ops autograd's backward pass issues cost controller_backward more; md.grad_generator's
    handing of each gradient between its thread and the caller's costs controller_switch at
    each change of the issuing thread."""
    base, charged = _controller(_costed(controller_overhead=1e-6), _backward)
    more, _ = _controller(_costed(controller_overhead=1e-6, controller_backward=1e-3), _backward)
    assert charged["backward"] >= 4 and charged["switch"] == 0
    assert more - base == pytest.approx(1e-3 * charged["backward"])
    base, charged = _controller(_costed(controller_overhead=1e-6), _generator)
    more, _ = _controller(_costed(controller_overhead=1e-6, controller_switch=1e-3), _generator)
    # the forward pass, then backward's thread; the gradients go to the caller's thread
    # (g + 1) and back to backward's while it has ops left to issue
    assert charged["switch"] >= 6
    assert more - base == pytest.approx(1e-3 * charged["switch"])


def _issued_in_backward(monkeypatch) -> list:
    """Fills with how each instruction issued in a backward pass was issued (``Issued``)."""
    from monarch_dsl.compiler.simulate_eager import EagerSimulator

    in_backward = []
    run = EagerSimulator.run

    def counting(self, ranks, items, issued=None):
        in_backward.extend(how for how in issued or () if how is not None and how.backward)
        return run(self, ranks, items, issued)

    monkeypatch.setattr(EagerSimulator, "run", counting)
    return in_backward


def test_controller_backward_is_charged_once_per_backward_node(monkeypatch):
    """A backward node's formula issues several instructions (``h * w``'s ``MulBackward0``
    a multiplication for each input); its graph walk and the formula's Python are the node's,
    so ``controller_backward`` is charged once a node: the sum's and the 4 multiplications'
    of ``_backward``, 5, for its at least 9 instructions issued in the backward pass."""
    in_backward = _issued_in_backward(monkeypatch)
    _, charged = _controller(_costed(controller_overhead=1e-6), _backward)
    assert len(in_backward) >= 9
    assert charged["backward"] == sum(how.node for how in in_backward) == 5


def test_a_final_callback_of_the_backward_pass_is_no_nodes_and_no_node_is_kept(monkeypatch):
    """An instruction a final callback of the pass issues (as md.DistributedDataParallel's
    finishing does) is in the pass but no node's: not charged. The engine keeps no node:
    a node that never ran keeps its saved tensors only while the graph lives, so a value
    dropped after the pass is freed in the simulated memory at once."""
    in_backward = _issued_in_backward(monkeypatch)

    def callback(mesh):
        w = md.to_mesh(torch.ones(8), mesh).requires_grad_()
        h = w * w

        def hook(g):
            torch.autograd.Variable._execution_engine.queue_callback(lambda: w.detach() + 1)
            return g

        h.register_hook(hook)
        torch.autograd.grad(h.sum(), [w])

    _, charged = _controller(_costed(controller_overhead=1e-6), callback)
    assert charged["backward"] == 2  # (SumBackward0, MulBackward0)
    assert [how.node for how in in_backward].count(False) >= 2  # (the mul's second; the add)

    n = 1 << 20  # 4 MiB a tensor
    sim = md.Simulator(gpus=1)
    memory = sim.job.sim.memory[0]
    with sim.mesh.activate():
        x = md.to_mesh(torch.ones(n), sim.mesh).requires_grad_()
        w = md.to_mesh(torch.ones(n), sim.mesh).requires_grad_()
        e = x.exp()  # (ExpBackward0 saves e; grad(loss, [w]) does not run it)
        loss = (e * w).sum()
        (gw,) = torch.autograd.grad(loss, [w])
        del e, loss
        sim.summary()
        assert memory.live == 3 * 4 * n  # x, w and w's gradient


def test_an_eager_op_costs_a_worker_its_overhead_too():
    def program(mesh):
        x = torch.ones(8)
        x + 1
        x.reduce("gpu", "sum")

    def spans(profile):
        sim = md.Simulator(gpus=2, profile=profile)
        with sim.mesh.activate():
            program(sim.mesh)
        return [e.end - e.start for e in _busy(sim, "compute") + _busy(sim, "comm")]

    plain, more = spans(_costed()), spans(_costed(eager_op_overhead=1e-3))
    assert len(plain) == len(more) >= 4
    assert all(b - a == pytest.approx(1e-3) for a, b in zip(plain, more))


def test_local_data_sent_costs_the_controller_per_rank_and_each_rank_the_bytes():
    """md.to_mesh of a local tensor: the controller pays the "controller" link's time for its
    bytes to every rank (simulate.sending), each rank the bytes at the link's bandwidth before
    the copy's own cost (simulate.receiving); a compiled call's local argument, the same on
    each rank before its program."""
    import dataclasses

    from monarch_dsl.compiler.profile import Link

    with_link = _costed(controller_overhead=1e-6)
    with_link = dataclasses.replace(
        with_link, links={**with_link.links, "controller": Link(5e-5, 1e9)}
    )
    without = dataclasses.replace(
        with_link, links={k: v for k, v in with_link.links.items() if k != "controller"}
    )
    value = torch.ones(250_000)  # 1e6 bytes, made outside the activation (a local tensor)
    x = torch.rand(8, 16)

    def run(profile):
        model = nn.Linear(16, 16)
        step = md.mesh_fn(lambda x: model(x).sum(), data_parallel="dp")
        other = nn.Linear(16, 16)
        whole = md.mesh_fn(lambda x: other(x).sum())  # (x replicated: sent whole)
        sim = md.Simulator(gpus=2, profile=profile)
        with sim.mesh.activate():
            sim.summary()  # (everything issued so far has reached the simulator)
            before = sim.job.sim.issued
            md.to_mesh(value, sim.mesh)
            sim.summary()
            issued = sim.job.sim.issued - before
            copies = [e.end - e.start for e in _busy(sim, "compute")]
            mesh = sim.mesh.flatten("dp")
            with mesh.activate():
                md.inspect(step(x))  # (compiles; the parameters go to the workers)
                start = sim.summary().step_time
                md.inspect(step(x))
                call = sim.summary().step_time - start
                for _ in range(2):
                    start = sim.summary().step_time
                    md.inspect(whole(x))  # (the first compiles)
                call_whole = sim.summary().step_time - start
        return issued, copies, call, call_whole

    issued, copies, call, call_whole = run(with_link)
    base_issued, base_copies, base_call, base_whole = run(without)
    assert issued - base_issued == pytest.approx(5e-5 + 2 * 1e6 / 1e9)
    assert len(copies) == len(base_copies) == 2  # (one _to_copy per rank)
    assert all(a - b == pytest.approx(1e6 / 1e9) for a, b in zip(copies, base_copies))
    # x (512 bytes) sent with the second call, each rank its own 4 rows (256 bytes): each
    # takes them in before its program (the controller's sending of it is off the path: the
    # ranks are still busy with the first)
    assert call - base_call == pytest.approx(256 / 1e9, rel=1e-3)
    # replicated, each rank is sent the whole
    assert call_whole - base_whole == pytest.approx(512 / 1e9, rel=1e-3)


def test_ranks_and_controller_sharing_cores_bound_the_step_time():
    """2 ranks and the controller on 2 cores: the step takes as long as they need sharing
    the cores fairly (compiler/simulate.cpu_bound); with a core each, the timeline's span."""

    def program(mesh):
        x = torch.ones(256, 256)
        for _ in range(20):
            x = x @ x

    def report(profile):
        sim = md.Simulator(gpus=2, profile=profile)
        with sim.mesh.activate():
            program(sim.mesh)
        return sim.summary(), sim.job.sim.issued

    own, _ = report(_costed(controller_overhead=1e-3, host_cores=4))
    shared, controller = report(_costed(controller_overhead=1e-3, host_cores=2))
    span = max(e.end for e in own.events) - min(e.start for e in own.events)
    assert own.step_time == pytest.approx(span)
    busy = sum(e.end - e.start for e in own.events if e.kind != "wait")
    ranks = [sum(e.end - e.start for e in own.events if e.kind != "wait" and e.rank == r)
             for r in (0, 1)]  # fmt: skip
    assert sum(ranks) == pytest.approx(busy)
    assert shared.step_time == pytest.approx(max(span, processor_sharing([controller, *ranks], 2)))
    assert shared.step_time >= (controller + busy) / 2
    assert shared.step_time > 1.2 * own.step_time


def test_a_rank_waits_in_an_eager_collective_for_its_work_in_the_batch_before_it():
    """On shared cores each rank's CPU in an eager collective grows by ``collective_wait``
    times its work issued in the batch window before it (since its previous collective):
    all of it where the controller issues fast; none where the window holds no op; and
    nothing where each process has a core."""
    from monarch_dsl.runtime.controller import FLUSH_DELAY

    def program(mesh):
        x = torch.ones(64, 64)  # (a mesh tensor: made on the ranks)
        for _ in range(3):
            for _ in range(8):
                x = x @ x
            x = x.reduce("gpu", "avg")

    def run(wait, overhead, cores=2):
        sim = md.Simulator(gpus=2, profile=_costed(
            controller_overhead=overhead, host_cores=cores, collective_wait=wait))  # fmt: skip
        with sim.mesh.activate():
            program(sim.mesh)
        report = sim.summary()
        ops = [e for e in report.events if e.kind == "compute"]
        compute = [sum(e.end - e.start for e in ops if e.rank == r) for r in (0, 1)]
        return report, sim.job.sim, compute, sim.job.sim.issued

    fast = 1e-6  # the whole program is issued within one batch window
    report, job, compute, controller = run(0.5, fast)
    assert job.batch_window == FLUSH_DELAY
    assert compute[0] > 0 and job.window_work == pytest.approx(compute)  # (not the reduces)
    busy = job.busy()
    want = processor_sharing([controller, *(b + 0.5 * w for b, w in zip(busy, compute))], 2)
    assert report.step_time == pytest.approx(max(want, run(0.0, fast)[0].step_time))
    assert report.step_time > run(0.0, fast)[0].step_time
    # an op issued every 2 batch windows: none is in the window before a collective
    _, slow, _, _ = run(0.5, 2 * FLUSH_DELAY)
    assert slow.window_work == [0.0, 0.0]
    # a core each: the bound does not apply, the wait costs nothing
    assert run(0.5, fast, cores=4)[0].step_time == run(0.0, fast, cores=4)[0].step_time


def test_the_collective_wait_counts_only_on_a_host_short_of_cores():
    """2 hosts of 2 ranks on 2 cores each: the controller's host is short of a core, the
    other is not, and its ranks' collectives cost no wait."""

    def step_time(host, wait):
        sim = md.Simulator(hosts=2, gpus=2, profile=_costed(
            controller_overhead=1e-6, host_cores=2, collective_wait=wait))  # fmt: skip
        with sim.mesh.slice(host=host).activate():
            x = torch.ones(64, 64)
            for _ in range(3):
                for _ in range(8):
                    x = x @ x
                x = x.reduce("gpu", "avg")
        return sim.summary().step_time

    assert step_time(1, 0.5) == step_time(1, 0.0)
    assert step_time(0, 0.5) > step_time(0, 0.0)


def test_on_an_async_device_a_worker_launches_ops_while_the_device_runs_earlier_ones():
    """``async_device`` (a GPU's profile): an eager op's host part (dispatch, the worker's
    handling) overlaps the device's running of the ops launched before it. Large matmuls and
    then views: the views' launches hide behind the matmuls, and each matmul's launch behind
    the one before; on a CPU profile every op's whole time is in series."""
    import dataclasses

    def step_time(profile, matmuls: int, views: int) -> float:
        sim = md.Simulator(gpus=1, profile=profile)
        with sim.mesh.activate():
            x = torch.ones(512, 512)
            for _ in range(matmuls):
                x = x @ x
            for _ in range(views):
                x = x.t()
            md.inspect(x)
        return sim.summary().step_time

    serial = _costed(eager_op_overhead=3e-6)
    overlapped = dataclasses.replace(serial, async_device=True)
    host = serial.host_seconds(matmul=True)  # (no small_op_floor: the same for every op)
    assert host > 0
    for p in (serial, overlapped):
        assert step_time(p, 4, 0) > step_time(p, 2, 0) > 40 * host  # (the device's chain)
    # views: in series on a CPU, hidden behind the matmuls on a device
    assert step_time(serial, 4, 20) - step_time(serial, 4, 0) == pytest.approx(20 * host)
    assert step_time(overlapped, 4, 20) == pytest.approx(step_time(overlapped, 4, 0))
    # two more matmuls: their kernels, and on a CPU their host parts too
    more = step_time(serial, 4, 0) - step_time(serial, 2, 0)
    assert step_time(overlapped, 4, 0) - step_time(overlapped, 2, 0) == pytest.approx(
        more - 2 * host
    )


def test_on_an_async_device_launches_count_where_nothing_hides_them():
    """What a launch cannot hide behind: the step's first op (with the data it was sent),
    whose host part opens the step; and ops after a collective, whose failure flag the
    worker's host thread reads, waiting for the device."""
    import dataclasses

    serial = _costed(eager_op_overhead=3e-6)
    overlapped = dataclasses.replace(serial, async_device=True)
    host = serial.host_seconds(matmul=True)

    def first_op(profile) -> float:
        sim = md.Simulator(gpus=1, profile=profile)
        with sim.mesh.activate():
            md.inspect(md.to_mesh(torch.ones(1 << 20), sim.mesh) + 1)
        return sim.summary().step_time

    assert first_op(overlapped) == pytest.approx(first_op(serial))

    def after_reduce(profile, views: int) -> float:
        sim = md.Simulator(gpus=2, profile=profile)
        with sim.mesh.activate():
            x = torch.ones(512, 512)
            x = (x @ x).reduce("gpu", "avg")
            for _ in range(views):
                x = x.t()
            md.inspect(x)
        return sim.summary().step_time

    for p in (serial, overlapped):
        assert after_reduce(p, 20) - after_reduce(p, 0) == pytest.approx(20 * host)


def test_a_fetch_and_a_compiled_call_end_the_window_before_a_collective():
    """The controller sends all it holds when the caller waits for a fetch, and a compiled
    call on several ranks ends with a collective of its own: the work before either is not
    what the next eager collective waits for."""
    model = nn.Linear(64, 64)
    step = md.mesh_fn(lambda x: model(x).sum(), data_parallel="gpu")

    def window(between):
        sim = md.Simulator(gpus=2, profile=_costed(controller_overhead=1e-6, host_cores=2))
        with sim.mesh.activate():
            x = torch.ones(64, 64)
            for _ in range(8):
                x = x @ x
            between(x)
            x.reduce("gpu", "avg")
            sim.summary()
        return sim.job.sim.window_work

    assert all(w > 0 for w in window(lambda x: None))
    assert window(md.inspect) == [0.0, 0.0]
    assert window(lambda x: step(torch.ones(8, 64))) == [0.0, 0.0]


def test_a_failure_of_the_simulator_itself_is_an_error_for_the_caller_not_a_dead_thread(
    monkeypatch,
):
    """An exception inside the simulator (a program it cannot simulate) used to escape from
    whichever thread flushed the batch -- often the process's flusher thread, which then died
    with a traceback, and every later delayed batch of the process with it. Now the mesh stops,
    the waiting fetch and every later one raise a SupervisionError saying why, and no thread
    dies."""
    import threading

    from monarch_dsl.compiler import simulate_eager
    from monarch_dsl.errors import SupervisionError

    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)

    def boom(self, *args, **kwargs):
        raise ValueError("boom")

    sim = md.Simulator(gpus=2)
    monkeypatch.setattr(simulate_eager.EagerSimulator, "run", boom)
    with sim.mesh.activate():
        x = torch.ones(4) + 1
        with pytest.raises(SupervisionError, match="the simulator failed .*ValueError: boom"):
            md.inspect(x)
        with pytest.raises(SupervisionError, match="ValueError: boom"):
            md.inspect(x * 2)
    assert died == []


def test_a_simulated_batch_that_cannot_be_sent_fails_its_fetch_with_the_cause(monkeypatch):
    """The engine's path for a batch it could not encode or send fails the fetches it held
    (``fail_calls``), on a simulated mesh too: not an AttributeError, not a wait forever."""
    sim = md.Simulator(gpus=2)

    def unsendable(ranks, msg):
        raise TypeError("cannot encode this")

    with sim.mesh.activate():
        x = torch.ones(4) + 1
        md.inspect(x)
        monkeypatch.setattr(sim.job, "post", unsendable)
        with pytest.raises(TypeError, match="cannot encode this"):
            md.inspect(x * 2)
        assert not sim.job.pending  # (its fetch failed, saying why)
        monkeypatch.undo()
        assert md.inspect(x * 3).shape == (4,)


def test_a_remote_function_is_costed_under_a_profile_that_measured_elementwise_ops():
    # (a calibrated profile has per-op element rates; a remote function is no aten op and
    # once crashed the simulator looking for its overload name)
    import dataclasses

    from monarch_dsl.compiler.profile import BUILTIN

    profile = dataclasses.replace(BUILTIN["cpu-local"], elementwise=(("add", 1e-9),))

    @md.remote
    def double(x):
        return x * 2

    sim = md.Simulator(gpus=2, profile=profile)
    with sim.mesh.activate():
        y = double(torch.rand(64, 64)) + 1
        assert md.inspect(y).shape == (64, 64)
    assert {e.rank for e in _busy(sim, "compute") if e.name == "remote function"} == {0, 1}


def test_a_ddp_training_loop_runs_on_the_simulator_with_its_buckets_on_the_comms_stream():
    import dataclasses

    from monarch_dsl.compiler.profile import BUILTIN

    profile = dataclasses.replace(BUILTIN["cpu-local"], elementwise=(("add", 1e-9),))
    sim = md.Simulator(gpus=2, profile=profile)
    with sim.mesh.activate():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        ddp = md.DistributedDataParallel(model, dim="gpu", bucket_cap_mb=0.002)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(2):
            loss = ddp(torch.rand(8, 32)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert md.inspect(loss).shape == ()
    buckets = _busy(sim, "comm", stream="comms")
    assert buckets and {e.rank for e in buckets} == {0, 1}
    assert {e.name for e in buckets} == {"all_reduce"}
    report = sim.summary()
    assert report.peak_memory[0] > 0
    # print(report): its totals in a line, not its events
    text = str(report)
    assert text.startswith("SimReport: step ") and "SimEvent" not in text
    assert f"{len(report.events)} events" in text and len(text) < 300


def _ddp_loop(profile, replay: bool, steps: int):
    """md.DistributedDataParallel's loop (two Linear layers, SGD) on 2 simulated ranks,
    ``steps`` steps on one batch: the simulator after it."""
    sim = md.Simulator(gpus=2, profile=profile)
    with sim.mesh.activate():
        torch.manual_seed(0)
        model = md.to_mesh(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)), sim.mesh)
        ddp = md.DistributedDataParallel(model, dim="gpu", replay=replay)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x = md.to_mesh(torch.rand(8, 32), sim.mesh)
        for _ in range(steps):
            opt.zero_grad()
            loss = ddp(x).square().mean()
            loss.backward()
            opt.step()
        assert md.inspect(loss).shape == ()
        sim.summary()
        # (read while the model lives: its deletes go with the next flush)
        sim.held = [(m.live, m.peak) for m in sim.job.sim.memory]
    return sim


def test_a_replayed_ddp_step_is_one_plan_run_costing_the_controller_its_replayed_terms():
    """md.Simulator replays md.DistributedDataParallel's repeated step as the workers do
    (tensor/replay.py): from the third step on, one plan run, which costs the controller
    replay_issue and each instruction it stands for controller_replayed (an instruction
    that is no op: the same fraction of its eager cost), and the workers the plan's steps
    without eager_op_overhead."""
    profile = _costed(
        controller_overhead=1e-3,
        controller_replayed=1e-4,
        replay_issue=5e-3,
        eager_op_overhead=1e-3,
    )
    steps = 6
    sim = _ddp_loop(profile, True, steps)
    charged = sim.job.sim.charged
    assert charged["replay"] == steps - 2  # (seen once, then made a plan and run)
    per_step = charged["replayed"] / charged["replay"]
    assert per_step > 20 and per_step == int(per_step)
    eager = charged["op"] + charged["reduce"] + charged["borrow"]
    expected = 1e-3 * eager + 1e-4 * charged["replayed"] + 5e-3 * charged["replay"]
    assert sim.job.sim.issued == pytest.approx(expected)
    assert not sim.job.runs and not sim.job.issued  # (nothing left behind per instruction)
    # replay off: every step eager, and the workers' per-op overhead on every op
    off = _ddp_loop(profile, False, steps)
    assert off.job.sim.charged["replay"] == 0 and off.job.sim.charged["replayed"] == 0
    assert max(sim.job.sim.busy()) < max(off.job.sim.busy()) - (steps - 2) * per_step * 0.5e-3


def test_a_replayed_ddp_loop_leaves_the_memory_of_the_eager_one():
    """A replay's run writes the parameters in place (their storage kept, gradients viewing
    their bucket stay views): what each rank holds after the loop is what the eager loop
    leaves, and its peak about the eager one's."""
    profile = _costed()
    on, off = _ddp_loop(profile, True, 6), _ddp_loop(profile, False, 6)
    assert on.job.sim.charged["replay"] == 4
    for (live, peak), (eager_live, eager_peak) in zip(on.held, off.held, strict=True):
        # (the peak: the eager batches' and the plan's orders of allocating and freeing)
        assert live == eager_live > 0 and peak <= 1.1 * eager_peak


def test_an_eager_ddp_loop_frees_each_step_s_values_as_the_next_step_starts():
    """md.DistributedDataParallel(replay=False) still cuts the instruction stream at each
    forward: a batch never holds several steps whose dead values are deleted only at its end
    (the simulated peak then grew with the steps issued within the flush delay)."""
    profile = _costed()
    few, many = _ddp_loop(profile, False, 6), _ddp_loop(profile, False, 30)
    for (_, peak), (_, peak_after_more) in zip(few.held, many.held, strict=True):
        # (by the sixth step the same every step; a batch the flusher's timer sent early
        # deletes sooner: a little lower)
        assert peak_after_more <= 1.1 * peak


def _replayed_steps(step, steps: int = 5, replay: bool = True):
    """``step(x)`` ``steps`` times on 2 simulated ranks, each cut as md.DistributedDataParallel
    cuts a step (replayed from the second on, with ``replay``): the last result's shape, and
    each rank's live memory after it."""
    from monarch_dsl.tensor.engine import Engine

    sim = md.Simulator(gpus=2)
    engine = Engine.of(sim.mesh)
    if replay:
        engine.start_replay()
    with sim.mesh.activate():
        x = md.to_mesh(torch.ones(256, 256), sim.mesh)
        kept = []
        for _ in range(steps):
            engine.cut(("step",) if replay else None)
            kept.append(step(x))
        engine.cut(None)
        shape = md.inspect(kept[-1]).shape
        sim.summary()
        live = [m.live for m in sim.job.sim.memory]
    if replay:
        assert sim.job.sim.charged["replay"] == steps - 1  # (all but the first sight)
    return shape, live


def test_a_replayed_step_runs_on_this_run_s_numbers():
    """A replayed run's steps run on its own numbers (a float in a step's arguments, or one
    lifted into the plan's inputs): here arange's bounds, which set its shape (as a
    factory's, not lifted: a stand-in number once gave it no elements)."""
    shape, _ = _replayed_steps(lambda x: x[0, :8] + torch.arange(0.0, 8.0))
    assert shape == (8,)


def test_a_view_a_replayed_step_keeps_is_on_its_input_s_storage():
    """What a replayed run leaves is where the eager instructions would have left it: a view
    of an input on that input's storage, not a new allocation."""
    eager = _replayed_steps(lambda x: x.view(-1)[:1000], replay=False)
    replayed = _replayed_steps(lambda x: x.view(-1)[:1000])
    assert replayed == eager and eager[1][0] == 256 * 256 * 4


def test_a_replayed_run_that_cannot_run_fails_its_values_and_the_simulated_mesh_goes_on():
    """A replayed run the simulator cannot run on a rank (here: an input it lost on rank 1;
    shapes that do not fit fail on the controller before anything is sent) fails what it
    leaves on every rank, as the plans' rule says, and the mesh takes the next
    instructions."""
    from monarch_dsl.errors import SupervisionError
    from monarch_dsl.tensor.engine import Engine

    sim = md.Simulator(gpus=2)
    engine = Engine.of(sim.mesh)
    engine.start_replay()
    with sim.mesh.activate():
        w = md.to_mesh(torch.ones(16, 4), sim.mesh)
        x = md.to_mesh(torch.ones(8, 16), sim.mesh)
        for k in range(4):
            if k == 3:
                sim.job.drain()  # (the batches sent so far are simulated: the state is theirs)
                sim.job.sim.refs[1].pop(w._md_ref)
            engine.cut(("step",))
            y = (x @ w).relu()
        engine.cut(None)
        sim.job.drain()
        assert sim.job.sim.charged["replay"] == 3
        with pytest.raises(Exception, match="is not on rank 1") as failed:
            md.inspect(y)
        assert not isinstance(failed.value, SupervisionError)
        assert md.inspect(md.to_mesh(torch.ones(2), sim.mesh) + 1).shape == (2,)


def test_an_in_place_change_of_shape_in_a_replayed_step_applies_once():
    """Ranks that hold different values run a replayed step apart; a tensor they all hold (a
    factory's, made on the mesh) gets an in-place change of its shape once, as eagerly."""
    from monarch_dsl.tensor.engine import Engine

    def shape(replay: bool) -> tuple:
        sim = md.Simulator(gpus=2)
        engine = Engine.of(sim.mesh)
        if replay:
            engine.start_replay()
        with sim.mesh.activate():
            x = md.to_mesh(torch.ones(4), sim.mesh)  # (each rank its own value)
            w = torch.zeros(4)  # (one value every rank holds)
            for _ in range(5):
                engine.cut(("step",) if replay else None)
                w.unsqueeze_(0)
                x + 1
            engine.cut(None)
            if replay:  # (the ranks ran the step apart, on the w both hold)
                assert engine.replay.replayed >= 2
            return tuple(md.inspect(w).shape)

    assert shape(True) == shape(False) == (1, 1, 1, 1, 1, 4)


def test_the_simulated_workers_take_the_default_dtype_a_batch_was_issued_under():
    """As workers do (RunBatch.default_dtype): a batch made under float64 is simulated under
    it, though the program set float32 again before the simulator ran it."""
    sim = md.Simulator(gpus=2)
    try:
        with sim.mesh.activate():
            torch.set_default_dtype(torch.float64)
            a = torch.randn(3)
            torch.set_default_dtype(torch.float32)
            b = torch.arange(4) / 2
            assert (a.dtype, b.dtype) == (torch.float64, torch.float32)
            assert (md.inspect(a).dtype, md.inspect(b).dtype) == (torch.float64, torch.float32)
            assert torch.get_default_dtype() == torch.float32
    finally:
        torch.set_default_dtype(torch.float32)
