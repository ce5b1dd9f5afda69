"""Unchanged torchrun scripts on a mesh (SPEC §6, ``pm.run_spmd`` / ``monarch-dsl run --spmd``):
the same weights as torchrun, the torch.distributed variables, output prefixed by rank, a mesh
that outlives runs, failed / killed ranks named with the others stopped, bad inputs refused."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import TORCH_GLOO_EXIT_ABORT, local_mesh, pid_alive, wait_until

import monarch_dsl as md
from monarch_dsl.errors import SpmdError
from monarch_dsl.parallel import spmd

pytestmark = pytest.mark.procs
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "spmd_scripts")
DDP_TRAIN = os.path.join(SCRIPTS, "ddp_train.py")
RANKS = os.path.join(SCRIPTS, "ranks.py")


pm = local_mesh({"gpu": 2})


def rank_files(path, n=2):
    out = []
    for r in range(n):
        with open(os.path.join(path, f"{r}.json")) as f:
            out.append(json.load(f))
    return out


def both_started(path, n=2):
    """Every rank has written its file (ranks.py writes ``<RANK>.tmp`` first, then renames it:
    counting the folder's entries would count a rank still writing)."""
    return all(os.path.exists(os.path.join(path, f"{r}.json")) for r in range(n))


def assert_gone(pids):
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10, what=f"pids {pids} gone")


def assert_mesh_runs(pm, tmp_path):
    """The mesh still runs a script (and its workers still answer)."""
    again = tmp_path / "again"
    again.mkdir()
    assert pm.run_spmd(RANKS, "ok", str(again)).values() == [0, 0]


# ----------------------------------------------------------------------------- same as torchrun


