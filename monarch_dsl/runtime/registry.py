"""Where persistent meshes are found: one private directory per user, one record per mesh.

``spawn_procs(name="exp", persistent=True)`` starts a keeper (runtime/forkserver.py in keeper
mode) that writes ``<dir>/exp.json``; ``md.attach("exp")``, ``monarch-dsl ls`` and
``monarch-dsl stop`` read it. The directory is ``$XDG_RUNTIME_DIR/monarch_dsl`` (else
``<tmp>/monarch_dsl-<uid>``), mode 0700 and owned by the user -- anything else is refused, not
repaired -- and a record is mode 0600: it holds the mesh's secret, the token its workers and
controllers authenticate with. So only the same user can attach. The keeper's socket
(``exp.sock``) and log of what workers printed while no controller was attached (``exp.log``)
live beside it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(
            f"a persistent mesh's name is 1-64 letters, digits, '_', '.' or '-' (not first), "
            f"got {name!r}"
        )
    return name


def root() -> Path:
    """The user's private directory of persistent meshes (made on first use)."""
    base = os.environ.get("XDG_RUNTIME_DIR", "")
    if base and os.path.isdir(base) and os.access(base, os.W_OK):
        path = Path(base) / "monarch_dsl"
    else:
        path = Path(tempfile.gettempdir()) / f"monarch_dsl-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} must be a directory owned by you with mode 0700 (it holds your persistent "
            f"meshes' secrets); it is not, so it is not used"
        )
    return path


@dataclass
class Record:
    """What ``md.attach`` needs to find a persistent mesh and join it."""

    name: str
    pid: int  # the keeper's
    socket: str  # the keeper's listening socket (attach)
    secret: str  # hex: the workers' and controllers' token
    dims: list[str]
    sizes: list[int]
    idle_timeout: float
    created: float
    hostname: str
    log: str  # what the workers print while no controller is attached
    controller: int = 0  # the pid of the controller attached now (0: none)
    since: float = 0.0  # when it attached, or the last one detached

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def paths(name: str) -> tuple[Path, Path, Path]:
    """(record, socket, log) of mesh ``name``."""
    d = root()
    return d / f"{name}.json", d / f"{name}.sock", d / f"{name}.log"


def write(record: Record) -> None:
    """Atomically, mode 0600."""
    path = paths(record.name)[0]
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(record), f)
    os.replace(tmp, path)


def read(name: str) -> Record | None:
    path = paths(check_name(name))[0]
    try:
        st = path.stat()
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not yours alone (mode 0600); refusing to use it")
    return Record(**data)


def remove(name: str) -> None:
    for p in paths(name):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def records() -> list[Record]:
    """Every persistent mesh recorded (a record whose keeper is gone is removed)."""
    out = []
    for path in sorted(root().glob("*.json")):
        try:
            rec = read(path.stem)
        except (ValueError, PermissionError, json.JSONDecodeError, TypeError):
            continue
        if rec is None:
            continue
        if not rec.alive():
            remove(rec.name)
            continue
        out.append(rec)
    return out
