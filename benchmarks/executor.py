"""Executor benchmark (issue 5, part 1): time per instruction of a 200-op plan of small aten ops
on 8x8 tensors, run by

- the C++ runtime (``monarch_dsl._core.CompiledPlan``: dispatcher handles resolved once,
  boxed calls),
- the Python reference executor (``compiler.lower.run_step`` per step, as workers do with
  ``MD_EXECUTOR=python``),
- the peer: the same graph as a ``make_fx`` GraphModule (generated Python code calling
  ``torch.ops.aten.*``), and ``torch.fx.Interpreter`` for reference.

Target: the C++ runtime >= 3x faster per instruction than the GraphModule. Medians of several
repetitions; the three alternate so machine noise hits them alike.

On a GPU (part 3), the same plan in the C++ runtime beside eager CUDA. Also the same ops as an
eager batch (what ``with pm.activate():`` sends: one ``CallOp`` per op)
through a worker's executor, in this process, from ``run(batch)`` to the barrier's reply: the
C++ executor (``_core.Executor``, the workers' default) vs the Python reference executor.

    python benchmarks/executor.py [--ops 200] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from monarch_dsl import _core, isa
from monarch_dsl.compiler.lower import core_steps, run_step
from monarch_dsl.isa import Compute, Program, Slot
from monarch_dsl.runtime.core_executor import CoreExecutor
from monarch_dsl.runtime.executor import ReferenceExecutor


def chain(n_ops: int):
    """A function of two 8x8 tensors doing ``n_ops`` small aten ops."""

    def f(a, b):
        x, y = a, b
        for i in range(n_ops // 5):
            x = torch.mm(x, y)
            x = x * 0.5
            x = torch.tanh(x)
            y = y + x
            x = torch.relu(x - 0.1 * i)
        return x, y

    return f


def to_program(gm: torch.fx.GraphModule) -> tuple[Program, int]:
    """The graph's ops as the executors' steps (slots for values, frees at last uses)."""
    slots: dict = {}
    steps = []
    n_inputs = 0
    # Each value is freed by the step that uses it last (as lowered plans and the GraphModule's
    # generated code do), unless it is an output.
    last_use: dict = {}
    outputs = set()
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            if node.op == "output":
                outputs.add(arg)
            else:
                last_use[arg] = node
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            slots[node] = len(slots)
            n_inputs += 1
        elif node.op == "call_function":
            slots[node] = len(slots)

            def conv(v):
                if isinstance(v, torch.fx.Node):
                    return Slot(slots[v])
                if isinstance(v, (list, tuple)):
                    return type(v)(conv(x) for x in v)
                return v

            op = str(node.target)
            steps.append(
                Compute(
                    name=op,
                    args=conv(tuple(node.args)),
                    kwargs={k: conv(v) for k, v in node.kwargs.items()},
                    outs=(slots[node],),
                    frees=tuple(
                        slots[a]
                        for a in dict.fromkeys(node.all_input_nodes)
                        if last_use.get(a) is node and a not in outputs and a.op != "placeholder"
                    ),
                )
            )
    program = Program("bench", (), (), tuple(steps), len(slots), tuple(range(n_inputs)), (), (), ())
    return program, len(steps)


def to_batch(program: Program) -> tuple:
    """The program's steps as an eager batch: ref ``slot + 1`` for each slot."""

    def conv(v):
        if isinstance(v, Slot):
            return isa.Ref(v.index + 1)
        if isinstance(v, (list, tuple)):
            return type(v)(conv(x) for x in v)
        return v

    items = [(-1, isa.DefineMesh(0, ("gpu",), (1,), (0,)))]
    for s in program.steps:
        op = s.op.replace(".", "::", 1)  # aten.mm.default -> aten::mm.default
        outs = tuple(o + 1 for o in s.outs)
        items.append((0, isa.CallOp(op, conv(s.args), conv(s.kwargs), outs, "main", "")))
    items.append((0, isa.Delete(tuple(o + 1 for s in program.steps for o in s.outs), "main")))
    items.append((0, isa.Fetch(1, -1, "main", "")))  # a barrier: replies once all ran
    return tuple(items)


