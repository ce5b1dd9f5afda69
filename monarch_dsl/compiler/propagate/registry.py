"""Sharding rules: what a rule is, the table of rules by op, and helpers the rules share.

A rule lists an op's candidate strategies on one mesh dim: for each, the placements its tensor
inputs must have and the placements its outputs then get. Rules are registered by op name
without overload and in-place suffix (``@rule("aten.add")`` covers ``aten.add.Tensor`` and
``aten.add_.Scalar``; ``"prims.sum"``), one module per op family under ``rules/``, the shape
of DTensor's ``torch/distributed/tensor/_ops/``. Every namespace other than ``prims`` is
looked up as ``aten``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from monarch_dsl.compiler.ops import base_name
from monarch_dsl.compiler.plan import Instr, Placement, Replicate, Shard

R = Replicate()


class Strategy(NamedTuple):
    """Inputs' required placements (one per tensor input, in ``Instr.uses()`` order; None:
    whatever it has) and the outputs' placements (one per out)."""

    ins: tuple[Placement | None, ...]
    outs: tuple[Placement, ...]


class DimType(NamedTuple):
    """A value's type as a rule sees it on one mesh dim: its whole shape and dtype (as its
    ``TensorType`` has them) and its placement on that dim."""

    shape: tuple[int, ...] | None
    dtype: str
    placement: Placement


class Ctx(NamedTuple):
    """What a rule sees of an instruction on one mesh dim: its tensor inputs' types (with
    their placements on that dim), its outputs' types and the dim's size."""

    ins: list[DimType]  # types of the tensor inputs, Instr.uses() order
    outs: tuple[DimType, ...]  # (placed Replicate: the rule decides)
    n: int  # size of the mesh dim


# rule(ins, ctx, name, inplace): name and inplace as ``ops.base_name`` gives them; None: the
# rule does not apply (the op runs replicated).
Rule = Callable[[Instr, Ctx, str, bool], "list[Strategy] | None"]


class _Entry(NamedTuple):
    fn: Rule
    factory: bool


_RULES: dict[str, _Entry] = {}


def rule(*ops: str, factory: bool = False) -> Callable[[Rule], Rule]:
    """Register the decorated function as the rule of ``ops`` (``"aten.mm"``, ``"prims.sum"``).
    An aten op's rule applies only when it has tensor inputs; a ``factory``'s only when it
    has none."""

    def register(fn: Rule) -> Rule:
        for op in ops:
            if op in _RULES:
                raise ValueError(f"two sharding rules for {op}")
            _RULES[op] = _Entry(fn, factory)
        return fn

    return register


def aten(names: Iterable[str]) -> list[str]:
    """``["aten.add", ...]`` for ``{"add", ...}``, in sorted order."""
    return [f"aten.{n}" for n in sorted(names)]


def strategies(ins: Instr, c: Ctx) -> list[Strategy] | None:
    """Candidate strategies of ``ins`` on one mesh dim, or None if the op has no rule."""
    ns = ins.op.split(".")[0]
    name, inplace = base_name(ins.op)
    key = f"prims.{name}" if ns == "prims" else f"aten.{name}"
    entry = _RULES.get(key)
    if entry is None:
        return None
    if ns != "prims" and entry.factory != (not c.ins):
        return None  # an aten op with no tensor inputs has a rule only if it is a factory
    return entry.fn(ins, c, name, inplace)


# ---- helpers for rules -----------------------------------------------------------------------


def norm_dim(d: int, ndim: int) -> int:
    """Tensor dim ``d`` of ``ndim``, counted from the front."""
    return d + ndim if d < 0 else d


def divisible(t: DimType, d: int, n: int) -> bool:
    """Whether ``t``'s dim ``d`` exists and ``n`` ranks can shard it evenly."""
    return t.shape is not None and 0 <= d < len(t.shape) and t.shape[d] % n == 0 and t.shape[d] > 0


def valid(s: Strategy, c: Ctx) -> bool:
    """Whether every tensor ``s`` shards, input or output, divides evenly."""
    for p, t in zip(s.ins, c.ins):
        if isinstance(p, Shard) and not divisible(t, p.dim, c.n):
            return False
    for p, t in zip(s.outs, c.outs):
        if isinstance(p, Shard) and not divisible(t, p.dim, c.n):
            return False
    return True


def first_input_as_is(cands: list[Strategy], c: Ctx) -> list[Strategy]:
    """``cands`` with those that take the first input as it is laid out first (a stable
    sort: ties in cost go to them)."""
    return sorted(cands, key=lambda s: 0 if s.ins[0] == c.ins[0].placement else 1)
