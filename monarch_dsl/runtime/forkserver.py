"""The fork server -- one warm process per controller that forks workers on request -- and the
controller's client of it (:class:`ForkServerClient`, :func:`fork_server`).

Importing torch takes seconds; forking a process that has imported it takes milliseconds. So a
controller keeps one fork server and every worker of every local mesh is forked from it: torch
is imported once, and a second mesh costs only the forks.

Two ways to start it:

- *forked from the controller* (fast: no import at all). Only safe while the controller has
  never run a multi-threaded OpenMP region: libgomp's thread pool does not survive ``fork`` and
  the child hangs in its first parallel op. We cannot ask libgomp whether its pool exists, so
  the fork server proves it: it forks a throwaway child that runs a parallel op under an alarm.
  If that child does not finish cleanly the fork server says so and exits, and the controller
  falls back to
- *a fresh interpreter* (:func:`main`), which imports torch itself.

The fork server is single-threaded (so forking it is always safe), lives in its own session
(Ctrl-C in the controller's terminal does not reach the workers), kills its children and exits
when the controller's end of the channel closes, and reports every child's exit status.

It also forks the processes of ``pm.run_spmd`` (``ForkScripts``): one per rank, each running an
unchanged torchrun script as ``__main__`` (``run_script``). They come from here, not from the
workers, for the reason the workers do: this process has imported torch and is proven safe to
fork, while a worker has started threads (its executor's streams, gloo, OpenMP) and may have
initialized CUDA. ``run_script`` first undoes what a fork inherits and a fresh interpreter would
not have (signal handlers, atexit functions, logging handlers, the random generators' state,
torch's thread count), and ends the way an interpreter does (non-daemon threads joined, atexit
functions run, streams flushed). Each such process leads its own process group, so stopping a
rank also stops what it started (a DataLoader's workers).

The client (in the controller) starts the fork server on first use, sends it requests with the
file descriptors of the children's stdout and stderr, and reads its replies on a thread of its
own: the pids forked, and every child's exit status (``watch_exit``).
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import faulthandler
import gc
import hmac
import importlib.machinery
import itertools
import logging
import os
import pickle
import pkgutil
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import weakref
import zipfile
from collections.abc import Callable, Sequence
from typing import Any

from monarch_dsl.errors import SpawnError
from monarch_dsl.mesh import coords_of_index
from monarch_dsl.runtime.future import Future
from monarch_dsl.runtime.messages import (
    Attach,
    Attached,
    AttachRefused,
    ChildExited,
    Forked,
    ForkScripts,
    ForkServerReady,
    ForkServerUnsafe,
    ForkWorkers,
    KeeperConfig,
    Reconnect,
    Shutdown,
    StopWorker,
)

log = logging.getLogger("monarch_dsl")

MAX_MESSAGE = 1 << 20
MAX_FDS = 2048
PROBE_SECONDS = 2  # a sound probe takes milliseconds; a hung one is killed by the alarm


def _set_parent_death_signal() -> None:
    """Linux: SIGKILL this process when its parent (the fork server) exits."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _send(chan: socket.socket, msg) -> None:
    chan.send(pickle.dumps(msg))


def _probe_fork_safety() -> str | None:
    """Fork a child that runs a parallel torch op under an alarm; None if it finished."""
    import torch

    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(PROBE_SECONDS)
            torch.set_num_threads(max(2, torch.get_num_threads()))
            torch.ones(1 << 20).mul_(2).sum()
            os._exit(0)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return (
        "the controller has used a multi-threaded OpenMP op before its first mesh, so forked "
        "children would hang"
    )


