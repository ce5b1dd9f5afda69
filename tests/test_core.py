"""The C++ runtime (monarch_dsl._core): built by setup, loaded here, never rebuilt; compared
with the Python reference executor on the same programs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from compiler_helpers import mse_step

import monarch_dsl as md
from monarch_dsl import _build, _core
from monarch_dsl.compiler.lower import core_steps, run_step
from monarch_dsl.isa import Compute, Program, Slot

core = _core.require()  # setup built it; a missing build fails here, clearly


def _step(op, args, outs, kwargs=None, frees=()):
    return Compute(name=op, args=args, kwargs=kwargs or {}, outs=outs, loc="x.py:1", frees=frees)


def _run_both(steps, inputs, n):
    from monarch_dsl.compiler.lower import core_steps
    from monarch_dsl.isa import Program

    program = Program("p", (), (), tuple(steps), n, tuple(range(len(inputs))), (), (), ())
    env = [None] * n
    cenv = core.Env(n)
    for i, v in enumerate(inputs):
        env[i] = v
        cenv[i] = v.clone() if v is not None else None  # (a step writes in place)
    for s in steps:
        run_step(s, env)
    compiled = core.CompiledPlan(core_steps(program, None, None), Slot)
    assert compiled.run(cenv, 0, len(steps)) == -1, compiled.last_error()
    return env, cenv


def test_program_matches_python_on_many_argument_kinds():
    x = torch.randn(4, 6)
    i = torch.tensor([[1, 2], [3, 4]])
    steps = [
        _step("aten.mm.default", (Slot(0), Slot(1)), (2,)),
        _step("aten.mul.Tensor", (Slot(2), 2.5), (3,)),  # a number for a Tensor argument
        _step("aten.mul.Tensor", (Slot(5), 2.5), (6,)),  # int tensor * float: promotes
        _step("aten.sum.dim_IntList", (Slot(3), [1], True), (7,)),
        _step("aten.split.Tensor", (Slot(3), 2, 1), (8, 9, 10)),  # a list result
        _step("aten.cat.default", ([Slot(8), Slot(10)], 1), (11,)),  # a Tensor[] argument
        _step("aten.zeros.default", ([2, 3],), (12,), {"dtype": torch.float64}),
        _step("aten.view.default", (Slot(3), [2, 12]), (13,)),
        _step("aten.add_.Tensor", (Slot(0), Slot(0)), (14,), {"alpha": 0.5}),  # in place
    ]
    env, cenv = _run_both(steps, [x.clone(), torch.randn(6, 6), None, None, None, i], 15)
    for k in range(2, 15):
        if env[k] is None:
            continue
        assert torch.equal(env[k], cenv[k]) and env[k].dtype == cenv[k].dtype, k


def test_results_of_small_ops_reuse_their_buffers_only_when_nothing_holds_them():
    """Memory planning: a step with an out= overload writes the previous run's result again
    -- only when neither that tensor nor its storage is held (a kept output, a view, a Python
    reference)."""
    steps = [
        _step("aten.mm.default", (Slot(0), Slot(1)), (2,)),
        _step("aten.mul.Tensor", (Slot(2), 0.5), (3,), frees=(2,)),
        _step("aten.tanh.default", (Slot(3),), (4,)),
        _step("aten.view.default", (Slot(4), [64]), (5,)),  # a view of tanh's result
        _step("aten.add.Tensor", (Slot(3), Slot(4)), (6,), frees=(3, 4)),
    ]
    program = Program("p", (), (), tuple(steps), 7, (0, 1), (5, 6), (), ())
    compiled = core.CompiledPlan(core_steps(program, None, None), Slot)
    kept = []
    for run in range(4):
        a, b = torch.randn(8, 8), torch.randn(8, 8)
        env, cenv = [a, b] + [None] * 5, core.Env(7)
        cenv[0], cenv[1] = a, b
        for s in steps:
            run_step(s, env)
        assert compiled.run(cenv, 0, len(steps)) == -1, compiled.last_error()
        # mm and mul write their buffers from the second run on. In run 1, tanh's storage is
        # held by run 0's view and add's result by Python (kept below): not rewritten.
        if run <= 1:
            assert compiled.reused() == (0 if run == 0 else 2)
        else:  # (run 1's results were let go; Python may keep a released wrapper's tensor)
            assert compiled.reused() >= 2
        for k in (5, 6):
            assert torch.equal(env[k], cenv[k]), (run, k)
        if run == 0:
            kept = [(cenv[k], cenv[k].clone()) for k in (5, 6)]  # held across later runs
        del env, cenv
    for held, value in kept:
        assert torch.equal(held, value)  # what the caller kept was never written again


def test_a_plans_first_run_plan_keeps_no_result_buffers():
    """A plan run once (a step's first call, compiled for the state before it exists) keeps
    none of its results for a next run that may never come; from its second run on it does."""
    steps = [
        _step("aten.mm.default", (Slot(0), Slot(1)), (2,)),
        _step("aten.mul.Tensor", (Slot(2), 0.5), (3,), frees=(2,)),
    ]
    program = Program("p", (), (), tuple(steps), 4, (0, 1), (3,), (), ())
    compiled = core.CompiledPlan(core_steps(program, None, None), Slot)
    for run, reused in enumerate([0, 0, 2]):
        a, b = torch.randn(8, 8), torch.randn(8, 8)
        env = core.Env(4)
        env[0], env[1] = a, b
        assert compiled.run_plan(env, torch.device("cpu"), False) == -1, compiled.last_error()
        assert compiled.reused() == reused, run
        if run == 2:  # (read once: a Python wrapper of a result may keep it held)
            torch.testing.assert_close(env[3], (a @ b) * 0.5)
        del env


def test_an_op_whose_out_overload_takes_other_types_is_not_written_with_it():
    """div.Scalar's formals have the names of div.out's but a Scalar where div.out takes a
    Tensor: its result is made anew each run, not written with div.out (which failed from the
    second run on: "Expected Tensor but got Int" -- a compiled ``x.mean(1)`` step's third call).
    """
    steps = [
        _step("aten.sum.dim_IntList", (Slot(0), [1]), (1,)),
        _step("aten.div.Scalar", (Slot(1), 5), (2,)),
        _step("aten.mul.Scalar", (Slot(2), 3), (3,)),
        _step("aten.add.Tensor", (Slot(3), Slot(2)), (4,), frees=(3,)),  # add.out: as before
        _step("aten.neg.default", (Slot(4),), (5,), frees=(4,)),
    ]
    compiled = _program(steps, 6, (0,), (2, 5))
    for run in range(3):
        x = torch.randn(4, 5)
        env, cenv = [x] + [None] * 5, core.Env(6)
        cenv[0] = x
        for s in steps:
            run_step(s, env)
        assert compiled.run(cenv, 0, len(steps)) == -1, compiled.last_error()
        for k in (2, 5):
            assert torch.equal(env[k], cenv[k]), (run, k)
        del env, cenv
    assert compiled.reused() >= 1  # add's buffer is still written again


def _program(steps, n, inputs, outputs):
    from monarch_dsl.compiler.lower import core_steps
    from monarch_dsl.isa import Program

    program = Program("p", (), (), tuple(steps), n, inputs, outputs, (), ())
    return core.CompiledPlan(core_steps(program, None, None), Slot)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.int64,
        torch.int8,
        torch.uint8,
    ],
)
def test_numbers_in_tensor_arguments_give_what_torch_gives_in_every_dtype(dtype):
    """The program converts a Python number in a Tensor argument (x * 0.1) to float32 once,
    instead of on every call as TensorIterator does; the results must stay bitwise what eager
    torch gives, dtype included, in every dtype (half and bfloat16 read the number unrounded,
    7 in uint8 is not 7, int / int divides in float)."""
    x = (torch.randn(8, 8) * 10).to(dtype)
    numbers = [0.1, 1 / 3, 3, -7, 1e-3]
    eager = {
        "mul": torch.mul,
        "add": torch.add,
        "sub": torch.sub,
        "div": torch.div,
        "fmod": torch.fmod,
        "remainder": torch.remainder,
    }
    ops = [f"aten.{name}.Tensor" for name in eager]
    steps = [
        _step(op, (Slot(0), v), (1 + k,))
        for k, (op, v) in enumerate((op, v) for op in ops for v in numbers)
    ]
    compiled = _program(steps, 1 + len(steps), (0,), tuple(range(1, 1 + len(steps))))
    for run in range(3):  # the first run converts, the later ones reuse the conversion
        env = core.Env(1 + len(steps))
        env[0] = x
        assert compiled.run(env, 0, len(steps)) == -1, compiled.last_error()
        for k, s in enumerate(steps):
            want = eager[s.op.split(".")[1]](x, s.args[1])
            got = env[1 + k]
            assert got.dtype == want.dtype and torch.equal(got, want), (run, s.op, s.args[1])


def test_ops_without_an_out_kernel_run_in_place_only_on_values_nothing_else_holds():
    """relu has no out= kernel of its own: from the second run on it runs as relu_ on its
    argument where that dies at the step and nothing else holds it (here tanh's result, kept
    only as tanh's buffer) -- never on a plan input, a value used later, or a view."""
    steps = [
        _step("aten.tanh.default", (Slot(0),), (1,)),
        _step("aten.relu.default", (Slot(1),), (2,), frees=(1,)),  # dies here: in place
        _step("aten.relu.default", (Slot(0),), (3,)),  # a plan input: never
        _step("aten.tanh.default", (Slot(0),), (4,)),
        _step("aten.relu.default", (Slot(4),), (5,)),  # used again below: never
        _step("aten.neg.default", (Slot(4),), (6,), frees=(4,)),
        _step("aten.tanh.default", (Slot(0),), (7,)),
        _step("aten.view.default", (Slot(7), [64]), (8,)),
        _step("aten.relu.default", (Slot(7),), (9,), frees=(7,)),  # a view holds it: never
    ]
    outputs = (2, 3, 5, 6, 8, 9)
    compiled = _program(steps, 10, (0,), outputs)
    in_place = []
    for run in range(3):
        x = torch.randn(8, 8)
        before = x.clone()
        env = core.Env(10)
        env[0] = x
        assert compiled.run(env, 0, len(steps)) == -1, compiled.last_error()
        in_place.append(compiled.in_place())
        assert torch.equal(x, before)
        t = torch.tanh(before)
        want = {2: t.relu(), 3: before.relu(), 5: t.relu(), 6: -t, 8: t.view(64), 9: t.relu()}
        for k, v in want.items():
            assert torch.equal(env[k], v), (run, k)
        del env
    assert in_place == [0, 1, 1]  # run 0 learns; then exactly one relu runs in place


@pytest.mark.parametrize(
    "shape, placements",
    [
        ((8, 6), (md.Shard(0),)),
        ((8, 6), (md.Shard(1),)),  # a column: not contiguous until copied
        ((8, 6), (md.Shard(0), md.Shard(1))),
        ((8, 6), (md.Shard(0), md.Shard(0))),
        ((8, 6), (md.Replicate(), md.Shard(1))),
        ((5, 6), (md.Shard(0),)),  # uneven: chunk's parts
    ],
)
def test_env_takes_a_ranks_part_of_a_whole_as_local_part_cuts_it(shape, placements):
    """``Env.set_part`` (a local argument sent whole with a call of a compiled step) gives
    what ``local_part`` gives: the same values, contiguous, a copy of its own."""
    from monarch_dsl.compiler.interpret import local_part
    from monarch_dsl.mesh import all_coords

    whole = torch.arange(float(shape[0] * shape[1])).reshape(shape)
    sizes = (2,) * len(placements)
    for coords in all_coords(sizes):
        want = local_part(whole, placements, coords, sizes)
        cuts = [(p.dim, coords[m], sizes[m]) for m, p in enumerate(placements) if p.is_shard()]
        env = core.Env(2)
        env.set_part(1, whole, cuts)
        got = env[1]
        assert torch.equal(got, want) and got.is_contiguous(), coords
        assert got.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
    env = core.Env(3)
    env.set_many([2, 0], [whole, 1.5])
    assert env[2] is whole or env[2].data_ptr() == whole.data_ptr()
    assert env[0] == 1.5 and env[1] is None
    with pytest.raises(ValueError, match="as many values as slots"):
        env.set_many([0, 1], [whole])


def test_program_error_names_the_step_and_later_steps_do_not_run():
    steps = [
        _step("aten.relu.default", (Slot(0),), (2,)),
        _step("aten.mm.default", (Slot(0), Slot(1)), (3,)),  # 4x6 @ 4x6: fails
        _step("aten.neg.default", (Slot(3),), (4,)),
    ]
    from monarch_dsl.compiler.lower import core_steps
    from monarch_dsl.isa import Program

    program = Program("p", (), (), tuple(steps), 5, (0, 1), (), (), ())
    compiled = core.CompiledPlan(core_steps(program, None, None), Slot)
    env = core.Env(5)
    env[0], env[1] = torch.randn(4, 6), torch.randn(4, 6)
    assert compiled.run(env, 0, 3) == 1
    assert "mat1 and mat2 shapes cannot be multiplied" in compiled.last_error()
    assert env.has(2) and not env.has(4)


def test_one_loader_for_plans_workers_and_shared_memory(monkeypatch):
    from monarch_dsl.runtime import shm

    assert _core.native() is core and shm.core() is core and _core.CompiledPlan is core.CompiledPlan
    assert _core.unavailable_reason() is None and _core.worker_native() is core
    monkeypatch.setenv("MD_EXECUTOR", "python")
    assert _core.worker_native() is None


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def fail(**kwargs):
        raise RuntimeError(
            "Error building extension 'monarch_dsl_core': program.cpp:1: error: expected ';'"
        )

    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.raises(_build.BuildError, match="expected ';'"):
        _build._compile(tmp_path)


@md.remote(propagate=lambda: torch.zeros((), dtype=torch.bool))
def _worker_uses_cpp():
    from monarch_dsl.runtime import worker

    runner = worker.current.executor().plan_runner
    return torch.tensor(runner is not None and runner.core is not None)


def _train_on_workers(executor: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    step = md.mesh_fn(data_parallel="dp")(mse_step(model, opt))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(3)]
    pm = md.this_host().spawn_procs({"dp": 2}, env={"MD_EXECUTOR": executor})
    try:
        with pm.activate():
            losses = [step(x, y) for x, y in batches]
            got = [md.inspect(loss) for loss in losses]
            assert bool(md.inspect(_worker_uses_cpp())) == (executor == "cpp")
        step.pull()
    finally:
        pm.stop()
    return got, copy.deepcopy(model.state_dict())


@pytest.mark.procs
def test_workers_run_compiled_plans_in_cpp_with_the_same_results():
    """The same training on a mesh whose workers use the C++ runtime and on one whose workers
    use the Python reference executor (MD_EXECUTOR=python): bit for bit equal."""
    a_losses, a_state = _train_on_workers("cpp")
    b_losses, b_state = _train_on_workers("python")
    assert all(torch.equal(a, b) for a, b in zip(a_losses, b_losses))
    assert all(torch.equal(a_state[k], b_state[k]) for k in a_state)


def _matmul(x, w):
    return x @ w


def _tanh_matmul(x, w):
    return torch.tanh(x @ w)


S = md.Shard
# (step, placements, out placement): a reduce_scatter; an all_gather then an all_to_all over
# dp onto a dim tp also shards; an all_to_all (the collectives the DP MLP above does not use)
REDISTRIBUTIONS = [
    (_matmul, {"x": {"dp": S(0), "tp": S(1)}, "w": {"tp": S(0)}}, {"dp": S(0), "tp": S(1)}),
    (_tanh_matmul, {"x": {"dp": S(0)}, "w": {"tp": S(1)}}, {"dp": S(1)}),
    (_tanh_matmul, {"x": {"tp": S(0)}}, {"tp": S(1)}),
]


def _redistribute_on_workers(executor: str):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)
    pm = md.this_host().spawn_procs({"dp": 2, "tp": 2}, env={"MD_EXECUTOR": executor})
    got = []
    try:
        with pm.activate():
            for fn, placements, out in REDISTRIBUTIONS:
                step = md.mesh_fn(placements=placements, out_placements={"out0": out})(fn)
                y = step(x, w)
                got.append([md.inspect(y, dp=a, tp=b) for a in range(2) for b in range(2)])
            assert bool(md.inspect(_worker_uses_cpp())) == (executor == "cpp")
    finally:
        pm.stop()
    return x, w, got


@pytest.mark.procs
def test_workers_redistribute_in_cpp_as_in_python():
    """reduce_scatter, all_gather and all_to_all in compiled plans on a dp x tp mesh: the C++
    plan driver's local shards equal the Python reference's bit for bit, and put together
    they are the one-process result."""
    x, w, cpp = _redistribute_on_workers("cpp")
    _, _, python = _redistribute_on_workers("python")
    for (fn, _, out), mine, ref in zip(REDISTRIBUTIONS, cpp, python):
        assert all(torch.equal(a, b) for a, b in zip(mine, ref)), fn.__name__
        whole = fn(x, w)
        if out == {"tp": S(1)}:  # dp replicates: each (dp, tp) holds tp's column block
            expected = [whole.chunk(2, 1)[b] for a in range(2) for b in range(2)]
        elif out == {"dp": S(1)}:
            expected = [whole.chunk(2, 1)[a] for a in range(2) for b in range(2)]
        else:  # rows by dp, columns by tp
            expected = [whole.chunk(2, 0)[a].chunk(2, 1)[b] for a in range(2) for b in range(2)]
        for m, e in zip(mine, expected):
            torch.testing.assert_close(m, e)
