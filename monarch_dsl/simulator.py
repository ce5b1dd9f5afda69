"""``md.Simulator``: a mesh that accepts every eager program (ops, streams, borrows, reduces,
``to_mesh``, remote functions, ``grad_generator``, optimizers, compiled steps) and runs none
of it: no worker process is started. The tensor engine and everything above it run
unchanged; the simulated job below them executes the instructions with costs instead of data
(``compiler/simulate_eager.py``, which says the model) and answers fetches with zeros."""

from __future__ import annotations

import gc
import itertools
import os
import pickle
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from monarch_dsl.compiler.profile import DeviceProfile, ProfileLike
from monarch_dsl.compiler.simulate import SimEvent, SimReport
from monarch_dsl.compiler.simulate_eager import FREE, EagerSimulator, Issued, Replayed
from monarch_dsl.errors import SupervisionError
from monarch_dsl.proc_mesh import ProcMesh, _root
from monarch_dsl.remote import function_of
from monarch_dsl.runtime import controller, logs
from monarch_dsl.runtime.future import Future, before_block
from monarch_dsl.runtime.messages import Hello, RunBatch, SetupCollectives
from monarch_dsl.tensor.engine import EXTENSION, Engine
from monarch_dsl.tensor.replay import Replay

TRACE_MODES = ("stream_only", "everything")  # everything: the controller's issue times too
_call_ids = itertools.count(1)
QUEUED_MAX = 2000  # instructions the simulated job holds before it simulates them (post)


class _Own(threading.local):
    """Per thread (a thread's own: a new thread that gets a dead one's id starts afresh):
    the CPU seconds of work that is not the simulated program's so far (the simulators' own:
    own_work; Python's garbage collections, whose cost here is the simulator's heap), how
    deep in own_work it is, and when the collection under way started."""

    seconds = 0.0
    depth = 0
    gc_start: float | None = None


_OWN = _Own()


@contextmanager
def own_work() -> Iterator[None]:
    """The simulator's own work on this thread (simulating a batch, a report): its CPU seconds
    are left out of the controller's measured Python (``Issued.python``)."""
    own = _OWN
    depth = own.depth
    own.depth = depth + 1
    start = time.thread_time() if depth == 0 else 0.0
    try:
        yield
    finally:
        own.depth = depth
        if depth == 0:
            own.seconds += time.thread_time() - start


def _collecting(phase: str, info: dict) -> None:
    """``gc.callbacks``: a collection's CPU time counts as the simulator's own (outside
    ``own_work``: inside it, it is counted already). Its cost scales with the heap, and the
    simulator's (every event, the meta values) is not the controller's."""
    own = _OWN
    if own.depth:
        return
    if phase == "start":
        own.gc_start = time.thread_time()
    elif (start := own.gc_start) is not None:
        own.gc_start = None
        own.seconds += time.thread_time() - start


_HELD: weakref.WeakSet[Any] = weakref.WeakSet()  # simulated engines holding a batch


def _flush_held() -> None:
    """``future.before_block``: a caller is about to wait; the simulated engines send what
    they hold (on its thread)."""
    for engine in list(_HELD):
        _HELD.discard(engine)
        if engine.held:
            try:
                engine.flush()
            except SupervisionError:  # (a broken simulated mesh: its own calls fail with
                pass  # it; the caller waiting here may wait for something else)


def _function_shapes(payload: bytes, args: tuple, kwargs: dict) -> Any:
    """A remote function's result on meta tensors: its propagator's, else the function's own
    run on meta tensors."""
    fn = function_of(payload)
    if fn is not None and fn.propagate is not None:
        out = fn.propagate(*args, **kwargs)
    else:
        f = fn.fn if fn is not None else pickle.loads(payload)
        try:
            with torch.device("meta"):
                out = f(*args, **kwargs)
        except Exception as e:
            name = getattr(f, "__qualname__", "a remote function")
            raise TypeError(
                f"{name} could not run on meta tensors to give its output shapes to the "
                f"simulator ({type(e).__name__}: {e}): give it @md.remote(propagate=...)"
            ) from e
    return pytree.tree_map(
        lambda x: (
            torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x
        ),
        out,
    )


