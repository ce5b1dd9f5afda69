"""Streams and borrows: ``md.Stream("comms")`` names a stream of commands (one stream runs in
order on every worker, streams run concurrently); ``s.borrow(t)`` lends a tensor to another
stream until ``borrow.drop()``. The rules a borrowed tensor obeys are ``active.check_usable``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from monarch_dsl import isa
from monarch_dsl.frames import user_line
from monarch_dsl.tensor.active import check_usable, stream_scope, stream_stack
from monarch_dsl.tensor.handle import Tensor


class Stream:
    """A named stream of commands: commands on one stream run in order on every worker,
    streams run concurrently. ``md.Stream("comms")``; ``with s.activate():``."""

    def __init__(self, name: str):
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"a stream name must be an identifier, got {name!r}")
        self.name = name

    @contextlib.contextmanager
    def activate(self) -> Iterator[Stream]:
        with stream_scope(self):
            yield self

    def borrow(self, t: Tensor, mutable: bool = False) -> tuple[Tensor, Borrow]:
        """Lend ``t`` to this stream: returns (the tensor on this stream, the borrow). While
        borrowed, ``t``'s stream may read but not write it (``mutable=False``; this stream may
        only read it too), or not touch it at all (``mutable=True``). ``borrow.drop()`` ends
        it."""
        line = user_line()
        if not isinstance(t, Tensor):
            raise TypeError(f"borrow needs an md.Tensor, got {type(t).__name__}")
        check_usable(t, "borrow", 0, write=mutable)
        if t._md_stream == self.name:
            raise TypeError(f"borrow: the tensor is already on stream {self.name!r}")
        engine = t._md_engine
        ref = engine.new_ref()
        lent = Tensor(None, t._md_mesh, engine, ref, self.name, t._md_desc)
        borrow = Borrow(t, lent, mutable, line)
        lent._md_state = ("lent", borrow)
        t._md_state = ("borrowed", borrow)
        engine.append(
            t._md_mesh_id,
            isa.BorrowBegin(t._md_ref, ref, t._md_stream, self.name, engine.new_ref(), line),
        )
        return lent, borrow

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("md.Stream", self.name))

    def __repr__(self) -> str:
        return f"md.Stream({self.name!r})"


class Borrow:
    """A tensor lent to another stream; ``drop()`` gives it back."""

    def __init__(self, origin: Tensor, lent: Tensor, mutable: bool, line: str):
        self.origin = origin
        self.lent = lent
        self.mutable = mutable
        self.line = line
        self.dropped_at: str | None = None

    def drop(self) -> None:
        line = user_line()
        if self.dropped_at is not None:
            raise TypeError(f"this borrow was already dropped at {self.dropped_at}")
        self.dropped_at = line
        lent, origin = self.lent, self.origin
        engine = lent._md_engine
        lent._md_state = ("dropped", line)
        origin._md_state = None
        engine.append(
            lent._md_mesh_id,
            isa.BorrowEnd(lent._md_ref, origin._md_stream, lent._md_stream, engine.new_ref(), line),
        )

    def __repr__(self) -> str:
        state = f"dropped at {self.dropped_at}" if self.dropped_at else "active"
        return f"<md.Borrow of {self.origin._md_stream!r} -> {self.lent._md_stream!r}, {state}>"


_MAIN = Stream("main")


def get_active_stream() -> Stream:
    """The stream new commands go to (``main`` unless a ``with s.activate():`` says else)."""
    stack = stream_stack()
    return stack[-1] if stack else _MAIN
