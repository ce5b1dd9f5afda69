"""Worker output aggregation (SPEC §8 "Logs", ``pm.logging(aggregate_window=...)``): the same
line from several ranks is printed once with their label, lines that differ apart and in the
order they first came, partial lines are not held forever, a dying worker's last lines come
out before its error, and what is held is printed at exit; no thread dies of any of it."""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import local_mesh, wait_until

import monarch_dsl as md
from monarch_dsl.runtime import logs

pytestmark = pytest.mark.procs
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = 60.0  # a window no test waits for: what it prints came out for another reason


class Printer(md.Actor):
    @md.endpoint
    def say(self, text, ranks=None, err=False, end="\n"):
        if ranks is None or md.current_rank().rank in ranks:
            stream = sys.stderr if err else sys.stdout
            print(text.format(rank=md.current_rank().rank), end=end, flush=True, file=stream)

    @md.endpoint
    def say_and_die(self, text, rank):
        if md.current_rank().rank == rank:
            print(text)
            print("dying on stderr", file=sys.stderr)
            os.kill(os.getpid(), signal.SIGKILL)


class Output:
    """What the forwarder printed to this process's stdout and stderr, gathered."""

    def __init__(self, capfd):
        self.capfd, self.out, self.err = capfd, "", ""

    def read(self) -> "Output":
        # Under the forwarder's lock, which it holds while it writes: a line written between
        # the capture's read and its reset would be lost (capfd.readouterr reads, then
        # truncates), 1 run in ~10 of the tests that wait while ranks print.
        with logs.forwarder()._lock:
            out, err = self.capfd.readouterr()
        self.out, self.err = self.out + out, self.err + err
        return self

    def wait_for(self, *lines: str, err: bool = False, timeout: float = 10.0) -> list[str]:
        """Wait until every one of ``lines`` was printed; the lines of the stream so far."""

        def printed() -> bool:
            self.read()
            got = (self.err if err else self.out).splitlines()
            return all(line in got for line in lines)

        wait_until(printed, timeout, f"{lines} on {'stderr' if err else 'stdout'}")
        return (self.err if err else self.out).splitlines()


@pytest.fixture(autouse=True)
def no_thread_dies(monkeypatch):
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    yield
    assert not died, [f"{d.thread}: {d.exc_type.__name__}: {d.exc_value}" for d in died]
    thread = logs.forwarder()._thread
    assert thread is None or thread.is_alive(), "the log forwarder's thread died"


pm = local_mesh({"gpu": 4})


@pytest.fixture
def printers(pm):
    am = pm.spawn("printer", Printer)
    yield am
    pm.logging(aggregate_window=None)


def test_labels_are_boxes_of_coordinates():
    gpu = logs.LogGroup(("gpu",), (4,))
    assert gpu.label([2]) == "gpu=2"
    assert gpu.label([3, 0, 1, 2]) == "gpu=0-3"
    assert gpu.label([0, 1, 3]) == "gpu=0-1,3"
    grid = logs.LogGroup(("host", "gpu"), (2, 4))
    assert grid.label([5]) == "host=1,gpu=1"
    assert grid.label(range(8)) == "host=0-1,gpu=0-3"
    assert grid.label([1, 5]) == "host=0-1,gpu=1"
    assert grid.label([0, 2, 4, 6]) == "host=0-1,gpu=0,2"
    assert grid.label(range(6)) == "host=0,gpu=0-3; host=1,gpu=0-1"


@pytest.mark.parametrize("bad", [-1, -0.5, "1", float("nan"), float("inf"), True, [1.0]])
def test_bad_windows_are_refused(pm, bad):
    with pytest.raises(ValueError, match="aggregate_window"):
        pm.logging(aggregate_window=bad)
    assert pm.job.log_group.window == 0.0


def test_the_same_line_from_every_rank_is_printed_once(printers, pm, capfd):
    pm.logging(aggregate_window=LONG)  # every rank printed it: no wait for the window
    printers.say.call("loss 1.23").get(timeout=30)
    printers.say.call("warning 7", err=True).get(timeout=30)
    output = Output(capfd)
    assert output.wait_for("[gpu=0-3] loss 1.23").count("[gpu=0-3] loss 1.23") == 1
    assert output.wait_for("[gpu=0-3] warning 7", err=True).count("[gpu=0-3] warning 7") == 1
    assert "loss" not in output.err and "warning" not in output.out
    assert "[gpu=0] loss 1.23" not in output.out


