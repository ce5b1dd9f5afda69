"""The README's demo and the tensor tutorial run as shipped."""

import os
import subprocess
import sys

import pytest
from conftest import TORCH_GLOO_EXIT_ABORT

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
    # The allocations that fail are over the CPU workers' memory budgets (a share of the
    # host's available memory): an error, with every worker alive for what follows.
    assert "failed as expected: RuntimeError: worker memory budget exceeded" in text
    # The same walkthrough on workers with the Python reference executor prints the same,
    # but for what depends on the memory available when each run spawned its mesh.
    python = run_example("tutorial.py", 300, MD_EXECUTOR="python")
    check_tutorial(python)
    assert _budget_free(python) == _budget_free(text)


def _budget_free(text: str) -> list[str]:
    """The tutorial's output without the lines that depend on the workers' memory budgets."""
    budget = ("failed as expected:", "largest batch that worked:")
    return [line for line in text.splitlines() if not line.startswith(budget)]


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


def test_ddp_train_gives_the_same_weights_four_ways():
    """examples/ddp_train.py: torch DDP under torchrun, the unchanged script on a mesh
    (monarch-dsl run --spmd), md.DistributedDataParallel and the compiled loop body end with
    the same weights; the first three print the same per-rank losses."""
    script = os.path.join(ROOT, "examples", "ddp_train.py")
    env = dict(os.environ, MONARCH_DSL_QUIET="1", OMP_NUM_THREADS="1")

    def run(*cmd):
        for attempt in range(2):
            out = subprocess.run(
                [sys.executable, *cmd], capture_output=True, text=True, timeout=180, env=env,
                cwd=ROOT,
            )  # fmt: skip
            # torch's gloo exit abort (conftest.TORCH_GLOO_EXIT_ABORT) is the peer's bug, not
            # a result. Plain torchrun (the peer itself): its output is complete, and it is
            # what is compared below (a missing line fails there). Our launcher (--spmd) must
            # report a rank that exits non-zero: run once more, and only for that abort. (CI
            # saw two aborts in a row of plain torchrun.)
            done = "weight checksum:" in out.stdout
            peer_exit_abort = done and TORCH_GLOO_EXIT_ABORT in out.stderr
            if peer_exit_abort and cmd[:2] == ("-m", "torch.distributed.run"):
                return out.stdout
            if out.returncode == 0 or attempt or not peer_exit_abort:
                break
        assert out.returncode == 0, out.stderr
        return out.stdout

    def line(text, prefix):
        return next(x.split(prefix, 1)[1] for x in text.splitlines() if prefix in x)

    torchrun = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script)
    spmd = run("-m", "monarch_dsl", "run", "--spmd", "-n", "2", script)
    eager = run(script, "--md")
    compiled = run(script, "--md", "--compiled")
    weights = {line(t, "weight checksum:") for t in (torchrun, spmd, eager, compiled)}
    assert len(weights) == 1, (torchrun, spmd, eager, compiled)
    losses = {line(t, "losses (rank 0):") for t in (torchrun, spmd, eager)}
    assert len(losses) == 1, (torchrun, spmd, eager)
