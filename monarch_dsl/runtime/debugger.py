"""The controller's side of ``breakpoint()`` in workers: stopped ranks, and the console that
drives their pdb sessions (``md.debug()`` here, ``monarch-dsl debug`` from another terminal).

A worker's paused thread dials the job's listener with a ``DebugHello`` (runtime/remote_pdb.py);
``Job._admit`` hands that connection to ``sessions().add``. Each ``Session`` has a reader
thread that collects pdb's output and knows whether pdb is waiting for a command; the session
ends when the connection closes (the rank resumed, or died). Other ranks are not involved: their
replies keep coming, and a call waits only for the paused rank's reply.

The first time a rank stops, and whenever the set of stopped ranks changes while no console is
open, the table of stopped ranks goes to stderr with how to attach. A console is a line-oriented
loop over any text stream (``Console``): the controller's terminal for ``md.debug()``, or a Unix
socket for ``monarch-dsl debug``. That socket lives in a per-user 0700 directory and refuses
peers of another user (``SO_PEERCRED``); its name is the controller's pid.
"""

from __future__ import annotations

import atexit
import itertools
import os
import select
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from monarch_dsl.runtime import transport
from monarch_dsl.runtime.messages import DebugHello, DebugInput, DebugOutput, DebugWhere

COMMAND_TIMEOUT = 60.0  # longest wait for a pdb command's answer before the console moves on
PROMPT = "(md-debug) "
HELP = """commands:
  list                  the stopped ranks
  attach RANK           a pdb session on RANK (pdb's own commands; `detach` leaves it paused)
  cast RANKS CMD        one pdb command on several ranks: RANKS is `all`, `1`, `0-3` or `0,2`
  continue              resume every stopped rank
  quit                  leave the debugger (stopped ranks stay stopped)
"""


# =============================================================================== sessions


class Session:
    """One stopped thread of a worker, with its pdb."""

    def __init__(self, sid: str, hello: DebugHello, conn: transport.Connection):
        self.id = sid
        self.hello = hello
        self.where = (hello.function, hello.filename, hello.lineno)
        self.conn = conn
        self.waiting = False  # pdb is at its prompt
        self.closed = False
        self.attached = False  # a console is relaying to it (one at a time)
        self._out: list[str] = []
        self._cond = threading.Condition()

    @property
    def location(self) -> str:
        return f"{self.where[1]}:{self.where[2]}"

    def read_forever(self, on_close: Callable[[Session], None]) -> None:
        """The session's reader thread: pdb's output in, until the connection closes."""
        try:
            while True:
                msg = self.conn.recv()
                with self._cond:
                    if isinstance(msg, DebugOutput):
                        self._out.append(msg.text)
                        self.waiting = msg.waiting
                    elif isinstance(msg, DebugWhere):
                        self.where = (msg.function, msg.filename, msg.lineno)
                    self._cond.notify_all()
        except (EOFError, OSError, transport.ProtocolError):
            pass
        finally:
            self.conn.close()
            with self._cond:
                self.closed = True
                self._cond.notify_all()
            on_close(self)

    def claim(self) -> bool:
        """Take the session for one console's ``attach`` (False: another console has it)."""
        with self._cond:
            if self.attached:
                return False
            self.attached = True
            return True

    def send(self, line: str) -> None:
        """One command for pdb (the caller checked that pdb is waiting)."""
        with self._cond:
            self.waiting = False
        try:
            self.conn.send(DebugInput(line))
        except OSError:
            pass  # the reader thread sees the connection close

    def output(self, deadline: float) -> tuple[str, bool]:
        """What pdb wrote since the last call, once there is some or pdb is done (waiting for
        a command, or the session closed), or at ``deadline``; and whether pdb is done."""
        with self._cond:
            while not self._out and not self.waiting and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            text, self._out = "".join(self._out), []
            return text, self.waiting or self.closed

    def ready(self, deadline: float) -> bool:
        """Wait until pdb reads a command (True), or the session closes, or ``deadline``."""
        with self._cond:
            while not self.waiting and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self.waiting and not self.closed

    def discard_output(self) -> None:
        with self._cond:
            self._out = []

    def answer(self, deadline: float) -> tuple[str, bool]:
        """All pdb writes until it is done, or until ``deadline``."""
        parts = []
        while True:
            text, done = self.output(deadline)
            parts.append(text)
            if done or time.monotonic() >= deadline:
                return "".join(parts), done