def eager_runner(executor, batch, a, b):
    done = threading.Semaphore(0)
    executor.reply = lambda call_id, value: done.release()
    executor.refs[1], executor.refs[2] = a, b

    def run():
        executor.run(batch)
        if not done.acquire(timeout=60):
            raise RuntimeError("the executor never reached the barrier")

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    core = _core.require()

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    gm = make_fx(chain(args.ops))(a, b)
    program, n = to_program(gm)
    compiled = core.CompiledPlan(core_steps(program, None, None), Slot)
    interp = torch.fx.Interpreter(gm)

    def run_cpp():
        env = core.Env(program.n_slots)
        env[0], env[1] = a, b
        if compiled.run(env, 0, len(program.steps)) != -1:
            raise RuntimeError(compiled.last_error())

    def run_python():
        env = [None] * program.n_slots
        env[0], env[1] = a, b
        for s in program.steps:
            run_step(s, env)

    def run_graph():
        gm(a, b)

    def run_graph_inference():  # no autograd dispatch at all, as the C++ runtime runs plans
        with torch.inference_mode():
            gm(a, b)

    def run_interp():
        interp.run(a, b)

    # The same results first.
    env = core.Env(program.n_slots)
    env[0], env[1] = a, b
    compiled.run(env, 0, len(program.steps))
    ref = gm(a, b)
    assert torch.equal(env[program.n_slots - 1], ref[1]) or torch.equal(
        env[program.n_slots - 1], ref[0]
    ), "the C++ runtime's result differs from the GraphModule's"

    def measure(runners: dict) -> dict[str, float]:
        """Median us per instruction of each runner; the runners alternate."""
        iters = {k: args.iters if k != "interp" else max(args.iters // 4, 10) for k in runners}
        for fn in runners.values():  # warm up
            for _ in range(5):
                fn()
        times: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(args.reps):
            for k, fn in runners.items():
                t0 = time.perf_counter()
                for _ in range(iters[k]):
                    fn()
                times[k].append((time.perf_counter() - t0) / iters[k] / n * 1e6)
        return {k: statistics.median(v) for k, v in times.items()}

    med = measure(
        {
            "cpp": run_cpp,
            "python": run_python,
            "graph": run_graph,
            "graph_inference": run_graph_inference,
            "interp": run_interp,
        }
    )
    ratio = med["graph"] / med["cpp"]
    print(
        f"{n}-op plan of small aten ops on 8x8 tensors; medians of {args.reps} repetitions "
        f"(us per instruction)"
    )
    print(f"{'executor':<42}{'us/op':>10}{'vs graph':>10}")
    rows = [
        ("C++ runtime (_core.CompiledPlan)", "cpp"),
        ("Python reference executor (run_step)", "python"),
        ("peer: make_fx GraphModule forward", "graph"),
        ("  the same under torch.inference_mode()", "graph_inference"),
        ("torch.fx.Interpreter", "interp"),
    ]
    for label, k in rows:
        print(f"{label:<42}{med[k]:>10.2f}{med['graph'] / med[k]:>9.2f}x")
    check = "PASS" if ratio >= 3 else "MISS"

    # The executors are made only now: measured beside them (alternating), the plan runs
    # took ~1.5 us/op instead of ~0.95 here.
    batch = to_batch(program)
    callbacks = dict(reply=None, reply_failure=None, report=print)
    cpu = torch.device("cpu")
    core_ex = CoreExecutor(core, 0, cpu, **callbacks)
    ref_ex = ReferenceExecutor(0, cpu, **callbacks)
    eager = measure(
        {
            "eager_cpp": eager_runner(core_ex, batch, a, b),
            "eager_python": eager_runner(ref_ex, batch, a, b),
        }
    )
    core_ex.close()
    speedup = eager["eager_python"] / eager["eager_cpp"]
    print(f"\nthe same {n} ops as an eager batch through a worker's executor (us per instruction)")
    print(f"{'C++ executor (_core.Executor)':<42}{eager['eager_cpp']:>10.2f}{speedup:>9.2f}x")
    print(f"{'Python reference executor':<42}{eager['eager_python']:>10.2f}{1:>9.2f}x")
    print(f"target: C++ >= 3x faster than the GraphModule per op: {ratio:.2f}x  {check}")

    # Part 3: on a GPU, the executor's overhead per op beside eager CUDA (the same graph run
    # by the GraphModule), each run ended by a synchronize.
    if not torch.cuda.is_available():
        print("\nGPU part: no CUDA device here (skipped)")
        return
    cuda = torch.device("cuda")
    ga, gb = a.to(cuda), b.to(cuda)
    on_gpu = core.CompiledPlan(core_steps(program, None, cuda), Slot)

    def run_cpp_cuda():
        env = core.Env(program.n_slots)
        env[0], env[1] = ga, gb
        if on_gpu.run(env, 0, len(program.steps)) != -1:
            raise RuntimeError(on_gpu.last_error())
        torch.cuda.synchronize()

    def run_eager_cuda():
        gm(ga, gb)
        torch.cuda.synchronize()

    gpu = measure({"cpp_cuda": run_cpp_cuda, "eager_cuda": run_eager_cuda})
    print(f"\nthe same {n} ops on {torch.cuda.get_device_name()} (us per instruction)")
    print(f"{'C++ runtime (_core.CompiledPlan)':<42}{gpu['cpp_cuda']:>10.2f}")
    print(f"{'peer: eager CUDA (GraphModule forward)':<42}{gpu['eager_cuda']:>10.2f}")


if __name__ == "__main__":
    main()
