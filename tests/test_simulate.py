"""The simulator (compiler/simulate.py): a back end of the instruction set that runs a lowered
plan with costs instead of data, and device profiles (compiler/profile.py). Pure: no
processes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn as nn
from compiler_helpers import (
    MEGATRON_MLP,
    mse_batches,
    mse_step,
    simulate_training,
    two_stages,
)

import monarch_dsl as md
from monarch_dsl import isa
from monarch_dsl.compiler.compile import compile_step
from monarch_dsl.compiler.profile import BUILTIN, DeviceProfile
from monarch_dsl.compiler.simulate import (
    BLOCK_KIND,
    kept_buffers,
    runs_in_place,
    simulate_program,
    writes_out,
)
from monarch_dsl.isa import Slot
from monarch_dsl.mesh_fn import _homes

# ---- every step kind ---------------------------------------------------------------------------


def _every_kind() -> tuple[isa.Program, list]:
    """A program with a step of every kind on a 2-rank mesh, and its slots' local types."""
    c = dict(dims=(0,), shapes=((4, 4),), dtype="float32", loc="t.py:1")
    steps = [
        isa.Compute(name="aten.mm.default", args=(Slot(0), Slot(1)), outs=(2,), loc="t.py:1"),
        isa.AllReduce(args=(Slot(2), Slot(1)), outs=(3, 4), **{**c, "shapes": ((4, 4),) * 2}),
        isa.AllGather(args=(Slot(3),), outs=(5,), dim=0, **c),
        isa.ReduceScatter(args=(Slot(5),), outs=(6,), dim=0, **c),
        isa.AllToAll(args=(Slot(6),), outs=(7,), split_dim=0, cat_dim=1, **c),
        isa.ShardLocal(args=(Slot(7),), outs=(8,), dim=0, **c),
        isa.PartialLocal(args=(Slot(8),), outs=(9,), **c),
        isa.Send(args=(Slot(9),), peer=1, on=((0, 0),), **c),
        isa.Recv(outs=(10,), peer=0, on=((0, 1),), **c),
    ]
    assert {type(s) for s in steps} == set(isa.STEPS)
    f = "float32"
    types = [((4, 4), f)] * 5 + [((8, 4), f), ((4, 4), f), ((2, 8), f)] + [((1, 8), f)] * 3
    program = isa.Program("every_kind", ("x",), (2,), tuple(steps), 11, (0, 1), (4,),
                          ((4, 4),), ("float32",))  # fmt: skip
    return program, types


def test_the_simulator_runs_every_step_kind():
    program, types = _every_kind()
    report = simulate_program(program, types, "cpu-local")
    ops = {(e.rank, e.name) for e in report.events if e.kind != "wait"}
    for kind in isa.STEPS:
        name = "aten.mm.default" if kind is isa.Compute else kind.kind
        assert any(n == name for _, n in ops), kind
    assert report.step_time > 0 and set(report.peak_memory) == {0, 1}
    # the recv ends no earlier than the send it pairs with
    send = next(e for e in report.events if e.name == "send")
    recv = next(e for e in report.events if e.name == "recv")
    assert (send.rank, recv.rank) == (0, 1) and recv.end >= send.end


def test_memory_views_share_storage_and_frees_release_it():
    f = "float32"
    steps = (
        isa.Compute(name="aten.view.default", args=(Slot(0), [32768]), outs=(1,)),
        isa.Compute(name="aten.mul.Tensor", args=(Slot(1), Slot(1)), outs=(2,), frees=(1,)),
        isa.Compute(name="aten.add.Tensor", args=(Slot(2), Slot(2)), outs=(3,), frees=(2,)),
        isa.Compute(name="aten.mul.Tensor", args=(Slot(3), Slot(3)), outs=(4,), frees=(3,)),
    )
    program = isa.Program("mem", ("x",), (1,), steps, 5, (0,), (4,), ((32768,),), (f,))
    types = [((256, 128), f)] + [((32768,), f)] * 4
    report = simulate_program(program, types, "cpu-local", held=())
    # the input (128 KiB), never the view; at most two 128 KiB results alive at once (results
    # above PLANNED_BYTES: the runtime keeps no buffer for them)
    assert report.peak_memory == {0: 3 * 131072} and report.resident_memory == {0: 131072}