class SimJob:
    """A controller Job without workers: what the tensor engine sends it (``RunBatch``) is
    queued and run in the simulator (``post``, ``drain``), and its fetches are answered from
    there."""

    def __init__(
        self, dims: tuple[str, ...], sizes: tuple[int, ...], prof: DeviceProfile, trace: str
    ):
        self.dims, self.sizes = dims, sizes
        self.world = 1
        for s in sizes:
            self.world *= s
        self.address = "simulated:"
        host = socket.gethostname()
        self.hellos = {r: Hello(r, 0, host, "cpu") for r in range(self.world)}
        self.pids: dict[int, int] = {}
        self.dead: dict[int, Any] = {}
        self.extensions: dict[str, Any] = {}
        self.log_group = logs.LogGroup(dims, sizes)  # (no pipes: pm.logging changes nothing)
        self.before_stop: list[Callable[[float], None]] = []
        self.stopping = False
        self.stopped = False
        self.broken = ""  # why the simulator itself failed (its own error, not the program's)
        self.failures: list[tuple] = []
        self.observed: set[tuple] = set()
        self.pending: dict[int, tuple[Future, Callable[[list], Any] | None, list, list]] = {}
        self.issued: dict[int, Issued] = {}  # id(instruction) -> how it was issued (_SimEngine)
        self.runs: dict[int, Replayed] = {}  # id(a replay's RunPlan) -> what it stands for
        self.queue: deque[tuple[Sequence[int], tuple, list]] = deque()  # batches to simulate
        self.queued = 0  # instructions in them
        self.lock = threading.RLock()
        self.sim = EagerSimulator(
            dims,
            sizes,
            prof,
            self._reply,
            self._reply_failure,
            self.failures.append,
            _function_shapes,
            trace_controller=trace == "everything",
            batch_window=controller.FLUSH_DELAY,
        )

    coords = controller.Job.coords
    remote_error = controller.Job.remote_error
    unobserved_failures = controller.Job.unobserved_failures

    def describe(self, rank: int) -> str:
        coords = ",".join(f"{d}={c}" for d, c in self.coords(rank).items())
        return f"simulated rank {rank} ({coords})"

    def check_alive(self, ranks: Sequence[int]) -> None:
        if self.broken:
            raise SupervisionError(self.broken)
        if self.stopped or self.stopping:
            raise SupervisionError("this simulated mesh has been stopped")

    def expect(
        self, ranks: Sequence[int], finish: Callable[[list], Any] | None, whole_job: bool = False
    ) -> tuple[int, Future]:
        self.check_alive(ranks)
        call_id = next(_call_ids)
        fut: Future = Future()
        self.pending[call_id] = (fut, finish, list(ranks), [])
        return call_id, fut

    def post(self, ranks: Sequence[int], msg: Any) -> None:
        """A batch is queued, and the queue simulated when a call awaits its reply (a
        fetch, a remote function's result: its caller is about to wait for it) or the queue
        holds ``QUEUED_MAX`` instructions (``drain``):
        the simulator's work, between stretches of the program, slowed the program's own
        measured Python by up to 1.5x (the caches it leaves cold); in fewer, longer runs,
        less."""
        self.check_alive(ranks)
        if isinstance(msg, RunBatch):
            with self.lock:
                issued = [
                    self.runs.pop(id(ins), None) or self.issued.pop(id(ins), None)
                    for _, ins in msg.items
                ]
                self.queue.append((ranks, msg.items, issued, msg.default_dtype))
                self.queued += len(msg.items)
                if self.queued >= QUEUED_MAX or self.pending:  # (a call awaits its reply)
                    self.drain()
        elif not isinstance(msg, SetupCollectives):  # (no process groups to set up)
            raise TypeError(f"the simulator has no handler for {type(msg).__name__}")

    def drain(self) -> None:
        """Simulate the queued batches, in order."""
        # (from the user's thread under pm.activate(): the values made here are local)
        with own_work(), self.lock, _disable_current_modes():
            while self.queue:
                ranks, items, issued, default_dtype = self.queue.popleft()
                self.queued -= len(items)
                mine = torch.get_default_dtype()
                try:
                    # (the default dtype the batch was issued under, as workers take it;
                    # the program's may have changed since. Process-wide: an op issued on
                    # another thread meanwhile sees it, where the two differ)
                    want = getattr(torch, default_dtype) if default_dtype else mine
                    if want is not mine:
                        torch.set_default_dtype(want)
                    self.sim.run(ranks, items, issued)
                except Exception as e:
                    # The simulator's own failure (a program the workers would run that it
                    # cannot): the mesh is done (nothing more is queued: check_alive), its
                    # waiting calls fail saying so, and the thread draining gets a
                    # SupervisionError instead of e (a wait's before_block flush drops it).
                    self.queue.clear()
                    self.queued = 0
                    self._break(e)
                    raise SupervisionError(self.broken) from e
                finally:
                    if torch.get_default_dtype() is not mine:
                        torch.set_default_dtype(mine)

    def replayed(self, run: Any, body: list[Any]) -> None:
        """``run`` (a replay's ``RunPlan``, about to be posted) stands for the instructions
        ``body``: how each was issued goes with it."""
        with self.lock:
            self.runs[id(run)] = Replayed(tuple((i, self.issued.pop(id(i), None)) for i in body))

    def request(self, *args: Any, **kwargs: Any) -> Future:
        raise NotImplementedError(
            "md.Simulator simulates tensor programs; actors need worker processes"
        )

    def raised(self, exc: BaseException) -> None:
        """As ``Job.raised`` (a simulated worker does not die: nothing to record)."""

    def fail_calls(self, call_ids: Sequence[int], err: BaseException) -> None:
        """As ``Job.fail_calls``: the pending calls ``call_ids`` fail with ``err`` (their
        batch could not be sent)."""
        for call_id in call_ids:
            p = self.pending.pop(call_id, None)
            if p is not None:
                p[0].set_exception(err)

    def _reply(self, call_id: int, rank: int, value: Any) -> None:
        p = self.pending.get(call_id)
        if p is None:
            return
        fut, finish, ranks, values = p
        values.append((ranks.index(rank), value))
        if len(values) == len(ranks):
            del self.pending[call_id]
            ordered = [v for _, v in sorted(values, key=lambda iv: iv[0])]
            fut.set_result(finish(ordered) if finish else None)

    def _reply_failure(self, call_id: int, rank: int, failure: tuple) -> None:
        p = self.pending.pop(call_id, None)
        if p is not None:
            p[0].set_exception(self.remote_error(failure, observed=True))

    def _break(self, e: BaseException) -> None:
        self.broken = (
            f"the simulator failed and this simulated mesh is stopped: {type(e).__name__}: {e} "
            "(a bug of md.Simulator: please report it with the program)"
        )
        self.stop()  # (what the engine sends from now on is dropped; waiting calls fail)

    def stop(self, timeout: float = 0.0) -> None:
        self.stopped = True
        for call_id, p in list(self.pending.items()):
            del self.pending[call_id]
            p[0].set_exception(SupervisionError(self.broken or "the simulated mesh was stopped"))


