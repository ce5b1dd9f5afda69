"""The tensor engine of one process allocation: instructions batched for the workers.

Each op appends an instruction (``monarch_dsl/isa``) to the batch; batches go to the workers
lazily -- when a value is fetched, when the batch is big, a moment after it started, or at
``stop()`` -- so the controller never pays a round trip per op. Tensors the garbage collector
took are deleted on the workers by the next batch. The engine keeps itself in its controller
Job's ``extensions`` and has the job's ``before_stop`` wait for what it sent.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch

from monarch_dsl import isa
from monarch_dsl.errors import SupervisionError
from monarch_dsl.frames import user_line
from monarch_dsl.mesh import Mesh
from monarch_dsl.runtime import controller
from monarch_dsl.runtime.messages import RunBatch, SetupCollectives
from monarch_dsl.tensor.replay import Replay

BATCH_MAX = 1000  # instructions; more are sent at once
EXTENSION = "tensor"  # the engine's name in its job's extensions

_AFTER_DELETES = (isa.Fetch, isa.RunPlan)
_default_dtype = torch.get_default_dtype


def _fetches(items: tuple) -> list[int]:
    """The call ids of the fetches in a batch's ``items`` (their callers wait for them)."""
    return [ins.call_id for _, ins in items if isinstance(ins, isa.Fetch)]


