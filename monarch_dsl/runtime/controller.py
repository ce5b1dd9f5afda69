"""The controller's side of a process allocation (a ``Job``): the workers' connections, the
receiver thread that completes futures, supervision, and the flusher that sends held-back
calls. Local workers come from the fork server (runtime/forkserver.py)."""

from __future__ import annotations

import itertools
import logging
import math
import os
import pickle
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from monarch_dsl.errors import ActorError, RemoteError, SpawnError, SupervisionError
from monarch_dsl.runtime import debugger, logs, transport
from monarch_dsl.runtime.context import Point
from monarch_dsl.runtime.failure import is_communication
from monarch_dsl.runtime.forkserver import ForkServerClient, describe_status, fork_server
from monarch_dsl.runtime.future import Future, before_block
from monarch_dsl.runtime.messages import (
    Configure,
    DebugHello,
    ErrorReply,
    FailureReport,
    FetchFailed,
    ForkWorkers,
    Hello,
    KeeperConfig,
    Reply,
    StopWorker,
)

log = logging.getLogger("monarch_dsl")

_call_ids = itertools.count(1)

# A thread whose caller swallows a worker's death (the flusher's sends, a block's last flush
# while another error leaves it): a death raised there has not reached the program.
_quiet = threading.local()


class quietly:
    """``with controller.quietly():`` -- the caller of what runs in it swallows a
    SupervisionError, so a worker's death raised there is not ``told`` (``Job.told``)."""

    def __enter__(self) -> None:
        self.before = getattr(_quiet, "on", False)
        _quiet.on = True

    def __exit__(self, *exc: object) -> None:
        _quiet.on = self.before


def is_quiet() -> bool:
    """Whether this thread's caller swallows a worker's death (see ``quietly``)."""
    return getattr(_quiet, "on", False)


STOP_TIMEOUT = 5.0
CALLER_PARK = 0.005  # after a caller read replies itself, the background reader waits this long
EXIT_STATUS_WAIT = 1.0
# How long a survivor's failed communication waits for the death that likely caused it: its
# peer's exit can reach the controller after the survivor's report of the broken collective.
PEER_LOSS_WAIT = 2.0


# =============================================================================== batching


FLUSH_DELAY = 0.001  # longest time a held-back call waits before it is sent
# ... and one held lazily (a replayed eager step's batch, sent when the step ends or a caller
# waits): a step that takes longer is cut here (then sent as it is, not replayed)
LAZY_DELAY = 0.1


