"""Process meshes: ``md.this_host().spawn_procs({"gpu": 4})`` and ``md.remote_hosts(...)``."""

from __future__ import annotations

import atexit
import math
import numbers
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from monarch_dsl import _build
from monarch_dsl import actor as _actor
from monarch_dsl import persistent as _persistent
from monarch_dsl.errors import AttachError
from monarch_dsl.mesh import Mesh
from monarch_dsl.parallel import spmd as _spmd
from monarch_dsl.runtime import (
    codesync,
    controller,
    forkserver,
    logs,
    memory,
    registry,
    serialize,
    transport,
)
from monarch_dsl.runtime.messages import Inventory
from monarch_dsl.tensor import activation as _activation

DEFAULT_TIMEOUT = 120.0
DEFAULT_IDLE_TIMEOUT = 3600.0  # a persistent mesh with no controller for this long ends
STOP_SYNC_TIMEOUT = 60.0  # stop() waits this long for the workers to finish their commands

atexit.register(controller.stop_all)


class ProcMesh(Mesh):
    """A mesh of worker processes. Every mesh operation (rename, split, slice, flatten) gives a
    ProcMesh over the same processes; ``stop()`` ends them all."""

    _job: controller.Job

    @property
    def job(self) -> controller.Job:
        """The controller's allocation these processes belong to (``runtime/controller.py``),
        for the layers built on process meshes (the tensor engine, actors, parallel)."""
        return self._job

    def _derive(self, dims: tuple[str, ...], ranks: np.ndarray) -> ProcMesh:
        pm = ProcMesh._from_array(dims, ranks)
        pm._job = self._job
        return pm

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> _actor.ActorMesh:
        """Create an instance of ``cls`` (an ``md.Actor``) in every process of this mesh; waits
        until every constructor has run (raises ``md.ActorError`` if one raised)."""
        return _actor.spawn(self, name, cls, args, kwargs)

    def stop(self) -> None:
        """Stop every worker of the allocation this mesh belongs to (slices included).

        Raises ``md.RemoteError`` for a failed tensor command whose error nobody fetched."""
        job = self._job
        unseen = []
        if job.before_stop and not job.stopped:
            for finish in list(job.before_stop):
                try:  # let the workers finish what was sent, and report its failures
                    finish(STOP_SYNC_TIMEOUT)
                except Exception:  # noqa: BLE001 - a dead or stuck worker: stop anyway
                    pass
            unseen = job.unobserved_failures()
        job.stop()
        if unseen:
            raise job.remote_error(unseen[0], observed=True)

    # ---- persistent meshes ---------------------------------------------------------------
    @property
    def name(self) -> str | None:
        """The name of a persistent mesh (``spawn_procs(name=..., persistent=True)``)."""
        return self._job.name

    def detach(self) -> None:
        """Leave this persistent mesh running without this controller (what exiting does):
        what was sent is finished first; the workers keep their actors and pinned tensors and
        wait for ``md.attach(name)``. Every handle of this controller on it is then dead."""
        job = self._job
        if job.keeper is None:
            raise RuntimeError("only a persistent mesh (spawn_procs(persistent=True)) detaches")
        for finish in list(job.before_stop):
            finish(STOP_SYNC_TIMEOUT)
        job.detach()

    def _inventory(self) -> list[dict]:
        """What the live workers of this mesh hold beyond a controller (messages.Inventory)."""
        ranks = tuple(int(r) for r in self.ranks if int(r) not in self._job.dead)
        fut = self._job.request(ranks, lambda call_id: Inventory(call_id), finish=list)
        return fut.get(DEFAULT_TIMEOUT)

    def actors(self, name: str) -> _actor.ActorMesh:
        """The actor mesh spawned under ``name`` on these processes (by this controller or, on
        a persistent mesh, an earlier one), with its state; the latest if several were."""
        found: dict[int, tuple] = {}
        names: set[str] = set()
        for inv in self._inventory():
            for actor_id, actor_name, where, dims, sizes, ranks in inv["actors"]:
                names.add(actor_name)
                if actor_name == name:
                    found[actor_id] = (where, dims, sizes, ranks)
        if not found:
            raise KeyError(
                f"no actor named {name!r} on {self} (actors here: {sorted(names) or 'none'})"
            )
        actor_id = max(found)
        (module, qualname, payload), dims, sizes, ranks = found[actor_id]
        try:
            cls = serialize.loads(payload)
        except Exception as e:  # noqa: BLE001 - whatever unpickling raises: say what to do
            raise ImportError(
                f"actor {name!r} is a {module}.{qualname}, which this process cannot load "
                f"({type(e).__name__}: {e}); make its module importable here (sys.path)"
            ) from None
        procs = self._derive(tuple(dims), np.array(ranks).reshape(sizes))
        return _actor.ActorMesh(cls, name, actor_id, procs, procs)

    def pinned(self, name: str) -> Any:
        """The mesh tensor pinned as ``name`` (``md.pin``) on these processes."""
        info = None
        names: set[str] = set()
        for inv in self._inventory():
            names.update(inv["pinned"])
            info = info or inv["pinned"].get(name)
        if info is None:
            raise KeyError(
                f"no tensor pinned as {name!r} on {self} (pinned: {sorted(names) or 'none'})"
            )
        shape, dtype, dims, sizes, ranks = info
        mesh = self._derive(tuple(dims), np.array(ranks).reshape(sizes))
        with mesh.activate():
            return _persistent.loader(tuple(shape), dtype)(name)

    def run_spmd(
        self,
        script: str | os.PathLike,
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        module: bool = False,
    ) -> _actor.ValueMesh:
        """Run an unchanged ``torchrun`` script on every worker of this mesh: rank ``i`` is
        the ``i``-th worker, row-major, with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
        ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (``env`` adds variables),
        its output prefixed by the worker's coordinates. Returns each rank's exit code (0) as
        a ValueMesh. A rank that exits non-zero or is killed stops the others and raises
        ``md.SpmdError`` naming it; so does ``timeout`` (seconds). ``module=True``: ``script``
        is a module name, run as ``python -m`` runs it. The mesh outlives the run: each rank is
        forked from the fork server, which has imported torch already."""
        return _spmd.run_spmd(self, script, args, env, timeout, module)

    def sync_code(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> codesync.CodeSync:
        """Send the workers of this mesh the local Python modules that changed since they
        last got them, and reload those: actors and ``@md.remote`` functions defined there run
        the new code from their next call, without restarting the workers. Local modules: the
        ones this process imported from files under ``paths`` (default: the script's
        directory, or the cwd in a REPL). Raises ``md.CodeSyncError`` for a module that does
        not compile (nothing is sent) or whose reload raised on a worker (which keeps its old
        code). Returns what was sent and reloaded (``print`` it). See runtime/codesync.py."""
        return codesync.sync_code(self._job, tuple(self.ranks), paths, timeout)

    def sync_files(
        self, src: str | os.PathLike, dst: str | os.PathLike, *, timeout: float = DEFAULT_TIMEOUT
    ) -> codesync.FileSync:
        """Copy the file or directory tree ``src`` to ``dst`` on every host of this mesh (a
        relative ``dst``: relative to the workers' cwd), only the files missing or different
        there. Returns how many files and bytes were written."""
        return codesync.sync_files(self._job, tuple(self.ranks), src, dst, timeout)

    def logging(self, *, aggregate_window: float | None) -> None:
        """How the workers' output reaches this terminal (each line prefixed by its rank's
        coordinates). ``aggregate_window=1.0``: the same line printed by several ranks within
        1 s of the first is printed once, with the ranks that printed it (``[gpu=0-3] loss
        1.23``, ``[host=0-1,gpu=0-3] ...``, ``[gpu=0,2] ...``); lines that differ, or come
        later, are printed apart, in the order they first came; stdout and stderr stay apart.
        A line waits at most the window (less once every rank has printed it). ``0`` or
        ``None``: each line as it comes (the default). What is held is printed when the
        window changes, a worker dies, the mesh stops, and at exit.

        It applies to every process of the allocation this mesh belongs to (slices
        included, ``run_spmd`` on them too); workers started by an external launcher
        (``md.remote_hosts``) print on their own hosts. See runtime/logs.py."""
        window = 0.0 if aggregate_window is None else aggregate_window
        if (
            isinstance(window, bool)
            or not isinstance(window, numbers.Real)
            or not math.isfinite(window)
            or window < 0
        ):
            raise ValueError(
                f"aggregate_window must be seconds >= 0 (0 or None: off), got {aggregate_window!r}"
            )
        logs.forwarder().set_window(self._job.log_group, float(window))

    def activate(self):
        """``with pm.activate():`` torch calls create and run on every rank of this mesh."""
        return _activation.activate(self)

    def rank(self, dims: Any = ()) -> Any:
        """Under activation: a mesh tensor holding each rank's coordinate along ``dims``
        (several dims combine row-major)."""
        return _activation.mesh_rank(self, dims)

    @property
    def stopped(self) -> bool:
        return self._job.stopped

    def __enter__(self) -> ProcMesh:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ProcMesh({str(self)!r})"


def _check_shape(per_host: Mapping[str, int], what: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if not isinstance(per_host, Mapping) or not per_host:
        raise TypeError(f"{what} takes a non-empty dict of dim name -> size, got {per_host!r}")
    mesh = Mesh(dict(per_host))  # validates names and sizes
    return mesh.dims, tuple(mesh.sizes.values())


def _progress_printer(label: str, quiet: bool) -> Callable[[int, int], None]:
    start = time.monotonic()
    tty = sys.stderr.isatty()
    state = {"last": -1}

    def progress(ready: int, total: int) -> None:
        if quiet or ready == state["last"]:
            return
        state["last"] = ready
        elapsed = time.monotonic() - start
        if ready == total:
            end = "\n"
            text = f"monarch_dsl: {label}: {total}/{total} workers ready in {elapsed:.2f} s"
        elif tty:
            end = ""
            text = f"monarch_dsl: {label}: {ready}/{total} workers ready..."
        else:
            return
        sys.stderr.write(("\r" if tty else "") + text + end)
        sys.stderr.flush()

    return progress


def _quiet() -> bool:
    return os.environ.get("MONARCH_DSL_QUIET", "0") not in ("", "0")


class LocalHost:
    """This machine: ``spawn_procs`` starts worker processes here."""

    def spawn_procs(
        self,
        per_host: Mapping[str, int] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        setup: Callable[[], Any] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        name: str | None = None,
        persistent: bool = False,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        memory_limit: int | None = None,
    ) -> ProcMesh:
        """Start one worker process per rank of ``per_host`` (e.g. ``{"gpu": 4}``, or
        ``{"host": 2, "gpu": 4}`` to fake 2 hosts). ``env`` is added to each worker's
        environment; ``setup()`` runs in each worker before it joins (a raise there is reported
        as ``md.SpawnError`` with the worker's stderr).

        ``memory_limit``: each CPU worker's memory budget in bytes, beyond what it maps when it
        starts (an allocation past it fails, as ``md.RemoteError`` or ``md.ActorError``, instead
        of getting the worker killed by the OS); default: this host's available memory now,
        divided among the mesh's workers (``$MONARCH_DSL_MEMORY_LIMIT`` where set); ``0``: no
        budget. CUDA workers have none (see runtime/memory.py).

        ``persistent=True`` (with a ``name``): the workers, their actors and pinned tensors
        outlive this controller -- exiting (or crashing, or ``pm.detach()``) leaves them to
        ``md.attach(name)`` from another process -- until ``idle_timeout`` seconds pass with
        no controller attached, or ``pm.stop()``. Its workers come from a keeper of their own
        (a fresh interpreter: seconds, where other meshes take milliseconds)."""
        dims, sizes = _check_shape(per_host if per_host is not None else {"gpu": 1}, "spawn_procs")
        if not isinstance(persistent, bool):
            raise TypeError(f"persistent must be a bool, got {persistent!r}")
        if persistent:
            if name is None:
                raise ValueError("a persistent mesh needs a name: spawn_procs(name=..., ...)")
            registry.check_name(name)
            if isinstance(idle_timeout, bool) or not isinstance(idle_timeout, (int, float)):
                raise TypeError(f"idle_timeout must be seconds, got {idle_timeout!r}")
            if not idle_timeout > 0:
                raise ValueError(f"idle_timeout must be > 0, got {idle_timeout}")
            old = registry.read(name)
            if old is not None and old.alive():
                raise ValueError(
                    f"a persistent mesh named {name!r} is running (keeper pid {old.pid}): "
                    f"md.attach({name!r}) joins it, `monarch-dsl stop {name}` ends it"
                )
        elif name is not None:
            raise ValueError("name= names a persistent mesh: pass persistent=True too")
        if env is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise TypeError("env must map str to str")
        if setup is not None and not callable(setup):
            raise TypeError(f"setup must be callable, got {type(setup).__name__}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        memory_limit = memory.check_limit(memory_limit)
        setup_bytes = None
        if setup is not None:
            payload, buffers = serialize.dumps(setup)
            if buffers:
                raise TypeError("setup must not close over tensors")
            setup_bytes = payload
        env = dict(env or {})
        # The budget is resolved here, once: every worker of the mesh gets the same share.
        env[memory.ENV] = str(memory.resolve(memory_limit, env, math.prod(sizes)))
        if env.get("MD_EXECUTOR", os.environ.get("MD_EXECUTOR", "cpp")) != "python":
            # Built here, once, before any worker starts (workers only load it). Without it
            # (no compiler, ...) ensure() says why and how to fix it, and workers run Python.
            if _build.ensure() is None:
                env["MD_EXECUTOR"] = "python"
        label = ",".join(f"{d}={s}" for d, s in zip(dims, sizes))
        job = controller.Job(dims, sizes, token=transport.new_token())
        controller.register(job)
        local = sizes[-1] if dims[0] == "host" and len(dims) > 1 else job.world
        progress = _progress_printer(label, _quiet())
        try:
            if persistent:
                assert name is not None
                job.start_persistent(name, idle_timeout, local, env, setup_bytes, timeout, progress)
            else:
                job.start_local(local, env, setup_bytes, timeout, progress)
        except BaseException:
            job.stop()
            raise
        return _root(job)

    def __repr__(self) -> str:
        return "LocalHost()"


def _root(job: controller.Job) -> ProcMesh:
    pm = ProcMesh._from_array(job.dims, np.arange(job.world).reshape(job.sizes))
    pm._job = job
    return pm


_this_host = LocalHost()


def attach(name: str, *, timeout: float = DEFAULT_TIMEOUT) -> ProcMesh:
    """The persistent mesh ``name`` (``spawn_procs(name=name, persistent=True)``), from any
    process of the same user: its workers connect to this controller, with their actors
    (``pm.actors(name)``) and pinned tensors (``pm.pinned(name)``); no process starts. One
    controller at a time: attaching to a mesh another controller holds raises
    ``md.AttachError`` (detach or stop it there first)."""
    registry.check_name(name)
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    rec = registry.read(name)
    if rec is None or not rec.alive():
        if rec is not None:
            registry.remove(name)
        running = ", ".join(r.name for r in registry.records()) or "none"
        raise AttachError(
            f"no persistent mesh named {name!r} is running (running: {running}; "
            f"`monarch-dsl ls` lists them)"
        )
    job = controller.Job(tuple(rec.dims), tuple(rec.sizes), token=bytes.fromhex(rec.secret))
    controller.register(job)
    try:
        keeper, attached, fds = forkserver.ForkServerClient.attach_keeper(
            rec.socket, bytes.fromhex(rec.secret), job.address, timeout
        )
    except (ConnectionRefusedError, OSError) as e:
        job.stop()
        raise AttachError(f"cannot attach to persistent mesh {name!r}: {e}") from None
    label = f"{name} (attached)"
    try:
        progress = _progress_printer(label, _quiet())
        job.adopt(name, keeper, attached.pids, attached.exited, fds, timeout, progress)
    except BaseException:
        job.stop(detach=True)
        raise
    pm = _root(job)
    ids = [a[0] for inv in pm._inventory() for a in inv["actors"]]
    _actor.reserve_ids(max(ids, default=0))
    return pm


def this_host() -> LocalHost:
    """The local host. Starting the fork server here (not at the first spawn) lets it fork
    from a controller that has not yet run a multi-threaded torch op."""
    forkserver.fork_server().ensure_started()
    return _this_host


class RemoteHosts:
    """Workers started by an external launcher (torchrun, SLURM, Kubernetes, Ray) that join this
    controller over TCP. Start them with ``command()`` and the variables of ``env()``, then call
    ``spawn_procs`` to wait for them."""

    def __init__(self, hosts: int, listen: str, token: bytes | None):
        if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
            raise ValueError(f"hosts must be a positive int, got {hosts!r}")
        self.hosts = hosts
        self._listen = listen
        self._token = token or transport.new_token()
        self._job: controller.Job | None = None
        self._per_host: tuple[tuple[str, ...], tuple[int, ...]] | None = None

    def _ensure_job(self, dims: tuple[str, ...], sizes: tuple[int, ...]) -> controller.Job:
        if self._job is None:
            self._job = controller.Job(
                ("host", *dims), (self.hosts, *sizes), listen=self._listen, token=self._token
            )
            controller.register(self._job)
            self._per_host = (dims, sizes)
        elif self._per_host != (dims, sizes):
            raise ValueError(
                f"this allocation was set up for {dict(zip(*self._per_host))} per host, "
                f"not {dict(zip(dims, sizes))}"
            )
        return self._job

    def listen(self, per_host: Mapping[str, int]) -> str:
        """Open the listening socket for ``per_host`` workers per host; returns its address."""
        dims, sizes = _check_shape(per_host, "listen")
        if "host" in dims:
            raise ValueError("'host' is the dim of the hosts; name the per-host dims otherwise")
        return self._ensure_job(dims, sizes).address

    @property
    def address(self) -> str:
        if self._job is None:
            raise RuntimeError("call listen(per_host) (or spawn_procs) first")
        return self._job.address

    def env(self) -> dict[str, str]:
        """Variables every launched worker needs (the job's secret token)."""
        return {"MONARCH_DSL_TOKEN": self._token.hex()}

    def command(self) -> list[str]:
        """The command each launched worker runs (it takes its rank from --rank or the
        launcher's RANK / SLURM_PROCID / OMPI_COMM_WORLD_RANK)."""
        return [sys.executable, "-m", "monarch_dsl", "worker", "--connect", self.address]

    def spawn_procs(
        self,
        per_host: Mapping[str, int],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        memory_limit: int | None = None,
    ) -> ProcMesh:
        """Wait until every worker (hosts x per_host) has joined; returns their ProcMesh.

        ``memory_limit``: each CPU worker's memory budget in bytes, set once they joined;
        None keeps the one each started with (``$MONARCH_DSL_MEMORY_LIMIT`` in its environment,
        else its host's available memory divided by ``LOCAL_WORLD_SIZE``); ``0``: none."""
        memory_limit = memory.check_limit(memory_limit)
        self.listen(per_host)
        job = self._job
        assert job is not None
        job.memory_limit = memory_limit
        label = f"{self.hosts} remote host(s) at {job.address}"
        try:
            job.wait_joined(timeout, _progress_printer(label, _quiet()))
        except BaseException:
            job.stop()
            raise
        return _root(job)


def remote_hosts(
    hosts: int, *, listen: str = "tcp:127.0.0.1:0", token: bytes | None = None
) -> RemoteHosts:
    """An allocation of ``hosts`` hosts whose workers an external launcher starts.

    ``listen``: where the controller accepts workers (loopback unless told otherwise, e.g.
    ``"tcp:0.0.0.0:29600"`` for other machines)."""
    transport.parse_address(listen)
    return RemoteHosts(hosts, listen, token)
