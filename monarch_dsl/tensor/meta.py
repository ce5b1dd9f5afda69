"""What an op gives, without running it: output shapes from meta tensors (cached), and which
arguments an op writes."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from monarch_dsl.tensor.handle import META_CACHE_MAX, Tensor, describe, new_meta

# Output metadata by (op, input metadata, other arguments): running an op on meta tensors goes
# through torch's Python reference implementations (hundreds of microseconds); a loop (a
# training step) repeats the same ops on the same shapes, so remember what they gave.
_meta_cache: dict[tuple, tuple] = {}


def _key_part(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.storage_offset())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *map(_key_part, x))
    if type(x) in _SCALARS:  # (3, 3.0 and True are equal keys, of three output dtypes)
        return (type(x), x)
    return x


_SCALARS = frozenset((int, float, bool, complex))


def output_meta(func, op: str, flat: list, meta_flat: list, spec: Any, factory: bool):
    """The output leaves as meta tensors, non-tensors, or ``Alias(i)`` for "the input
    flat[i]" (in-place ops); and the output pytree spec."""
    try:
        key = (func, torch.get_default_dtype(), spec, *map(_key_part, meta_flat))
        hash(key)
    except TypeError:
        key = None
    hit = _meta_cache.get(key) if key is not None else None
    if hit is not None:
        leaves, out_spec = hit
        return [new_meta(x) if type(x) is tuple else x for x in leaves], out_spec
    meta_args, meta_kwargs = pytree.tree_unflatten(meta_flat, spec)
    before = {id(m): describe(m) for i, m in enumerate(meta_flat) if isinstance(flat[i], Tensor)}
    if factory:
        meta_kwargs["device"] = torch.device("meta")
    try:
        meta_out = func(*meta_args, **meta_kwargs)
    except (NotImplementedError, RuntimeError) as e:
        # (torch says so with either: "cannot repeat_interleave a meta tensor without
        # output_size", "Tensor.item() cannot be called on meta tensors"; another
        # RuntimeError is the user's, a shape mismatch: raised as it is)
        if not isinstance(e, NotImplementedError) and "meta tensor" not in str(e):
            raise  # (NotImplementedError is a RuntimeError too)
        raise TypeError(
            f"{op} cannot run on mesh tensors eagerly: its output shape is not known without "
            f"the data ({e})"
        ) from None
    out_leaves, out_spec = pytree.tree_flatten(meta_out)
    position = {id(m): i for i, m in enumerate(meta_flat) if isinstance(flat[i], Tensor)}
    leaves: list = []
    cached: list = []
    for leaf in out_leaves:
        if isinstance(leaf, torch.Tensor):
            i = position.get(id(leaf))
            if i is not None:
                after = describe(leaf)  # (unsqueeze_, t_, resize_, out= resized: another)
                alias = Alias(i, after if after != before[id(leaf)] else None)
                leaves.append(alias)
                cached.append(alias)
                continue
            cached.append(describe(leaf))
        else:
            cached.append(leaf)
        leaves.append(leaf)
    if key is not None and len(_meta_cache) < META_CACHE_MAX:
        _meta_cache[key] = (tuple(cached), out_spec)
    return leaves, out_spec


class Alias:
    """An output that is input ``index`` (of the flattened arguments) itself; ``desc``: its
    (shape, stride, dtype, storage offset) after the op, where the op changed them in place
    (``x.unsqueeze_(0)``, ``x.resize_(n)``, ``out=`` of another shape), else None."""

    __slots__ = ("index", "desc")

    def __init__(self, index: int, desc: tuple | None = None):
        self.index = index
        self.desc = desc
