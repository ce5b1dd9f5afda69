"""The C++ executor (``_core.Executor`` via runtime/core_executor.py) against the Python
reference executor: the same eager instructions, run in this process by both, give the same
ref tables -- equal tensors bit for bit, the same failures -- and the same reported root causes.
The process tests (test_tensor.py, the tutorial in test_examples.py) run on workers with each."""

import threading

import pytest
import torch
import torch.distributed as dist

from monarch_dsl import _build, _core, isa
from monarch_dsl.runtime.executor import Failure, ReferenceExecutor

core = _core.require()  # setup built it; a missing build fails here, clearly

from monarch_dsl.runtime.core_executor import CoreExecutor  # noqa: E402

R = isa.Ref
D = isa.WORKER_DEVICE


def op(name, args, outs, kwargs=None, stream="main", line="prog.py:1"):
    return (0, isa.CallOp(name, tuple(args), kwargs or {}, tuple(outs), stream, line))


PROGRAM = [
    (-1, isa.DefineMesh(0, ("gpu",), (1,), (0,))),
    (0, isa.Seed(7, "prog.py:0")),
    op("aten::rand", [[4, 4]], [1], {"device": D}),
    op("aten::randn", [[4, 4]], [2], {"device": D}),
    op("aten::mm", [R(1), R(2)], [3]),
    op("aten::add.Tensor", [R(3), 2], [4]),  # a Python number as a wrapped-number tensor
    op("aten::relu", [R(4)], [5]),
    op("aten::cat", [[R(1), R(2)], 0], [6]),  # a Tensor[] argument
    op("aten::split.Tensor", [R(6), 4], [7, 8]),  # a list result
    op("aten::max.dim", [R(5), 1], [9, 10]),  # a tuple result
    op("aten::mm", [R(1), R(6)], [11], line="prog.py:11"),  # 4x4 @ 8x4: fails
    op("aten::add.Tensor", [R(11), R(1)], [12]),  # fails with it
    op("aten::sum", [R(1)], [13]),  # independent: fine
    (0, isa.Delete((2,), "main")),
    op("aten::arange", [2], [14], {"dtype": torch.int64, "device": D}),
    op("aten::clone", [R(1)], [15]),
    op("aten::index_put_", [R(15), [R(14)], R(13)], [15]),  # a Tensor?[] argument
    op("aten::scalar_tensor", [isa.MeshCoord(0, ("gpu",))], [16], {"device": D}),  # Python path
    op("aten::add.Tensor", [R(16), 1], [37]),  # queued after it, in C++: runs after it
    (3, isa.CallOp("aten::ones", ([2],), {}, (38,), "main", "")),  # a mesh without this rank
    op("aten::mul.Tensor", [R(12), 2], [None]),  # an output nobody holds
    # stream "comms" borrows %5, computes with it, and gives it back
    (0, isa.BorrowBegin(5, 17, "main", "comms", 1, "prog.py:20")),
    op("aten::mul.Tensor", [R(17), 3], [18], stream="comms"),
    (0, isa.BorrowEnd(17, "main", "comms", 2, "prog.py:22")),
    op("aten::add.Tensor", [R(5), R(18)], [19]),
    # a result that is an undefined tensor (no input gradient) takes no output ref
    op("aten::ones", [[4]], [30], {"device": D}),
    op("aten::zeros", [[4]], [31], {"device": D}),
    op("aten::native_layer_norm", [R(1), [4], R(30), R(31), 1e-5], [32, 33, 34]),
    op(
        "aten::native_layer_norm_backward",
        [R(1), R(1), [4], R(33), R(34), R(30), R(31), [False, True, True]],
        [35, 36],
    ),
    # collectives over the one-rank mesh (a gloo group of one), on two streams
    (0, isa.Reduce(1, 20, 0, ("gpu",), "sum", False, (4, 4), "float32", "main", "prog.py:24")),
    (0, isa.Reduce(13, 13, 0, ("gpu",), "avg", False, (), "float32", "main", "prog.py:25")),
    (0, isa.Reduce(6, 21, 0, ("gpu",), "stack", False, (8, 4), "float32", "main", "prog.py:26")),
    (0, isa.Reduce(6, 22, 0, ("gpu",), "max", True, (8, 4), "float32", "comms", "prog.py:27")),
    (0, isa.Reduce(11, 23, 0, ("gpu",), "sum", False, (4, 4), "float32", "main", "prog.py:28")),
    # copies to this same rank (a transfer's pair with itself), of a value and of a failure
    (0, isa.Transfer(1, 24, ((0, 0),), (4, 4), "float32", "main", "prog.py:29")),
    (0, isa.Transfer(11, 25, ((0, 0),), (4, 4), "float32", "main", "prog.py:30")),
    (0, isa.Fetch(99, -1, "main", "")),  # a barrier: replies when every stream got here
]


