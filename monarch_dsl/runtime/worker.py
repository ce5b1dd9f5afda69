"""The worker process: receives messages from the controller and runs them.

A blocking loop on the controller connection runs each message in order. Sync endpoints run
inline on that thread; async endpoints run on an asyncio loop in a second thread and reply when
they finish. The worker exits when the controller says so, or as soon as the connection drops
(so a dead controller leaves no orphans).
"""

from __future__ import annotations

import asyncio
import faulthandler
import inspect
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from monarch_dsl.runtime import codesync, context, memory, remote_pdb, serialize, transport
from monarch_dsl.runtime.messages import (
    CallEndpoint,
    Configure,
    ErrorReply,
    FailureReport,
    FetchFailed,
    Hello,
    Inventory,
    Reconnect,
    Reply,
    RunBatch,
    SetupCollectives,
    SpawnActor,
    StopWorker,
)

current: Worker | None = None  # this process's worker (for introspection from endpoints)
# Tensors kept by name (``md.pin``): on a persistent mesh they outlive the controller that made
# them (the executor's refs do not: a detached worker drops them). name -> (tensor, dims,
# sizes, ranks of the mesh it was pinned on).
pinned: dict[str, tuple[Any, tuple[str, ...], tuple[int, ...], tuple[int, ...]]] = {}
FLUSH_AFTER = 0.0005  # seconds a finished reply may wait for the ones after it
DETACH_CLOSE_TIMEOUT = 5.0  # a detached worker waits this long for its streams to finish