def test_ddp_script_gives_the_weights_torchrun_gives(pm, tmp_path):
    ours, theirs = tmp_path / "ours.pt", tmp_path / "torchrun.pt"
    try:
        codes = pm.run_spmd(DDP_TRAIN, str(ours), "4")
    except SpmdError as e:  # torch's gloo exit abort (conftest): once more, for it alone
        if e.returncode != -signal.SIGABRT or TORCH_GLOO_EXIT_ABORT not in e.stderr:
            raise
        codes = pm.run_spmd(DDP_TRAIN, str(ours), "4")
    assert isinstance(codes, md.ValueMesh) and codes.values() == [0, 0]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + [DDP_TRAIN, str(theirs), "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Plain torchrun is the peer: its gloo exit abort comes after rank 0 saved the weights
    # (the script's barrier follows the save), and the weights are what is compared.
    assert proc.returncode == 0 or TORCH_GLOO_EXIT_ABORT in proc.stderr, proc.stderr
    a, b = torch.load(ours), torch.load(theirs)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_ranks_see_the_torch_distributed_variables_and_output_is_prefixed(pm, tmp_path, capfd):
    pm.run_spmd(RANKS, "ok", str(tmp_path), env={"SPMD_TEST_EXTRA": "x"})
    seen = rank_files(tmp_path)
    ports = {s["env"]["MASTER_PORT"] for s in seen}
    assert len(ports) == 1 and ports.pop().isdigit()
    for r, s in enumerate(seen):
        env = s["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["GROUP_RANK"] == "0"
        assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")  # as torchrun
        assert env["SPMD_TEST_EXTRA"] == "x"
        assert s["argv"] == ["ok", str(tmp_path)] and s["cwd"] == os.getcwd()
        assert s["pid"] not in pm._job.pids.values()  # a process of its own, not the worker
    out, err = capfd.readouterr()
    assert "[gpu=0] hello from rank 0 of 2" in out and "[gpu=1] hello from rank 1 of 2" in out
    assert "[gpu=1] to stderr from rank 1" in err


def test_a_rank_runs_its_script_as_python_does(pm, tmp_path, capfd):
    """A probe of torchrun scripts found these differences from ``python script.py``: a file
    opened at module level and never closed was empty (no teardown of ``__main__`` before the
    rank's exit), the script's ``sys.excepthook`` was not called, ``__builtins__`` was a dict,
    a file name that is not UTF-8 could not be printed, and ``\\r`` / ``\\f`` split lines."""
    script = os.path.join(SCRIPTS, "as_python.py")
    here = subprocess.run(
        [sys.executable, script, str(tmp_path)], capture_output=True, text=True,
        errors="replace", timeout=60,
    )  # fmt: skip
    assert here.returncode == 1 and "hook: KeyError 'raised at the end'" in here.stderr
    assert (tmp_path / "python.log").read_text() == "written before exit\n"
    with pytest.raises(SpmdError) as info:  # (one rank: a failure stops the others)
        pm.slice(gpu=1).run_spmd(script, str(tmp_path))
    assert info.value.failures == {0: 1}
    out, err = capfd.readouterr()
    assert (tmp_path / "0.log").read_text() == "written before exit\n"
    assert "[gpu=1] hook: KeyError 'raised at the end'" in err
    assert "Traceback" not in err  # the hook replaced it, as in python
    assert "[gpu=1] builtins: module" in out
    assert "[gpu=1] progress 2/2\n" in out and "progress 1/2" not in out
    assert "[gpu=1] form\ffeed\n" in out
    for line in (
        "annotations: {'x': <class 'int'>, 'return': None}",
        "atexit pickled Config",
    ):
        assert line in here.stdout and f"[gpu=1] {line}" in out, (line, here.stdout, out)
    # the name prints where python prints it (it depends on the locale's error handler)
    assert ("[gpu=1] name: data_" in out) == ("name: data_" in here.stdout)


def test_a_slice_runs_with_its_own_ranks(pm, tmp_path, capfd):
    assert pm.slice(gpu=1).run_spmd(RANKS, "ok", str(tmp_path)).values() == [0]
    (seen,) = rank_files(tmp_path, 1)
    assert seen["env"]["RANK"] == "0" and seen["env"]["WORLD_SIZE"] == "1"
    assert "[gpu=1] hello from rank 0 of 1" in capfd.readouterr().out


def test_a_second_run_starts_no_process_and_imports_no_torch(pm, tmp_path):
    workers = dict(pm._job.pids)
    times = []
    for i in range(2):
        d = tmp_path / str(i)
        d.mkdir()
        start = time.perf_counter()
        pm.run_spmd(RANKS, "ok", str(d))
        times.append(time.perf_counter() - start)
        assert all(s["torch_preloaded"] for s in rank_files(d))
    assert pm._job.pids == workers and all(pid_alive(p) for p in workers.values())
    print(f"first run {times[0] * 1e3:.0f} ms, second {times[1] * 1e3:.0f} ms")  # not a check


# ----------------------------------------------------------------------------- failures


def test_a_rank_exiting_3_is_named_and_the_others_are_stopped(pm, tmp_path):
    start = time.monotonic()
    with pytest.raises(SpmdError) as info:
        pm.run_spmd(RANKS, "exit3", str(tmp_path))
    assert time.monotonic() - start < spmd.STOP_GRACE  # rank 0 ended by SIGTERM, not a wait
    err = info.value
    assert err.rank == 1 and err.returncode == 3 and err.failures == {1: 3}
    assert err.coords == {"gpu": 1} and err.stopped == (0,) and not err.timed_out
    assert "rank 1 (gpu=1" in str(err) and "exited with code 3" in str(err)
    assert "rank 1 gives up" in err.stderr
    assert_gone([s["pid"] for s in rank_files(tmp_path)])
    assert_mesh_runs(pm, tmp_path)


def test_a_rank_killed_mid_collective_is_named_and_rank_0_is_not_left_in_it(pm, tmp_path):
    start = time.monotonic()
    with pytest.raises(SpmdError) as info:
        pm.run_spmd(RANKS, "kill9", str(tmp_path), timeout=60)
    assert time.monotonic() - start < 30
    err = info.value
    assert err.failures.get(1) == -signal.SIGKILL, err
    assert "rank 1 (gpu=1" in str(err) and "killed by signal SIGKILL" in str(err)
    assert_gone([s["pid"] for s in rank_files(tmp_path)])
    assert_mesh_runs(pm, tmp_path)


def test_a_rank_ignoring_sigterm_is_killed_after_the_grace_period(pm, tmp_path, monkeypatch):
    monkeypatch.setattr(spmd, "STOP_GRACE", 0.5)
    with pytest.raises(SpmdError) as info:
        pm.run_spmd(RANKS, "ignore_term", str(tmp_path))
    assert info.value.failures == {1: 1} and info.value.stopped == (0,)
    assert_gone([s["pid"] for s in rank_files(tmp_path)])


def test_timeout_stops_every_rank(pm, tmp_path):
    # 3 s: time for both ranks to write their files (their pids) on a loaded 2-core host; at
    # 1 s a rank was now and then stopped before its file, and there was no pid to check
    start = time.monotonic()
    with pytest.raises(SpmdError, match="timed out after 3 s") as info:
        pm.run_spmd(RANKS, "sleep", str(tmp_path), timeout=3)
    assert time.monotonic() - start < 3 + spmd.STOP_GRACE
    assert info.value.timed_out and info.value.stopped == (0, 1) and info.value.failures == {}
    wait_until(lambda: both_started(tmp_path), what="both ranks' files")
    assert_gone([s["pid"] for s in rank_files(tmp_path)])


def test_killing_a_worker_during_a_run_is_a_supervision_error(tmp_path):
    mesh = md.this_host().spawn_procs({"gpu": 2})
    try:
        worker = mesh._job.pids[1]

        def kill_when_started():
            wait_until(lambda: both_started(tmp_path), what="both ranks started")
            os.kill(worker, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_started, daemon=True)
        killer.start()
        with pytest.raises(md.SupervisionError) as info:
            mesh.run_spmd(RANKS, "sleep", str(tmp_path), timeout=60)
        killer.join()
        assert info.value.rank == 1 and "killed by signal SIGKILL" in str(info.value)
        assert_gone([s["pid"] for s in rank_files(tmp_path)])
        with pytest.raises(md.SupervisionError):  # as for any call needing the dead worker
            mesh.run_spmd(RANKS, "ok", str(tmp_path))
    finally:
        mesh.stop()


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((os.path.join(SCRIPTS, "no_such_script.py"),), {}, FileNotFoundError, "no such script"),
        ((SCRIPTS,), {}, FileNotFoundError, "no such script"),
        ((42,), {}, TypeError, "script must be a path"),
        ((RANKS, "ok", 3), {}, TypeError, "arguments are strings"),
        ((RANKS,), {"env": {"A": 1}}, TypeError, "env must map str to str"),
        ((RANKS,), {"env": [("A", "1")]}, TypeError, "env must be a dict"),
        ((RANKS,), {"env": {"A=B": "1"}}, ValueError, "not a valid environment variable"),
        ((RANKS,), {"env": {"RANK": "1"}}, ValueError, "sets RANK"),
        ((RANKS,), {"env": {"MASTER_PORT": "http"}}, ValueError, "MASTER_PORT"),
        ((RANKS,), {"timeout": 0}, ValueError, "timeout"),
    ],
)
def test_bad_inputs_are_refused_before_anything_starts(pm, monkeypatch, args, kwargs, exc, match):
    def no_run(*a, **k):
        raise AssertionError("a run was started")

    monkeypatch.setattr(spmd, "_Run", no_run)
    with pytest.raises(exc, match=match):
        pm.run_spmd(*args, **kwargs)


