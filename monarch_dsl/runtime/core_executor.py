"""The worker's executor in the C++ runtime (``_core.Executor``, cpp/executor.cpp).

The ref table, the stream threads and the borrow events live in C++. Aten ops run there
through the dispatcher without the GIL, and so do collectives (``Reduce``) and copies between
meshes (``Transfer``), through the executor's process groups: gloo / NCCL backends or shared
memory (cpp/comm.h), made by Python once per group. What still needs Python -- fetches,
remote functions, the Python side of compiled plans, seeding -- is handed to the stream's C++
thread as a Python callable, run under the GIL in its place in the stream's order, by the same
handlers as the reference executor's (they see the C++ table through its mapping interface).
``MD_EXECUTOR=python`` selects the reference executor instead; the tests run eager batches and
plans through both and compare.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from monarch_dsl import isa
from monarch_dsl.runtime.executor import ReferenceExecutor
from monarch_dsl.runtime.failure import Failure


class CoreExecutor(ReferenceExecutor):
    def __init__(self, core: Any, rank: int, device: Any, **callbacks: Any):
        super().__init__(rank, device, **callbacks)
        self.core = core.Executor(rank, isa.Ref, isa.WORKER_DEVICE, device, Failure, self.report)
        self.refs = self.core  # type: ignore[assignment]  # a mapping of ref -> value
        self._group_names: set[str] = set()  # groups whose getter C++ has

    def values_of(self, refs: tuple[int, ...]) -> list[Any]:
        return self.core.get_many(refs)

    def run(self, items: tuple) -> None:
        """Eager ops go to C++ in runs (prepared and queued there, one wake-up per stream per
        run); everything else comes back to :meth:`_other`, in its place."""
        self.core.run_batch(items, self.member, isa.CallOp, self._other)

    def _other(self, mesh: int, ins: Any) -> None:
        """One instruction of this rank that is not an op C++ prepares."""
        core = self.core
        kind = type(ins)
        if kind is isa.CallOp:  # arguments only Python takes (a mesh coordinate)
            core.python(ins.stream, partial(self.call_op, ins))
        elif kind is isa.Reduce:
            group = self._group_key(ins)
            core.reduce(ins, group, what=f"reduce over {ins.dims}", what_error=f"reduce {ins.dims}")
        elif kind is isa.Transfer:
            rank = self.rank
            groups = [
                self._pair_group(a, b, ins.stream) if rank in (a, b) and a != b else ""
                for a, b in ins.pairs
            ]
            core.transfer(ins, groups)
        elif kind is isa.Delete:
            core.delete(ins.stream, list(ins.refs))
        elif kind is isa.DefineMesh:
            self.define_mesh(ins)
        elif kind is isa.DefinePlan:
            self.plans().define(ins)
        elif kind is isa.Seed:
            core.python("main", partial(self.seed, ins))
        elif kind is isa.Fetch and ins.ref < 0:
            core.barrier(partial(self.reply, ins.call_id, None))
        elif kind is isa.BorrowBegin:
            core.signal(ins.origin, ins.event)
            core.borrow_begin(ins.stream, ins.event, ins.src, ins.dst)
        elif kind is isa.BorrowEnd:
            core.borrow_end(ins.stream, ins.event, ins.dst)
            core.wait(ins.origin, ins.event)
        else:
            core.python(ins.stream, partial(self.handlers[kind], ins))

    def _group_key(self, ins: isa.Reduce) -> str:
        """The C++ side's name for the group of ``ins`` (mesh slice and stream)."""
        return self._named_group(
            f"{ins.mesh}/{','.join(ins.dims)}/{ins.stream}", partial(self.reduce_group, ins)
        )

    def _pair_group(self, a: int, b: int, stream: str) -> str:
        """The C++ side's name for the group of ranks ``a`` and ``b`` on ``stream``."""
        members = sorted((a, b))
        return self._named_group(
            f"pair/{members[0]},{members[1]}/{stream}", partial(self._pair, members, stream)
        )

    def _named_group(self, name: str, get: Any) -> str:
        """``name``, whose getter ``get`` is registered on first sight (C++ calls it on the
        stream's thread at the group's first use)."""
        if name not in self._group_names:
            self._group_names.add(name)
            self.core.set_group(name, get)
        return name

    def _pair(self, members: list[int], stream: str) -> tuple:
        return self.process_group(members, stream), members.index(self.rank), 2

    def close(self, timeout: float = 60.0) -> None:
        """Stop the stream threads once they ran what they were given; free every ref and
        drop the process groups."""
        self.core.close()
        super().close(timeout)
