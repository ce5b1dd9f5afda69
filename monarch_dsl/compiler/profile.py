"""Device profiles: what the simulator (``compiler/simulate.py``) charges for a step.

Compute is a roofline per op family: ``max(flops / (rate * efficiency), bytes / (bandwidth *
efficiency))`` (for matmuls, their sum where ``matmul_passes`` is set) plus a per-op dispatch
overhead. ``rate`` is the dtype's peak, or, where the
profile has a measured ``matmul_curve`` (FLOP/s achieved by float32 matmuls of each size), that
curve at the op's FLOPs (interpolated log-log, scaled by the dtype's peak over float32's);
``bandwidth`` is ``memory_bandwidth``, or the measured ``bandwidth_curve`` at the op's bytes (a
CPU's caches make a 4 MiB op several times faster per byte than a 64 MiB one). Communication is
an alpha-beta model per link kind: ``alpha * rounds + traffic / bandwidth``, where ``traffic``
is what the algorithm moves per rank (a ring all-reduce 2(n-1)/n of the bytes, in 2(n-1)
rounds; all-gather, reduce-scatter and all-to-all (n-1)/n, in n-1 rounds; send/recv all of
them, in one). A link may also be given per group size (key ``"shm@4"``: 4 ranks), where one
alpha and beta do not fit all sizes (4 ranks sharing 2 cores).

Built-in profiles: ``"h100"``, ``"h200"`` (from NVIDIA's public datasheets; the efficiencies
and latencies are assumptions, said so at each number) and ``"cpu-local"``: the profile that
``monarch-dsl calibrate`` measured on this machine (``calibrated_path()``) when there is one,
else a conservative placeholder for a 2-core CPU. ``"cuda-local"``: what ``monarch-dsl calibrate
--device cuda`` measured on this machine's GPU (compute and overheads; its links are the
built-in profile's of that GPU), an error naming that command until it has run. ``profile=``
anywhere takes a built-in name, a path to a saved profile, or a profile.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

# Link kinds (``DeviceProfile.links``' keys). "controller": a local tensor passed to a compiled
# step, sent by the controller to every worker at each call (latency per argument).
LINK_KINDS = ("shm", "gloo", "nccl_intra", "inter_host", "controller")
# Op families (``DeviceProfile.efficiency``' keys): ``compiler/simulate.py`` says which op is which.
FAMILIES = ("matmul", "pointwise", "reduction", "other")


# A measured curve: (x, rate) points, x increasing (FLOPs or bytes of one op -> per second).
Curve = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Link:
    """One kind of link: ``latency`` (alpha, seconds per round of the algorithm) and
    ``bandwidth`` (beta, bytes per second one rank sends), or, where measured, ``curve``: beta
    by the bytes a rank sends, ((traffic, bytes/s), ...) (shared memory copies through the
    caches: 8 MiB went 30% faster per byte than 32 MiB). ``overlap``: whether a collective
    on it runs beside the rank's compute (NCCL's kernels, gloo's threads), or in the thread
    that issues it, so that compute waits for it even when it was issued on another stream
    (the C++ runtime's shared-memory collectives copy and reduce in the caller's thread).
    ``factors``: ((collective kind, ((traffic, factor), ...)), ...), measured by
    ``monarch-dsl calibrate``: the kind's time over the alpha-beta time of its traffic, by
    traffic (alpha and beta are fitted to all-reduces; through shared memory a send goes
    through a ring, a big all-gather or reduce-scatter through gloo); 1 for a kind not
    listed."""

    latency: float
    bandwidth: float
    overlap: bool = True
    curve: Curve = ()
    factors: tuple[tuple[str, Curve], ...] = ()

    def time(self, traffic: float, rounds: int, kind: str = "all_reduce") -> float:
        beta = interpolate(self.curve, traffic) if self.curve and traffic > 0 else self.bandwidth
        by_size = dict(self.factors).get(kind)
        factor = interpolate(by_size, max(traffic, 1.0)) if by_size else 1.0
        return (self.latency * rounds + traffic / beta) * factor

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Link:
        values = dict(data)
        if "curve" in data:  # (JSON lists; the link's tuples)
            values["curve"] = tuple((float(x), float(y)) for x, y in data["curve"])
        if "factors" in data:
            values["factors"] = tuple(
                (str(k), tuple((float(x), float(y)) for x, y in curve))
                for k, curve in data["factors"]
            )
        return cls(**values)


def interpolate(curve: Sequence[Sequence[float]], x: float, floor: bool = False) -> float:
    """The rate of ``curve`` at ``x``: linear in log-log between the points around it (a
    power law between two measured sizes), the end point's rate beyond either end; with
    ``floor``, below the first point the rate that takes that point's time (x0 / y0: a
    smaller op takes no less time than the smallest measured one)."""
    if x <= curve[0][0]:
        if floor and x > 0:
            return float(curve[0][1]) * x / float(curve[0][0])
        return float(curve[0][1])
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    return float(curve[-1][1])


@functools.cache
def _shape_table(
    shapes: tuple[tuple[int, int, int, float], ...],
) -> tuple[list[int], list[int], list[int], dict[tuple[int, int, int], float]]:
    """``matmul_shapes`` as (the m, k and n axes, {(m, k, n): seconds per multiply-add});
    a grid: every combination of the axes' sizes must be there."""
    axes = [sorted({int(row[d]) for row in shapes}) for d in range(3)]
    per = {(m, k, n): max(t, 1e-15) / (m * k * n) for m, k, n, t in shapes}
    missing = len(axes[0]) * len(axes[1]) * len(axes[2]) - len(per)
    if missing:
        raise ValueError(f"matmul_shapes: not a grid of sizes ({missing} combinations missing)")
    return axes[0], axes[1], axes[2], per


