"""``monarch-dsl`` / ``python -m monarch_dsl``: the command line."""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import time
from typing import Any


def _env_rank() -> int | None:
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def _worker(args: argparse.Namespace) -> int:
    token_hex = os.environ.get("MONARCH_DSL_TOKEN", "")
    try:
        token = bytes.fromhex(token_hex)
    except ValueError:
        token = b""
    if not token:
        print(
            "monarch-dsl worker: set MONARCH_DSL_TOKEN to the controller's token "
            "(RemoteHosts.env())",
            file=sys.stderr,
        )
        return 2
    rank = args.rank if args.rank is not None else _env_rank()
    if rank is None:
        print(
            "monarch-dsl worker: no rank: pass --rank or run under a launcher that sets RANK",
            file=sys.stderr,
        )
        return 2
    os.environ["MONARCH_DSL_ROLE"] = "worker"
    if os.environ.get("MD_EXECUTOR", "cpp") != "python":
        from monarch_dsl import _build

        if _build.ensure() is None:  # said why on stderr; this worker runs Python
            os.environ["MD_EXECUTOR"] = "python"
    from monarch_dsl.runtime import transport, worker

    world = int(os.environ.get("WORLD_SIZE", "0") or 0)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    try:
        worker.connect_and_serve(args.connect, token, rank, world, local)
    except (OSError, transport.ProtocolError) as e:
        print(f"monarch-dsl worker (rank {rank}): cannot join {args.connect}: {e}", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.spmd:
        return _run_spmd(args)
    if args.nproc is not None:
        print("monarch-dsl run: -n/--nproc goes with --spmd", file=sys.stderr)
        return 2
    from monarch_dsl.runtime import forkserver

    sys.argv = [args.script, *args.args]
    sys.path.insert(0, forkserver.first_path(args.script, args.module, os.getcwd()))
    forkserver.run_main(args.script, args.module)  # (its module stays __main__ until exit)
    return 0


def _run_spmd(args: argparse.Namespace) -> int:
    """A torchrun script on a new local mesh of N workers (``pm.run_spmd``); exits with the
    first failed rank's code (128 + signal for a killed one)."""
    from monarch_dsl.parallel import spmd

    nproc = 1 if args.nproc is None else args.nproc
    if nproc < 1:
        print(f"monarch-dsl run --spmd: -n must be at least 1, got {nproc}", file=sys.stderr)
        return 2
    try:  # before paying for a mesh
        spmd.check_arguments(args.script, args.args, None, None, args.module)
    except (OSError, TypeError, ValueError, ImportError) as e:
        print(f"monarch-dsl run --spmd: {e}", file=sys.stderr)
        return 2
    import monarch_dsl as md
    from monarch_dsl.errors import MonarchError, SpmdError

    def terminate(signum, frame):  # as torchrun: SIGTERM to us stops the ranks, then we exit
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)

    # The workers only host the ranks: no GPU of their own, no C++ runtime to build.
    pm = md.this_host().spawn_procs(
        {"rank": nproc}, env={"MD_DEVICE": "cpu", "MD_EXECUTOR": "python"}
    )
    try:
        pm.run_spmd(args.script, *args.args, module=args.module)
        return 0
    except SpmdError as e:
        print(f"monarch-dsl run --spmd: {e}", file=sys.stderr)
        code = e.returncode
        return 1 if code is None or code == 0 else code if code > 0 else 128 - code
    except MonarchError as e:
        print(f"monarch-dsl run --spmd: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 128 + 2
    finally:
        pm.stop()


def _build(args: argparse.Namespace) -> int:
    from monarch_dsl import _build

    return _build.main()


def _example(spec: str) -> Any:
    """An example argument from ``f32[8,16]`` (the plan text's spelling of a tensor type)."""
    import re

    import torch

    from monarch_dsl.compiler.plan import DTYPE_NAMES

    names = {short: name for name, short in DTYPE_NAMES.items()}
    m = re.fullmatch(r"(\w+)\[([\d,\s]*)\]", spec.strip())
    if m is None or m.group(1) not in names:
        raise ValueError(
            f"--arg {spec!r}: expected a tensor type like f32[8,16] (dtypes: {', '.join(names)})"
        )
    shape = [int(n) for n in m.group(2).replace(" ", "").split(",") if n]
    dtype = getattr(torch, names[m.group(1)])
    return (
        torch.randn(shape, dtype=dtype)
        if dtype.is_floating_point
        else torch.zeros(shape, dtype=dtype)
    )


def _load_step(target: str, data_parallel: str | None) -> Any:
    """``FILE:FN``: the function ``FN`` of the file (run as a module named
    ``__monarch_dsl_plan__``, so its ``if __name__ == "__main__":`` part does not run), as an
    ``@md.mesh_fn`` (a plain function is wrapped, with ``data_parallel``)."""
    import monarch_dsl as md
    from monarch_dsl.mesh_fn import MeshFunction

    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"{target!r}: expected FILE:FN, e.g. train.py:step")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    names = runpy.run_path(path, run_name="__monarch_dsl_plan__")
    if name not in names:
        raise ValueError(f"{path} defines no {name!r}")
    fn = names[name]
    if isinstance(fn, MeshFunction):
        return fn
    if not callable(fn):
        raise TypeError(f"{path}:{name} is a {type(fn).__name__}, not a function")
    return md.mesh_fn(fn, data_parallel=data_parallel)


