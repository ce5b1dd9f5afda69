"""``pm.run_spmd(script, *args)``: an unchanged ``torchrun`` script on every worker of a mesh
(SPEC §6). ``monarch-dsl run --spmd -n N script.py ARGS`` is this on a new local mesh.

Where the script runs
---------------------
Each rank of a run is a process of its own, forked for that run by the controller's fork server
(``runtime/forkserver.py``) -- neither the worker itself nor a child of the worker:

- *Not in the worker.* A torchrun script owns its process: it calls ``init_process_group`` and
  ``destroy_process_group``, ``sys.exit``, leaves threads, CUDA contexts and module state
  behind. And when one rank dies, the others sit inside a gloo/NCCL collective that only a
  signal interrupts -- and signalling a worker would take the mesh down. A process per rank
  per run can be stopped by signal (its whole process group: what it started, too) while the
  workers, their actors and tensors stay as they were.
- *Not forked from the worker.* By the time of a run a worker has started threads (executor
  streams, gloo, an OpenMP pool after its first tensor op) and, on a GPU host, asked CUDA for
  its devices: a fork of it could hang in its first parallel op or be refused CUDA.
- *Forked from the fork server.* It has imported torch, is single-threaded, has never run an
  OpenMP region nor touched CUDA (it proves this before serving), and already forks every
  worker, reports each child's exit status, and kills its children if the controller dies. So
  a rank starts in milliseconds without ``import torch``, on the first run as on every later
  one: the one-time cost is the mesh's start. ``forkserver.run_script`` makes the fork look like
  a fresh ``python script.py ARGS`` (signals, atexit, logging, random state, thread count).

What a rank sees
----------------
Rank ``i`` of a run is the ``i``-th worker of the (possibly sliced) mesh, row-major; its output
is prefixed with that worker's coordinates, like the worker's own output. Its environment is the
controller's environment now (as torchrun's children get the launching shell's), then the env
the mesh was spawned with, then torchrun's variables -- ``MASTER_ADDR`` (loopback: every rank of
a local mesh is on this host), ``MASTER_PORT`` (a free port per run), ``OMP_NUM_THREADS=1`` when
unset and more than one rank, ``ROLE_NAME``, ``TORCHELASTIC_RUN_ID``/``_RESTART_COUNT``/
``_MAX_RESTARTS`` -- then ``env=`` (which may override those), then the per-rank ones it may
not: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``. ``LOCAL_RANK == RANK`` (one host), so a
whole mesh's rank ``i`` picks the GPU its worker uses. Not set: ``TORCHELASTIC_USE_AGENT_STORE``
(there is no agent; rank 0 hosts the store, as with ``torch.distributed.launch``) and
``TORCHELASTIC_ERROR_FILE``.

Failure and stopping
--------------------
When a rank exits non-zero or is killed, the others get SIGTERM -- whose default action ends a
process even inside a C++ collective -- and SIGKILL after ``STOP_GRACE`` s (a Python SIGTERM
handler only runs between bytecodes, never inside a collective), both to the rank's process
group; then ``md.SpmdError`` names the first failed rank, its exit code or signal and the end of
its stderr. Nothing waits unbounded: the run's ``timeout`` (the same stop, then ``SpmdError``
with ``timed_out``), a poll every ``POLL`` s that notices a worker of the mesh dying (the run is
stopped and its ``md.SupervisionError`` raised, as for any call on the mesh) or the mesh being
stopped, bounded waits for exit reports after the signals. Ctrl-C in the controller stops the
ranks before it propagates. The mesh stays usable after any of these.

``module=True`` (``monarch-dsl run --spmd -m pkg.train``) runs a module as ``python -m`` (and
``torchrun -m``) do: the working directory first on ``sys.path``, ``argv[0]`` the module's file;
a package runs its ``__main__``. The module is found on the controller (the working directory,
then its ``sys.path``) without importing it, so a misspelled name fails before any process
starts.

Not yet: meshes of remote hosts (their workers have no fork server on this host; a per-host fork
server started by ``monarch-dsl worker`` would take the same ``ForkScripts`` request).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from monarch_dsl.actor import ValueMesh
from monarch_dsl.errors import SpmdError, SupervisionError
from monarch_dsl.runtime import controller, forkserver, logs
from monarch_dsl.runtime.messages import ForkScripts

STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when stopping ranks
KILL_WAIT = 10.0  # after SIGKILL: the longest wait for the fork server to report the exits
FORK_TIMEOUT = 60.0
POLL = 0.05  # how often a waiting run looks at the mesh's workers
MASTER_ADDR = "127.0.0.1"

# Set for each rank; env= may not name them.
PER_RANK_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
)


def run_spmd(
    pm: Any,
    script: str | os.PathLike,
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    module: bool = False,
) -> ValueMesh:
    """Run ``script`` with ``args`` once per worker of ``pm`` (a ProcMesh); see the module
    docstring. Returns each rank's exit code (all 0) as a ValueMesh shaped like ``pm``."""
    path, args, env = check_arguments(script, args, env, timeout, module)
    job = pm.job
    ranks = pm.ranks
    job.check_alive(ranks)
    if not job.pids:
        raise NotImplementedError(
            "run_spmd runs scripts on meshes of this host (md.this_host().spawn_procs); the "
            "workers of remote_hosts() have no fork server here: start the script there with "
            "torchrun"
        )
    return _Run(job, pm, ranks, path, args, env, module).result(timeout)


