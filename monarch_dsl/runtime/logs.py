"""Forwards worker stdout/stderr to the controller's terminal, prefixed with the worker's
coordinates, and aggregates identical lines from many ranks (``pm.logging(aggregate_window=)``).

Each local worker writes its fds 1 and 2 into pipes that the controller created, so its output
reaches us even when it dies hard (a segfault message included). We keep the tail of every
worker's stderr: a worker that fails to start or dies is reported with it.

One thread reads every pipe, through one selector. The pipes of one job form a ``LogGroup``:
it names its ranks by their coordinates and holds the job's aggregation window.

Aggregation (a group's window > 0 s). A complete line is held in an entry (stream, text, the
ranks that printed it) for at most one window after the entry's first line. The same line on
the same stream from another rank joins the entry; from a rank already in it, it starts a new
entry (a rank that prints a line twice has it printed twice). Entries are printed in the order
of their first line: the oldest once its window ends, or sooner once it holds every rank that
still has that stream open (no line can join it any more). A partial line (no newline yet) is
held at most one window, then counts as a line (the rest, when it comes, is a line of its
own). Everything held, partial lines included, is printed when a worker fails (``flush``,
before its error is raised), when the window changes or the job stops (``set_window``: what a
stopped job's workers print later comes per rank), and at exit. stdout and stderr are never
mixed: an entry is one stream's and is printed there. With ``MONARCH_DSL_WORKER_OUTPUT=0``
nothing is printed or held (stderr's tail is still kept).

Labels (``LogGroup.label``): one rank is ``host=0,gpu=1``. Several ranks are written as boxes:
every dim but the last a range (``host=0-1``), the last a list of ranges (``gpu=0-3``,
``gpu=0,2``); ranks that are not one box are a list of boxes joined by ``; ``
(``host=0,gpu=0-3; host=1,gpu=0-1``).

Invariants: the forwarder's lock guards every pipe and group. Only the forwarder's thread
waits, in ``select``, until the earliest deadline (an entry's window, a partial line's); a
thread that sets an earlier deadline (a drain from a caller) wakes it.
"""

from __future__ import annotations

import atexit
import collections
import math
import os
import selectors
import sys
import threading
import time
from collections.abc import Iterable, Sequence

from monarch_dsl.mesh import coords_of_index

TAIL_BYTES = 16 * 1024


def _shown(line: str) -> str:
    """What a terminal shows of ``line``: after its last carriage return (a progress bar's
    updates, ``\\r``-separated, are one line: its last state), without a CRLF's CR. Only
    ``\\n`` ends a line (not ``str.splitlines``' form feeds, vertical tabs and separators)."""
    line = line.removesuffix("\r")
    return line[line.rfind("\r") + 1 :]


class _Pipe:
    __slots__ = (
        "fd",
        "group",
        "rank",
        "label",
        "is_err",
        "partial",
        "tail",
        "closed",
    )

    def __init__(self, fd: int, group: LogGroup, rank: int, is_err: bool):
        self.fd = fd
        self.group = group
        self.rank = rank
        self.label = group.label([rank])
        self.is_err = is_err
        self.partial = b""  # the last line read, while its newline has not come
        self.tail: collections.deque[bytes] = collections.deque()  # stderr as read
        self.closed = False


class _Entry:
    """One held line: printed once, labelled with the ranks that printed it."""

    __slots__ = ("is_err", "text", "ranks", "until")

    def __init__(self, is_err: bool, text: str, rank: int, until: float):
        self.is_err = is_err
        self.text = text
        self.ranks = {rank}
        self.until = until


class LogGroup:
    """The worker pipes of one job: how its ranks are labelled (its dims and sizes), and its
    aggregation window (seconds; 0: every line printed as it comes, prefixed by its rank)."""

    def __init__(self, dims: Sequence[str], sizes: Sequence[int]):
        self.dims, self.sizes = tuple(dims), tuple(sizes)
        self.window = 0.0
        self.pipes: list[_Pipe] = []  # open ones
        # rank -> its open pipes, per stream (stdout, stderr): who may still join an entry
        self.open: tuple[collections.Counter, collections.Counter] = (
            collections.Counter(),
            collections.Counter(),
        )
        self.entries: collections.deque[_Entry] = collections.deque()  # in order of first line
        self.joinable: dict[tuple[bool, str], collections.deque[_Entry]] = {}  # by line

    def label(self, ranks: Iterable[int]) -> str:
        """``gpu=0-3``, ``host=0-1,gpu=0-3``, ``host=0,gpu=0-3; host=1,gpu=0-1`` (see above)."""
        coords = sorted(coords_of_index(r, self.sizes) for r in set(ranks))
        return "; ".join(
            ",".join(f"{d}={v}" for d, v in zip(self.dims, box)) for box in _boxes(coords)
        )


