"""Hyperparameters as plan inputs: a learning rate a scheduler changes at every step.

A traced optimizer update holds its settings as constants (``add_(p, g, alpha=-0.1)``,
``mul(reciprocal, 0.1)`` for Adam's step size, ``mul_(p, 0.999)`` for AdamW's decay). A plan
with those constants is right for one learning rate only; compiling it again at every step of
a scheduler costs a trace per step. Here the settings a step's optimizers changed (``lr``,
``momentum``, an element of ``betas``: float entries of ``param_groups``) become inputs of the
plan, worked out on the controller at every call.

How: the step is traced at the settings as they are, once more per setting with that setting
at half its value, and once with every setting moved at once (to 3/4 of it, 4/5 ...). The
graphs must be the same but for some constants; each constant that differs must be an affine
function of the settings (fitted on the first traces, checked on the last one: a constant
that is not, ``-lr / (1 - beta1)``, or a graph whose ops change, leaves the settings as
constants, and the caller compiles again on a change, as before). Each such constant becomes
an input (one per distinct function), used where it was:

- an argument typed ``Tensor`` (a Python number the trace wrapped: ``mul.Tensor(x, 0.1)``):
  the input itself, a 0-dim tensor of the other operand's dtype, as the number was cast
  (float32 for half types in arithmetic, which reads a number at float32);
- ``alpha=`` of add/sub and ``value=`` of addcdiv/addcmul: the operand they scale times the
  input (``add_(p, mul(g, lr))``; the same value, rounded once more than the fused op);
- another Scalar argument: the op's overload that takes a Tensor there (``lerp_.Scalar`` ->
  ``lerp_.Tensor`` for Adam's ``1 - beta1``, ``pow.Scalar`` -> ``pow.Tensor_Tensor`` for
  ``beta1 ** step``), the input's dtype that of the first float operand;
- a traced 0-dim constant tensor: the input.

A setting is lifted only while it keeps its sign (``momentum != 0`` decides the update's ops):
``sign_of`` is part of the plan cache key instead of the value. Sampling is sound only where
the setting cannot be clamped or copied behind the traces' back: ``AFFINE`` optimizers only,
no read of it from outside torch.optim while tracing (``_Watched``), and no other holder of it
in the step (``_holders``: a kept parameter group, a scheduler's ``get_last_lr()``).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from monarch_dsl.compiler.capture import Captured, capture, used_objects, walk_used

aten = torch.ops.aten

# Scalar arguments lifted as a factor of another operand: op packet -> (the scalar's kwarg,
# the operand it scales).
_SCALES = {
    "add": ("alpha", 1),
    "add_": ("alpha", 1),
    "sub": ("alpha", 1),
    "sub_": ("alpha", 1),
    "addcdiv": ("value", 1),
    "addcdiv_": ("value", 1),
    "addcmul": ("value", 1),
    "addcmul_": ("value", 1),
}
# The affine check's tolerance, relative to how far the constant moved between the traces
# (not to its size: ``1 - lr * wd`` with lr and wd both lifted moves by ~lr * wd and misses the
# check by 0.05 * lr * wd, far below 1e-6 of the constant), plus a few units in the last place
# of the constant's size: a Python number is computed in float64 (a linear function fits to
# rounding); a traced 0-dim tensor constant in its own dtype.
_TOL = 1e-9
_ULPS = 16


# The optimizers whose update uses each float setting as a factor or a term (an affine
# function of it), or decides its ops by the setting's sign only (``momentum != 0``): what a
# few traces can check. Others may clamp one (``Adafactor``: ``min(lr, ...)``), which no
# sampling can rule out; their settings stay constants. Exact types: a subclass may override
# ``step``.
AFFINE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
)
_OPTIM_DIR = os.path.dirname(torch.optim.__file__) + os.sep


class _Watched(dict[str, Any]):
    """A parameter group while the step is traced: where code outside torch.optim reads one of
    ``keys`` goes into ``reads`` (the step's own code, or an optimizer hook, may branch on it
    or clamp it)."""

    def __init__(self, group: dict[str, Any], keys: set[str], reads: list[str]) -> None:
        super().__init__(group)
        self._keys, self._reads = keys, reads

    def _read(self, key: Any) -> None:
        if key in self._keys:
            code = sys._getframe(2)
            if not code.f_code.co_filename.startswith(_OPTIM_DIR):
                self._reads.append(f"{code.f_code.co_filename}:{code.f_lineno}")

    def __getitem__(self, key: Any) -> Any:
        self._read(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._read(key)
        return super().get(key, default)


@dataclass(frozen=True)
class Hyper:
    """One float setting of an optimizer the step uses: ``param_groups[group][key]``, or its
    ``index``-th element (``betas``)."""

    opt: str  # the optimizer's name in the step (``used_objects``)
    group: int
    key: str
    index: int | None = None

    def get(self, optimizers: dict[str, torch.optim.Optimizer]) -> Any:
        # (dict's own lookup: not a read of the step, where the group is ``_Watched``)
        value = dict.__getitem__(optimizers[self.opt].param_groups[self.group], self.key)
        return value if self.index is None else value[self.index]

    def set(self, optimizers: dict[str, torch.optim.Optimizer], value: float) -> None:
        group = optimizers[self.opt].param_groups[self.group]
        if self.index is None:
            group[self.key] = value
        else:
            old = dict.__getitem__(group, self.key)
            group[self.key] = type(old)(value if i == self.index else v for i, v in enumerate(old))


@dataclass(frozen=True)
class Lifted:
    """A plan input standing for a constant of the update: ``const + sum(coef * setting)``."""

    name: str
    dtype: torch.dtype
    const: float
    coef: tuple[tuple[int, float], ...]  # (index into the lifted settings, factor)

    def value(self, settings: Sequence[float]) -> float:
        return self.const + sum(c * settings[k] for k, c in self.coef)


def is_setting(value: Any) -> bool:
    """A value a scheduler may change that can be lifted: a Python float, not a bool."""
    return isinstance(value, float) and math.isfinite(value)


def liftable_now(h: Hyper, optimizers: dict[str, torch.optim.Optimizer]) -> bool:
    """Whether setting ``h`` is there and now a nonzero float (at zero, or gone, it is a
    constant of the plan compiled now)."""
    try:
        v = h.get(optimizers)
    except (KeyError, IndexError, TypeError):
        return False
    return is_setting(v) and v != 0


def sign_of(value: float) -> int:
    return (value > 0) - (value < 0)


def current(hypers: Sequence[Hyper], optimizers: dict[str, torch.optim.Optimizer]) -> list[float]:
    return [float(h.get(optimizers)) for h in hypers]


def capture_lifted(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    hypers: Sequence[Hyper],
    **capture_kwargs: Any,
) -> tuple[Captured, str]:
    """``capture(fn, ...)`` with ``hypers`` as inputs of kind ``hyper`` (``Captured.lifted``).
    Returns the captured step and ``""``, or the step with them as constants and why they could
    not be lifted."""
    _, optimizers = used_objects(fn)
    hypers = list(hypers)
    why = ""
    if not all(liftable_now(h, optimizers) for h in hypers):
        return capture(
            fn, args, kwargs, **capture_kwargs
        ), "a setting is gone or not a nonzero float"
    base = [h.get(optimizers) for h in hypers]
    for h in hypers:
        if type(optimizers[h.opt]) not in AFFINE:
            why = (
                f"{h.opt} is a {type(optimizers[h.opt]).__qualname__}, not one of torch.optim's "
                f"{', '.join(sorted(c.__name__ for c in AFFINE))}, whose updates are known to "
                "use their settings linearly"
            )
    held = _holders(fn, [optimizers[h.opt].param_groups[h.group] for h in hypers])
    if held:
        why = (
            f"the step reads the settings other than through the optimizer ({held}): a "
            "copy a trace cannot vary"
        )
    if why:
        return capture(fn, args, kwargs, **capture_kwargs), why
    points = [list(base)]
    for k in range(len(hypers)):
        moved = list(base)
        moved[k] = base[k] * 0.5
        points.append(moved)
    points.append([v * (0.75 + 0.05 * (k % 4)) for k, v in enumerate(base)])
    traces: list[Captured] = []
    reads: list[str] = []  # where code outside torch.optim read a lifted setting
    groups = {(h.opt, h.group) for h in hypers}
    keys = {h.key for h in hypers}
    originals = {g: optimizers[g[0]].param_groups[g[1]] for g in groups}
    try:
        for (opt, i), group in originals.items():
            optimizers[opt].param_groups[i] = _Watched(group, keys, reads)
        for point in points:
            for h, v in zip(hypers, point):
                h.set(optimizers, v)
            traces.append(capture(fn, args, kwargs, **capture_kwargs))
    finally:
        for (opt, i), group in originals.items():
            group.update(optimizers[opt].param_groups[i])
            optimizers[opt].param_groups[i] = group
        for h, v in zip(hypers, base):
            h.set(optimizers, v)
    if reads:
        return traces[0], f"the step reads it outside torch.optim, at {reads[0]}"
    slots, why = _differing(traces)
    if why:
        return traces[0], why
    lifted, why = _fit(slots, points)
    if why:
        return traces[0], why
    return _rewrite(traces[0], hypers, slots, lifted)


def _holders(fn: Callable[..., Any], groups: list[dict[str, Any]]) -> str:
    """What, besides the optimizers, the step (or a helper function it calls) holds that has
    the settings: a parameter group itself (``group = opt.param_groups[0]`` kept from before),
    the list of them, or an LR scheduler (``get_last_lr()`` is a copy). Its name, or ""."""
    from torch.optim.lr_scheduler import LRScheduler

    ids = {id(g) for g in groups}
    for name, value in walk_used(fn):
        if id(value) in ids:
            return f"{name}: a parameter group"
        if isinstance(value, (list, tuple)) and any(id(v) in ids for v in value):
            return f"{name}: the parameter groups"
        if isinstance(value, LRScheduler) or hasattr(value, "get_last_lr"):
            return f"{name}: an LR scheduler"
    return ""


# A slot: (node index, "args" / "kwargs" / "attr", position or name).
_Slot = tuple[int, str, Any]


def _differing(traces: list[Captured]) -> tuple[dict[_Slot, list[float]], str]:
    """The constants that differ between the traces (each slot's value in every trace), where
    the graphs are otherwise equal."""
    graphs = [list(t.graph.graph.nodes) for t in traces]
    base = graphs[0]
    changed = "the step's ops change with the setting"
    if any(len(g) != len(base) for g in graphs):
        return {}, changed
    index = {n: i for i, n in enumerate(base)}
    found: set[_Slot] = set()
    for other, g in zip(traces[1:], graphs[1:]):
        oindex = {n: i for i, n in enumerate(g)}
        for i, (a, b) in enumerate(zip(base, g)):
            if a.op != b.op or a.target != b.target:
                return {}, changed
            if a.op == "get_attr":
                va, vb = getattr(traces[0].graph, a.target), getattr(other.graph, b.target)
                if not isinstance(va, torch.Tensor) or va.dim() != 0:
                    continue  # to_plan refuses it
                if va.item() != vb.item():
                    found.add((i, "attr", None))
                continue
            if len(a.args) != len(b.args) or set(a.kwargs) != set(b.kwargs):
                return {}, changed
            pairs = [("args", k, x, y) for k, (x, y) in enumerate(zip(a.args, b.args))]
            pairs += [("kwargs", k, a.kwargs[k], b.kwargs[k]) for k in a.kwargs]
            for where, k, x, y in pairs:
                if _same(x, y, index, oindex):
                    continue
                if type(x) is float and type(y) is float:
                    found.add((i, where, k))
                    continue
                return {}, f"{a.target} takes a setting where it cannot be an input"
    slots: dict[_Slot, list[float]] = {}
    for slot in found:
        i, where, k = slot
        values = []
        for t, g in zip(traces, graphs):
            node = g[i]
            if where == "attr":
                values.append(float(getattr(t.graph, node.target).item()))
            else:
                values.append(node.args[k] if where == "args" else node.kwargs[k])
        slots[slot] = values
    return slots, ""


def _same(x: Any, y: Any, index: dict[Any, int], oindex: dict[Any, int]) -> bool:
    if isinstance(x, torch.fx.Node) or isinstance(y, torch.fx.Node):
        return (
            isinstance(x, torch.fx.Node)
            and isinstance(y, torch.fx.Node)
            and index.get(x) == oindex.get(y)
        )
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b, index, oindex) for a, b in zip(x, y))
    return type(x) is type(y) and x == y


_Fit = tuple[float, tuple[tuple[int, float], ...]]  # (const, ((setting, factor), ...))


def _fit(
    slots: dict[_Slot, list[float]], points: list[list[float]]
) -> tuple[dict[tuple[float, ...], _Fit], str]:
    """Each slot's values (one per trace) as ``const + sum(factor * setting)``: fitted on the
    base trace and those that moved one setting, checked on the last (all moved)."""
    base = points[0]
    out: dict[tuple[float, ...], _Fit] = {}
    for (_, where, _), values in sorted(slots.items(), key=lambda s: (s[0][0], str(s[0][1:]))):
        c0 = values[0]
        coef = []
        for k in range(len(base)):
            dc = values[1 + k] - c0
            if dc:
                coef.append((k, dc / (points[1 + k][k] - base[k])))
        const = c0 - sum(c * base[k] for k, c in coef)
        if abs(const) <= 1e-12 * abs(c0):
            const = 0.0
        check = points[-1]
        predicted = const + sum(c * check[k] for k, c in coef)
        moved = max(abs(v - c0) for v in values)
        size = max(abs(v) for v in values)
        # (a traced tensor constant: float32's unit in the last place, the widest it has)
        ulp = math.ulp(size) * (2**29 if where == "attr" else 1)
        if abs(predicted - values[-1]) > _TOL * moved + _ULPS * ulp:
            return {}, "a constant of the update is not a linear function of the settings"
        out[tuple(values)] = (const, tuple(coef))
    return out, ""


def _float_dtype(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
        return val.dtype
    return None


def _scalar_dtype(packet: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of an input standing for a number an op took: arithmetic reads a number at
    float32 (its opmath) for half types, so the input keeps that precision (a 0-dim operand
    does not change the result's dtype); others (lerp's weight) must have the operand's."""
    half = dtype in (torch.float16, torch.bfloat16)
    return torch.float32 if half and packet.rstrip("_") in ("add", "sub", "mul", "div") else dtype


def _tensor_twin(target: Any, name: str) -> Any:
    """The overload of ``target``'s op that takes its Scalar argument ``name`` as a Tensor,
    the rest alike (``lerp_.Scalar`` -> ``lerp_.Tensor``, ``pow.Scalar`` ->
    ``pow.Tensor_Tensor``), or None."""
    packet = target.overloadpacket
    mine = target._schema.arguments
    for overload in packet.overloads():
        twin = getattr(packet, overload)
        theirs = twin._schema.arguments
        if len(theirs) != len(mine) or len(twin._schema.returns) != len(target._schema.returns):
            continue
        if all(
            a.name == b.name
            and (str(b.type) == "Tensor" if a.name == name else str(a.type) == str(b.type))
            for a, b in zip(mine, theirs)
        ):
            return twin
    return None


def _rewrite(
    captured: Captured,
    hypers: list[Hyper],
    slots: dict[_Slot, list[float]],
    fits: dict[tuple[float, ...], _Fit],
) -> tuple[Captured, str]:
    """The base trace with each slot taken from an input of kind ``hyper``; or, where one
    cannot be, the trace unchanged and why."""
    gm = captured.graph
    graph = gm.graph
    nodes = list(graph.nodes)
    # First what to do with each slot, so that a slot that cannot be lifted changes nothing.
    # (slot, how, the input's dtype, the op's Tensor overload where how is "twin")
    plans: list[tuple[_Slot, str, torch.dtype, Any]] = []
    for slot in sorted(slots, key=lambda s: (s[0], str(s[1:]))):
        i, where, k = slot
        node = nodes[i]
        if where == "attr":
            dtype = getattr(gm, node.target).dtype
            if not dtype.is_floating_point:
                return captured, "a setting reaches an integer constant"
            plans.append((slot, "attr", dtype, None))
            continue
        target = node.target
        packet = target.overloadpacket.__name__
        formal = (
            target._schema.arguments[k]
            if where == "args"
            else next(a for a in target._schema.arguments if a.name == k)
        )
        if str(formal.type) == "Tensor":
            dtypes = [d for d in map(_float_dtype, node.args) if d is not None]
            if dtypes:
                plans.append((slot, "tensor", _scalar_dtype(packet, dtypes[0]), None))
                continue
        elif packet in _SCALES and where == "kwargs" and k == _SCALES[packet][0]:
            dtype = _float_dtype(node.args[_SCALES[packet][1]])
            if dtype is not None:
                plans.append((slot, "scale", _scalar_dtype("mul", dtype), None))
                continue
        elif str(formal.type) in ("Scalar", "number"):
            twin = _tensor_twin(target, formal.name)
            dtypes = [d for d in map(_float_dtype, node.args) if d is not None]
            if twin is not None and dtypes:
                plans.append((slot, "twin", dtypes[0], twin))
                continue
        return captured, f"{target} takes a setting as {formal.name}= (it cannot be an input)"

    placeholders = [n for n in nodes if n.op == "placeholder"]
    taken = set(captured.input_names)
    inputs: dict[tuple[tuple[float, ...], torch.dtype], tuple[torch.fx.Node, Lifted]] = {}

    def input_for(values: tuple[float, ...], dtype: torch.dtype) -> torch.fx.Node:
        if (values, dtype) not in inputs:
            const, coef = fits[values]
            main = hypers[coef[0][0]] if coef else hypers[0]
            stem = f"{main.opt}.{main.key}"
            name, n = stem, 1
            while name in taken:
                name, n = f"{stem}.{n}", n + 1
            taken.add(name)
            with graph.inserting_after(placeholders[-1]):
                node = graph.placeholder(f"hyper_{len(inputs)}")  # (an identifier)
            node.meta["val"] = torch.empty((), dtype=dtype)
            placeholders.append(node)
            inputs[(values, dtype)] = (node, Lifted(name, dtype, const, coef))
        return inputs[(values, dtype)][0]

    for slot, how, dtype, twin in plans:
        i, where, k = slot
        node = nodes[i]
        h = input_for(tuple(slots[slot]), dtype)
        if how == "attr":
            node.replace_all_uses_with(h)
            graph.erase_node(node)
        elif how in ("tensor", "twin"):
            if how == "twin":
                node.target = twin
            if where == "args":
                node.args = tuple(h if j == k else a for j, a in enumerate(node.args))
            else:
                node.kwargs = {**node.kwargs, k: h}
        else:  # scale: op(a, b, alpha=c) -> op(a, mul(b, h))
            j = _SCALES[node.target.overloadpacket.__name__][1]
            operand = node.args[j]
            with graph.inserting_before(node):
                scaled = graph.call_function(aten.mul.Tensor, (operand, h))
            for m in ("stack_trace", "custom"):
                if m in node.meta:
                    scaled.meta[m] = node.meta[m]
            scaled.meta["val"] = operand.meta["val"]
            node.args = tuple(scaled if n == j else a for n, a in enumerate(node.args))
            node.kwargs = {a: v for a, v in node.kwargs.items() if a != k}
    graph.lint()
    gm.recompile()
    lifted = [lift for _, lift in inputs.values()]
    base = [values[0] for values, _ in inputs]
    return (
        replace(
            captured,
            input_names=captured.input_names + [lift.name for lift in lifted],
            input_kinds=captured.input_kinds + ["hyper"] * len(lifted),
            input_values=captured.input_values
            + [torch.tensor(v, dtype=lift.dtype) for v, lift in zip(base, lifted)],
            hypers=tuple(hypers),
            lifted=tuple(lifted),
        ),
        "",
    )
