"""The C++ runtime (cpp/). Only simple values cross this boundary: tensors, numbers, lists."""

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

# The loader (_core.py): the module whose classes follow.
def native() -> ModuleType | None:
    """The C++ runtime's module, loaded once (never built here), or None: not built or failed
    to load (``unavailable_reason()`` says why)."""

def unavailable_reason() -> str | None: ...
def require() -> ModuleType:
    """``native()``, or the exception that stopped it (BuildError: not built)."""

def worker_native() -> ModuleType | None:
    """``native()`` for a worker, or None: ``MD_EXECUTOR=python``, or not built (said once)."""

class Env:
    """A rank's value slots for one run of a plan (``isa.Program.n_slots`` of them)."""

    def __init__(self, n: int) -> None: ...
    def set(self, slot: int, value: Any) -> None:
        """Put a tensor, a Python number, or None in ``slot``."""
    def __setitem__(self, slot: int, value: Any) -> None: ...
    def __getitem__(self, slot: int) -> Any:
        """The tensor / number in ``slot`` (None if empty)."""
    def get(self, slot: int) -> Any: ...
    def set_none(self, slot: int) -> None: ...
    def set_many(self, slots: Sequence[int], values: Sequence[Any]) -> None:
        """``set(slots[k], values[k])`` for every ``k``."""
    def set_part(self, slot: int, whole: Any, cuts: Sequence[tuple[int, int, int]]) -> None:
        """``slot`` = a contiguous copy of this rank's part of tensor ``whole``: each cut
        ``(dim, index, n)`` in turn takes part ``index`` of ``n`` along ``dim`` (``chunk``'s)."""
    def has(self, slot: int) -> bool: ...
    def __len__(self) -> int: ...

class CompiledPlan:
    """The compute steps of a lowered plan, resolved once to dispatcher operators.

    ``steps``: per step, None (run by the caller: communication, or another rank's step) or
    an ``isa.Compute``, read by field name (``name`` "aten.mm.default", ``args``, ``kwargs``,
    ``outs``, ``frees``), whose args may hold ``slot_type`` instances (``isa.Slot``) standing
    for slot values, alone or in a list (a Tensor[] argument). Constants are converted by the
    op's schema here, once.
    """

    def __init__(self, steps: Sequence[Any], slot_type: type) -> None: ...
    def run(self, env: Env, begin: int, end: int) -> int:
        """Run the compute steps in [begin, end) on ``env``, without the GIL: each step's
        results go to its out slots, and its last uses are freed. Returns -1, or the index of
        the step that raised (then ``last_error()`` says why)."""
    def last_error(self) -> str: ...
    def reused(self) -> int:
        """How many steps of the last run wrote their result into the previous run's (memory
        planning: a step with an out= overload and a result of at most 64 KiB reuses it when
        neither that tensor nor its storage is held any more, e.g. by Python), or wrote their
        argument in place (counted by ``in_place()`` too)."""
    def in_place(self) -> int:
        """How many steps of the last run ran in place on their argument: an op whose out=
        overload is not a device kernel (relu) runs as its in-place twin (relu_) where the
        argument dies at that step, nothing else holds it (but the buffer of the step that
        made it), and an earlier run gave a result of its dtype and sizes."""
    def reduced_in_place(self) -> int:
        """How many all-reduces of the last ``run_plan`` left their result in their own
        tensors (no result buffer): each dies at the step, is used once, is the only tensor
        on its storage (but the buffer of the step that made it) and covers it exactly."""
    def reduced_shared(self) -> int:
        """Of those, how many reduced a block of shared memory every rank maps, which the
        steps making the gradients wrote them into (no copies in or out)."""
    def set_comm(
        self,
        k: int,
        step: Any,
        *,
        group: Any,
        index: int,
        size: int,
        peer: int,
        async_: bool,
        slot_type: type,
    ) -> None:
        """Communication step ``k`` of this rank (``runtime/plan_runner.py``): ``step`` is an
        ``isa.Comm`` -- AllReduce (a bucket: several args), AllGather, ReduceScatter,
        AllToAll over ``group`` (a c10d backend or a ShmProcessGroup), Send / Recv with
        ``peer``, ShardLocal / PartialLocal (``index`` of ``size`` along a mesh dim) -- read by
        field name (``kind``, ``args``, ``outs``, ``frees``, ``shapes``, ``dtype``, and
        ``reduce`` / ``dim`` / ``split_dim`` / ``cat_dim`` where the kind has them).
        ``shapes`` / ``dtype``: the zeros sent after a failure; ``async_``: started, and
        waited for at a result's first use."""
    def set_uses(self, uses: Sequence[Sequence[int]]) -> None:
        """Per step, the slots it reads (where a collective in flight is waited for)."""
    def set_agree(self, group: Any) -> None:
        """The group over the whole mesh whose members agree at the end of every
        ``run_plan`` whether any failed (a one-int MAX all-reduce: the failure flag)."""
    def last_agree_cpu(self) -> float:
        """The CPU seconds of the last ``run_plan``'s failure flag (``set_agree``)."""
    def set_trace(self, on: bool) -> None:
        """Record the next ``run_plan``s' steps (``last_trace``); ``False``: stop."""
    def last_trace(self) -> list[tuple[int, int, float, float]]:
        """The last ``run_plan``'s record while tracing: (step, kind, start, end), seconds of
        CLOCK_MONOTONIC; kind 0 compute, 1 communication (a collective on main, or the start
        of one on another stream), 2 waiting for started collectives, 3 the failure flag
        (step: the number of steps)."""
    def has_comms(self) -> bool: ...
    OTHER_FAILED: int
    def run_plan(self, env: Env, device: Any, inputs_failed: bool = False) -> int:
        """The whole plan for this rank without the GIL, compute and communication in order;
        after a failure (from the start with ``inputs_failed``) only communication goes on
        (with zeros). Returns -1, or the index of the step that failed (``last_error()`` says
        why; the number of steps: after them, or the inputs); with ``set_agree``,
        ``OTHER_FAILED`` where this rank ran fine and another failed (raises where the flag's
        all-reduce fails)."""
    def __len__(self) -> int: ...

