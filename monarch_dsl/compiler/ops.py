"""What the passes know about an op from its name and aten's schema of it: its base name,
whether it writes in place (and into what), whether its result shares storage with its input.

Op names are aten's (and prims') overload names, ``"aten.add_.Tensor"``: namespace, op,
overload. The communication and local redistributions a plan holds (``plan.COMM_OPS``,
``plan.LOCAL_OPS``) have no dot.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from monarch_dsl.compiler.plan import Instr, Var
from monarch_dsl.isa import leaves

# The prefix of aten's multi-tensor ops (``_foreach_add_``: one op over lists of tensors).
FOREACH = "_foreach_"


class _Aliasing:
    """Ops (base names) whose result shares storage with their first input: these by name
    (``reshape`` and ``chunk`` may or may not copy; ``_unsafe_view``'s schema does not say),
    and every aten view op -- one that functionalization has a ``<name>_copy`` twin for and
    whose result the schema marks as an alias (``diagonal``, ``unfold``, ``view_as_real``, ...):
    a list by name missed those, and a write through one was lost."""

    NAMED = frozenset(
        "view _unsafe_view reshape t transpose permute expand unsqueeze squeeze split "
        "split_with_sizes chunk slice narrow select detach alias as_strided unbind".split()
    )

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.NAMED or _aten_view(name))


@functools.cache
def _aten_view(name: str) -> bool:
    if name.endswith("_copy") or not hasattr(torch.ops.aten, name + "_copy"):
        return False
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return False
    for overload in packet.overloads():
        returns = getattr(packet, overload)._schema.returns
        if returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
            return True
    return False


def convolution_flags(name: str, args: Any) -> tuple[bool, tuple[bool, ...]]:
    """``transposed`` and the output mask of ``aten.convolution`` (base ``name``; its one
    output) or ``convolution_backward`` (the input's, weight's and bias's gradients), from
    their positional ``args``."""
    backward = name == "convolution_backward"
    at = 7 if backward else 6  # (where `transposed` is)
    transposed = bool(args[at]) if len(args) > at else False
    if not backward:
        return transposed, (True,)
    mask = args[-1] if args and isinstance(args[-1], (list, tuple)) else ()
    return transposed, tuple(bool(mask[i]) if i < len(mask) else True for i in range(3))


# The upsampling ops (each with a ``_backward``): propagation shards them along the batch and
# channels, and lowering gives a backward's ``input_size`` (its result's whole shape) the local
# shape. (torch names the nearest-exact ones with a leading underscore.)
UPSAMPLES = tuple(
    f"upsample_{m}" for m in ("nearest1d", "nearest2d", "nearest3d", "linear1d", "bilinear2d",
                              "bicubic2d", "trilinear3d")
) + tuple(f"_upsample_nearest_exact{n}d" for n in (1, 2, 3))  # fmt: skip

ALIASING = _Aliasing()


def base_name(op: str) -> tuple[str, bool]:
    """The op's name without namespace, overload and in-place suffix, and whether it writes
    in place: ``("add", True)`` for ``"aten.add_.Tensor"``, ``("_foreach_add", True)`` for
    the multi-tensor ``"aten._foreach_add_.List"``; prims ops by their name; a name with no
    dot (``"remote"``, a remote function's) is its own base."""
    name = op.split(".")[1] if "." in op else op
    if name.endswith("_") and (not name.startswith("_") or name.startswith(FOREACH)):
        return name[:-1], True
    return name, False


def written(ins: Instr) -> list[str]:
    """The values ``ins`` writes in place, in ``ins.uses()`` order (``written_uses``)."""
    uses = ins.uses()
    return [uses[i] for i in written_uses(ins)]


def written_uses(ins: Instr) -> list[int]:
    """Which of ``ins.uses()`` (by index) ``ins`` writes in place: for an aten op, every
    tensor its schema marks written (``Tensor(a!)``: an in-place op's ``self``, every tensor
    of a multi-tensor in-place op's first list, an ``out=`` argument -- ``torch.mul(a, 3,
    out=a)`` is ``aten.mul.out``, whose name does not say it writes); otherwise, by name, an
    in-place op's first tensor argument, or every tensor of its first list argument."""
    if "." not in ins.op:
        return []
    formals = _written_formals(ins.op)
    if formals is None:
        name, inplace = base_name(ins.op)
        if not inplace:
            return []
        first = ins.args[0] if ins.args else None
        if name.startswith(FOREACH):
            return list(range(len(leaves(first, Var)))) if isinstance(first, (list, tuple)) else []
        return [0] if ins.uses() else []
    positions, names = formals
    out: list[int] = []
    k = 0  # the index in ins.uses() of the next argument's first tensor
    for where, value in [*enumerate(ins.args), *ins.kwargs]:
        n = len(leaves(value, Var))
        if where in positions or where in names:
            out.extend(range(k, k + n))
        k += n
    return out


@functools.cache
def _written_formals(op: str) -> tuple[frozenset[int], frozenset[str]] | None:
    """The positions and names of the formal arguments aten's schema of ``op`` marks written;
    None where ``op`` is not an aten overload."""
    namespace, _, rest = op.partition(".")
    name, _, overload = rest.partition(".")
    if namespace != "aten" or not overload:
        return None
    packet: Any = getattr(torch.ops.aten, name, None)
    resolved = getattr(packet, overload, None) if packet is not None else None
    if resolved is None:
        return None
    writes = schema_writes(resolved)
    return frozenset(k for k, a in writes if not a.kwarg_only), frozenset(a.name for _, a in writes)


def schema_writes(overload: Any) -> list[tuple[int, Any]]:
    """(position, formal argument) of each argument aten's schema of ``overload`` (an
    ``OpOverload``) marks written: ``Tensor(a!)``."""
    return [
        (k, a)
        for k, a in enumerate(overload._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
