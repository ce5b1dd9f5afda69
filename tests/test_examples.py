"""The README's demo and the tensor tutorial run as shipped."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.procs


def run_example(name: str, timeout: float, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, MONARCH_DSL_QUIET="1", **env),
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_demo_runs():
    """``bash scripts/demo.sh``: the compiled dp x tp step, checked, run on 4 workers with the
    losses of one process; then the actors example."""
    text = run_example("demo.py", 180)
    assert "plan.check(): every collective is matched on all 4 ranks" in text
    assert "all_reduce  tp" in text and "all_reduce  dp    comms" in text
    assert "the compiled step on the mesh trains exactly like one process" in text
    assert "after broadcast: 116" in text
    assert "ActorError: actor Point(host=0, gpu=1) raised: ValueError" in text
    assert "still alive after the error: 116" in text


def test_tutorial_runs():
    text = run_example("tutorial.py", 300)
    check_tutorial(text)
    # The same walkthrough on workers with the Python reference executor prints the same.
    assert run_example("tutorial.py", 300, MD_EXECUTOR="python") == text


@pytest.mark.gpu
def test_tutorial_runs_unchanged_on_cuda():
    import torch

    if torch.cuda.device_count() < 4:
        pytest.skip("the tutorial's meshes have 4 ranks: one GPU each")
    check_tutorial(run_example("tutorial.py", 300, MD_DEVICE="cuda"))


def check_tutorial(text: str) -> None:
    assert "failed as expected" in text and "recovered: [2.0, 2.0]" in text
    assert "largest batch that worked:" in text and "None" not in text
    assert "reduce over gpu: 1.0" in text and "reduce over host: 1.0" in text
    assert "stack over everything: tensor([0, 1, 2, 3])" in text
    assert "renamed: dp=2,tp=2  split: pp=2,dp=2  slice: [1, 3]" in text
    assert "pipeline output at dp=1:" in text
    assert "ddp step matches single-process training: True" in text