class Sessions:
    """Every stopped rank of this controller, over all its process meshes."""

    def __init__(self) -> None:
        self.by_id: dict[str, Session] = {}
        self.consoles: set[Console] = set()
        self._cond = threading.Condition()
        self._server: DebugServer | None = None
        self._server_error: OSError | None = None

    def add(self, hello: DebugHello, conn: transport.Connection) -> Session:
        """From ``Job._admit``: a worker's thread stopped in ``breakpoint()``."""
        self.server()  # first: the table says how to attach from another terminal
        with self._cond:
            sid = str(hello.rank)
            for n in itertools.count(2):  # the same rank, stopped in two places (meshes, threads)
                if sid not in self.by_id:
                    break
                sid = f"{hello.rank}.{n}"
            session = Session(sid, hello, conn)
            self.by_id[sid] = session
            # Consoles that showed their table already hear of it; the others will show it.
            consoles = [c for c in self.consoles if c.showing]
            if not self.consoles:
                # Under the lock: a console that starts now shows its table after this one,
                # and one that started already (it reads ``by_id`` as soon as it is there)
                # is not interrupted by it.
                self.announce()
            self._cond.notify_all()  # waiters go on once the table is out
        threading.Thread(
            target=session.read_forever, args=(self._remove,), name="md-debug-session", daemon=True
        ).start()
        note = f"\n[rank {sid} stopped in {session.where[0]} at {session.location}]\n"
        for console in consoles:
            console.notify(note)
        return session

    def _remove(self, session: Session) -> None:
        with self._cond:
            if self.by_id.get(session.id) is session:
                del self.by_id[session.id]
            self._cond.notify_all()

    def snapshot(self) -> list[Session]:
        with self._cond:
            return sorted(self.by_id.values(), key=_order)

    def wait_stopped(self, count: int, timeout: float, exactly: bool = False) -> bool:
        """Wait until ``count`` ranks (or more, unless ``exactly``) are stopped at once; False
        after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(
                lambda: len(self.by_id) == count or not exactly and len(self.by_id) > count,
                timeout,
            )

    def table(self) -> str:
        rows = [("rank", "actor", "coords", "host", "function", "file:line")]
        for s in self.snapshot():
            h = s.hello
            coords = ",".join(f"{d}={c}" for d, c in h.coords) or "-"
            rows.append((s.id, h.actor, coords, h.hostname, s.where[0], s.location))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = [
            "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows
        ]
        return "\n".join(line.rstrip() for line in lines)

    def announce(self) -> None:
        """The table of stopped ranks, on the controller's stderr, with how to attach."""
        stopped = self.snapshot()
        if not stopped:
            return
        how = "md.debug() in this process"
        if self.server() is not None:
            how += f", or `monarch-dsl debug --pid {os.getpid()}` from another terminal"
        n = len(stopped)
        print(
            f"monarch_dsl: {n} rank{'s' if n != 1 else ''} stopped in breakpoint()\n"
            f"{self.table()}\nattach with {how}",
            file=sys.stderr,
            flush=True,
        )

    def server(self) -> DebugServer | None:
        """The socket ``monarch-dsl debug`` connects to (None: it could not be made)."""
        with self._cond:
            if self._server is None and self._server_error is None:
                try:
                    self._server = DebugServer(self)
                except OSError as e:
                    self._server_error = e
                    print(f"monarch_dsl: monarch-dsl debug is not available: {e}", file=sys.stderr)
            return self._server


def _order(s: Session) -> tuple:
    rank, _, n = s.id.partition(".")
    return (int(rank), int(n or 1))


_sessions = Sessions()


def sessions() -> Sessions:
    return _sessions


# =============================================================================== console