def test_lines_that_differ_are_printed_apart_in_order_of_arrival(printers, pm, capfd):
    pm.logging(aggregate_window=LONG)
    printers.say.call("first\nrank {rank}\nlast").get(timeout=30)
    printers.say.call("first").get(timeout=30)  # again: a second line, not a second rank
    pm.logging(aggregate_window=None)  # prints what it held
    lines = Output(capfd).read().out.splitlines()
    expected = ["[gpu=0-3] first", "[gpu=0-3] last", "[gpu=0-3] first"]
    assert sorted(lines) == sorted(expected + [f"[gpu={r}] rank {r}" for r in range(4)])
    assert lines[0] == "[gpu=0-3] first"  # every rank printed it before its own line
    assert lines.index("[gpu=0-3] last") > min(lines.index(f"[gpu={r}] rank {r}") for r in range(4))
    # (not necessarily last: a rank whose pipe the forwarder reads late has its own line
    # arrive after another rank's second "first", which opened that entry)
    assert lines.index("[gpu=0-3] first", 1) > lines.index("[gpu=0-3] last")


def test_a_subset_of_ranks_is_labelled_with_its_ranks(printers, pm, capfd):
    pm.logging(aggregate_window=LONG)
    printers.say.call("middle", ranks=[1, 2]).get(timeout=30)
    printers.say.call("even", ranks=[0, 2], err=True).get(timeout=30)
    pm.logging(aggregate_window=None)
    output = Output(capfd).read()
    assert output.out.splitlines() == ["[gpu=1-2] middle"]
    assert output.err.splitlines() == ["[gpu=0,2] even"]


def test_held_and_partial_lines_come_out_when_their_window_ends(printers, pm, capfd):
    pm.logging(aggregate_window=0.3)  # (one rank prints: no other rank could join)
    printers.say.call("only me", ranks=[1]).get(timeout=30)
    output = Output(capfd)
    output.wait_for("[gpu=1] only me")
    printers.say.call("epoch 1 ...", ranks=[2], end="").get(timeout=30)
    output.wait_for("[gpu=2] epoch 1 ...")  # no newline came: a line after one window
    printers.say.call(" done", ranks=[2]).get(timeout=30)
    assert output.wait_for("[gpu=2]  done") == [
        "[gpu=1] only me",
        "[gpu=2] epoch 1 ...",
        "[gpu=2]  done",
    ]


def test_turning_it_off_gives_per_rank_lines_again(printers, pm, capfd):
    pm.logging(aggregate_window=LONG)
    printers.say.call("held", ranks=[3]).get(timeout=30)
    pm.logging(aggregate_window=0)  # prints what it held
    output = Output(capfd)
    assert output.read().out.splitlines() == ["[gpu=3] held"]
    printers.say.call("again").get(timeout=30)
    output.wait_for(*[f"[gpu={r}] again" for r in range(4)])
    pm.logging(aggregate_window=LONG)
    pm.logging(aggregate_window=None)
    printers.say.call("and again").get(timeout=30)
    output.wait_for(*[f"[gpu={r}] and again" for r in range(4)])


def test_a_killed_worker_s_last_lines_come_before_its_error(capfd):
    pm = md.this_host().spawn_procs({"gpu": 2})
    try:
        pm.logging(aggregate_window=LONG)
        printers = pm.spawn("printer", Printer)
        printers.say.call("both").get(timeout=30)
        with pytest.raises(md.SupervisionError, match=r"rank 1 \(gpu=1") as info:
            printers.say_and_die.call("last words", 1).get(timeout=30)
        assert info.value.rank == 1 and "dying on stderr" in info.value.stderr
        output = Output(capfd).read()  # already printed: no waiting for the window
        assert output.out.splitlines() == ["[gpu=0-1] both", "[gpu=1] last words"]
        assert "[gpu=1] dying on stderr" in output.err.splitlines()
    finally:
        pm.stop()


SCRIPT = """
    import monarch_dsl as md

    class Printer(md.Actor):
        @md.endpoint
        def say(self):
            if md.current_rank().rank == 0:
                print("only rank 0")

    pm = md.this_host().spawn_procs({"gpu": 2})
    pm.logging(aggregate_window=600)
    pm.spawn("p", Printer).say.call().get(timeout=30)
    print("exiting")
    """


def _start(**env: str) -> subprocess.Popen:
    env = dict(os.environ, MONARCH_DSL_QUIET="1", **env)
    env["PYTHONPATH"] = ROOT
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_what_is_held_is_printed_at_exit_unless_output_is_off():
    procs = [_start(), _start(MONARCH_DSL_WORKER_OUTPUT="0")]  # (side by side: faster)
    try:
        (out, err), (off_out, off_err) = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    # It exits without pm.stop(), long before the window ends.
    assert procs[0].returncode == 0, err
    assert out.splitlines() == ["exiting", "[gpu=0] only rank 0"]
    assert "Traceback" not in err
    assert procs[1].returncode == 0, off_err
    assert off_out.splitlines() == ["exiting"]
