"""Forwards worker stdout/stderr to the controller's terminal, prefixed with the worker's rank.

Each local worker writes its fds 1 and 2 into pipes that the controller created, so its output
reaches us even when it dies hard (a segfault message included). We keep the tail of every
worker's stderr: a worker that fails to start or dies is reported with it.
"""

from __future__ import annotations

import collections
import os
import selectors
import sys
import threading

TAIL_BYTES = 16 * 1024


class _Pipe:
    __slots__ = ("fd", "label", "is_err", "partial", "tail", "closed")

    def __init__(self, fd: int, label: str, is_err: bool):
        self.fd = fd
        self.label = label
        self.is_err = is_err
        self.partial = b""
        self.tail: collections.deque[bytes] = collections.deque()
        self.closed = False


class LogForwarder:
    """One thread, one selector over every worker pipe of this controller."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread: threading.Thread | None = None
        self.echo = os.environ.get("MONARCH_DSL_WORKER_OUTPUT", "1") != "0"

    def add(self, fd: int, label: str, is_err: bool) -> _Pipe:
        os.set_blocking(fd, False)
        pipe = _Pipe(fd, label, is_err)
        with self._lock:
            self._sel.register(fd, selectors.EVENT_READ, pipe)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="md-logs", daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"x")
        return pipe

    def drain(self, pipe: _Pipe) -> None:
        """Read whatever is in the pipe now (used before reporting a worker's death)."""
        with self._lock:
            self._read(pipe)

    def remove(self, pipe: _Pipe) -> None:
        """Print what the pipe holds now, then stop reading it and close our end (a
        controller detaching from a persistent mesh: its keeper reads the pipe again)."""
        with self._lock:
            self._read(pipe)
            if not pipe.closed:
                self._close(pipe)

    def stderr_tail(self, pipe: _Pipe | None, max_lines: int = 60) -> str:
        if pipe is None:
            return ""
        self.drain(pipe)
        with self._lock:
            text = b"".join(pipe.tail) + pipe.partial
        lines = text.decode(errors="replace").splitlines()
        return "\n".join(lines[-max_lines:])

    def _run(self) -> None:
        while True:
            events = self._sel.select()
            with self._lock:
                for key, _ in events:
                    if key.data is None:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                    else:
                        self._read(key.data)

    def _read(self, pipe: _Pipe) -> None:
        """Caller holds the lock."""
        while not pipe.closed:
            try:
                chunk = os.read(pipe.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._close(pipe)
                return
            data = pipe.partial + chunk
            cut = data.rfind(b"\n") + 1
            pipe.partial = data[cut:]
            if cut:
                self._emit(pipe, data[:cut])

    def _close(self, pipe: _Pipe) -> None:
        """Caller holds the lock: print the unfinished last line, stop reading, close."""
        if pipe.partial:
            self._emit(pipe, pipe.partial + b"\n")
            pipe.partial = b""
        pipe.closed = True
        self._sel.unregister(pipe.fd)
        os.close(pipe.fd)

    def _emit(self, pipe: _Pipe, data: bytes) -> None:
        if pipe.is_err:
            pipe.tail.append(data)
            size = sum(map(len, pipe.tail))
            while size > TAIL_BYTES and len(pipe.tail) > 1:
                size -= len(pipe.tail.popleft())
        if not self.echo:
            return
        prefix = f"[{pipe.label}] "
        text = "".join(prefix + line + "\n" for line in data.decode(errors="replace").splitlines())
        stream = sys.stderr if pipe.is_err else sys.stdout
        try:
            stream.write(text)
            stream.flush()
        except (ValueError, OSError):  # the controller closed its streams (interpreter exit)
            pass


_forwarder: LogForwarder | None = None
_forwarder_lock = threading.Lock()


def forwarder() -> LogForwarder:
    global _forwarder
    with _forwarder_lock:
        if _forwarder is None:
            _forwarder = LogForwarder()
        return _forwarder
