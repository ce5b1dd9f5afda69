"""``breakpoint()`` in workers (SPEC §8): a controller script on a real terminal (a pty), driven
as a user would -- the table of stopped ranks, ``attach``, pdb commands, ``cast``, ``continue``
-- and ``monarch-dsl debug`` from a second terminal."""

from __future__ import annotations

import codecs
import os
import pty
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import monarch_dsl as md
from monarch_dsl.runtime import debugger, transport
from monarch_dsl.runtime.messages import DebugHello

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 30.0  # for any one expected piece of output; the whole run takes seconds


class Terminal:
    """A process on a pty of its own: ``expect`` a pattern in its output, ``send`` a line."""

    def __init__(self, argv: list[str], cwd: str):
        self.master, slave = pty.openpty()
        env = dict(os.environ, PYTHONPATH=ROOT, MONARCH_DSL_QUIET="1", TERM="dumb")
        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            env=env,
            start_new_session=True,  # its own session: the pty is its controlling terminal
        )
        os.close(slave)
        self.seen = ""  # everything it wrote
        self.pos = 0  # how far expect() has read in `seen`
        # (a read can end inside a UTF-8 character or between a line's \r and \n)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.cr = False  # the last read ended with \r

    def expect(self, pattern: str, timeout: float = TIMEOUT) -> re.Match:
        """The first match of ``pattern`` after the previous match; fails at the deadline."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            found = regex.search(self.seen, self.pos)
            if found:
                self.pos = found.end()
                return found
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(
                    f"no {pattern!r} within {timeout} s; the terminal showed:\n{self.seen}"
                )

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True  # the deadline check in expect() ends it
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the process closed the terminal
            return False
        if not data:
            return False
        text = ("\r" if self.cr else "") + self.decoder.decode(data)
        self.cr = text.endswith("\r")
        self.seen += (text[:-1] if self.cr else text).replace("\r\n", "\n")
        return True

    def send(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")

    def wait(self, timeout: float = TIMEOUT) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(min(0.5, max(0.0, deadline - time.monotonic())))
        return self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own group: what we started
            self.proc.wait(timeout=TIMEOUT)
        os.close(self.master)


@pytest.fixture
def terminals():
    made: list[Terminal] = []

    def start(argv: list[str], cwd) -> Terminal:
        term = Terminal(argv, cwd=str(cwd))
        made.append(term)
        return term

    yield start
    for term in made:
        term.close()


def controller(terminals, script: str, tmp_path, *args: str) -> Terminal:
    path = tmp_path / "controller.py"
    path.write_text(textwrap.dedent(script))
    return terminals([sys.executable, str(path), *args], tmp_path)


def line_of(script: str, text: str) -> int:
    lines = textwrap.dedent(script).splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


ENDPOINT_SCRIPT = """\
    import sys

    import monarch_dsl as md


    class Worker(md.Actor):
        @md.endpoint
        def work(self, x):
            rank = md.current_rank().rank
            secret = x * 10 + rank
            if rank == 1:
                breakpoint()
            return secret


    pm = md.this_host().spawn_procs({"gpu": 2})
    am = pm.spawn("w", Worker)
    replies = am.work.stream(4)
    # (a line in one write: with PYTHONUNBUFFERED, print writes its pieces and its newline
    # apart, and the table of stopped ranks, printed from another thread, can land between)
    say = lambda line: (sys.stdout.write(line + "\\n"), sys.stdout.flush())  # noqa: E731
    say(f"first reply {next(replies)}")  # rank 0's: rank 1 is stopped
    if sys.argv[1:] == ["--cli"]:  # the debugger in another terminal; this one just waits
        say(f"second reply {next(replies)}")
    else:
        md.debug(wait=60)
        say(f"second reply {next(replies)}")
    pm.stop()
"""


def test_breakpoint_in_an_endpoint_pauses_its_rank_only(terminals, tmp_path):
    term = controller(terminals, ENDPOINT_SCRIPT, tmp_path)
    term.expect(r"first reply 40\n")  # rank 0 replied while rank 1 sits in breakpoint()
    stop = line_of(ENDPOINT_SCRIPT, "return secret")  # pdb stops on the line after breakpoint()
    term.expect(r"\(md-debug\) ")
    term.send("list")
    term.expect(r"list\n")  # (the terminal echoes what we type)
    row = term.expect(r"  1 +Worker +gpu=1 +\S+ +Worker\.work +(\S+):(\d+)\n\(md-debug\) ")
    assert row.group(1).endswith("controller.py") and int(row.group(2)) == stop
    term.send("attach 1")
    term.expect(rf"controller\.py\({stop}\)work\(\)\n-> return secret\n\(Pdb\) ")
    term.send("p secret")
    term.expect(r"p secret\n41\n\(Pdb\) ")
    term.send("continue")
    term.expect(r"rank 1 resumed\n")
    term.expect(r"no rank is stopped any more\n")
    term.expect(r"second reply 41\n")
    assert term.wait() == 0


REMOTE_SCRIPT = """\
    import sys

    import torch

    import monarch_dsl as md
    from monarch_dsl.runtime import debugger


    @md.remote(propagate=lambda t: t)
    def scale(t):
        factor = 3 + md.current_rank().rank
        breakpoint()
        return t * factor


    pm = md.this_host().spawn_procs({"gpu": 2})
    with pm.activate():
        y = scale(torch.ones(2))
        assert debugger.sessions().wait_stopped(2, timeout=60)
        md.debug(wait=60)
        values = [md.inspect(y, gpu=i).tolist() for i in range(2)]
        sys.stdout.write(f"values {values}\\n")  # (one write: see ENDPOINT_SCRIPT)
        sys.stdout.flush()
    pm.stop()
