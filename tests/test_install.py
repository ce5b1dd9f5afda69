"""The front door: a non-editable ``pip install`` of a wheel built from this checkout, in a fresh
virtual environment, runs a compiled plan on workers in the C++ runtime; without a C++
compiler it says so, says how to fix it, and runs on the Python reference executor.

The fresh venv installs the wheel with pip (no editable finder, no checkout on sys.path); it
sees torch and the other dependencies through a ``.pth`` line to the directories they are
installed in, since installing torch again would take minutes. The C++ runtime is found in the
per-user cache under the key of the wheel's own sources: setup built it from the same sources,
so the wheel's first use loads it without compiling (which also shows the wheel ships exactly
those sources)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch
    import torch.nn.functional as F
    from torch import nn

    import monarch_dsl as md
    from monarch_dsl import _build

    venv = Path(sys.argv[1]).resolve()
    assert Path(md.__file__).resolve().is_relative_to(venv), md.__file__
    assert _build.SOURCES.resolve().is_relative_to(venv), _build.SOURCES
    assert sorted(p.name for p in _build.SOURCES.glob("*.cpp")), "no C++ sources shipped"

    @md.remote(propagate=lambda: torch.zeros((), dtype=torch.bool))
    def worker_runs_cpp():
        from monarch_dsl.runtime import worker

        runner = worker.current.executor().plan_runner
        return torch.tensor(runner is not None and runner.core is not None)

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        return step

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    local = make()
    want = [local(x, y).item() for x, y in batches]

    step = md.mesh_fn(data_parallel="dp")(make())
    pm = md.this_host().spawn_procs({"dp": 2})
    try:
        with pm.activate():
            got = [md.inspect(step(x, y)).item() for x, y in batches]
            cpp = bool(md.inspect(worker_runs_cpp()))
    finally:
        pm.stop()
    assert all(abs(a - b) < 1e-5 for a, b in zip(got, want)), (got, want)
    print(f"RESULT cpp={cpp} losses={[round(v, 5) for v in got]}")
    """
)


def _deps_path() -> list[str]:
    """The directories torch and the package's other dependencies are installed in."""
    dirs = []
    for name in ("torch", "numpy", "cloudpickle", "lark", "ninja", "setuptools"):
        module = importlib.import_module(name)
        d = str(Path(module.__file__).resolve().parent.parent)
        if d not in dirs:
            dirs.append(d)
    return dirs


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv with monarch_dsl installed from a wheel of this checkout."""
    tmp = tmp_path_factory.mktemp("install")
    wheels = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(CHECKOUT)],
        check=True, timeout=300, cwd=tmp,
    )  # fmt: skip
    (wheel,) = wheels.glob("monarch_dsl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"monarch_dsl/cpp/{p.name}" for p in (CHECKOUT / "monarch_dsl" / "cpp").iterdir()}
    assert shipped <= names, f"the wheel lacks {sorted(shipped - names)}"
    assert {"monarch_dsl/_core.pyi", "monarch_dsl/py.typed"} <= names

    env_dir = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "deps.pth").write_text("\n".join(_deps_path()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, timeout=300, cwd=tmp,
    )  # fmt: skip
    (tmp / "script.py").write_text(SCRIPT)
    return env_dir


def _run(venv: Path, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    full.update(env)
    return subprocess.run(
        [venv / "bin" / "python", venv.parent / "script.py", str(venv)],
        cwd=venv.parent, env=full, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.procs
def test_a_wheel_install_runs_compiled_plans_in_cpp(venv):
    r = _run(venv)
    assert r.returncode == 0, r.stderr
    assert "RESULT cpp=True" in r.stdout, r.stdout + r.stderr
    assert "building the C++ runtime" not in r.stderr, "the wheel's sources differ from setup's"
    assert "WARNING" not in r.stderr, r.stderr


@pytest.mark.procs
def test_without_a_compiler_it_says_how_to_fix_it_and_runs_python(venv, tmp_path):
    r = _run(venv, MONARCH_DSL_BUILD_DIR=str(tmp_path / "empty"), CXX="/nonexistent/c++")
    assert r.returncode == 0, r.stderr
    assert "RESULT cpp=False" in r.stdout, r.stdout + r.stderr
    assert "no C++ compiler ('/nonexistent/c++' is not on PATH)" in r.stderr, r.stderr
    assert "apt-get install g++" in r.stderr and "monarch-dsl build" in r.stderr
    assert "Python reference executor" in r.stderr
    # said once, by the controller, not once per worker
    assert r.stderr.count("the C++ runtime cannot be built") == 1, r.stderr