class _Issuing(threading.local):
    """A simulated engine's state per issuing thread (its own: a new thread that gets a dead
    one's id starts afresh): its CPU time and own work (``_OWN``) at its last append's end;
    what was measured before free instructions (for the next costed one); the backward node
    of its last costed instruction, as (graph task, sequence number, name) -- not the node
    itself, whose saved tensors it would keep alive (and the simulated memory with them)."""

    last: tuple[float, float] | None = None
    carried = 0.0
    last_node: tuple[int, int, str] | None = None


class _SimEngine(Engine):
    """The tensor engine of a simulated mesh: records how each instruction was issued (its
    thread; in autograd's backward pass or not, and the first of its backward node or not;
    the thread's CPU seconds since its previous instruction, the simulator's own work left
    out) for the controller's costs (``compiler/simulate_eager.py``).

    Its batches are simulated on the thread that issues them, not on the flusher's: the
    simulator's work beside the program (on another thread, taking the GIL back and forth)
    made the program's own Python measure 2-3x what it takes on a real controller. A batch
    is sent as a real one is, its deadline read off the measured Python instead of the wall
    clock (the simulation of earlier batches, a garbage collection of the simulator's heap,
    make the wall clock meaningless here): once the issuing threads have run ``FLUSH_DELAY``
    of it since its first instruction (a replayed step's, held lazily: ``LAZY_DELAY``), at a
    cut, or when a caller is about to wait (``future.before_block``). The flusher's thread
    never sends one (its wall-clock backstop split replayed steps)."""

    job: SimJob

    def __init__(self, job: SimJob) -> None:
        super().__init__(job)  # type: ignore[arg-type]  # (a Job in all the engine uses)
        self._threads = _Issuing()  # per issuing thread (see _Issuing)
        self._python = 0.0  # measured seconds of all threads: the batches' clock
        self._held_at = 0.0  # the clock at the held batch's first instruction
        self._deadline = controller.FLUSH_DELAY

    def _hold(self, lazy: bool) -> None:
        self._held_at = self._python
        self._deadline = controller.LAZY_DELAY if lazy else controller.FLUSH_DELAY
        _HELD.add(self)  # (sent before a caller waits: _flush_held; not the flusher's)

    def flush(self) -> None:
        with own_work():
            super().flush()

    def start_replay(self) -> Replay:
        """Replay as on workers (``tensor/replay.py``); each run made is told to the job with
        the instructions it stands for, which the controller issued all the same (their
        costs: ``compiler/simulate_eager.py``)."""
        replay = super().start_replay()
        replay.on_run = self.job.replayed
        return replay

    def append(self, mesh: int, ins: Any) -> None:
        now = time.thread_time()
        mine = self._threads
        python = 0.0
        if mine.last is not None:  # (the thread's first instruction: nothing measured before)
            python = max(0.0, now - mine.last[0] - (_OWN.seconds - mine.last[1]))
        self._python += python
        python += mine.carried
        mine.carried = 0.0
        try:
            with own_work():
                if self.held and self._python - self._held_at >= self._deadline:
                    self.flush()  # (its deadline passed while the program ran: sent before)
                self._append(mine, mesh, ins, python)
        finally:
            mine.last = (time.thread_time(), _OWN.seconds)

    def _append(self, mine: _Issuing, mesh: int, ins: Any, python: float) -> None:
        task = torch._C._current_graph_task_id()
        first = False
        if task == -1:
            mine.last_node = None
        else:
            node = torch._C._current_autograd_node()
            key = None if node is None else (task, node._sequence_nr(), node.name())
            if not isinstance(ins, FREE):  # (the node's first costed one is charged)
                first = key is not None and key != mine.last_node
                mine.last_node = key
        if not isinstance(ins, FREE):  # (free ones cost nothing: no entry to leave behind)
            thread = threading.get_ident()
            self.job.issued[id(ins)] = Issued(thread, task != -1, first, python)
        else:
            mine.carried = python
        super().append(mesh, ins)