def run(make):
    done = threading.Event()
    reports = []
    ex = make(
        reply=lambda call_id, value: done.set(),
        reply_failure=lambda call_id, f: None,
        report=reports.append,
    )
    ex.store = dist.HashStore()  # the groups' rendezvous (one rank here)
    ex.run(tuple(PROGRAM))
    assert done.wait(30), "the barrier never replied"
    table = {k: ex.refs.get(k) for k in sorted(ex.refs.keys())}
    return ex, table, reports


def test_both_executors_give_the_same_ref_table(executors):
    cpp, got, cpp_reports = run(lambda **cb: CoreExecutor(core, 0, torch.device("cpu"), **cb))
    py, want, py_reports = run(lambda **cb: ReferenceExecutor(0, torch.device("cpu"), **cb))
    executors += [cpp, py]
    assert isinstance(cpp.refs, core.Executor) and isinstance(py.refs, dict)
    assert sorted(got) == sorted(want) == [
        1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19, 20, 21, 22, 23, 24, 25,
        30, 31, 32, 33, 34, 35, 36, 37,
    ]  # fmt: skip
    for k, w in want.items():
        g = got[k]
        if isinstance(w, Failure):
            assert isinstance(g, Failure), k
            assert (g.rank, g.line, g.op, g.error) == (w.rank, w.line, w.op, w.error), k
        else:
            assert g.dtype == w.dtype and torch.equal(g, w), k
    assert "mat1 and mat2 shapes cannot be multiplied" in got[11].error
    assert got[12].line == got[23].line == got[25].line == "prog.py:11"  # the root cause
    assert torch.equal(got[24], got[1]) and got[24].data_ptr() != got[1].data_ptr()  # a copy
    assert got[21].shape == (1, 8, 4) and torch.equal(got[20], got[1])
    assert got[35].shape == got[36].shape == (4,)  # weight and bias gradients, in that order
    assert got[37].item() == 1.0  # the mesh coordinate 0, plus 1: ran after the Python op
    assert [(f.line, f.error) for f in cpp_reports] == [(f.line, f.error) for f in py_reports]
    assert len(cpp_reports) == 1  # one root cause, reported once


def test_the_table_is_a_mapping_python_handlers_can_use():
    cpp = CoreExecutor(
        core, 0, torch.device("cpu"), reply=None, reply_failure=None, report=lambda f: None
    )
    refs = cpp.refs
    t = torch.arange(3.0)
    refs[1] = t
    refs[2] = Failure(0, "a.py:3", "aten::x", "RuntimeError: no", "tb")
    assert refs[1] is t or torch.equal(refs[1], t)
    assert refs[1].data_ptr() == t.data_ptr()  # the same tensor, not a copy
    f = refs.get(2)
    assert isinstance(f, Failure) and (f.line, f.error) == ("a.py:3", "RuntimeError: no")
    assert 1 in refs and 3 not in refs and len(refs) == 2
    assert refs.get(3) is None and refs.pop(3, "gone") == "gone"
    with pytest.raises(KeyError):
        refs[3]
    with pytest.raises(TypeError):
        refs[4] = "not a value"
    assert torch.equal(refs.pop(1), t) and len(refs) == 1
    refs[1] = t
    # many at once (a compiled step's inputs), as the reference executor's dict gives them
    got = cpp.values_of((1, 2, 3, -1))
    assert got[0].data_ptr() == t.data_ptr() and got[2] is None and got[3] is None
    assert isinstance(got[1], Failure) and got[1].line == "a.py:3"
    py = ReferenceExecutor(
        0, torch.device("cpu"), reply=None, reply_failure=None, report=lambda f: None
    )
    py.refs.update({1: t, 2: got[1]})
    want = py.values_of((1, 2, 3, -1))
    assert want[0] is t and want[1] is got[1] and want[2:] == [None, None]
    cpp.close()