def check_arguments(
    script: Any, args: Sequence[Any], env: Any, timeout: Any, module: bool = False
) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """Everything is checked here, before any process is started."""
    if module:
        path = _check_module(script)
    else:
        if not isinstance(script, (str, os.PathLike)) or not isinstance(os.fspath(script), str):
            raise TypeError(f"run_spmd: script must be a path (str), got {type(script).__name__}")
        path = os.path.abspath(os.fspath(script))
        if not os.path.isfile(path):
            raise FileNotFoundError(errno.ENOENT, "run_spmd: no such script file", path)
    for a in args:
        if not isinstance(a, str):
            raise TypeError(
                f"run_spmd: the script's arguments are strings, as on a command line; got "
                f"{type(a).__name__} {a!r} (pass str({a!r}))"
            )
    if env is None:
        env = {}
    if not isinstance(env, Mapping):
        raise TypeError(f"run_spmd: env must be a dict of str to str, got {type(env).__name__}")
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"run_spmd: env must map str to str, got {k!r}: {v!r}")
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise ValueError(f"run_spmd: {k!r}={v!r} is not a valid environment variable")
        if k in PER_RANK_VARS:
            raise ValueError(f"run_spmd: env sets {k}, which run_spmd sets for each rank")
    port = env.get("MASTER_PORT")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"run_spmd: MASTER_PORT must be a port number, got {port!r}")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
    ):
        raise ValueError(f"run_spmd: timeout must be a positive number of seconds, got {timeout!r}")
    return path, tuple(args), dict(env)


def _check_module(name: Any) -> str:
    """``name`` if it is a module ``python -m`` would find from here: a file ``a/b.py`` or a
    package ``a/b/`` with ``__main__.py`` under the working directory or a ``sys.path`` entry.
    Found by looking, not importing: nothing of the user's runs in the controller."""
    if not isinstance(name, str) or not all(p.isidentifier() for p in name.split(".")):
        raise ValueError(f"run_spmd: module must be a dotted module name, got {name!r}")
    rel = os.path.join(*name.split("."))
    for base in [os.getcwd(), *(p for p in sys.path if p)]:
        if os.path.isfile(os.path.join(base, rel + ".py")) or os.path.isfile(
            os.path.join(base, rel, "__main__.py")
        ):
            return name
    raise ModuleNotFoundError(
        f"run_spmd: no module named {name!r} (looked for {rel}.py or {rel}/__main__.py under "
        f"the working directory and sys.path)",
        name=name,
    )


def free_port(host: str = MASTER_ADDR) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_envs(mesh_env: Mapping[str, str], env: Mapping[str, str], n: int) -> list[dict[str, str]]:
    """The whole environment of each of ``n`` ranks (see the module docstring)."""
    base = {**os.environ, **mesh_env}
    defaults = {
        "MASTER_ADDR": MASTER_ADDR,
        "MASTER_PORT": env.get("MASTER_PORT") or str(free_port()),
        "ROLE_NAME": "default",
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }
    if n > 1 and "OMP_NUM_THREADS" not in base:
        defaults["OMP_NUM_THREADS"] = "1"  # as torchrun: n ranks share the cores
    common = {**base, **defaults, **env, "MONARCH_DSL_ROLE": "spmd"}
    return [
        dict(
            common,
            RANK=str(i),
            LOCAL_RANK=str(i),
            WORLD_SIZE=str(n),
            LOCAL_WORLD_SIZE=str(n),
            GROUP_RANK="0",
            GROUP_WORLD_SIZE="1",
            ROLE_RANK=str(i),
            ROLE_WORLD_SIZE=str(n),
        )
        for i in range(n)
    ]


def returncode(status: int | None) -> int | None:
    """``subprocess``'s convention: the exit code, or minus the signal that killed it."""
    return None if status is None else os.waitstatus_to_exitcode(status)