@dataclass(frozen=True)
class DeviceProfile:
    """The costs of one device and its links. ``peak_flops`` by torch dtype name (a dtype not
    listed uses ``"float32"``'s), ``memory_bandwidth`` in bytes/s, ``efficiency`` per op family
    (the fraction of the peak a real kernel reaches), ``dispatch_overhead`` seconds per op a
    worker runs, ``controller_overhead`` seconds the controller spends issuing one eager op
    (the simulator of eager programs, ``md.Simulator``: a worker cannot start an op before the
    controller has issued it),
    ``links`` by kind (``LINK_KINDS``), and by kind and group size (``"shm@4"``) where measured
    apart; collectives within a host use ``intra_host``, across
    hosts ``inter_host`` (a rank's host: its coordinate along a mesh dim named ``host``, else
    its index // ``ranks_per_host``). ``memory_capacity``: bytes per device (0: unknown).

    Measured by ``monarch-dsl calibrate`` (empty otherwise): ``matmul_curve``, ((FLOPs of one
    float32 matmul, FLOP/s it reached), ...) by size; ``bandwidth_curve``, ((bytes one
    pointwise op reads and writes, bytes/s), ...); ``plan_overhead``, seconds one call of a
    compiled step costs its workers beyond its steps (the ``RunPlan`` message, the plan
    runner's bookkeeping, the failure-flag round after the run); ``plan_issue`` (+
    ``plan_issue_per_input`` per tensor input, + ``plan_issue_per_output`` per result: its
    handle, and its delete when the next call replaces it), the controller's CPU seconds per
    call (a local tensor argument adds its sending over ``links["controller"]``);
    ``host_cores``: the cores
    the ranks of a host and its controller share (0: not shared). See
    ``compiler/simulate.py:steady_step_time``.

    The controller's CPU per eager instruction (``compiler/simulate_eager.py``; all of its
    threads: issuing, pickling and sending the batches): ``controller_overhead`` per
    instruction, ``controller_reduce`` per ``Reduce`` and ``controller_borrow`` per
    ``BorrowBegin`` / ``BorrowEnd`` in its place (0: ``controller_overhead``),
    ``controller_backward`` more per node of autograd's backward pass that issues
    instructions (on the first of them on a thread: its graph walk and its formula's Python
    are the node's, whatever ops the formula issues; a final callback's instructions are no
    node's), ``controller_switch`` each time the issuing thread
    changes (``md.grad_generator``'s helper thread handing a gradient over and taking it back:
    a condition variable, the GIL). ``controller_replayed``: the controller's CPU per
    instruction of a batch it replays (``tensor/replay.py``: issued and described, not
    encoded or sent; an instruction of another kind than an op at the same fraction of its
    eager cost; 0: uncalibrated, as eager), ``replay_issue`` per run that stands for such a
    batch (the ``RunPlan`` made, encoded and sent). ``controller_measured``: the eager
    simulator also charges the controller each instruction's measured Python (the issuing
    thread's CPU since its previous instruction as the simulated program ran: the user's loop,
    modules, optimizer, autograd, the dispatch and handlers -- ``simulate_eager.Issued``), and
    the terms above are what it spends beyond that (calibrated so: each program's CPU less the
    Python measured in the simulator); False (the built-ins): the terms are the whole cost and
    the user's Python is not modelled. ``eager_op_overhead``: a worker's seconds
    per eager instruction beyond the op's compute (receiving and decoding it, the executor's
    bookkeeping, its stream's queue). ``collective_wait``: where a host's ranks and its
    controller share its cores (``host_cores``), the fraction of a rank's work in the batch
    before an eager collective (the instructions the controller issued in the batch window
    before it, since the rank's previous collective) that the rank spends waiting in the
    collective, its CPU spinning, for a peer the OS runs later: the workers take in a batch
    at once, and one runs its part while the other waits for a core the controller holds.

    ``matmul_passes``: 0 for the roofline; else a matmul's memory traffic adds to its
    arithmetic instead of hiding under it, and its inputs cross memory this many times (a
    CPU's BLAS packs them into blocks before multiplying: it reads them, writes the packed
    copy, reads that): ``flops / rate + (passes * inputs + output_passes * outputs) /
    bandwidth``. ``passes`` is measured from thin matmuls (n/32 x n x n, a batch through a
    layer): on a 2-core EPYC they took 15-40% longer than square ones of as many FLOPs, which
    the roofline's max cannot say; ``matmul_output_passes`` from wide ones (n x n/32 x n, a
    weight's gradient over a small batch), whose outputs, each the sum of only n/32 products,
    cost several times their bytes.

    ``matmul_shapes``: ((m, k, n, seconds), ...), float32 ``mm`` of an m x k by a k x n matrix
    measured on a grid of sizes (each m with each k and n; seconds net of the dispatch
    overhead). Where present, a 2-D matmul's time is read off it (``matmul_seconds``) instead
    of the curve and passes above: a CPU's BLAS is several times slower per FLOP on a thin
    batch (16 rows) than on a square one, and none of a few fitted numbers says by how much for
    every shape (off by up to 2.4x on a 2-core EPYC).

    ``elementwise``: ((aten op, seconds per element), ...), float32 pointwise ops whose
    arithmetic, not their bytes, can set their time (``tanh``: 4.5-5 ns an element on a 2-core
    EPYC, 8x an ``add``'s bytes at its bandwidth), measured net of the dispatch overhead. Such
    an op takes the longer of its bytes' time and its elements' (``elementwise_seconds``).

    ``cache_bytes``: the last-level cache a host's ranks share (0: none modelled), and
    ``warm_bandwidth_curve`` / ``warm_matmul_shapes``: ``bandwidth_curve`` / ``matmul_shapes``
    measured with the operands in it (calibration cycles through few enough operand sets that
    the host's ranks together touch at most a quarter of it; the tables above cycle through
    more than it holds, as the weights of a model larger than the cache come from memory). A
    step whose inputs were touched recently enough to still be in the cache runs at the warm
    rates (``warm``; ``compiler/simulate.py:warm_fractions`` says which): a 16 x 512 x 512
    matmul and a 512 x 512 ``add`` took 2x and 3x less so on a 2-core EPYC.

    ``small_op_floor``: whether a matmul smaller than the ``matmul_curve``'s smallest measured
    size takes that size's time, not its FLOPs at that size's rate. Set by ``monarch-dsl
    calibrate --device cuda``: a GPU's small matmuls are launches (cuBLAS, a split-K
    reduction), not work (on an H200, in a plan of the C++ runtime, a 128^3 float32 ``mm``
    took 13.8 us and a 256^3 one 15.7 us, where the 256^3 one's rate put the 128^3 one at 6
    us). A CPU's small matmuls shrink with their work: its curve keeps the smallest size's
    rate below it. (Not the bandwidth curve: its first point is the smallest ``add`` that
    does work beyond the dispatch, the launch-bound ones being left out of it, and a smaller
    pointwise op costs the dispatch alone.)

    ``async_device``: the workers' ops run on a device that runs them on its own (a GPU), so
    in an eager program a worker's part of an op (``host_seconds``) overlaps the device's
    running of the ops it launched before (``compiler/simulate_eager.py``). False: an op runs
    where it is dispatched, one after the other (CPU workers)."""

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    efficiency: dict[str, float]
    dispatch_overhead: float
    links: dict[str, Link]
    intra_host: str = "nccl_intra"
    inter_host: str = "inter_host"
    ranks_per_host: int = 8
    memory_capacity: float = 0.0
    controller_overhead: float = 0.0
    matmul_curve: Curve = ()
    bandwidth_curve: Curve = ()
    plan_overhead: float = 0.0
    plan_issue: float = 0.0
    plan_issue_per_input: float = 0.0
    plan_issue_per_output: float = 0.0
    host_cores: int = 0
    matmul_passes: float = 0.0
    matmul_output_passes: float = 1.0
    controller_reduce: float = 0.0
    controller_borrow: float = 0.0
    controller_backward: float = 0.0
    controller_switch: float = 0.0
    controller_replayed: float = 0.0
    replay_issue: float = 0.0
    eager_op_overhead: float = 0.0
    collective_wait: float = 0.0
    matmul_shapes: tuple[tuple[int, int, int, float], ...] = ()
    elementwise: tuple[tuple[str, float], ...] = ()
    cache_bytes: int = 0
    warm_bandwidth_curve: Curve = ()
    warm_matmul_shapes: tuple[tuple[int, int, int, float], ...] = ()
    small_op_floor: bool = False
    async_device: bool = False
    controller_measured: bool = False
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for shapes in (self.matmul_shapes, self.warm_matmul_shapes):
            if shapes:
                _shape_table(shapes)  # a grid, or a ValueError when the profile loads

    @property
    def has_warm(self) -> bool:
        """Whether the profile says how much faster an op runs on operands in the cache."""
        return bool(self.cache_bytes and (self.warm_bandwidth_curve or self.warm_matmul_shapes))

    def warm(self) -> DeviceProfile:
        """This profile with operands in the cache: its warm tables in place of the others
        (each where it has one)."""
        return dataclasses.replace(
            self,
            bandwidth_curve=self.warm_bandwidth_curve or self.bandwidth_curve,
            matmul_shapes=self.warm_matmul_shapes or self.matmul_shapes,
            warm_bandwidth_curve=(),
            warm_matmul_shapes=(),
        )

    def flops_per_second(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["float32"])

    def host_seconds(self, matmul: bool) -> float:
        """With ``async_device``, what a worker's host spends to launch an eager op: the
        dispatch and ``eager_op_overhead``, and for a matmul with ``small_op_floor`` its
        launches too, the smallest measured matmul's time (a size the device runs at once)."""
        seconds = self.dispatch_overhead + self.eager_op_overhead
        if matmul and self.small_op_floor and self.matmul_curve:
            x0, y0 = self.matmul_curve[0]
            seconds += float(x0) / float(y0)
        return seconds

    def matmul_flops_per_second(self, flops: float, dtype: str) -> float:
        """What a matmul of ``flops`` reaches: the measured curve (float32's, scaled by the
        dtype's peak over float32's) where there is one, else the dtype's peak."""
        if not self.matmul_curve:
            return self.flops_per_second(dtype)
        scale = self.flops_per_second(dtype) / self.peak_flops["float32"]
        return interpolate(self.matmul_curve, flops, self.small_op_floor) * scale

    def matmul_seconds(self, m: int, k: int, n: int, dtype: str) -> float | None:
        """Seconds of an (m x k) @ (k x n) matmul from ``matmul_shapes`` (None without): its
        seconds per multiply-add interpolated linearly in the logarithms of m, k and n between
        the measured sizes (beyond them, the nearest measured size's), times its m k n (other
        dtypes: scaled by their peak over float32's)."""
        if not self.matmul_shapes or min(m, k, n) < 1:
            return None
        ms, ks, ns, per = _shape_table(self.matmul_shapes)
        # (linear in the logarithms along each axis in turn: ``interpolate``'s rule)
        by_k = [
            [(kj, interpolate([(nh, per[(mi, kj, nh)]) for nh in ns], n)) for kj in ks] for mi in ms
        ]
        rate = interpolate([(mi, interpolate(curve, k)) for mi, curve in zip(ms, by_k)], m)
        scale = self.peak_flops["float32"] / self.flops_per_second(dtype)
        return rate * m * k * n * scale

    def elementwise_seconds(self, op: str, numel: int) -> float | None:
        """Seconds of the arithmetic of pointwise op ``op`` (``"tanh"``: an aten op's name
        without namespace and overload) over ``numel`` elements, where measured (None else)."""
        for name, per in self.elementwise:
            if name == op:
                return per * numel
        return None

    def matmul_memory_seconds(self, inputs: float, outputs: float, efficiency: float) -> float:
        """The memory time of a matmul reading ``inputs`` bytes and writing ``outputs``: its
        inputs ``matmul_passes`` times where that is set (else once), its outputs
        ``matmul_output_passes`` times (at least once)."""
        out_passes = max(self.matmul_output_passes, 1.0)
        moved = max(self.matmul_passes, 1.0) * inputs + out_passes * outputs
        return moved / (self.bandwidth(moved) * efficiency) if moved else 0.0

    def bandwidth(self, moved: float) -> float:
        """Bytes/s of a memory-bound op that reads and writes ``moved`` bytes: the measured
        curve where there is one, else ``memory_bandwidth``."""
        if not self.bandwidth_curve:
            return self.memory_bandwidth
        return interpolate(self.bandwidth_curve, moved)

    def link(self, cross_host: bool, n: int | None = None) -> Link:
        """The link of a collective across hosts or not; over ``n`` ranks: the link measured
        for the group size nearest ``n`` (the larger on a tie) where the profile has any
        (``"shm@4"``), else the kind's."""
        kind = self.inter_host if cross_host else self.intra_host
        sized = {}
        for key, link in self.links.items():
            base, sep, size = key.partition("@")
            if sep and base == kind and size.isdigit():
                sized[int(size)] = link
        if n is None or not sized:
            return self.links[kind]
        return sized[min(sized, key=lambda m: (abs(m - n), -m))]

    def with_link(self, kind: str, latency: float, bandwidth: float) -> DeviceProfile:
        """This profile with link ``kind`` replaced."""
        return dataclasses.replace(self, links={**self.links, kind: Link(latency, bandwidth)})

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceProfile:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown device profile fields: {sorted(unknown)}")
        values = dict(data)
        # (a GPU calibration saved before the field: its small_op_floor says it is one)
        values.setdefault("async_device", bool(values.get("small_op_floor", False)))
        values["links"] = {k: Link.from_json(v) for k, v in data["links"].items()}
        for k in ("matmul_curve", "bandwidth_curve", "warm_bandwidth_curve"):  # (JSON lists)
            if k in data:
                values[k] = tuple((float(x), float(y)) for x, y in data[k])
        if "elementwise" in data:
            values["elementwise"] = tuple((str(op), float(t)) for op, t in data["elementwise"])
        for k in ("matmul_shapes", "warm_matmul_shapes"):
            if k in data:
                values[k] = tuple((int(m), int(a), int(n), float(t)) for m, a, n, t in data[k])
        return cls(**values)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeviceProfile:
        with open(path) as f:
            return cls.from_json(json.load(f))

    @classmethod
    def get(cls, profile: ProfileLike) -> DeviceProfile:
        """``profile`` as a ``DeviceProfile``: a built-in name (``BUILTIN``; ``"cpu-local"``
        is the calibrated file, ``calibrated_path()``, when there is one), a path to a saved
        one, or a profile (returned as is); None is ``"cpu-local"``."""
        if profile is None:
            profile = "cpu-local"
        if isinstance(profile, DeviceProfile):
            return profile
        if profile == "cpu-local":
            return _calibrated() or BUILTIN["cpu-local"]
        if profile in CALIBRATED and profile not in BUILTIN:
            found = _calibrated(profile)
            if found is None:
                raise ValueError(
                    f"device profile {profile!r} is what {_calibrate_command(profile)} "
                    f"measures on a machine with the GPU, and it has not run here (no "
                    f"{calibrated_path(profile)})"
                )
            return found
        if isinstance(profile, str) and profile in BUILTIN:
            return BUILTIN[profile]
        if os.path.exists(profile):
            return cls.load(profile)
        raise ValueError(
            f"unknown device profile {profile!r}: not a built-in ({', '.join(BUILTIN)}) nor a file"
        )


