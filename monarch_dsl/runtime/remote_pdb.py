"""``breakpoint()`` in a worker: a pdb whose terminal is the controller (runtime/debugger.py).

The worker sets ``sys.breakpointhook`` at startup (``install``). A ``breakpoint()`` -- in a sync
endpoint on the worker's main loop, an async one on its asyncio thread, a remote function on
its stream's thread -- pauses only the thread that called it. That thread dials the controller's
listener on a connection of its own (authenticated with the job's token, as workers are) and
runs pdb with that connection as its stdin and stdout: ``DebugOutput`` carries what pdb writes
(``waiting`` once it reads its next command), ``DebugInput`` the commands. The worker's main
connection is not touched, so nothing else has to be routed around a paused thread.

A session is one stop: ``continue`` (or ``quit``) closes the connection, which the controller
reads as "resumed"; a later stop (a breakpoint set with ``b``) dials again.
"""

from __future__ import annotations

import os
import pdb
import socket
import sys
from types import FrameType
from typing import Any

from monarch_dsl.runtime import context, transport
from monarch_dsl.runtime.messages import DebugHello, DebugInput, DebugOutput, DebugWhere

_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))
# The frames that run user code in a worker, and what they say about it: (file, function).
_ENDPOINT_FRAMES = {("worker.py", "call_endpoint"), ("worker.py", "_run_async")}
_REMOTE_FRAMES = {("executor.py", "call_function")}

_controller: tuple[str, bytes, int] | None = None  # (address, token, worker rank)


def install(address: str, token: bytes, worker_rank: int) -> None:
    """Make ``breakpoint()`` in this worker pause the calling thread under a remote pdb."""
    global _controller
    _controller = (address, token, worker_rank)
    sys.breakpointhook = _breakpoint


def _breakpoint(*args: Any, **kwargs: Any) -> Any:
    hook = os.environ.get("PYTHONBREAKPOINT")
    if hook is not None and hook not in ("", "pdb.set_trace"):
        return sys.__breakpointhook__(*args, **kwargs)  # "0" (off) or the user's own hook
    frame = sys._getframe(1)
    assert _controller is not None
    debugger = RemotePdb(*_controller, actor=_actor_of(frame))
    try:
        debugger.channel.connect()
    except (OSError, transport.ProtocolError) as e:
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        print(
            f"monarch_dsl: breakpoint() at {where} cannot reach the controller's debugger ({e}); "
            "going on",
            file=sys.stderr,
            flush=True,
        )
        return None
    debugger.set_trace(frame)
    return None


def _actor_of(frame: FrameType | None) -> str:
    """The actor class whose endpoint runs ``frame`` (its caller chain), ``@remote`` inside a
    remote function, ``-`` elsewhere."""
    while frame is not None:
        code = frame.f_code
        if os.path.dirname(code.co_filename) == _RUNTIME_DIR:
            key = (os.path.basename(code.co_filename), code.co_name)
            if key in _ENDPOINT_FRAMES:
                return type(frame.f_locals.get("instance")).__name__
            if key in _REMOTE_FRAMES:
                return "@remote"
        frame = frame.f_back
    return "-"


class Channel:
    """pdb's stdin and stdout: a connection to the controller."""

    def __init__(self, address: str, token: bytes, worker_rank: int, actor: str):
        self.address, self.token, self.worker_rank, self.actor = address, token, worker_rank, actor
        self.conn: transport.Connection | None = None
        self.announced = False
        self._out: list[str] = []
        self.encoding = "utf-8"

    def connect(self) -> None:
        if self.conn is None:
            sock = transport.dial(self.address)
            transport.handshake_dialer(sock, self.token)
            sock.settimeout(None)  # a paused rank waits for its user as long as it takes
            self.conn = transport.Connection(sock, self.address)
            self.announced = False

    def stopped_at(self, frame: FrameType) -> None:
        """Tell the controller where this thread stopped (the first time: who it is)."""
        self.connect()
        assert self.conn is not None
        code = frame.f_code
        name = getattr(code, "co_qualname", code.co_name)
        if self.announced:
            self.conn.send(DebugWhere(name, code.co_filename, frame.f_lineno))
            return
        try:
            point = context.current_rank()
            rank, coords = point.rank, tuple(point.items())
        except RuntimeError:  # before the worker was configured
            rank, coords = self.worker_rank, ()
        self.conn.send(
            DebugHello(
                rank,
                coords,
                self.worker_rank,
                os.getpid(),
                socket.gethostname(),
                self.actor,
                name,
                code.co_filename,
                frame.f_lineno,
            )
        )
        self.announced = True

    # -- the file interface pdb uses
    def write(self, text: str) -> int:
        self._out.append(text)
        return len(text)

    def flush(self) -> None:
        self._send(waiting=False)

    def readline(self) -> str:
        self._send(waiting=True)
        if self.conn is None:
            return "continue\n"
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError, transport.ProtocolError):
                self.close()
                return "continue\n"  # the controller went away: do not stay paused for nobody
            if isinstance(msg, DebugInput):
                return msg.line.rstrip("\n") + "\n"

    def isatty(self) -> bool:
        return False

    def _send(self, waiting: bool) -> None:
        if self.conn is None or not (self._out or waiting):
            return
        text, self._out = "".join(self._out), []
        try:
            self.conn.send(DebugOutput(text, waiting))
        except OSError:
            self.close()

    def close(self) -> None:
        if self.conn is not None:
            self._send(waiting=False)
            self.conn.close()
            self.conn = None


class RemotePdb(pdb.Pdb):
    """pdb on a ``Channel``: each stop is reported to the controller; resuming (``continue``,
    ``quit``) ends the session."""

    def __init__(self, address: str, token: bytes, worker_rank: int, actor: str):
        self.channel = Channel(address, token, worker_rank, actor)
        super().__init__(stdin=self.channel, stdout=self.channel, nosigint=True, readrc=False)
        self.prompt = "(Pdb) "
        self._resumed = False

    def interaction(self, frame: FrameType | None, traceback: Any) -> None:
        self._resumed = False
        if frame is not None:
            try:
                self.channel.stopped_at(frame)
            except (OSError, transport.ProtocolError):
                self.set_continue()  # nobody to talk to: run on
                return
        try:
            super().interaction(frame, traceback)
        finally:
            if self._resumed:
                self.channel.close()

    def set_continue(self) -> None:
        self._resumed = True
        super().set_continue()

    def set_quit(self) -> None:
        self._resumed = True
        super().set_quit()
