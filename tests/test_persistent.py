"""Persistent meshes (SPEC §8): spawn_procs(name=, persistent=True) outlives its controller;
md.attach from another process finds the workers, their actors (with their state) and pinned
tensors; one controller at a time; only the owner's secret attaches; an abandoned mesh ends
after idle_timeout; a worker that died while no controller was attached is named on attach;
monarch-dsl ls / attach / stop. Every test ends its meshes' keepers and checks that nothing
(process, record, /dev/shm segment) is left."""

import os
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
from conftest import pid_alive, wait_until

import monarch_dsl as md
from monarch_dsl.runtime import registry

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The controller that starts a mesh, in its own process (it exits or is killed; the mesh stays).
STARTER = textwrap.dedent(
    """
    import sys, torch
    import monarch_dsl as md
    from actors_lib import Counter
    name, idle, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    pm = md.this_host().spawn_procs({"gpu": 2}, name=name, persistent=True, idle_timeout=idle)
    c = pm.spawn("counter", Counter, 10)
    print("counter", c.incr.call().get().values(), flush=True)
    with pm.activate():
        md.pin(md.to_mesh(torch.arange(6.0).reshape(2, 3), pm) * (1 + pm.rank("gpu")), "w")
    print("ready", flush=True)
    if mode == "hang":
        sys.stdin.read()
    """
)


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    """A private registry for the test (the user's own meshes are elsewhere)."""
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    return d