ProfileLike = Union[str, "os.PathLike[str]", DeviceProfile, None]

# Where ``monarch-dsl calibrate`` writes the ``"cpu-local"`` profile (a directory).
PROFILE_DIR_ENV = "MONARCH_DSL_PROFILE_DIR"
# The profiles ``monarch-dsl calibrate`` writes: ``--device cpu`` (the default) and ``cuda``.
CALIBRATED = ("cpu-local", "cuda-local")


def calibrated_path(name: str = "cpu-local") -> Path:
    """The calibrated profile ``name``'s file (``CALIBRATED``): ``<name>.json`` in
    ``$MONARCH_DSL_PROFILE_DIR``, else in ``$XDG_CACHE_HOME/monarch_dsl/profiles``, else in
    ``~/.cache/monarch_dsl/profiles`` (per user, as the C++ runtime's builds)."""
    if name not in CALIBRATED:
        raise ValueError(f"no calibrated profile is called {name!r} (only {CALIBRATED})")
    if os.environ.get(PROFILE_DIR_ENV):
        return Path(os.environ[PROFILE_DIR_ENV]) / f"{name}.json"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "monarch_dsl" / "profiles" / f"{name}.json"


def _calibrate_command(name: str) -> str:
    """The command that writes calibrated profile ``name`` (``"cuda-local"``: ``--device
    cuda``)."""
    device = name.removesuffix("-local")
    return (
        "`monarch-dsl calibrate`"
        if device == "cpu"
        else (f"`monarch-dsl calibrate --device {device}`")
    )


