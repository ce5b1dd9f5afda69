"""Process meshes (SPEC §2): start-up errors, no orphans, fork server modes, remote hosts."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from actors_lib import Counter
from conftest import pid_alive, wait_until

import monarch_dsl as md

pytestmark = pytest.mark.procs
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
    env = dict(os.environ, MONARCH_DSL_QUIET="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
    return env


def run_script(code: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(**env),
    )


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "per_host, exc",
    [
        ({"gpu": 0}, ValueError),
        ({"gpu": -1}, ValueError),
        ({"gpu": 1.5}, TypeError),
        ({"not a name": 2}, ValueError),
        ({}, TypeError),
        ([("gpu", 2)], TypeError),
    ],
)
def test_spawn_procs_rejects_bad_shapes(per_host, exc):
    with pytest.raises(exc):
        md.this_host().spawn_procs(per_host)


def test_spawn_procs_rejects_bad_options():
    with pytest.raises(TypeError, match="env"):
        md.this_host().spawn_procs({"gpu": 1}, env={"A": 1})
    with pytest.raises(TypeError, match="setup"):
        md.this_host().spawn_procs({"gpu": 1}, setup="not callable")
    with pytest.raises(ValueError, match="timeout"):
        md.this_host().spawn_procs({"gpu": 1}, timeout=0)


# ----------------------------------------------------------------------------- start-up errors


def _fail_import():
    import this_module_does_not_exist  # noqa: F401


def test_worker_whose_import_fails_is_an_error_with_its_stderr():
    start = time.monotonic()
    with pytest.raises(md.SpawnError) as info:
        md.this_host().spawn_procs({"gpu": 2}, setup=_fail_import, timeout=60)
    assert time.monotonic() - start < 30
    err = info.value
    assert "failed to start" in str(err) and "exited with code 1" in str(err)
    assert "ModuleNotFoundError" in err.stderr and "this_module_does_not_exist" in err.stderr


def test_worker_that_dies_while_starting_is_an_error():
    with pytest.raises(md.SpawnError, match="exited with code 3") as info:
        md.this_host().spawn_procs({"gpu": 2}, setup=lambda: os._exit(3), timeout=60)
    assert info.value.coords is not None


def test_a_worker_that_dies_as_it_is_configured_is_an_error_naming_it(monkeypatch):
    """A worker that joined, then died before the controller sent it its configuration: the
    send failed on the closed socket with a bare OSError (Bad file descriptor), seen once
    when attaching under load. Now it is the SupervisionError naming the rank and how it died,
    and no worker is left."""
    import gc

    from monarch_dsl.runtime import controller, transport

    real = transport.Connection.send_encoded
    killed = []

    here = os.getpid()  # (forked workers send with the patched method too)

    def dies_first(self, parts):
        jobs = [] if killed or os.getpid() != here else gc.get_objects()
        mine = (j for j in jobs if isinstance(j, controller.Job) and self in j.conns.values())
        job = next(mine, None)
        if job is not None:  # the first worker configured: killed, then its socket fails
            rank = next(r for r, c in job.conns.items() if c is self)
            os.kill(job.pids[rank], signal.SIGKILL)
            wait_until(lambda: not pid_alive(job.pids[rank]), 30, "the worker to die")
            killed.append(job)
            raise OSError(9, "Bad file descriptor")
        return real(self, parts)

    monkeypatch.setattr(transport.Connection, "send_encoded", dies_first)
    with pytest.raises(md.SupervisionError, match="killed by signal SIGKILL") as info:
        md.this_host().spawn_procs({"gpu": 2}, timeout=60)
    assert info.value.rank is not None and killed
    pids = list(killed[0].pids.values())
    wait_until(lambda: not any(map(pid_alive, pids)), 30, "no worker to be left")
    monkeypatch.setattr(transport.Connection, "send_encoded", real)


@pytest.mark.parametrize(
    "device, why",
    [("cuda", "MD_DEVICE=cuda, but this worker sees no CUDA device"), ("tpu", "MD_DEVICE must be")],
)
def test_a_device_the_workers_cannot_use_is_a_clear_spawn_error(device, why):
    import torch

    if device == "cuda" and torch.cuda.device_count() > 0:
        pytest.skip("this machine has a GPU")
    with pytest.raises(md.SpawnError) as info:
        md.this_host().spawn_procs({"gpu": 2}, env={"MD_DEVICE": device}, timeout=60)
    assert why in info.value.stderr


def test_env_and_setup_reach_the_workers():
    marker = "monarch-dsl-test"
    pm = md.this_host().spawn_procs(
        {"gpu": 2}, env={"MD_TEST_MARK": marker}, setup=lambda: os.environ.update(SETUP_RAN="1")
    )
    try:
        am = pm.spawn("c", EnvReader)
        assert am.read.call("MD_TEST_MARK").get(timeout=30).values() == [marker] * 2
        assert am.read.call("SETUP_RAN").get(timeout=30).values() == ["1"] * 2
        assert am.read.call("LOCAL_RANK").get(timeout=30).values() == ["0", "1"]
    finally:
        pm.stop()


class EnvReader(md.Actor):
    @md.endpoint
    def read(self, name):
        return os.environ.get(name)


# ----------------------------------------------------------------------------- scripts


def test_actor_class_in_main_and_current_rank_from_a_script():
    out = run_script(
        """
        import monarch_dsl as md

        class Greeter(md.Actor):
            @md.endpoint
            def hi(self, who):
                p = md.current_rank()
                return f"{who} from {p['host']},{p['gpu']}"

        pm = md.this_host().spawn_procs({"host": 2, "gpu": 2})
        print(pm.spawn("g", Greeter).hi.call("hello").get(timeout=30).item(host=1, gpu=0))
        pm.stop()
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "hello from 1,0"


