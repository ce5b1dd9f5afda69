"""The reference executor: runs plan instructions (``monarch_dsl/isa``) on one worker, in Python.

It keeps the ref table, and an error value per failed ref: an instruction whose inputs failed
is skipped and its outputs fail with the same root cause, so only what depends on a failure
fails. Collectives always take part -- with a zero placeholder for a failed input -- so a
failure on some ranks never leaves the others waiting. The C++ executor (issue 5) implements
the same contract; this one stays for differential tests.
"""

from __future__ import annotations

import datetime
import pickle
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from monarch_dsl import isa
from monarch_dsl.isa import collectives
from monarch_dsl.isa.opnames import resolve_op
from monarch_dsl.mesh import coords_of_index, index_of_coords
from monarch_dsl.runtime import codesync, context, exchange, memory
from monarch_dsl.runtime.failure import Failure

if TYPE_CHECKING:
    from monarch_dsl.runtime.plan_runner import PlanRunner

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


class ReferenceExecutor:
    def __init__(
        self,
        rank: int,
        device: torch.device,
        reply: Callable[[int, Any], None],
        reply_failure: Callable[[int, Failure], None],
        report: Callable[[Failure], None],
    ):
        self.rank = rank
        self.device = device
        self.refs: dict[int, Any] = {}
        self.meshes: dict[int, isa.DefineMesh] = {}
        self.member: dict[int, bool] = {}
        self.reply = reply  # (call_id, value) -> sends a Reply
        self.reply_failure = reply_failure
        self.report = report  # a root failure, for the controller to raise if nobody fetches
        self.store: dist.Store | None = None
        self.store_address: tuple[str, int] | None = None
        self._store_lock = threading.Lock()
        self.groups: dict[tuple[int, ...], Any] = {}
        self.functions: dict[bytes, Callable] = {}
        self.handlers = {
            isa.CallOp: self.call_op,
            isa.CallFunction: self.call_function,
            isa.Reduce: self.reduce,
            isa.Transfer: self.transfer,
            isa.Fetch: self.fetch,
            isa.Delete: self.delete,
            isa.Seed: self.seed,
            isa.DefineMesh: self.define_mesh,
            isa.BorrowBegin: self.borrow_begin,
            isa.BorrowEnd: self.borrow_end,
            isa.RunPlan: self.run_plan,
        }
        self.plan_runner: PlanRunner | None = None
        self.streams: dict[str, queue.SimpleQueue] = {}
        self.threads: list[threading.Thread] = []
        self.events: dict[int, threading.Event] = {}
        self.events_lock = threading.Lock()

    # ------------------------------------------------------------------ driving
    def run(self, items: tuple) -> None:
        """``items``: (mesh id, instruction) pairs; run those whose mesh includes this rank,
        each on its stream's thread (one thread per stream, in order)."""
        member = self.member
        for mesh, ins in items:
            if not (mesh < 0 or member.get(mesh, False)):
                continue
            kind = type(ins)
            if kind is isa.DefineMesh:
                self.define_mesh(ins)
            elif kind is isa.DefinePlan:
                self.plans().define(ins)
            elif kind is isa.Seed:
                self._queue("main").put(ins)
            elif kind is isa.Fetch and ins.ref < 0:
                self._barrier(ins.call_id)
            elif kind is isa.BorrowBegin:
                self._queue(ins.origin).put(("signal", ins.event))
                self._queue(ins.stream).put(ins)
            elif kind is isa.BorrowEnd:
                self._queue(ins.stream).put(ins)
                self._queue(ins.origin).put(("wait", ins.event))
            else:
                self._queue(ins.stream).put(ins)

    # ------------------------------------------------------------------ streams
    def _queue(self, stream: str) -> queue.SimpleQueue:
        q = self.streams.get(stream)
        if q is None:
            q = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._stream_loop, args=(q,), name=f"md-stream-{stream}", daemon=True
            )
            memory.start_thread(thread)  # (one that cannot start leaves no stream behind)
            self.streams[stream] = q
            self.threads.append(thread)
        return q

    def close(self, timeout: float = 60.0) -> None:
        """Stop the stream threads once they ran what they were given, and drop the refs and
        the process groups: their resources go now, in this process (not in one forked from
        it later, where a gloo group's threads would be missing)."""
        for q in self.streams.values():
            q.put(None)
        for thread in self.threads:
            thread.join(timeout)
        self.streams.clear()
        self.threads.clear()
        self.refs = {}
        self.groups.clear()
        self.plan_runner = None

    def _stream_loop(self, q: queue.SimpleQueue) -> None:
        # OpenMP's and MKL's thread counts are per thread (a new one starts at one per core):
        # take the process's, as the C++ executor's stream threads do (at::init_num_threads).
        try:
            torch.set_num_threads(torch.get_num_threads())
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # per thread: ops without a device use this GPU
        except Exception:  # noqa: BLE001 - the stream still runs what it is given (or fails it)
            print(
                f"monarch_dsl executor: setting up a stream thread:\n{traceback.format_exc()}",
                file=sys.stderr,
                flush=True,
            )
        handlers = self.handlers
        while True:
            ins = q.get()
            if ins is None:  # close()
                return
            try:
                if type(ins) is tuple:  # ("signal" | "wait" | "barrier", event id or callback)
                    what, arg = ins
                    if what == "signal":
                        self._event(arg).set()
                    elif what == "wait":
                        self._event(arg).wait()
                        self.events.pop(arg, None)
                    else:
                        arg()  # (a barrier's reply: it may fail to send)
                else:
                    handlers[type(ins)](ins)
            except Exception:  # noqa: BLE001 - a bug of ours; keep the stream alive and say so
                print(
                    f"monarch_dsl executor: internal error on {ins!r}:\n{traceback.format_exc()}",
                    file=sys.stderr,
                    flush=True,
                )

    def _event(self, event: int) -> threading.Event:
        with self.events_lock:
            ev = self.events.get(event)
            if ev is None:
                ev = self.events[event] = threading.Event()
            return ev

    def _barrier(self, call_id: int) -> None:
        """Reply once every stream has run what it was given before this point."""
        queues = list(self.streams.values())
        if not queues:
            self.reply(call_id, None)
            return
        left = [len(queues)]
        lock = threading.Lock()

        def arrive() -> None:
            with lock:
                left[0] -= 1
                done = left[0] == 0
            if done:
                self.reply(call_id, None)

        for q in queues:
            q.put(("barrier", arrive))

    def borrow_begin(self, ins: isa.BorrowBegin) -> None:
        self._event(ins.event).wait()  # the origin stream got here: the value is ready
        self.events.pop(ins.event, None)
        self.refs[ins.dst] = self.refs.get(ins.src)

    def borrow_end(self, ins: isa.BorrowEnd) -> None:
        self.refs.pop(ins.dst, None)
        self._event(ins.event).set()

    # ------------------------------------------------------------------ values
    def _value(self, x: Any) -> Any:
        if isinstance(x, isa.Ref):
            return self.refs[x.id]
        if x is isa.WORKER_DEVICE:
            return self.device
        if isinstance(x, isa.MeshCoord):
            mesh = self.meshes[x.mesh]
            coords = self.coords_in(mesh)
            picked = [mesh.dims.index(d) for d in x.dims]
            return index_of_coords([coords[k] for k in picked], [mesh.sizes[k] for k in picked])
        if isinstance(x, tuple):
            return tuple(self._value(v) for v in x)
        if isinstance(x, list):
            return [self._value(v) for v in x]
        if isinstance(x, dict):
            return {k: self._value(v) for k, v in x.items()}
        return x

    def _failed_input(self, args: Any, kwargs: Any) -> Failure | None:
        for rid in isa.refs_in(args) + isa.refs_in(kwargs):
            v = self.refs.get(rid)
            if isinstance(v, Failure):
                return v
            if rid not in self.refs:
                return Failure(self.rank, "", "", f"internal error: no value for %{rid}", "")
        return None

    # ------------------------------------------------------------------ for the plan runner
    # (and the C++ executor's Python side): failures, coordinates, process groups

    def fail(self, outs, failure: Failure, root: bool) -> None:
        """Store ``failure`` as the value of the refs ``outs`` (None entries are skipped);
        ``root``: it happened here (not an input's), so report it to the controller."""
        for rid in outs:
            if rid is not None:
                self.refs[rid] = failure
        if root:
            self.report(failure)

    def root_failure(self, loc: str, op: str, e: BaseException) -> Failure:
        """The failure of ``op`` (made at the user's ``loc``) on this rank, raising ``e``."""
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return Failure(self.rank, loc, op, f"{type(e).__name__}: {e}", tb)

    def values_of(self, refs: tuple[int, ...]) -> list[Any]:
        """``[self.refs.get(r) for r in refs]`` (the C++ table's: one call)."""
        get = self.refs.get
        return [get(r) for r in refs]

    def coords_in(self, mesh: isa.DefineMesh) -> tuple[int, ...]:
        """This rank's coordinates in ``mesh`` (one per dim, row-major)."""
        return coords_of_index(mesh.ranks.index(self.rank), mesh.sizes)

    def group_along(
        self, mesh: isa.DefineMesh, coords: tuple[int, ...], dims: tuple[int, ...], stream: str
    ) -> tuple[Any, int, int]:
        """The process group (for ``stream``) of the ranks of ``mesh`` that share this rank's
        ``coords`` on every dim but ``dims`` (indices): (group, this rank's index in it, its
        size)."""
        kept = [k for k in range(len(coords)) if k not in dims]
        members = [
            r
            for i, r in enumerate(mesh.ranks)
            if all(coords_of_index(i, mesh.sizes)[k] == coords[k] for k in kept)
        ]
        return self.process_group(members, stream), members.index(self.rank), len(members)

    # ------------------------------------------------------------------ instructions
    def define_mesh(self, ins: isa.DefineMesh) -> None:
        self.meshes[ins.mesh] = ins
        self.member[ins.mesh] = self.rank in ins.ranks

    def call_op(self, ins: isa.CallOp) -> None:
        failed = self._failed_input(ins.args, ins.kwargs)
        if failed is not None:
            self.fail(ins.outs, failed, root=False)
            return
        try:
            result = resolve_op(ins.op)(*self._value(ins.args), **self._value(ins.kwargs))
        except Exception as e:  # noqa: BLE001 - the failure is the value now
            self.fail(ins.outs, self.root_failure(ins.loc, ins.op, e), root=True)
            return
        leaves = pytree.tree_leaves(result)
        for rid, leaf in zip(ins.outs, (x for x in leaves if isinstance(x, torch.Tensor))):
            if rid is not None:
                self.refs[rid] = leaf

    def call_function(self, ins: isa.CallFunction) -> None:
        failed = self._failed_input(ins.args, ins.kwargs)
        result = None
        if failed is None:
            try:
                fn = self.functions.get(ins.fn)
                if fn is None:
                    fn = self.functions[ins.fn] = codesync.newest(pickle.loads(ins.fn))
                mesh = self.meshes[ins.mesh]
                point = context.Point.of_index(mesh.ranks.index(self.rank), mesh.dims, mesh.sizes)
                token = context.set_current_point(point)
                try:
                    result = fn(*self._value(ins.args), **self._value(ins.kwargs))
                finally:
                    context.reset_current_point(token)
            except Exception as e:  # noqa: BLE001
                failed = self.root_failure(ins.loc, getattr(fn, "__qualname__", "remote"), e)
                self.fail(ins.outs, failed, root=True)
        else:
            self.fail(ins.outs, failed, root=False)
        tensors = [x for x in pytree.tree_leaves(result) if isinstance(x, torch.Tensor)]
        if failed is None:
            for rid, leaf in zip(ins.outs, tensors):
                if rid is not None:
                    self.refs[rid] = leaf
        if ins.shapes_to >= 0 and ins.shapes_rank == self.rank:
            if failed is not None:
                self.reply_failure(ins.shapes_to, failed)
            else:
                spec = pytree.treespec_dumps(pytree.tree_structure(result))
                leaves = [
                    (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                    for x in pytree.tree_leaves(result)
                ]
                self.reply(ins.shapes_to, (leaves, spec))

    def fetch(self, ins: isa.Fetch) -> None:
        try:
            self._fetch(ins)
        except MemoryError as e:
            # At the budget's last pages anything can fail (making the reply, a frame): the
            # caller waits for an answer, so say it from the grace room instead of losing it.
            with memory.grace():
                self.reply_failure(ins.call_id, self.root_failure(ins.loc, "fetch", e))

    def _fetch(self, ins: isa.Fetch) -> None:
        if ins.ref < 0:  # a barrier: everything before it has run
            self.reply(ins.call_id, None)
            return
        value = self.refs.get(ins.ref)
        if isinstance(value, Failure):
            self.reply_failure(ins.call_id, value)
            return
        if value is None:
            self.reply_failure(
                ins.call_id,
                Failure(self.rank, ins.loc, "fetch", f"%{ins.ref} was deleted", ""),
            )
            return
        try:
            copy = value.detach().to("cpu", copy=True)
        except Exception as e:  # noqa: BLE001 - no memory for the copy (its budget): say so
            with memory.grace():  # (room to say it, were the budget used up to its last pages)
                self.reply_failure(ins.call_id, self.root_failure(ins.loc, "fetch", e))
            return
        self.reply(ins.call_id, copy)

    def delete(self, ins: isa.Delete) -> None:
        for rid in ins.refs:
            self.refs.pop(rid, None)

    def plans(self) -> PlanRunner:
        """The plan runner (``DefinePlan``, ``RunPlan``), made at first use."""
        if self.plan_runner is None:
            from monarch_dsl.runtime.plan_runner import PlanRunner

            self.plan_runner = PlanRunner(self)
        return self.plan_runner

    def run_plan(self, ins: isa.RunPlan) -> None:
        self.plans().run(ins)

    def seed(self, ins: isa.Seed) -> None:
        torch.manual_seed(ins.seed)

    # ------------------------------------------------------------------ collectives
    def use_store(self, host: str, port: int) -> None:
        """Where the controller's store is: joined at the first collective (on the stream
        that needs it), not here -- the worker's message loop must never wait on a store (a
        controller that died just after sending this would hold it for the store's timeout,
        and a persistent mesh's worker could not go back to waiting for the next one)."""
        self.store_address = (host, port)
        self.store = None

    def _store(self) -> dist.Store:
        with self._store_lock:
            if self.store is None:
                if self.store_address is None:
                    raise RuntimeError("collectives are not set up on this worker")
                host, port = self.store_address
                self.store = dist.TCPStore(host, port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
            return self.store

    def process_group(self, members: list[int], stream: str = "main") -> Any:
        """The gloo group of ``members`` for ``stream``: streams run concurrently, so each has
        its own groups (two streams' collectives must never interleave on one group)."""
        key = (stream, *members)
        group = self.groups.get(key)
        if group is None:
            prefix = dist.PrefixStore(f"md/{stream}/" + ",".join(map(str, members)), self._store())
            # Shared memory between ranks of one host (CPU tensors); gloo otherwise.
            from monarch_dsl.runtime import shm

            group = shm.make_group(prefix, members, self.rank, COLLECTIVE_TIMEOUT, self.device)
            if group is None:
                group = new_group(prefix, members.index(self.rank), len(members), self.device)
            self.groups[key] = group
        return group

    def transfer(self, ins: isa.Transfer) -> None:
        """Send to / receive from each peer; a failed source sends a flag and zeros, so the
        receiver fails too (with the sender's root cause) instead of hanging or using zeros."""
        src = self.refs.get(ins.src)
        works = []
        received = None
        failure = None
        try:
            for a, b in ins.pairs:
                if a == b == self.rank:
                    received = self._local_copy(src)
                    continue
                if self.rank not in (a, b):
                    continue
                members = sorted((a, b))
                group = self.process_group(members, ins.stream)
                peer = members.index(b if self.rank == a else a)
                if self.rank == a:
                    ok = not isinstance(src, Failure)
                    value = (
                        src
                        if ok
                        else torch.zeros(
                            ins.shape, dtype=getattr(torch, ins.dtype), device=self.device
                        )
                    )
                    flag = torch.tensor([1 if ok else 0], device=self.device)
                    works.append(group.send([flag], peer, 0))
                    works.append(group.send([value.detach().contiguous()], peer, 1))
                else:
                    flag = torch.zeros(1, dtype=torch.int64, device=self.device)
                    buf = torch.empty(
                        ins.shape, dtype=getattr(torch, ins.dtype), device=self.device
                    )
                    works.append(group.recv([flag], peer, 0))
                    works.append(group.recv([buf], peer, 1))
                    received = (flag, buf)
            for w in works:
                w.wait()
        except Exception as e:  # noqa: BLE001
            failure = self.root_failure(ins.loc, "to_mesh", e)
        if failure is not None:
            self.fail((ins.out,), failure, root=True)
        elif isinstance(received, tuple):
            flag, buf = received
            if int(flag.item()) == 1:
                self.refs[ins.out] = buf
            else:
                self.fail(
                    (ins.out,),
                    Failure(self.rank, ins.loc, "to_mesh", "the source value had failed", ""),
                    root=False,
                )
        elif received is not None:
            self.refs[ins.out] = received

    def _local_copy(self, src: Any) -> Any:
        """A rank's ``to_mesh`` to itself: a contiguous copy, as one received from another
        rank is (the controller's handle describes it so: ``handle.contiguous_desc``)."""
        if isinstance(src, Failure):
            return src
        return src.detach().clone(memory_format=torch.contiguous_format)

    def reduce_group(self, ins: isa.Reduce) -> tuple[Any, int, int]:
        """The process group of this rank's slice of ``ins.dims``; (group, my index, size)."""
        mesh = self.meshes[ins.mesh]
        dims = tuple(k for k, d in enumerate(mesh.dims) if d in ins.dims)
        return self.group_along(mesh, self.coords_in(mesh), dims, ins.stream)

    def reduce(self, ins: isa.Reduce) -> None:
        src = self.refs.get(ins.src)
        failed = src if isinstance(src, Failure) else None
        if failed is None and isinstance(src, torch.Tensor) and src.device != self.device:
            # (a remote function's CPU tensor on a GPU worker): this rank alone would fail in
            # the collective while the others wait in it; it is a failed input instead.
            failed = Failure(self.rank, ins.loc, f"reduce {ins.dims}", _elsewhere(src), "")
        try:
            group, index, size = self.reduce_group(ins)
            # Whether any rank of the group lost its input: then every rank's result is failed
            # (it would mix in a placeholder), and all still take part, so none waits forever.
            if exchange.any_failed(group, failed is not None, self.device) and failed is None:
                failed = Failure(
                    self.rank,
                    ins.loc,
                    f"reduce over {ins.dims}",
                    "the input of another rank of the group had failed",
                    "",
                )
            if failed is not None:
                meta = self._placeholder_meta(ins)
                src = torch.zeros(meta[0], dtype=meta[1], device=self.device)
            in_place = ins.out == ins.src and failed is None
            out = _collective(group, index, size, src, ins.reduction, ins.scatter, in_place)
            if failed is not None and not isinstance(self.refs.get(ins.src), Failure):
                self.report(failed)  # this rank's own input was fine: a root cause here
        except Exception as e:  # noqa: BLE001
            self.fail((ins.out,), self.root_failure(ins.loc, f"reduce {ins.dims}", e), True)
            return
        if failed is not None:
            self.fail((ins.out,), failed, root=False)
        elif ins.out == ins.src:
            if out is not src:
                src.copy_(out)
        else:
            self.refs[ins.out] = out

    def _placeholder_meta(self, ins: isa.Reduce) -> tuple[tuple[int, ...], torch.dtype]:
        return ins.shape, getattr(torch, ins.dtype)


def _elsewhere(t: torch.Tensor) -> str:
    return f"RuntimeError: the input is on {t.device}, not on this worker's device"


def new_group(store: Any, index: int, size: int, device: torch.device) -> Any:
    """A torch.distributed backend for ``size`` ranks (this one at ``index``): NCCL for CUDA
    tensors, gloo otherwise."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, index, size, options)
    return dist.ProcessGroupGloo(store, index, size, COLLECTIVE_TIMEOUT)


def _collective(
    group, index: int, size: int, src: torch.Tensor, reduction: str, scatter: bool, in_place: bool
):
    """The eager ``Reduce``'s result; an in-place all-reduce of a contiguous tensor works on
    ``src`` itself (no copies: at 64 MiB two copies halved the bandwidth)."""
    if reduction == "stack":
        # scatter: all-to-all, piece i of my dim 0 goes to rank i
        c = collectives.all_to_all(src, 0, 0, size) if scatter else collectives.stack(src)
        return exchange.run(group, index, size, c)
    if scatter:
        return exchange.run(group, index, size, collectives.reduce_scatter(src, reduction, 0, size))
    c = collectives.all_reduce([src], reduction, size, in_place=in_place)
    return exchange.run(group, index, size, c)[0]