class Worker:
    def __init__(
        self,
        conn: transport.Connection,
        rank: int,
        device: Any,
        keeper: socket.socket | None = None,
        token: bytes = b"",
    ):
        self.conn = conn
        self.rank = rank
        self.device = device  # worker_device(), told to the controller in Hello
        # A persistent mesh's worker: its channel to the keeper, and the mesh's token.
        self.keeper = keeper
        self.token = token
        self.actors: dict[int, tuple[Any, context.Point]] = {}
        self.actor_info: dict[int, tuple[str, tuple, tuple, tuple]] = {}  # name, dims, sizes, ranks
        self._loop: asyncio.AbstractEventLoop | None = None
        self._methods: dict[tuple[type, str], tuple[Callable, bool]] = {}
        # Replies made while more requests are already queued go out together (one syscall,
        # one wake-up of the controller) -- but never held longer than FLUSH_AFTER seconds.
        self._outbox: list = []
        self._outbox_since = 0.0
        self._io_thread = threading.get_ident()
        self._executor = None
        self._default_dtype = ""  # the torch default dtype the last batch set ("": none yet)
        global current
        current = self
        self.handlers = {
            SpawnActor: self.spawn_actor,
            CallEndpoint: self.call_endpoint,
            Configure: self.configure,
            StopWorker: self.stop,
            RunBatch: self.run_batch,
            SetupCollectives: self.setup_collectives,
            Inventory: self.inventory,
        }
        self.handlers.update(codesync.worker_handlers(self))  # pm.sync_code, pm.sync_files

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        while True:
            try:
                msg = self.conn.recv(self.flush)
            except (EOFError, OSError):
                if self.keeper is None:
                    _exit(0)  # the controller is gone: so are we
                self.conn = self.detached()  # a persistent mesh: wait for the next one
                continue
            except (transport.ProtocolError, MemoryError) as e:
                if isinstance(e, MemoryError):  # a message bigger than what its budget has left
                    memory.annotate(e)
                why = "; ".join((repr(e), *getattr(e, "__notes__", ())))
                print(f"monarch_dsl worker {self.rank}: {why}; closing", file=sys.stderr)
                _exit(1)
            handler = self.handlers.get(type(msg))
            if type(msg) is transport.UndecodableMessage and msg.call_id is not None:
                # e.g. an actor whose class's module cannot be imported here: say so to the
                # caller (it would wait forever for an answer that never comes)
                self.error(
                    msg.call_id,
                    RuntimeError(
                        f"worker {self.rank} could not read the {msg.kind} message sent to it: "
                        f"{msg.reason}"
                    ),
                )
                continue
            if handler is None:
                print(
                    f"monarch_dsl worker {self.rank}: dropped a message it cannot run: {msg!r}",
                    file=sys.stderr,
                )
                continue
            handler(msg)

    def flush(self) -> None:
        if self._outbox:
            parts, self._outbox = self._outbox, []
            try:
                self.conn.send_encoded(parts)
            except OSError:
                self.lost()

    def lost(self) -> None:
        """Sending to the controller failed: it is gone. A persistent mesh's worker notices
        in its loop (and waits for the next controller); any other exits."""
        if self.keeper is None:
            _exit(0)

    def detached(self) -> transport.Connection:
        """The controller of this persistent mesh's worker is gone: drop its tensor state
        (its refs, streams and process groups; pinned tensors and actors stay), then wait for
        the keeper to say where the next controller is, and join it. Exits when the keeper
        says stop or is gone."""
        self.conn.close()
        self._outbox = []
        if self._executor is not None:
            try:  # (a stream still stuck after this, in a dead peer's collective, is left)
                self._executor.close(DETACH_CLOSE_TIMEOUT)
            except Exception:  # noqa: BLE001 - a broken executor must not keep the worker
                traceback.print_exc()
            self._executor = None
        assert self.keeper is not None
        while True:
            try:
                data = self.keeper.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                _exit(0)
            msg = pickle.loads(data)
            if isinstance(msg, StopWorker):
                _exit(0)
            if isinstance(msg, Reconnect):
                try:
                    return _join(msg.address, self.token, self.rank, self.device)
                except (OSError, transport.ProtocolError) as e:
                    print(
                        f"monarch_dsl worker {self.rank}: could not join the controller at "
                        f"{msg.address}: {e}",
                        file=sys.stderr,
                        flush=True,
                    )

    def reply(self, msg: Any) -> None:
        memory.or_in_grace(lambda: self._reply(msg))  # sent even with no room left to send it

    def reply_made(self, make: Callable[[], Any]) -> None:
        """``reply(make())``, with the message made in the grace room where the budget has no
        room left for it: a failure's report (its text, ``memory.explain``) must not be lost
        to a MemoryError -- the controller waits for it (a fetch of a value whose allocation
        failed at the budget's last pages hung)."""
        self.reply(memory.or_in_grace(make))

    def _reply(self, msg: Any) -> None:
        try:
            parts = transport.encode(msg)
            if threading.get_ident() != self._io_thread:
                self.conn.send_encoded(parts)
                return
            if not self._outbox:
                self._outbox_since = time.perf_counter()
            self._outbox += parts
            if (
                not self.conn.has_buffered()
                or time.perf_counter() - self._outbox_since > FLUSH_AFTER
            ):
                self.flush()
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            # The endpoint returned something that cannot be pickled: say so instead.
            self.conn.send(
                ErrorReply(
                    msg.call_id,
                    self.rank,
                    f"the endpoint's return value cannot be sent to the controller: "
                    f"{type(e).__name__}: {e}",
                    None,
                )
            )
        except OSError:
            self.lost()

    def error(self, call_id: int, exc: BaseException) -> None:
        memory.annotate(exc)  # an allocation over this worker's budget says so
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if call_id < 0:  # nobody waits for this one: at least the user sees it
            print(tb, file=sys.stderr, flush=True)
            return
        try:
            exc_bytes = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text only
            exc_bytes = None
        self.reply(ErrorReply(call_id, self.rank, tb, exc_bytes))

    # ------------------------------------------------------------------ handlers
    def spawn_actor(self, msg: SpawnActor) -> None:
        index = msg.ranks.index(self.rank)
        point = context.Point.of_index(index, msg.dims, msg.sizes)
        token = context.set_current_point(point)
        try:
            instance = msg.cls(*msg.args, **msg.kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            self.error(msg.call_id, e)
            return
        finally:
            context.reset_current_point(token)
        self.actors[msg.actor_id] = (instance, point)
        self.actor_info[msg.actor_id] = (msg.name, msg.dims, msg.sizes, msg.ranks)
        self.reply(Reply(msg.call_id, self.rank, None))

    def inventory(self, msg: Inventory) -> None:
        actors = []
        for actor_id, (name, dims, sizes, ranks) in self.actor_info.items():
            cls = type(self.actors[actor_id][0])
            # The class travels as bytes, unpickled only by pm.actors: a controller that
            # cannot import its module still gets the rest (and a clear error there).
            payload, _ = serialize.dumps(cls)
            where = (cls.__module__, cls.__qualname__, payload)
            actors.append((actor_id, name, where, dims, sizes, ranks))
        kept = {
            name: (tuple(t.shape), t.dtype, dims, sizes, ranks)
            for name, (t, dims, sizes, ranks) in pinned.items()
        }
        self.reply(Reply(msg.call_id, self.rank, {"actors": actors, "pinned": kept}))

    def endpoint(self, cls: type, name: str) -> tuple[Callable, bool]:
        """The endpoint function ``name`` of ``cls``, and whether it is async."""
        key = (cls, name)
        found = self._methods.get(key)
        if found is None:
            fn = getattr(cls, name, None)
            if not getattr(fn, "__md_endpoint__", False):
                raise AttributeError(f"{cls.__name__}.{name} is not an endpoint")
            found = self._methods[key] = (fn, inspect.iscoroutinefunction(fn))
        return found

    def call_endpoint(self, msg: CallEndpoint) -> None:
        try:
            instance, point = self.actors[msg.actor_id]
            fn, is_async = self.endpoint(type(instance), msg.method)
        except BaseException as e:  # noqa: BLE001
            self.error(msg.call_id, e)
            return
        if is_async:
            asyncio.run_coroutine_threadsafe(self._run_async(msg, fn, instance, point), self.loop())
            return
        token = context.set_current_point(point)
        try:
            value = fn(instance, *msg.args, **msg.kwargs)
        except BaseException as e:  # noqa: BLE001
            self.error(msg.call_id, e)
            return
        finally:
            context.reset_current_point(token)
        if msg.call_id >= 0:
            self.reply(Reply(msg.call_id, self.rank, value))

    async def _run_async(self, msg: CallEndpoint, fn, instance, point) -> None:
        context.set_current_point(point)
        try:
            value = await fn(instance, *msg.args, **msg.kwargs)
        except BaseException as e:  # noqa: BLE001
            self.error(msg.call_id, e)
            return
        if msg.call_id >= 0:
            self.reply(Reply(msg.call_id, self.rank, value))

    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="md-async", daemon=True).start()
        return self._loop

    # ------------------------------------------------------------------ tensor engine
    def executor(self):
        if self._executor is None:
            import torch

            from monarch_dsl import _core
            from monarch_dsl.runtime.executor import ReferenceExecutor

            device = self.device
            if device.type == "cuda":
                torch.cuda.set_device(device)  # NCCL and new CUDA tensors use this GPU
            callbacks = dict(
                reply=lambda call_id, value: self.reply(Reply(call_id, self.rank, value)),
                reply_failure=lambda call_id, f: self.reply_made(
                    lambda: FetchFailed(call_id, self.rank, _outgoing(f))
                ),
                report=lambda f: self.reply_made(lambda: FailureReport(self.rank, _outgoing(f))),
            )
            core = _core.worker_native()  # None: MD_EXECUTOR=python, or no build (said once)
            if core is None:
                self._executor = ReferenceExecutor(self.rank, device, **callbacks)
            else:
                from monarch_dsl.runtime.core_executor import CoreExecutor

                self._executor = CoreExecutor(core, self.rank, device, **callbacks)
        return self._executor

    def run_batch(self, msg: RunBatch) -> None:
        executor = self.executor()
        if msg.default_dtype and msg.default_dtype != self._default_dtype:
            import torch

            # (process-wide: the controller has waited until what came before it ran)
            torch.set_default_dtype(getattr(torch, msg.default_dtype))
            self._default_dtype = msg.default_dtype
        executor.run(msg.items)

    def setup_collectives(self, msg: SetupCollectives) -> None:
        self.executor().use_store(msg.host, msg.port)

    def configure(self, msg: Configure) -> None:
        context.set_process_point(context.Point.of_index(self.rank, msg.dims, msg.sizes))
        if msg.memory_limit is not None and self.device.type == "cpu":
            memory.set_budget(msg.memory_limit)  # RemoteHosts.spawn_procs(memory_limit=)

    def stop(self, msg: StopWorker) -> None:
        _exit(0)


