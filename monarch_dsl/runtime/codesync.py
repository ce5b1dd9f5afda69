"""Code sync: ``pm.sync_code()`` and ``pm.sync_files()`` (SPEC §8).

``sync_code(paths)`` finds the modules the controller has imported from files under ``paths``
(default: the directory of the ``__main__`` script, or the cwd in a REPL or notebook), leaving
out the standard library, site-packages and monarch_dsl itself. Each is identified by the
sha256 of its file's bytes. The controller remembers, per worker, the digest of every module
it synced there, and sends a worker only the modules whose digest it does not have. The first
sync of a mesh therefore sends every local module: what a worker loaded before it is of
unknown age (it may have imported the file before an edit). A module that does not compile is
reported with its ``file:line`` before anything is sent.

The worker loads a module from the bytes it received, never from its own file system:

- A remote worker may not have the file at all, or an old copy of it.
- A worker on the controller's host could re-read the file, but a reload from the file can run
  stale bytecode. The ``__pycache__`` check compares only the source's mtime, in whole
  seconds, and its size, so an edit that keeps the size within the second the module was
  imported goes unnoticed.

So each worker has a meta path finder, first on ``sys.meta_path``, that serves the synced
sources by module name: ``importlib.reload`` of a synced module, and a first import of one
the worker had not imported yet, both run the synced bytes. The finder keeps the controller's
path as ``__file__`` (tracebacks name the user's file) and puts the source in ``linecache``
(the lines show where that file is missing). Nothing is written to disk and no bytecode is
cached. After a sync, a worker keeps running the synced version of a module until the next
sync, even if the file on its disk changes.

Reloading is done in place (``importlib.reload`` keeps the module object), in reverse import
order (a module imported by another usually comes after it in ``sys.modules``, and is reloaded
first). Three things would otherwise keep running old code:

- Live actors: an instance keeps its class object. Each live actor whose class comes from a
  reloaded module gets the new class of the same qualname (``instance.__class__ = new``),
  with its state kept. The worker's endpoint cache (``Worker._methods``) is cleared.
- ``@md.remote`` functions: the controller ships the function by value (cloudpickle: the
  module's name is bound to the ``RemoteFunction``, not to the function, so pickle cannot
  refer to it by name), and the worker caches what it unpickled (``executor.functions``).
  The cache is cleared, and ``newest(fn)`` maps an unpickled function of a synced module to
  that module's current definition of the same qualname.
- Names bound by ``from m import f`` in a module that did not change keep the old ``f``.
  That is ``importlib.reload``'s rule, and it stays (edit or sync that module too).

If a reload raises on a worker (an error at import time), that worker puts every module of
this sync back as it was (namespace and finder entry), so its old code keeps running. The
controller then raises ``md.CodeSyncError`` naming the module and the ranks. Tensor work
already queued on a worker's streams when a sync arrives may run with either version.

``sync_files(src, dst)`` copies a file or a tree to ``dst`` on every host of the mesh (a
relative ``dst`` is relative to the workers' cwd). One worker per host name writes. The
controller first asks it which files are missing or differ (by sha256, so a ``dst`` that is
``src`` on a shared file system costs nothing), then sends only those. Files are written to a
temporary name and renamed into place.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.abc
import importlib.util
import linecache
import os
import sys
import sysconfig
import traceback
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from monarch_dsl.errors import CodeSyncError
from monarch_dsl.runtime.future import flush_before_blocking
from monarch_dsl.runtime.messages import (
    CodeSyncOutcome,
    ListStaleFiles,
    Reply,
    SyncCode,
    SyncedModule,
    WriteFiles,
)

if TYPE_CHECKING:
    from monarch_dsl.runtime.controller import Job

WRITE_BATCH_BYTES = 64 << 20  # sync_files sends at most this much file data per message
SKIP_DIRS = frozenset({"__pycache__", ".git"})


# =============================================================================== controller


@dataclass(frozen=True)
class CodeSync:
    """What ``pm.sync_code()`` did: the modules ``sent`` (to at least one worker), those
    ``reloaded`` (by at least one worker: the others had not imported them), the source
    ``bytes`` sent in all, and how many ``workers`` it covered."""

    sent: tuple[str, ...]
    reloaded: tuple[str, ...]
    bytes: int
    workers: int

    def __str__(self) -> str:
        if not self.sent:
            return f"code sync: nothing changed ({self.workers} workers up to date)"
        reloaded = ", ".join(self.reloaded) or "none (not imported there yet)"
        return (
            f"code sync: sent {len(self.sent)} module(s) ({self.bytes} bytes in all) to "
            f"{self.workers} workers; reloaded: {reloaded}"
        )


@dataclass(frozen=True)
class FileSync:
    """What ``pm.sync_files()`` did: ``files`` and ``bytes`` written (summed over hosts), of
    ``total`` files in ``src``, on ``hosts`` hosts."""

    files: int
    bytes: int
    total: int
    hosts: int

    def __str__(self) -> str:
        if not self.files:
            return f"file sync: nothing changed ({self.total} files on {self.hosts} host(s))"
        return (
            f"file sync: wrote {self.files} of {self.total} files ({self.bytes} bytes) on "
            f"{self.hosts} host(s)"
        )


def default_paths() -> list[str]:
    """The directory of the ``__main__`` script; the cwd in a REPL or a notebook."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if isinstance(main_file, str) and main_file.endswith(".py"):
        return [os.path.dirname(os.path.realpath(main_file))]
    return [os.getcwd()]


