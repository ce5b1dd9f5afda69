"""``monarch-dsl calibrate`` (monarch_dsl/calibrate.py) and what the cost model does with a
calibrated profile (measured curves, links per group size, the "cpu-local" file)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import pid_alive, wait_until

import monarch_dsl as md
from monarch_dsl import calibrate, isa
from monarch_dsl.__main__ import main
from monarch_dsl.compiler.profile import BUILTIN, DeviceProfile, Link, calibrated_path, interpolate
from monarch_dsl.compiler.simulate import (
    BLOCK_KIND,
    compute_time,
    cpu_bound,
    processor_sharing,
    simulate_program,
    steady_step_time,
)
from monarch_dsl.isa import Slot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A made-up calibrated profile: rates rise with size, then level off.
MATMUL = ((1e3, 1e9), (1e6, 1e10), (1e9, 4e10))
BANDWIDTH = ((1e4, 2e10), (1e7, 5e10), (1e8, 1e10))


def _calibrated(**changes) -> DeviceProfile:
    links = {
        **BUILTIN["cpu-local"].links,
        "shm@2": Link(1e-5, 5e9),
        "shm@4": Link(3e-5, 2e9),
    }
    return dataclasses.replace(
        BUILTIN["cpu-local"],
        matmul_curve=MATMUL,
        bandwidth_curve=BANDWIDTH,
        plan_overhead=2e-4,
        links=links,
        elementwise=(("tanh", 3.5e-9), ("gelu", 2e-9)),
        notes="made up",
        **changes,
    )


def test_profile_json_round_trip_with_the_measured_fields(tmp_path):
    p = _calibrated()
    p.save(tmp_path / "p.json")
    loaded = DeviceProfile.load(tmp_path / "p.json")
    assert loaded == p
    assert loaded.matmul_curve == MATMUL and loaded.links["shm@4"] == Link(3e-5, 2e9)
    assert loaded.elementwise == (("tanh", 3.5e-9), ("gelu", 2e-9))
    # a file written before these fields existed still loads, with them empty
    old = BUILTIN["h100"].to_json()
    for key in ("matmul_curve", "bandwidth_curve", "plan_overhead", "controller_reduce"):
        del old[key]
    empty = dataclasses.replace(BUILTIN["h100"], controller_reduce=0.0)
    assert DeviceProfile.from_json(json.loads(json.dumps(old))) == empty
    with pytest.raises(ValueError, match="unknown device profile fields"):
        DeviceProfile.from_json({**old, "matmul_table": []})


def test_the_curve_is_interpolated_log_log_and_gives_monotone_times():
    # at the points: the points' rates; beyond the ends: the end's
    for x, rate in MATMUL:
        assert interpolate(MATMUL, x) == pytest.approx(rate)
    assert interpolate(MATMUL, 10) == 1e9 and interpolate(MATMUL, 1e12) == 4e10
    # half way in log between two points: their geometric mean
    assert interpolate(MATMUL, math.sqrt(1e3 * 1e6)) == pytest.approx(math.sqrt(1e9 * 1e10))
    p = _calibrated()
    flops = [10 ** (k / 8) for k in range(16, 80)]  # 1e2 .. 1e10
    times = [f / p.matmul_flops_per_second(f, "float32") for f in flops]
    assert all(a < b for a, b in zip(times, times[1:]))
    for (x0, r0), (x1, r1) in zip(MATMUL, MATMUL[1:]):
        for f in flops:
            if x0 < f < x1:
                assert min(r0, r1) <= p.matmul_flops_per_second(f, "float32") <= max(r0, r1)
                assert x0 / r0 < f / p.matmul_flops_per_second(f, "float32") < x1 / r1
    # other dtypes: the curve scaled by their peak over float32's
    half = p.peak_flops["float64"] / p.peak_flops["float32"]
    assert p.matmul_flops_per_second(1e6, "float64") == pytest.approx(1e10 * half)
    # memory-bound: the bandwidth curve at the bytes moved, or the one number without one
    assert p.bandwidth(1e7) == pytest.approx(5e10)
    assert BUILTIN["cpu-local"].bandwidth(1e7) == BUILTIN["cpu-local"].memory_bandwidth


def test_below_the_smallest_measured_size_a_gpu_profile_keeps_its_time(tmp_path):
    """``small_op_floor`` (a GPU's profile): a matmul smaller than the matmul curve's first
    point takes that point's time; without it (a CPU's) the first point's rate. Pointwise ops
    read the bandwidth curve alike in both (below its first point: the dispatch alone)."""
    (x0, r0), (b0, w0) = MATMUL[0], BANDWIDTH[0]
    ones = {"matmul": 1.0, "pointwise": 1.0, "reduction": 1.0, "other": 1.0}
    cpu = _calibrated(efficiency=ones, matmul_passes=0.0)  # (a roofline, as a GPU's)
    gpu = dataclasses.replace(cpu, small_op_floor=True)
    assert interpolate(MATMUL, x0 / 10, floor=True) == pytest.approx(r0 / 10)
    for flops in (x0 / 10, x0 / 1000):
        assert flops / gpu.matmul_flops_per_second(flops, "float32") == pytest.approx(x0 / r0)
        assert flops / cpu.matmul_flops_per_second(flops, "float32") == pytest.approx(flops / r0)
    for moved in (1.0, b0 / 10, b0, 1e9):
        assert gpu.bandwidth(moved) == cpu.bandwidth(moved)
    # at and above the first point both read the curve alike
    for flops in (x0, 1e5, 1e9, 1e12):
        assert gpu.matmul_flops_per_second(flops, "float32") == cpu.matmul_flops_per_second(
            flops, "float32"
        )
    # in the simulator: a tiny matmul costs the smallest measured one's time and the
    # dispatch; a tiny add, its bytes at the first point's bandwidth and the dispatch
    types = [((2, 2), "float32"), ((2, 2), "float32"), ((2, 2), "float32")]
    mm = isa.Compute(name="aten.mm.default", args=(Slot(0), Slot(1)), outs=(2,))
    assert compute_time(mm, types, gpu) == pytest.approx(x0 / r0 + gpu.dispatch_overhead)
    assert compute_time(mm, types, cpu) < compute_time(mm, types, gpu)
    add = isa.Compute(name="aten.add.Tensor", args=(Slot(0), Slot(1)), outs=(2,))
    assert compute_time(add, types, gpu) == compute_time(add, types, cpu)
    assert compute_time(add, types, gpu) == pytest.approx(48 / w0 + gpu.dispatch_overhead)
    gpu.save(tmp_path / "p.json")
    assert DeviceProfile.load(tmp_path / "p.json").small_op_floor
    # an eager matmul's host part: its launches (the smallest measured one) where it floors
    eager = cpu.dispatch_overhead + cpu.eager_op_overhead
    assert gpu.host_seconds(matmul=True) == pytest.approx(eager + x0 / r0)
    assert gpu.host_seconds(matmul=False) == cpu.host_seconds(matmul=True) == eager
    dataclasses.replace(gpu, async_device=True).save(tmp_path / "q.json")
    assert DeviceProfile.load(tmp_path / "q.json").async_device
    assert BUILTIN["h100"].async_device and BUILTIN["h200"].async_device
    assert not BUILTIN["cpu-local"].async_device
    # a profile saved before the field: a GPU calibration's (small_op_floor) is async
    for p, want in ((gpu, True), (cpu, False)):
        old = p.to_json()
        del old["async_device"]
        assert DeviceProfile.from_json(old).async_device is want


def test_matmul_shapes_are_read_off_the_grid_and_interpolated_between_sizes(tmp_path):
    # seconds per multiply-add: 4 ns at m=16, 1 ns at m=64 (any k, n); k, n at 64 and 256
    grid = tuple(
        (m, k, n, (4e-9 if m == 16 else 1e-9) * m * k * n)
        for m in (16, 64)
        for k in (64, 256)
        for n in (64, 256)
    )
    p = dataclasses.replace(_calibrated(), matmul_shapes=grid)
    f = "float32"
    assert p.matmul_seconds(16, 64, 256, f) == pytest.approx(4e-9 * 16 * 64 * 256)
    # m=32 is half way between 16 and 64 in log: 2 ns (the geometric mean of 4 and 1)
    assert p.matmul_seconds(32, 128, 128, f) == pytest.approx(2e-9 * 32 * 128 * 128)
    # beyond the grid: the nearest size's time per multiply-add, times the work
    assert p.matmul_seconds(8, 64, 64, f) == pytest.approx(4e-9 * 8 * 64 * 64)
    assert p.matmul_seconds(1024, 4096, 64, f) == pytest.approx(1e-9 * 1024 * 4096 * 64)
    # other dtypes: by their peak over float32's
    half = p.peak_flops["float32"] / p.peak_flops["bfloat16"]
    assert p.matmul_seconds(64, 64, 64, "bfloat16") == pytest.approx(1e-9 * 64**3 * half)
    # a 2-D matmul's compute time is the table's, plus the dispatch overhead
    types = [((16, 256), f), ((256, 64), f), ((16, 64), f)]
    mm = isa.Compute(name="aten.mm.default", args=(Slot(0), Slot(1)), outs=(2,))
    assert compute_time(mm, types, p) == pytest.approx(4e-9 * 16 * 256 * 64 + p.dispatch_overhead)
    p.save(tmp_path / "p.json")
    assert DeviceProfile.load(tmp_path / "p.json") == p
    assert _calibrated().matmul_seconds(64, 64, 64, f) is None  # no table: the curve's time
    with pytest.raises(ValueError, match="not a grid"):
        dataclasses.replace(p, matmul_shapes=grid[1:])


def test_compute_time_uses_the_measured_curves():
    p = _calibrated(efficiency={"matmul": 1.0, "pointwise": 1.0, "reduction": 1.0, "other": 1.0})
    f = "float32"
    types = [((64, 64), f), ((64, 64), f), ((64, 64), f)]
    mm = isa.Compute(name="aten.mm.default", args=(Slot(0), Slot(1)), outs=(2,))
    flops = 2 * 64**3
    assert compute_time(mm, types, p) == pytest.approx(
        flops / interpolate(MATMUL, flops) + p.dispatch_overhead
    )
    add = isa.Compute(name="aten.add.Tensor", args=(Slot(0), Slot(1)), outs=(2,))
    moved = 3 * 64 * 64 * 4
    assert compute_time(add, types, p) == pytest.approx(
        moved / interpolate(BANDWIDTH, moved) + p.dispatch_overhead
    )
    # a pointwise op whose arithmetic was measured: the longer of its bytes' and its elements'
    tanh = isa.Compute(name="aten.tanh.default", args=(Slot(0),), outs=(2,))
    moved = 2 * 64 * 64 * 4
    memory = moved / interpolate(BANDWIDTH, moved)
    assert memory < 64 * 64 * 3.5e-9  # (so the arithmetic sets it)
    assert compute_time(tanh, types, p) == pytest.approx(64 * 64 * 3.5e-9 + p.dispatch_overhead)
    tiny = dataclasses.replace(p, elementwise=(("tanh", 1e-15),))
    assert compute_time(tanh, types, tiny) == pytest.approx(memory + p.dispatch_overhead)
    relu = isa.Compute(name="aten.relu.default", args=(Slot(0),), outs=(2,))  # not measured
    assert compute_time(relu, types, p) == pytest.approx(memory + p.dispatch_overhead)


def test_a_link_per_group_size():
    p = _calibrated()
    assert p.link(False, 2) == Link(1e-5, 5e9)
    assert p.link(False, 4) == p.link(False, 8) == Link(3e-5, 2e9)  # the nearest measured
    assert p.link(False, 3) == Link(3e-5, 2e9)  # a tie: the larger
    assert p.link(False) == p.links["shm"]  # no size: the kind's own
    assert p.link(True, 4) == p.links["gloo"]  # none measured per size for gloo


def test_cpu_local_is_the_calibrated_file_when_there_is_one(tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_DSL_PROFILE_DIR", str(tmp_path / "profiles"))
    assert calibrated_path() == tmp_path / "profiles" / "cpu-local.json"
    assert DeviceProfile.get("cpu-local") is BUILTIN["cpu-local"]  # none yet
    assert "uncalibrated" in BUILTIN["cpu-local"].notes
    mine = _calibrated()
    assert calibrate.save(mine) == calibrated_path()
    assert DeviceProfile.get("cpu-local") == mine and DeviceProfile.get(None) == mine
    assert DeviceProfile.get("h100") is BUILTIN["h100"]
    # without the variable: XDG_CACHE_HOME, else ~/.cache
    monkeypatch.delenv("MONARCH_DSL_PROFILE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibrated_path() == tmp_path / "xdg" / "monarch_dsl" / "profiles" / "cpu-local.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    home = os.path.expanduser("~")
    assert str(calibrated_path()) == f"{home}/.cache/monarch_dsl/profiles/cpu-local.json"
    # a broken file is an error that names it
    monkeypatch.setenv("MONARCH_DSL_PROFILE_DIR", str(tmp_path / "profiles"))
    calibrated_path().write_text("{not json")
    with pytest.raises(ValueError, match="cpu-local.json: not a device profile"):
        DeviceProfile.get("cpu-local")


def test_fit_link_recovers_alpha_and_beta():
    truth = Link(latency=2e-5, bandwidth=3e9)
    points = [(2, b, truth.time(b, 2)) for b in (4e3, 6e4, 1e6, 8e6)]
    link, worst = calibrate.fit_link(points)
    assert link.latency == pytest.approx(2e-5) and link.bandwidth == pytest.approx(3e9)
    assert worst < 1e-9


@pytest.mark.parametrize(
    "ranks, message",
    [
        ("1", "--ranks: a collective needs at least 2 ranks, got 1"),
        ("x", "--ranks: expected comma-separated integers >= 2 (e.g. 2,4), got 'x'"),
        ("2,", "--ranks: expected comma-separated integers"),
    ],
)
def test_bad_ranks_are_refused_before_anything_starts(ranks, message, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("measured with bad arguments")

    monkeypatch.setattr(calibrate, "measure", never)
    assert main(["calibrate", "--ranks", ranks]) == 2
    assert message in capsys.readouterr().err


def test_bad_ranks_are_refused_from_python_too(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("measured with bad arguments")

    monkeypatch.setattr(calibrate, "measure", never)
    with pytest.raises(ValueError, match="ranks: a collective needs at least 2 ranks, got 1"):
        calibrate.run(ranks=(2, 1))
    with pytest.raises(TypeError, match="ranks: expected integers >= 2, got '2'"):
        calibrate.run(ranks=("2",))
    with pytest.raises(ValueError, match="at least one group size"):
        calibrate.run(ranks=())


def _descendants(pid: int) -> dict[int, int]:
    """The living descendants of ``pid``: pid -> depth (1: a child)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out: dict[int, int] = {}
    frontier = {pid: 0}
    while frontier:
        frontier = {p: frontier[q] + 1 for p, q in parent.items() if q in frontier}
        out.update(frontier)
    return out


