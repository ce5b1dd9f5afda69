"""Where the user's code is: the one rule for the ``file:line`` that monarch_dsl's messages
print -- a plan's instruction locations and a ``PlanError``, a tensor command's line in a
``RemoteError``, a borrow's "dropped at ...".

The user's frame is the innermost one whose file is the user's (see ``is_user_file``); its
file prints as ``short_path`` gives it (relative to the working directory when under it).
This module imports nothing from the package (the compiler and the tensor engine both use it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

import torch

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def is_user_file(path: str) -> bool:
    """Whether code in ``path`` is the user's: a real file (not ``<stdin>``, ``<string>`` or
    torch.fx's generated ``<eval_with_key>``) outside monarch_dsl, torch and unittest."""
    if path.startswith("<"):
        return False
    path = os.path.abspath(path)
    return not (
        path.startswith(PACKAGE_DIR + os.sep)
        or path.startswith(TORCH_DIR + os.sep)
        or "/unittest/" in path
    )


def short_path(path: str) -> str:
    """A path as messages print it: relative to the working directory when under it."""
    path = os.path.abspath(path)
    cwd = os.getcwd()
    return os.path.relpath(path, cwd) if path.startswith(cwd + os.sep) else path


def innermost_user(frames: Iterable) -> str:
    """``file:line`` of the innermost user frame of ``frames`` -- outermost first, each a
    ``(file, line, ...)`` tuple or a ``traceback.FrameSummary`` -- or ``""`` if none is."""
    last = ""
    for path, line, *_ in frames:
        if is_user_file(path):
            last = f"{short_path(path)}:{line}"
    return last


# id(code object) -> (code, its file as printed or "" for code that is not the user's,
# {bytecode offset: "file:line"}); the code object is kept so that its id is not reused.
_code_files: dict[int, tuple] = {}


def user_line(depth: int = 2) -> str:
    """``file:line`` of the innermost user frame of the running stack, looked for from
    ``depth`` frames up (2: from the caller's caller), or ``""`` if none is.

    The same rule as ``innermost_user``, fast enough for every tensor op: each code object's
    file is judged (and made relative to the working directory) once, when first seen."""
    try:
        f = sys._getframe(depth)
    except ValueError:  # no Python frame up there
        return ""
    files = _code_files
    while f is not None:
        code = f.f_code
        entry = files.get(id(code))
        if entry is None:
            path = code.co_filename
            shown = short_path(path) if is_user_file(path) else ""
            entry = files[id(code)] = (code, shown, {})
        if entry[1]:
            lines = entry[2]
            at = f.f_lasti
            line = lines.get(at)
            if line is None:
                line = f"{entry[1]}:{f.f_lineno}"
                if len(lines) < 4096:
                    lines[at] = line
            return line
        f = f.f_back
    return ""