class Console:
    """The debugger's command loop over a text stream: ``readline()`` returns a line ("" at
    the end of input), ``write(text)`` shows text."""

    def __init__(
        self,
        readline: Callable[[], str],
        write: Callable[[str], None],
        registry: Sessions | None = None,
        command_timeout: float = COMMAND_TIMEOUT,
    ):
        self.readline = readline
        self.write = write
        self.registry = registry or sessions()
        self.command_timeout = command_timeout
        self.showing = False  # the table was shown: tell of new stops as they come
        self._write_lock = threading.Lock()

    def notify(self, text: str) -> None:
        """From another thread: something the user should know now."""
        with self._write_lock:
            self.write(text)

    def say(self, text: str) -> None:
        with self._write_lock:
            self.write(text)

    def run(self, wait: float = 0.0) -> None:
        """Until ``quit``, the end of input, or no stopped rank left after a command. With no
        rank stopped yet, waits up to ``wait`` seconds for one first."""
        with self.registry._cond:
            self.registry.consoles.add(self)  # from now on, new stops are told here
        try:
            if not self.registry.snapshot():
                self.say(f"waiting up to {wait:g} s for a rank to stop in breakpoint()\n")
                if not self.registry.wait_stopped(1, wait):
                    self.say("no rank stopped\n")
                    return
            with self.registry._cond:  # (re-entrant) no stop between the table and `showing`
                self.say(self.registry.table() + "\n")
                self.showing = True
            while self.registry.snapshot():
                self.say(PROMPT)
                line = self.readline()
                if not line:
                    self.say("\n")
                    return
                if not self.command(line.strip()):
                    return
            self.say("no rank is stopped any more\n")
        finally:
            with self.registry._cond:
                self.registry.consoles.discard(self)

    def command(self, line: str) -> bool:
        """Run one console command; False: leave the console."""
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        if not word:
            return True
        if word in ("quit", "q", "exit"):
            return False
        if word in ("list", "l", "ls"):
            self.say(self.registry.table() + "\n")
        elif word in ("help", "h", "?"):
            self.say(HELP)
        elif word in ("attach", "a"):
            session = self.registry.by_id.get(rest)
            if session is None:
                self.say(f"no stopped rank {rest!r}; stopped: {self._ids()}\n")
            else:
                self.attach(session)
        elif word == "cast":
            ranks, _, cmd = rest.partition(" ")
            if not ranks or not cmd.strip():
                self.say("usage: cast RANKS CMD, e.g. cast 0-3 bt, cast all continue\n")
                return True
            try:
                targets = self.select(ranks)
            except ValueError as e:
                self.say(f"{e}\n")
                return True
            self.cast(targets, cmd.strip())
        elif word in ("continue", "c", "cont"):
            self.cast(self.registry.snapshot(), "continue")
        else:
            self.say(f"unknown command {word!r}\n{HELP}")
        return True

    def _ids(self) -> str:
        return ", ".join(s.id for s in self.registry.snapshot()) or "none"

    def select(self, spec: str) -> list[Session]:
        """The sessions named by ``all``, ``1``, ``0-3``, ``0,2,5``, ``1.2``."""
        stopped = self.registry.snapshot()
        if spec == "all":
            return stopped
        chosen: list[Session] = []
        for part in spec.split(","):
            lo, dash, hi = part.partition("-")
            try:
                if dash:
                    wanted = set(range(int(lo), int(hi) + 1))
                    found = [s for s in stopped if int(s.id.partition(".")[0]) in wanted]
                else:
                    found = [s for s in stopped if s.id == part or s.id.partition(".")[0] == part]
                    int(part.partition(".")[0])
            except ValueError:
                raise ValueError(
                    f"cannot read the ranks {spec!r}: expected all, 1, 0-3 or 0,2"
                ) from None
            chosen += [s for s in found if s not in chosen]
        if not chosen:
            raise ValueError(f"no stopped rank in {spec!r}; stopped: {self._ids()}")
        return chosen

    def attach(self, session: Session) -> None:
        if not session.claim():
            self.say(f"rank {session.id} is attached from another console\n")
            return
        try:
            self.say(f"attached to rank {session.id} (`detach` leaves it stopped)\n")
            session.ready(time.monotonic() + self.command_timeout)  # a new stop: its prompt
            text, done = session.output(time.monotonic())
            self.say(text)
            while True:
                if session.closed:
                    self.say(f"\nrank {session.id} resumed\n")
                    return
                if not done:
                    self.say(f"rank {session.id} is busy: attach again to see what it says\n")
                    return
                line = self.readline()
                if not line or line.strip() == "detach":
                    self.say(f"detached from rank {session.id}; it stays stopped\n")
                    return
                session.send(line.rstrip("\n"))
                deadline = time.monotonic() + self.command_timeout
                done = False
                while not done and time.monotonic() < deadline:
                    text, done = session.output(deadline)
                    self.say(text)
        finally:
            session.attached = False

    def cast(self, targets: list[Session], cmd: str) -> None:
        """Send ``cmd`` to every target at once (a collective needs all of them to go on),
        then print each one's answer, prefixed by its rank."""
        sent = []
        deadline = time.monotonic() + self.command_timeout
        for s in targets:
            if s.attached:
                self.say(f"[rank {s.id}] attached from another console: skipped\n")
            elif not s.ready(deadline):  # a rank that just stopped reaches its prompt first
                self.say(f"[rank {s.id}] busy: skipped\n")
            else:
                s.discard_output()  # where it stopped: the table says it
                s.send(cmd)
                sent.append(s)
        for s in sent:
            text, done = s.answer(deadline)
            for line in text.splitlines():
                if line.strip() and line.strip() != "(Pdb)":
                    self.say(f"[rank {s.id}] {line}\n")
            if s.closed:
                self.say(f"[rank {s.id}] resumed\n")
            elif not done:
                self.say(f"[rank {s.id}] still busy after {self.command_timeout:g} s\n")


