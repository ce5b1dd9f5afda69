"""pm.sync_code / pm.sync_files (SPEC §8): edited modules reach running workers."""

import importlib
import os
import py_compile
import sys
import uuid

import pytest
import torch

import monarch_dsl as md

MODULE = """\
import torch

import monarch_dsl as md


class Greeter(md.Actor):
    def __init__(self):
        self.calls = 0

    @md.endpoint
    def hello(self):
        self.calls += 1
        return "{version}", self.calls


@md.remote(propagate=lambda: torch.zeros((), dtype=torch.int64))
def version():
    return torch.tensor({number})
"""


def write_module(path, version, extra="", keep_mtime=False):
    """Versions "v1", "v2", ... keep the file's size. ``keep_mtime``: and its mtime, as an edit
    within the second of the import looks -- a reload from the file would then run the stale
    bytecode in __pycache__ (see runtime/codesync.py)."""
    before = os.stat(path) if keep_mtime else None
    with open(path, "w") as f:
        f.write(MODULE.format(version=version, number=int(version[1:])) + extra)
    if before is not None:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.fixture
def pkg(tmp_path):
    """A package (unique name) on sys.path with one module, imported here; yields
    (module, its path). The workers are spawned after, so they can import it too."""
    name = f"csync_{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp_path / name)
    (tmp_path / name / "__init__.py").write_text("")
    path = str(tmp_path / name / "mod.py")
    write_module(path, "v1")
    # Its bytecode in __pycache__, as a Python without PYTHONDONTWRITEBYTECODE writes it.
    py_compile.compile(path, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(f"{name}.mod"), path
    finally:
        sys.path.remove(str(tmp_path))
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]


@pytest.fixture
def pm(pkg):
    mesh = md.this_host().spawn_procs({"gpu": 2})
    try:
        yield mesh
    finally:
        mesh.stop()


def remote_version(pm, mod):
    with pm.activate():
        t = mod.version()
    return [int(md.inspect(t, gpu=g)) for g in range(2)]


def test_an_edited_module_is_used_on_the_next_call(pkg, pm, tmp_path):
    mod, path = pkg
    greeter = pm.spawn("greeter", mod.Greeter)
    assert greeter.hello.call().get().values() == [("v1", 1), ("v1", 1)]
    assert remote_version(pm, mod) == [1, 1]
    first = pm.sync_code(tmp_path)  # the first sync sends every local module
    assert mod.__name__ in first.sent and mod.__name__ in first.reloaded
    assert greeter.hello.call().get().values() == [("v1", 2), ("v1", 2)]

    write_module(path, "v2", keep_mtime=True)
    report = pm.sync_code(tmp_path)
    assert report.sent == (mod.__name__,) and report.reloaded == (mod.__name__,)
    assert report.bytes == 2 * os.path.getsize(path) and report.workers == 2
    # The live actor runs the new class, with its state; so does a new one, and the remote
    # function (shipped by value from the controller's old module) runs the new definition.
    assert greeter.hello.call().get().values() == [("v2", 3), ("v2", 3)]
    assert pm.spawn("fresh", mod.Greeter).hello.call().get().values() == [("v2", 1)] * 2
    assert remote_version(pm, mod) == [2, 2]

    again = pm.sync_code(tmp_path)
    assert again.sent == () and again.bytes == 0
    assert "nothing changed" in str(again)


def test_a_syntax_error_is_reported_on_the_controller_and_old_code_keeps_running(pkg, pm, tmp_path):
    mod, path = pkg
    greeter = pm.spawn("greeter", mod.Greeter)
    pm.sync_code(tmp_path)
    write_module(path, "v2", extra="\ndef broken(:\n    pass\n")
    bad_line = MODULE.count("\n") + 2
    with pytest.raises(md.CodeSyncError, match=rf"{path}:{bad_line}: SyntaxError") as info:
        pm.sync_code(tmp_path)
    assert info.value.line == bad_line and "nothing was sent" in str(info.value)
    assert greeter.hello.call().get().values() == [("v1", 1), ("v1", 1)]
    assert remote_version(pm, mod) == [1, 1]

    write_module(path, "v3")  # fixed: the next sync sends it
    assert pm.sync_code(tmp_path).sent == (mod.__name__,)
    assert greeter.hello.call().get().values() == [("v3", 2), ("v3", 2)]