def _program(steps, n, inputs, outputs, types, sizes=(1,)):
    dims = tuple(f"d{i}" for i in range(len(sizes)))
    shapes = tuple(types[o][0] for o in outputs)
    dtypes = tuple(types[o][1] for o in outputs)
    return isa.Program("mem", dims, sizes, tuple(steps), n, inputs, outputs, shapes, dtypes)


def test_small_results_are_written_into_buffers_kept_between_calls():
    """As cpp/program.cpp plans memory: a result of at most PLANNED_BYTES from an op with an
    out= overload is written into the previous run's result (resident, nothing new in the
    call), unless the caller still holds that result (the previous call's output): then it is
    made anew while the old one is held."""
    f = "float32"
    steps = [
        isa.Compute(name="aten.mm.default", args=(Slot(0), Slot(0)), outs=(1,)),
        isa.Compute(name="aten.mul.Tensor", args=(Slot(1), 2.0), outs=(2,), frees=(1,)),
    ]
    types = [((16, 16), f)] * 3  # 1 KiB each
    program = _program(steps, 3, (0,), (2,), types)
    assert writes_out("aten.mm.default") and writes_out("aten.mul.Tensor")
    assert not writes_out("aten.sum.dim_IntList")  # (its out= kernel is no CPU kernel)
    # div.out / mul.out take a Tensor where div.Scalar / mul.Scalar take a Scalar
    assert not writes_out("aten.div.Scalar") and not writes_out("aten.mul.Scalar")
    alone = simulate_program(program, types, "cpu-local", held=())
    assert alone.resident_memory == {0: 3 * 1024} and alone.peak_memory == {0: 3 * 1024}
    held = simulate_program(program, types, "cpu-local")  # the caller holds the last output
    assert held.resident_memory == {0: 3 * 1024}  # x, mm's buffer, the previous output
    assert held.peak_memory == {0: 4 * 1024}  # mul's result made anew


def test_an_op_with_an_in_place_twin_runs_in_place_on_a_dying_argument():
    """relu with no out= overload runs as relu_ when its argument dies at the step and nothing
    else holds it: no new storage."""
    f = "float32"
    big = ((256, 128), f)  # 128 KiB: no kept buffers
    assert runs_in_place("aten.relu.default") and not runs_in_place("aten.mm.default")

    def peak(frees: tuple[int, ...], outputs: tuple[int, ...]) -> int:
        steps = [
            isa.Compute(name="aten.mul.Tensor", args=(Slot(0), 2.0), outs=(1,)),
            isa.Compute(name="aten.relu.default", args=(Slot(1),), outs=(2,), frees=frees),
        ]
        program = _program(steps, 3, (0,), outputs, [big] * 3)
        return simulate_program(program, [big] * 3, "cpu-local", held=()).peak_memory[0]

    assert peak((1,), (2,)) == 2 * 131072  # x and mul's result, written by relu_
    assert peak((), (1, 2)) == 3 * 131072  # mul's result lives on: relu makes its own


def test_the_memory_model_plans_the_steps_the_runtime_plans():
    """kept_buffers and runs_in_place against the C++ runtime's own counts on a second run
    (nothing of the first held): the steps that wrote the previous run's result, and those of
    them that ran in place."""
    from monarch_dsl import _core
    from monarch_dsl.compiler.lower import core_steps

    core = _core.require()
    f = "float32"
    steps = [
        isa.Compute(name="aten.mm.default", args=(Slot(0), Slot(0)), outs=(1,)),
        isa.Compute(name="aten.mul.Tensor", args=(Slot(1), 0.5), outs=(2,), frees=(1,)),
        isa.Compute(name="aten.relu.default", args=(Slot(2),), outs=(3,), frees=(2,)),
        isa.Compute(name="aten.le.Scalar", args=(Slot(3), 0.0), outs=(4,)),
        isa.Compute(name="aten.sum.dim_IntList", args=(Slot(3), [1]), outs=(5,)),
        isa.Compute(name="aten.gelu.default", args=(Slot(3),), outs=(6,), frees=(3,)),
        isa.Compute(name="aten.cat.default", args=([Slot(6), Slot(0)],), outs=(7,)),
        isa.Compute(name="aten.mm.default", args=(Slot(8), Slot(8)), outs=(9,)),  # 256 KiB
    ]
    types = [((16, 16), f)] * 4 + [((16, 16), "bool"), ((16,), f), ((16, 16), f), ((32, 16), f)]
    types += [((256, 256), f)] * 2
    program = _program(steps, 10, (0, 8), (4, 5, 7, 9), types)
    kept = kept_buffers(program, types, (0,))
    assert sorted(kept) == [0, 1, 5, 6]  # mm, mul, gelu, cat; not le, sum, the big mm
    compiled = core.CompiledPlan(core_steps(program, None, None), Slot)
    for _ in range(2):
        env = core.Env(10)
        env[0], env[8] = torch.randn(16, 16), torch.randn(256, 256)
        assert compiled.run(env, 0, len(steps)) == -1, compiled.last_error()
        del env
    # relu wrote mul's buffer in place: a reuse that is no kept buffer of its own
    assert compiled.reused() == len(kept) + 1 and compiled.in_place() == 1