def test_streams_run_concurrently_and_borrows_wait():
    """Stream "b" waits for event 1, which only stream "a" signals after its ops: b's op sees
    a's result. A barrier covers both streams."""
    ex = core.Executor(0, isa.Ref, D, torch.device("cpu"), Failure, lambda f: None)
    done = threading.Event()
    ex.call_op("a", "aten::ones", ((3,),), {"device": D}, [1], "x.py:1")
    ex.call_op("a", "aten::mul.Tensor", (R(1), 5), {}, [2], "x.py:2")
    ex.borrow_begin("b", 1, 2, 3)
    ex.signal("a", 1)
    ex.call_op("b", "aten::add.Tensor", (R(3), 1), {}, [4], "x.py:3")
    ex.barrier(done.set)
    assert done.wait(30)
    assert ex.get(4).tolist() == [6.0, 6.0, 6.0]
    assert sorted(ex.streams()) == ["a", "b"]
    ex.close()
    assert len(ex) == 0


def test_a_streams_python_steps_share_one_python_thread_state_until_it_closes():
    """The Python steps of a stream (a compiled call's, a remote function's, a fetch) run in
    one Python thread state, as on a Python thread: what one leaves in a thread-local the next
    finds there (each had a new one, made and deleted around it); closing lets go of it."""
    import gc
    import weakref

    ex = core.Executor(0, isa.Ref, D, torch.device("cpu"), Failure, lambda f: None)
    local = threading.local()
    seen, done = [], threading.Event()

    class Kept:  # held by the stream's thread-local: alive while its thread state is
        pass

    def first():
        local.kept = Kept()
        seen.append(weakref.ref(local.kept))

    def later():
        seen.append(getattr(local, "kept", None) is not None)

    ex.python("s", first)
    for _ in range(3):
        ex.python("s", later)
    ex.barrier(done.set)
    assert done.wait(30)
    assert seen[1:] == [True, True, True]
    assert seen[0]() is not None
    ex.close()
    gc.collect()
    assert seen[0]() is None  # the thread state (and its thread-locals) went with the stream