def resolve_paths(paths: str | os.PathLike | Iterable[str | os.PathLike] | None) -> list[str]:
    if paths is None:
        return default_paths()
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = []
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"sync_code paths must be paths (str or os.PathLike), got {p!r}")
        real = os.path.realpath(p)
        if not os.path.isdir(real):
            raise FileNotFoundError(f"sync_code: {os.fspath(p)!r} is not a directory")
        out.append(real)
    return out


@functools.cache
def _excluded_dirs() -> tuple[str, ...]:
    """Where modules never sync from: the interpreter's libraries and monarch_dsl itself."""
    dirs = {
        os.path.realpath(p)
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
    dirs.add(os.path.realpath(os.path.dirname(os.path.dirname(__file__))))  # monarch_dsl/
    return tuple(d + os.sep for d in dirs)


_realpaths: dict[str, str] = {}  # a module's __file__ -> its real path


def _realpath(file: str) -> str:
    """``os.path.realpath``, remembered: it costs an lstat per path component, and a
    controller with torch imported has about a thousand modules to look at per sync."""
    real = _realpaths.get(file)
    if real is None:
        real = _realpaths[file] = os.path.realpath(file)
    return real


def _under(path: str, dirs: Sequence[str]) -> bool:
    return any(path.startswith(d) for d in dirs)


def local_modules(roots: Sequence[str]) -> list[SyncedModule]:
    """The modules imported here from ``.py`` files under ``roots``, with their sources."""
    roots = tuple(r.rstrip(os.sep) + os.sep for r in roots)
    excluded = _excluded_dirs()
    found = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name in ("__main__", "__mp_main__") or not isinstance(file, str):
            continue
        if not file.endswith(".py"):
            continue
        path = _realpath(file)
        if not _under(path, roots) or _under(path, excluded):
            continue
        parts = path.split(os.sep)
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        try:
            with open(path, "rb") as f:
                source = f.read()
        except OSError:
            continue  # deleted since it was imported: nothing to send
        package = os.path.basename(path) == "__init__.py" and hasattr(module, "__path__")
        found.append(SyncedModule(name, file, source, hashlib.sha256(source).hexdigest(), package))
    return found


def check_compiles(module: SyncedModule) -> None:
    """Raise ``CodeSyncError`` (``file:line``) when ``module``'s source does not compile."""
    try:
        compile(module.source, module.path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        line = getattr(e, "lineno", None)
        where = f"{module.path}:{line}" if line else module.path
        text = (getattr(e, "text", None) or "").rstrip()
        shown = f"\n    {text.strip()}" if text else ""
        msg = getattr(e, "msg", None) or str(e)
        raise CodeSyncError(
            f"{where}: {type(e).__name__}: {msg} (module {module.name}){shown}\n"
            f"nothing was sent; the workers keep running the old code",
            path=module.path,
            line=line,
            module=module.name,
        ) from None


def sync_code(job: Job, ranks: Sequence[int], paths: Any, timeout: float) -> CodeSync:
    """``pm.sync_code``: send each worker of ``ranks`` the local modules it lacks, reload."""
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    roots = resolve_paths(paths)
    modules = local_modules(roots)
    known: dict[int, dict[str, str]] = job.extensions.setdefault("codesync", {})
    todo: dict[tuple[SyncedModule, ...], list[int]] = {}  # the modules to send -> ranks
    for r in ranks:
        have = known.get(r, {})
        mods = tuple(m for m in modules if have.get(m.name) != m.digest)
        if mods:
            todo.setdefault(mods, []).append(r)
    sent = {m.name: m for mods in todo for m in mods}
    for m in sent.values():
        check_compiles(m)
    if not sent:
        return CodeSync((), (), 0, len(ranks))
    job.check_alive(ranks)
    flush_before_blocking()  # tensor work already issued goes out before the sync
    futures = [
        (mods, group, job.request(group, lambda cid, mods=mods: SyncCode(cid, mods), list))
        for mods, group in todo.items()
    ]
    reloaded: set[str] = set()
    failed: dict[str, list[int]] = {}
    first_tb = ""
    total = 0
    for mods, group, fut in futures:
        outcomes: list[CodeSyncOutcome] = fut.get(timeout)
        size = sum(len(m.source) for m in mods)
        for r, outcome in zip(group, outcomes):
            total += size
            if outcome.failed:
                failed.setdefault(outcome.failed, []).append(r)
                first_tb = first_tb or outcome.traceback
                continue
            known.setdefault(r, {}).update((m.name, m.digest) for m in mods)
            reloaded.update(outcome.reloaded)
    if failed:
        module, bad = next(iter(failed.items()))
        last = first_tb.strip().splitlines()[-1] if first_tb.strip() else "an error"
        others = f" and {len(bad) - 1} other worker(s)" if len(bad) > 1 else ""
        raise CodeSyncError(
            f"reloading module {module} ({sent[module].path}) raised on worker "
            f"{job.describe(bad[0])}{others}: {last}\n"
            f"those workers rolled this sync back and keep running the old code",
            path=sent[module].path,
            module=module,
            ranks=bad,
            remote_traceback=first_tb,
        )
    order = [m.name for m in modules]
    return CodeSync(
        tuple(n for n in order if n in sent),
        tuple(n for n in order if n in reloaded),
        total,
        len(ranks),
    )


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _source_files(src: str, dst: str) -> tuple[str, dict[str, str]]:
    """The destination root and {path relative to it: local file} for ``src`` -> ``dst``."""
    if os.path.isfile(src):
        return os.path.dirname(dst) or ".", {os.path.basename(dst): src}
    files = {}
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            local = os.path.join(dirpath, name)
            if os.path.isfile(local):  # not a broken link, a socket, ...
                files[os.path.relpath(local, src)] = local
    return dst, files


def sync_files(
    job: Job, ranks: Sequence[int], src: str | os.PathLike, dst: str | os.PathLike, timeout: float
) -> FileSync:
    """``pm.sync_files``: copy ``src`` (a file or a directory tree) to ``dst`` on every host of
    ``ranks``, only the files that are missing or differ there."""
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    for what, p in (("src", src), ("dst", dst)):
        if not isinstance(p, (str, os.PathLike)) or not os.fspath(p):
            raise TypeError(f"sync_files {what} must be a non-empty path, got {p!r}")
    src, dst = os.path.abspath(src), os.fspath(dst)
    if not os.path.exists(src):
        raise FileNotFoundError(f"sync_files: {src!r} does not exist")
    root, files = _source_files(src, dst)
    digests = {rel: _sha256_file(local) for rel, local in files.items()}
    writers: dict[str, int] = {}  # host name -> the rank that writes there
    for r in ranks:
        hello = job.hellos.get(r)
        writers.setdefault(hello.hostname if hello else f"rank {r}", r)
    wranks = tuple(writers.values())
    flush_before_blocking()
    manifest = tuple(digests.items())
    stale: list[tuple[str, ...]] = job.request(
        wranks, lambda cid: ListStaleFiles(cid, root, manifest), list
    ).get(timeout)
    futures = []
    count = 0
    for r, rels in zip(wranks, stale):
        count += len(rels)
        batch: list[tuple[str, bytes, int]] = []
        size = 0
        for rel in rels:
            local = files[rel]
            with open(local, "rb") as f:
                data = f.read()
            batch.append((rel, data, os.stat(local).st_mode & 0o7777))
            size += len(data)
            if size >= WRITE_BATCH_BYTES:
                futures.append(_write(job, r, root, batch))
                batch, size = [], 0
        if batch:
            futures.append(_write(job, r, root, batch))
    written = sum(fut.get(timeout) for fut in futures)
    return FileSync(count, written, len(files), len(wranks))


def _write(job: Job, rank: int, root: str, batch: list) -> Any:
    files = tuple(batch)
    return job.request((rank,), lambda cid: WriteFiles(cid, root, files), lambda v: v[0])


# =============================================================================== worker


class _SourceLoader(importlib.abc.SourceLoader):
    """Loads one synced module from its bytes (no bytecode cache: ``path_stats`` is not
    implemented, so ``SourceLoader`` neither reads nor writes one)."""

    def __init__(self, module: SyncedModule):
        self.module = module

    def get_filename(self, fullname: str) -> str:
        return self.module.path

    def get_data(self, path: str) -> bytes:
        if path == self.module.path:
            return self.module.source
        with open(path, "rb") as f:  # something else next to it (package data)
            return f.read()

    def is_package(self, fullname: str) -> bool:
        return self.module.package


class _SyncedFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` once a worker synced code: the synced modules by name."""

    def __init__(self) -> None:
        self.modules: dict[str, SyncedModule] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        m = self.modules.get(fullname)
        if m is None:
            return None
        locations = [os.path.dirname(m.path)] if m.package else None
        return importlib.util.spec_from_file_location(
            fullname, m.path, loader=_SourceLoader(m), submodule_search_locations=locations
        )


_finder = _SyncedFinder()


def newest(obj: Any) -> Any:
    """``obj`` (a function unpickled by value), or -- if its module was synced here -- that
    module's current definition of the same qualname (for ``@md.remote`` functions: the
    function a ``RemoteFunction`` wraps)."""
    if not _finder.modules:
        return obj
    name = getattr(obj, "__module__", None)
    if name not in _finder.modules:
        return obj
    found = _lookup(sys.modules.get(name), getattr(obj, "__qualname__", ""))
    if found is not None and not isinstance(found, types.FunctionType):
        found = getattr(found, "__wrapped__", None)  # a RemoteFunction (functools.wraps)
    return found if callable(found) else obj


def _lookup(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        if obj is None or part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj


def apply_code(modules: Sequence[SyncedModule], actors: Iterable[Any]) -> CodeSyncOutcome:
    """On a worker: serve ``modules`` from now on and reload those imported here, all or
    nothing; then move live ``actors`` of reloaded classes to the new classes."""
    previous = {m.name: _finder.modules.get(m.name) for m in modules}
    if not sys.meta_path or sys.meta_path[0] is not _finder:
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        sys.meta_path.insert(0, _finder)
    for m in modules:
        _finder.modules[m.name] = m
        lines = m.source.decode("utf-8", "replace").splitlines(keepends=True)
        linecache.cache[m.path] = (len(m.source), None, lines, m.path)  # kept by checkcache
    importlib.invalidate_caches()
    names = {m.name for m in modules}
    order = [n for n in reversed(list(sys.modules)) if n in names]
    saved: dict[str, tuple[Any, dict]] = {}
    current = ""
    try:
        for current in order:
            module = sys.modules[current]
            saved[current] = (module, dict(module.__dict__))
            importlib.reload(module)
    except BaseException:  # noqa: BLE001 - reported to the controller, then rolled back
        tb = traceback.format_exc()
        for name, (module, namespace) in saved.items():
            module.__dict__.clear()
            module.__dict__.update(namespace)
            sys.modules[name] = module
        for name, prev in previous.items():
            if prev is None:
                _finder.modules.pop(name, None)
                linecache.cache.pop(_path_of(modules, name), None)
            else:
                _finder.modules[name] = prev
                lines = prev.source.decode("utf-8", "replace").splitlines(keepends=True)
                linecache.cache[prev.path] = (len(prev.source), None, lines, prev.path)
        return CodeSyncOutcome((), current, tb)
    _rebind(actors, set(order))
    return CodeSyncOutcome(tuple(order))


def _path_of(modules: Sequence[SyncedModule], name: str) -> str:
    return next(m.path for m in modules if m.name == name)


def _rebind(instances: Iterable[Any], reloaded: set[str]) -> None:
    """Give each instance of a class of a reloaded module the new class of that name."""
    for instance in instances:
        cls = type(instance)
        if cls.__module__ not in reloaded:
            continue
        new = _lookup(sys.modules.get(cls.__module__), cls.__qualname__)
        if isinstance(new, type) and new is not cls:
            try:
                instance.__class__ = new
            except TypeError as e:  # a different __slots__ layout, ...
                print(
                    f"monarch_dsl code sync: an actor of {cls.__qualname__} keeps its old "
                    f"class: {e}",
                    file=sys.stderr,
                    flush=True,
                )


def _safe_join(root: str, rel: str) -> str:
    if os.path.isabs(rel) or ".." in rel.split(os.sep):
        raise ValueError(f"sync_files: refusing a path outside the destination: {rel!r}")
    return os.path.join(root, rel)


def stale_files(root: str, entries: Sequence[tuple[str, str]]) -> tuple[str, ...]:
    """On a worker: the entries missing under ``root`` or whose content differs."""
    root = os.path.abspath(root)
    stale = []
    for rel, digest in entries:
        path = _safe_join(root, rel)
        try:
            same = os.path.isfile(path) and _sha256_file(path) == digest
        except OSError:
            same = False
        if not same:
            stale.append(rel)
    return tuple(stale)


def write_files(root: str, files: Sequence[tuple[str, bytes, int]]) -> int:
    """On a worker: write each file under ``root`` (a temporary name, then a rename)."""
    root = os.path.abspath(root)
    total = 0
    for rel, data, mode in files:
        path = _safe_join(root, rel)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.md-sync-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        total += len(data)
    return total


def worker_handlers(worker: Any) -> dict[type, Callable[[Any], None]]:
    """The handlers of this module's messages, for ``Worker.handlers``."""

    def answer(call_id: int, compute: Callable[[], Any]) -> None:
        try:
            value = compute()
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            worker.error(call_id, e)
            return
        worker.reply(Reply(call_id, worker.rank, value))

    def on_sync_code(msg: SyncCode) -> None:
        def run() -> CodeSyncOutcome:
            outcome = apply_code(msg.modules, [inst for inst, _ in worker.actors.values()])
            if not outcome.failed:
                worker._methods.clear()  # (class, name) -> endpoint: the classes changed
                executor = worker._executor
                if executor is not None:
                    executor.functions.clear()  # unpickled remote functions
            return outcome

        answer(msg.call_id, run)

    return {
        SyncCode: on_sync_code,
        ListStaleFiles: lambda msg: answer(msg.call_id, lambda: stale_files(msg.root, msg.entries)),
        WriteFiles: lambda msg: answer(msg.call_id, lambda: write_files(msg.root, msg.files)),
    }