class ForkServer:
    def __init__(self, chan: socket.socket, forked_from_controller: bool):
        self.chan = chan
        self.forked = forked_from_controller
        self.children: set[int] = set()
        self.groups: set[int] = set()  # children that lead a process group (scripts)

    def serve(self) -> None:
        if self.forked:
            unsafe = _probe_fork_safety()
            if unsafe:
                _send(self.chan, ForkServerUnsafe(unsafe))
                os._exit(0)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.wake_fds = (wake_r, wake_w)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.chan, selectors.EVENT_READ, "chan")
        self.sel.register(wake_r, selectors.EVENT_READ, "child")
        self.started()
        _send(self.chan, ForkServerReady(os.getpid(), self.forked))
        while True:
            for key, _ in self.sel.select(self.select_timeout()):
                self.on_event(key)
            self.tick()

    # Hooks of the keeper (a subclass): the plain fork server has no timers or other sockets.
    def started(self) -> None:
        pass

    def select_timeout(self) -> float | None:
        return None

    def tick(self) -> None:
        pass

    def child_close(self) -> None:
        """In a child just forked: close what is this process's own."""
        self.chan.close()
        for fd in self.wake_fds:
            os.close(fd)

    def on_event(self, key: selectors.SelectorKey) -> None:
        if key.data == "chan":
            self.on_request()
        elif key.data == "child":
            try:
                os.read(self.wake_fds[0], 4096)
            except BlockingIOError:
                pass
            self.reap()

    def on_controller_lost(self) -> None:
        """The controller is gone: so are its workers and scripts."""
        self.kill_children()
        os._exit(0)

    def kill_children(self) -> None:
        for pid in self.children:
            try:
                if pid in self.groups:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def on_request(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.chan, MAX_MESSAGE, MAX_FDS)
        except OSError:
            data, fds = b"", []
        if not data:
            self.on_controller_lost()
            return
        msg = pickle.loads(data)
        self.handle(msg, fds)

    def handle(self, msg, fds: list[int]) -> None:
        pids = []
        if isinstance(msg, ForkWorkers):
            for i, rank in enumerate(msg.ranks):
                body = self._worker_body(msg, rank)
                pids.append(self.fork(body, fds[2 * i], fds[2 * i + 1], fds, group=False))
        elif isinstance(msg, ForkScripts):
            for i, env in enumerate(msg.envs):
                body = self._script_body(msg, env)
                pids.append(self.fork(body, fds[2 * i], fds[2 * i + 1], fds, group=True))
        for fd in fds:
            os.close(fd)
        if isinstance(msg, (ForkWorkers, ForkScripts)):
            _send(self.chan, Forked(msg.request_id, tuple(pids)))

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.groups.discard(pid)
            self.exited(pid, status)

    def exited(self, pid: int, status: int) -> None:
        try:
            _send(self.chan, ChildExited(pid, status))
        except OSError:  # the controller is going (its channel's end is read next)
            pass

    def fork(
        self,
        body: Callable[[], int],
        out_fd: int,
        err_fd: int,
        fds,
        *,
        group: bool,
        keep: int = -1,
    ) -> int:
        """Fork a child that writes to ``out_fd``/``err_fd``, runs ``body()`` and exits with
        the code it returns; ``group``: the child leads a new process group."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        me = os.getpid()
        pid = os.fork()
        if pid:
            self.children.add(pid)
            if group:
                self.groups.add(pid)
                try:  # here too, so the group exists before the controller hears of the pid
                    os.setpgid(pid, pid)
                except OSError:
                    pass
            return pid
        code = 1
        try:
            _set_parent_death_signal()
            if os.getppid() != me:  # the fork server died before the signal was armed
                os._exit(1)
            if group:
                os.setpgid(0, 0)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self.child_close()
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            for fd in fds:
                if fd != keep:
                    os.close(fd)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            # Fresh text streams on fds 1 and 2: the inherited sys.stdout/sys.stderr may not
            # write to those fds at all (e.g. pytest's capture in a forked controller).
            # Encoding and errors as the interpreter chose them for its own (surrogateescape
            # under a C or UTF-8 locale: a file name that is not UTF-8 prints, as it would).
            sys.stdout = sys.__stdout__ = _text_stream(1, sys.__stdout__)
            sys.stderr = sys.__stderr__ = _text_stream(2, sys.__stderr__)
            code = body()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - the controller reads this from our stderr
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
        raise AssertionError("unreachable")

    @staticmethod
    def _worker_body(msg: ForkWorkers, rank: int, keeper_fd: int = -1) -> Callable[[], int]:
        def body() -> int:
            os.environ.update(msg.env)
            if keeper_fd >= 0:  # a persistent mesh's worker: its channel to the keeper
                os.environ["MONARCH_DSL_KEEPER_FD"] = str(keeper_fd)
            os.environ["LOCAL_RANK"] = str(msg.ranks.index(rank))
            sys.path[:] = list(msg.sys_path)
            try:
                os.chdir(msg.cwd)
            except OSError:
                pass
            if msg.setup is not None:
                pickle.loads(msg.setup)()
            from monarch_dsl.runtime import worker

            worker.connect_and_serve(
                msg.address, msg.token, rank, msg.world_size, msg.local_world_size
            )
            return 1  # connect_and_serve never returns

        return body

    @staticmethod
    def _script_body(msg: ForkScripts, env: dict[str, str]) -> Callable[[], int]:
        return lambda: run_script(msg.script, msg.args, env, msg.sys_path, msg.cwd, msg.module)


# =============================================================================== keeper

KEEPER_STOP_GRACE = 5.0  # seconds stopped workers get to exit before they are killed


class Keeper(ForkServer):
    """The fork server of a persistent mesh (``spawn_procs(name=, persistent=True)``).

    A fresh interpreter in its own session, so it outlives the controller that started it. It
    is the workers' parent and holds, for each, the read ends of its stdout and stderr pipes and
    a control channel (a socketpair; the worker finds its end in ``MONARCH_DSL_KEEPER_FD``).
    While a controller is attached, it has dups of the pipes and reads them; the keeper only
    reports exits. When the controller's channel closes (it exited, crashed or detached), the
    keeper drains the pipes into the mesh's log file and waits, on its Unix socket
    (``registry.paths``), for a controller that sends the mesh's secret and ``Attach``: it hands
    that one the pipes and tells every worker (``Reconnect``) to connect to it. A second
    controller while one is attached is refused. With no controller for ``idle_timeout``
    seconds, or on ``Shutdown`` (``pm.stop()``), it stops the workers (``StopWorker`` over
    their channels; killed after ``KEEPER_STOP_GRACE`` s), removes the mesh's record and exits.
    If it dies, the workers die with it (their parent-death signal)."""

    def __init__(self, chan: socket.socket, config: KeeperConfig):
        super().__init__(chan, forked_from_controller=False)
        self.config = config
        self.listener: socket.socket | None = None
        self.pids: list[int] = []  # by rank
        self.rank_of: dict[int, int] = {}
        self.exit_status: dict[int, int] = {}  # rank -> status, of the workers gone
        self.controls: dict[int, socket.socket] = {}  # rank -> the keeper's end
        self.pipes: list[int] = []  # read ends: 2 per rank (stdout, stderr), rank order
        self.labels: dict[int, str] = {}  # read end -> "[dims] " prefix
        self.draining: set[int] = set()
        self.attached: bool = True
        self.detached_at: float | None = None
        self.stopping_at: float | None = None
        self.log_file = None
        self.record = None  # registry.Record, written when started

    def serve(self) -> None:
        try:
            super().serve()
        except BaseException:  # noqa: BLE001 - a bug of ours: said in the log; no mesh is left
            traceback.print_exc()  # (stderr is the mesh's log)
            self.note("the keeper failed (above): ending the mesh")
            self.kill_children()
            self.finish()

    # ---- hooks -------------------------------------------------------------------------------
    def started(self) -> None:
        from monarch_dsl.runtime import registry

        record, sock_path, log_path = registry.paths(self.config.name)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.log_file = open(fd, "wb", buffering=0)  # noqa: SIM115 - lives as long as we do
        os.dup2(fd, 2)  # our own errors go there too
        try:
            sock_path.unlink()
        except FileNotFoundError:
            pass
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(sock_path))
        os.chmod(sock_path, 0o600)
        self.listener.listen(8)
        self.sel.register(self.listener, selectors.EVENT_READ, "listener")
        self.record = registry.Record(
            name=self.config.name,
            pid=os.getpid(),
            socket=str(sock_path),
            secret=self.config.secret.hex(),
            dims=list(self.config.dims),
            sizes=list(self.config.sizes),
            idle_timeout=self.config.idle_timeout,
            created=time.time(),
            hostname=socket.gethostname(),
            log=str(log_path),
            controller=os.getppid(),
            since=time.time(),
        )
        registry.write(self.record)

    def set_controller(self, pid: int) -> None:
        """Record who drives the mesh now (``monarch-dsl ls`` shows it)."""
        from monarch_dsl.runtime import registry

        self.record.controller, self.record.since = pid, time.time()
        try:
            registry.write(self.record)
        except OSError as e:
            self.note(f"could not update the record: {e}")

    def select_timeout(self) -> float | None:
        now = time.monotonic()
        if self.stopping_at is not None:
            return max(0.0, self.stopping_at + KEEPER_STOP_GRACE - now)
        if self.detached_at is not None:
            return max(0.0, self.detached_at + self.config.idle_timeout - now)
        return None

    def tick(self) -> None:
        now = time.monotonic()
        if self.stopping_at is not None:
            if now >= self.stopping_at + KEEPER_STOP_GRACE:
                self.kill_children()
        elif self.detached_at is not None and now >= self.detached_at + self.config.idle_timeout:
            self.note(f"no controller for {self.config.idle_timeout:g} s (idle_timeout): stopping")
            self.stop_workers()
        if self.pids and not self.children and (not self.attached or self.stopping_at):
            self.finish()

    def child_close(self) -> None:
        super().child_close()
        if self.listener is not None:
            self.listener.close()
        for ctl in self.controls.values():
            ctl.close()
        for fd in self.pipes:
            os.close(fd)
        if self.log_file is not None:
            self.log_file.close()

    def on_event(self, key: selectors.SelectorKey) -> None:
        if key.data == "listener":
            self.accept()
        elif isinstance(key.data, tuple) and key.data[0] == "pipe":
            self.drain(key.data[1])
        elif isinstance(key.data, tuple) and key.data[0] == "control":
            self.sel.unregister(key.fileobj)  # (a worker's end closed: reap says why)
        else:
            super().on_event(key)

    def on_controller_lost(self) -> None:
        self.sel.unregister(self.chan)
        self.chan.close()
        self.attached = False
        if self.stopping_at is not None:
            return
        self.detached_at = time.monotonic()
        self.note("the controller detached")
        self.set_controller(0)
        for fd in self.pipes:
            if fd not in self.draining:
                self.sel.register(fd, selectors.EVENT_READ, ("pipe", fd))
                self.draining.add(fd)

    def handle(self, msg, fds: list[int]) -> None:
        if isinstance(msg, ForkWorkers) and not self.pids:
            self.fork_workers(msg)
        elif isinstance(msg, Shutdown):
            self.stop_workers()
        else:
            super().handle(msg, fds)

    def exited(self, pid: int, status: int) -> None:
        rank = self.rank_of.get(pid)
        if rank is not None:
            self.exit_status[rank] = status
            ctl = self.controls.pop(rank, None)
            if ctl is not None:
                try:
                    self.sel.unregister(ctl)
                except (KeyError, ValueError):
                    pass
                ctl.close()
        if self.attached:
            super().exited(pid, status)
        elif rank is not None:
            self.note(f"worker rank {rank} (pid {pid}) {describe_status(status)}")

    # ---- workers -----------------------------------------------------------------------------
    def fork_workers(self, msg: ForkWorkers) -> None:
        ends = []
        for rank in msg.ranks:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            ends.append((rank, out_w, err_w, theirs))
            self.controls[rank] = mine  # (all ours before any fork: each child closes them)
            self.sel.register(mine, selectors.EVENT_READ, ("control", rank))
            coords = coords_of_index(rank, self.config.sizes)
            label = ",".join(f"{d}={c}" for d, c in zip(self.config.dims, coords))
            for fd in (out_r, err_r):
                self.pipes.append(fd)
                self.labels[fd] = f"[{label}] "
        theirs_fds = [
            fd for _, out_w, err_w, theirs in ends for fd in (out_w, err_w, theirs.fileno())
        ]
        for rank, out_w, err_w, theirs in ends:
            body = self._worker_body(msg, rank, keeper_fd=theirs.fileno())
            pid = self.fork(body, out_w, err_w, theirs_fds, group=False, keep=theirs.fileno())
            self.pids.append(pid)
            self.rank_of[pid] = rank
        for _, out_w, err_w, theirs in ends:
            os.close(out_w)
            os.close(err_w)
            theirs.close()
        socket.send_fds(
            self.chan, [pickle.dumps(Attached(msg.request_id, tuple(self.pids)))], self.pipes
        )

    def stop_workers(self) -> None:
        if self.stopping_at is None:
            self.stopping_at = time.monotonic()
        for ctl in self.controls.values():
            try:
                _send(ctl, StopWorker())
            except OSError:
                pass

    def finish(self) -> None:
        from monarch_dsl.runtime import registry

        record, sock_path, _ = registry.paths(self.config.name)
        for path in (record, sock_path):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        self.note("stopped")
        os._exit(0)

    # ---- controllers -------------------------------------------------------------------------
    def accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            conn.settimeout(KEEPER_HANDSHAKE_TIMEOUT)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            uid = int.from_bytes(creds[4:8], sys.byteorder)
            secret = conn.recv(256)
            data = conn.recv(MAX_MESSAGE)  # (read before answering: unread data resets)
            if uid != os.getuid() or not hmac.compare_digest(secret, self.config.secret):
                _send(conn, AttachRefused("wrong secret (only the mesh's owner can attach)"))
                conn.close()
                return
            msg = pickle.loads(data)  # (only from the owner, who knows the secret)
            if not isinstance(msg, Attach):
                raise ValueError(f"expected Attach, got {type(msg).__name__}")
            if self.attached or self.stopping_at is not None:
                why = "is stopping" if self.stopping_at is not None else "has a controller"
                _send(
                    conn,
                    AttachRefused(
                        f"persistent mesh {self.config.name!r} {why}: one controller at a time "
                        f"(detach or stop the other first)"
                    ),
                )
                conn.close()
                return
            conn.settimeout(None)
        except (OSError, ValueError, pickle.UnpicklingError, EOFError) as e:
            self.note(f"refused a connection: {e}")
            conn.close()
            return
        for fd in self.draining:
            self.sel.unregister(fd)
        self.draining.clear()
        self.chan = conn
        self.sel.register(conn, selectors.EVENT_READ, "chan")
        self.attached = True
        self.detached_at = None
        self.note(f"controller pid {msg.pid} attached")
        self.set_controller(msg.pid)
        attached = Attached(0, tuple(self.pids), dict(self.exit_status))
        socket.send_fds(conn, [pickle.dumps(attached)], self.pipes)
        for ctl in self.controls.values():
            try:
                _send(ctl, Reconnect(msg.address))
            except OSError:
                pass

    # ---- logs --------------------------------------------------------------------------------
    def drain(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(fd)
            self.draining.discard(fd)
            return
        prefix = self.labels.get(fd, "").encode()
        lines = data.splitlines(keepends=True)
        self.write_log(b"".join(prefix + line for line in lines))

    def note(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.write_log(f"monarch_dsl keeper {stamp}: {text}\n".encode())

    def write_log(self, data: bytes) -> None:
        if self.log_file is not None:
            try:
                self.log_file.write(data)
            except OSError:
                pass


KEEPER_HANDSHAKE_TIMEOUT = 5.0


def keeper_main() -> None:
    """Entry point of a persistent mesh's keeper: ``python -c _KEEPER FD``; the first message
    on the channel is its ``KeeperConfig``."""
    os.environ["MONARCH_DSL_ROLE"] = "keeper"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    chan = socket.socket(fileno=int(sys.argv[1]))
    config = pickle.loads(chan.recv(MAX_MESSAGE))
    import torch  # noqa: F401 - imported once, here

    from monarch_dsl.runtime import worker  # noqa: F401

    Keeper(chan, config).serve()


# =============================================================================== scripts


def _text_stream(fd: int, like: Any) -> Any:
    """A line-buffered text stream on ``fd`` with ``like``'s encoding and errors."""
    return open(  # noqa: SIM115 - the process's stream, open until it exits
        fd, "w", buffering=1, closefd=False,
        encoding=getattr(like, "encoding", None), errors=getattr(like, "errors", None),
    )  # fmt: skip