"""


def test_breakpoint_in_a_remote_function_and_cast_to_several_ranks(terminals, tmp_path):
    term = controller(terminals, REMOTE_SCRIPT, tmp_path)
    stop = line_of(REMOTE_SCRIPT, "return t * factor")
    for rank in (0, 1):  # rows of one table: a row leaves its newline for the next row's
        term.expect(rf"\n  {rank} +@remote +gpu={rank} +\S+ +scale +\S+controller\.py:{stop}(?=\n)")
    term.expect(r"\(md-debug\) ")
    term.send("cast 5 bt")
    term.expect(r"no stopped rank in '5'; stopped: 0, 1\n")
    term.send("cast all p factor")
    term.expect(r"\[rank 0\] 3\n\[rank 1\] 4\n")
    term.send("cast 0-1 continue")
    term.expect(r"\[rank 0\] resumed\n\[rank 1\] resumed\n")
    term.expect(r"values \[\[3\.0, 3\.0\], \[4\.0, 4\.0\]\]\n")
    assert term.wait() == 0


def test_monarch_dsl_debug_attaches_from_another_terminal(terminals, tmp_path):
    main = controller(terminals, ENDPOINT_SCRIPT, tmp_path, "--cli")
    pid = int(main.expect(r"`monarch-dsl debug --pid (\d+)`").group(1))
    main.pos = 0  # (the table on stderr and the reply on stdout come in either order)
    main.expect(r"first reply 40\n")
    assert pid == main.proc.pid
    client = terminals([sys.executable, "-m", "monarch_dsl", "debug", "--pid", str(pid)], tmp_path)
    client.expect(r"\n  1 +Worker +gpu=1 .*Worker\.work.*\n\(md-debug\) ")
    client.send("attach 1")
    client.expect(r"\(Pdb\) ")
    client.send("p secret + 1")
    client.expect(r"\n42\n\(Pdb\) ")
    client.send("continue")
    client.expect(r"rank 1 resumed\n")
    assert client.wait() == 0  # the controller's console closed: no rank is stopped
    main.expect(r"second reply 41\n")
    assert main.wait() == 0


class Stops(md.Actor):
    @md.endpoint
    def stop_on(self, rank):
        if md.current_rank().rank == rank:
            breakpoint()
        return md.current_rank().rank


def test_a_paused_worker_that_dies_fails_its_call_with_a_supervision_error():
    pm = md.this_host().spawn_procs({"gpu": 2})
    try:
        am = pm.spawn("s", Stops)
        fut = am.stop_on.call(1)
        assert debugger.sessions().wait_stopped(1, timeout=60)
        [session] = debugger.sessions().snapshot()
        hello = session.hello
        assert (session.id, hello.actor, hello.coords) == ("1", "Stops", (("gpu", 1),))
        assert hello.pid == pm.job.pids[1]
        os.kill(hello.pid, signal.SIGKILL)  # our own worker
        with pytest.raises(md.SupervisionError, match="rank 1"):
            fut.get(timeout=60)
        assert debugger.sessions().wait_stopped(0, timeout=10, exactly=True)  # gone from the table
    finally:
        pm.stop()


def _hello(rank: int) -> DebugHello:
    return DebugHello(rank, (("gpu", rank),), rank, os.getpid(), "vm", "W", "f", "x.py", 3)


def test_a_console_that_opens_as_a_rank_stops_is_not_interrupted_by_the_table(capsys):
    """The table goes to stderr only while no console is open; a console opening while a stop
    is being admitted (the CI flake: the table landed in the middle of a pdb answer) shows the
    table itself and is told nothing else."""
    registry = debugger.Sessions()
    lines: queue.Queue[str] = queue.Queue()
    shown: list[str] = []
    console = debugger.Console(lines.get, shown.append, registry)
    ran = threading.Thread(target=console.run, kwargs={"wait": 30.0})
    opened = threading.Event()

    def server():  # the console opens while the stop is admitted
        if not opened.is_set():
            opened.set()
            ran.start()
            deadline = time.monotonic() + 10
            while console not in registry.consoles and time.monotonic() < deadline:
                time.sleep(0.001)
        return None

    registry.server = server  # type: ignore[method-assign]
    ours, theirs = socket.socketpair()
    try:
        registry.add(_hello(1), transport.Connection(ours, "test"))
        lines.put("quit\n")
        ran.join(timeout=30)
        assert not ran.is_alive()
        assert "stopped in breakpoint()" not in capsys.readouterr().err
        assert re.search(r"  1 +W +gpu=1 +vm +f +x\.py:3\n", "".join(shown))
    finally:
        theirs.close()  # the session's reader thread ends
        ours.close()


def test_the_table_goes_to_stderr_before_a_waiter_goes_on(capsys):
    registry = debugger.Sessions()
    registry.server = lambda: None  # type: ignore[method-assign]
    ours, theirs = socket.socketpair()
    try:
        registry.add(_hello(0), transport.Connection(ours, "test"))
        assert registry.wait_stopped(1, 0)
        err = capsys.readouterr().err
        assert err.startswith("monarch_dsl: 1 rank stopped in breakpoint()\n")
        assert re.search(r"  0 +W +gpu=0 +vm +f +x\.py:3\nattach with md\.debug\(\)", err)
    finally:
        theirs.close()
        assert registry.wait_stopped(0, 10, exactly=True)  # the closed session left the table
        ours.close()
