"""Build (once) and load the C++ runtime, ``monarch_dsl._core``.

The sources ship inside the package (``monarch_dsl/cpp/``, package data), so a plain
``pip install`` has them. They are compiled on first use against the torch that is installed
at that moment, with torch's C++ extension tooling (ninja, torch's headers and pybind11), into a
per-user cache: ``$MONARCH_DSL_BUILD_DIR``, else ``$XDG_CACHE_HOME/monarch_dsl/core``, else
``~/.cache/monarch_dsl/core``. One directory per key; the key covers the sources' contents,
torch's version and the Python version, so an editable checkout and an installed wheel of the
same sources share one build, and a new torch gets a new one.

Why on first use rather than when the wheel is built: a wheel build that compiles against torch
needs torch inside pip's build environment, and pip's default (isolated) build would download a
second torch there -- on most machines a multi-GB CUDA build -- and the extension would then be
tied to that torch rather than the one the user runs. Compiling against the installed torch on
first use (as ``torch.utils.cpp_extension.load`` does) has neither problem.

Who builds: the controller, before it starts workers (``ensure``: a progress line, then
'ready'); ``monarch-dsl build`` (or ``python -m monarch_dsl._build``) ahead of time; an
externally launched worker before it joins. Workers started by a controller only load. Two
processes building the same key at once take turns on a file lock; the second loads what the
first built. A build that cannot happen (no C++ compiler, no Python headers, no ninja) says so,
says how to fix it, and says that workers run the Python reference executor instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

SOURCES = Path(__file__).resolve().parent / "cpp"
NAME = "monarch_dsl_core"
KEEP = 3  # builds kept in the cache (the newest); older ones are removed after a new build
_lock = threading.Lock()
_module: ModuleType | None = None
_failure: BuildError | None = None  # ensure(): why the runtime is unavailable (said once)


class BuildError(RuntimeError):
    """The C++ runtime is not available: not built, or it did not compile (the message says
    why and how to fix it)."""


def _sources() -> list[Path]:
    return sorted(SOURCES.glob("*.cpp"))


def sources_hash() -> str:
    """Of the sources' names and contents only (not their paths), so every copy of the same
    sources -- a checkout, an installed wheel -- has the same hash."""
    h = hashlib.sha256()
    for p in _sources() + sorted(SOURCES.glob("*.h")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def cache_dir() -> Path:
    """Where builds live: ``$MONARCH_DSL_BUILD_DIR``, else the user's cache directory."""
    if os.environ.get("MONARCH_DSL_BUILD_DIR"):
        return Path(os.environ["MONARCH_DSL_BUILD_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "monarch_dsl" / "core"


def build_dir() -> Path:
    """This build's directory: one per (sources, torch version, Python version)."""
    import torch

    key = f"{sources_hash()} {torch.__version__} {sys.version}"
    return cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:16]


def _built(directory: Path) -> Path | None:
    """The build's shared library, once a build finished there (its stamp is written last)."""
    found = sorted(directory.glob(f"{NAME}*.so"))
    return found[0] if found and (directory / "complete").exists() else None


def _load_so(so: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, so)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(build: bool = True) -> ModuleType:
    """The ``_core`` module: loaded from its build, compiled first if there is none (and
    ``build``; else :class:`BuildError`)."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        import torch  # noqa: F401 - the extension links against torch's libraries

        directory = build_dir()
        so = _built(directory)
        if so is None and not build:
            raise BuildError(
                f"the C++ runtime is not built for these sources and this torch ({directory}); "
                "build it with `monarch-dsl build`"
            )
        if so is None:
            with _build_lock(directory):
                so = _built(directory)  # another process may have built it meanwhile
                if so is None:
                    _module = _compile(directory)
                    (directory / "complete").write_text(sources_hash())
                    _prune(directory)
                    return _module
        _module = _load_so(so)
        return _module


def ensure(log=None) -> ModuleType | None:
    """The C++ runtime, built now if needed (the controller calls this before it starts
    workers), or None when it cannot be had: then why, and how to fix it, is said once (on
    ``log``, default stderr) and workers use the Python reference executor."""
    global _failure
    if _failure is not None:
        return None
    try:
        return load(build=True)
    except BuildError as e:
        _failure = e
        print(
            f"monarch_dsl: WARNING: {e}\nmonarch_dsl: until then, workers run the Python "
            "reference executor (correct, but several times slower).",
            file=log or sys.stderr,
        )
        return None


class _build_lock:
    """An exclusive lock on one build directory, between processes (released by the kernel if
    its holder dies). Waiting for another process's build says so."""

    def __init__(self, directory: Path):
        directory.parent.mkdir(parents=True, exist_ok=True)
        self.path = directory.parent / f"{directory.name}.lock"

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                "monarch_dsl: waiting for another process building the C++ runtime...",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def check_toolchain() -> None:
    """What a build needs beyond torch: a C++ compiler, Python's headers and ninja. Raises
    :class:`BuildError` naming what is missing and how to get it."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError(
            f"the C++ runtime cannot be built: no C++ compiler ({cxx!r} is not on PATH). "
            "Install one (Debian/Ubuntu: `apt-get install g++`; Fedora: `dnf install gcc-c++`; "
            "macOS: `xcode-select --install`) or point CXX at one, then run `monarch-dsl build`"
        )
    include = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not include.exists():
        raise BuildError(
            f"the C++ runtime cannot be built: Python's headers are missing ({include}). "
            f"Install them (Debian/Ubuntu: `apt-get install python3-dev`), then run "
            "`monarch-dsl build`"
        )
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        raise BuildError(
            "the C++ runtime cannot be built: ninja is missing. `pip install ninja` "
            "(a dependency of monarch-dsl), then run `monarch-dsl build`"
        ) from None


def _compile(directory: Path) -> ModuleType:
    from torch.utils import cpp_extension

    check_toolchain()
    directory.mkdir(parents=True, exist_ok=True)
    sources = _sources()
    progress = _Progress(directory, len(sources))
    try:
        # verbose=False: ninja's output is captured and put in the error on a failure; a
        # successful build prints nothing but the progress line.
        module = cpp_extension.load(
            name=NAME,
            sources=[str(p) for p in sources],
            build_directory=str(directory),
            extra_cflags=["-O2"],
            verbose=False,
            is_python_module=True,
        )
    except Exception as e:  # noqa: BLE001 - any failure: say so with the compiler's words
        progress.stop(ok=False)
        log = directory / "build.log"
        log.write_text(f"{e}\n")
        raise BuildError(
            f"building the C++ runtime failed ({type(e).__name__}); compiler output in {log}:\n"
            + _tail(str(e))
        ) from None
    progress.stop(ok=True)
    return module


class _Progress:
    """The build's progress line on stderr: objects compiled so far and seconds elapsed
    (rewritten in place on a terminal, a line every 30 s otherwise)."""

    def __init__(self, directory: Path, sources: int):
        self.directory, self.sources = directory, sources
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.done = threading.Event()
        print(
            f"monarch_dsl: building the C++ runtime for this torch, once "
            f"({sources} files, about {30 * sources // max(1, os.cpu_count() or 1) + 20} s) "
            f"in {directory}",
            file=sys.stderr,
            flush=True,
        )
        self.thread = threading.Thread(target=self._run, name="md-build-progress", daemon=True)
        self.thread.start()

    def _line(self) -> str:
        objects = len(list(self.directory.glob("*.o")))
        return (
            f"monarch_dsl: compiling: {min(objects, self.sources)}/{self.sources} files, "
            f"{time.monotonic() - self.start:.0f} s"
        )

    def _run(self) -> None:
        interval = 1.0 if self.tty else 30.0
        while not self.done.wait(interval):
            if self.tty:
                sys.stderr.write("\r" + self._line())
            else:
                sys.stderr.write(self._line() + "\n")
            sys.stderr.flush()

    def stop(self, ok: bool) -> None:
        self.done.set()
        self.thread.join()
        if self.tty:
            sys.stderr.write("\r\033[K")
        took = time.monotonic() - self.start
        state = "ready" if ok else "FAILED"
        print(f"monarch_dsl: C++ runtime {state} ({took:.0f} s)", file=sys.stderr, flush=True)


def _prune(keep: Path) -> None:
    """Remove all but the newest KEEP builds in the cache (never one being built: its lock is
    held)."""
    base = keep.parent
    builds = sorted(
        (d for d in base.iterdir() if d.is_dir() and d != keep),
        key=lambda d: d.stat().st_mtime,
        reverse=True,
    )
    for old in builds[KEEP - 1 :]:
        lock = base / f"{old.name}.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # being built right now
        else:
            shutil.rmtree(old, ignore_errors=True)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def main() -> int:
    try:
        m = load(build=True)
    except BuildError as e:
        print(f"monarch_dsl: {e}", file=sys.stderr)
        return 1
    print(f"monarch_dsl: C++ runtime ready ({m.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
