"""``monarch-dsl`` / ``python -m monarch_dsl``: the command line."""

from __future__ import annotations

import argparse
import os
import runpy
import sys


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
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    runpy.run_path(args.script, run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="monarch-dsl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="join a controller as a worker (for external launchers)")
    w.add_argument("--connect", required=True, help="the controller's address, tcp:HOST:PORT")
    w.add_argument("--rank", type=int, default=None, help="this worker's rank (default: $RANK)")
    w.set_defaults(fn=_worker)
    r = sub.add_parser("run", help="run a script (its meshes are local)")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=_run)
    v = sub.add_parser("version", help="print the version")
    v.set_defaults(fn=lambda _: print(__import__("monarch_dsl").__version__) or 0)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