@pytest.fixture
def started(runtime_dir):
    """start(mode="exit"|"hang", idle=60) -> (name, starter process); ends every keeper."""
    names, procs = [], []

    def start(mode="exit", idle=60.0):
        name = "t" + uuid.uuid4().hex[:8]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]))
        p = subprocess.Popen(
            [sys.executable, "-c", STARTER, name, str(idle), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        names.append(name)
        procs.append(p)
        for line in p.stdout:
            if line.startswith("ready"):
                return name, p
        _, err = p.communicate(timeout=30)
        raise AssertionError(f"the starter failed:\n{err}")

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
        for f in (p.stdout, p.stdin, p.stderr):
            f.close()
    for name in names:
        rec = registry.read(name)
        if rec is not None and rec.alive():
            kids = _children(rec.pid)
            os.kill(rec.pid, signal.SIGKILL)  # its workers die with it (parent-death signal)
            wait_until(lambda kids=kids: not any(map(pid_alive, kids)), 30, "the workers to end")
        registry.remove(name)


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _segments(pids) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if any(str(p) in n for p in pids)]


def _gone(rec: registry.Record, workers: list[int]) -> None:
    wait_until(lambda: not pid_alive(rec.pid), 30, "the keeper to exit")
    wait_until(lambda: not any(pid_alive(w) for w in workers), 30, "the workers to exit")
    left = registry.read(rec.name)
    if left is not None:  # what the keeper said is the clue
        log = open(rec.log).read() if os.path.exists(rec.log) else "(no log)"
        raise AssertionError(f"the record outlived its keeper: {left}\nthe keeper's log:\n{log}")
    assert not os.path.exists(rec.socket)
    assert _segments(workers) == []


def test_a_persistent_mesh_outlives_its_controller(started):
    name, starter = started("exit")
    assert starter.wait(timeout=60) == 0  # the controller is gone ...
    rec = registry.read(name)
    assert rec is not None and rec.alive()  # ... its mesh is not
    workers = _children(rec.pid)
    assert len(workers) == 2 and all(pid_alive(w) for w in workers)

    pm = md.attach(name)
    assert pm.name == name and pm.dims == ("gpu",) and pm.sizes == {"gpu": 2}
    counter = pm.actors("counter")  # the actor, with its state
    assert list(counter.incr.call().get().values()) == [12, 12]
    w = pm.pinned("w")
    with pm.activate():
        w1 = md.inspect(w, gpu=1)
        y = md.inspect((w + 1).sum(), gpu=0)  # new work on the pinned tensor
    assert torch.equal(w1, torch.arange(6.0).reshape(2, 3) * 2)
    assert y.item() == 15 + 6
    with pytest.raises(KeyError, match="no actor named 'nope'.*counter"):
        pm.actors("nope")
    with pytest.raises(KeyError, match="no tensor pinned as 'v'.*'w'"):
        pm.pinned("v")
    fresh = pm.spawn("other", counter._cls, 0)
    assert list(fresh.incr.call().get().values()) == [1, 1]  # a new actor does not clash
    pm.detach()
    with pytest.raises(md.SupervisionError):
        counter.incr.call().get()  # this controller's handles are dead once detached

    pm = md.attach(name)  # again: the same processes, the state still there
    assert sorted(pm._job.pids.values()) == sorted(workers)
    assert list(pm.actors("counter").get.call().get().values()) == [12, 12]
    assert list(pm.actors("other").get.call().get().values()) == [1, 1]
    pm.stop()
    _gone(rec, workers)
    with pytest.raises(md.AttachError, match=f"no persistent mesh named '{name}'"):
        md.attach(name)


def test_one_controller_at_a_time_and_only_with_the_secret(started):
    name, starter = started("exit")
    starter.wait(timeout=60)
    with pytest.raises(ValueError, match="a persistent mesh's name"):
        md.attach("no/slashes")
    with pytest.raises(ValueError, match=f"named '{name}' is running"):
        md.this_host().spawn_procs({"gpu": 1}, name=name, persistent=True)
    with pytest.raises(ValueError, match="needs a name"):
        md.this_host().spawn_procs({"gpu": 1}, persistent=True)
    with pytest.raises(ValueError, match="idle_timeout must be > 0"):
        md.this_host().spawn_procs({"gpu": 1}, name="x", persistent=True, idle_timeout=0)

    rec = registry.read(name)
    good = rec.secret
    rec.secret = "00" * 32  # a forged record: the keeper does not know this secret
    registry.write(rec)
    with pytest.raises(md.AttachError, match="wrong secret"):
        md.attach(name)
    rec.secret = good
    registry.write(rec)

    pm = md.attach(name)
    other = subprocess.run(
        [sys.executable, "-c", f"import monarch_dsl as md; md.attach({name!r})"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert other.returncode != 0
    assert "AttachError" in other.stderr and "has a controller" in other.stderr, other.stderr
    assert list(pm.actors("counter").get.call().get().values()) == [11, 11]  # undisturbed
    workers = list(pm._job.pids.values())
    pm.stop()
    _gone(rec, workers)


def test_controller_killed_then_a_worker_killed_while_detached(started):
    name, starter = started("hang")
    starter.kill()  # the controller crashes (SIGKILL): nothing ran at its exit
    starter.wait(timeout=30)
    rec = registry.read(name)
    workers = _children(rec.pid)
    wait_until(lambda: registry.read(name).controller == 0, 30, "the keeper to see it go")
    os.kill(workers[1], signal.SIGKILL)  # rank 1 dies while no controller is attached
    wait_until(lambda: not pid_alive(workers[1]), 30, "rank 1 to die")

    pm = md.attach(name)  # attaching works: rank 1 is dead from the start, named
    with pytest.raises(md.SupervisionError, match=r"rank 1 \(gpu=1.*killed by signal SIGKILL"):
        pm.actors("counter").incr.call().get()
    assert pm.actors("counter").slice(gpu=0).get.call_one().get() == 11  # rank 0 lives on
    pm.stop()  # and the mesh can still be stopped
    _gone(rec, workers)


def test_an_abandoned_mesh_ends_after_idle_timeout(started):
    name, starter = started("exit", idle=1.0)
    rec = registry.read(name)  # (the starter is still attached: the clock has not started)
    workers = _children(rec.pid)
    starter.wait(timeout=60)
    _gone(rec, workers)  # no controller for 1 s: workers stopped, record removed
    with open(rec.log) as f:
        log = f.read()
    assert "idle_timeout" in log and "stopped" in log


def test_cli_ls_attach_stop(started):
    name, starter = started("exit")
    starter.wait(timeout=60)
    rec = registry.read(name)
    workers = _children(rec.pid)
    env = dict(os.environ, PYTHONPATH=ROOT)

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "monarch_dsl", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    ls = cli("ls")
    assert ls.returncode == 0 and name in ls.stdout and "gpu=2" in ls.stdout, ls.stdout
    shown = cli("attach", name)
    assert shown.returncode == 0, shown.stderr
    assert "counter (Counter)" in shown.stdout and "w [2, 3] torch.float32" in shown.stdout
    assert cli("attach", "t-missing").returncode == 1
    stopped = cli("stop", name)
    assert stopped.returncode == 0 and f"stopped persistent mesh '{name}'" in stopped.stdout
    _gone(rec, workers)
    assert name not in cli("ls").stdout
