"""What is active on each thread -- the mesh of the innermost ``with pm.activate():``, the
stream of the innermost ``with s.activate():`` -- and the borrow rules a mesh tensor is
checked against before a command that uses it is sent."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_state = threading.local()

streams_used = False  # until a stream is activated, every thread's stream is "main"


def active_mesh() -> Any:
    """The mesh of the innermost ``with pm.activate():`` of this thread, or None."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


def mesh_stack() -> list:
    """This thread's activated meshes, innermost last."""
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    return stack


def stream_stack() -> list:
    """This thread's activated streams (``md.Stream``), innermost last."""
    stack = getattr(_state, "streams", None)
    if stack is None:
        stack = _state.streams = []
    return stack


@contextlib.contextmanager
def stream_scope(stream: Any) -> Iterator[None]:
    """Inside the block, ``stream`` (an ``md.Stream``) is this thread's active stream."""
    global streams_used
    streams_used = True
    stack = stream_stack()
    stack.append(stream)
    try:
        yield
    finally:
        stack.pop()


def current_stream() -> str:
    """The name of the stream new commands of this thread go to (``"main"`` by default)."""
    stack = getattr(_state, "streams", None)
    return stack[-1].name if stack else "main"


def check_usable(t: Any, op: str, i: int, write: bool) -> None:
    """The borrow rules, checked before anything is sent: raises ``TypeError`` if the mesh
    tensor ``t``, argument ``#i`` of ``op`` (written when ``write``), cannot be used here --
    its borrow was dropped, it is lent, or it is on another stream than the active one."""
    state = t._md_state
    if state is not None:
        kind, info = state
        if kind == "dropped":
            raise TypeError(
                f"{op}: argument #{i} was a borrowed tensor whose borrow was dropped at "
                f"{info}; it cannot be used any more"
            )
        if kind == "borrowed":
            if info.mutable:
                raise TypeError(
                    f"{op}: argument #{i} is lent to stream {info.lent._md_stream!r} (a mutable "
                    f"borrow at {info.line}); it cannot be used until the borrow is dropped"
                )
            if write:
                raise TypeError(
                    f"{op}: argument #{i} is lent to stream {info.lent._md_stream!r} (borrowed "
                    f"at {info.line}); it can be read but not written until the borrow is "
                    f"dropped"
                )
        if kind == "lent" and write and not info.mutable:
            raise TypeError(
                f"{op}: argument #{i} was borrowed immutably (at {info.line}); borrow it with "
                f"mutable=True to write it"
            )
    stream = current_stream()
    if t._md_stream != stream:
        raise TypeError(
            f"{op}: argument #{i} is on stream {t._md_stream!r} but the active stream is "
            f"{stream!r}: borrow it (md.Stream({stream!r}).borrow(t)) to use it here"
        )