def test_an_async_collective_holds_its_arguments_until_its_result_is_used():
    """A collective off main is started at its step and finished at its result's first use,
    holding its arguments until then; its result goes into the all-reduce buffer the runtime
    keeps -- unless its argument dies at it and nothing else holds it: then the argument takes
    the result (cpp/program.cpp reduces_in_place), and no buffer is kept. (On a link other
    than shared memory: there such a bucket goes into a block, below.)"""
    f = "float32"
    big, w = ((256, 128), f), ((128, 128), f)  # 128 KiB, 64 KiB
    shm = DeviceProfile.get("cpu-local")
    no_shm = dataclasses.replace(shm, intra_host="gloo")

    def report(stream: str, in_place: bool, profile: DeviceProfile = no_shm):
        c = dict(dims=(0,), shapes=((256, 128),), dtype=f)
        # (not in place: a view of mm's result is alive when the all-reduce starts)
        viewed, dies = (Slot(0), (2,)) if in_place else (Slot(2), (2, 6))
        steps = [
            isa.Compute(name="aten.mm.default", args=(Slot(0), Slot(1)), outs=(2,)),
            isa.Compute(name="aten.view.default", args=(viewed, [-1]), outs=(6,)),
            isa.AllReduce(args=(Slot(2),), outs=(3,), frees=dies, stream=stream, **c),
            isa.Compute(name="aten.mul.Tensor", args=(Slot(0), 3.0), outs=(4,)),
            isa.Compute(name="aten.sum.default", args=(Slot(3),), outs=(5,), frees=(3,)),
        ]
        types = [big, w, big, big, big, ((), f), ((256 * 128,), f)]
        program = _program(steps, 7, (0, 1), (4, 5), types, sizes=(2,))
        return simulate_program(program, types, profile, held=())

    kib = 1024
    held, waited = report("comms", False), report("main", False)
    # resident: x, w and the all-reduce's buffer
    assert held.resident_memory[0] == waited.resident_memory[0] == (128 + 64 + 128) * kib
    assert held.peak_memory[0] == (320 + 128 + 128) * kib  # mm's result lives until sum
    assert waited.peak_memory[0] == (320 + 128) * kib + 4  # mm freed as the all-reduce ends
    held, waited = report("comms", True), report("main", True)
    assert held.resident_memory[0] == waited.resident_memory[0] == (128 + 64) * kib
    # mm's result is the all-reduce's, and lives until sum; mul's beside it
    assert held.peak_memory[0] == waited.peak_memory[0] == (192 + 128 + 128) * kib + 4
    # Ranks that share memory: mm writes its result into a block of shared memory that the
    # all-reduce reduces where it lies (cpp/program.cpp set_up_block), kept between calls in
    # two halves (one holds the last call's result while the caller has it); costed by the
    # link's factor for such a block's all-reduce (BLOCK_KIND), the all-reduce's without one.
    link = shm.link(False, 2)
    halved = dataclasses.replace(link, factors=((BLOCK_KIND, ((1.0, 0.5),)),))
    fast = dataclasses.replace(shm, links={**shm.links, "shm@2": halved, "shm": halved})
    plain = dataclasses.replace(link, factors=())
    slow = dataclasses.replace(shm, links={**shm.links, "shm@2": plain, "shm": plain})
    in_block, unfactored = report("comms", True, fast), report("comms", True, slow)
    assert in_block.resident_memory[0] == unfactored.resident_memory[0] == (192 + 256) * kib
    assert in_block.peak_memory[0] == (448 + 128) * kib + 4  # (mm's result: in the block)

    def comm(r):
        return [e.end - e.start for e in r.events if e.kind == "comm" and e.rank == 0]

    assert comm(in_block) == [pytest.approx(0.5 * comm(unfactored)[0])]


