"""A worker killed during tensor work (issue 14, item 6): every pending and later call names the
dead rank and its signal as a SupervisionError; the survivors' failures that its death caused
(their collective lost its peer) are reported as its doing, never as their own, with no
traceback per step and no thread dying; nothing stays in /dev/shm."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import monarch_dsl as md
from monarch_dsl.runtime import controller, logs, shm, transport
from monarch_dsl.runtime.messages import FetchFailed
from monarch_dsl.tensor.engine import Engine

sys.path.insert(0, str(Path(__file__).parent))
from actors_lib import Counter, RefTable, shared_last_run  # noqa: E402
from compiler_helpers import TwoStages, mse_step  # noqa: E402

pytestmark = pytest.mark.procs
NAMED = r"worker rank 1 \(dp=1, pid \d+\) was killed by signal SIGKILL"


@md.remote(propagate=lambda rank: torch.zeros(()))
def _die_on(rank):
    """SIGKILLs the worker of ``rank`` at this point of its stream."""
    if md.current_rank().rank == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    return torch.zeros(())


@contextlib.contextmanager
def _one_batch(pm):
    """What is issued inside goes to the workers in one batch, after the block: the victim's
    death cannot be noticed before the survivor has the work after it."""
    with Engine.of(pm).send_lock:
        yield


def _killed_with_no_timed_flush(pm) -> Engine:
    """``pm``'s engine, which sends a batch only when something flushes it (no timer), after
    rank 1 was SIGKILLed and its death recorded."""
    engine = Engine.of(pm)
    engine._hold = lambda lazy: None
    with pm.activate():
        md.inspect(torch.ones(2))
    os.kill(pm.job.pids[1], signal.SIGKILL)  # our own worker
    with pm.job._cond:
        assert pm.job._cond.wait_for(lambda: 1 in pm.job.dead, 30)
    return engine


@pytest.fixture
def dp2():
    segments = set(shm.segments())
    pm = md.this_host().spawn_procs({"dp": 2})
    try:
        yield pm
    finally:
        pm.stop()  # raises no RemoteError for the survivor's broken collectives
        assert set(shm.segments()) <= segments


def _survivor_holds(pm, table, ref) -> tuple:
    """What rank 0 holds under ``ref``; asserts it printed no traceback up to now."""
    held = table.slice(dp=0).held.call_one(ref).get(timeout=30)
    err = logs.forwarder().stderr_tail(pm.job.stderr[0])
    assert "held-done" in err and "Traceback" not in err, err
    return held


def _assert_names_the_dead(info) -> None:
    assert info.value.rank == 1 and info.value.coords == {"dp": 1}, info.value


@pytest.mark.parametrize(
    "sharded, warm", [(False, 1), (False, 4), (True, 1)], ids=["ddp", "ddp-blocks", "fully_shard"]
)
def test_a_worker_killed_during_compiled_steps_is_named(dp2, sharded, warm):
    """(fully_shard: the victim dies between steps of all-gathers, re-gathers and
    reduce-scatters through shared memory, which its peer waits in. ddp-blocks: after the
    warm calls the gradient bucket is in a block of shared memory both ranks map, whose
    all-reduce the survivor waits in; nothing of it stays in /dev/shm.)"""
    table = dp2.spawn("refs", RefTable)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)
    )
    if sharded:
        md.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 16)

    step = md.mesh_fn(mse_step(model, opt), data_parallel="dp")
    with dp2.activate():
        for _ in range(warm):
            assert torch.isfinite(md.inspect(step(x, y)))
    if warm == 4:  # (the bucket is in a block now: the survivor waits in its all-reduce)
        assert shared_last_run(dp2, step) == [1, 1]
    with pytest.raises(md.SupervisionError, match=NAMED) as info:
        with dp2.activate():
            with _one_batch(dp2):
                _die_on(1)
                losses = [step(x, y) for _ in range(3)]
            md.inspect(losses[-1], dp=0)  # the survivor's value: it lost its peer
    _assert_names_the_dead(info)
    # Later calls name it too, each with an error of its own.
    errors = []
    for _ in range(2):
        with pytest.raises(md.SupervisionError, match=NAMED) as info:
            with dp2.activate():
                md.inspect(step(x, y), dp=0)
        _assert_names_the_dead(info)
        errors.append(info.value)
    assert errors[0] is not errors[1]
    # The survivor's steps failed with their broken communication as the value (not "was
    # deleted": nothing made), and it printed no traceback per step.
    for loss in losses:
        kind, failure = _survivor_holds(dp2, table, loss._md_ref)
        assert kind == "failure" and failure[0] == 0, (kind, failure)


def test_a_worker_killed_during_pipelined_steps_is_named(dp2):
    """pp=2 with micro-batches: the second stage's rank dies between steps, while the first
    stage's waits in the sends and receives of activations and gradients. That survivor's
    step fails with the broken link as its value (its own stage's gradients, which live on it
    alone), with no traceback; pulling the state back names the dead rank too."""
    table = dp2.spawn("refs", RefTable)
    pipe = dp2.rename(dp="pp")
    torch.manual_seed(0)
    model = TwoStages()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 16)

    def train(x, y):
        loss = mse_step(model, opt)(x, y)
        return loss, model.first[0].weight.grad  # (stage 0's: on the survivor)

    step = md.mesh_fn(train, micro_batches=2)
    with pipe.activate():
        assert torch.isfinite(md.inspect(step(x, y)[0]))
    with pytest.raises(md.SupervisionError, match=PIPE_NAMED) as info:
        with pipe.activate():
            with _one_batch(pipe):
                _die_on(1)
                outs = [step(x, y) for _ in range(3)]
            md.inspect(outs[-1][0])  # (the loss is the last stage's: the dead rank's)
    assert info.value.rank == 1
    for _, grad in outs:
        kind, failure = _survivor_holds(dp2, table, grad._md_ref)
        assert kind == "failure" and failure[0] == 0, (kind, failure)
    with pytest.raises(md.SupervisionError, match=PIPE_NAMED):
        step.pull()


PIPE_NAMED = r"worker rank 1 \((dp|pp)=1, pid \d+\) was killed by signal SIGKILL"


def test_a_worker_killed_during_eager_collectives_is_named(dp2):
    table = dp2.spawn("refs", RefTable)
    with dp2.activate():
        t = torch.ones(64)
        assert md.inspect(md.reduce(t, "dp")).sum() == 128
        # The controller blocks in the fetch of the survivor's value while the victim dies.
        with pytest.raises(md.SupervisionError, match=NAMED) as info:
            with _one_batch(dp2):
                _die_on(1)
                fetched = md.reduce(t, "dp")
                unfetched = md.reduce(t, "dp")  # stop() must not blame the survivor for it
            md.inspect(fetched, dp=0)
        _assert_names_the_dead(info)
    with pytest.raises(md.SupervisionError, match=NAMED):
        with dp2.activate():
            md.inspect(t + 1)
    for s in (fetched, unfetched):
        kind, failure = _survivor_holds(dp2, table, s._md_ref)
        assert kind == "failure" and failure[2] == "reduce ('dp',)", (kind, failure)
    assert dp2.job.failures  # the survivor reported them; stop() (the fixture) raises none


def test_a_death_the_program_caught_is_not_raised_again_at_the_blocks_end(dp2):
    engine = Engine.of(dp2)
    engine._hold = lambda lazy: None  # no timed flush: the block's end sends what is held
    with dp2.activate():
        t = torch.ones(8)
        assert md.inspect(md.reduce(t, "dp")).sum() == 16
        with pytest.raises(md.SupervisionError, match=NAMED):
            with _one_batch(dp2):
                _die_on(1)
                u = md.reduce(t, "dp")
            md.inspect(u, dp=0)
        del u, t  # their deletes, and an op nobody fetches, wait in the batch
        v = torch.ones(2) * 2
        assert engine.batch and dp2.job.told == {1}
    assert not engine.batch  # dropped at the end: the program was told
    with pytest.raises(md.SupervisionError, match=NAMED):  # and told again when it asks
        md.inspect(v)


def test_a_death_nobody_was_told_of_is_raised_at_the_blocks_end(dp2):
    """Also when the flusher's thread sent a batch after the death first: it swallows the
    error (it must not die of it), which tells the program nothing."""
    engine = _killed_with_no_timed_flush(dp2)
    issued = False
    with pytest.raises(md.SupervisionError, match=NAMED):
        with dp2.activate():
            torch.ones(2) + 1
            controller.flusher().hold(engine)
            controller.flusher().flush_all()  # (as the flusher's thread: the error swallowed)
            assert not engine.batch
            torch.ones(2) + 2
            issued = True
    assert issued and 1 in dp2.job.told


def test_a_death_a_flush_raised_to_the_program_is_not_raised_again_at_the_blocks_end(dp2):
    """A batch's flush on the program's thread (md.DistributedDataParallel's forward starting
    a step, a full batch) raises the death to the program, which caught it here: the deletes
    at the block's end do not raise it a second time (test_replay's killed-worker test did,
    now and then)."""
    engine = _killed_with_no_timed_flush(dp2)
    with dp2.activate():
        t = torch.ones(2) + 1
        with pytest.raises(md.SupervisionError, match=NAMED):
            engine.cut()  # (as the wrapper's forward does)
        assert dp2.job.told == {1}
        del t
        torch.ones(2) + 2
        assert engine.batch
    assert not engine.batch


def test_a_death_landing_as_a_batch_is_sent_is_raised_once(dp2, monkeypatch):
    """The death is recorded after the flush checked for one and before the batch is posted:
    the send raises it to the program, which is then told (the block's end raised it a second
    time: test_replay's killed-worker test failed so in CI)."""
    job = dp2.job
    real = job.post

    def racing(ranks, msg):
        if 1 not in job.dead:  # the death lands as the batch goes out
            job.dead[1] = md.SupervisionError(
                "worker rank 1 (dp=1, pid 1) was killed by signal SIGKILL", rank=1, coords={"dp": 1}
            )
        return real(ranks, msg)

    try:
        with dp2.activate():
            t = torch.ones(2) + 1
            monkeypatch.setattr(job, "post", racing)
            with pytest.raises(md.SupervisionError, match=NAMED):
                md.inspect(t)
            assert 1 in job.told
            del t  # (a delete at the block's end: the death is not raised again)
    finally:
        monkeypatch.undo()
        job.dead.pop(1, None)  # (a made-up death: the worker is alive, and stopped as such)
        job.told.discard(1)


def test_a_fetch_registered_as_a_worker_dies_is_refused_not_left_waiting(dp2, monkeypatch):
    """A death the receiver thread records while expect prepares the call: the call is
    refused with it (it would not be among the calls the death fails, and would wait
    forever)."""
    job = dp2.job
    real = controller.Pending

    def racing(*args, **kwargs):
        if 1 not in job.dead:  # the death lands as the call is made
            job.dead[1] = md.SupervisionError(
                "worker rank 1 (dp=1, pid 1) was killed by signal SIGKILL", rank=1, coords={"dp": 1}
            )
        return real(*args, **kwargs)

    monkeypatch.setattr(controller, "Pending", racing)
    try:
        with pytest.raises(md.SupervisionError, match=NAMED):
            job.expect([0], None, whole_job=True)
        assert not job.pending and 1 in job.told
    finally:
        job.dead.pop(1, None)  # (a made-up death: the worker is alive, and stopped as such)


def test_after_the_death_calls_from_any_thread_name_it(dp2):
    counters = dp2.spawn("c", Counter)
    with pytest.raises(md.SupervisionError, match=NAMED):
        counters.slice(dp=1).sigkill_self.call_one().get(timeout=30)
    seen = []

    def tensor_work():
        try:
            with dp2.activate():
                md.inspect(md.reduce(torch.ones(4), "dp"))
        except md.SupervisionError as e:
            seen.append(e)

    worker = threading.Thread(target=tensor_work)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and len(seen) == 1 and re.match(NAMED, str(seen[0])), seen
    with pytest.raises(md.SupervisionError, match=NAMED):
        counters.get.call().get(timeout=10)
    assert counters.slice(dp=0).incr.call_one().get(timeout=10) == 1  # the survivor serves


# ---- the order of the reports, without processes -----------------------------------------


@pytest.fixture
def job():
    """A job of two ranks whose connections are socket pairs (no workers): the test plays
    the messages' order."""
    j = controller.Job(("dp",), (2,))
    ends = []
    for rank in range(2):
        ours, theirs = socket.socketpair()
        ends.append(theirs)
        j.conns[rank] = transport.Connection(ours, f"rank {rank}")
        j.pending_by_rank[rank] = set()
    try:
        yield j
    finally:
        j.stop(timeout=0.1)
        for s in ends:
            s.close()


PEER_LOST = (0, "train.py:3", "all_reduce", "RuntimeError: rank 1 exited without taking part", "")


@contextlib.contextmanager
def _reading(job):
    """Read replies as a waiting caller does (the background reader steps aside)."""
    with job._handoff_lock:
        job._callers_reading = 1
    os.write(job._wake_w, b"x")
    try:
        with job._read_lock:
            yield
    finally:
        with job._handoff_lock:
            job._callers_reading = 0


def _fetch(job, failure, whole_job=True):
    """A fetch of rank 0's value, answered with ``failure``."""
    call_id, fut = job.expect((0,), lambda values: values[0], whole_job=whole_job)
    with _reading(job):
        job._dispatch(0, FetchFailed(call_id, 0, failure))
    return fut


def test_a_survivors_broken_collective_reported_before_the_death_is_the_deaths(job):
    fut = _fetch(job, PEER_LOST)
    assert not fut.done()  # held: a death may explain it
    with _reading(job):
        job._on_lost(1, job.conns[1], EOFError())
    lost = r"worker rank 1 \(dp=1\) lost its connection"
    with pytest.raises(md.SupervisionError, match=lost):
        fut.get(timeout=1)
    # After the death, a call of rank 0 alone whose communication broke: the death's, at once.
    fut = _fetch(job, PEER_LOST, whole_job=False)
    assert fut.done()
    with pytest.raises(md.SupervisionError, match=lost):
        fut.get()


def test_a_broken_collective_no_death_explains_is_the_survivors_after_a_while(job, monkeypatch):
    monkeypatch.setattr(controller, "PEER_LOSS_WAIT", 0.2)
    fut = _fetch(job, PEER_LOST)
    assert not fut.done()
    with pytest.raises(md.RemoteError, match="all_reduce at train.py:3 failed on worker rank 0"):
        fut.get(timeout=10)  # the background reader releases it at its deadline
    # The user's own error is reported at once.
    fut = _fetch(job, (0, "train.py:4", "aten::mm", "RuntimeError: shapes differ", ""))
    assert fut.done()
    with pytest.raises(md.RemoteError, match="shapes differ"):
        fut.get()