class _Run:
    """One run: its processes, their exit statuses and output pipes."""

    def __init__(
        self,
        job: controller.Job,
        pm: Any,
        ranks: list[int],
        script: str,
        args: tuple[str, ...],
        env: dict[str, str],
        module: bool = False,
    ):
        self.job, self.pm, self.ranks, self.script = job, pm, ranks, script
        self.labels = [job.log_group.label([r]) for r in ranks]
        self._cond = threading.Condition()
        self.status: dict[int, int | None] = {}  # run rank -> wait status, in order of exit
        self.signalled: set[int] = set()  # ranks we stopped (their exit is no failure)
        self.out: list[Any] = []
        self.err: list[Any] = []
        envs = rank_envs(job.worker_env, env, len(ranks))
        server = forkserver.fork_server()
        fds: list[int] = []
        try:
            for rank in ranks:
                out_r, out_w = os.pipe()
                fds.append(out_w)
                self.out.append(logs.forwarder().add(out_r, job.log_group, rank, is_err=False))
                err_r, err_w = os.pipe()
                fds.append(err_w)
                self.err.append(logs.forwarder().add(err_r, job.log_group, rank, is_err=True))
            request = ForkScripts(
                0, script, args, tuple(envs), tuple(sys.path), os.getcwd(), module
            )
            self.pids: tuple[int, ...] = server.fork(request, fds, FORK_TIMEOUT)
        finally:
            for fd in fds:  # the children hold them now; our copies would hide their EOF
                os.close(fd)
        for i, pid in enumerate(self.pids):
            server.watch_exit(pid, lambda status, i=i: self._on_exit(i, status))
        self.started = time.monotonic()

    # ------------------------------------------------------------------ events
    def _on_exit(self, i: int, status: int) -> None:
        """From the fork server's reader thread (status -1: the fork server died)."""
        with self._cond:
            self.status[i] = None if status < 0 else status
            self._cond.notify_all()

    def _failed(self, i: int) -> bool:
        return i not in self.signalled and returncode(self.status[i]) != 0

    def _mesh_broken(self) -> bool:
        job = self.job
        return job.stopping or job.stopped or any(r in job.dead for r in self.ranks)

    def wait(self, timeout: float | None) -> str:
        """Until every rank exited ("done"), one failed ("failed"), a worker of the mesh died
        or the mesh was stopped ("mesh"), or ``timeout`` passed ("timeout")."""
        deadline = None if timeout is None else self.started + timeout
        with self._cond:
            while True:
                if any(self._failed(i) for i in self.status):
                    return "failed"
                if len(self.status) == len(self.pids):
                    return "done"
                if self._mesh_broken():
                    return "mesh"
                wait = POLL
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return "timeout"
                    wait = min(wait, left)
                self._cond.wait(wait)

    def _running(self) -> list[int]:
        with self._cond:
            return [i for i in range(len(self.pids)) if i not in self.status]

    def _wait_exits(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: len(self.status) == len(self.pids), timeout)

    def _signal(self, ranks: list[int], sig: int) -> None:
        for i in ranks:
            pid = self.pids[i]
            try:
                os.killpg(pid, sig)  # the rank leads its process group (forkserver.py)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def stop(self) -> None:
        """SIGTERM every rank still running, SIGKILL after STOP_GRACE s."""
        with self._cond:
            running = [i for i in range(len(self.pids)) if i not in self.status]
            self.signalled.update(running)
        if not running:
            return
        self._signal(running, signal.SIGTERM)
        self._wait_exits(STOP_GRACE)
        running = self._running()
        if running:
            self._signal(running, signal.SIGKILL)
            self._wait_exits(KILL_WAIT)

    # ------------------------------------------------------------------ result
    def result(self, timeout: float | None) -> ValueMesh:
        try:
            why = self.wait(timeout)
        except BaseException:  # Ctrl-C: no rank outlives the call
            self.stop()
            raise
        if why != "done":
            self.stop()
        logs.forwarder().flush(self.job.log_group)  # everything they printed, before we return
        if why == "mesh":
            dead = [r for r in self.ranks if r in self.job.dead]
            if dead:
                raise self.job.dead[dead[0]]
            raise SupervisionError("the process mesh was stopped during run_spmd")
        with self._cond:
            failed = [i for i in self.status if self._failed(i)]
            stopped = sorted(i for i in self.signalled)
        if failed or why == "timeout":
            raise self._error(failed, stopped, timeout if why == "timeout" else None)
        return ValueMesh(self.pm, [returncode(self.status[i]) for i in range(len(self.pids))])

    def describe(self, i: int) -> str:
        return f"rank {i} ({self.labels[i]}, pid {self.pids[i]})"

    def _error(self, failed: list[int], stopped: list[int], timeout: float | None) -> SpmdError:
        name = os.path.basename(self.script)
        what = f"timed out after {timeout} s" if timeout is not None else ""
        if failed:
            what = "; ".join(
                [f"{self.describe(i)} {forkserver.describe_status(self.status[i])}" for i in failed]
                + ([what] if what else [])
            )
        if stopped:
            what += f"; stopped rank{'s' if len(stopped) > 1 else ''} " + ", ".join(
                map(str, stopped)
            )
        first = failed[0] if failed else None
        return SpmdError(
            f"run_spmd({name}): {what}",
            failures={i: returncode(self.status[i]) for i in failed},
            rank=first,
            coords=None if first is None else self.job.coords(self.ranks[first]),
            returncode=None if first is None else returncode(self.status[first]),
            stderr="" if first is None else logs.forwarder().stderr_tail(self.err[first]),
            stopped=stopped,
            timed_out=timeout is not None,
        )