def debug(wait: float = 60.0, command_timeout: float = COMMAND_TIMEOUT) -> None:
    """SPEC §8: the debugger on this terminal. With no rank stopped in ``breakpoint()``, waits
    up to ``wait`` seconds for one; returns on ``quit``, or once no rank is stopped any more."""

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        Console(sys.stdin.readline, write, sessions(), command_timeout).run(wait)
    except KeyboardInterrupt:
        write("\nleft the debugger; stopped ranks stay stopped\n")


# =============================================================================== monarch-dsl debug


def socket_dir() -> str:
    """The per-user directory of the controllers' debugger sockets, created 0700; refused
    when it is not ours alone (someone else could listen there in our name)."""
    path = os.path.join(tempfile.gettempdir(), f"monarch_dsl-debug-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be a directory of this user's only (mode 0700)")
    return path


def _peer_uid(sock: socket.socket) -> int:
    """The uid of a Unix socket's peer (Linux); elsewhere the 0700 directory is the guard."""
    if not hasattr(socket, "SO_PEERCRED"):
        return os.getuid()
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class DebugServer:
    """``monarch-dsl debug`` connects here: one ``Console`` per connection, same user only."""

    def __init__(self, registry: Sessions):
        self.registry = registry
        self.path = os.path.join(socket_dir(), f"{os.getpid()}.sock")
        if os.path.exists(self.path):
            os.unlink(self.path)  # a previous process with our pid
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(self.path)
        finally:
            os.umask(old)
        self.sock.listen(8)
        atexit.register(self.close)
        threading.Thread(target=self._accept, name="md-debug-server", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if _peer_uid(conn) != os.getuid():
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("r", encoding="utf-8", errors="replace", newline="\n")

        def write(text: str) -> None:
            try:
                conn.sendall(text.encode())
            except OSError:
                pass

        try:
            Console(reader.readline, write, self.registry).run()
        except OSError:
            pass
        finally:
            reader.close()
            conn.close()

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def controllers() -> list[int]:
    """The pids of this user's live controllers that have a debugger socket."""
    try:
        where = socket_dir()
        names = os.listdir(where)
    except OSError:
        return []
    pids = []
    for name in names:
        stem, ext = os.path.splitext(name)
        if ext == ".sock" and stem.isdigit():
            try:
                os.kill(int(stem), 0)
            except ProcessLookupError:  # a controller that was killed: its socket is stale
                try:
                    os.unlink(os.path.join(where, name))
                except OSError:
                    pass
                continue
            except PermissionError:
                pass
            pids.append(int(stem))
    return sorted(pids)


def client(pid: int | None, stdin: int = 0, stdout: Any = None) -> int:
    """``monarch-dsl debug``: relay this terminal to a controller's console. Returns the exit
    status."""
    out = stdout or sys.stdout
    if pid is None:
        pids = controllers()
        if not pids:
            print("monarch-dsl debug: no controller has a rank stopped in breakpoint()",
                  file=sys.stderr)  # fmt: skip
            return 1
        if len(pids) > 1:
            print(
                f"monarch-dsl debug: {len(pids)} controllers have ranks stopped in breakpoint() "
                f"(pids {', '.join(map(str, pids))}): choose one with --pid",
                file=sys.stderr,
            )
            return 1
        pid = pids[0]
    path = os.path.join(socket_dir(), f"{pid}.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as e:
        print(f"monarch-dsl debug: cannot reach controller {pid} ({path}): {e}", file=sys.stderr)
        return 1
    watch: list[Any] = [sock, stdin]
    try:
        while True:  # until the controller's console closes the connection
            ready, _, _ = select.select(watch, [], [])
            if sock in ready:
                data = sock.recv(65536)
                if not data:
                    return 0
                out.write(data.decode(errors="replace"))
                out.flush()
            if stdin in ready:
                data = os.read(stdin, 65536)
                if data:
                    sock.sendall(data)
                else:  # end of input: the console quits, and closes
                    sock.shutdown(socket.SHUT_WR)
                    watch.remove(stdin)
    finally:
        sock.close()