def run_script(
    script: str,
    args: tuple[str, ...],
    env: dict[str, str],
    sys_path: tuple[str, ...],
    cwd: str,
    module: bool = False,
) -> int:
    """In a process just forked from the fork server: run ``script`` as ``__main__`` as a fresh
    ``python script ARGS`` would (``module``: as ``python -m script ARGS``: the working
    directory first on sys.path, argv[0] the module's file), with exactly ``env`` as its
    environment; returns its exit code (SystemExit's, 1 for an uncaught exception, reported
    through ``sys.excepthook``: the traceback on stderr unless the script set its own)."""
    os.environ.clear()
    os.environ.update(env)
    _as_if_fresh(env)
    sys.argv[:] = [script, *args]
    first = first_path(script, module, cwd)
    sys.path[:] = [first, *(p for p in sys_path if p and p != first)]
    os.chdir(cwd)
    code = 0
    old_main = sys.modules.get("__main__")
    try:
        run_main(script, module)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:  # noqa: BLE001 - as the interpreter would: report it, exit 1
        _report_uncaught(e, script)
        code = 1
        if isinstance(e, KeyboardInterrupt):
            code = 128 + signal.SIGINT
    # What the interpreter does at exit, in its order: join non-daemon threads, run atexit
    # (the script's module still __main__: a handler may pickle its classes), then drop the
    # main module (what its globals held is freed: a file it opened and never closed is
    # flushed and closed, as at a real exit).
    try:
        threading._shutdown()  # type: ignore[attr-defined] # as multiprocessing's children do
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    atexit._run_exitfuncs()
    atexit._clear()  # (they ran; what they refer to of the script goes with the rest)
    _drop_main(old_main)
    return code