def _outgoing(failure) -> tuple:
    """A failure as it leaves this worker: one that exceeded its memory budget says so."""
    rank, line, op, error, tb = failure.as_tuple()
    return (rank, line, op, memory.explain(error), tb)


def worker_device():
    """SPEC: a worker uses ``cuda:<local index>`` when GPUs are present, ``cpu`` otherwise.
    ``MD_DEVICE`` (``cpu`` or ``cuda``, e.g. from ``spawn_procs(env=...)``) chooses instead.
    A host with fewer GPUs than its workers is refused here, clearly: two NCCL ranks on one
    GPU fail later, obscurely."""
    import torch

    want = os.environ.get("MD_DEVICE", "").strip().lower()
    if want not in ("", "cpu", "cuda"):
        raise RuntimeError(f"MD_DEVICE must be 'cpu' or 'cuda', not {want!r}")
    if want == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        if want == "cuda":
            raise RuntimeError("MD_DEVICE=cuda, but this worker sees no CUDA device")
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= count:
        raise RuntimeError(
            f"worker with LOCAL_RANK={local} on a host with {count} CUDA device(s): at most "
            f"{count} worker(s) per host can have a GPU each (MD_DEVICE=cpu runs them on the CPU)"
        )
    return torch.device("cuda", local)