class Simulator:
    """``md.Simulator(hosts=1, gpus=4, trace_mode="stream_only", profile=None)``: ``sim.mesh``
    (dims ``("host", "gpu")``) takes any eager program and runs none of it; ``sim.events``,
    ``sim.summary()`` say what it would cost with ``profile`` (a built-in name, a path, a
    ``DeviceProfile``; None: ``"cpu-local"``). ``trace_mode="everything"`` adds the
    controller's issuing of each instruction (rank -1, stream ``controller``)."""

    def __init__(
        self,
        hosts: int = 1,
        gpus: int = 4,
        trace_mode: str = "stream_only",
        profile: ProfileLike = None,
    ):
        for name, value in (("hosts", hosts), ("gpus", gpus)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if trace_mode not in TRACE_MODES:
            raise ValueError(f"trace_mode must be one of {TRACE_MODES}, got {trace_mode!r}")
        if profile is not None and not isinstance(profile, (str, os.PathLike, DeviceProfile)):
            raise ValueError(
                f"profile must be a built-in name, a path or an md.DeviceProfile, got {profile!r}"
            )
        self.profile = DeviceProfile.get(profile)
        if _collecting not in gc.callbacks:  # (from the first simulator on)
            gc.callbacks.append(_collecting)
            before_block.append(_flush_held)
        self.trace_mode = trace_mode
        self.job = SimJob(("host", "gpu"), (hosts, gpus), self.profile, trace_mode)
        engine = _SimEngine(self.job)
        engine.store = "simulated"  # collectives need no store: there are no process groups
        self.job.extensions[EXTENSION] = engine
        self.job.before_stop.append(engine.sync)
        self._engine = engine
        self.mesh: ProcMesh = _root(self.job)  # type: ignore[arg-type]

    def _flush(self) -> None:
        self._engine.flush()
        self.job.drain()

    @property
    def events(self) -> list[SimEvent]:
        """The timeline so far (``md.SimEvent``s, seconds)."""
        with own_work():
            self._flush()
            with self.job.lock:
                return list(self.job.sim.events)

    def summary(self) -> SimReport:
        """The ``md.SimReport`` of everything issued so far."""
        with own_work():
            self._flush()
            with self.job.lock:
                return self.job.sim.report()

    def display(self, **kwargs: Any) -> dict[str, str]:
        """``sim.summary().display(**kwargs)``: the timeline in the terminal, a trace JSON and
        a PNG (``path=`` their prefix, default ``md-sim``; ``path=None``: none)."""
        with own_work():
            return self.summary().display(**kwargs)

    def __repr__(self) -> str:
        sizes = dict(zip(self.job.dims, self.job.sizes))
        return f"md.Simulator({sizes}, profile={self.profile.name!r})"


__all__ = ["Simulator", "SimJob", "TRACE_MODES"]