_loaded: dict[tuple[str, int], DeviceProfile] = {}


def _calibrated(name: str = "cpu-local") -> DeviceProfile | None:
    """The calibrated profile (read again when the file changes), or None if there is none."""
    path = calibrated_path(name)
    try:
        key = (str(path), path.stat().st_mtime_ns)
    except OSError:
        return None
    if key not in _loaded:
        try:
            profile = DeviceProfile.load(path)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"{path}: not a device profile ({type(e).__name__}: {e}); run "
                f"{_calibrate_command(name)} again, or remove the file"
            ) from e
        for old in [k for k in _loaded if k[0] == str(path)]:
            del _loaded[old]
        _loaded[key] = profile
    return _loaded[key]


# Assumed for the GPUs (not datasheet numbers): a large matmul reaches ~70% of the dense
# tensor-core peak, memory-bound kernels ~80% of HBM bandwidth; each op costs ~5 us to launch.
_GPU_EFFICIENCY = {"matmul": 0.7, "pointwise": 0.8, "reduction": 0.7, "other": 0.6}
_GPU_LINKS = {
    # NVLink 4: 900 GB/s per GPU total, both directions (H100/H200 SXM datasheets): 450 GB/s
    # each way. Latency ~10 us per NCCL ring step: an assumption.
    "nccl_intra": Link(latency=10e-6, bandwidth=450e9),
    # 400 Gb/s NDR InfiniBand (ConnectX-7) per GPU, as in a DGX H100: 50 GB/s. Latency ~20 us
    # per step: an assumption.
    "inter_host": Link(latency=20e-6, bandwidth=50e9),
    # Assumptions for the CPU back ends on a GPU host.
    "shm": Link(latency=20e-6, bandwidth=10e9, overlap=False),
    "gloo": Link(latency=100e-6, bandwidth=1e9),
}

