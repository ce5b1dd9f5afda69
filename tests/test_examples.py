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
