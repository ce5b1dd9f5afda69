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
import ctypes
import faulthandler
import itertools
import logging
import os
import pickle
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Sequence

from monarch_dsl.errors import SpawnError
from monarch_dsl.runtime.future import Future
from monarch_dsl.runtime.messages import (
    ChildExited,
    Forked,
    ForkScripts,
    ForkServerReady,
    ForkServerUnsafe,
    ForkWorkers,
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
        sel = selectors.DefaultSelector()
        sel.register(self.chan, selectors.EVENT_READ, "chan")
        sel.register(wake_r, selectors.EVENT_READ, "child")
        _send(self.chan, ForkServerReady(os.getpid(), self.forked))
        while True:
            for key, _ in sel.select():
                if key.data == "chan":
                    self.on_request()
                else:
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        pass
                    self.reap()

    def on_request(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.chan, MAX_MESSAGE, MAX_FDS)
        except OSError:
            data, fds = b"", []
        if not data:  # the controller is gone: so are its workers and scripts
            for pid in self.children:
                try:
                    if pid in self.groups:
                        os.killpg(pid, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            os._exit(0)
        msg = pickle.loads(data)
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
            _send(self.chan, ChildExited(pid, status))

    def fork(self, body: Callable[[], int], out_fd: int, err_fd: int, fds, *, group: bool) -> int:
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
            self.chan.close()
            for fd in self.wake_fds:
                os.close(fd)
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            for fd in fds:
                os.close(fd)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            # Fresh text streams on fds 1 and 2: the inherited sys.stdout/sys.stderr may not
            # write to those fds at all (e.g. pytest's capture in a forked controller).
            sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
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
    def _worker_body(msg: ForkWorkers, rank: int) -> Callable[[], int]:
        def body() -> int:
            os.environ.update(msg.env)
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


# =============================================================================== scripts


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
    environment; returns its exit code (SystemExit's, 1 for an uncaught exception, whose
    traceback goes to stderr)."""
    os.environ.clear()
    os.environ.update(env)
    _as_if_fresh(env)
    sys.argv[:] = [script, *args]
    first = cwd if module else os.path.dirname(script)
    sys.path[:] = [first, *(p for p in sys_path if p and p != first)]
    os.chdir(cwd)
    code = 0
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:  # noqa: BLE001 - as the interpreter would: print it, exit 1
        _print_script_traceback(e, script)
        code = 1
        if isinstance(e, KeyboardInterrupt):
            code = 128 + signal.SIGINT
    # What the interpreter does at exit, in its order: join non-daemon threads, run atexit.
    try:
        threading._shutdown()  # type: ignore[attr-defined] # as multiprocessing's children do
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    atexit._run_exitfuncs()
    return code


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


def _print_script_traceback(exc: BaseException, script: str) -> None:
    """The traceback from the script's own frames on (not runpy's or ours)."""
    tb = exc.__traceback__
    main = sys.argv[0] if sys.argv else script  # (a module's file, once runpy set it)
    while tb is not None and tb.tb_frame.f_code.co_filename not in (script, main):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


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

    def _start_fresh(self, timeout: float) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd, self._stderr_path = tempfile.mkstemp(prefix="monarch_dsl-forkserver-", suffix=".err")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _FRESH, str(child.fileno())],
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
        threading.Thread(target=self._read_loop, name="md-forkserver", daemon=True).start()

    # ------------------------------------------------------------------ use
    def fork(self, request: ForkWorkers, fds: Sequence[int], timeout: float) -> tuple[int, ...]:
        self.ensure_started()
        fut: Future = Future()
        request = request._replace(request_id=next(self._ids))
        self._requests[request.request_id] = fut
        assert self._chan is not None
        socket.send_fds(self._chan, [pickle.dumps(request)], list(fds))
        return fut.get(timeout)

    def watch_exit(self, pid: int, callback: Callable[[int], None]) -> None:
        """Call ``callback(status)`` (from the reader thread) when ``pid`` exits."""
        with self._lock:
            status = self._exited.pop(pid, None)
            if status is None:
                self._exit_watchers[pid] = callback
                return
        callback(status)

    def _read_loop(self) -> None:
        assert self._chan is not None
        while True:
            try:
                data = self._chan.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                self._on_lost()
                return
            msg = pickle.loads(data)
            if isinstance(msg, Forked):
                fut = self._requests.pop(msg.request_id, None)
                if fut is not None:
                    fut.set_result(msg.pids)
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
            watchers, self._exit_watchers = self._exit_watchers, {}
            requests, self._requests = self._requests, {}
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