H100 = DeviceProfile(
    name="h100",
    peak_flops={
        "bfloat16": 989e12,  # H100 SXM datasheet: 989 TFLOP/s dense BF16 (1979 sparse)
        "float16": 989e12,  # H100 SXM datasheet: 989 TFLOP/s dense FP16
        "float32": 67e12,  # H100 SXM datasheet: 67 TFLOP/s FP32 (not TF32: torch's default)
        "float64": 67e12,  # H100 SXM datasheet: 67 TFLOP/s FP64 tensor core
        "int8": 1979e12,  # H100 SXM datasheet: 1979 TOPS dense INT8
    },
    memory_bandwidth=3.35e12,  # H100 SXM datasheet: 3.35 TB/s HBM3
    memory_capacity=80e9,  # H100 SXM datasheet: 80 GB
    efficiency=_GPU_EFFICIENCY,
    dispatch_overhead=5e-6,  # assumption: a CUDA kernel launch through the dispatcher
    links=_GPU_LINKS,
    ranks_per_host=8,  # an HGX H100 board: 8 GPUs
    # the controller's Python issuing an eager op, as measured on a CPU host here
    # (benchmarks/tensor_engine.py: ~7-9 us an op); a host CPU is a host CPU
    controller_overhead=8e-6,
    # The controller's CPU for eager instructions beyond an op's, and a worker's per eager
    # instruction beyond its op: what `monarch-dsl calibrate` measured on a 2-core EPYC
    # (rounded); instruction handling is host Python whatever the device.
    controller_reduce=50e-6,
    controller_borrow=5e-6,
    controller_backward=15e-6,
    controller_switch=90e-6,
    eager_op_overhead=6e-6,
    async_device=True,
    notes="NVIDIA H100 SXM datasheet peaks; efficiencies and latencies are assumptions",
)

