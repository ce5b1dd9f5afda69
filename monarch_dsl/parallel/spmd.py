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
stopped, bounded waits for exit reports after the signals. Ctrl-C in the controller is passed
on to the ranks as torchrun does (SIGINT: a script's ``except KeyboardInterrupt:`` runs), and
what still runs ``INTERRUPT_GRACE`` s later (or at a second Ctrl-C) is stopped as above,
before the KeyboardInterrupt propagates. The mesh stays usable after any of these.

``module=True`` (``monarch-dsl run --spmd -m pkg.train``) runs a module as ``python -m`` (and
``torchrun -m``) do: the working directory first on ``sys.path``, ``argv[0]`` the module's file;
a package runs its ``__main__``. The module is found on the controller (the working directory,
then its ``sys.path``) without importing it, so a misspelled name fails before any process
starts.

Meshes of remote hosts
----------------------
Workers an external launcher started (``md.remote_hosts``) have no fork server on this host.
There each worker starts its own rank's process, as torchrun's agent does, from a fork server
of its own: an ``_Agent`` actor on each worker starts one at the first run (a fresh
interpreter, through a small bootstrap that first asks the kernel to kill it when the worker
dies, ``PR_SET_PDEATHSIG``, and then execs it; it imports torch once, and kills its children
when its worker is gone), and has it fork the rank as the controller's fork server forks a
local one (``forkserver.run_script``: as ``python script ARGS``, ``-m`` for a module) -- so a
worker killed mid-run leaves no rank behind, and a second run starts its ranks in
milliseconds. The agent reports the rank's exit status and the end of its stderr, and
signals its process group when the run is stopped; the controller polls the agents every
``POLL`` s and applies the same rules as above (the first failure stops the others: SIGTERM,
SIGKILL after ``STOP_GRACE``). What differs:

- the script (or module) must exist on every host at the same path (``pm.sync_files`` copies
  it); where a host lacks it, no rank runs: ``FileNotFoundError`` naming the rank and the host
  is raised and the ranks already started are stopped;
- each rank's environment is its worker's environment (the launcher's on that host) less the
  launcher's own ``TORCHELASTIC_*`` variables and the job's token, with the variables above
  set (``OMP_NUM_THREADS=1`` only where the worker's has none); ``MASTER_ADDR`` is the
  address rank 0's worker connected from (its host name where that is loopback and the run
  spans hosts), and ``MASTER_PORT`` a port free on rank 0's host; ``GROUP_RANK`` /
  ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` count the run's ranks by host (the ``host``
  coordinate), as torchrun's; its memory limit is the one its worker started with, not the
  worker's budget;
- the output is prefixed with the worker's coordinates on its own host, where the workers of
  ``md.remote_hosts`` print (``pm.logging`` does not reach them);
- the first run on a mesh pays for each worker's fork server (a fresh interpreter and
  ``import torch``); one per worker process, not per host.

On both, a rank is a fork of an interpreter that has started: variables that Python or torch
read only at start-up (``PYTHONHASHSEED``, ``LD_PRELOAD``, ``PYTHONMALLOC``, ...) given in
``env=`` do not take effect, as they would in torchrun's fresh ranks.
"""

from __future__ import annotations

import collections
import errno
import os
import signal
import socket
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from monarch_dsl.actor import Actor, ValueMesh, endpoint
from monarch_dsl.errors import ActorError, SpmdError, SupervisionError
from monarch_dsl.mesh import coords_of_index
from monarch_dsl.runtime import controller, forkserver, logs, memory
from monarch_dsl.runtime.messages import ForkScripts

STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when stopping ranks
# seconds a Ctrl-C'd rank has to finish its `except KeyboardInterrupt:` (a checkpoint) before
# SIGTERM: torchrun's agent waits 30 s too; a second Ctrl-C stops the ranks at once
INTERRUPT_GRACE = 30.0
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
    if not job.pids:  # workers an external launcher started (md.remote_hosts)
        return _RemoteRun(job, pm, ranks, path, args, env, module).result(timeout)
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
    defaults = _launch_vars(MASTER_ADDR, env.get("MASTER_PORT") or str(free_port()))
    if n > 1 and "OMP_NUM_THREADS" not in base:
        defaults["OMP_NUM_THREADS"] = "1"  # as torchrun: n ranks share the cores
    return _per_rank({**base, **defaults, **env, "MONARCH_DSL_ROLE": "spmd"}, [list(range(n))])


def _launch_vars(addr: str, port: str) -> dict[str, str]:
    """What torchrun sets for every rank of a run, rendezvous at ``addr:port``."""
    return {
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
        "ROLE_NAME": "default",
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def _per_rank(common: dict[str, str], hosts: list[list[int]]) -> list[dict[str, str]]:
    """``common`` with each rank's variables, ``hosts`` the run's ranks grouped by host (in
    order): ``LOCAL_RANK`` and ``GROUP_RANK`` as torchrun numbers them."""
    n = sum(len(members) for members in hosts)
    out: list[dict[str, str]] = [{} for _ in range(n)]
    for g, members in enumerate(hosts):
        for local, i in enumerate(members):
            out[i] = dict(
                common,
                RANK=str(i),
                LOCAL_RANK=str(local),
                WORLD_SIZE=str(n),
                LOCAL_WORLD_SIZE=str(len(members)),
                GROUP_RANK=str(g),
                GROUP_WORLD_SIZE=str(len(hosts)),
                ROLE_RANK=str(i),
                ROLE_WORLD_SIZE=str(n),
            )
    return out


def _fork_with_pipes(
    server: forkserver.ForkServerClient, request: ForkScripts, n: int
) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """Fork the ``n`` ranks of ``request`` from ``server``, each with a pipe for its stdout
    and one for its stderr: (their pids, each rank's (stdout, stderr) read ends, the
    caller's to close). The write ends are closed here once the ranks hold them (ours would
    hide their EOF), and the read ends too where the fork fails. The one start of local
    runs (``_Run``) and a remote worker's rank (``_Agent.start``)."""
    reads: list[int] = []
    writes: list[int] = []
    try:
        for _ in range(2 * n):
            r, w = os.pipe()
            reads.append(r)
            writes.append(w)
        pids = server.fork(request, writes, FORK_TIMEOUT)
    except BaseException:
        for fd in reads:
            os.close(fd)
        raise
    finally:
        for fd in writes:
            os.close(fd)
    return pids, list(zip(reads[::2], reads[1::2]))


def _abandon(pids: Sequence[int], fds: list[int]) -> None:
    """After ranks were forked but could not be set up: kill them (each leads its process
    group, see forkserver.py; the fork server reaps them) and close the pipe ends ``fds``
    nobody took."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for fd in fds:
        os.close(fd)


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
        self.pids: tuple[int, ...] = ()
        self._start(args, env, module)
        self.started = time.monotonic()

    def _start(self, args: tuple[str, ...], env: dict[str, str], module: bool) -> None:
        """Fork the ranks from the fork server, their output forwarded here."""
        job, ranks, script = self.job, self.ranks, self.script
        self.out: list[Any] = []
        self.err: list[Any] = []
        envs = rank_envs(job.worker_env, env, len(ranks))
        server = forkserver.fork_server()
        request = ForkScripts(0, script, args, tuple(envs), tuple(sys.path), os.getcwd(), module)
        self.pids, pipes = _fork_with_pipes(server, request, len(ranks))
        left = [fd for pair in pipes for fd in pair]  # (not yet the forwarder's)
        try:
            for rank, (out_r, err_r) in zip(ranks, pipes):
                self.out.append(logs.forwarder().add(out_r, job.log_group, rank, is_err=False))
                left.remove(out_r)
                self.err.append(logs.forwarder().add(err_r, job.log_group, rank, is_err=True))
                left.remove(err_r)
        except BaseException:
            _abandon(self.pids, left)
            raise
        for i, pid in enumerate(self.pids):
            server.watch_exit(pid, lambda status, i=i: self._on_exit(i, status))

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

    def interrupt(self) -> None:
        """SIGINT every rank still running (a script's ``except KeyboardInterrupt:`` runs, as
        under torchrun's Ctrl-C), and wait up to INTERRUPT_GRACE s for them to exit."""
        running = self._running()
        with self._cond:
            self.signalled.update(running)
        if running:
            self._signal(running, signal.SIGINT)
            self._wait_exits(INTERRUPT_GRACE)

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
        except KeyboardInterrupt:  # Ctrl-C: passed on, as torchrun does; no rank outlives it
            try:
                self.interrupt()
            finally:
                self.stop()
            raise
        except BaseException:
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

    def _stderr_tail(self, i: int) -> str:
        return logs.forwarder().stderr_tail(self.err[i])

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
            stderr="" if first is None else self._stderr_tail(first),
            stopped=stopped,
            timed_out=timeout is not None,
        )


# ---------------------------------------------------------------------------- remote hosts
TAIL_LINES = 40  # the end of a remote rank's stderr kept for the error
BOOTSTRAP = (  # argv: the worker's pid, the RLIMIT_DATA it was started with, the command
    "import ctypes, os, resource, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):  # the worker died before that\n"
    "    os._exit(128 + signal.SIGKILL)\n"
    "hard = resource.getrlimit(resource.RLIMIT_DATA)[1]  # (not the worker's budget)\n"
    "resource.setrlimit(resource.RLIMIT_DATA, (int(sys.argv[2]), hard))\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n"
)
# The launcher's variables a rank must not inherit from its worker: torchrun gives its workers
# TORCHELASTIC_USE_AGENT_STORE=True (rank 0 would then wait for a store nobody serves) and
# others of its own run; run_spmd sets its own.
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")


def remote_rank_envs(
    job: controller.Job, ranks: list[int], mesh_env: Mapping[str, str], env: Mapping[str, str],
    master: tuple[str, int],
) -> list[dict[str, str]]:  # fmt: skip
    """The variables each rank of a run on remote hosts gets on top of its worker's own
    environment (see the module docstring; ``OMP_NUM_THREADS`` is the agent's, from its
    worker's environment)."""
    hosts: dict[Any, list[int]] = {}
    for i, r in enumerate(ranks):
        hosts.setdefault(job.coords(r).get("host", 0), []).append(i)
    defaults = _launch_vars(master[0], str(master[1]))
    common = {**mesh_env, **defaults, **env, "MONARCH_DSL_ROLE": "spmd"}
    return _per_rank(common, list(hosts.values()))


class _Agent(Actor):
    """On each worker of a mesh of remote hosts: starts, watches and stops its rank's process
    of a ``run_spmd`` run (see the module docstring), forked by a fork server of its own
    (started at the first run, a fresh interpreter through ``BOOTSTRAP``: it imports torch
    once). Its output is copied, line by line and prefixed with the worker's coordinates
    (``label``, as the controller prefixes a local rank's), to the worker's own stdout /
    stderr."""

    def __init__(self) -> None:
        self.runs: dict[str, _Rank] = {}

    @endpoint
    def master_port(self) -> int:
        return free_port("0.0.0.0")

    @endpoint
    def start(
        self,
        run: str,
        script: str,
        args: tuple[str, ...],
        env: dict[str, str],
        module: bool,
        label: str,
    ) -> int:
        if not module and not os.path.isfile(script):
            raise FileNotFoundError(
                errno.ENOENT,
                f"run_spmd: no such script file on host {socket.gethostname()} (copy it there "
                f"with pm.sync_files)",
                script,
            )
        full = _rank_base_env()
        if int(env.get("LOCAL_WORLD_SIZE", "1")) > 1:
            full.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: a host's ranks share its cores
        full.update(env)
        server = _worker_fork_server()
        request = ForkScripts(0, script, args, (full,), tuple(sys.path), os.getcwd(), module)
        (pid,), [(out_r, err_r)] = _fork_with_pipes(server, request, 1)
        rank = _Rank(pid)
        pipes = [os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")]  # each closed by its copier
        try:
            server.watch_exit(pid, rank.exited)
            for pipe, out, keep in zip(pipes, (sys.stdout, sys.stderr), (None, rank.tail)):
                t = threading.Thread(
                    target=_copy_lines,
                    args=(pipe, out, f"[{label}] ", keep),
                    name="md-spmd-output",
                    daemon=True,
                )
                t.start()
                rank.threads.append(t)
        except BaseException:
            _abandon((pid,), [])
            for pipe in pipes[len(rank.threads) :]:  # (a started copier closes its own at EOF)
                pipe.close()
            raise
        self.runs[run] = rank
        return pid

    @endpoint
    def poll(self, run: str) -> tuple[int | None, str]:
        """The rank's wait status (None while it runs) and, once it exited, its stderr's
        end (all of its output read first)."""
        rank = self.runs.get(run)
        if rank is None or not rank.done.is_set():
            return None, ""
        if rank.threads:  # (once: a descendant may hold the pipes open; not waited for again)
            for t in rank.threads:
                t.join(0.2)
            rank.threads.clear()
        # (-1: the fork server died, and the rank with it: killed by its PR_SET_PDEATHSIG)
        return rank.status if rank.status >= 0 else signal.SIGKILL, "".join(rank.tail)

    @endpoint
    def signal(self, run: str, sig: int) -> None:
        rank = self.runs.get(run)
        if rank is not None and not rank.done.is_set():
            try:
                os.killpg(rank.pid, sig)  # (it leads its process group: forkserver.py)
            except (ProcessLookupError, PermissionError):
                pass

    @endpoint
    def forget(self, run: str) -> None:
        rank = self.runs.pop(run, None)
        if rank is not None and not rank.done.wait(STOP_GRACE):  # (signalled or exited by now)
            try:
                os.killpg(rank.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


_server: forkserver.ForkServerClient | None = None  # this worker's (one for all its agents)
_server_lock = threading.Lock()
SERVER_START_TIMEOUT = 120.0  # a fresh interpreter importing torch, on a busy host


def _rank_base_env() -> dict[str, str]:
    """The worker's environment less the job's token and the launcher's own variables."""
    return {
        k: v
        for k, v in os.environ.items()
        if k != "MONARCH_DSL_TOKEN" and not k.startswith(LAUNCHER_PREFIXES)
    }


def _worker_fork_server() -> forkserver.ForkServerClient:
    """This worker's fork server for ``run_spmd`` ranks, started (again, if it died) here.
    (No cleanup at the worker's exit: workers end by ``os._exit``; the fork server then
    loses its channel and kills the ranks, and dies with the worker anyway: the bootstrap's
    ``PR_SET_PDEATHSIG``.)"""
    global _server
    with _server_lock:
        if _server is None or not _server.alive:
            limit = memory.inherited_data_limit()  # (the ranks': not the worker's budget)
            prefix = (sys.executable, "-c", BOOTSTRAP, str(os.getpid()), str(limit))
            _server = forkserver.ForkServerClient.start_fresh(
                prefix, SERVER_START_TIMEOUT, env=_rank_base_env()
            )
        return _server


class _Rank:
    """A rank's process on an agent's worker: its exit status (from the fork server, which
    reaps it), its stderr's end and the threads copying its output."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.status = -1
        self.done = threading.Event()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.threads: list[threading.Thread] = []

    def exited(self, status: int) -> None:
        self.status = status
        self.done.set()


def _copy_lines(pipe: Any, out: Any, label: str, keep: Any) -> None:
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace")
            if keep is not None:
                keep.append(line)
            try:
                out.write(label + line if line.endswith("\n") else label + line + "\n")
                out.flush()
            except (OSError, ValueError):  # the worker's own output is gone: keep reading
                pass


_agents: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = weakref.WeakKeyDictionary()
_agents_lock = threading.Lock()


def _agent(pm: Any) -> Any:
    """The ``_Agent`` actors on ``pm``'s workers (spawned once per job and ranks)."""
    with _agents_lock:
        per_job = _agents.setdefault(pm.job, {})
        agent = per_job.get(tuple(pm.ranks))
        if agent is None:
            agent = per_job[tuple(pm.ranks)] = pm.spawn(f"md-spmd-{uuid.uuid4().hex[:8]}", _Agent)
        return agent


def _master_addr(job: controller.Job, rank: int, ranks: list[int]) -> str:
    """The address rank ``rank``'s worker connected from (a TCP peer), else loopback; where
    that is a loopback address but the run's workers are on several hosts (rank 0's worker on
    the controller's host), rank 0's host name as its worker reported it."""
    conn = job.conns.get(rank)
    try:
        host = conn.sock.getpeername()[0] if conn is not None else MASTER_ADDR
    except (OSError, AttributeError, IndexError, TypeError):
        host = MASTER_ADDR
    if not isinstance(host, str) or not host:
        host = MASTER_ADDR
    names = {job.hellos[r].hostname for r in ranks if r in job.hellos}
    if host.startswith("127.") and len(names) > 1 and rank in job.hellos:
        return job.hellos[rank].hostname
    return host


class _RemoteRun(_Run):
    """A run on workers of remote hosts: each rank's process is started, polled and stopped
    by the ``_Agent`` on its worker."""

    def _start(self, args: tuple[str, ...], env: dict[str, str], module: bool) -> None:
        """Each agent starts its rank; then a thread polls them."""
        job, pm, ranks, script = self.job, self.pm, self.ranks, self.script
        self.tails: dict[int, str] = {}
        self.run_id = uuid.uuid4().hex
        self.agent = _agent(pm)
        port = env.get("MASTER_PORT")
        if port is None:
            port = self.agent.slice(**_point(pm, 0)).master_port.call_one().get(FORK_TIMEOUT)
        master = (env.get("MASTER_ADDR") or _master_addr(job, ranks[0], ranks), int(port))
        envs = remote_rank_envs(job, ranks, job.worker_env, env, master)
        self._done = threading.Event()
        try:
            started = [
                self.agent.slice(**_point(pm, i)).start.call_one(
                    self.run_id, script, args, envs[i], module, self.labels[i]
                )
                for i in range(len(ranks))
            ]
            pids = []
            for i, f in enumerate(started):
                try:
                    # (the first run also starts each worker's fork server)
                    pids.append(f.get(SERVER_START_TIMEOUT + FORK_TIMEOUT))
                except ActorError as e:  # the agent's own error, naming the rank (a missing
                    # script on its host): raised as itself, as a local run raises it
                    if isinstance(e.exception, OSError) and e.exception.errno is not None:
                        raise type(e.exception)(
                            e.exception.errno,
                            f"{e.exception.strerror} (rank {i}, {self.labels[i]})",
                            e.exception.filename,
                        ) from e
                    raise
            self.pids = tuple(pids)
        except BaseException:
            self._stop_started()
            raise
        self._poller = threading.Thread(target=self._poll, name="md-spmd-poll", daemon=True)
        self._poller.start()

    def _stop_started(self) -> None:
        """A start failed: stop the ranks that did start (each agent ignores a run it has not)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                self.agent.signal.call(self.run_id, sig).get(FORK_TIMEOUT)
            except Exception:  # noqa: BLE001 - a worker gone: nothing of this run is left there
                pass
        try:
            self.agent.forget.call(self.run_id).get(FORK_TIMEOUT)  # (and reap what started)
        except Exception:  # noqa: BLE001
            pass

    def _poll(self) -> None:
        """Every POLL s: each agent's rank's status (``_poll_once``), until all exited."""
        while not self._done.is_set():
            if self._poll_once():
                return
            self._done.wait(POLL)

    def _poll_once(self) -> bool:
        """Each agent's rank's status, recorded; whether all ranks have ended. A rank whose
        worker died is gone with it (its process was killed with the worker: the bootstrap's
        PR_SET_PDEATHSIG), with no status (the run's error is the worker's); the others are
        asked one by one from then on."""
        dead = [i for i in range(len(self.ranks)) if self._gone(i)]
        try:
            if not dead:
                replies = list(self.agent.poll.call(self.run_id).get(FORK_TIMEOUT).values())
            else:
                replies = [
                    (None, "")
                    if i in self.status or i in dead
                    else self.agent.slice(**_point(self.pm, i))
                    .poll.call_one(self.run_id)
                    .get(FORK_TIMEOUT)
                    for i in range(len(self.ranks))
                ]
        except Exception:  # noqa: BLE001 - a worker died meanwhile: see it next round
            replies = [(None, "")] * len(self.ranks)
        for i, (status, tail) in enumerate(replies):
            if status is not None and i not in self.status:
                self.tails[i] = tail
                self._on_exit(i, status)
        with self._cond:
            return self._all_ended()

    def stop(self) -> None:
        """As a local run's, after one more poll: a rank that exited since the last one (a
        second failure, moments after the first) is reported as it ended, not as stopped."""
        self._poll_once()
        super().stop()

    def _gone(self, i: int) -> bool:
        """Its worker died, or the mesh is being stopped (which ends the ranks with it)."""
        job = self.job
        return job.stopping or job.stopped or self.ranks[i] in job.dead

    def _all_ended(self) -> bool:
        return all(i in self.status or self._gone(i) for i in range(len(self.pids)))

    def _running(self) -> list[int]:
        with self._cond:
            return [i for i in range(len(self.pids)) if i not in self.status and not self._gone(i)]

    def _wait_exits(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(self._all_ended, timeout)

    def _signal(self, ranks: list[int], sig: int) -> None:
        for i in ranks:
            try:
                self.agent.slice(**_point(self.pm, i)).signal.call_one(self.run_id, sig).get(
                    FORK_TIMEOUT
                )
            except Exception:  # noqa: BLE001 - its worker is gone, and the rank with it
                pass

    def result(self, timeout: float | None) -> ValueMesh:
        try:
            return super().result(timeout)
        finally:
            self._done.set()
            try:
                self.agent.forget.call(self.run_id).get(FORK_TIMEOUT)
            except Exception:  # noqa: BLE001 - a dead worker forgets on its own
                pass

    def describe(self, i: int) -> str:
        return f"rank {i} ({self.labels[i]}, pid {self.pids[i]} on its host)"

    def _stderr_tail(self, i: int) -> str:
        return self.tails.get(i, "")


def _point(pm: Any, i: int) -> dict[str, int]:
    """The coordinates of ``pm``'s ``i``-th worker, row-major, as ``slice`` takes them."""
    return dict(zip(pm.sizes, coords_of_index(i, tuple(pm.sizes.values()))))