class Executor:
    """A worker's executor of eager instructions: the ref table (ref -> tensor, number or
    ``failure_type`` instance), one thread per stream, events for borrows, and aten ops called
    through the dispatcher without the GIL, collectives through the groups' C++ backends. An op
    with a failed input is skipped and its outputs take that failure; an op that raises gets a
    new root failure, passed to ``report`` (under the GIL). Every other instruction is a Python
    callable run under the GIL on its stream's thread, in order (``runtime/core_executor.py``).

    ``ref_type``: the named tuple standing for a ref in arguments (``isa.Ref``);
    ``device_sentinel``: the object standing for ``device`` (``isa.WORKER_DEVICE``)."""

    def __init__(
        self,
        rank: int,
        ref_type: type,
        device_sentinel: object,
        device: Any,
        failure_type: type,
        report: Callable[[Any], None],
    ) -> None: ...
    # The ref table, as a mapping.
    def get(self, ref: int, default: Any = None) -> Any: ...
    def get_many(self, refs: Sequence[int]) -> list[Any]:
        """``[get(r) for r in refs]``, read at one point in time."""
    def __getitem__(self, ref: int) -> Any: ...
    def __setitem__(self, ref: int, value: Any) -> None:
        """A tensor, a Python number, None, or a ``failure_type`` instance."""
    def pop(self, ref: int, default: Any = None) -> Any: ...
    def __contains__(self, ref: int) -> bool: ...
    def __len__(self) -> int: ...
    def keys(self) -> list[int]: ...
    # Instructions, queued on a stream (a thread per stream, started on first use).
    def call_op(
        self,
        stream: str,
        op: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outs: Sequence[int],
        line: str,
    ) -> None:
        """``outs = op(*args, **kwargs)``, ``op`` as ``"aten::add.Tensor"``; ``outs`` receive the
        tensor results in order (-1: not kept). Raises here, before queueing, for what the
        dispatcher cannot take (unknown op, arguments its schema rejects)."""
    def run_batch(
        self,
        items: tuple[Any, ...],
        member: dict[int, bool],
        callop_type: type,
        other: Callable[[int, Any], None],
    ) -> None:
        """A message's ``(mesh, instruction)`` pairs in order, skipping meshes this rank is
        not in (``member[mesh]`` false or missing; mesh < 0 is every rank). Eager ops
        (``callop_type`` tuples: op, args, kwargs, outs, stream, line) are prepared as by
        ``call_op`` and queued with one lock and one wake-up per stream for each run of up to 64
        of them; every other instruction, and an op ``call_op`` would refuse, is passed to
        ``other(mesh, instruction)`` in its place, after the ops before it are queued."""
    def set_group(self, key: str, get: Callable[[], tuple[Any, int, int]]) -> None:
        """Name a process group: ``get()`` returns (group, this rank's index, size), a c10d
        backend (gloo, NCCL) or a ``runtime/shm.py`` ShmProcessGroup; called under the GIL on
        the stream thread of the first collective that uses it."""
    def reduce(self, ins: Any, group: str, what: str, what_error: str) -> None:
        """``isa.Reduce`` ``ins`` (read by field name) over the group named ``group``, without
        Python: a flag all-reduce first (did any rank's input fail?), zeros in place of a
        failed input, then the collective (sum avg min max prod; stack = all-gather;
        ``scatter``: reduce-scatter, or all-to-all with stack). ``out == src``: in place.
        ``what`` / ``what_error``: its name in a failure's op and in a peer's error."""
    def transfer(self, ins: Any, groups: Sequence[str]) -> None:
        """``isa.Transfer`` ``ins`` (read by field name): per pair, the group named
        ``groups[i]`` ("" where this rank is not in the pair); a failed source sends a flag
        and zeros, so the receiver fails with the sender's root cause."""
    def delete(self, stream: str, refs: Sequence[int]) -> None: ...
    def signal(self, stream: str, event: int) -> None: ...
    def wait(self, stream: str, event: int) -> None: ...
    def borrow_begin(self, stream: str, event: int, src: int, dst: int) -> None:
        """Wait for ``event``, then ``dst`` holds the value of ``src``."""
    def borrow_end(self, stream: str, event: int, dst: int) -> None:
        """Forget ``dst``, then signal ``event``."""
    def python(self, stream: str, fn: Callable[[], None]) -> None: ...
    def barrier(self, done: Callable[[], None]) -> None:
        """``done()`` once every stream has run what it was given before."""
    def streams(self) -> list[str]: ...
    def close(self) -> None:
        """Stop the stream threads after what they were given; free every ref."""

