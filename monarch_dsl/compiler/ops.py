"""What the passes know about an op from its name: its base name, whether it writes in place
(and into what), whether its result shares storage with its input.

Op names are aten's (and prims') overload names, ``"aten.add_.Tensor"``: namespace, op,
overload. The communication and local redistributions a plan holds (``plan.COMM_OPS``,
``plan.LOCAL_OPS``) have no dot.
"""

from __future__ import annotations

from monarch_dsl.compiler.plan import Instr, Var

# The prefix of aten's multi-tensor ops (``_foreach_add_``: one op over lists of tensors).
FOREACH = "_foreach_"

# Ops whose result shares storage with their first input.
ALIASING = set(
    "view _unsafe_view reshape t transpose permute expand unsqueeze squeeze split "
    "split_with_sizes chunk slice narrow select detach alias as_strided unbind".split()
)


def base_name(op: str) -> tuple[str, bool]:
    """The op's name without namespace, overload and in-place suffix, and whether it writes
    in place: ``("add", True)`` for ``"aten.add_.Tensor"``, ``("_foreach_add", True)`` for
    the multi-tensor ``"aten._foreach_add_.List"``; prims ops by their name. ``op`` must be
    a dotted name (not a communication)."""
    name = op.split(".")[1]
    if name.endswith("_") and (not name.startswith("_") or name.startswith(FOREACH)):
        return name[:-1], True
    return name, False


def written(ins: Instr) -> list[str]:
    """The values ``ins`` writes in place: an in-place op's first tensor argument; a
    multi-tensor in-place op's (``_foreach_add_([p0, p1], ...)``) every tensor of its first
    list argument. (Tracing makes a foreach op one op per tensor: ``capture``.)"""
    if "." not in ins.op:
        return []
    name, inplace = base_name(ins.op)
    if not inplace:
        return []
    if name.startswith(FOREACH):
        first = ins.args[0] if ins.args else ()
        if isinstance(first, (list, tuple)):
            return [v.name for v in first if isinstance(v, Var)]
        return []
    return ins.uses()[:1]
