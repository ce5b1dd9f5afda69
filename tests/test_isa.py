"""The instruction set (monarch_dsl.isa) against its back ends: every instruction kind and
every plan step kind is handled by each of them, and they compute the same values.

Back ends: the Python reference executor and plan runner, the C++ executor and program, the
in-process interpreter and the eager simulator. A new kind without a handler somewhere fails
here."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from monarch_dsl import _core, isa
from monarch_dsl.compiler.interpret import run_program
from monarch_dsl.isa import Slot
from monarch_dsl.runtime.executor import Failure, ReferenceExecutor

core = _core.require()  # setup built it; a missing build fails here, clearly

from monarch_dsl.runtime.core_executor import CoreExecutor  # noqa: E402


def test_the_kinds_are_a_closed_set():
    assert len(set(isa.INSTRUCTIONS)) == len(isa.INSTRUCTIONS)
    assert set(isa.STEPS) == {isa.Compute, *isa.Comm.__subclasses__()}
    assert len({s.kind for s in isa.STEPS}) == len(isa.STEPS)
    assert set(isa.COLLECTIVES) <= set(isa.STEPS)


def test_every_instruction_kind_has_a_handler_in_both_executors():
    """The reference executor dispatches by a table; the C++ one takes some kinds itself and
    gives it the others (DefinePlan is taken at arrival by both: the plan is defined before
    anything later in the batch can run it)."""
    py = ReferenceExecutor(0, torch.device("cpu"), reply=None, reply_failure=None, report=None)
    handled = set(py.handlers) | {isa.DefinePlan}
    assert handled == set(isa.INSTRUCTIONS), set(isa.INSTRUCTIONS) ^ handled


def test_every_instruction_kind_has_a_handler_in_the_simulator():
    """``md.Simulator``'s back end (compiler/simulate_eager.py) executes every instruction
    with costs; one it has no handler for is an error naming it."""
    from monarch_dsl.compiler.profile import DeviceProfile
    from monarch_dsl.compiler.simulate_eager import EagerSimulator

    sim = EagerSimulator(("gpu",), (1,), DeviceProfile.get(None), None, None, None, None)
    assert set(sim.handlers) == set(isa.INSTRUCTIONS), set(isa.INSTRUCTIONS) ^ set(sim.handlers)
    with pytest.raises(TypeError, match="no handler for int"):
        sim.run([0], [(-1, 3)])


# ---- one program with a step of every kind ---------------------------------------------------


def _program(with_p2p: bool) -> isa.Program:
    """On a one-rank mesh (dim x of size 1), so the executors run it in this process."""
    c = dict(dims=(0,), shapes=((4, 4),), dtype="float32", loc="t.py:1")
    steps = [
        isa.Compute(name="aten.mm.default", args=(Slot(0), Slot(1)), outs=(2,), loc="t.py:1"),
        isa.AllReduce(
            args=(Slot(2), Slot(1)), outs=(3, 4), reduce="avg", **{**c, "shapes": ((4, 4),) * 2}
        ),
        isa.AllGather(args=(Slot(3),), outs=(5,), dim=1, **c),
        isa.ReduceScatter(
            args=(Slot(5),), outs=(6,), reduce="sum", dim=1, **{**c, "shapes": ((4, 4),)}
        ),
        isa.AllToAll(args=(Slot(6),), outs=(7,), split_dim=0, cat_dim=1, **c),
        isa.ShardLocal(args=(Slot(7),), outs=(8,), dim=0, **c),
        isa.PartialLocal(args=(Slot(8),), outs=(9,), reduce="sum", **c),
    ]
    outputs = (4, 9)
    if with_p2p:  # to itself (the executors need two ranks for these: test_mesh_fn's pipeline)
        steps += [
            isa.Send(args=(Slot(9),), peer=0, **c),
            isa.Recv(outs=(10,), peer=0, **c),
        ]
        outputs = (4, 10)
    kinds = {type(s) for s in steps}
    assert kinds == set(isa.STEPS) - ({isa.Send, isa.Recv} if not with_p2p else set())
    return isa.Program("every_kind", ("x",), (1,), tuple(steps), 11, (0, 1), outputs,
                       ((4, 4), (4, 4)), ("float32", "float32"))  # fmt: skip


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)]


def _want():
    a, b = _inputs()
    return [b.clone(), a @ b]  # every collective of one rank gives back its input


@pytest.mark.parametrize("p2p", [False, True])
@pytest.mark.parametrize("compute", ["python", "cpp"])
def test_the_interpreter_runs_every_step_kind(compute, p2p):
    got = run_program(_program(p2p), {(0,): _inputs()}, core if compute == "cpp" else None)[(0,)]
    for g, w in zip(got, _want(), strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("plans", ["python", "cpp"])
@pytest.mark.parametrize("executor", ["reference", "cpp"])
def test_the_executors_run_every_step_kind(executor, plans, executors, monkeypatch):
    """The plan runner runs a plan's steps in Python (MD_EXECUTOR=python) or in the C++
    program, under either executor."""
    monkeypatch.setenv("MD_EXECUTOR", plans)
    done = threading.Event()
    callbacks = dict(
        reply=lambda call_id, value: done.set(),
        reply_failure=lambda call_id, f: done.set(),
        report=lambda f: None,
    )
    if executor == "cpp":
        ex = CoreExecutor(core, 0, torch.device("cpu"), **callbacks)
    else:
        ex = ReferenceExecutor(0, torch.device("cpu"), **callbacks)
    executors.append(ex)
    ex.store = dist.HashStore()
    a, b = _inputs()
    ex.run(
        (
            (-1, isa.DefineMesh(0, ("x",), (1,), (0,))),
            (0, isa.CallOp("aten::clone", (a,), {}, (1,), "main", "t.py:1")),
            (0, isa.CallOp("aten::clone", (b,), {}, (2,), "main", "t.py:1")),
            (0, isa.DefinePlan(7, _program(False), ((), ()))),
            (0, isa.RunPlan(7, 0, (1, 2), (3, 4), (), "main", "t.py:2")),
            (0, isa.Fetch(1, -1, "main", "t.py:3")),
        )
    )
    assert done.wait(30), "the barrier never replied"
    got = [ex.refs.get(3), ex.refs.get(4)]
    assert not any(isinstance(g, Failure) for g in got), got
    for g, w in zip(got, _want(), strict=True):
        torch.testing.assert_close(g, w)
    assert (ex.plan_runner.core is None) == (plans == "python")


def test_the_cpp_executor_reads_an_eager_op_by_field_name(executors):
    """run_batch finds CallOp's fields by name: a field added (or moved) in isa.CallOp still
    runs in C++, not silently in Python."""
    from typing import NamedTuple

    class MovedCallOp(NamedTuple):  # isa.CallOp's fields, reordered, plus one
        loc: str
        extra: int
        stream: str
        outs: tuple
        kwargs: dict
        args: tuple
        op: str

    ex = CoreExecutor(core, 0, torch.device("cpu"), reply=None, reply_failure=None, report=None)
    executors.append(ex)
    others, done = [], threading.Event()
    ins = MovedCallOp("t.py:1", 0, "main", (1,), {}, ((2, 3),), "aten::ones")
    ex.core.run_batch(((0, ins),), {0: True}, MovedCallOp, lambda m, i: others.append(i))
    ex.core.barrier(done.set)
    assert done.wait(30) and others == []
    assert torch.equal(ex.refs.get(1), torch.ones(2, 3))

    class NoLoc(NamedTuple):
        op: str
        args: tuple
        kwargs: dict
        outs: tuple
        stream: str

    executors.append(ex2 := CoreExecutor(core, 0, torch.device("cpu"), reply=None,
                                         reply_failure=None, report=None))  # fmt: skip
    with pytest.raises(TypeError, match="no field loc"):
        ex2.core.run_batch(((0, NoLoc("aten::ones", ((1,),), {}, (1,), "main")),), {0: True},
                           NoLoc, lambda m, i: None)  # fmt: skip


def test_a_communication_step_carries_its_arguments_shapes():
    """What a failed rank sends zeros of: an all-gather's argument is the shard, not the
    gathered whole (the result's shape), so the group's sizes agree after a failure."""
    import monarch_dsl as md
    from monarch_dsl.compiler.lower import lower

    model = torch.nn.Linear(16, 16)
    md.fully_shard(model)

    @md.mesh_fn(data_parallel="dp")
    def step(x):
        return model(x).sum()

    plan = step.compile(torch.ones(8, 16), mesh=md.Mesh.from_string("dp=2"))
    gathers = [s for s in lower(plan).steps if isinstance(s, isa.AllGather)]
    assert gathers and all(s.shapes[0][0] * 2 == 16 for s in gathers), gathers


@pytest.mark.parametrize("executor", ["reference", "cpp"])
def test_a_stream_outlives_a_barrier_whose_reply_fails(executor, executors, capfd):
    """A barrier's reply that raises (its connection gone) is an internal error said on
    stderr; the stream goes on with what comes after it (no thread ends with a traceback
    and leaves the next instructions unrun)."""
    replies: list[int] = []
    done = threading.Event()

    def reply(call_id, value):
        if call_id == 1:
            raise ConnectionResetError("the controller's connection is gone")
        replies.append(call_id)
        done.set()

    callbacks = dict(reply=reply, reply_failure=lambda c, f: done.set(), report=lambda f: None)
    cpu = torch.device("cpu")
    if executor == "cpp":
        ex = CoreExecutor(core, 0, cpu, **callbacks)
    else:
        ex = ReferenceExecutor(0, cpu, **callbacks)
    executors.append(ex)
    a, _ = _inputs()
    ex.run(
        (
            (-1, isa.DefineMesh(0, ("x",), (1,), (0,))),
            (0, isa.CallOp("aten::clone", (a,), {}, (1,), "main", "t.py:1")),
            (0, isa.Fetch(1, -1, "main", "t.py:2")),  # its reply raises
            (0, isa.CallOp("aten::neg", (isa.Ref(1),), {}, (2,), "main", "t.py:3")),
            (0, isa.Fetch(2, -1, "main", "t.py:4")),
        )
    )
    assert done.wait(30), "the stream stopped at the failed reply"
    assert replies == [2]
    torch.testing.assert_close(ex.refs.get(2), -ex.refs.get(1))
    assert "connection is gone" in capfd.readouterr().err


def test_a_stream_whose_thread_set_up_fails_still_runs(executors, capfd, monkeypatch):
    """The reference executor's stream thread sets its intra-op threads first; where that
    raises, it says so and runs its instructions anyway (not a dead thread and a hang)."""
    done = threading.Event()
    callbacks = dict(reply=lambda c, v: done.set(), reply_failure=lambda c, f: done.set(),
                     report=lambda f: None)  # fmt: skip
    ex = ReferenceExecutor(0, torch.device("cpu"), **callbacks)
    executors.append(ex)

    def refuse(n):
        raise RuntimeError("no threads for you")

    monkeypatch.setattr(torch, "set_num_threads", refuse)
    a, _ = _inputs()
    ex.run(
        (
            (-1, isa.DefineMesh(0, ("x",), (1,), (0,))),
            (0, isa.CallOp("aten::neg", (a,), {}, (1,), "main", "t.py:1")),
            (0, isa.Fetch(1, -1, "main", "t.py:2")),
        )
    )
    assert done.wait(30), "the stream never ran"
    torch.testing.assert_close(ex.refs.get(1), -a)
    assert "no threads for you" in capfd.readouterr().err
