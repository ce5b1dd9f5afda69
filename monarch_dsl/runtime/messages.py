"""Every message of the control plane, in one place.

Messages are ``typing.NamedTuple`` classes: immutable, typed, and the cheapest thing to pickle
(a tuple plus a class reference), which matters on the per-call hot path. Three channels:

- controller <-> worker: the framed, authenticated connection of ``transport.py``;
- controller <-> fork server: a private ``socketpair`` (SOCK_SEQPACKET) that can carry file
  descriptors (the workers' stdout/stderr pipes);
- worker -> controller replies.
"""

from __future__ import annotations

from typing import Any, NamedTuple

# --------------------------------------------------------------------------- worker -> controller


class Hello(NamedTuple):
    """First message of a worker after the handshake: who it is."""

    rank: int  # rank in its allocation (the root mesh of the ProcMesh)
    pid: int
    hostname: str
    device: str = "cpu"  # the type of the device its tensors live on: "cpu" or "cuda"


class Reply(NamedTuple):
    """The value returned by an endpoint (or None for a spawn acknowledgement)."""

    call_id: int
    rank: int
    value: Any


class ErrorReply(NamedTuple):
    """An endpoint (or actor constructor) raised: the traceback as text, the exception if it
    could be pickled."""

    call_id: int
    rank: int
    traceback: str
    exception: bytes | None


# --------------------------------------------------------------------------- controller -> worker


class SpawnActor(NamedTuple):
    """Create one actor on every worker in ``ranks``; each finds its own point in the mesh."""

    call_id: int
    actor_id: int
    name: str
    cls: Any  # the Actor subclass (cloudpickled by value when defined in __main__)
    args: tuple
    kwargs: dict
    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]  # allocation ranks of the actor mesh, row-major


class CallEndpoint(NamedTuple):
    """Call ``method`` on actor ``actor_id``; ``call_id`` < 0 means no reply is wanted."""

    call_id: int
    actor_id: int
    method: str
    args: tuple
    kwargs: dict


class Configure(NamedTuple):
    """Sent once every worker has joined: the shape of the process mesh (for current_rank),
    and the memory budget of a CPU worker in bytes (0: none; None: keep the one it started
    with, runtime/memory.py)."""

    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    memory_limit: int | None = None


class SetupCollectives(NamedTuple):
    """Where the job's rendezvous store (a torch TCPStore) listens."""

    host: str
    port: int


class RunBatch(NamedTuple):
    """Instructions (``monarch_dsl/isa``) for the tensor engine, as (mesh id, instruction)
    pairs; a worker runs those of the meshes it belongs to (mesh id -1: every worker).
    ``default_dtype``: the controller's torch default dtype they were issued under (a name,
    ``"float32"``; ``""``: the worker's stays), which factories and type promotion use."""

    items: tuple
    default_dtype: str = ""


class FetchFailed(NamedTuple):
    """The reply to a fetch of a failed value: its root failure (see executor.Failure)."""

    call_id: int
    rank: int
    failure: tuple


class FailureReport(NamedTuple):
    """A worker's instruction failed (a root cause, not a failure inherited from inputs)."""

    rank: int
    failure: tuple


class StopWorker(NamedTuple):
    """Finish and exit."""


class SyncedModule(NamedTuple):
    """One module's source, as code sync sends it (``runtime/codesync.py``)."""

    name: str  # e.g. "pkg.model"
    path: str  # the controller's file: the module's __file__ on the worker, for tracebacks
    source: bytes
    digest: str  # sha256 of ``source``, hex
    package: bool  # an ``__init__.py``


class SyncCode(NamedTuple):
    """Serve these modules' sources to imports from now on and reload the ones this worker
    has imported; answered with a ``CodeSyncOutcome``."""

    call_id: int
    modules: tuple[SyncedModule, ...]


class CodeSyncOutcome(NamedTuple):
    """A worker's answer to ``SyncCode``: the modules it reloaded, or the one whose reload
    raised (``failed``, with the traceback) -- then it rolled every module back."""

    reloaded: tuple[str, ...]
    failed: str = ""
    traceback: str = ""


class ListStaleFiles(NamedTuple):
    """Which of ``entries`` ((path relative to ``root``, sha256 hex) pairs) are missing or
    differ under ``root`` (relative: to the worker's cwd)? Answered with a tuple of paths."""

    call_id: int
    root: str
    entries: tuple[tuple[str, str], ...]


class WriteFiles(NamedTuple):
    """Write ``files`` ((relative path, bytes, mode) triples) under ``root``, each atomically;
    answered with the number of bytes written."""

    call_id: int
    root: str
    files: tuple[tuple[str, bytes, int], ...]


class Inventory(NamedTuple):
    """Controller -> worker: what lives here beyond a controller -- its actors and pinned
    tensors. Answered with a ``Reply`` of ``{"actors": [(actor_id, name, (class module,
    class qualname, the class pickled), dims, sizes, ranks)], "pinned": {name: (shape, dtype,
    dims, sizes, ranks)}}``."""

    call_id: int