def _step_of(args: argparse.Namespace) -> tuple[Any, list, Any]:
    """The step, its example arguments and the mesh (a value) that ``args`` name."""
    import monarch_dsl as md

    step = _load_step(args.target, args.data_parallel)
    return step, [_example(a) for a in args.arg], md.Mesh.from_string(args.mesh)


def _plan_of(args: argparse.Namespace) -> Any:
    step, examples, mesh = _step_of(args)
    return step.compile(*examples, mesh=mesh)


def _plan(args: argparse.Namespace) -> int:
    """Print a compiled step's plan, check it, print its summary."""
    from monarch_dsl.errors import MonarchError

    try:
        plan = _plan_of(args)
    except (OSError, ValueError, TypeError) as e:
        print(f"monarch-dsl {args.command}: {e}", file=sys.stderr)
        return 2
    print(plan)
    try:
        plan.check()
    except MonarchError as e:
        print(f"monarch-dsl plan: the plan does not check: {e}", file=sys.stderr)
        return 1
    print()
    print(plan.summary())
    return 0


def _simulate(args: argparse.Namespace) -> int:
    """Simulate one call of a compiled step: the report, the timeline, a trace file, a PNG."""
    from monarch_dsl.compiler import timeline

    if args.width < 8:
        print(f"monarch-dsl simulate: --width must be 8 or more, not {args.width}", file=sys.stderr)
        return 2
    try:
        step, examples, mesh = _step_of(args)
        plan = step.compile(*examples, mesh=mesh)
        report = plan.simulate(profile=args.profile)
    except (OSError, ValueError, TypeError, KeyError) as e:
        print(f"monarch-dsl simulate: {e}", file=sys.stderr)
        return 2
    print(f"plan {plan.name} on {args.mesh}, profile {report.profile}")
    if _uncalibrated(args.profile):
        print("  uncalibrated: cpu-local is a placeholder until you run `monarch-dsl calibrate`")
    _totals(report)
    if args.trace:
        print(f"  trace: {report.save_trace(args.trace)} (Perfetto / chrome://tracing)")
    if args.png:
        try:
            print(f"  timeline: {timeline.save_png(report.events, args.png, plan.name)}")
        except ImportError as e:
            print(f"monarch-dsl simulate: {e}", file=sys.stderr)
            return 2
    print()
    print(report.timeline(args.width))
    if args.measure:
        return _measure(args, step, examples, mesh)
    return 0


def _totals(report: Any) -> None:
    ms = 1e3
    print(f"  step time          {report.step_time * ms:10.3f} ms")
    print(f"  compute time       {report.compute_time * ms:10.3f} ms")
    print(f"  communication      {report.comm_time * ms:10.3f} ms")
    print(f"  exposed comm       {report.exposed_comm_time * ms:10.3f} ms")
    for rank, peak in sorted(report.peak_memory.items()):
        print(f"  peak memory rank {rank} {peak / 2**20:10.2f} MiB")