class Flusher:
    """Sends what connections hold back during a burst of calls (``send_batched``): at once
    when a caller is about to wait for a result, else at most ``FLUSH_DELAY`` later."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: set[Any] = set()  # anything with flush(): connections, tensor batches
        # ... flushed when a caller is about to wait, or LAZY_DELAY after it was held
        self._lazy: dict[Any, float] = {}
        self._thread: threading.Thread | None = None
        before_block.append(self.flush_all)

    def hold(self, conn: Any, lazy: bool = False) -> None:
        """``lazy``: sent when a caller is about to wait (or it flushes itself), at the latest
        ``LAZY_DELAY`` from now."""
        # (Held once per batch, after its previous batch went -- maybe by its own flush, which
        # leaves this its earlier hold: dropped, or a timer still set for a batch gone would
        # send this one early, a replayed step in two parts.)
        with self._cond:
            if lazy:
                self._held.discard(conn)
                self._lazy[conn] = time.monotonic()  # (its start)
            else:
                self._lazy.pop(conn, None)
                self._held.add(conn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="md-flusher", daemon=True)
                self._thread.start()
            self._cond.notify()

    def flush_all(self, lazy: bool = True) -> None:
        """``lazy``: those held lazily too (else only those held LAZY_DELAY already)."""
        # Flushing a tensor batch may hold a connection: loop until nothing is held.
        while True:
            with self._cond:  # (those held on the timer first: theirs is the shorter wait)
                # (hold keeps a conn in one of the two: none is flushed twice)
                held, self._held = list(self._held), set()
                if lazy:
                    held.extend(self._lazy)
                    self._lazy = {}
                elif self._lazy:
                    late = time.monotonic() - LAZY_DELAY
                    for conn, since in list(self._lazy.items()):
                        if since <= late:
                            held.append(conn)
                            del self._lazy[conn]
            if not held:
                return
            for conn in held:
                try:
                    with quietly():
                        conn.flush()
                except (OSError, SupervisionError):
                    # A dead worker (a socket error, or a tensor batch for a job that lost
                    # one): the receiver thread reports it and fails its calls. The flusher
                    # thread runs this too and must not die of it: every later batch of the
                    # process would then wait for a caller to block.
                    pass
                except Exception:  # noqa: BLE001 - an internal error sending a batch (its
                    # waiters were failed with it, see Engine.flush): said, and the flusher
                    # goes on for the other connections
                    log.exception("monarch_dsl: a batch could not be sent")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._held and not self._lazy:
                    self._cond.wait()
                if self._held:
                    self._cond.wait(FLUSH_DELAY)  # the burst goes on a moment; then send it
                else:  # (only lazy ones: until the oldest is due, or something is held)
                    due = min(self._lazy.values()) + LAZY_DELAY - time.monotonic()
                    if due > 0:
                        self._cond.wait(due)
            self.flush_all(lazy=False)


_flusher = Flusher()


def flusher() -> Flusher:
    """Holds anything with a ``flush()`` (connections, tensor batches) for at most
    ``FLUSH_DELAY``."""
    return _flusher


# =============================================================================== pending calls


class Pending:
    """One call awaiting replies from some ranks of a job."""

    __slots__ = ("future", "ranks", "index", "values", "remaining", "finish", "on_item", "point_of")

    def __init__(
        self,
        ranks: Sequence[int],
        finish: Callable[[list], Any] | None,
        on_item: Callable[[int, Any, BaseException | None], None] | None = None,
        point_of: Callable[[int], Point] | None = None,
        reader: Any = None,
    ):
        self.future: Future = Future(reader)
        self.ranks = ranks
        self.index = {r: i for i, r in enumerate(ranks)} if len(ranks) > 1 else None
        self.values: list = [None] * len(ranks)
        self.remaining = len(ranks)
        self.finish = finish
        self.on_item = on_item
        self.point_of = point_of


# =============================================================================== job


class _Poller:
    """``select.poll`` with a payload per fd: the least Python between a reply and its reader
    (``selectors`` costs a few microseconds more per wake-up, on every round trip)."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._data: dict[int, Any] = {}

    def register(self, fileobj: Any, data: Any) -> None:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        self._data[fd] = data
        self._poll.register(fd, select.POLLIN)

    def unregister(self, fileobj: Any) -> None:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        if fd in self._data:
            del self._data[fd]
            self._poll.unregister(fd)

    def select(self, timeout: float | None = None) -> list:
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        data = self._data
        return [data[fd] for fd, _ in self._poll.poll(ms) if fd in data]


