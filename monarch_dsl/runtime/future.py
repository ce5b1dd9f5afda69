"""``md.Future``: the result of a call that may not have arrived yet."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_complete_lock = threading.Lock()  # completing a future is rare and short: one lock for all
_PENDING = object()

# Called before any thread blocks waiting for a result: the controller sends the calls it is
# still holding back for batching (see transport.Connection.send_batched).
before_block: list[Callable[[], None]] = []


def flush_before_blocking() -> None:
    for hook in before_block:
        hook()


class Future(Generic[T]):
    """``.get(timeout=None)`` blocks for the value (or raises the remote error); ``await fut``
    works in asyncio code. Completed by the controller's receiver thread."""

    __slots__ = ("_waiter", "_value", "_exc", "_callbacks", "_reader")

    def __init__(self, reader: Any = None) -> None:
        # ``reader``: an object whose ``read_until(future, timeout)`` can make progress on this
        # future in the waiting thread, and whose ``raised(exc)`` hears of each error ``get``
        # raises to a caller (the controller's Job); None: just wait.
        self._reader = reader
        self._waiter = threading.Lock()
        self._waiter.acquire()
        self._value: Any = _PENDING
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[Future[T]], None]] | None = None

    # ------------------------------------------------------------------ completion
    def _complete(self, value: Any, exc: BaseException | None) -> bool:
        with _complete_lock:
            if self._value is not _PENDING or self._exc is not None:
                return False
            self._exc = exc
            self._value = None if exc is not None else value
            callbacks, self._callbacks = self._callbacks, None
            self._waiter.release()
        for cb in callbacks or ():
            cb(self)
        return True

    def set_result(self, value: T) -> bool:
        return self._complete(value, None)

    def set_exception(self, exc: BaseException) -> bool:
        return self._complete(None, exc)

    # ------------------------------------------------------------------ waiting
    def done(self) -> bool:
        return self._value is not _PENDING or self._exc is not None

    def wait_until_done(self, timeout: float | None) -> None:
        """Block until the result (or error) is in, or ``timeout`` passes, without reading
        replies or raising (the reply reader's wait; users call ``get``)."""
        if self._waiter.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._waiter.release()

    def get(self, timeout: float | None = None) -> T:
        if not self.done():
            flush_before_blocking()
            if self._reader is not None:
                self._reader.read_until(self, timeout)
            else:
                self.wait_until_done(timeout)
            if not self.done():
                raise TimeoutError(f"no result within {timeout} s (the call is still pending)")
        if self._exc is not None:
            if self._reader is not None:
                self._reader.raised(self._exc)
            raise self._exc
        return self._value

    result = get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.get(timeout)
        except TimeoutError:
            raise
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    def add_done_callback(self, cb: Callable[[Future[T]], None]) -> None:
        with _complete_lock:
            if not self.done():
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(cb)
                return
        cb(self)

    def __await__(self) -> Generator[Any, None, T]:
        if not self.done():
            flush_before_blocking()
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()

            def wake(_: Future[T]) -> None:
                loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))

            self.add_done_callback(wake)
            yield from waiter.__await__()
        return self.get()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exc else "done")
        return f"<md.Future {state}>"
