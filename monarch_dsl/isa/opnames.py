"""The torch operator an instruction or a step names.

The instruction set spells an operator two ways: an eager ``CallOp``'s ``op`` is the
dispatcher's name, ``"aten::add.Tensor"`` (no overload: ``default``, as c10 finds it), and a
compiled ``Compute`` step's ``name`` is the overload's Python name, ``"aten.add.Tensor"``
(namespace, op, overload). ``resolve_op`` takes either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_ops: dict[str, Callable[..., Any]] = {}


def resolve_op(name: str) -> Callable[..., Any]:
    """The torch op overload ``name`` names: ``torch.ops.aten.add.Tensor`` for
    ``"aten::add.Tensor"`` or ``"aten.add.Tensor"``, ``torch.ops.aten.mm.default`` for
    ``"aten::mm"``. Looked up once per name."""
    fn = _ops.get(name)
    if fn is None:
        if "::" in name:
            ns, _, rest = name.partition("::")
            op, _, overload = rest.partition(".")
        else:
            ns, op, overload = name.split(".")
        fn = _ops[name] = getattr(getattr(getattr(torch.ops, ns), op), overload or "default")
    return fn


def written_args(func: Any) -> tuple[tuple[int, str], ...]:
    """Positions and names of the arguments ``func`` writes (in-place and out= ops)."""
    found = _written_args.get(func)
    if found is None:
        found = _written_args[func] = tuple(
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    return found


_written_args: dict[Any, tuple[tuple[int, str], ...]] = {}