# --------------------------------------------------------------------------- debugger sessions
# A worker's ``breakpoint()`` dials the controller's listener on a connection of its own (so the
# paused thread's pdb never shares the worker's main connection); see runtime/debugger.py.


class DebugHello(NamedTuple):
    """First message of a debugger connection (instead of ``Hello``): who stopped, and where."""

    rank: int  # in the actor mesh (or the remote function's mesh)
    coords: tuple[tuple[str, int], ...]
    worker_rank: int  # in the process mesh
    pid: int
    hostname: str
    actor: str  # the actor's class, "@remote" for a remote function, "-" outside both
    function: str
    filename: str
    lineno: int


class DebugOutput(NamedTuple):
    """Text pdb wrote; ``waiting``: pdb is at its prompt, reading the next command."""

    text: str
    waiting: bool


class DebugWhere(NamedTuple):
    """The paused thread stopped again, somewhere else (after ``next``, ``step``, ...)."""

    function: str
    filename: str
    lineno: int


class DebugInput(NamedTuple):
    """One command line for the paused rank's pdb (controller -> worker)."""

    line: str


# The messages of worker connections, in wire order: a frame carries ``(index, *fields)``, a
# plain tuple, which pickles ~4x faster than the NamedTuple itself (no class lookup, no
# __reduce_ex__ call). Append new types at the end.
WIRE_TYPES: tuple[type, ...] = (
    Hello,
    Reply,
    ErrorReply,
    SpawnActor,
    CallEndpoint,
    Configure,
    StopWorker,
    SetupCollectives,
    RunBatch,
    FetchFailed,
    FailureReport,
    SyncCode,
    ListStaleFiles,
    WriteFiles,
    Inventory,
    DebugHello,
    DebugOutput,
    DebugWhere,
    DebugInput,
)
WIRE_INDEX: dict[type, int] = {cls: i for i, cls in enumerate(WIRE_TYPES)}


# --------------------------------------------------------------------------- fork server


class ForkWorkers(NamedTuple):
    """Ask the fork server for one worker per entry of ``ranks``. Sent with 2 file descriptors
    per worker (stdout and stderr write ends, in order)."""

    request_id: int
    address: str
    token: bytes
    ranks: tuple[int, ...]
    world_size: int
    local_world_size: int
    env: dict[str, str]
    sys_path: tuple[str, ...]
    cwd: str
    setup: bytes | None  # cloudpickled callable run in each worker before it connects


class ForkScripts(NamedTuple):
    """Ask the fork server for one process per entry of ``envs`` that runs ``script`` as
    ``__main__`` (``pm.run_spmd``; see forkserver.run_script). Sent with 2 file descriptors per
    process (stdout and stderr write ends, in order); answered with ``Forked``, and each
    process's exit with ``ChildExited``. Each process leads its own process group, so the
    controller stops a rank and whatever it started with one ``killpg``."""

    request_id: int
    script: str  # an absolute path, or a module's name (``module``)
    args: tuple[str, ...]
    envs: tuple[dict[str, str], ...]  # the whole environment of each process, in rank order
    sys_path: tuple[str, ...]  # sys.path after the script's directory (the cwd for a module)
    cwd: str
    module: bool = False  # ``script`` is a module, run as ``python -m script`` runs it


class Forked(NamedTuple):
    request_id: int
    pids: tuple[int, ...]


class ForkServerReady(NamedTuple):
    pid: int
    forked_from_controller: bool


class ForkServerUnsafe(NamedTuple):
    """The fork server found it cannot fork safely (see forkserver.py) and is exiting."""

    reason: str


class ChildExited(NamedTuple):
    pid: int
    status: int  # as from os.waitpid


# --------------------------------------------------------------------------- persistent meshes
# A persistent mesh's fork server is its keeper (forkserver.py): a fresh interpreter in its own
# session that outlives controllers. Its channel to the controller that started it is the usual
# socketpair; a later controller reaches it on its Unix socket (registry.py) with ``Attach``.


class KeeperConfig(NamedTuple):
    """Controller -> keeper, the first message: become the keeper of mesh ``name``."""

    name: str
    secret: bytes
    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    idle_timeout: float


class Attach(NamedTuple):
    """A controller -> the keeper's socket, after the mesh's secret (raw bytes, the first
    packet): let me drive the mesh; the workers are to connect to ``address``."""

    address: str
    pid: int


class Attached(NamedTuple):
    """Keeper -> controller: the workers' pids by rank (their stdout and stderr pipes' read
    ends come with it, 2 per rank in rank order). Each worker is told to connect to the
    controller's ``address``. Also the answer to ``ForkWorkers`` in keeper mode."""

    request_id: int
    pids: tuple[int, ...]
    exited: dict[int, int] = {}  # rank -> exit status (os.waitpid's), of those already gone


class AttachRefused(NamedTuple):
    reason: str


class Reconnect(NamedTuple):
    """Keeper -> a detached worker: connect to the controller at ``address``."""

    address: str


class Shutdown(NamedTuple):
    """Controller -> keeper: the mesh is stopped (``pm.stop()``): end the workers, remove the
    record, exit."""
