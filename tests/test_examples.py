"""The README's demo runs as shipped."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.procs
def test_actors_example_runs():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "actors.py")],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, MONARCH_DSL_QUIET="1"),
    )
    assert out.returncode == 0, out.stderr
    assert "after broadcast: 116" in out.stdout
    assert "ActorError: actor Point(host=0, gpu=1) raised: ValueError" in out.stdout
    assert "still alive after the error: 116" in out.stdout


@pytest.mark.procs
def test_tutorial_runs():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "tutorial.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, MONARCH_DSL_QUIET="1"),
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "failed as expected" in text and "recovered: [2.0, 2.0]" in text
    assert "largest batch that worked:" in text and "None" not in text
    assert "reduce over gpu: 1.0" in text and "reduce over host: 1.0" in text
    assert "stack over everything: tensor([0, 1, 2, 3])" in text
    assert "renamed: dp=2,tp=2  split: pp=2,dp=2  slice: [1, 3]" in text
    assert "pipeline output at dp=1:" in text
    assert "ddp step matches single-process training: True" in text