def _boxes(coords: list[tuple[int, ...]]) -> list[tuple[str, ...]]:
    """Sorted, distinct coordinates as boxes, each one text per dim: every dim but the last
    one range, the last a list of ranges. Consecutive values of the first dim whose other
    coordinates are the same make one range."""
    if len(coords[0]) == 1:
        return [(_ranges([c[0] for c in coords]),)]
    rest: dict[int, list[tuple[int, ...]]] = {}
    for c in coords:
        rest.setdefault(c[0], []).append(c[1:])
    runs: list[tuple[int, int, list[tuple[str, ...]]]] = []  # first, last, boxes of the rest
    for value, inner in rest.items():
        boxes = _boxes(inner)
        if runs and runs[-1][1] == value - 1 and runs[-1][2] == boxes:
            runs[-1] = (runs[-1][0], value, boxes)
        else:
            runs.append((value, value, boxes))
    return [(_span(first, last), *box) for first, last, boxes in runs for box in boxes]


def _ranges(values: list[int]) -> str:
    """Sorted distinct ints as ranges: ``0-3,5``."""
    spans: list[list[int]] = []
    for v in values:
        if spans and spans[-1][1] == v - 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ",".join(_span(a, b) for a, b in spans)


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


class LogForwarder:
    """One thread, one selector over every worker pipe of this controller."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread: threading.Thread | None = None
        self._holding: set[LogGroup] = set()  # groups with entries
        self._partials: dict[_Pipe, float] = {}  # aggregating: when a partial line is a line
        self._wake_at = math.inf  # when the thread's select returns by itself
        self.echo = os.environ.get("MONARCH_DSL_WORKER_OUTPUT", "1") != "0"

    # ------------------------------------------------------------------ API
    def add(self, fd: int, group: LogGroup, rank: int, is_err: bool) -> _Pipe:
        """Forward the pipe ``fd`` (ours to close) of ``rank`` of ``group``."""
        os.set_blocking(fd, False)
        pipe = _Pipe(fd, group, rank, is_err)
        with self._lock:
            self._sel.register(fd, selectors.EVENT_READ, pipe)
            group.pipes.append(pipe)
            group.open[is_err][rank] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="md-logs", daemon=True)
                self._thread.start()
        self._wake()
        return pipe

    def drain(self, pipe: _Pipe) -> None:
        """Read whatever is in the pipe now (used before reporting a worker's death)."""
        with self._lock:
            self._read(pipe)

    def flush(self, group: LogGroup) -> None:
        """Read what the group's pipes hold now and print everything held (a worker of the
        group failed: its last lines come before the error)."""
        with self._lock:
            self._flush(group)

    def set_window(self, group: LogGroup, seconds: float) -> None:
        """Aggregate the group's lines over ``seconds`` from now on (0: print each as it
        comes). What its workers printed before is printed first, under the old window."""
        with self._lock:
            self._flush(group)
            group.window = seconds
            now = time.monotonic()
            for pipe in group.pipes:
                self._partials.pop(pipe, None)
                self._hold_partial(pipe, now)

    def flush_all(self) -> None:
        """At exit: print everything held."""
        with self._lock:
            for group in {pipe.group for pipe in self._partials} | self._holding:
                self._flush(group)

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
            text = b"".join(pipe.tail)
        lines = text.decode(errors="replace").splitlines()
        return "\n".join(lines[-max_lines:])

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        timeout: float | None = None
        while True:
            events = self._sel.select(timeout)
            with self._lock:
                for key, _ in events:
                    if key.data is None:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                    else:
                        self._read(key.data)
                timeout = self._tick()

    def _tick(self) -> float | None:
        """The thread, holding the lock: print what is due; the seconds until the next
        deadline (None: none)."""
        now = time.monotonic()
        for pipe in [p for p, until in self._partials.items() if until <= now]:
            self._cut_partial(pipe)
        for group in list(self._holding):
            self._print_ready(group, now)
        deadlines = [g.entries[0].until for g in self._holding]
        deadlines += self._partials.values()
        self._wake_at = min(deadlines, default=math.inf)
        return None if not deadlines else max(0.0, self._wake_at - now)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # a wake-up is pending already
            pass

    def _deadline(self, until: float) -> None:
        """Caller holds the lock: ``until`` is a new deadline."""
        if until < self._wake_at and threading.current_thread() is not self._thread:
            self._wake_at = until
            self._wake()

    # ------------------------------------------------------------------ reading (lock held)
    def _read(self, pipe: _Pipe) -> None:
        while not pipe.closed:
            try:
                chunk = os.read(pipe.fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self._close(pipe)
                break
            if pipe.is_err:
                pipe.tail.append(chunk)
                size = sum(map(len, pipe.tail))
                while size > TAIL_BYTES and len(pipe.tail) > 1:
                    size -= len(pipe.tail.popleft())
            data = pipe.partial + chunk
            cut = data.rfind(b"\n") + 1
            pipe.partial = data[cut:]
            if cut:
                self._lines(pipe, data[:cut])
            if not pipe.partial:
                self._partials.pop(pipe, None)
            self._hold_partial(pipe, time.monotonic())
        if pipe.group.entries:
            self._print_ready(pipe.group, time.monotonic())

    def _hold_partial(self, pipe: _Pipe, now: float) -> None:
        """Aggregating: a partial line counts as a line one window after it began."""
        if pipe.partial and pipe not in self._partials and pipe.group.window and self.echo:
            self._partials[pipe] = now + pipe.group.window
            self._deadline(self._partials[pipe])

    def _cut_partial(self, pipe: _Pipe) -> None:
        text, pipe.partial = pipe.partial, b""
        self._partials.pop(pipe, None)
        self._lines(pipe, text)

    def _close(self, pipe: _Pipe) -> None:
        """Print the unfinished last line, stop reading, close."""
        if pipe.partial:
            self._cut_partial(pipe)
        pipe.closed = True
        self._sel.unregister(pipe.fd)
        os.close(pipe.fd)
        group = pipe.group
        group.pipes.remove(pipe)
        group.open[pipe.is_err][pipe.rank] -= 1
        if not group.open[pipe.is_err][pipe.rank]:
            del group.open[pipe.is_err][pipe.rank]  # (fewer ranks to wait for)

    def _lines(self, pipe: _Pipe, data: bytes) -> None:
        if not self.echo:
            return
        lines = [_shown(line) for line in data.decode(errors="replace").split("\n")]
        if lines[-1] == "":  # (the newline that ended the last line)
            lines.pop()
        group = pipe.group
        if not group.window:
            self._write(pipe.is_err, "".join(f"[{pipe.label}] {line}\n" for line in lines))
            return
        now = time.monotonic()
        for line in lines:
            self._hold(group, pipe, line, now)

    # ------------------------------------------------------------------ aggregating (lock held)
    def _hold(self, group: LogGroup, pipe: _Pipe, line: str, now: float) -> None:
        """Add ``pipe``'s ``line`` to the first entry of that line without its rank, or to a
        new entry."""
        key = (pipe.is_err, line)
        same = group.joinable.get(key)
        if same is not None:
            for entry in same:
                if pipe.rank not in entry.ranks:
                    entry.ranks.add(pipe.rank)
                    return
        entry = _Entry(pipe.is_err, line, pipe.rank, now + group.window)
        group.entries.append(entry)
        group.joinable.setdefault(key, collections.deque()).append(entry)
        if group not in self._holding:
            self._holding.add(group)
            self._deadline(entry.until)

    def _flush(self, group: LogGroup) -> None:
        """Read the group's pipes, and print every line held (partial ones included)."""
        for pipe in list(group.pipes):
            self._read(pipe)
            if pipe in self._partials:
                self._cut_partial(pipe)
        self._print_ready(group, time.monotonic(), everything=True)

    def _print_ready(self, group: LogGroup, now: float, everything: bool = False) -> None:
        """Print the group's entries, oldest first, while the oldest is due or complete (or
        all of them: ``everything``)."""
        out: list[tuple[bool, str]] = []
        while group.entries:
            entry = group.entries[0]
            if not (everything or entry.until <= now or _complete(group, entry)):
                break
            group.entries.popleft()
            key = (entry.is_err, entry.text)
            same = group.joinable[key]
            same.popleft()  # (the oldest entry of its line is the oldest held)
            if not same:
                del group.joinable[key]
            text = f"[{group.label(entry.ranks)}] {entry.text}\n"
            if out and out[-1][0] == entry.is_err:
                out[-1] = (entry.is_err, out[-1][1] + text)
            else:
                out.append((entry.is_err, text))
        if not group.entries:
            self._holding.discard(group)
        for is_err, text in out:
            self._write(is_err, text)

    @staticmethod
    def _write(is_err: bool, text: str) -> None:
        stream = sys.stderr if is_err else sys.stdout
        try:
            stream.write(text)
            stream.flush()
        except (ValueError, OSError):  # the controller closed its streams (interpreter exit)
            pass


def _complete(group: LogGroup, entry: _Entry) -> bool:
    """Every rank that still has the entry's stream open is in it."""
    still = group.open[entry.is_err]
    return len(entry.ranks) >= len(still) and all(r in entry.ranks for r in still)


_forwarder: LogForwarder | None = None
_forwarder_lock = threading.Lock()


def forwarder() -> LogForwarder:
    global _forwarder
    with _forwarder_lock:
        if _forwarder is None:
            _forwarder = LogForwarder()
        return _forwarder


@atexit.register
def _flush_at_exit() -> None:
    """Runs after ``controller.stop_all`` (registered later, so run earlier)."""
    if _forwarder is not None:
        _forwarder.flush_all()
