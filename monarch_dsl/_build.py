"""Build (once) and load the C++ runtime, ``monarch_dsl._core``.

The sources are ``cpp/*.cpp``; they are compiled against the installed torch with torch's C++
extension tooling (ninja, torch's own headers and pybind11) into ``build/core/<key>/``, where
the key covers the sources, torch's version and the Python version. A build that exists is
loaded as is: setup builds it (``python -m monarch_dsl._build``), tests and workers only load.
``MONARCH_DSL_BUILD_DIR`` puts the builds elsewhere.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "cpp"
NAME = "monarch_dsl_core"
_lock = threading.Lock()
_module: ModuleType | None = None


class BuildError(RuntimeError):
    """The C++ runtime did not compile; the message carries the compiler's output."""


def _sources() -> list[Path]:
    return sorted(SOURCES.glob("*.cpp"))


def build_dir() -> Path:
    """One directory per torch and Python version (ninja rebuilds what changed in it)."""
    import torch

    key = hashlib.sha256(f"{torch.__version__} {sys.version}".encode()).hexdigest()[:12]
    base = Path(os.environ.get("MONARCH_DSL_BUILD_DIR", ROOT / "build" / "core"))
    return base / key


def sources_hash() -> str:
    h = hashlib.sha256()
    for p in _sources() + sorted(SOURCES.glob("*.h")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def _built(directory: Path) -> Path | None:
    found = sorted(directory.glob(f"{NAME}*.so"))
    return found[0] if found else None


def load(build: bool = True) -> ModuleType:
    """The ``_core`` module: loaded from its build, compiled first if there is none (and
    ``build``)."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        import torch  # noqa: F401 - the extension links against torch's libraries

        directory = build_dir()
        stamp = directory / "sources.sha256"
        so = _built(directory)
        current = so is not None and stamp.exists() and stamp.read_text() == sources_hash()
        if current:
            spec = importlib.util.spec_from_file_location(NAME, so)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        elif not build:
            raise BuildError(f"the C++ runtime is not built, or out of date, in {directory}")
        else:
            module = _compile(directory)
            stamp.write_text(sources_hash())
        _module = module
        return module


def _compile(directory: Path) -> ModuleType:
    import contextlib
    import io

    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    print(f"monarch_dsl: building the C++ runtime in {directory} (once)", file=sys.stderr)
    try:
        with contextlib.redirect_stdout(out):
            module = cpp_extension.load(
                name=NAME,
                sources=[str(p) for p in _sources()],
                build_directory=str(directory),
                extra_cflags=["-O2"],
                verbose=True,
                is_python_module=True,
            )
    except Exception as e:  # noqa: BLE001 - any failure: say so with the compiler's words
        log = directory / "build.log"
        log.write_text(out.getvalue() + f"\n{e}\n")
        raise BuildError(
            f"building the C++ runtime failed ({type(e).__name__}); compiler output in {log}:\n"
            + _tail(out.getvalue() + str(e))
        ) from None
    return module


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


if __name__ == "__main__":
    m = load()
    print(f"monarch_dsl: C++ runtime ready ({m.__file__})")