class ShmGroup:
    """Collectives through one POSIX shared-memory segment among ``size`` processes of one
    host (``runtime/shm.py`` wraps it as a process group). Rank 0 creates the segment and
    unlinks its name once every member has attached, so nothing outlives the processes. Every
    wait gives up after ``timeout`` seconds, or sooner when a member has died, with an error
    naming the group, the operation and the ranks waited for. The GIL is released while
    waiting and copying."""

    def __init__(
        self,
        name: str,
        rank: int,
        size: int,
        capacity_bytes: int = ...,
        timeout: float = 300.0,
        ring_bytes: int = ...,
    ) -> None: ...
    def all_reduce(self, tensor: Any, op: str = "sum") -> None:
        """In place: sum / avg / max / min / prod; each rank reduces its slice of each chunk,
        so every rank gets bit-identical results."""
    def all_reduce_into(self, output: Any, inputs: Sequence[Any], op: str = "sum") -> None:
        """``output`` = the all-reduce of the concatenation of ``inputs`` (contiguous, the
        output's dtype and, in all, its number of elements), read where they are: a gradient
        bucket without a flat copy first. The same results as ``all_reduce`` of that copy."""
    def all_reduce_pieces(self, tensors: Sequence[Any], op: str = "sum") -> None:
        """The all-reduce of the concatenation of ``tensors`` (contiguous, one dtype, none
        overlapping another), left in them: a gradient bucket that takes its own result. The
        same results as ``all_reduce`` of their flat copy."""
    def all_gather(self, tensor: Any) -> Any:
        """The members' tensors stacked along a new dim 0, in rank order."""
    def all_gather_into(self, outputs: Sequence[Any], input: Any) -> None: ...
    def reduce_scatter(self, output: Any, inputs: Sequence[Any], op: str = "sum") -> None: ...
    def broadcast(self, tensor: Any, root: int) -> None: ...
    def barrier(self) -> None: ...
    def send(self, tensor: Any, dst: int, tag: int = 0) -> None:
        """Through a ring buffer per direction; blocks while the ring is full."""
    def try_send(self, tensor: Any, dst: int, tag: int = 0) -> bool: ...
    def recv(self, tensor: Any, src: int, tag: int = 0) -> None:
        """Into ``tensor``; a size or tag that differs from the send's is an error."""
    def close(self) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    timeout: float