def test_a_mesh_of_remote_hosts_runs_scripts_and_stops_them_on_failure(
    tmp_path, capfd, monkeypatch
):
    """Workers an external launcher started (md.remote_hosts: 2 "hosts" of 2 here, over TCP):
    each has its rank forked by a fork server of its own (not this host's). The variables
    count ranks by host; output is prefixed on the worker's host; a failing rank stops the
    others and is named with the end of its stderr; the mesh runs again; a script missing on
    the workers' host is a FileNotFoundError naming the rank; a worker killed
    during a run is a SupervisionError, and no rank outlives it (the killed worker's own rank
    dies with it: PR_SET_PDEATHSIG)."""
    hosts = md.remote_hosts(2)
    address = hosts.listen({"gpu": 2})
    env = dict(os.environ, MONARCH_DSL_QUIET="1", PYTHONPATH=ROOT, **hosts.env())
    # as torchrun leaves them in its workers' environment: a rank must not inherit the first
    # (rank 0 would wait for an agent's store), and keeps the launcher's thread count
    env.update(TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="3")
    command = [sys.executable, "-m", "monarch_dsl", "worker", "--connect", address]
    workers = [subprocess.Popen(command, env=dict(env, RANK=str(r))) for r in range(4)]
    try:
        pm = hosts.spawn_procs({"gpu": 2}, timeout=120)
        ok = tmp_path / "ok"
        ok.mkdir()
        assert pm.run_spmd(RANKS, "ok", str(ok), timeout=60).values() == [0, 0, 0, 0]
        seen = rank_files(ok, 4)
        assert [s["env"]["RANK"] for s in seen] == ["0", "1", "2", "3"]
        assert [s["env"]["LOCAL_RANK"] for s in seen] == ["0", "1", "0", "1"]
        assert [s["env"]["GROUP_RANK"] for s in seen] == ["0", "0", "1", "1"]
        for s in seen:
            e = s["env"]
            assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) == (
                "4",
                "2",
                "2",
            )
            assert (
                e["MASTER_ADDR"] == "127.0.0.1"
                and e["MASTER_PORT"] == seen[0]["env"]["MASTER_PORT"]
            )
            assert e["MONARCH_DSL_TOKEN"] is None  # the job's secret stays with the workers
            assert not s["token_in_proc_environ"]  # (nor was their fork server given it)
            assert e["TORCHELASTIC_USE_AGENT_STORE"] is None and e["OMP_NUM_THREADS"] == "3"
            assert s["torch_preloaded"]  # forked from the worker's fork server
        out, err = capfd.readouterr()
        assert "[host=1,gpu=0] hello from rank 2 of 4" in out
        assert "[host=0,gpu=1] to stderr from rank 1" in err

        failed = tmp_path / "exit3"
        failed.mkdir()
        with pytest.raises(SpmdError, match=r"rank 1 \(host=0,gpu=1.*exited with code 3") as e:
            pm.run_spmd(RANKS, "exit3", str(failed), timeout=60)
        assert e.value.rank == 1 and e.value.returncode == 3 and list(e.value.stopped) == [0, 2, 3]
        assert "rank 1 gives up" in e.value.stderr
        assert_gone([s["pid"] for s in rank_files(failed, 4)])

        # the mesh runs again: DDP training over gloo (a rendezvous at rank 0's address)
        weights = tmp_path / "w.pt"
        assert pm.run_spmd(DDP_TRAIN, str(weights), "2", timeout=120).values() == [0, 0, 0, 0]
        assert weights.exists()

        # a script missing on the workers' host (found here: check_arguments passes it on)
        missing = str(tmp_path / "elsewhere.py")
        with monkeypatch.context() as m:
            m.setattr(spmd, "check_arguments", lambda *a: (missing, (), {}))
            with pytest.raises(FileNotFoundError, match=r"no such script file on host .*rank 0"):
                pm.run_spmd(missing)

        # a worker's fork server killed during a run: its rank dies with it (an error naming
        # the rank; the others stopped); the next run starts a new one
        servers = _fork_servers([w.pid for w in workers])
        assert len(servers) == 4
        napping = tmp_path / "nap"
        napping.mkdir()
        killer = threading.Thread(
            target=lambda: (
                wait_until(lambda: len(list(napping.glob("*.json"))) == 4, 60, "4 ranks up"),
                os.kill(servers[workers[3].pid], signal.SIGKILL),
            )
        )
        killer.start()
        with pytest.raises(SpmdError, match=r"rank 3 .*SIGKILL"):
            pm.run_spmd(RANKS, "sleep", str(napping), timeout=60)
        killer.join()
        assert_gone([s["pid"] for s in rank_files(napping, 4)])
        assert pm.run_spmd(RANKS, "ok", str(ok), timeout=60).values() == [0, 0, 0, 0]

        sleeping = tmp_path / "sleep"
        sleeping.mkdir()
        killer = threading.Thread(
            target=lambda: (
                wait_until(lambda: len(list(sleeping.glob("*.json"))) == 4, 60, "4 ranks up"),
                workers[2].kill(),
            )
        )
        killer.start()
        with pytest.raises(md.SupervisionError, match="rank 2"):
            pm.run_spmd(RANKS, "sleep", str(sleeping), timeout=60)
        killer.join()
        assert_gone([s["pid"] for s in rank_files(sleeping, 4)])
        servers = _fork_servers([w.pid for w in workers])
        pm.stop()
        assert_gone(list(servers.values()))  # the workers' fork servers end with them
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait(timeout=30)


