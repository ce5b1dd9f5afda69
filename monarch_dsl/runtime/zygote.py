"""The fork server: one warm process per controller that forks workers on request.

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
- *a fresh interpreter* (``python -m monarch_dsl.runtime.zygote FD``), which imports torch
  itself.

The fork server is single-threaded (so forking it is always safe), lives in its own session
(Ctrl-C in the controller's terminal does not reach the workers), kills its children and exits
when the controller's end of the channel closes, and reports every child's exit status.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import selectors
import signal
import socket
import sys
import traceback

from monarch_dsl.runtime.messages import (
    ChildExited,
    Forked,
    ForkServerReady,
    ForkServerUnsafe,
    ForkWorkers,
)

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
        if not data:  # the controller is gone: so are its workers
            for pid in self.children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os._exit(0)
        msg = pickle.loads(data)
        if not isinstance(msg, ForkWorkers):
            return
        pids = []
        for i, rank in enumerate(msg.ranks):
            pids.append(self.fork_worker(msg, rank, fds[2 * i], fds[2 * i + 1], fds))
        for fd in fds:
            os.close(fd)
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
            _send(self.chan, ChildExited(pid, status))

    def fork_worker(self, msg: ForkWorkers, rank: int, out_fd: int, err_fd: int, fds) -> int:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid:
            self.children.add(pid)
            return pid
        code = 1
        try:
            me = os.getppid()
            _set_parent_death_signal()
            if os.getppid() != me:
                os._exit(1)
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
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - the controller reads this from our stderr
            traceback.print_exc()
        finally:
            try:
                sys.stderr.flush()
            finally:
                os._exit(code)
        raise AssertionError("unreachable")


def main() -> None:
    """Entry point of a fresh-interpreter fork server: ``python -m ... FD``."""
    os.environ["MONARCH_DSL_ROLE"] = "fork-server"
    chan = socket.socket(fileno=int(sys.argv[1]))
    import torch  # noqa: F401 - the whole point: imported once, here

    from monarch_dsl.runtime import worker  # noqa: F401

    ForkServer(chan, forked_from_controller=False).serve()


if __name__ == "__main__":
    main()
