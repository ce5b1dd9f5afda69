"""``monarch-dsl plan FILE:FN`` and ``monarch-dsl simulate FILE:FN``: a compiled step's plan
and its simulated call from the command line, without processes."""

from __future__ import annotations

import json

from monarch_dsl.__main__ import main

STEP = """
import torch
import torch.nn.functional as F
from torch import nn

import monarch_dsl as md

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


@md.mesh_fn(data_parallel="dp")
def step(x, y):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def plain(x, w):
    return (x @ w).sum()


if __name__ == "__main__":
    raise SystemExit("the file's main part must not run")
"""


def _file(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(STEP)
    return str(path)


def test_plan_prints_checks_and_summarizes(tmp_path, capsys):
    path = _file(tmp_path)
    assert main(["plan", f"{path}:step", "--mesh", "dp=2", "--arg", "f32[8,16]",
                 "--arg", "f32[8,16]"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("plan step(dp=2)") and "in %x: f32[8,16] {dp: S(0)}" in out
    assert "gradient bucket 1/1" in out and "train.py:" in out  # the summary's table


def test_a_plain_function_is_compiled_with_data_parallel(tmp_path, capsys):
    path = _file(tmp_path)
    args = ["plan", f"{path}:plain", "--mesh", "dp=2", "--data-parallel", "dp"]
    assert main([*args, "--arg", "f32[8,4]", "--arg", "f32[4,4]"]) == 0
    out = capsys.readouterr().out
    assert "in %x: f32[8,4] {dp: S(0)}" in out and "all_reduce" in out


def test_simulate_reports_and_writes_a_trace(tmp_path, capsys):
    path, trace, png = _file(tmp_path), tmp_path / "t.json", tmp_path / "t.png"
    assert main(["simulate", f"{path}:step", "--arg", "f32[8,16]", "--arg", "f32[8,16]",
                 "--profile", "h100", "--trace", str(trace), "--png", str(png),
                 "--width", "30"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "profile h100" in out and "exposed comm" in out and "peak memory rank 1" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    bars = [ln for ln in out.splitlines() if ln.startswith("rank ")]
    assert {b.split("|")[0].strip() for b in bars} >= {"rank 0 main", "rank 1 main"}
    assert all(len(b.split("|")[1]) == 30 for b in bars)
    assert png.read_bytes()[:4] == b"\x89PNG" and f"timeline: {png}" in out
    assert main(["simulate", f"{path}:step", "--arg", "f32[8,16]", "--width", "2"]) == 2
    assert "--width must be 8 or more" in capsys.readouterr().err


def test_bad_targets_and_types_are_refused_clearly(tmp_path, capsys):
    path = _file(tmp_path)
    assert main(["plan", f"{path}:nope", "--arg", "f32[8,16]"]) == 2
    assert "defines no 'nope'" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "missing.py") + ":step"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["plan", f"{path}:step", "--arg", "x8"]) == 2
    assert "expected a tensor type like f32[8,16]" in capsys.readouterr().err
    assert main(["simulate", f"{path}:step", "--arg", "f32[8,16]", "--arg", "f32[8,16]",
                 "--profile", "no-such-device"]) == 2  # fmt: skip
    assert "no-such-device" in capsys.readouterr().err