def test_a_module_that_raises_on_reload_is_rolled_back_on_the_workers(pkg, pm, tmp_path):
    mod, path = pkg
    greeter = pm.spawn("greeter", mod.Greeter)
    pm.sync_code(tmp_path)
    write_module(path, "v2", extra="\nraise RuntimeError('import-time boom')\n")
    with pytest.raises(md.CodeSyncError, match="import-time boom") as info:
        pm.sync_code(tmp_path)
    err = info.value
    assert err.module == mod.__name__ and sorted(err.ranks) == [0, 1]
    assert "rank 0" in str(err) and "old code" in str(err)
    assert f'File "{path}"' in err.remote_traceback
    assert greeter.hello.call().get().values() == [("v1", 1), ("v1", 1)]
    assert remote_version(pm, mod) == [1, 1]

    write_module(path, "v3")  # the failed version was not recorded as the workers' code
    assert pm.sync_code(tmp_path).reloaded == (mod.__name__,)
    assert greeter.hello.call().get().values() == [("v3", 2), ("v3", 2)]


def test_sync_code_rejects_bad_paths(pm, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        pm.sync_code(tmp_path / "missing")
    with pytest.raises(TypeError, match="must be paths"):
        pm.sync_code([3])


def test_sync_files_copies_only_what_changed(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(src / "sub" / "run.sh", 0o755)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the workers' cwd: a relative dst lands there
    pm = md.this_host().spawn_procs({"host": 2, "gpu": 2})  # one host name: one writer
    try:
        first = pm.sync_files(src, "dst")
        assert (first.files, first.total, first.hosts) == (2, 2, 1)
        assert first.bytes == len("alpha") + len("#!/bin/sh\necho hi\n")
        assert (work / "dst" / "a.txt").read_text() == "alpha"
        assert os.stat(work / "dst" / "sub" / "run.sh").st_mode & 0o777 == 0o755

        assert pm.sync_files(src, "dst").files == 0
        (src / "a.txt").write_text("alpha, edited")
        again = pm.sync_files(src, "dst")
        assert (again.files, again.bytes) == (1, len("alpha, edited"))
        assert (work / "dst" / "a.txt").read_text() == "alpha, edited"

        one = pm.sync_files(src / "a.txt", tmp_path / "elsewhere" / "b.txt")  # a single file
        assert one.files == 1 and (tmp_path / "elsewhere" / "b.txt").read_text() == "alpha, edited"
        assert sorted(os.listdir(work / "dst")) == ["a.txt", "sub"]  # no temporary files left

        with pytest.raises(FileNotFoundError, match="does not exist"):
            pm.sync_files(tmp_path / "missing", "dst")
    finally:
        pm.stop()


@md.remote(propagate=lambda name: torch.zeros((), dtype=torch.bool))
def _importable(name):
    import importlib.util

    return torch.tensor(importlib.util.find_spec(name) is not None)


def importable(pm, name):
    with pm.activate():
        t = _importable(name)
    return [bool(md.inspect(t, gpu=g)) for g in range(2)]


def test_a_worker_without_the_files_imports_the_synced_modules(tmp_path):
    """As on a remote host without the code: the package is not on the workers' sys.path.
    After a sync they import it from the bytes sent; tracebacks show its lines."""
    pm = md.this_host().spawn_procs({"gpu": 2})
    name = f"csync_{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp_path / name)
    (tmp_path / name / "__init__.py").write_text("")
    path = str(tmp_path / name / "mod.py")
    write_module(
        path,
        "v1",
        extra="\n\nclass Failing(md.Actor):\n    def __init__(self):\n"
        "        raise ValueError('failing on purpose')\n",
    )
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module(f"{name}.mod")
        assert importable(pm, name) == [False, False]
        report = pm.sync_code(tmp_path)
        assert report.sent == (name, mod.__name__) and report.reloaded == ()
        assert importable(pm, name) == [True, True]
        assert pm.spawn("greeter", mod.Greeter).hello.call().get().values() == [("v1", 1)] * 2
        with pytest.raises(md.ActorError) as info:
            pm.spawn("failing", mod.Failing)
        assert "raise ValueError('failing on purpose')" in info.value.remote_traceback
    finally:
        pm.stop()
        sys.path.remove(str(tmp_path))
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]