@pytest.mark.parametrize("after", [0.0, 2.0], ids=["starting", "measuring"])
def test_a_worker_killed_during_calibration_is_an_error_naming_it_and_nothing_is_written(
    tmp_path, after
):
    """SIGKILL of a worker as the workers start, or ``after`` seconds later (a quick
    calibration measures for about 5 s more): the command says which rank died, writes
    nothing, and leaves no process behind."""
    out = tmp_path / "cpu.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "MONARCH_DSL_QUIET": "1"}
    cmd = [sys.executable, "-m", "monarch_dsl", "calibrate", "--quick", "--ranks", "2"]
    proc = subprocess.Popen(cmd + ["--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    seen: dict[int, int] = {}
    try:
        # the workers: the fork server's children (grandchildren of the command)
        wait_until(lambda: len([p for p, d in _descendants(proc.pid).items() if d == 2]) >= 2,
                   60, "the calibration's workers to start")  # fmt: skip
        seen = _descendants(proc.pid)
        victim = max(p for p, d in seen.items() if d == 2)
        time.sleep(after)  # (the moment of the fault, not a wait for anything)
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err
    assert "monarch-dsl calibrate:" in err and "rank" in err and f"pid {victim}" in err, err
    assert "nothing was written" in err and "Traceback" not in err, err
    assert not out.exists()
    wait_until(lambda: not any(pid_alive(p) for p in seen), 30, "the calibration's processes")


def test_a_quick_calibration_writes_a_profile_that_loads(tmp_path):
    out = tmp_path / "cpu.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "MONARCH_DSL_QUIET": "1"}
    cmd = [sys.executable, "-m", "monarch_dsl", "calibrate", "--quick", "--ranks", "2"]
    r = subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True, env=env,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    p = md.DeviceProfile.load(out)
    assert p.name == "cpu-local" and p.matmul_curve and p.bandwidth_curve
    rates = [
        p.memory_bandwidth,
        p.dispatch_overhead,
        p.controller_overhead,
        *p.peak_flops.values(),
        *(v for point in p.matmul_curve + p.bandwidth_curve for v in point),
        *(p.links[k].bandwidth for k in ("shm", "gloo", "shm@2", "gloo@2", "controller")),
    ]
    assert all(math.isfinite(v) and v > 0 for v in rates), rates
    latencies = [link.latency for link in p.links.values()]
    eager = [p.controller_reduce, p.controller_borrow, p.controller_backward]
    eager += [p.controller_switch, p.eager_op_overhead, p.collective_wait, p.replay_issue]
    assert p.controller_replayed > 0  # (the replayed programs were replayed, and measured)
    others = [p.plan_overhead, p.plan_issue, p.plan_issue_per_input, p.plan_issue_per_output]
    others += [*latencies, *eager]
    assert all(math.isfinite(v) and v >= 0 for v in others), others
    assert p.matmul_passes >= 1 and not p.links["shm"].overlap and p.links["gloo"].overlap
    # the quick grid of matmul shapes (2 x 2 x 2), every time measured and positive
    assert sorted(row[:3] for row in p.matmul_shapes) == sorted(
        itertools.product(*calibrate.QUICK.shapes)
    )
    assert all(math.isfinite(t) and t > 0 for *_, t in p.matmul_shapes), p.matmul_shapes
    # measured again with the operands in the cache: the same grid and sizes, every time
    # positive, and the cache the ranks share
    assert p.cache_bytes > 0 and p.has_warm
    assert [row[:3] for row in p.warm_matmul_shapes] == [row[:3] for row in p.matmul_shapes]
    assert all(math.isfinite(t) and t > 0 for *_, t in p.warm_matmul_shapes)
    # (never slower than from memory: a warm time above the cold one is the machine's drift)
    assert all(w[3] <= c[3] for w, c in zip(p.warm_matmul_shapes, p.matmul_shapes))
    assert [x for x, _ in p.warm_bandwidth_curve] == [x for x, _ in p.bandwidth_curve]
    assert all(math.isfinite(r) and r > 0 for _, r in p.warm_bandwidth_curve)
    assert "operands in the cache" in r.stdout
    assert [op for op, _ in p.elementwise] == list(calibrate.QUICK.elementwise)
    assert all(math.isfinite(t) and t > 0 for _, t in p.elementwise), p.elementwise
    assert p.links["shm"] == p.links["shm@2"]
    # every kind measured beside the fitted all-reduces has its factor, on both backends (a
    # bucket's all-reduce in a block of shared memory: on shared memory only)
    for key, block in (("shm@2", {BLOCK_KIND}), ("gloo@2", set())):
        factors = dict(p.links[key].factors)
        assert set(factors) == {"all_gather", "reduce_scatter", "send", *block}, (key, factors)
        assert all(math.isfinite(f) and f > 0 for c in factors.values() for _, f in c), factors
    sections = ("matmul, float32", "memory-bound ops", "dispatch, per op", "links:", "shm  ")
    more = ("a reduce (controller_reduce)", "per eager op beyond", "(controller_replayed)")
    for section in (*sections, *more):
        assert section in r.stdout, section
    assert f"wrote {out}" in r.stdout
    if calibrate.steal_seconds() is not None:  # (Linux) the host's share, said
        assert "(steal)" in r.stdout and "in a measurement kept" in r.stdout
    # the profile simulates a compiled step
    report = _one_linear_plan().simulate(profile=str(out))
    assert report.step_time > 0 and report.profile == "cpu-local"


def _steal_by_attempt(monkeypatch, jumps):
    """Fake ``steal_seconds``: the host takes ``jumps[k]`` seconds during attempt k."""
    stolen = [0.0]
    attempts = []

    def measure(tag):
        stolen[0] += jumps[len(attempts)]
        attempts.append(tag)
        return len(attempts)

    monkeypatch.setattr(calibrate, "steal_seconds", lambda: [stolen[0], 0.0])
    return measure, attempts


def test_a_measurement_the_host_took_cpu_from_is_taken_again_and_the_least_stolen_kept(
    monkeypatch,
):
    measure, attempts = _steal_by_attempt(monkeypatch, [1000.0, 500.0, 0.0, 0.0])
    kept: list[float] = []
    assert calibrate.unstolen(measure, "x", stolen=kept) == 3  # the first quiet one
    assert attempts == ["x"] * 3 and kept == [0.0]
    measure, attempts = _steal_by_attempt(monkeypatch, [1e3, 1.0, 1e3, 1e3, 0.0])
    kept = []
    assert calibrate.unstolen(measure, "y", retries=3, stolen=kept) == 2  # never quiet
    assert len(attempts) == 4 and kept[0] > calibrate.STEAL_MAX
    # one still stolen after its retries is taken once more at the end, the less stolen kept
    measure, attempts = _steal_by_attempt(monkeypatch, [1.0] + [1e4] * 3 + [0.0, 1.0] + [1e4] * 7)
    shares: list[float] = []
    takes = calibrate._Takes(shares)
    stored: list[int] = []
    takes.take(stored.append, measure, "z")
    assert stored == [1] and len(takes.later) == 1 and shares == []
    takes.again()
    assert stored == [1, 5] and shares == [0.0] and not takes.later
    takes.take(stored.append, measure, "w")  # (the least stolen: the first, kept by again)
    takes.again()
    assert stored == [1, 5, 6] and shares[1] > calibrate.STEAL_MAX
    # a single clock tick stolen from a short measurement is not a reason to take it again
    tick = 1 / os.sysconf("SC_CLK_TCK")
    measure, attempts = _steal_by_attempt(monkeypatch, [tick, 0.0])
    kept = []
    assert calibrate.unstolen(measure, "t", stolen=kept) == 1 and kept[0] > calibrate.STEAL_MAX
    monkeypatch.setattr(calibrate, "steal_seconds", lambda: None)  # no steal to read
    calls = []
    assert calibrate.unstolen(lambda: calls.append(1) or "once") == "once" and calls == [1]


def test_steal_is_read_per_cpu():
    per_cpu = calibrate.steal_seconds()
    if per_cpu is None:
        pytest.skip("no /proc/stat here")
    assert len(per_cpu) == len(calibrate._cpu_lines()) - 1 and all(x >= 0 for x in per_cpu)


def _one_linear_plan(model=None, width=8):
    """A data-parallel SGD step of ``model`` (default: one Linear) compiled for dp=2."""
    import torch

    model = model if model is not None else torch.nn.Linear(width, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @md.mesh_fn(data_parallel="dp")
    def step(x):
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        opt.step()
        return loss

    return step.compile(torch.randn(4, width), mesh=md.Mesh.from_string("dp=2"))


def test_a_link_with_beta_by_size_round_trips_and_interpolates(tmp_path):
    link = Link(1e-6, 5e9, overlap=False, curve=((1e5, 8e9), (1e7, 4e9)),
                factors=(("all_gather", ((1e5, 1.5), (1e7, 6.0))),))  # fmt: skip
    assert link.time(1e5, 2) == pytest.approx(2e-6 + 1e5 / 8e9)
    assert link.time(1e6, 2) == pytest.approx(2e-6 + 1e6 / math.sqrt(8e9 * 4e9))
    assert link.time(1e5, 2, "all_gather") == pytest.approx(1.5 * (2e-6 + 1e5 / 8e9))
    # the factor by size: log-log between the measured sizes
    assert link.time(1e6, 2, "all_gather") == pytest.approx(3.0 * link.time(1e6, 2))
    assert link.time(1e5, 2, "send") == link.time(1e5, 2)  # (a kind not listed: 1)
    p = _calibrated()
    p = dataclasses.replace(p, links={**p.links, "shm": link})
    p.save(tmp_path / "p.json")
    assert DeviceProfile.load(tmp_path / "p.json").links["shm"] == link


def test_fit_matmul_recovers_the_curve_and_the_passes():
    """Times made by the model itself (a rate that levels off, inputs crossing memory 3 times,
    outputs 5 times) give back that rate, 3 passes and 5 output passes."""
    memory = DeviceProfile("m", {}, 1.0, {}, 0.0, {}, bandwidth_curve=BANDWIDTH)
    truth = dataclasses.replace(
        memory, matmul_curve=((2.0 * 64**3, 2e10), (2.0 * 1024**3, 8e10)), matmul_passes=3.0,
        matmul_output_passes=5.0,
    )  # fmt: skip
    truth = dataclasses.replace(truth, peak_flops={"float32": 8e10})

    def seconds(m: int, k: int, n: int) -> float:
        flops = 2.0 * m * k * n
        memory_time = truth.matmul_memory_seconds(4.0 * (m * k + k * n), 4.0 * m * n, 1.0)
        return flops / truth.matmul_flops_per_second(flops, "float32") + memory_time

    square = {n: seconds(n, n, n) for n in (64, 256, 1024)}
    thin = {n: seconds(n // 32, n, n) for n in (512, 1024)}
    wide = {n: seconds(n, n // 32, n) for n in (512, 1024)}
    curve, passes, out_passes = calibrate.fit_matmul(square, thin, 0.0, memory, wide)
    assert passes == pytest.approx(3.0, rel=1e-2)
    assert out_passes == pytest.approx(5.0, rel=1e-2)
    for x, rate in curve:
        assert rate == pytest.approx(truth.matmul_flops_per_second(x, "float32"), rel=1e-3)


def test_a_shared_memory_bucket_holds_the_main_stream():
    """On a link that runs in the issuing thread (shm), a comms-stream all-reduce does not
    overlap the compute after it; on one that does (gloo's threads), it does."""
    f = "float32"
    steps = (
        isa.AllReduce(args=(Slot(0),), outs=(1,), dims=(0,), shapes=((256, 256),), stream="comms"),
        isa.Compute(name="aten.mm.default", args=(Slot(2), Slot(2)), outs=(3,)),
        isa.Compute(name="aten.add.Tensor", args=(Slot(1), Slot(3)), outs=(4,)),
    )
    program = isa.Program("b", ("dp",), (2,), steps, 5, (0, 2), (4,), ((256, 256),) * 2, (f, f))
    types = [((256, 256), f)] * 5
    ends = {}
    for overlap in (False, True):
        links = {**BUILTIN["cpu-local"].links, "shm": Link(1e-5, 1e8, overlap=overlap)}
        p = dataclasses.replace(BUILTIN["cpu-local"], links=links)
        report = simulate_program(program, types, p)
        comm = next(e for e in report.events if e.kind == "comm" and e.rank == 0)
        mm = next(e for e in report.events if e.name == "aten.mm.default" and e.rank == 0)
        assert (mm.start >= comm.end) == (not overlap)
        ends[overlap] = report.step_time
    assert ends[False] > ends[True]


def test_steady_step_time_is_the_slower_of_controller_and_ranks_or_their_cpu():
    p = dataclasses.replace(
        BUILTIN["cpu-local"],
        plan_overhead=1e-4,
        plan_issue=2e-4,
        plan_issue_per_input=1e-5,
        links={**BUILTIN["cpu-local"].links, "controller": Link(1e-5, 1e9)},
    )
    # the controller: 2e-4 + 10 inputs * 1e-5 + a local argument (1e-5 + 2 x 1e6 B / 1e9)
    assert steady_step_time(1e-3, p, 10, (), ranks=2) == pytest.approx(1e-3 + 1e-4)
    assert steady_step_time(0.0, p, 10, (10**6,), ranks=2) == pytest.approx(3e-4 + 1e-5 + 2e-3)
    # a rank: its steps, plan_overhead and taking the local argument in (1e6 B / 1e9)
    assert steady_step_time(5e-3, p, 10, (10**6,), ranks=2) == pytest.approx(5e-3 + 1e-4 + 1e-3)
    shared = dataclasses.replace(p, host_cores=2)  # 3 processes on 2 cores: CPU sets the pace
    assert steady_step_time(1e-3, shared, 10, (), ranks=2) == pytest.approx((3e-4 + 2 * 1.1e-3) / 2)
    # each result the plan returns (a handle, deleted when the next call replaces it)
    per_result = dataclasses.replace(p, plan_issue_per_output=5e-5)
    assert steady_step_time(0.0, per_result, 10, (), ranks=2, outputs=4) == pytest.approx(5e-4)


def test_a_compute_measurement_cycles_its_results_through_as_many_buffers_as_inputs():
    """Each result lives until ``sets`` steps later (a step's gradients each have their own
    buffer, gone from the caches by the next pass); the inputs cycle the same way."""
    program = calibrate._program("aten.mm.default", (Slot(0), Slot(1)), 2, 3, 8)
    assert program.inputs == tuple(range(6))
    assert [s.args for s in program.steps[:4]] == [
        (Slot(0), Slot(1)), (Slot(2), Slot(3)), (Slot(4), Slot(5)), (Slot(0), Slot(1)),
    ]  # fmt: skip
    assert [s.outs for s in program.steps] == [(6 + j,) for j in range(8)]
    assert [s.frees for s in program.steps] == [(), (), ()] + [(6 + j,) for j in range(5)]


def test_call_costs_fit_inputs_results_local_arguments_and_a_steps_dispatch_in_a_plan():
    """``_call_costs`` on made-up measurements: each term is the difference it was given,
    against the median of the cases the controller issues alike."""
    loop = dataclasses.replace(BUILTIN["cpu-local"], dispatch_overhead=2e-6)

    def case(cpu: float, in_steps: float = 1e-3) -> tuple:
        return (None, 1.5e-3, cpu, 1e-4, in_steps)

    small, large = calibrate.LOCAL_ARG_BYTES
    more = calibrate.MORE
    calls = {
        "base": case(2.5e-4),  # (an outlier: the median of the 3 cases issued alike counts)
        "double": case(2e-4, 2e-3),
        f"+{more} inputs": case(2e-4 + more * 5e-6),
        f"+{more} results": case(2e-4 + more * 1e-5),
        # (sent by parts: each rank its row, the bytes of z in all)
        f"local {calibrate._size(small)}": case(2e-4 + 1e-5 + small / 1e9),
        f"local {calibrate._size(large)}": case(2e-4 + 1e-5 + large / 1e9),
        "plan steps": case(2e-4, calibrate.PLAN_STEPS * 4.5e-6),
    }
    p = calibrate._call_costs(loop, calls, 2)
    assert p.plan_issue_per_input == pytest.approx(5e-6)
    assert p.plan_issue_per_output == pytest.approx(1e-5)
    assert p.plan_issue == pytest.approx(2e-4 - 3 * 5e-6 - 1e-5)
    assert p.links["controller"].latency == pytest.approx(1e-5, rel=1e-3)
    assert p.links["controller"].bandwidth == pytest.approx(1e9, rel=1e-3)
    assert p.dispatch_overhead == pytest.approx(4.5e-6)  # a step in a plan, not in a loop
    # (CPU and GPU workers alike: on a GPU the step's CPU is its launch); where the steps' CPU
    # was not measured (no probe), the loop's dispatch stays
    unmeasured = {**calls, "plan steps": case(2e-4, 0.0)}
    assert calibrate._call_costs(loop, unmeasured, 2).dispatch_overhead == 2e-6


def test_cpu_bound_counts_the_controller_and_the_ranks_only_where_cores_are_short():
    p = dataclasses.replace(BUILTIN["cpu-local"], host_cores=2)
    # 3 processes on 2 cores, shared fairly: 2/3 of a core each until the controller's 1 s is
    # done (1.5 s), then a core each for the ranks' last 1 and 2 s: 3.5 s (not the sum / 2)
    assert cpu_bound(1.0, [2.0, 3.0], p) == pytest.approx(3.5)
    assert cpu_bound(2.0, [2.0, 2.0], p) == pytest.approx(3.0)  # alike: their sum over the cores
    assert processor_sharing([1.2, 1.2, 2.0], 2) == pytest.approx(1.8 + 0.8)
    assert processor_sharing([1.0, 5.0], 4) == pytest.approx(5.0)  # (a core each)
    assert cpu_bound(1.0, [2.0], p) == 0.0  # a core each
    assert cpu_bound(1.0, [2.0, 3.0], dataclasses.replace(p, host_cores=0)) == 0.0  # unknown


# ---- --device cuda: "cuda-local", one GPU worker ---------------------------------------------


def test_fit_collective_wait_recovers_the_wait_from_the_workers_cpu():
    """The workers' CPU per repetition of the wait program, made of the simulator's busy time
    plus 0.7 x its window work, gives collective_wait 0.7; no more than the busy time, 0."""
    p = dataclasses.replace(BUILTIN["cpu-local"], host_cores=2, controller_overhead=2e-6)
    sim = md.Simulator(hosts=1, gpus=2, profile=p)
    n = 6
    with sim.mesh.activate():
        state = calibrate._eager_setup(calibrate.WAIT, sim.mesh)
        md.inspect(calibrate._eager_body(calibrate.WAIT, state, "gpu", 2))
        job = sim.job.sim
        busy0, window0 = job.busy()[0], job.window_work[0]
        md.inspect(calibrate._eager_body(calibrate.WAIT, state, "gpu", n))
        busy = (job.busy()[0] - busy0) / n
        window = (job.window_work[0] - window0) / n
    assert window > 0.5 * busy  # (the ops before each reduce, issued within the window)
    assert calibrate.fit_collective_wait(p, 2, busy + 0.7 * window, 4) == pytest.approx(0.7)
    assert calibrate.fit_collective_wait(p, 2, 0.5 * busy, 4) == 0.0


def test_cuda_local_is_an_error_naming_the_command_until_calibrated(tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_DSL_PROFILE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="`monarch-dsl calibrate --device cuda`.*not run here"):
        DeviceProfile.get("cuda-local")
    mine = dataclasses.replace(BUILTIN["h200"], name="cuda-local", dispatch_overhead=7e-6)
    assert calibrate.save(mine) == tmp_path / "cuda-local.json"  # (by the profile's name)
    assert DeviceProfile.get("cuda-local") == mine
    assert DeviceProfile.get("cpu-local") is BUILTIN["cpu-local"]  # the other stays as it was
    (tmp_path / "cuda-local.json").write_text("[]")
    with pytest.raises(ValueError, match="run `monarch-dsl calibrate --device cuda` again"):
        DeviceProfile.get("cuda-local")
    with pytest.raises(ValueError, match="no calibrated profile is called 'tpu-local'"):
        calibrated_path("tpu-local")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "cuda", "--ranks", "2"], "collectives are not measured with --device cuda"),
        (["--device", "cuda"], "torch sees no CUDA GPU here"),
    ],
)
def test_bad_device_arguments_are_refused_before_anything_starts(
    args, message, monkeypatch, capsys
):
    def never(*args, **kwargs):
        raise AssertionError("measured with bad arguments")

    monkeypatch.setattr(calibrate, "measure", never)
    monkeypatch.setattr(calibrate.torch.cuda, "is_available", lambda: "--ranks" in args)
    assert main(["calibrate", *args]) == 2
    assert message in capsys.readouterr().err


def test_gpu_bases_by_name():
    assert calibrate.gpu_base("NVIDIA H200") is BUILTIN["h200"]
    assert calibrate.gpu_base("NVIDIA H100 80GB HBM3") is BUILTIN["h100"]
    assert calibrate.gpu_base("NVIDIA A100-SXM4-80GB") is BUILTIN["h100"]


def test_the_one_gpu_calibration_runs_on_one_cpu_worker():
    """What ``--device cuda`` runs (one worker: compute at its sizes, the overheads, no
    collectives; the roofline profile on the GPU's built-in links), on a CPU worker here."""
    s = dataclasses.replace(
        calibrate.CUDA_QUICK,
        matmul=(32, 128),
        thin=(256,),
        pointwise=(1 << 12, 1 << 16),
        dtype_size=128,
        dtypes=True,
    )
    cal = calibrate._measure(s, (1,), {"MD_DEVICE": "cpu"}, False, True)
    p = cal.profile
    assert p.name == "cuda-local" and cal.device == "cuda" and not cal.comm
    assert p.matmul_passes == 0 and p.host_cores == 0 and p.small_op_floor and p.async_device
    assert set(cal.matmul) == {32, 128} and set(cal.dtypes) == {"float64", "bfloat16", "float16"}
    assert len(p.matmul_curve) >= 1 and len(p.bandwidth_curve) >= 1
    positive = [p.dispatch_overhead, p.memory_bandwidth, *p.peak_flops.values()]
    positive += [p.controller_overhead, p.eager_op_overhead]
    assert all(math.isfinite(v) and v > 0 for v in positive), positive
    for kind in ("nccl_intra", "inter_host"):  # not measured: the base GPU's
        assert p.links[kind] == BUILTIN["h100"].links[kind]
    assert "controller" in p.links  # (a local argument's sending was measured)
    text = calibrate.table(cal)
    assert "links: not measured" in text and "n = 128   bfloat16" in text
    assert _one_linear_plan().simulate(profile=p).step_time > 0


@pytest.mark.gpu
def test_a_quick_gpu_calibration_writes_cuda_local(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "MONARCH_DSL_QUIET": "1"}
    env["MONARCH_DSL_PROFILE_DIR"] = str(tmp_path)
    cmd = [sys.executable, "-m", "monarch_dsl", "calibrate", "--quick", "--device", "cuda"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"wrote {tmp_path / 'cuda-local.json'}" in r.stdout
    p = md.DeviceProfile.load(tmp_path / "cuda-local.json")
    # a GPU, not a CPU: float32 matmuls past 1 TFLOP/s, memory past 100 GB/s
    assert p.peak_flops["float32"] > 1e12 and p.memory_bandwidth > 1e11, r.stdout
    assert 0 < p.dispatch_overhead < 1e-3 and p.memory_capacity > 1e9


def test_the_simulator_times_each_collective_kind_by_its_link_factor():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    plan = _one_linear_plan(md.fully_shard(model), width=64)
    base = BUILTIN["cpu-local"]

    def comm_seconds(factors):
        link = dataclasses.replace(base.links["shm"], factors=factors)
        p = dataclasses.replace(base, links={**base.links, "shm": link, "shm@2": link})
        by_kind: dict[str, float] = {}
        for e in plan.simulate(profile=p).events:
            if e.kind == "comm" and e.rank == 0:
                by_kind[e.name] = by_kind.get(e.name, 0.0) + e.end - e.start
        return by_kind

    plain = comm_seconds(())
    scaled = comm_seconds((("all_gather", ((1.0, 3.0),)), ("reduce_scatter", ((1.0, 0.5),))))
    assert plain["all_gather"] > 0 and plain["reduce_scatter"] > 0
    assert scaled["all_gather"] == pytest.approx(3.0 * plain["all_gather"])
    assert scaled["reduce_scatter"] == pytest.approx(0.5 * plain["reduce_scatter"])
    assert scaled["all_reduce"] == pytest.approx(plain["all_reduce"])  # (the loss's)


# ---- the cache: operands still in it run at the warm rates -------------------------------------


def _warm_profile(cache_bytes: int) -> DeviceProfile:
    """``_calibrated()`` with a matmul grid, and warm tables: the grid 2x and the bandwidth 4x
    faster with the operands in a cache of ``cache_bytes``."""
    grid = tuple((m, k, n, 1e-9 * m * k * n) for m in (8, 64) for k in (8, 64) for n in (8, 64))
    return _calibrated(
        matmul_shapes=grid,
        cache_bytes=cache_bytes,
        warm_matmul_shapes=tuple((m, k, n, t / 2) for m, k, n, t in grid),
        warm_bandwidth_curve=tuple((x, 4 * r) for x, r in BANDWIDTH),
    )


def test_the_warm_tables_round_trip_and_replace_the_cold_ones():
    p = _warm_profile(1 << 20)
    loaded = DeviceProfile.from_json(json.loads(json.dumps(p.to_json())))
    assert loaded == p and loaded.has_warm
    hot = p.warm()
    assert hot.matmul_seconds(8, 8, 8, "float32") == pytest.approx(
        p.matmul_seconds(8, 8, 8, "float32") / 2
    )
    assert hot.bandwidth(1e7) == pytest.approx(4 * p.bandwidth(1e7)) and not hot.has_warm
    assert not dataclasses.replace(p, cache_bytes=0).has_warm and not BUILTIN["h100"].has_warm
    with pytest.raises(ValueError, match="not a grid"):
        dataclasses.replace(p, warm_matmul_shapes=p.warm_matmul_shapes[1:])


def test_warm_fraction_is_one_within_a_quarter_of_the_cache_and_zero_beyond_it():
    from monarch_dsl.compiler.simulate import warm_fraction

    assert warm_fraction(0, 1 << 20) == 1.0 and warm_fraction(1 << 18, 1 << 20) == 1.0
    assert warm_fraction(1 << 20, 1 << 20) == 0.0 and warm_fraction(math.inf, 1 << 20) == 0.0
    assert warm_fraction(1 << 19, 1 << 20) == pytest.approx(0.5)  # (log-linear between)


def test_a_step_whose_data_fits_the_cache_runs_at_the_warm_rates_and_one_larger_at_the_cold():
    plan = _one_linear_plan(torch_mlp(4, 16), width=16)
    program, types = _lowered(plan)
    ranks = [(0,), (1,)]
    hosts = {c: 0 for c in ranks}
    from monarch_dsl.compiler.simulate import warm_fractions

    # the whole step's data (a few KiB a rank) in a quarter of each rank's half of 1 MiB:
    # every step warm, the parameters too (last touched by the last call's update: the
    # reuse is counted in a steady state of calls, not from a cold start)
    warm = warm_fractions(program, types, _warm_profile(1 << 20), ranks, hosts)
    assert set(warm) == set(ranks) and warm[(0,)]
    assert all(f == 1.0 for f in warm[(0,)].values()), warm[(0,)]
    fast = plan.simulate(profile=_warm_profile(1 << 20)).step_time
    hot = plan.simulate(profile=_warm_profile(1 << 20).warm()).step_time
    assert fast == pytest.approx(hot, rel=1e-4)  # (a local shard's copy: not a compute step)
    # a cache of 1 KiB (512 bytes a rank) holds no weight (1 KiB): mostly the cold rates, but
    # a value used right after it is made is still there
    cold = warm_fractions(program, types, _warm_profile(1 << 10), ranks, hosts)[(0,)]
    assert sum(cold.values()) / len(cold) < 0.5 and 0.0 in cold.values(), cold
    assert any(f == 1.0 for f in cold.values()), cold
    slow = plan.simulate(profile=_warm_profile(1 << 10)).step_time
    uncached = plan.simulate(profile=_warm_profile(0)).step_time
    assert fast < slow < uncached
    # four ranks on the host share its cache: each rank's share is a quarter
    four = {c: 0 for c in [(0,), (1,), (2,), (3,)]}
    shared = warm_fractions(program, types, _warm_profile(1 << 20), list(four), four)
    assert (
        shared[(0,)] == warm_fractions(program, types, _warm_profile(1 << 18), ranks, hosts)[(0,)]
    )


def test_reuse_distance_counts_the_distinct_bytes_touched_since():
    from monarch_dsl.compiler.simulate import warm_fractions

    # x (4 KiB) read; then 8 steps each make a fresh 4 KiB tensor from y; then x negated in
    # place (its only bytes: x's)
    kb4 = ((1024,), "float32")
    steps = [isa.Compute(name="aten.neg.default", args=(Slot(0),), outs=(2,))]
    steps += [
        isa.Compute(name="aten.neg.default", args=(Slot(1),), outs=(3 + j,), frees=(3 + j,))
        for j in range(8)
    ]
    steps += [isa.Compute(name="aten.neg_.default", args=(Slot(0),), outs=(11,))]
    program = isa.Program("p", ("r",), (1,), tuple(steps), 12, (0, 1), (2, 11), (), ())
    types = [kb4] * 12
    c = (0,)

    def last(cache: int) -> float:
        return warm_fractions(program, types, _warm_profile(cache), [c], {c: 0})[c][9]

    # touched since x: the first result, y (once, read 8 times) and the 8 results: 40 KiB
    assert last(160 << 10) == 1.0  # within a quarter of the cache
    assert last(80 << 10) == pytest.approx(0.5)  # half way, in log, to all of it
    assert last(40 << 10) == 0.0  # the whole cache touched since: x gone
    # the first step reads x after its update at the end of the last call: nothing between
    assert warm_fractions(program, types, _warm_profile(40 << 10), [c], {c: 0})[c][0] > 0


def _lowered(plan):
    from monarch_dsl.compiler.lower import lower
    from monarch_dsl.compiler.simulate import slot_types

    return lower(plan), slot_types(plan)


def torch_mlp(layers: int, width: int):
    import torch

    return torch.nn.Sequential(
        *[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    )


def test_the_local_argument_calls_send_local_tensors_of_their_size(monkeypatch):
    """The controller link is measured from compiled calls with a local tensor argument of
    each of ``LOCAL_ARG_BYTES``: each call must copy and send that many bytes (a tensor made
    under the mesh's activation is a mesh tensor, and nothing would be sent)."""
    import sys as _sys

    from monarch_dsl.runtime import serialize

    sent: list[int] = []

    def spy(t):
        sent.append(t.numel() * t.element_size())
        return serialize.snapshot(t)

    monkeypatch.setattr(_sys.modules["monarch_dsl.mesh_fn"], "snapshot", spy)
    monkeypatch.setattr(calibrate, "steal_seconds", lambda: None)  # (no block taken again)
    pm = md.this_host().spawn_procs({"r": 2})
    try:
        calibrate._set_up_collectives(pm)
        calibrate._calls(pm, 2, 1)
    finally:
        pm.stop()
    for nbytes in calibrate.LOCAL_ARG_BYTES:  # warm-up and 2 timed calls each
        assert sent.count(nbytes) == 3, (nbytes, sent)


def test_cache_span_reads_the_largest_cache_whatever_order_sysfs_lists_its_entries_in(tmp_path):
    # A sysfs cache directory holds `uevent` beside the `index*` directories; os.listdir may
    # list it first. It was read as a cache and the whole lookup fell back to 64 MiB.
    for name, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "307200K")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    (tmp_path / "uevent").write_text("")
    (tmp_path / "index1").mkdir()  # no size file: skipped, not the end of the lookup
    assert calibrate.cache_span(str(tmp_path)) == 2 * 307200 * 1024
    assert calibrate.cache_span(str(tmp_path / "missing")) == 64 << 20


def test_a_convolution_costs_its_flops_at_a_matmuls_rate():
    """A convolution (and its backward: the input's and the weight's gradients) is costed by
    its multiply-adds at the rate a matmul of as many flops reaches, not only by the bytes it
    reads and writes (it was costed as a pointwise op: a 3x3 conv of 64 channels, ~600x too
    little)."""
    ones = {"matmul": 1.0, "pointwise": 1.0, "reduction": 1.0, "other": 1.0}
    p = _calibrated(efficiency=ones, matmul_passes=0.0)
    x, w, y = (
        ((8, 64, 16, 16), "float32"),
        ((64, 64, 3, 3), "float32"),
        ((8, 64, 16, 16), "float32"),
    )
    conv = isa.Compute(
        name="aten.convolution.default",
        args=(Slot(0), Slot(1), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        outs=(2,),
    )
    flops = 2 * math.prod(y[0]) * 64 * 9
    want = flops / p.matmul_flops_per_second(flops, "float32") + p.dispatch_overhead
    assert compute_time(conv, [x, w, y], p) == pytest.approx(want)
    # the backward, both gradients: twice that; the weight's alone: once
    for mask, times in (([True, True, False], 2), ([False, True, True], 1)):
        back = isa.Compute(
            name="aten.convolution_backward.default",
            args=(Slot(0), Slot(1), Slot(2), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask),
            outs=(3, 4, 5),
        )
        types = [y, x, w, x, w, ((64,), "float32")]
        rate = p.matmul_flops_per_second(times * flops, "float32")
        assert compute_time(back, types, p) == pytest.approx(
            times * flops / rate + p.dispatch_overhead
        )
    # transposed: the input's elements take the weight's slices
    tconv = isa.Compute(
        name="aten.convolution.default",
        args=(Slot(0), Slot(1), None, [1, 1], [1, 1], [1, 1], True, [0, 0], 1),
        outs=(2,),
    )
    small = ((8, 64, 8, 8), "float32")
    flops = 2 * math.prod(small[0]) * 64 * 9
    want = flops / p.matmul_flops_per_second(flops, "float32") + p.dispatch_overhead
    assert compute_time(tconv, [small, w, y], p) == pytest.approx(want)