def _runs_as_package(script: str) -> bool:
    """``python script`` runs a directory's or a zip file's ``__main__.py``."""
    return os.path.isdir(script) or zipfile.is_zipfile(script)


def first_path(script: str, module: bool, cwd: str) -> str:
    """What ``python [-m] script`` puts first on ``sys.path``: the working directory ``cwd``
    for a module, a directory or zip file itself, else the script's directory."""
    if module:
        return cwd
    if _runs_as_package(script):
        return script
    return os.path.dirname(os.path.abspath(script))


def run_main(script: str, module: bool) -> None:
    """Run ``script`` (a file, source or compiled, a directory or zip with a ``__main__.py``,
    or with ``module`` a module name) as ``python [-m] script`` runs it: in a new module that
    is ``sys.modules["__main__"]`` from then on, whose ``__builtins__`` is the builtins module
    and ``__file__`` absolute, compiled without this file's ``from __future__`` flags, with
    CPython's own ``runpy`` steps for ``-m`` and packages. The caller has set ``sys.argv``
    and ``sys.path``."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    if module:
        runpy._run_module_as_main(script, alter_argv=True)  # type: ignore[attr-defined]
        return
    if _runs_as_package(script):
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        return
    path = os.path.abspath(script)
    with open(path, "rb") as f:
        code = pkgutil.read_code(f)  # a .pyc (None: not one)
    if code is None:
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
    loader = importlib.machinery.SourceFileLoader("__main__", path)
    loader._md_globals = main.__dict__  # type: ignore[attr-defined] # (see _drop_main)
    main.__dict__.update(
        __file__=path, __cached__=None, __package__=None, __spec__=None, __loader__=loader
    )
    exec(code, main.__dict__)  # noqa: S102 - the user's script


def _drop_main(old: types.ModuleType | None) -> None:
    """As the interpreter's exit drops ``__main__``: the script's module leaves
    ``sys.modules`` and its garbage is collected, each finalizer seeing the globals it needs
    (the script's functions and its globals make a cycle, freed only so); then, as the
    interpreter clears a module that outlived that (``_PyModule_ClearDict``: referred to from
    ``sys.excepthook``, a signal handler, a thread), the script's globals are set to None,
    names with one leading underscore first, and what they held is freed. (The globals are
    found through the module's loader, which holds them: a weak reference to it says whether
    they outlived the collection without keeping them alive.)"""
    main = sys.modules.get("__main__")
    loader = getattr(main, "__loader__", None)
    survivor = weakref.ref(loader) if hasattr(loader, "_md_globals") else None
    del main, loader
    if old is not None:
        sys.modules["__main__"] = old
    else:
        sys.modules.pop("__main__", None)
    gc.collect()
    alive = survivor() if survivor is not None else None
    if alive is None:
        return
    names = alive._md_globals
    del alive
    for pass_ in (0, 1):
        for name in list(names):
            if name != "__builtins__" and (pass_ == 1 or (name[:1] == "_" and name[1:2] != "_")):
                names[name] = None
    del names
    gc.collect()


def _report_uncaught(exc: BaseException, script: str) -> None:
    """An exception the script did not catch, as the interpreter reports it: through
    ``sys.excepthook`` where the script set one, else the traceback from the script's own
    frames on."""
    hook = sys.excepthook
    if hook is sys.__excepthook__:
        _print_script_traceback(exc, script)
        return
    try:
        hook(type(exc), exc, _script_frames(exc, script))
    except BaseException as e:  # noqa: BLE001 - as the interpreter: say so, then the original
        print("Error in sys.excepthook:", file=sys.stderr)
        traceback.print_exception(type(e), e, e.__traceback__)
        print("\nOriginal exception was:", file=sys.stderr)
        _print_script_traceback(exc, script)


def _as_if_fresh(env: dict[str, str]) -> None:
    """Undo the state a fork inherits from the fork server (or the controller it was forked
    from) that a fresh interpreter would not have."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if sig == signal.SIGINT:
            handler = signal.default_int_handler
        elif sig in (signal.SIGPIPE, getattr(signal, "SIGXFSZ", None)):
            handler = signal.SIG_IGN  # as Python sets them at startup
        else:
            handler = signal.SIG_DFL
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError, RuntimeError):
            pass
    atexit._clear()
    sys.excepthook = sys.__excepthook__
    threading.excepthook = threading.__excepthook__
    faulthandler.disable()
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    if "logging" in sys.modules:  # the controller's handlers would swallow basicConfig()
        import logging

        logging.root.handlers.clear()
        logging.root.setLevel(logging.WARNING)
    # Random state: forked children would all draw the same numbers (fresh ones differ).
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    import torch

    torch.seed()
    # torch read OMP_NUM_THREADS when the fork server imported it; the script's may differ.
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)  # sys.exit("message"): printed, exit 1
    return 1