def test_controller_killed_with_sigkill_leaves_no_orphans():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import os, sys
                import monarch_dsl as md
                from actors_lib import Counter
                pm = md.this_host().spawn_procs({"gpu": 3})
                pids = pm.spawn("c", Counter).pid.call().get(timeout=60).values()
                ppid = pm.spawn("d", Counter).ppid.call().get(timeout=60).values()[0]
                print(" ".join(map(str, pids + [ppid])), flush=True)
                sys.stdin.read()  # wait to be killed
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 4 and all(pid_alive(p) for p in pids), line
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        wait_until(
            lambda: not any(pid_alive(p) for p in pids), 10, "workers and fork server to exit"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    "prelude, mode",
    [
        ("", "forked from the controller"),
        (
            "import torch; torch.set_num_threads(2); torch.ones(1 << 22).mul_(2)",
            "fresh interpreter",
        ),
    ],
)
def test_fork_server_forks_only_when_safe(prelude, mode):
    """A controller that already ran a parallel OpenMP op cannot be forked (the children would
    hang): the probe notices and a fresh interpreter serves instead. Both work."""
    out = run_script(
        f"""
        {prelude}
        import monarch_dsl as md
        from monarch_dsl.runtime import forkserver
        pm = md.this_host().spawn_procs({{"gpu": 2}})
        from actors_lib import Counter
        print(pm.spawn("c", Counter, 2).incr.call(1).get(timeout=60).values())
        print(forkserver.fork_server().mode)
        pm.stop()
        """,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-2:] == ["[3, 3]", mode]


def test_fresh_fork_server_on_request():
    out = run_script(
        """
        import monarch_dsl as md
        from monarch_dsl.runtime import forkserver
        from actors_lib import Counter
        pm = md.this_host().spawn_procs({"gpu": 2})
        print(pm.spawn("c", Counter, 1).get.call().get(timeout=60).values())
        print(forkserver.fork_server().mode)
        """,
        timeout=180,
        MONARCH_DSL_FORK_SERVER="fresh",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-2:] == ["[1, 1]", "fresh interpreter"]


def test_worker_output_is_forwarded_with_its_rank():
    out = run_script(
        """
        import monarch_dsl as md

        class Talker(md.Actor):
            @md.endpoint
            def talk(self):
                print("to stdout")
                import sys; print("to stderr", file=sys.stderr)

        pm = md.this_host().spawn_procs({"gpu": 2})
        pm.spawn("t", Talker).talk.call().get(timeout=30)
        pm.stop()
        """
    )
    assert out.returncode == 0, out.stderr
    assert "[gpu=0] to stdout" in out.stdout and "[gpu=1] to stdout" in out.stdout
    assert "[gpu=1] to stderr" in out.stderr


# ----------------------------------------------------------------------------- remote hosts


def _launch_workers(address, token_env, ranks):
    return [
        subprocess.Popen(
            [sys.executable, "-m", "monarch_dsl", "worker", "--connect", address],
            env=_env(**token_env, RANK=str(r)),
        )
        for r in ranks
    ]


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def test_remote_hosts_workers_join_over_tcp():
    hosts = md.remote_hosts(2)
    address = hosts.listen({"gpu": 1})
    assert address.startswith("tcp:127.0.0.1:")
    procs = _launch_workers(address, hosts.env(), [0, 1])
    try:
        pm = hosts.spawn_procs({"gpu": 1}, timeout=60)
        assert pm.sizes == {"host": 2, "gpu": 1}
        am = pm.spawn("c", Counter, 4)
        assert am.where.call().get(timeout=30).values() == [
            (0, {"host": 0, "gpu": 0}),
            (1, {"host": 1, "gpu": 0}),
        ]
        assert am.slice(host=1).incr.call(1).get(timeout=30).values() == [5]
        pm.stop()
        for p in procs:
            assert p.wait(timeout=20) == 0
    finally:
        _kill(procs)


def test_remote_hosts_times_out_naming_missing_ranks():
    hosts = md.remote_hosts(2)
    procs = _launch_workers(hosts.listen({"gpu": 1}), hosts.env(), [1])
    try:
        with pytest.raises(md.SpawnError, match=r"1 of 2 workers did not join.*rank 0"):
            hosts.spawn_procs({"gpu": 1}, timeout=5)
        # It exits either way: 0 if it had joined (told to stop), 1 if it was still importing
        # torch when the controller gave up ("cannot join"); never left running.
        assert procs[0].wait(timeout=30) in (0, 1)
    finally:
        _kill(procs)


def test_remote_hosts_rejects_bad_arguments():
    with pytest.raises(ValueError):
        md.remote_hosts(0)
    with pytest.raises(ValueError, match="tcp:HOST:PORT"):
        md.remote_hosts(1, listen="localhost:80")
    hosts = md.remote_hosts(1)
    with pytest.raises(ValueError, match="'host'"):
        hosts.listen({"host": 2})
    hosts.listen({"gpu": 2})
    with pytest.raises(ValueError, match="set up for"):
        hosts.listen({"gpu": 4})
    hosts._job.stop()


def test_worker_under_torchrun_joins():
    hosts = md.remote_hosts(1)
    address = hosts.listen({"gpu": 2})
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-port=0",
            "-m",
            "monarch_dsl",
            "worker",
            "--connect",
            address,
        ],
        env=_env(**hosts.env()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pm = hosts.spawn_procs({"gpu": 2}, timeout=120)
        am = pm.spawn("c", EnvReader)
        assert am.read.call("LOCAL_RANK").get(timeout=30).values() == ["0", "1"]
        pm.stop()
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, err
    finally:
        _kill([launcher])