class Job:
    """A set of worker processes (the root of a ProcMesh) and their connections."""

    def __init__(
        self,
        dims: tuple[str, ...],
        sizes: tuple[int, ...],
        *,
        listen: str | None = None,
        token: bytes | None = None,
    ):
        self.dims, self.sizes = dims, sizes
        self.world = 1
        for s in sizes:
            self.world *= s
        self.token = token or transport.new_token()
        self._dir = ""
        if listen is None:
            self._dir = tempfile.mkdtemp(prefix="monarch_dsl-")  # 0700: private to the user
            listen = "unix:" + os.path.join(self._dir, "controller.sock")
        self.listener, self.address = transport.listen(listen)
        self.conns: dict[int, transport.Connection] = {}
        self.hellos: dict[int, Hello] = {}
        self.pids: dict[int, int] = {}  # local workers: rank -> pid
        self.stderr: dict[int, Any] = {}  # local workers: rank -> log pipe
        self.pipes: list[Any] = []  # local workers' stdout and stderr pipes (logs.forwarder)
        self.log_group = logs.LogGroup(dims, sizes)  # their labels and aggregation window
        # A persistent mesh (spawn_procs(name=, persistent=True), md.attach): its name and
        # our channel to its keeper (forkserver.Keeper); None for any other job.
        self.name: str | None = None
        self.keeper: ForkServerClient | None = None
        self._adopted = False  # attached to a running persistent mesh (not started by us)
        self.worker_env: dict[str, str] = {}  # local workers: the env they were started with
        # A budget for the workers to take once they joined (RemoteHosts.spawn_procs; local
        # workers get theirs at their start, runtime/memory.py); None: theirs.
        self.memory_limit: int | None = None
        self.dead: dict[int, SupervisionError] = {}
        self.exit_status: dict[int, int] = {}
        self.pending: dict[int, Pending] = {}
        self.pending_by_rank: dict[int, set[int]] = {}
        self.pending_whole_job: set[int] = set()  # call ids that any worker's death fails
        # Calls whose reply was a failed communication, held until a worker's death explains
        # it or PEER_LOSS_WAIT passes: call id -> (deadline, rank, the RemoteError).
        self._held: dict[int, tuple[float, int, RemoteError]] = {}
        self.failures: list[tuple] = []  # root failures reported by workers (tensor engine)
        self.observed: set[tuple] = set()  # ... of which some fetch has raised
        # Dead ranks whose death has reached the program: a call of its raised it (Future.get,
        # expect/request refusing it, a tensor batch's flush on the program's thread:
        # ``Engine.flush``). Not a flush whose caller swallows it (``quietly``: the flusher's).
        self.told: set[int] = set()
        # Higher layers keep their per-job state here by name (the tensor engine: "tensor"),
        # and add to before_stop what ProcMesh.stop runs, with a timeout in seconds, before
        # it stops the workers (the engine waits for what it sent).
        self.extensions: dict[str, Any] = {}
        self.before_stop: list[Callable[[float], None]] = []
        self.stopping = False
        self.stopped = False
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # `with self._lock` where no wait follows
        self._startup_failure: SpawnError | None = None
        self._sel = _Poller()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, None)
        self._sel.register(self.listener, "listener")
        self._read_lock = threading.Lock()  # held by whoever reads the sockets (see read_until)
        self._handoff_lock = threading.Lock()
        self._handoff = threading.Condition(self._handoff_lock)
        self._callers_reading = 0
        self._caller_read_at = 0.0
        self._bg_selecting = False
        self._thread = threading.Thread(target=self._run, name="md-receiver", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ naming
    def coords(self, rank: int) -> dict[str, int]:
        return dict(Point.of_index(rank, self.dims, self.sizes))

    def describe(self, rank: int) -> str:
        coords = ",".join(f"{d}={c}" for d, c in self.coords(rank).items())
        pid = self.pids.get(rank) or (self.hellos[rank].pid if rank in self.hellos else None)
        where = f", pid {pid}" if pid else ""
        if rank in self.hellos and self.hellos[rank].hostname != socket.gethostname():
            where += f" on {self.hellos[rank].hostname}"
        return f"rank {rank} ({coords}{where})"

    def death(self, rank: int) -> SupervisionError:
        """A new SupervisionError for dead ``rank`` (each raise gets its own: one instance
        raised again and again would carry every earlier raise's traceback)."""
        err = self.dead[rank]
        return SupervisionError(err.args[0], rank=err.rank, coords=err.coords, stderr=err.stderr)

    def first_death(self) -> SupervisionError | None:
        """The error of the worker that died first, if one did."""
        for rank in list(self.dead):
            return self.death(rank)
        return None

    # ------------------------------------------------------------------ startup
    def start_local(
        self,
        local_world_size: int,
        env: dict[str, str],
        setup: bytes | None,
        timeout: float,
        progress: Callable[[int, int], None],
    ) -> None:
        """Fork every worker from the fork server and wait until all have joined."""
        server = fork_server()
        server.ensure_started()
        self.worker_env = dict(env)
        fds: list[int] = []
        for rank in range(self.world):
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            logs.forwarder().add(out_r, self.log_group, rank, is_err=False)
            self.stderr[rank] = logs.forwarder().add(err_r, self.log_group, rank, is_err=True)
            fds += [out_w, err_w]
        request = self._fork_request(local_world_size, env, setup)
        try:
            pids = server.fork(request, fds, timeout)
        finally:
            for fd in fds:
                os.close(fd)
        for rank, pid in enumerate(pids):
            self.pids[rank] = pid
            server.watch_exit(pid, lambda status, rank=rank: self._on_exit(rank, status))
        self.wait_joined(timeout, progress)

    def _fork_request(
        self, local_world_size: int, env: dict[str, str], setup: bytes | None
    ) -> ForkWorkers:
        """Every worker of this job, joining us, with this process's sys.path and cwd."""
        return ForkWorkers(
            0,
            self.address,
            self.token,
            tuple(range(self.world)),
            self.world,
            local_world_size,
            env,
            tuple(sys.path),
            os.getcwd(),
            setup,
        )

    def start_persistent(
        self,
        name: str,
        idle_timeout: float,
        local_world_size: int,
        env: dict[str, str],
        setup: bytes | None,
        timeout: float,
        progress: Callable[[int, int], None],
    ) -> None:
        """Start a keeper for persistent mesh ``name`` (forkserver.Keeper: a fresh interpreter
        that outlives us), have it fork every worker, and wait until all have joined."""
        self.worker_env = dict(env)
        config = KeeperConfig(name, self.token, self.dims, self.sizes, idle_timeout)
        keeper = ForkServerClient.start_keeper(config, timeout)
        self.name, self.keeper = name, keeper
        request = self._fork_request(local_world_size, env, setup)
        pids, fds = keeper.fork_keeper(request, timeout)
        self._take_workers(keeper, pids, fds)
        self.wait_joined(timeout, progress)

    def adopt(
        self,
        name: str,
        keeper: ForkServerClient,
        pids: Sequence[int],
        exited: dict[int, int],
        fds: Sequence[int],
        timeout: float,
        progress: Callable[[int, int], None],
    ) -> None:
        """Drive persistent mesh ``name``, whose keeper just let us attach (``md.attach``):
        its workers are connecting to us. Those that died while no controller was attached
        (``exited``: rank -> status) are dead here from the start: every call involving them
        raises ``SupervisionError`` naming them (``pm.stop()`` still works)."""
        self.name, self.keeper = name, keeper
        self._adopted = True
        for rank, status in exited.items():
            self.exit_status[rank] = status
            self.dead[rank] = self._died_detached(rank, status)
        self._take_workers(keeper, pids, fds)
        self.wait_joined(timeout, progress)

    def _died_detached(self, rank: int, status: int) -> SupervisionError:
        return SupervisionError(
            f"worker {self.describe(rank)} {describe_status(status)} while no controller was "
            f"attached to persistent mesh {self.name!r}",
            rank=rank,
            coords=self.coords(rank),
        )

    def _take_workers(self, server: ForkServerClient, pids: Sequence[int], fds: Sequence[int]):
        forward = logs.forwarder().add
        for rank, pid in enumerate(pids):
            self.pipes.append(forward(fds[2 * rank], self.log_group, rank, is_err=False))
            self.stderr[rank] = forward(fds[2 * rank + 1], self.log_group, rank, is_err=True)
            self.pipes.append(self.stderr[rank])
            self.pids[rank] = pid
            server.watch_exit(pid, lambda status, rank=rank: self._on_exit(rank, status))

    def detach(self, timeout: float = STOP_TIMEOUT) -> None:
        """Leave a persistent mesh running without us: close our connections (each worker
        drops what it held for us and waits for the next controller) and our channel to its
        keeper. Calls still pending fail."""
        if self.keeper is None:
            raise RuntimeError("only a persistent mesh can be detached from")
        self.stop(timeout, detach=True)

    def wait_joined(self, timeout: float, progress: Callable[[int, int], None]) -> None:
        """Wait until every worker has joined (attached to a persistent mesh: or is dead)."""
        deadline = time.monotonic() + timeout

        def waiting() -> bool:
            if self._adopted:
                return any(r not in self.hellos and r not in self.dead for r in range(self.world))
            return len(self.hellos) < self.world

        with self._cond:
            while waiting() and self._startup_failure is None:
                progress(len(self.hellos), self.world)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(self.world) if r not in self.hellos]
                    self._startup_failure = SpawnError(
                        f"{len(missing)} of {self.world} workers did not join within {timeout} s "
                        f"(missing: {', '.join(self.describe(r) for r in missing[:8])})",
                        rank=missing[0],
                        coords=self.coords(missing[0]),
                        stderr=self._stderr_of(missing[0]),
                    )
                    break
                self._cond.wait(left)
            failure = self._startup_failure
        if failure is not None:
            self.stop(detach=self._adopted)  # (a mesh we attached to outlives our failure)
            raise failure
        progress(self.world, self.world)
        configure = transport.encode(Configure(self.dims, self.sizes, self.memory_limit))
        for rank, conn in list(self.conns.items()):
            try:
                conn.send_encoded(configure)
            except OSError:
                # It died as it joined (its socket closed under us). A mesh we attached to
                # keeps it as dead from the start (named at its first use).
                if self._await_verdict(rank) and self._adopted:
                    continue
                self.stop(detach=self._adopted)
                if rank in self.dead:
                    raise self.death(rank) from None
                raise SupervisionError(
                    f"worker {self.describe(rank)} lost its connection as it joined",
                    rank=rank,
                    coords=self.coords(rank),
                ) from None

    def _stderr_of(self, rank: int) -> str:
        """A worker failed: print what the job's workers printed (what aggregation holds
        included, so its last lines come before the error), and give its stderr's tail."""
        logs.forwarder().flush(self.log_group)
        return logs.forwarder().stderr_tail(self.stderr.get(rank))

    def _on_exit(self, rank: int, status: int) -> None:
        """From the fork server's reader: a local worker exited."""
        with self._cond:
            self.exit_status[rank] = status
            self._cond.notify_all()
            if self._adopted and rank not in self.hellos and rank not in self.dead:
                # (a persistent mesh's worker that died as we attached: dead from the start)
                self.dead[rank] = self._died_detached(rank, status)
                return
            if rank not in self.hellos and not self.stopping and self._startup_failure is None:
                self._startup_failure = SpawnError(
                    f"worker {self.describe(rank)} failed to start: it {describe_status(status)}",
                    rank=rank,
                    coords=self.coords(rank),
                    stderr=self._stderr_of(rank),
                )
                self._cond.notify_all()

    # ------------------------------------------------------------------ receiver thread
    def _run(self) -> None:
        """The background reader: reads whenever no caller is reading for itself, and stays
        out of the way for ``CALLER_PARK`` s after a caller read (it will likely read again:
        a loop of calls) -- so a caller rarely has to wake it to take over."""
        while not self.stopped:
            with self._handoff:
                if self._callers_reading and not self.stopped:
                    # until the caller hands reading back (read_until notifies): no timed
                    # wake-ups meanwhile (every 5 ms they cost ~2% of a core while the main
                    # thread waited on a long result, taken from the workers' cores)
                    self._handoff.wait()
                    continue
                idle = time.monotonic() - self._caller_read_at
                if idle < CALLER_PARK:
                    self._handoff.wait(CALLER_PARK - idle)
                    continue
            with self._read_lock:
                self._bg_selecting = True
                if self._callers_reading or self.stopped:
                    self._bg_selecting = False
                    continue
                events = self._sel.select(self._held_timeout(None))
                self._bg_selecting = False
                self._process(events)

    def _process(self, events) -> None:
        """Caller holds ``_read_lock``."""
        for data in events:
            if data is None:
                try:
                    os.read(self._wake_r, 4096)
                except (BlockingIOError, OSError):
                    pass
            elif data == "listener":
                self._accept()
            else:
                rank, conn = data
                try:
                    msgs = conn.reader.read()
                except (EOFError, OSError, transport.ProtocolError, MemoryError) as e:
                    self._on_lost(rank, conn, e)
                    continue
                for msg in msgs:
                    self._dispatch(rank, msg)
        if self._held:
            self._release_held()

    def _held_timeout(self, left: float | None) -> float | None:
        """``left``, or less: until the first held call's deadline."""
        if not self._held:
            return left
        until = min(deadline for deadline, _, _ in self._held.values()) - time.monotonic()
        return max(0.0, until if left is None else min(left, until))

    def _release_held(self) -> None:
        """Deliver the held failures that no death explained within PEER_LOSS_WAIT."""
        now = time.monotonic()
        for call_id, (deadline, rank, err) in list(self._held.items()):
            if now >= deadline or call_id not in self.pending:
                del self._held[call_id]
                self._deliver(rank, call_id, None, err)

    def read_until(self, fut: Future, timeout: float | None) -> None:
        """Wait for ``fut`` by reading replies in the calling thread.

        Handing each reply from the background reader to the waiting thread cost about as much
        as the rest of a round trip (two thread wake-ups and GIL hand-offs), so a lone waiter
        reads for itself: it asks the background reader to step aside (its wake-up overlaps the
        worker's work on the request), reads and dispatches every message until its own
        result is in, then hands reading back. With another waiter already reading, or from
        the reader thread itself, it just waits for the future."""
        if threading.get_ident() == self._thread.ident or self.stopped:
            fut.wait_until_done(timeout)
            return
        solo = False
        try:
            with self._handoff_lock:
                if not self._callers_reading:
                    # (in this order: an interrupt between the two still hands reading back)
                    solo = True
                    self._callers_reading = 1
            if not solo:
                fut.wait_until_done(timeout)
                return
            deadline = None if timeout is None else time.monotonic() + timeout
            if self._bg_selecting:
                os.write(self._wake_w, b"x")  # the background reader is in select(): step aside
            locked = False
            try:  # (acquired inside: an interrupt right after it still releases it)
                locked = self._read_lock.acquire(timeout=-1 if timeout is None else timeout)
                if not locked:
                    return
                while not fut.done() and not self.stopped:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return
                    self._process(self._sel.select(self._held_timeout(left)))
            finally:
                if locked:
                    self._read_lock.release()
        finally:
            if solo:
                with self._handoff:
                    self._callers_reading = 0
                    self._caller_read_at = time.monotonic()
                    self._handoff.notify_all()  # the background reader's park starts now

    def _accept(self) -> None:
        try:
            sock, addr = self.listener.accept()
        except OSError:
            return
        threading.Thread(
            target=self._admit, args=(sock, addr), daemon=True, name="md-handshake"
        ).start()

    def _admit(self, sock: socket.socket, addr: Any) -> None:
        peer = str(addr) if addr else "a local process"
        try:
            transport.handshake_listener(sock, self.token)
            sock.settimeout(transport.HANDSHAKE_TIMEOUT)
            conn = transport.Connection(sock, peer)
            hello = conn.recv()
            sock.settimeout(None)
            if isinstance(hello, DebugHello):  # a worker's thread stopped in breakpoint()
                debugger.sessions().add(hello, conn)
                return
            if not isinstance(hello, Hello):
                raise transport.ProtocolError(f"expected Hello, got {type(hello).__name__}")
            with self._cond:
                if not 0 <= hello.rank < self.world or hello.rank in self.hellos:
                    raise transport.ProtocolError(
                        f"rank {hello.rank} is out of range or already joined (world {self.world})"
                    )
                if self.stopping:
                    raise transport.ProtocolError("the mesh is stopping")
                self.conns[hello.rank] = conn
                self.hellos[hello.rank] = hello
                self.pending_by_rank[hello.rank] = set()
                self._sel.register(conn.sock, (hello.rank, conn))
                self._cond.notify_all()
            os.write(self._wake_w, b"x")
            while conn.has_buffered():  # sent in the same packet as the Hello
                self._dispatch(hello.rank, conn.recv())
        except (transport.ProtocolError, OSError, EOFError) as e:
            log.warning(
                "monarch_dsl: refused a connection to %s from %s: %s", self.address, peer, e
            )
            sock.close()

    def _dispatch(self, rank: int, msg: Any) -> None:
        cls = type(msg)
        if cls is Reply:
            self._deliver(rank, msg.call_id, msg.value, None)
        elif cls is ErrorReply:
            exc = None
            if msg.exception is not None:
                try:
                    exc = pickle.loads(msg.exception)
                except Exception:  # noqa: BLE001 - the text is enough
                    exc = None
            p = self.pending.get(msg.call_id)
            point = p.point_of(rank) if p is not None and p.point_of else None
            where = f"actor {point}" if point is not None else self.describe(rank)
            first = msg.traceback.strip().splitlines()[-1] if msg.traceback.strip() else "error"
            err = ActorError(
                f"{where} raised: {first}",
                rank=point.rank if point else rank,
                point=point,
                remote_traceback=msg.traceback,
                exception=exc,
            )
            self._deliver(rank, msg.call_id, None, err)
        elif cls is FetchFailed:
            self._fetch_failed(rank, msg.call_id, msg.failure)
        elif cls is FailureReport:
            self.failures.append(msg.failure)
        elif cls is transport.UndecodableMessage and msg.call_id is not None:
            # A reply this process cannot load (e.g. an object of a module it cannot import):
            # the call fails with why, instead of waiting forever.
            err = RemoteError(
                f"the {msg.kind} from worker {self.describe(rank)} could not be read here: "
                f"{msg.reason}",
                rank=rank,
                coords=self.coords(rank),
                error=msg.reason,
            )
            self._deliver(rank, msg.call_id, None, err)
        else:
            log.warning("monarch_dsl: dropped a message from %s: %r", self.describe(rank), msg)

    def _fetch_failed(self, rank: int, call_id: int, failure: tuple) -> None:
        """A fetched value had failed. A communication that raised on a survivor (its peer
        vanished) is the dead worker's doing: the call fails with its SupervisionError --
        also when the death is noticed up to PEER_LOSS_WAIT after this reply (the call is
        held until then), never with the survivor's "connection closed" or a value the abort
        left unmade."""
        err = self.remote_error(failure, observed=True)
        if is_communication(failure):
            death = self.first_death()
            if death is not None:
                self._deliver(rank, call_id, None, death)
                return
            if call_id in self.pending:
                self._held[call_id] = (time.monotonic() + PEER_LOSS_WAIT, rank, err)
                return
        self._deliver(rank, call_id, None, err)

    def _deliver(self, rank: int, call_id: int, value: Any, exc: BaseException | None) -> None:
        p = self.pending.get(call_id)
        if p is None:
            return
        if p.index is None and rank != p.ranks[0] or p.index is not None and rank not in p.index:
            log.warning(
                "monarch_dsl: dropped a reply from %s to a call it was not part of",
                self.describe(rank),
            )
            return
        if p.on_item is not None:
            p.on_item(rank, value, exc)
        if exc is not None and p.on_item is None:
            self._forget(call_id, p)
            p.future.set_exception(exc)
            return
        i = 0 if p.index is None else p.index[rank]
        p.values[i] = value
        p.remaining -= 1
        self.pending_by_rank[rank].discard(call_id)
        if p.remaining == 0:
            del self.pending[call_id]
            self.pending_whole_job.discard(call_id)
            p.future.set_result(p.finish(p.values) if p.finish else None)

    def _forget(self, call_id: int, p: Pending) -> None:
        self.pending.pop(call_id, None)
        self.pending_whole_job.discard(call_id)
        for r in p.ranks:
            s = self.pending_by_rank.get(r)
            if s is not None:
                s.discard(call_id)

    def _on_lost(self, rank: int, conn: transport.Connection, why: BaseException) -> None:
        self._sel.unregister(conn.sock)
        conn.close()
        if self.stopping:
            with self._cond:
                self.conns.pop(rank, None)
                self._cond.notify_all()
            return
        if rank in self.pids:  # a local worker: give the fork server a moment to report why
            with self._cond:
                self._cond.wait_for(lambda: rank in self.exit_status, EXIT_STATUS_WAIT)
        status = self.exit_status.get(rank)
        how = describe_status(status) if rank in self.pids else f"lost its connection ({why})"
        err = SupervisionError(
            f"worker {self.describe(rank)} {how}",
            rank=rank,
            coords=self.coords(rank),
            stderr=self._stderr_of(rank),
        )
        log.warning("monarch_dsl: %s", err.args[0])
        with self._cond:
            self.dead[rank] = err
            self.conns.pop(rank, None)
            call_ids = self.pending_by_rank.pop(rank, set()) | self.pending_whole_job
            call_ids |= set(self._held)  # a survivor's failed communication: this death's doing
            self._held.clear()
            self._cond.notify_all()
        for call_id in call_ids:
            p = self.pending.get(call_id)
            if p is None:
                continue
            if p.on_item is not None:
                p.on_item(rank, None, self.death(rank))
                p.remaining -= 1
                if p.remaining == 0:
                    self._forget(call_id, p)
                    p.future.set_result(None)
                continue
            self._forget(call_id, p)
            p.future.set_exception(self.death(rank))

    # ------------------------------------------------------------------ tensor engine
    def remote_error(self, failure: tuple, observed: bool) -> RemoteError:
        """The RemoteError for a failure tuple from a worker (executor.Failure)."""
        rank, line, op, error, tb = failure
        if observed:  # the same command failing on other ranks counts as seen too
            self.observed.add((line, op, error))
        at = f" at {line}" if line else ""
        return RemoteError(
            f"{op or 'a command'}{at} failed on worker {self.describe(rank)}: {error}",
            rank=rank,
            coords=self.coords(rank),
            line=line,
            op=op,
            error=error,
            remote_traceback=tb,
        )

    def unobserved_failures(self) -> list[tuple]:
        """Root failures no fetch has raised; after a worker's death, without the survivors'
        failed communications (the death's doing, reported as such)."""
        return [
            f
            for f in self.failures
            if tuple(f[1:4]) not in self.observed and not (self.dead and is_communication(f))
        ]

    def expect(
        self, ranks: Sequence[int], finish: Callable[[list], Any] | None, whole_job: bool = False
    ) -> tuple:
        """Register a call whose message goes out some other way (in a tensor batch);
        returns (call_id, future). ``whole_job``: the answer may depend on every worker (a
        tensor-engine fetch waits for its rank's streams, which may wait in a collective for
        any other rank): a dead worker anywhere fails it, before and while it is pending."""
        call_id = next(_call_ids)
        p = Pending(ranks, finish, None, None, self)
        with self._lock:  # (a death is recorded under it: before this check, or it fails the call)
            self.check_alive(range(self.world) if whole_job else ranks, tell=True)
            self.pending[call_id] = p
            for r in ranks:
                self.pending_by_rank[r].add(call_id)
            if whole_job:
                self.pending_whole_job.add(call_id)
        return call_id, p.future

    # ------------------------------------------------------------------ sending
    def check_alive(self, ranks: Sequence[int], tell: bool = False) -> None:
        """A SupervisionError if the mesh was stopped or a rank of ``ranks`` died; ``tell``:
        the caller raises it to the program (the death is then ``told``)."""
        if self.stopped or self.stopping:
            raise SupervisionError("this process mesh has been stopped")
        if self.dead:
            for r in ranks:
                if r in self.dead:
                    if tell:
                        self.told.add(r)
                    raise self.death(r)

    def raised(self, exc: BaseException) -> None:
        """A call's future raised ``exc`` to its caller (``Future.get``): a worker's death
        it names has been told (see ``told``)."""
        rank = getattr(exc, "rank", None)
        if isinstance(exc, SupervisionError) and rank is not None:
            self.told.add(rank)  # (its death may be recorded later: told already)

    def request(
        self,
        ranks: Sequence[int],
        msg_for: Callable[[int], Any],
        finish: Callable[[list], Any] | None = None,
        on_item: Callable[[int, Any, BaseException | None], None] | None = None,
        point_of: Callable[[int], Point] | None = None,
    ) -> Future:
        """Send ``msg_for(call_id)`` to every rank; the future completes with
        ``finish(values)`` once all have replied, or with the first error."""
        self.check_alive(ranks, tell=True)
        call_id = next(_call_ids)
        p = Pending(ranks, finish, on_item, point_of, self)
        parts = _encode_call(msg_for(call_id))
        with self._lock:
            self.pending[call_id] = p
            for r in ranks:
                waiting = self.pending_by_rank.get(r)
                if waiting is None:  # died (or never joined) since check_alive
                    self._forget(call_id, p)
                    self.check_alive([r])
                    raise SupervisionError(f"worker {self.describe(r)} is not connected")
                waiting.add(call_id)
        self._send_all(ranks, parts)
        return p.future

    def fail_calls(self, call_ids: Sequence[int], err: BaseException) -> None:
        """Fail the pending calls ``call_ids`` with ``err`` (their messages were never sent,
        or the mesh was stopped)."""
        failed = []
        with self._lock:
            for call_id in call_ids:
                p = self.pending.get(call_id)
                if p is not None:
                    self._forget(call_id, p)
                    failed.append(p)
        for p in failed:
            p.future.set_exception(err)

    def post(self, ranks: Sequence[int], msg: Any) -> None:
        """Send without expecting a reply."""
        self.check_alive(ranks)
        self._send_all(ranks, _encode_call(msg))

    def _await_verdict(self, rank: int) -> bool:
        """A send to ``rank`` failed: the receiver thread reports the death (its exit status,
        its stderr); wait for that verdict briefly. Whether it came."""
        with self._cond:
            return self._cond.wait_for(lambda: rank in self.dead, EXIT_STATUS_WAIT + 1)

    def _send_all(self, ranks: Sequence[int], parts: list) -> None:
        # Every rank's frame is made before any is sent: all ranks get a message or none.
        frames = [transport.for_rank(parts, r) for r in ranks]
        for r, frame in zip(ranks, frames):
            conn = self.conns.get(r)
            if conn is None:
                self.check_alive([r])
                raise SupervisionError(f"worker {self.describe(r)} is not connected")
            try:
                conn.send_batched(frame, _flusher.hold)
            except OSError as e:
                self._await_verdict(r)
                self.check_alive([r])
                raise SupervisionError(
                    f"worker {self.describe(r)} stopped accepting messages: {e}", rank=r
                ) from None

    # ------------------------------------------------------------------ stop
    def stop(self, timeout: float = STOP_TIMEOUT, detach: bool = False) -> None:
        """Stop the workers (``detach``: a persistent mesh's workers stay, for the next
        controller)."""
        with self._cond:
            if self.stopped:
                return
            self.stopping = True
            conns = dict(self.conns)
        if detach:
            for conn in conns.values():
                conn.close()
            with self._cond:
                self.conns.clear()
        stop = transport.encode(StopWorker())
        for conn in conns.values():
            try:
                conn.send_encoded(stop)
            except OSError:
                pass
        with self._cond:
            self._cond.wait_for(lambda: not self.conns, timeout)
            leftover = dict(self.conns)
        for conn in leftover.values():
            conn.close()
        if self.keeper is not None:
            if not detach:
                self.keeper.shutdown_keeper()  # it ends what is left of the mesh, and exits
            self.keeper.close()
            for pipe in self.pipes:
                logs.forwarder().remove(pipe)
        else:
            for rank, pid in self.pids.items():
                if rank not in self.exit_status:
                    try:
                        os.kill(pid, signal.SIGKILL)  # only our own workers, by pid
                    except ProcessLookupError:
                        pass
        # Print what aggregation holds; what the stopping workers print later, per rank.
        logs.forwarder().set_window(self.log_group, 0.0)
        self.stopped = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        with self._handoff:
            self._handoff.notify_all()
        self._thread.join(timeout)
        self.listener.close()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._held.clear()
        self.fail_calls(list(self.pending), SupervisionError("the process mesh was stopped"))
        _jobs.discard(self)


def _encode_call(msg: Any) -> list:
    try:
        return transport.encode(msg)
    except Exception as e:  # noqa: BLE001 - whatever pickling raises, say what could not go
        raise TypeError(
            f"cannot send this call's arguments to the workers: {type(e).__name__}: {e}"
        ) from e


_jobs: set[Job] = set()


def register(job: Job) -> None:
    _jobs.add(job)


def stop_all() -> None:
    """atexit: stop every job this controller started (a persistent mesh's: detach from it)."""
    for job in list(_jobs):
        try:
            job.stop(timeout=2.0, detach=job.keeper is not None)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