class Engine:
    """The tensor engine of one process allocation (a controller Job)."""

    def __init__(self, job: controller.Job):
        self.job = job
        self.ranks = tuple(range(job.world))
        self.batch: list[tuple[int, Any]] = []
        self.held = False  # a flush is due a moment from now (see append)
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.dead: list[tuple[int, str]] = []  # (ref, stream) of collected tensors
        self.refs = itertools.count(1)
        self.meshes: dict[tuple, int] = {}
        self.store: Any = None
        # What handles report as .device: the workers' device type (their data lives there).
        types = {hello.device for hello in job.hellos.values()}
        self.device = torch.device("cuda" if types == {"cuda"} else "cpu")
        self.batches_sent = 0
        self.mesh_shapes: dict[int, tuple] = {}  # mesh id -> (dims, sizes)
        self.replay: Replay | None = None  # see start_replay
        # The torch default dtype the batch is issued under (sent with it: the workers'
        # factories and type promotion use it); see _switch_default_dtype.
        self.default_dtype = torch.get_default_dtype()
        self._switching = False

    @classmethod
    def of(cls, mesh: Any) -> Engine:
        """The engine of ``mesh``'s allocation; made on first use, when it registers with
        the job: ``ProcMesh.stop`` then waits (``sync``) for what it sent."""
        job = mesh.job
        engine = job.extensions.get(EXTENSION)
        if engine is None:
            engine = job.extensions[EXTENSION] = cls(job)
            job.before_stop.append(engine.sync)
        return engine

    @staticmethod
    def of_job(job: controller.Job) -> Engine | None:
        """The engine of ``job``, or None if no mesh of it was ever used for tensors."""
        return job.extensions.get(EXTENSION)

    # ---- batching --------------------------------------------------------------------------
    def append(self, mesh: int, ins: Any) -> None:
        # No lock for an op: list.append is atomic, and flush takes the items it found from
        # the front of the same list, so one appended meanwhile stays for the next batch.
        if _default_dtype() is not self.default_dtype and not self._switching:
            self._switch_default_dtype()
        batch = self.batch
        # A fetch or barrier comes after the deletes of tensors that died before it; so does a
        # plan run (its caller holds every tensor it uses), so that the state a step replaced
        # (the last step's gradients) is freed before the step runs, not at the next flush:
        # its memory, an all-reduce's buffer, is reused.
        if self.dead and type(ins) in _AFTER_DELETES:
            with self.lock:
                self._append_deletes()
                batch.append((mesh, ins))
        else:
            batch.append((mesh, ins))
        if len(batch) >= BATCH_MAX:
            self.flush()
        elif not self.held:  # flush clears it before taking the items: none is left behind
            self.held = True
            try:
                # sent at the latest a moment from now; in a step being replayed, when the
                # program waits for something or at the next cut (at the latest LAZY_DELAY)
                replay = self.replay
                lazy = replay is not None and replay.active and replay.signature is not None
                self._hold(lazy)
            except BaseException:
                self.held = False
                raise

    def _hold(self, lazy: bool) -> None:
        """The batch has its first instruction: the flusher sends it (``controller.Flusher``)."""
        controller.flusher().hold(self, lazy=lazy)

    def flush(self) -> None:
        # The caller's thread and the flusher thread both flush: taking a batch and sending it
        # happen under one lock, so batches go out in the order they were taken.
        with self.send_lock:
            with self.lock:
                self.held = False
                self._append_deletes()
                batch = self.batch
                if not batch:
                    return
                items = tuple(batch)
                del batch[: len(items)]
                default_dtype = isa.dtype_name(self.default_dtype)
            if self.job.stopped or self.job.stopping:
                return
            if self.job.dead:
                # A worker died: this batch can never run. Its fetches fail with the death
                # (each was failed when it died; this is for one that was not). A death the
                # program has not been told of is raised, and is told from then on where
                # this caller raises it to the program (not the flusher's: it swallows it);
                # one it has been told of (Job.told) is not raised again: at the end of a
                # ``with pm.activate():`` block that caught the error, the deletes of the
                # tensors it dropped would raise it a second time.
                dead = sorted(self.job.dead)
                untold = [r for r in dead if r not in self.job.told]
                fetches = _fetches(items)
                if fetches:
                    self.job.fail_calls(fetches, self.job.death(dead[0]))
                if untold:
                    death = self.job.death(untold[0])
                    if not controller.is_quiet():
                        self.job.raised(death)  # (told: it reaches the program)
                    raise death
                return
            replay = self.replay  # (read once: a finalizer may stop it meanwhile)
            if replay is not None:
                items = replay.rewrite(items, self.mesh_shapes, default_dtype)
            self.batches_sent += 1
            try:
                self.job.post(self.ranks, RunBatch(items, default_dtype))
            except SupervisionError as e:
                # A dead worker (one that died since the check above): its pending calls fail
                # with its death; raised to the program here, it is told (as above)
                if not controller.is_quiet():
                    self.job.raised(e)
                raise
            except Exception as e:
                # The batch could not be encoded or sent (an internal error): the fetches it
                # held are never answered; fail them with the cause, not a wait forever.
                lost = RuntimeError(
                    f"internal: a batch of {len(items)} instructions could not be sent to the "
                    f"workers ({type(e).__name__}: {e}); the values it computed are lost"
                )
                self.job.fail_calls(_fetches(items), lost)
                raise

    def _switch_default_dtype(self) -> None:
        """An instruction is issued under another torch default dtype
        (``torch.set_default_dtype``) than the ones before it: those are sent and run first
        (a worker's default dtype is its process's, and its streams may still be running what
        it got before), and what follows goes under the new one."""
        self._switching = True  # (sync appends a barrier)
        try:
            self.sync()
        finally:
            self._switching = False
        with self.lock:
            self.default_dtype = _default_dtype()

    def mesh_id(self, mesh: Mesh) -> int:
        mid = mesh.__dict__.get("_md_mesh_id")
        if mid is not None:
            return mid
        mid = mesh.__dict__["_md_mesh_id"] = self._mesh_id(mesh)
        return mid

    def _mesh_id(self, mesh: Mesh) -> int:
        key = (mesh.dims, tuple(mesh.ranks))
        mid = self.meshes.get(key)
        if mid is None:
            mid = self.meshes[key] = len(self.meshes)
            sizes = tuple(mesh.sizes.values())
            self.mesh_shapes[mid] = (tuple(mesh.dims), sizes)
            self.append(-1, isa.DefineMesh(mid, mesh.dims, sizes, key[1]))
        return mid

    def rank_mesh_id(self, rank: int) -> int:
        """The id of the one-rank mesh of ``rank`` (for instructions only it runs)."""
        key = ((), (rank,))
        mid = self.meshes.get(key)
        if mid is None:
            mid = self.meshes[key] = len(self.meshes)
            self.append(-1, isa.DefineMesh(mid, (), (), (rank,)))
        return mid

    def ensure_collectives(self) -> None:
        if self.store is None:
            import torch.distributed as dist

            host = "127.0.0.1"
            if self.job.address.startswith("tcp:"):
                host = self.job.address[4:].rpartition(":")[0].strip("[]")
            self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            self.flush()
            self.job.post(self.ranks, SetupCollectives(host, self.store.port))

    def sync(self, timeout: float | None = None) -> None:
        """Wait until every worker has run what was sent so far (their failure reports have
        then arrived); ``TimeoutError`` after ``timeout`` seconds."""
        if self.job.stopped:
            return
        call_id, fut = self.job.expect(self.ranks, None, whole_job=True)
        self.append(-1, isa.Fetch(call_id, -1, "main", user_line()))
        self.flush()
        fut.get(timeout)

    # ---- replay (tensor/replay.py) ----------------------------------------------------------
    def start_replay(self) -> Replay:
        """Turn on record and replay of repeated batches (a user: ``stop_replay`` undoes it)."""
        with self.send_lock:
            if self.replay is None:
                self.replay = Replay()
            self.replay.users += 1
            return self.replay

    def stop_replay(self) -> None:
        """From a wrapper's finalizer, so from any thread and in the middle of anything (a
        garbage collection in a flush): no locks, no sending. A batch that waits lazily goes
        when the program next waits for something (at the latest ``LAZY_DELAY``); the next
        op's batch goes on the timer."""
        replay = self.replay
        if replay is not None:
            replay.users -= 1
            if replay.users <= 0:
                self.replay = None
                self.held = False

    def cut(self, signature: Any = ()) -> None:
        """A step starts (``md.DistributedDataParallel.forward``): what came before is one
        batch, so that each step is a batch of its own, the same from one step to the next.
        ``signature``: what the step's batches are told apart by besides their instructions
        (the shapes of the step's inputs); None: the step's batches are not to be replayed."""
        if self.batch or self.dead:
            self.flush()
        replay = self.replay  # (a finalizer in the flush may have stopped it)
        if replay is not None:
            replay.signature = signature

    def new_ref(self) -> int:
        return next(self.refs)

    def delete(self, ref: int, stream: str = "main") -> None:
        """From ``Tensor.__del__``, so from any thread and in the middle of anything (a garbage
        collection): no locks, no sending; the next batch carries the deletion."""
        self.dead.append((ref, stream))

    def _append_deletes(self) -> None:
        """Deletes of collected tensors: after every instruction issued while they lived, and
        before a fetch or barrier issued after they died. Holds the lock."""
        by_stream: dict[str, list[int]] = {}
        for ref, stream in self._take_dead():
            by_stream.setdefault(stream, []).append(ref)
        for stream, refs in by_stream.items():
            self.batch.append((-1, isa.Delete(tuple(refs), stream)))

    def _take_dead(self) -> list[tuple[int, str]]:
        dead = []
        while True:
            try:
                dead.append(self.dead.pop())
            except IndexError:
                return dead