def _script_frames(exc: BaseException, script: str) -> Any:
    """``exc``'s traceback from the script's own frames on (not runpy's or ours)."""
    tb = exc.__traceback__
    main = sys.argv[0] if sys.argv else script  # (a module's file, once runpy set it)
    names = (script, main, os.path.abspath(script))
    while tb is not None and tb.tb_frame.f_code.co_filename not in names:
        tb = tb.tb_next
    return tb or exc.__traceback__


def _print_script_traceback(exc: BaseException, script: str) -> None:
    """The traceback from the script's own frames on (not runpy's or ours)."""
    traceback.print_exception(type(exc), exc, _script_frames(exc, script))


# =============================================================================== client


def describe_status(status: int | None) -> str:
    """A child's exit status as the fork server reports it (``ChildExited``), in words."""
    if status is None:
        return "exited (status unknown)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"was killed by signal {name}"
    return f"exited with code {os.WEXITSTATUS(status)}"


# The command of a fresh-interpreter fork server (not ``python -m`` this module: importing
# monarch_dsl imports it, and runpy would run a second copy as __main__).
_FRESH = "from monarch_dsl.runtime.forkserver import main; main()"
_KEEPER = "from monarch_dsl.runtime.forkserver import keeper_main; keeper_main()"


class ForkServerClient:
    """The controller's handle on its fork server (one per controller process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chan: socket.socket | None = None
        self._pid: int | None = None
        self._proc: subprocess.Popen | None = None
        self._requests: dict[int, Future] = {}
        self._exit_watchers: dict[int, Callable[[int], None]] = {}
        self._exited: dict[int, int] = {}
        self._ids = itertools.count(1)
        self.mode = ""
        self._stderr_path = ""
        self._closed = False
        self._lost = False  # the fork server died (its exits will not come)
        self._restartable = True  # fork() starts the fork server again (fork_server()'s)

    # ------------------------------------------------------------------ start
    def ensure_started(self, timeout: float = 120.0) -> None:
        with self._lock:
            if self._chan is not None:
                return
            want = os.environ.get("MONARCH_DSL_FORK_SERVER", "fork")
            if want not in ("fork", "fresh"):
                raise ValueError(f"MONARCH_DSL_FORK_SERVER must be 'fork' or 'fresh', got {want!r}")
            reason = ""
            if want == "fork":
                reason = self._fork_unsafe_reason()
                if not reason:
                    ready = self._start_forked(timeout)
                    if isinstance(ready, ForkServerReady):
                        self.mode = "forked from the controller"
                        return self._start_reader()
                    reason = ready.reason
            self._start_fresh(timeout)
            self.mode = "fresh interpreter"
            if reason:
                log.info("monarch_dsl: fork server started fresh because %s", reason)
            self._start_reader()

    @staticmethod
    def _fork_unsafe_reason() -> str:
        if not hasattr(os, "fork"):
            return "this platform cannot fork"
        torch = sys.modules.get("torch")
        # A torch built with CUDA: asking it whether a GPU is there (torch.cuda.is_available,
        # as most scripts do) already makes its forked children refuse to use CUDA, so
        # workers on such a build come from a fresh interpreter. (CPU builds fork.)
        if torch is not None and torch.cuda._is_compiled():
            return "torch is built with CUDA (a forked worker could not initialize it)"
        return ""

    def _start_forked(self, timeout: float):
        from monarch_dsl.runtime import worker  # noqa: F401 - imported before the fork

        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            try:
                os.environ["MONARCH_DSL_ROLE"] = "fork-server"
                parent.close()
                os.setsid()
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                ForkServer(child, forked_from_controller=True).serve()
            finally:
                os._exit(1)
        child.close()
        msg = self._first_message(parent, timeout, lambda: "")
        if isinstance(msg, ForkServerUnsafe):
            os.waitpid(pid, 0)
            parent.close()
            return msg
        self._chan, self._pid = parent, pid
        return msg

    @classmethod
    def start_fresh(
        cls,
        prefix: Sequence[str] = (),
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> ForkServerClient:
        """A fork server of a fresh interpreter started through ``prefix`` (a command that
        execs the rest of its argv: a remote worker's bootstrap), with environment ``env``
        (default: this process's), and our channel to it; its own, not this process's
        ``fork_server()``, and not started again when it dies (``fork`` raises)."""
        return cls._started("fresh interpreter", timeout, prefix=prefix, env=env)

    @classmethod
    def _started(cls, mode: str, timeout: float, **how: Any) -> ForkServerClient:
        """A client of a new fork server started by ``_start_fresh(timeout, **how)``; not
        restarted when it dies."""
        client = cls()
        client._restartable = False
        client._start_fresh(timeout, **how)
        client.mode = mode
        client._start_reader()
        return client

    @property
    def alive(self) -> bool:
        """Whether our channel to the fork server is open (it has not died)."""
        return self._chan is not None

    def _start_fresh(
        self,
        timeout: float,
        keeper: KeeperConfig | None = None,
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd, self._stderr_path = tempfile.mkstemp(prefix="monarch_dsl-forkserver-", suffix=".err")
        env = dict(
            os.environ if env is None else env,
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        )
        if keeper is not None:
            _send(parent, keeper)  # (read first thing, before torch is imported)
        self._proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", _KEEPER if keeper else _FRESH, str(child.fileno())],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            stderr=fd,
            env=env,
            start_new_session=True,
        )
        os.close(fd)
        child.close()
        try:
            self._first_message(parent, timeout, self._fresh_stderr)
        finally:
            # The fork server keeps its fd; the name is only needed to report a failed start.
            os.unlink(self._stderr_path)
        self._chan, self._pid = parent, self._proc.pid

    def _fresh_stderr(self) -> str:
        try:
            with open(self._stderr_path, errors="replace") as f:
                return f.read()[-8000:]
        except OSError:
            return ""

    @staticmethod
    def _first_message(chan: socket.socket, timeout: float, stderr: Callable[[], str]):
        chan.settimeout(timeout)
        try:
            data = chan.recv(1 << 20)
        except TimeoutError:
            data = None
        chan.settimeout(None)
        if not data:
            what = "did not start in time" if data is None else "exited during startup"
            raise SpawnError(f"the monarch_dsl fork server {what}", stderr=stderr())
        return pickle.loads(data)

    def _start_reader(self) -> None:
        self._lost = False  # (a new channel: its children's exits will come)
        threading.Thread(target=self._read_loop, name="md-forkserver", daemon=True).start()

    # ------------------------------------------------------------------ use
    def fork(self, request: ForkWorkers, fds: Sequence[int], timeout: float) -> tuple[int, ...]:
        if self._restartable:
            self.ensure_started()
        fut: Future = Future()
        request = request._replace(request_id=next(self._ids))
        with self._lock:
            chan = self._chan
            if chan is None:
                raise SpawnError("the monarch_dsl fork server died")
            self._requests[request.request_id] = fut
        socket.send_fds(chan, [pickle.dumps(request)], list(fds))
        return fut.get(timeout)

    # ------------------------------------------------------------------ keepers
    @classmethod
    def start_keeper(cls, config: KeeperConfig, timeout: float) -> ForkServerClient:
        """A new keeper (a persistent mesh's fork server, see ``Keeper``) and our channel."""
        return cls._started("keeper", timeout, keeper=config)

    def fork_keeper(
        self, request: ForkWorkers, timeout: float
    ) -> tuple[tuple[int, ...], list[int]]:
        """A keeper's workers for ``request``: their pids, and the read ends of their stdout
        and stderr pipes (2 per rank, rank order; ours to close)."""
        fut: Future = Future()
        request = request._replace(request_id=next(self._ids))
        self._requests[request.request_id] = fut
        assert self._chan is not None
        _send(self._chan, request)
        pids, fds, _ = fut.get(timeout)
        return pids, fds

    @classmethod
    def attach_keeper(
        cls, path: str, secret: bytes, address: str, timeout: float
    ) -> tuple[ForkServerClient, Attached, list[int]]:
        """Join the keeper listening at ``path`` as the controller whose workers connect to
        ``address``: (our channel, its ``Attached``: the workers' pids and the exit status of
        those gone, their pipes' read ends). Raises
        ``ConnectionRefusedError`` with the keeper's reason when it says no."""
        chan = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        chan.settimeout(timeout)
        try:
            chan.connect(path)
            chan.send(secret)
            _send(chan, Attach(address, os.getpid()))
            data, fds, _, _ = socket.recv_fds(chan, MAX_MESSAGE, MAX_FDS)
        except BaseException:
            chan.close()
            raise
        msg = pickle.loads(data) if data else None
        if not isinstance(msg, Attached):
            chan.close()
            for fd in fds:
                os.close(fd)
            reason = msg.reason if isinstance(msg, AttachRefused) else "the keeper hung up"
            raise ConnectionRefusedError(reason)
        chan.settimeout(None)
        client = cls()
        client._chan, client.mode = chan, "keeper"
        client._start_reader()
        return client, msg, fds

    def shutdown_keeper(self) -> None:
        """Tell our keeper the mesh is stopped (it ends the workers and exits)."""
        chan = self._chan
        if chan is not None:
            try:
                _send(chan, Shutdown())
            except OSError:
                pass

    def close(self) -> None:
        """Close our channel (a keeper then waits for the next controller)."""
        with self._lock:
            chan, self._chan = self._chan, None
            self._closed = True
        if chan is not None:
            try:
                chan.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            chan.close()

    def watch_exit(self, pid: int, callback: Callable[[int], None]) -> None:
        """Call ``callback(status)`` (from the reader thread) when ``pid`` exits."""
        with self._lock:
            status = self._exited.pop(pid, None)
            if status is None and self._lost:  # (it died: no exit will be reported)
                status = -1
            if status is None:
                self._exit_watchers[pid] = callback
                return
        callback(status)

    def _read_loop(self) -> None:
        chan = self._chan
        assert chan is not None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(chan, MAX_MESSAGE, MAX_FDS)
            except OSError:
                data, fds = b"", []
            if not data:
                self._on_lost()
                return
            msg = pickle.loads(data)
            if isinstance(msg, Forked):
                fut = self._requests.pop(msg.request_id, None)
                if fut is not None:
                    fut.set_result(msg.pids)
            elif isinstance(msg, Attached):  # a keeper's workers: their pids and pipes
                fut = self._requests.pop(msg.request_id, None)
                if fut is not None:
                    fut.set_result((msg.pids, fds, msg.exited))
                else:
                    for fd in fds:
                        os.close(fd)
            elif isinstance(msg, ChildExited):
                with self._lock:
                    cb = self._exit_watchers.pop(msg.pid, None)
                    if cb is None:
                        self._exited[msg.pid] = msg.status
                if cb is not None:
                    cb(msg.status)

    def _on_lost(self) -> None:
        with self._lock:
            self._chan = None
            self._lost = not self._closed
            watchers, self._exit_watchers = self._exit_watchers, {}
            requests, self._requests = self._requests, {}
        if self._closed:  # we closed it (a controller detaching from a keeper)
            return
        err = SpawnError("the monarch_dsl fork server died")
        for fut in requests.values():
            fut.set_exception(err)
        for cb in watchers.values():
            cb(-1)


_fork_server = ForkServerClient()


def fork_server() -> ForkServerClient:
    return _fork_server


def main() -> None:
    """Entry point of a fresh-interpreter fork server: ``python -c _FRESH FD``."""
    os.environ["MONARCH_DSL_ROLE"] = "fork-server"
    chan = socket.socket(fileno=int(sys.argv[1]))
    import torch  # noqa: F401 - the whole point: imported once, here

    from monarch_dsl.runtime import worker  # noqa: F401

    ForkServer(chan, forked_from_controller=False).serve()