def test_a_python_step_that_let_a_memory_error_out_runs_once_more_with_room(capfd):
    """At a worker's budget's last pages a Python step (a fetch: its caller waits for the
    answer) can fail before its own code runs: it runs once more with 16 MiB more under
    RLIMIT_DATA, put back after. Another error is said on stderr and not run again."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    budget = 1 << 40  # a finite limit far above this process's use: a budget to grow
    resource.setrlimit(resource.RLIMIT_DATA, (budget, hard))
    ex = core.Executor(0, isa.Ref, D, torch.device("cpu"), Failure, lambda f: None)
    try:
        limits, others = [], []

        def step():
            limits.append(resource.getrlimit(resource.RLIMIT_DATA)[0])
            if len(limits) == 1:
                raise MemoryError

        def other():
            others.append(1)
            raise ValueError("a bug of ours")

        done = threading.Event()
        ex.python("main", step)
        ex.python("main", other)
        ex.barrier(done.set)
        assert done.wait(30)
        assert limits == [budget, budget + (16 << 20)]
        assert resource.getrlimit(resource.RLIMIT_DATA)[0] == budget
        assert others == [1]
        assert "internal error in a Python step" in capfd.readouterr().err
    finally:
        ex.close()
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def test_an_op_the_dispatcher_cannot_take_is_refused_when_queued():
    ex = core.Executor(0, isa.Ref, D, torch.device("cpu"), Failure, lambda f: None)
    with pytest.raises(RuntimeError):
        ex.call_op("main", "aten::no_such_op", (), {}, [1], "")
    with pytest.raises(RuntimeError, match="unexpected keyword"):
        ex.call_op("main", "aten::relu", (R(1),), {"bogus": 1}, [2], "")
    ex.close()


def test_the_build_is_current():
    assert _build.load(build=False) is core


# ---- compiled plans on one executor (runtime/plan_runner.py) ----------------------------------


def _plan_runner(rank: int, ranks: tuple[int, ...], store) -> tuple[ReferenceExecutor, object]:
    ex = ReferenceExecutor(
        rank, torch.device("cpu"), reply=None, reply_failure=None, report=lambda f: None
    )
    ex.store = store
    runner = ex.plans()
    ex.define_mesh(isa.DefineMesh(0, ("x",), (len(ranks),), ranks))
    return ex, runner


def _index_plan(op: str = "aten.index_select.default") -> isa.Program:
    """out = op(x, 0, idx): x and idx the inputs."""
    steps = (isa.Compute(name=op, args=(isa.Slot(0), 0, isa.Slot(1)), outs=(2,), loc="t.py:9"),)
    return isa.Program("p", ("x",), (len(steps),), steps, 3, (0, 1), (2,), ((1,),), ("float32",))


@pytest.mark.parametrize("executor", ["cpp", "python"])
def test_a_plan_whose_first_run_cannot_be_set_up_fails_its_outputs(monkeypatch, executor):
    """The C++ program of a plan is made at its first run; where that fails (an op it cannot
    find), the run's outputs fail with the cause, as a step's failure does (it used to escape
    the run: the outputs were never bound, and a fetch said they were deleted)."""
    monkeypatch.setenv("MD_EXECUTOR", executor)
    ex, runner = _plan_runner(0, (0,), dist.HashStore())
    runner.define(isa.DefinePlan(7, _index_plan("aten.no_such_op.default"), ((), ())))
    ex.refs.update({1: torch.arange(4.0), 2: torch.tensor([1])})
    for out in (10, 11):  # (and again: nothing half made was kept)
        runner.run(isa.RunPlan(7, 0, (1, 2), (out,), (), "main", "call.py:1"))
        failure = ex.refs.get(out)
        assert isinstance(failure, Failure) and "no_such_op" in failure.error, failure


def _rank_of_two(rank: int, port: int, peer_gone, results) -> None:
    """Rank ``rank`` of a two-rank mesh runs a plan once with its peer; rank 0 then runs it
    again, with an index out of its range, after rank 1 has exited."""
    import datetime

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    ex, runner = _plan_runner(rank, (0, 1), store)
    runner.define(isa.DefinePlan(7, _index_plan(), ((), ())))
    ex.refs.update({1: torch.arange(4.0), 2: torch.tensor([1])})
    runner.run(isa.RunPlan(7, 0, (1, 2), (10,), (), "main", "call.py:1"))
    if rank == 1:
        return
    assert peer_gone.wait(60)
    ex.refs[2] = torch.tensor([99])
    runner.run(isa.RunPlan(7, 0, (1, 2), (11,), (), "main", "call.py:2"))
    f = ex.refs.get(11)
    results.put((getattr(f, "op", None), getattr(f, "line", None), getattr(f, "error", repr(f))))


@pytest.mark.procs
def test_a_rank_whose_step_failed_reports_its_step_when_the_flag_cannot_be_agreed():
    """The failure flag's all-reduce fails where the peer is gone; a rank whose own step
    failed in that run reports its step (op, line, error), not the flag's error."""
    import multiprocessing

    from monarch_dsl.parallel.spmd import free_port

    ctx = multiprocessing.get_context("spawn")
    peer_gone, results = ctx.Event(), ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=_rank_of_two, args=(r, port, peer_gone, results)) for r in (0, 1)]
    for p in ps:
        p.start()
    try:
        ps[1].join(60)
        assert ps[1].exitcode == 0
        peer_gone.set()
        op, line, error = results.get(timeout=60)
        ps[0].join(60)
    finally:
        for p in ps:
            if p.is_alive():
                p.kill()
                p.join()
    assert (op, line) == ("aten.index_select.default", "t.py:9"), error
    assert "index" in error