def _measure(args: argparse.Namespace, step: Any, examples: list, mesh: Any) -> int:
    """``simulate --measure``: the same call on local worker processes, recorded by their C++
    runtime (``step.timeline``), after two calls (the plan's compile, then the state on the
    workers)."""
    import monarch_dsl as md
    from monarch_dsl.errors import MonarchError

    print()
    print(f"measured on {len(mesh)} local CPU workers (step.timeline of the third call):")
    try:
        pm = md.this_host().spawn_procs(mesh.sizes)
    except MonarchError as e:
        print(f"monarch-dsl simulate --measure: {e}", file=sys.stderr)
        return 1
    try:
        with pm.activate():
            for _ in range(2):
                step(*examples)
            measured = step.timeline(*examples)
    except (MonarchError, RuntimeError) as e:
        print(f"monarch-dsl simulate --measure: {e}", file=sys.stderr)
        return 1
    finally:
        pm.stop()
    _totals(measured)
    if args.trace:
        root, ext = os.path.splitext(args.trace)
        path = measured.save_trace(f"{root}.measured{ext or '.json'}")
        print(f"  trace: {path} (Perfetto / chrome://tracing)")
    print()
    print(measured.timeline(args.width))
    return 0


def _uncalibrated(profile: str | None) -> bool:
    from monarch_dsl.compiler.profile import BUILTIN, DeviceProfile

    return DeviceProfile.get(profile) is BUILTIN["cpu-local"]


