"""Memory budgets of CPU workers (SPEC §8, runtime/memory.py): an allocation past a worker's
budget is a recoverable error, never an out-of-memory kill."""

import resource

import pytest
import torch
from actors_lib import Hog
from conftest import doubling_search, pid_alive
from test_procs import _kill, _launch_workers

import monarch_dsl as md
from monarch_dsl.runtime import controller, memory

pytestmark = pytest.mark.procs

MiB = 1 << 20
FLOAT = 4  # bytes of a float32 element


def assert_every_worker_serves(pm) -> None:
    """Every worker is alive and runs the next command (a collective needs them all)."""
    assert all(pid_alive(pid) for pid in pm.job.pids.values()), pm.job.pids
    assert not pm.job.dead
    with pm.activate():
        ranks = md.inspect(pm.rank("gpu").reduce("gpu", "stack"))
        assert ranks.tolist() == list(range(pm.sizes["gpu"]))
        for gpu in range(pm.sizes["gpu"]):
            assert md.inspect(torch.ones(2) * 2, gpu=gpu).tolist() == [2.0, 2.0]


# ------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    "limit, exc",
    [(-1, ValueError), (1.5, TypeError), ("1GiB", TypeError), (True, TypeError)],
)
def test_bad_memory_limits_are_refused_before_any_worker_starts(limit, exc):
    jobs = set(controller._jobs)
    with pytest.raises(exc, match="memory_limit"):
        md.this_host().spawn_procs({"gpu": 1}, memory_limit=limit)
    hosts = md.remote_hosts(1)
    with pytest.raises(exc, match="memory_limit"):
        hosts.spawn_procs({"gpu": 1}, memory_limit=limit)
    assert hosts._job is None  # not even listening
    assert set(controller._jobs) == jobs


def test_a_bad_memory_limit_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(memory.ENV, "lots")
    jobs = set(controller._jobs)
    with pytest.raises(ValueError, match=memory.ENV):
        md.this_host().spawn_procs({"gpu": 1})
    assert set(controller._jobs) == jobs


def test_budgets_default_to_a_share_of_available_memory_and_zero_turns_them_off():
    with md.this_host().spawn_procs({"gpu": 2}) as pm:
        share = memory.host_available() // 2
        for budget, soft, private, _ in pm.spawn("h", Hog).budget.call().get().values():
            assert 0.8 * share < budget < 1.2 * share, (budget, share)
            assert private < soft <= private + budget  # the limit: its start + its budget
    with md.this_host().spawn_procs({"gpu": 1}, memory_limit=0) as pm:
        budget, soft, _, _ = pm.spawn("h", Hog).budget.call().get().item(gpu=0)
        assert budget == 0
        assert soft == resource.getrlimit(resource.RLIMIT_DATA)[0]  # as it was inherited


# ------------------------------------------------------------------------------ tensors


def test_doubling_search_on_8_workers_ends_in_an_error_and_a_live_mesh():
    with md.this_host().spawn_procs({"gpu": 8}, memory_limit=256 * MiB) as pm:
        with pm.activate():
            largest, e = doubling_search(1 << 20)
        assert largest is not None and largest * FLOAT <= 256 * MiB
        assert "worker memory budget exceeded" in e.error
        assert "256 MiB budget" in e.error
        assert f"asked for {memory.size_text(2 * largest * FLOAT)}" in e.error
        assert "memory_limit" in str(e)
        assert_every_worker_serves(pm)


def test_doubling_search_ends_under_the_default_budget():
    """torch.empty: nothing is touched, whatever the default budget lets through."""
    with md.this_host().spawn_procs({"gpu": 8}) as pm:
        with pm.activate():
            largest, e = doubling_search(1 << 24)
        assert largest is not None
        assert "worker memory budget exceeded" in e.error
        assert_every_worker_serves(pm)


