"""``monarch_dsl._core``: the C++ runtime, compiled from ``cpp/`` by ``monarch_dsl._build``; the
one place that loads it.

:func:`native` loads the build once per process (``monarch-dsl build``, ``scripts/setup.sh``
or the controller's ``_build.ensure()`` makes it; loading never compiles); :func:`require`
raises where it cannot; :func:`worker_native` adds a worker's choice of executor. The
module's classes (``Executor``, ``CompiledPlan``, ``Env``, ``ShmGroup``: ``_core.pyi``) are
attributes here too, loaded on first use.
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Any

from monarch_dsl import _build

_lock = threading.Lock()
_module: ModuleType | None = None
_error: Exception | None = None  # why it could not be loaded (the first try's answer stands)


def native() -> ModuleType | None:
    """The C++ runtime's module, or None when it cannot be loaded: not built for these sources
    and this torch, or it failed to load (:func:`unavailable_reason` says why). The first call
    loads it; later calls return what that one found."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                _module = _build.load(build=False)
            except Exception as e:  # noqa: BLE001 - not built, out of date, failed to load
                _error = e
        return _module


def unavailable_reason() -> str | None:
    """Why :func:`native` is None ("BuildError: ..."), or None when it is not."""
    if native() is not None or _error is None:
        return None
    return f"{type(_error).__name__}: {_error}"


def require() -> ModuleType:
    """:func:`native`, or the exception that stopped it (:class:`~monarch_dsl._build.BuildError`:
    not built)."""
    module = native()
    if module is None:
        raise _error  # type: ignore[misc]  # set whenever native() is None
    return module


def worker_native() -> ModuleType | None:
    """The C++ runtime for a worker's executor and compiled plans, unless ``MD_EXECUTOR=python``
    asks for the reference executor. A worker never builds it (the controller does, before
    starting workers): without a build, compute runs in Python, and says so once (then
    ``MD_EXECUTOR=python``)."""
    if os.environ.get("MD_EXECUTOR", "cpp") == "python":
        return None
    try:
        return require()
    except _build.BuildError as e:
        print(f"monarch_dsl worker: {e}; compiled plans run in Python", file=sys.stderr)
        os.environ["MD_EXECUTOR"] = "python"
        return None


def __getattr__(name: str) -> Any:
    """``_core.CompiledPlan`` and the other classes of the C++ module (:func:`require`)."""
    if name.startswith("_"):
        raise AttributeError(name)
    return getattr(require(), name)