def _fork_servers(parents: list[int]) -> dict[int, int]:
    """The fork servers run_spmd's agents started: worker pid -> its fork server's pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid in parents and b"forkserver import main" in command:
            out[ppid] = int(entry)
    return out


def test_a_stopped_mesh_refuses_to_run(tmp_path):
    mesh = md.this_host().spawn_procs({"gpu": 1})
    mesh.stop()
    with pytest.raises(md.SupervisionError, match="stopped"):
        mesh.run_spmd(RANKS, "ok", str(tmp_path))


# ----------------------------------------------------------------------------- command line


def cli_command(*args):
    return [sys.executable, "-m", "monarch_dsl", "run", *args]


def cli_env(**extra):
    return dict(os.environ, MONARCH_DSL_QUIET="1", PYTHONPATH=ROOT, **extra)


def cli(*args, timeout=120, **env):
    return subprocess.run(
        cli_command(*args), capture_output=True, text=True, timeout=timeout, env=cli_env(**env)
    )


@pytest.mark.parametrize("mode", ["fork", "fresh"])
def test_cli_runs_a_script_on_n_ranks(tmp_path, mode):
    proc = cli("--spmd", "-n", "2", RANKS, "ok", str(tmp_path), MONARCH_DSL_FORK_SERVER=mode)
    assert proc.returncode == 0, proc.stderr
    assert "[rank=0] hello from rank 0 of 2" in proc.stdout
    assert "[rank=1] hello from rank 1 of 2" in proc.stdout
    assert all(s["torch_preloaded"] for s in rank_files(tmp_path))


def test_cli_exits_with_the_failed_rank_code(tmp_path):
    proc = cli("--spmd", "-n", "2", RANKS, "exit3", str(tmp_path))
    assert proc.returncode == 3, proc.stderr
    assert "rank 1 (rank=1" in proc.stderr and "exited with code 3" in proc.stderr
    assert_gone([s["pid"] for s in rank_files(tmp_path)])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_cli_killed_during_a_run_leaves_no_rank_behind(tmp_path, sig):
    """And Ctrl-C (SIGINT) reaches the ranks as SIGINT, as under torchrun: a script's
    ``except KeyboardInterrupt:`` runs (it may save a checkpoint)."""
    proc = subprocess.Popen(
        cli_command("--spmd", "-n", "2", RANKS, "sigint", str(tmp_path)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=cli_env(),
        # as from a terminal: a shell runs a background job (CI's) with SIGINT ignored, and
        # an ignored signal stays ignored through exec
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_until(lambda: both_started(tmp_path), timeout=60, what="both ranks started")
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert code == (-sig if sig == signal.SIGKILL else 128 + sig)
    interrupted = [(tmp_path / f"{r}.interrupted").exists() for r in range(2)]
    assert interrupted == [sig == signal.SIGINT] * 2
    assert_gone([s["pid"] for s in rank_files(tmp_path)])


def test_cli_refuses_bad_arguments_before_starting_a_mesh(tmp_path, monkeypatch, capsys):
    from monarch_dsl.__main__ import main

    def no_mesh(*a, **k):
        raise AssertionError("a mesh was started")

    monkeypatch.setattr(md.LocalHost, "spawn_procs", no_mesh)
    assert main(["run", "--spmd", "-n", "2", str(tmp_path / "missing.py")]) == 2
    assert "no such script file" in capsys.readouterr().err
    assert main(["run", "--spmd", "-n", "0", RANKS]) == 2
    assert "-n must be at least 1" in capsys.readouterr().err
    assert main(["run", "-n", "2", RANKS]) == 2
    assert "goes with --spmd" in capsys.readouterr().err


# ----------------------------------------------------------------------------- -m module

MODULE = """
import json, os, sys
out = sys.argv[-1]
with open(os.path.join(out, os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"argv": sys.argv, "path0": sys.path[0], "name": __name__,
               "cwd": os.getcwd(), "pid": os.getpid()}, f)