def _calibrate(args: argparse.Namespace) -> int:
    """Measure this machine into the "cpu-local" profile (--device cuda: its GPU into
    "cuda-local"); print what was measured."""
    from pathlib import Path

    from monarch_dsl import calibrate
    from monarch_dsl.compiler.profile import calibrated_path
    from monarch_dsl.errors import MonarchError

    try:  # before any process starts
        given = calibrate.parse_ranks(args.ranks) if args.ranks is not None else None
        ranks = calibrate.check_arguments(args.device, given)
    except (TypeError, ValueError, RuntimeError) as e:
        print(f"monarch-dsl calibrate: {e}", file=sys.stderr)
        return 2
    name = f"{args.device}-local"
    path = Path(args.out) if args.out else calibrated_path(name)
    if path.is_dir():
        path = path / f"{name}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            raise PermissionError(f"cannot write to {path.parent}")
    except OSError as e:
        print(f"monarch-dsl calibrate: --out {path}: {e}", file=sys.stderr)
        return 2
    try:
        cal = calibrate.measure(quick=args.quick, ranks=ranks, progress=True, device=args.device)
    except MonarchError as e:  # a worker died or failed: said (with its own traceback)
        print(f"monarch-dsl calibrate: {e}\nmonarch-dsl calibrate: nothing was written",
              file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:  # (its workers are stopped on the way out)
        print("monarch-dsl calibrate: interrupted; nothing was written", file=sys.stderr)
        return 130
    saved = calibrate.save(cal.profile, path)
    print(calibrate.table(cal))
    names = f' (what profile "{name}" names from now on)' if path == calibrated_path(name) else ""
    print(f"wrote {saved}{names}")
    return 0


def _debug(args: argparse.Namespace) -> int:
    from monarch_dsl.runtime import debugger

    return debugger.client(args.pid)


# Every subcommand: (name, one line, an example). `monarch-dsl --help` lists them.
COMMANDS = [
    (
        "run",
        "run a script; its meshes are local worker processes",
        "monarch-dsl run train.py --lr 0.1",
    ),
    (
        "run --spmd",
        "run an unchanged torchrun script on -n N local workers (output prefixed by rank)",
        "monarch-dsl run --spmd -n 4 train_ddp.py --epochs 1",
    ),
    (
        "worker",
        "join a controller as a worker (for torchrun, SLURM, ...)",
        "torchrun --nproc-per-node=4 -m monarch_dsl worker --connect tcp:HOST:29600",
    ),
    (
        "build",
        "compile the C++ runtime for the installed torch now (else: on first use)",
        "monarch-dsl build",
    ),
    (
        "debug",
        "attach to the ranks stopped in breakpoint() of a running controller (as md.debug())",
        "monarch-dsl debug --pid 12345",
    ),
    (
        "plan",
        "print and check a compiled step's plan, for a mesh and example argument types",
        "monarch-dsl plan train.py:step --mesh dp=2 --arg f32[64,1024] --arg f32[64,1024]",
    ),
    (
        "simulate",
        "predict one call of a compiled step: time, communication, memory, a trace file",
        "monarch-dsl simulate train.py:step --mesh dp=2 --arg f32[64,1024] --profile h100",
    ),
    (
        "calibrate",
        'measure this machine into the "cpu-local" device profile (a minute or two); '
        '--device cuda: its GPU into "cuda-local"',
        "monarch-dsl calibrate --ranks 2,4",
    ),
    ("ls", "list your persistent meshes", "monarch-dsl ls"),
    (
        "attach",
        "attach to a persistent mesh: its actors, pinned tensors and log; -i for a Python prompt",
        "monarch-dsl attach exp -i",
    ),
    (
        "stop",
        "stop a persistent mesh (its workers, actors and pinned tensors)",
        "monarch-dsl stop exp",
    ),
    ("version", "print the version", "monarch-dsl version"),
]


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _ls(args: argparse.Namespace) -> int:
    from monarch_dsl.runtime import registry

    recs = registry.records()
    if not recs:
        print("no persistent meshes (spawn_procs(name=..., persistent=True) starts one)")
        return 0
    now = time.time()
    rows = [("NAME", "SHAPE", "KEEPER", "CONTROLLER", "AGE", "ENDS IF IDLE FOR", "LOG")]
    for r in recs:
        shape = ",".join(f"{d}={s}" for d, s in zip(r.dims, r.sizes))
        ctl = f"pid {r.controller}" if r.controller else f"none for {_age(now - r.since)}"
        rows.append(
            (r.name, shape, str(r.pid), ctl, _age(now - r.created), _age(r.idle_timeout), r.log)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def _attach_or_say(command: str, name: str):
    """md.attach(name), or None after printing why not."""
    import monarch_dsl as md

    try:
        return md.attach(name)
    except (md.AttachError, ValueError) as e:
        print(f"monarch-dsl {command}: {e}", file=sys.stderr)
        return None


def _describe_attached(pm) -> None:
    inv = pm._inventory()
    actors = sorted({(a[1], a[2][1]) for i in inv for a in i["actors"]})
    pinned = sorted({(n, tuple(v[0]), str(v[1])) for i in inv for n, v in i["pinned"].items()})
    print(f"attached to {pm.name!r}: {pm}")
    print("actors: " + (", ".join(f"{n} ({c})" for n, c in actors) or "none"))
    print("pinned: " + (", ".join(f"{n} {list(s)} {d}" for n, s, d in pinned) or "none"))


def _attach(args: argparse.Namespace) -> int:
    import monarch_dsl as md
    from monarch_dsl.runtime import registry

    pm = _attach_or_say("attach", args.name)
    if pm is None:
        return 1
    _describe_attached(pm)
    rec = registry.read(args.name)
    if rec is not None and args.log:
        try:
            with open(rec.log, errors="replace") as f:
                tail = f.read().splitlines()[-args.log :]
        except OSError:
            tail = []
        print(f"log ({rec.log}), last {len(tail)} lines:")
        for line in tail:
            print("  " + line)
    if args.interactive:
        import code

        import torch

        code.interact(
            banner="pm is the mesh; md, torch imported. Exit (Ctrl-D) detaches; pm.stop() ends it.",
            local={"pm": pm, "md": md, "torch": torch},
        )
    if not pm.stopped:
        pm.detach()
    return 0


def _stop(args: argparse.Namespace) -> int:

    pm = _attach_or_say("stop", args.name)
    if pm is None:
        return 1
    pm.stop()
    print(f"stopped persistent mesh {args.name!r}")
    return 0


def _epilog() -> str:
    width = max(len(name) for name, _, _ in COMMANDS)
    lines = ["commands:"]
    for name, text, example in COMMANDS:
        lines.append(f"  {name:<{width}}  {text}")
        lines.append(f"  {'':<{width}}    e.g. {example}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="monarch-dsl",
        description="Drive a mesh of processes (and their GPUs) from one Python program.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="one of the commands below"
    )
    helps = {name: text for name, text, _ in COMMANDS}
    r = sub.add_parser("run", description=helps["run"] + "; with --spmd: " + helps["run --spmd"])
    r.add_argument(
        "--spmd",
        action="store_true",
        help="run SCRIPT once per worker, as torchrun would (RANK, WORLD_SIZE, ... set)",
    )
    r.add_argument(
        "-n",
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="with --spmd: the number of ranks (default 1)",
    )
    r.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module name, run as python -m (and torchrun -m) run it",
    )
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=_run)
    w = sub.add_parser("worker", description=helps["worker"])
    w.add_argument("--connect", required=True, help="the controller's address, tcp:HOST:PORT")
    w.add_argument("--rank", type=int, default=None, help="this worker's rank (default: $RANK)")
    w.set_defaults(fn=_worker)
    b = sub.add_parser("build", description=helps["build"])
    b.set_defaults(fn=_build)
    d = sub.add_parser("debug", description=helps["debug"])
    d.add_argument(
        "--pid", type=int, default=None,
        help="the controller's pid (the table of stopped ranks names it; needed when several "
        "controllers have ranks stopped)",
    )  # fmt: skip
    d.set_defaults(fn=_debug)
    for name, fn in (("plan", _plan), ("simulate", _simulate)):
        c = sub.add_parser(name, description=helps[name])
        c.add_argument("target", metavar="FILE:FN", help="a file and its step function")
        c.add_argument("--mesh", default="dp=2", help="the mesh, e.g. dp=2,tp=2 (default dp=2)")
        c.add_argument(
            "--arg", action="append", default=[], metavar="TYPE",
            help="an example argument's type, e.g. f32[8,16]; once per tensor argument",
        )  # fmt: skip
        c.add_argument(
            "--data-parallel", default=None, metavar="DIM",
            help="for a plain function: shard its arguments over DIM (as mesh_fn's)",
        )  # fmt: skip
        if name == "simulate":
            c.add_argument("--profile", default=None, help="h100, h200, cpu-local or a JSON path")
            c.add_argument("--trace", default=None, metavar="PATH", help="write a trace JSON")
            c.add_argument("--png", default=None, metavar="PATH", help="draw the timeline")
            c.add_argument(
                "--width", type=int, default=72, help="terminal timeline cells (default 72)"
            )
            c.add_argument(
                "--measure", action="store_true",
                help="also run the call on local CPU worker processes (one per rank) and show "
                "what their C++ runtime recorded (step.timeline), beside the prediction",
            )  # fmt: skip
        c.set_defaults(fn=fn)
    k = sub.add_parser("calibrate", description=helps["calibrate"])
    k.add_argument(
        "--quick", action="store_true",
        help="small sizes and few repetitions: seconds, for a test (numbers less exact)",
    )  # fmt: skip
    k.add_argument(
        "--out", default=None, metavar="PATH",
        help="where to write the profile (default: cpu-local.json, or cuda-local.json with "
        "--device cuda, in $MONARCH_DSL_PROFILE_DIR, else in $XDG_CACHE_HOME/monarch_dsl/"
        "profiles, $XDG_CACHE_HOME being ~/.cache if unset)",
    )  # fmt: skip
    k.add_argument(
        "--ranks", default=None, metavar="N,M",
        help="group sizes to measure collectives at (default 2,4); compute runs on the first",
    )  # fmt: skip
    k.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"),
        help="cuda: this machine's GPU, on one CUDA worker, into profile \"cuda-local\" "
        "(compute and overheads; links: the built-in profile of that GPU)",
    )  # fmt: skip
    k.set_defaults(fn=_calibrate)
    ls = sub.add_parser("ls", description=helps["ls"])
    ls.set_defaults(fn=_ls)
    a = sub.add_parser("attach", description=helps["attach"])
    a.add_argument("name")
    a.add_argument(
        "-i", "--interactive", action="store_true",
        help="a Python prompt with the mesh as pm (exiting it detaches)",
    )  # fmt: skip
    a.add_argument("--log", type=int, default=20, metavar="N", help="log lines to show (20)")
    a.set_defaults(fn=_attach)
    st = sub.add_parser("stop", description=helps["stop"])
    st.add_argument("name")
    st.set_defaults(fn=_stop)
    v = sub.add_parser("version", description=helps["version"])
    v.set_defaults(fn=lambda _: print(__import__("monarch_dsl").__version__) or 0)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