H200 = dataclasses.replace(
    H100,
    name="h200",
    memory_bandwidth=4.8e12,  # H200 SXM datasheet: 4.8 TB/s HBM3e (compute as H100's)
    memory_capacity=141e9,  # H200 SXM datasheet: 141 GB
    notes="NVIDIA H200 SXM datasheet peaks; efficiencies and latencies are assumptions",
)

# A placeholder until ``monarch-dsl calibrate`` measures this machine: a conservative guess
# for 2 CPU cores (``DeviceProfile.get("cpu-local")`` gives the measured one when there is one).
CPU_LOCAL = DeviceProfile(
    name="cpu-local",
    peak_flops={
        "float32": 50e9,  # placeholder: 2 AVX2 cores reach ~100-200 GFLOP/s at best
        "float64": 25e9,  # placeholder: half of float32
        "bfloat16": 25e9,  # placeholder: bf16 matmuls are slower than f32 on most CPUs
        "float16": 10e9,  # placeholder
    },
    memory_bandwidth=10e9,  # placeholder: ~10 GB/s for 2 cores
    efficiency={"matmul": 0.5, "pointwise": 0.5, "reduction": 0.5, "other": 0.5},
    dispatch_overhead=10e-6,  # placeholder: torch's CPU dispatch is ~5-20 us an op
    links={
        # placeholder: a memcpy through /dev/shm (in the issuing thread: no overlap)
        "shm": Link(latency=20e-6, bandwidth=5e9, overlap=False),
        "gloo": Link(latency=100e-6, bandwidth=1e9),  # placeholder: TCP over loopback
        "nccl_intra": Link(latency=20e-6, bandwidth=5e9),  # (no NCCL on a CPU: as shm)
        "inter_host": Link(latency=200e-6, bandwidth=1.25e9),  # placeholder: 10 Gb/s Ethernet
    },
    intra_host="shm",
    inter_host="gloo",
    ranks_per_host=1 << 30,  # one host, unless the mesh has a "host" dim
    controller_overhead=8e-6,  # benchmarks/tensor_engine.py: ~7-9 us an eager op
    # measured by `monarch-dsl calibrate` on a 2-core EPYC (rounded; see H100)
    controller_reduce=50e-6,
    controller_borrow=5e-6,
    controller_backward=15e-6,
    controller_switch=90e-6,
    eager_op_overhead=6e-6,
    notes="uncalibrated placeholder for a 2-core CPU: run `monarch-dsl calibrate`",
)

BUILTIN: dict[str, DeviceProfile] = {p.name: p for p in (H100, H200, CPU_LOCAL)}