def _exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _limit_threads(local_world_size: int) -> None:
    """Share the host's cores between its workers, unless the user chose."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))


def connect_and_serve(
    address: str, token: bytes, rank: int, world_size: int, local_world_size: int
) -> None:
    """Runs in the worker process; never returns."""
    os.environ.update(
        MONARCH_DSL_ROLE="worker",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
    )
    faulthandler.enable()  # a segfault prints the Python stack to stderr (which we forward)
    _limit_threads(local_world_size)
    import torch  # noqa: F401 - a worker always has torch, whatever the endpoints need

    from monarch_dsl.runtime import kernels  # its ops (DDP's buckets) exist from now on

    kernels.configure_from_env()

    keeper = None
    fd = os.environ.pop("MONARCH_DSL_KEEPER_FD", "")
    if fd:  # a persistent mesh's worker (forkserver.Keeper)
        keeper = socket.socket(fileno=int(fd))
    device = worker_device()
    memory.retain_freed_memory()
    memory.apply_from_env(device, local_world_size)  # from here on, over budget is an error
    conn = _join(address, token, rank, device)
    Worker(conn, rank, device, keeper, token).run()


def _join(address: str, token: bytes, rank: int, device: Any) -> transport.Connection:
    """Connect to the controller at ``address`` and say who this worker is."""
    sock = transport.dial(address)
    transport.handshake_dialer(sock, token)
    conn = transport.Connection(sock, peer=address)
    remote_pdb.install(address, token, rank)  # breakpoint() pauses its thread, not the worker
    conn.send(Hello(rank, os.getpid(), socket.gethostname(), device.type))
    return conn