"""


def _module_tree(tmp_path):
    """``spmdpkg.train`` under ``tmp_path/src`` (the working directory the test runs in) and
    an output directory."""
    src, out = tmp_path / "src", tmp_path / "out"
    (src / "spmdpkg").mkdir(parents=True)
    out.mkdir()
    (src / "spmdpkg" / "__init__.py").write_text("")
    (src / "spmdpkg" / "train.py").write_text(MODULE)
    return src, out


def test_a_module_runs_as_python_dash_m_runs_it(pm, tmp_path, monkeypatch):
    src, out = _module_tree(tmp_path)
    monkeypatch.chdir(src)
    assert pm.run_spmd("spmdpkg.train", "--lr", "0.1", str(out), module=True).values() == [0, 0]
    for r, s in enumerate(rank_files(out)):
        assert s["name"] == "__main__" and s["path0"] == str(src) and s["cwd"] == str(src)
        assert s["argv"] == [str(src / "spmdpkg" / "train.py"), "--lr", "0.1", str(out)], r


def test_a_missing_or_malformed_module_is_refused_before_anything_starts(pm, tmp_path, monkeypatch):
    src, _ = _module_tree(tmp_path)
    monkeypatch.chdir(src)
    forked = []
    monkeypatch.setattr(spmd, "_Run", lambda *a, **k: forked.append(a))
    with pytest.raises(ModuleNotFoundError, match="no module named 'spmdpkg.nope'"):
        pm.run_spmd("spmdpkg.nope", module=True)
    with pytest.raises(ValueError, match="dotted module name"):
        pm.run_spmd("spmdpkg/train.py", module=True)
    assert forked == []


def test_cli_runs_a_module_on_n_ranks(tmp_path):
    src, out = _module_tree(tmp_path)
    proc = subprocess.run(
        cli_command("--spmd", "-n", "2", "-m", "spmdpkg.train", str(out)),
        capture_output=True, text=True, timeout=120, env=cli_env(), cwd=src,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [s["argv"][1:] for s in rank_files(out)] == [[str(out)], [str(out)]]
    missing = subprocess.run(
        cli_command("--spmd", "-n", "2", "-m", "spmdpkg.nope"),
        capture_output=True, text=True, timeout=120, env=cli_env(), cwd=src,
    )  # fmt: skip
    assert missing.returncode == 2 and "no module named 'spmdpkg.nope'" in missing.stderr


def test_a_fork_server_of_its_own_that_died_reports_its_ranks_gone_and_forks_no_more():
    """ForkServerClient.start_fresh (a remote worker's, for run_spmd): after the fork server
    dies, a rank watched from then on is reported gone at once (status -1: no run waits for
    an exit that will not come), and fork raises instead of starting another server."""
    from monarch_dsl.errors import SpawnError
    from monarch_dsl.runtime import forkserver
    from monarch_dsl.runtime.messages import ForkScripts

    client = forkserver.ForkServerClient.start_fresh((), 120.0, env=dict(os.environ))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        request = ForkScripts(0, RANKS, ("sleep", "/nonexistent"), (dict(os.environ, RANK="0"),),
                              tuple(sys.path), os.getcwd())  # fmt: skip
        (pid,) = client.fork(request, [out_w, err_w], 60)
    finally:
        os.close(out_w)
        os.close(err_w)
    os.kill(client._pid, signal.SIGKILL)  # the fork server dies (and its rank with it)
    wait_until(lambda: not client.alive, what="the channel's loss")
    statuses = []
    client.watch_exit(pid, statuses.append)
    assert statuses == [-1]
    with pytest.raises(SpawnError, match="fork server died"):
        client.fork(request, [], 5)
    assert_gone([pid])
    client._proc.wait(10)
    for fd in (out_r, err_r):
        os.close(fd)


def test_ranks_forked_but_not_set_up_are_killed_and_their_pipes_closed(monkeypatch):
    """A local run whose output could not be taken over after its ranks were forked (the log
    forwarder failing on a rank's stderr): the error comes out, the forked ranks are killed
    and no pipe end is left open here."""
    import types

    children: list[subprocess.Popen] = []

    class Server:
        def fork(self, request, fds, timeout):  # ranks that lead their process group
            for _ in range(len(fds) // 2):
                children.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
            return tuple(c.pid for c in children)

    taken: list[int] = []

    class Forwarder:
        def add(self, fd, group, rank, is_err):
            if len(taken) == 3:
                raise RuntimeError("can't start new thread")
            taken.append(fd)
            return fd

    monkeypatch.setattr(spmd.forkserver, "fork_server", lambda: Server())
    monkeypatch.setattr(spmd.logs, "forwarder", lambda: Forwarder())
    job = types.SimpleNamespace(
        worker_env={}, log_group=types.SimpleNamespace(label=lambda ranks: str(ranks))
    )
    before = set(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            spmd._Run(job, None, [0, 1], "script.py", (), {})
        for c in children:
            assert c.wait(10) == -signal.SIGKILL
        for fd in taken:  # (the forwarder's: it closes them at the ranks' EOF)
            os.close(fd)
        assert set(os.listdir("/proc/self/fd")) == before
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