def test_a_small_result_written_into_a_block_keeps_no_buffer_beside_it():
    """mm's result is small enough for a kept buffer (PLANNED_BYTES), but once mm writes it
    into its all-reduce's block the runtime lets that buffer go: resident are x, w and the
    block's two halves."""
    f, kib = "float32", 1024
    small, w = ((64, 128), f), ((128, 128), f)  # 32 KiB, 64 KiB
    c = dict(dims=(0,), shapes=((64, 128),), dtype=f)
    steps = [
        isa.Compute(name="aten.mm.default", args=(Slot(0), Slot(1)), outs=(2,)),
        isa.AllReduce(args=(Slot(2),), outs=(3,), frees=(2,), stream="comms", **c),
        isa.Compute(name="aten.sum.default", args=(Slot(3),), outs=(4,), frees=(3,)),
    ]
    types = [small, w, small, small, ((), f)]
    program = _program(steps, 5, (0, 1), (4,), types, sizes=(2,))
    shm = DeviceProfile.get("cpu-local")
    no_shm = dataclasses.replace(shm, intra_host="gloo")
    # elsewhere: the argument takes the result in place; mm keeps its buffer between calls
    elsewhere = simulate_program(program, types, no_shm, held=())
    assert elsewhere.resident_memory[0] == (32 + 64 + 32) * kib
    in_block = simulate_program(program, types, shm, held=())
    assert in_block.resident_memory[0] == (32 + 64 + 2 * 32) * kib


def test_an_all_reduce_of_a_view_or_of_another_all_reduce_s_result_keeps_its_buffer():
    """The runtime reduces in place only tensors that are their storage's whole and alone on
    it (but a compute step's own kept buffer): not a piece of a split, not the result of an
    earlier all-reduce (its buffer holds it). Each such all-reduce keeps its buffer."""
    f = "float32"
    kib = 1024
    c = dict(dims=(0,), dtype=f)
    big, half = ((256, 128), f), ((128, 128), f)  # 128 KiB, 64 KiB
    steps = [
        isa.Compute(name="aten.mul.Tensor", args=(Slot(0), 2.0), outs=(1,)),
        isa.AllReduce(args=(Slot(1),), outs=(2,), shapes=((256, 128),), **c),  # 1 lives on
        isa.AllReduce(args=(Slot(2),), outs=(3,), frees=(2,), shapes=((256, 128),), **c),
        isa.Compute(name="aten.split.Tensor", args=(Slot(1), 128), outs=(4, 5), frees=(1,)),
        isa.AllReduce(args=(Slot(5),), outs=(6,), frees=(4, 5), shapes=((128, 128),), **c),
        isa.Compute(name="aten.add.Tensor", args=(Slot(3), 1.0), outs=(7,), frees=(3,)),
        isa.Compute(name="aten.sum.default", args=(Slot(6),), outs=(8,), frees=(6,)),
    ]
    types = [big, big, big, big, half, half, half, big, ((), f)]
    program = _program(steps, 9, (0,), (7, 8), types, sizes=(2,))
    report = simulate_program(program, types, "cpu-local", held=())
    # x, and the three all-reduces' buffers (mul's result is over 64 KiB: not kept)
    assert report.resident_memory[0] == (128 + 128 + 128 + 64) * kib


def test_a_call_s_arguments_are_not_resident():
    """resident_memory is what stays between calls: not the call's own arguments."""
    model = nn.Linear(256, 256, bias=False)

    def loss(x):
        return model(x).sum()

    def mem(batch: int):
        plan, _ = compile_step(loss, (torch.randn(batch, 256),), {}, (("dp", 1),))
        return plan.simulate()

    a, b = mem(128), mem(256)
    assert a.resident_memory == b.resident_memory
    # the bigger batch: 128 more rows of x and of x @ w.T, 128 KiB each
    assert b.peak_memory[0] - a.peak_memory[0] == 2 * 128 * 256 * 4