def test_a_touched_allocation_over_the_budget_is_an_error_not_a_kill():
    with md.this_host().spawn_procs({"gpu": 2}, memory_limit=256 * MiB) as pm:
        with pm.activate():
            within = torch.ones(16 * MiB // FLOAT)
            assert md.inspect(within.sum()).item() == 16 * MiB // FLOAT
            over = torch.ones(512 * MiB // FLOAT)
            with pytest.raises(md.RemoteError, match="asked for 512 MiB.*256 MiB budget"):
                md.inspect(over.sum())
            assert md.inspect(within.sum() + 1).item() == 16 * MiB // FLOAT + 1
        assert_every_worker_serves(pm)


def test_workers_keep_freed_memory_for_their_next_step():
    # A step's multi-MiB tensors, made and freed again every step (fully_shard's gathered
    # weights): a worker keeps the memory, so only the first round's pages fault. (With
    # glibc's defaults, how many rounds fault again depends on what the process did before,
    # as glibc adapts its thresholds: a fresh worker faulted 11,100 times here, one forked
    # after the rest of the suite 4,700; no reliable comparison, so none is made.)
    rounds, tensors, numel = 10, 3, MiB  # 3 x 4 MiB a round
    with md.this_host().spawn_procs({"gpu": 1}) as pm:
        faults, pages = pm.spawn("hog", Hog).churn.call_one(tensors, numel, rounds).get()
    assert faults < 2 * pages // rounds, (faults, pages)


def test_md_malloc_retain_0_keeps_glibcs_defaults(monkeypatch):
    monkeypatch.setenv("MD_MALLOC_RETAIN", "0")
    assert memory.retain_freed_memory() is False


def test_a_fetch_with_no_room_for_its_copy_fails_and_the_value_stays():
    with md.this_host().spawn_procs({"gpu": 1}, memory_limit=256 * MiB) as pm:
        with pm.activate():
            big = torch.ones(160 * MiB // FLOAT)  # fits; its copy for the reply does not
            with pytest.raises(md.RemoteError, match="fetch.*asked for 160 MiB"):
                md.inspect(big)
            assert md.inspect(big[:2]).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("executor", ["cpp", "python"])
def test_a_worker_with_its_budget_used_up_starts_a_stream(executor):
    """The runtime's own threads are not the user's: a new stream starts with no room left."""
    env = {"MD_EXECUTOR": executor}
    with md.this_host().spawn_procs({"gpu": 1}, env=env, memory_limit=256 * MiB) as pm:
        with pm.activate():
            held = []
            for chunk in (16 * MiB, MiB):  # held until one does not fit: < 1 MiB is left
                while True:
                    try:
                        t = torch.ones(chunk // FLOAT)
                        md.inspect(t[:1])
                        held.append(t)
                    except md.RemoteError:
                        break
            assert sum(t.numel() for t in held) * FLOAT > 200 * MiB
            with md.Stream("other").activate():
                x = torch.ones(3) * 3
            assert md.inspect(x).tolist() == [3.0, 3.0, 3.0]
            assert md.inspect(held[-1][:1] + 1).tolist() == [2.0]


# ------------------------------------------------------------------------------ actors


def test_an_endpoint_over_the_budget_is_an_actor_error_and_the_actor_lives():
    with md.this_host().spawn_procs({"gpu": 2}, memory_limit=256 * MiB) as pm:
        hog = pm.spawn("h", Hog)
        assert hog.allocate.call(MiB).get().values() == [MiB, MiB]
        with pytest.raises(md.ActorError, match="budget exceeded: asked for 1 GiB.*256 MiB"):
            hog.allocate.call(1 << 28).get()
        with pytest.raises(md.ActorError, match="budget exceeded: asked for 2 GiB"):
            hog.allocate_numpy.call(1 << 28).get()  # numpy's allocations are bounded too
        assert hog.allocate.call(MiB, touch=False).get().values() == [MiB, MiB]
        # The same actor, with its state: every call counted.
        assert hog.allocate.call(1).get().values() == [1, 1]
        assert pm.spawn("again", Hog).allocate.call(2).get().values() == [2, 2]


# ------------------------------------------------------------------------------ other meshes


def test_a_persistent_mesh_keeps_its_budget():
    name = "test-memory-budget"
    pm = md.this_host().spawn_procs({"gpu": 1}, name=name, persistent=True, memory_limit=256 * MiB)
    try:
        pm.spawn("h", Hog)
        pm.detach()
        pm = md.attach(name)
        hog = pm.actors("h")
        assert hog.budget.call().get().item(gpu=0)[0] == 256 * MiB
        with pytest.raises(md.ActorError, match="256 MiB budget"):
            hog.allocate.call(1 << 28).get()
    finally:
        pm.stop()


def test_remote_hosts_set_their_workers_budget_once_joined():
    hosts = md.remote_hosts(2)
    procs = _launch_workers(hosts.listen({"gpu": 1}), hosts.env(), [0, 1])
    try:
        pm = hosts.spawn_procs({"gpu": 1}, timeout=60, memory_limit=256 * MiB)
        hog = pm.spawn("h", Hog)
        assert [b[0] for b in hog.budget.call().get(timeout=30).values()] == [256 * MiB] * 2
        with pytest.raises(md.ActorError, match="256 MiB budget"):
            hog.allocate.call(1 << 28).get(timeout=30)
        pm.stop()
    finally:
        _kill(procs)