# ---- compiled plans ----------------------------------------------------------------------------


def _mlp_plan(bucket_cap_mb: float = 1):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 256)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    plan, _ = compile_step(
        mse_step(model, opt), (x, y), {}, (("dp", 2),), data_parallel="dp",
        bucket_cap_mb=bucket_cap_mb,
    )  # fmt: skip
    return plan


def test_buckets_on_the_comms_stream_hide_communication():
    """The default schedule (gradient buckets on the comms stream) against the same plan before
    the schedule pass (every all-reduce on main, where nothing hides it)."""
    plan = _mlp_plan()
    assert any(c.stream == "comms" for c in plan.collectives)
    names = [p.name for p in plan.passes]
    unscheduled = plan.passes[names.index("schedule") - 1].plan
    assert all(c.stream == "main" for c in unscheduled.collectives)
    for profile in ("cpu-local", "h100"):
        bucketed, serial = plan.simulate(profile=profile), unscheduled.simulate(profile=profile)
        assert serial.exposed_comm_time == pytest.approx(serial.comm_time)
        assert bucketed.exposed_comm_time < serial.exposed_comm_time
        assert any(e.stream == "comms" and e.kind == "comm" for e in bucketed.events)
        assert bucketed.per_stream[(0, "comms")] > 0
        assert bucketed.step_time <= serial.step_time


def test_a_slower_link_makes_a_longer_step():
    plan = _mlp_plan()
    fast = BUILTIN["h100"]
    slow = fast.with_link("nccl_intra", latency=1e-3, bandwidth=1e9)
    a, b = plan.simulate(profile=fast), plan.simulate(profile=slow)
    assert b.step_time > a.step_time and b.comm_time > a.comm_time
    assert a.compute_time == pytest.approx(b.compute_time)
    # a faster memory makes memory-bound steps shorter: h200 has h100's compute, faster HBM
    assert plan.simulate(profile="h200").compute_time < a.compute_time


def test_fully_sharded_parameters_and_state_take_half_the_memory():
    def make(shard):
        def f():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
            if shard:
                md.fully_shard(model)
            return model, torch.optim.AdamW(model.parameters(), lr=0.01), mse_step

        return f

    batches = mse_batches(2, (8, 64))
    peaks = {}
    for shard in (False, True):
        *_, plans = simulate_training(make(shard), (("dp", 2),), batches, steps=2,
                                      data_parallel="dp")  # fmt: skip
        plan = plans[-1]  # (AdamW's state is an input from the second step on)
        assert any(i.kind == "state" for i in plan.inputs)
        peaks[shard] = plan.memory()
        assert set(peaks[shard]) == {0, 1} and peaks[shard][0] == peaks[shard][1]
    ratio = peaks[True][0] / peaks[False][0]
    # (not quite half: each rank's activations, and the buffers the runtime keeps for small
    # results, are the same either way; the unsharded gradients take their all-reduce's
    # result, so no bucket buffer is kept beside them)
    assert 0.4 < ratio < 0.7, peaks


def test_megatron_all_reduce_is_one_event_on_both_ranks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = mse_batches(1, (8, 16))[0]
    plan, _ = compile_step(mse_step(model, opt), (x, y), {}, (("tp", 2),), placements=MEGATRON_MLP)
    report = plan.simulate(mesh=md.Mesh.from_string("tp=2"), profile="h100")
    comms = [e for e in report.events if e.kind == "comm"]
    assert sorted(e.rank for e in comms) == [0, 1] and comms[0].name == "all_reduce"
    assert (comms[0].start, comms[0].end) == (comms[1].start, comms[1].end)
    assert comms[0].end > comms[0].start
    with pytest.raises(ValueError, match="compiled for mesh"):
        plan.simulate(mesh=md.Mesh.from_string("tp=4"))


def test_a_pipeline_sends_between_stages_and_keeps_each_stage_s_parameters():
    model, opt, step_of = two_stages()()
    x, y = mse_batches(1, (8, 16))[0]
    plan, _ = compile_step(step_of(model, opt), (x, y), {}, (("pp", 2),), micro_batches=2)
    report = plan.simulate(profile="h100")
    sends = [e for e in report.events if e.name == "send"]
    recvs = [e for e in report.events if e.name == "recv"]
    assert {e.rank for e in sends} == {0, 1} == {e.rank for e in recvs}  # forward and back
    # each stage holds its own parameters (and not the other's: the stages' peaks differ)
    stage = [sum(p.numel() * 4 for p in m.parameters()) for m in (model.first, model.second)]
    peak = report.peak_memory
    assert peak[0] >= stage[0] and peak[1] >= stage[1] and peak[0] != peak[1]


class _ThreeStages(nn.Module):
    """Three stages; a buffer read by the first and, with ``shared``, the last."""

    def __init__(self, shared: bool):
        super().__init__()
        self.shared = shared
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16, 16), 0.5))

    def forward(self, x):
        with md.pipeline_stage(0):
            h = torch.relu(self.a(x)) @ self.scale
        with md.pipeline_stage(1):
            h = torch.relu(self.b(h))
        with md.pipeline_stage(2):
            h = self.c(h)
            return h @ self.scale if self.shared else h


def test_an_input_two_stages_of_three_read_is_resident_on_every_rank():
    """The runtime's rule (``mesh_fn._homes``): an input the steps of one stage use lives on
    that stage's ranks; one that steps of several use, on the whole mesh (the middle stage's
    ranks too), which the simulator counts as resident there."""

    def resident(shared: bool) -> dict[int, int]:
        torch.manual_seed(0)
        model = _ThreeStages(shared)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        x, y = mse_batches(1, (8, 16))[0]
        plan, _ = compile_step(step, (x, y), {}, (("pp", 3),), micro_batches=2)
        (name,) = [i.name for i in plan.inputs if i.name.endswith("scale")]
        assert _homes(plan).get(name) == (None if shared else (("pp", 0),))
        return plan.simulate(profile="h100").resident_memory

    one, two = resident(False), resident(True)
    scale = 16 * 16 * 4
    assert two[1] - one[1] == scale  # the middle stage holds it too
    assert two[0] == one[0]  # the first stage held it already


# ---- profiles and traces -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_profile_save_load_round_trip(name, tmp_path):
    path = tmp_path / f"{name}.json"
    BUILTIN[name].save(path)
    loaded = md.DeviceProfile.load(path)
    assert loaded == BUILTIN[name]
    assert md.DeviceProfile.get(str(path)) == loaded and md.DeviceProfile.get(name) is BUILTIN[name]
    with pytest.raises(ValueError, match="unknown device profile"):
        md.DeviceProfile.get("no-such-device")


def test_h100_h200_numbers():
    h100, h200 = BUILTIN["h100"], BUILTIN["h200"]
    assert h100.peak_flops["bfloat16"] == 989e12 and h100.memory_bandwidth == 3.35e12
    assert h200.peak_flops == h100.peak_flops and h200.memory_bandwidth == 4.8e12


def test_the_trace_has_one_event_per_sim_event(tmp_path):
    report = _mlp_plan().simulate()
    assert isinstance(report, md.SimReport) and all(
        isinstance(e, md.SimEvent) for e in report.events
    )
    path = report.save_trace(tmp_path / "trace.json")
    with open(path) as f:
        trace = json.load(f)
    assert len(trace["traceEvents"]) == len(report.events)
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in trace["traceEvents"])
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}


def test_display_prints_bars_per_rank_and_stream_and_writes_trace_and_png(tmp_path):
    import io

    report = _mlp_plan().simulate()
    out = io.StringIO()
    written = report.display(tmp_path / "run", width=40, file=out)
    lines = out.getvalue().splitlines()
    rows = {ln.split("|")[0].strip(): ln.split("|")[1] for ln in lines if ln.startswith("rank ")}
    assert set(rows) == {"rank 0 main", "rank 0 comms", "rank 1 main", "rank 1 comms"}
    assert all(len(r) == 40 for r in rows.values())
    assert "#" in rows["rank 0 main"] and "=" in rows["rank 0 comms"]
    assert "#" not in rows["rank 0 comms"]  # the comms stream only communicates
    with open(written["trace"]) as f:
        assert len(json.load(f)["traceEvents"]) == len(report.events)
    pytest.importorskip("matplotlib")
    with open(written["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert str(tmp_path / "run.png") in out.getvalue()
    with pytest.raises(ValueError, match="width"):
        report.timeline(width=3)
