"""Capture: a training step (forward, backward, optimizer update) as one aten graph.

The user's function is traced with ``make_fx`` on fake tensors of the whole (global) shapes.
The modules and optimizers it uses (found in its closure and globals) are taken apart: their
parameters, buffers, optimizer state and existing ``.grad``s become inputs of the graph, so
the plan can keep them on the workers between steps. Optimizer state created by the step
(momentum buffers, Adam's moments on the first step) and the gradients it leaves become
outputs.

The optimizers are traced as ``torch.compile`` sees them (``torch.compiler.is_compiling()``
is true while tracing), so Adam's step count stays a tensor instead of a Python number baked
into the plan. Their multi-tensor (``foreach=True``) ops are traced as one op per tensor, so
each parameter's update is placed, sharded and put on its pipeline stage like any other op.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import re
import sys
import traceback
import types
import unittest.mock
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, TypedDict, cast

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._prims_common import make_contiguous_strides_for

from monarch_dsl.compiler.ops import ALIASING, FOREACH, base_name, schema_writes
from monarch_dsl.compiler.plan import (
    FreshNames,
    Input,
    Instr,
    Output,
    Plan,
    PlanError,
    Replicate,
    TensorType,
    Var,
)
from monarch_dsl.frames import innermost_user
from monarch_dsl.isa import dtype_name

aten = torch.ops.aten

# A decomposition table, as make_fx takes it: an op overload -> the function it becomes.
Decompositions = dict[torch._ops.OpOverload[..., Any], Callable[..., Any]]

# Ops decomposed while tracing, so that propagation needs rules only for a small set of
# primitives (pointwise, reductions, views, mm); the decompositions are written with the
# whole shapes, so their constants (a mean's element count) stay right on shards.
_DECOMPOSE = [
    aten.addmm,
    aten.mse_loss,
    aten.mse_loss_backward,
    aten._softmax_backward_data,
    aten._log_softmax_backward_data,
    aten.gelu_backward,
    aten.tanh_backward,
    aten.sigmoid_backward,
    aten.silu,
    aten.silu_backward,
    aten.native_dropout_backward,
    aten.addcmul,
    aten.addcdiv,
    aten.lerp,
    aten.rsub,
    aten.t,
    aten.linear,
    aten.matmul,
    aten.baddbmm,
    aten._to_copy,
    aten.zero,
    aten.select_backward,
    aten.slice_backward,
    # batch norm: sums over the batch and pointwise ops (with var_mean as sums, below), so a
    # batch-sharded activation is normalized where it is, with per-channel sums all-reduced,
    # instead of gathered whole onto every rank
    aten.native_batch_norm,
    aten.native_batch_norm_backward,
    # group norm (per sample: its statistics are sums over the sample's dims) and the losses
    # that are pointwise ops and a reduction: a batch shard stays where it is
    aten.native_group_norm,
    aten.native_group_norm_backward,
    aten.binary_cross_entropy,
    aten.binary_cross_entropy_backward,
    aten.binary_cross_entropy_with_logits,
    aten.smooth_l1_loss,
    aten.smooth_l1_loss_backward,
    aten.huber_loss,
    aten.huber_loss_backward,
]


# Not decomposed (a pointwise rule of its own): ReLU's backward stays one op, where torch's
# decomposition makes three (le, scalar_tensor, where).
#   aten.threshold_backward


def decompositions() -> Decompositions:
    from torch._decomp import get_decompositions

    # (torch types its keys as OperatorBase; they are the overloads of _DECOMPOSE's packets)
    table = cast(Decompositions, get_decompositions(_DECOMPOSE))
    torch_addmm = table[aten.addmm.default]
    table[aten.addmm.default] = functools.partial(_addmm, torch_addmm)
    table[aten.var_mean.correction] = _var_mean
    table[aten.as_strided.default] = _as_strided
    return {**table, **_foreach_decompositions()}


def _as_strided(x: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None) -> Any:
    """``aten.as_strided`` that is a plain ``view`` (a contiguous tensor taken whole, with the
    new size's contiguous strides: group norm's decomposition reshapes so) as that view, which
    propagation shards; any other as it is (NotImplemented: make_fx traces it unchanged)."""
    size = list(size)
    if (
        not storage_offset
        and x.storage_offset() == 0
        and x.is_contiguous()
        and math.prod(size) == x.numel()
        and tuple(stride) == make_contiguous_strides_for(size)
    ):
        return aten.view.default(x, size)
    return NotImplemented  # (make_fx then traces the op as it is)


def _var_mean(
    x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.var_mean`` as two sums over ``dim`` (the mean's, then the centred squares'),
    which propagation shards (a sharded reduced dim gives Partial sums); torch's kernel is one
    op with no rule, run replicated on the whole tensor. The counts are the whole shape's."""
    nd = x.dim()
    dims = list(range(nd)) if dim is None or len(dim) == 0 else [d % nd for d in dim]
    n = math.prod(x.shape[d] for d in dims)
    c = 1 if correction is None else correction
    mean = aten.sum.dim_IntList(x, dims, True) / n
    centered = x - mean
    var = aten.sum.dim_IntList(centered * centered, dims, keepdim) / max(0, n - c)
    return var, (mean if keepdim else aten.squeeze.dims(mean, dims))


def _addmm(
    torch_addmm: Callable[..., Any],
    self: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    *,
    beta: Any = 1,
    alpha: Any = 1,
) -> Any:
    """``aten.addmm`` (``nn.Linear``) as torch's decomposition computes it, ``out + beta *
    self`` with ``out = alpha * mm``, without its multiplies by 1: two ops a layer, each a
    dispatch and a pass over the activations on every rank at every step, that change no
    bit. Float32 / float64 only; the rest (computed in float32 and cast back, or mixed dtypes,
    which torch's promotes) is torch's."""
    if (
        self.dtype not in (torch.float32, torch.float64)
        or not mat1.dtype == mat2.dtype == self.dtype
    ):
        return torch_addmm(self, mat1, mat2, beta=beta, alpha=alpha)
    out = aten.mm(mat1, mat2)
    if alpha != 1:
        out = alpha * out
    if beta == 0:
        return out
    return out + (self if beta == 1 else beta * self)  # (out first: a contiguous result)


# ---- multi-tensor (foreach) ops --------------------------------------------------------------
#
# An optimizer with foreach=True updates all its parameters with one op per step of the update
# (``_foreach_add_([p0, p1, ...], [g0, g1, ...])``): one instruction writing tensors that may
# be laid out differently and live on different pipeline stages. Traced as one op per tensor
# (``add_(p0, g0)``, ``add_(p1, g1)``, ...) instead, each is placed, sharded and ordered on
# its own, like the foreach=False update.

# Per-tensor ops whose name is not the foreach op's without its prefix.
_FOREACH_AS: dict[str, Callable[..., Any]] = {
    "norm": lambda x, ord=2, dtype=None: aten.linalg_vector_norm(x, ord, dtype=dtype),
    "max": lambda x: aten.max.default(x),
}


@functools.cache
def _foreach_decompositions() -> Decompositions:
    table: Decompositions = {}
    for schema in torch._C._jit_get_all_schemas():
        ns, _, name = schema.name.partition("::")
        if ns != "aten" or not name.startswith(FOREACH) or "out" in schema.overload_name:
            continue
        packet = getattr(aten, name, None)
        op = getattr(packet, schema.overload_name or "default", None)
        if op is not None:
            table[op] = functools.partial(_foreach_per_tensor, op)
    return table


def _foreach_per_tensor(
    op: torch._ops.OpOverload[..., Any], *args: Any, **kwargs: Any
) -> list[Any] | None:
    """``op`` (a foreach op) as one op per tensor of its list arguments."""
    schema = op._schema
    base = schema.name.partition("::")[2].removeprefix(FOREACH)
    inplace = base.endswith("_")
    is_list = {a.name: str(a.type).startswith("List[") for a in schema.arguments}
    positional = [is_list[a.name] for a in schema.arguments if not a.kwarg_only]
    lists = [v for v, listed in zip(args, positional) if listed]
    lists += [v for k, v in kwargs.items() if is_list.get(k)]
    n = len(lists[0]) if lists else 0
    # addcmul/addcdiv's per-tensor scales given as one tensor: no per-tensor overload reads a
    # scale from a tensor (``value`` is a number), so the product is scaled by the element.
    scales = None
    if base.rstrip("_") in ("addcmul", "addcdiv") and schema.overload_name == "Tensor":
        *rest, scales = args
        args = tuple(rest)
    results: list[Any] = []
    try:
        for i in range(n):
            a = [v[i] if listed else v for v, listed in zip(args, positional)]
            kw = {k: v[i] if is_list.get(k) else v for k, v in kwargs.items()}
            if scales is not None:
                self, t1, t2 = a[:3]
                term = aten.mul(t1, t2) if base.startswith("addcmul") else aten.div(t1, t2)
                term = aten.mul(term, scales[i])
                results.append(aten.add_(self, term) if inplace else aten.add(self, term))
            elif base.rstrip("_") in ("addcmul", "addcdiv"):  # the scale is keyword-only
                scale = {"value": a[3]} if len(a) > 3 else {}
                results.append(getattr(aten, base)(*a[:3], **scale, **kw))
            elif base in _FOREACH_AS:
                results.append(_FOREACH_AS[base](*a, **kw))
            elif hasattr(aten, base):
                results.append(getattr(aten, base)(*a, **kw))
            elif inplace and hasattr(aten, base[:-1]):  # no in-place variant (maximum_)
                results.append(aten.copy_(a[0], getattr(aten, base[:-1])(*a, **kw)))
            else:
                raise RuntimeError(f"no per-tensor op aten.{base}")
    except PlanError:
        raise
    except Exception as e:
        raise PlanError(
            f"{op} (the multi-tensor update of an optimizer or of a utility with foreach=True) "
            f"could not be traced as one op per tensor: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}; pass foreach=False to the optimizer "
            "(or utility)",
            _user_location_here(),
        ) from e
    return None if inplace else results


def _cse(gm: torch.fx.GraphModule) -> None:
    """An op computed again from the same inputs is computed once (an MSE loss's backward
    repeats its forward's ``sub(out, y)``). Not merged: random ops; ops after a write into
    anything since the first (a key per stretch between writes); a value that is written into
    in place, or has a view written into (two buffers would become one); the step's results
    and the values they are views of (two results would share memory); ops of different
    pipeline stages (a stage's own recomputation beats a transfer); and calls that are not
    aten ops (or ``getitem``): a custom op may be random.

    torch has such a pass (``torch._functorch.compile_utils.fx_graph_cse``), made for
    AOTAutograd's functionalized graphs: it would merge two ``clone(x)`` later written in
    place differently, which this graph (not functionalized: optimizers' in-place updates)
    can have, and it imports ``torch._inductor`` (0.7 s on a first compile here)."""
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = _with_bases(output.all_input_nodes)
    written = _with_bases(v for node in graph.nodes for v in _written_nodes(node))
    seen: dict[Any, torch.fx.Node] = {}
    stretch = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
            if target._schema.is_mutable:
                stretch += 1
                continue
            if torch.Tag.nondeterministic_seeded in target.tags:
                continue
        elif target is not operator.getitem:
            stretch += 1  # unknown: it may write anything
            continue
        if node in written or node in results:
            continue
        stage = node.meta.get("custom", {}).get("md_stage")
        try:
            key = (target, stretch, repr(stage), _frozen(node.args), _frozen(node.kwargs))
            kept = seen.get(key)
        except TypeError:  # an argument that cannot be hashed
            continue
        if kept is None:
            seen[key] = node
        else:
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
    gm.recompile()


def _fold_keepdim_views(gm: torch.fx.GraphModule) -> None:
    """``view(sum(x, dims, keepdim=True), shape)`` where ``shape`` only drops the summed dims
    (autograd's ``sum_to_size``: every bias gradient) becomes ``sum(x, dims)``: one step less
    on every rank at every call, the same values."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.view.default:
            continue
        src = node.args[0]
        if not (
            isinstance(src, torch.fx.Node)
            and src.op == "call_function"
            and src.target is aten.sum.dim_IntList
            and len(src.users) == 1
            and len(src.args) == 3
            and src.args[2] is True
            and isinstance(src.args[1], (list, tuple))
            and len(src.args[1]) > 0  # (no dims: every dim)
            and "val" in src.meta
            and "val" in node.meta
        ):
            continue
        kept = tuple(src.meta["val"].shape)
        summed = {d % len(kept) for d in src.args[1]} if kept else set()
        if tuple(node.meta["val"].shape) != tuple(n for d, n in enumerate(kept) if d not in summed):
            continue
        src.args = (src.args[0], src.args[1], False)  # (keeps its name)
        src.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(src)
        graph.erase_node(node)
    gm.recompile()


def _frozen(value: Any) -> Any:
    """``value`` (an op's args or kwargs) as a key: lists as tuples, each constant with its
    type (1, 1.0 and True are different arguments)."""
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, torch.fx.Node):
        return value
    if isinstance(value, float):  # (0.0 and -0.0 are equal, and differ: 1 / x)
        return (float, value, math.copysign(1.0, value))
    return (type(value), value)


def _with_bases(nodes: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    """``nodes`` and every value they are views of, through chains of views (an op whose
    result aliases an argument, by its schema or by name: ``ops.ALIASING``, which has
    ``_unsafe_view``, whose schema does not say so) and ``getitem`` of multi-output ops."""
    out: set[torch.fx.Node] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node in out:
            continue
        out.add(node)
        target = node.target
        if node.op != "call_function":
            continue
        if target is operator.getitem:  # an output of a multi-output op
            todo.extend(a for a in node.args[:1] if isinstance(a, torch.fx.Node))
        elif isinstance(target, torch._ops.OpOverload):
            schema = target._schema
            if schema.returns and schema.returns[0].alias_info is not None:
                for k, formal in enumerate(schema.arguments):
                    if formal.alias_info is not None and k < len(node.args):
                        leaves = pytree.tree_leaves(node.args[k])
                        todo.extend(a for a in leaves if isinstance(a, torch.fx.Node))
            elif base_name(str(target))[0] in ALIASING and node.args:
                todo.extend(a for a in node.args[:1] if isinstance(a, torch.fx.Node))
    return out


def _unstack(gm: torch.fx.GraphModule) -> None:
    """``select(stack([x0, x1, ...]), 0, i)`` becomes ``clone(xi)``, and a stack nothing reads
    any more goes. A foreach optimizer traced as ``torch.compile`` sees it stacks its
    per-parameter step sizes into one tensor (Adam's ``_stack_if_compiling``) that each
    parameter's update then selects from: one value made of every parameter's step count,
    which would tie each pipeline stage's update to every other stage's. Only where no op
    between the stack and the select writes into ``xi`` (the clone reads it at the select)
    and none writes into the selected value (it is a view of the stack)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {node: k for k, node in enumerate(nodes)}
    writes = {node: _written_nodes(node) for node in nodes}
    written_at: dict[torch.fx.Node, list[int]] = defaultdict(list)  # value -> writes, in order
    for k, node in enumerate(nodes):
        for v in writes[node]:
            written_at[v].append(k)
    changed = False
    for node in nodes:
        if node.target is not aten.select.int or len(node.args) != 3 or node.args[1] != 0:
            continue
        stack, _, i = node.args
        if (
            not isinstance(stack, torch.fx.Node)
            or stack.target is not aten.stack.default
            or stack.kwargs
            or (len(stack.args) > 1 and stack.args[1] != 0)
            or not isinstance(i, int)
        ):
            continue
        # (aten.stack's first argument is its list of tensors)
        x = cast("list[torch.fx.Node]", stack.args[0])[i]
        lo, hi = order[stack], order[node]
        if any(lo < k < hi for k in written_at.get(x, ())) or any(
            node in writes.get(u, ()) for u in node.users
        ):
            continue
        with graph.inserting_before(node):
            clone = graph.call_function(aten.clone.default, (x,))
        clone.meta = dict(node.meta)
        node.replace_all_uses_with(clone)
        graph.erase_node(node)
        changed = True
    for node in nodes:
        if changed and node.target is aten.stack.default and not node.users:
            graph.erase_node(node)
    if changed:
        gm.recompile()


def _written_nodes(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The graph values ``node``'s op writes into (its schema's mutable arguments)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return set()
    out: set[torch.fx.Node] = set()
    for k, a in schema_writes(target):
        value = node.args[k] if k < len(node.args) else node.kwargs.get(a.name)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, torch.fx.Node):
                out.add(v)
    return out


def _user_location_here() -> str:
    """``file:line`` of the innermost user frame of the current stack."""
    return innermost_user(traceback.extract_stack())


@dataclass
class Captured:
    """The traced step: ``graph`` takes the flat ``input_names`` (in that order) and returns the
    flat values named by ``output_names``."""

    graph: torch.fx.GraphModule
    input_names: list[str]
    input_kinds: list[str]
    input_values: list[torch.Tensor]  # the real tensors (args, params, state) of this call
    output_names: list[str]
    output_kinds: list[str]
    out_spec: Any  # pytree spec of the function's own result
    # Optimizer settings taken in as inputs of kind "hyper" (``compiler/hyper.py``): the
    # settings (``hyper.Hyper``), and per such input how its value follows from them
    # (``hyper.Lifted``, in the order of those inputs).
    hypers: tuple[Any, ...] = ()
    lifted: tuple[Any, ...] = ()
    not_lifted: str = ""  # why settings asked to be inputs stayed constants


# ---- what the function uses ------------------------------------------------------------------


def used_objects(
    fn: Callable[..., Any],
) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
    """The modules and optimizers ``fn`` reaches through its closure and globals, by name,
    and through those of the plain functions it calls there (a ``train_step`` that calls the
    user's ``update(...)`` helper, which holds the optimizer), a few levels deep; a name one
    of them already took for another object becomes ``<function>_<name>``."""
    modules: dict[str, nn.Module] = {}
    optimizers: dict[str, torch.optim.Optimizer] = {}
    _collect_objects(fn, modules, optimizers, set(), depth=0)
    return modules, optimizers


_USED_DEPTH = 4  # how deep used_objects follows the user's helper functions


def _collect_objects(
    fn: Callable[..., Any],
    modules: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    seen: set[int],
    depth: int,
) -> None:
    for holder, name, value in _walk(fn, seen, depth):
        if isinstance(value, (nn.Module, torch.optim.Optimizer)):
            named: dict[str, Any] = modules if isinstance(value, nn.Module) else optimizers
            key = name if name not in named else f"{holder.__name__}_{name}"
            named.setdefault(key, value)


def walk_used(fn: Callable[..., Any]) -> Iterator[tuple[str, Any]]:
    """(name, value) of every object ``fn`` reaches as ``used_objects`` looks (its closure and
    globals, and those of the user's helper functions it calls, a few levels deep), once."""
    for _, name, value in _walk(fn, set(), 0):
        yield name, value


def _walk(fn: Callable[..., Any], seen: set[int], depth: int) -> Iterator[tuple[Any, str, Any]]:
    """(function, name, value) of the closure and global values ``fn`` uses not in ``seen``
    (ids; added), then those of the user's helper functions among them, depth first."""
    code = fn.__code__
    found: list[tuple[str, Any]] = []
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            found.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            pass
    for name in _global_names(code):
        if name in fn.__globals__:
            found.append((name, fn.__globals__[name]))
    helpers = []
    for name, value in found:
        if id(value) in seen:
            continue
        seen.add(id(value))
        yield fn, name, value
        if isinstance(value, types.FunctionType) and _users_function(value):
            helpers.append(value)
    if depth < _USED_DEPTH:
        for helper in helpers:
            yield from _walk(helper, seen, depth + 1)


def _users_function(fn: types.FunctionType) -> bool:
    """Whether ``fn`` is the user's own (not torch's or ours): worth looking into."""
    module = getattr(fn, "__module__", None) or ""
    return module.split(".")[0] not in ("torch", "monarch_dsl", "numpy", "functools")


def _global_names(code: CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:  # nested functions and comprehensions
        if inspect.iscode(const):
            names += _global_names(const)
    return names


# ---- tracing ---------------------------------------------------------------------------------


class _OutInfo(TypedDict, total=False):
    """What tracing the step found out about its results."""

    spec: pytree.TreeSpec  # of the function's own result
    n_out: int  # its tensors
    state: list[str]  # the optimizer state and gradients the step leaves, by name


def capture(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    state: dict[str, torch.Tensor] | None = None,
    values: dict[str, torch.Tensor] | None = None,
) -> Captured:
    """Trace ``fn(*args, **kwargs)`` with its modules' and optimizers' state as inputs.

    ``state``: the optimizer state and gradients to trace with (``<param>.<key>``, whole
    shapes), instead of what the local optimizers and parameters hold — a compiled step keeps
    its state on the workers. ``values``: stand-ins for parameters/buffers by name (same
    shapes), for the same reason."""
    from torch.fx.experimental.proxy_tensor import make_fx

    modules, optimizers = used_objects(fn)
    params: dict[str, torch.Tensor] = {}  # name -> tensor, modules' params then buffers
    kinds: dict[str, str] = {}
    owner: dict[int, str] = {}
    for mname, mod in modules.items():
        for pname, param in mod.named_parameters(remove_duplicate=True):
            if id(param) not in owner:
                owner[id(param)] = f"{mname}.{pname}"
                params[owner[id(param)]] = param
                kinds[owner[id(param)]] = "param"
        for bname, b in mod.named_buffers(remove_duplicate=True):
            if id(b) not in owner:
                owner[id(b)] = f"{mname}.{bname}"
                params[owner[id(b)]] = b
                kinds[owner[id(b)]] = "buffer"
    for oname, opt in optimizers.items():
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in owner:
                    owner[id(p)] = f"{oname}.param_groups.{gi}.{pi}"
                    params[owner[id(p)]] = p
                    kinds[owner[id(p)]] = "param"

    # Existing optimizer state and gradients: inputs too.
    given_state = state
    state = {}
    for opt in optimizers.values() if given_state is None else ():
        for p, entries in opt.state.items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor) and id(p) in owner:
                    state[f"{owner[id(p)]}.{key}"] = value
    for name, p in params.items() if given_state is None else ():
        if kinds[name] == "param" and p.grad is not None:
            state[f"{name}.grad"] = p.grad
    if given_state is not None:
        state = dict(given_state)

    sig = inspect.signature(fn)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{fn.__qualname__}: {e}") from None
    arg_names: list[str] = []
    arg_values: list[torch.Tensor] = []
    templates: list[tuple[str, pytree.TreeSpec, list[Any]]] = []  # (argument name, spec, leaves)
    for pname, value in bound.arguments.items():
        leaves, spec = pytree.tree_flatten(value)
        templates.append((pname, spec, leaves))
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                arg_names.append(pname if leaf is value else f"{pname}.{i}")
                arg_values.append(leaf)
    param_names = list(params)
    param_values = [(values or {}).get(n, params[n]) for n in param_names]
    state_names, state_values = list(state), list(state.values())
    n_args, n_params = len(arg_values), len(param_values)

    out_info: _OutInfo = {}

    def flat_step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = flat[:n_args]
        p = flat[n_args : n_args + n_params]
        s = flat[n_args + n_params :]
        traced = dict(zip(param_names, p))
        restore = _swap_in(modules, optimizers, params, traced, owner)
        try:
            # Gradients: existing ones are inputs; none otherwise.
            for name, t in zip(param_names, p):
                if kinds[name] == "param":
                    g = state_names.index(f"{name}.grad") if f"{name}.grad" in state else -1
                    t.grad = s[g] if g >= 0 else None
            by_param = {id(t): name for name, t in traced.items()}
            for opt in optimizers.values():
                opt.state = defaultdict(dict)
            for sname, value in zip(state_names, s):
                pname, _, key = sname.rpartition(".")
                if key == "grad":
                    continue
                for opt in optimizers.values():
                    if any(
                        id(q) == id(traced[pname]) for g in opt.param_groups for q in g["params"]
                    ):
                        opt.state[traced[pname]][key] = value
            it = iter(a)
            arguments: dict[str, Any] = {}
            for pname, spec, leaves in templates:
                leaves = [next(it) if isinstance(v, torch.Tensor) else v for v in leaves]
                arguments[pname] = pytree.tree_unflatten(leaves, spec)
            call = inspect.BoundArguments(sig, arguments)
            result = fn(*call.args, **call.kwargs)
            # A None (a step that returns nothing, or None in its result) comes back as None.
            result = pytree.tree_map(lambda v: _Nothing() if v is None else v, result)
            flat_out, spec = pytree.tree_flatten(result)
            out_info["spec"] = spec
            out_info["n_out"] = len(flat_out)
            for v in flat_out:
                if not isinstance(v, torch.Tensor):
                    raise PlanError(
                        f"{fn.__qualname__} returns a {type(v).__name__}; a compiled step "
                        "may return only tensors (in any pytree)"
                    )
            # State the step created or kept, and gradients.
            kept: list[tuple[str, torch.Tensor]] = []
            for opt in optimizers.values():
                for t, entries in opt.state.items():
                    state_of = by_param.get(id(t))
                    for key, value in entries.items():
                        if isinstance(value, torch.Tensor) and state_of is not None:
                            kept.append((f"{state_of}.{key}", value))
            for name, t in zip(param_names, p):
                if kinds[name] == "param" and t.grad is not None:
                    kept.append((f"{name}.grad", t.grad))
            out_info["state"] = [n for n, _ in kept]
            return tuple(flat_out) + tuple(v for _, v in kept)
        finally:
            for name, t in zip(param_names, p):
                if kinds[name] == "param":
                    t.grad = None
            restore()

    example: list[torch.Tensor] = []
    for v in arg_values:
        example.append(v.detach().requires_grad_(v.requires_grad))
    for name, v in zip(param_names, param_values):
        t = v.detach()
        if kinds[name] == "param":
            t = t.requires_grad_(params[name].requires_grad)
        example.append(t)
    example += [v.detach() for v in state_values]

    # fx keeps only "forward" frames in node stack traces, plus registered anchors: the step
    # function is one, so its ops (and the backward and optimizer it calls) carry its lines.
    anchor = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)
    if anchor is not None:
        anchor(fn)
    from monarch_dsl.compiler.stages import tracing_stages

    with (
        unittest.mock.patch("torch.compiler.is_compiling", lambda: True),
        unittest.mock.patch.object(torch.fx.proxy, "CapturedTraceback", _UserFrames),
        tracing_stages(),
    ):
        try:
            gm = make_fx(
                flat_step,
                tracing_mode="fake",
                decomposition_table=decompositions(),
                record_stack_traces=True,
            )(*example)
        except PlanError:
            raise
        except Exception as e:  # data-dependent control flow and friends
            loc = user_location_of_exception(e)
            if _is_data_dependent(e):
                raise PlanError(
                    f"{fn.__qualname__}: control flow that depends on a tensor's value cannot "
                    "be compiled (Python branches on shapes are fine; use torch.where for "
                    f"values): {type(e).__name__}: {str(e).splitlines()[0]}",
                    loc,
                ) from e
            hint = ""
            if _in_foreach(e):
                hint = (
                    " (in the multi-tensor path of an optimizer or utility with foreach=True: "
                    "construct it with foreach=False)"
                )
            raise PlanError(
                f"{fn.__qualname__} could not be traced{hint}: {type(e).__name__}: {e}", loc
            ) from e

    _unstack(gm)
    _cse(gm)
    _fold_keepdim_views(gm)
    n_out = out_info["n_out"]
    state_out = out_info["state"]
    input_names = arg_names + param_names + state_names
    input_kinds = ["arg"] * n_args + [kinds[n] for n in param_names] + ["state"] * len(state_names)
    output_names = [f"out{i}" for i in range(n_out)] + state_out
    output_kinds = ["out"] * n_out + ["grad" if n.endswith(".grad") else "state" for n in state_out]
    return Captured(
        graph=gm,
        input_names=input_names,
        input_kinds=input_kinds,
        input_values=arg_values + param_values + state_values,
        output_names=output_names,
        output_kinds=output_kinds,
        out_spec=out_info["spec"],
    )


def _leaves(value: Any) -> list[Any]:
    return pytree.tree_flatten(value)[0]


def _swap_in(
    modules: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    params: dict[str, torch.Tensor],
    traced: dict[str, torch.Tensor],
    owner: dict[int, str],
) -> Callable[[], None]:
    """Put the traced tensors in place of the modules' parameters/buffers and the optimizers'
    params and state; returns a function that puts the originals back."""
    undo: list[Callable[[], None]] = []
    by_id = {id(params[n]): traced[n] for n in params}
    for mod in modules.values():
        for sub in mod.modules():
            # (while tracing, a module's parameters are the traced tensors: not Parameters)
            tables: tuple[dict[str, Any], ...] = (sub._parameters, sub._buffers)
            for table in tables:
                for key, value in list(table.items()):
                    if value is not None and id(value) in by_id:
                        table[key] = by_id[id(value)]
                        undo.append(functools.partial(table.__setitem__, key, value))
    for opt in optimizers.values():
        old_state = opt.state
        old_params = [list(g["params"]) for g in opt.param_groups]
        for g in opt.param_groups:
            g["params"] = [by_id.get(id(p), p) for p in g["params"]]

        def put_back(
            opt: torch.optim.Optimizer = opt,
            old_state: defaultdict[torch.Tensor, Any] = old_state,
            old_params: list[list[torch.Tensor]] = old_params,
        ) -> None:
            opt.state = old_state
            for g, ps in zip(opt.param_groups, old_params):
                g["params"] = ps

        undo.append(put_back)

    def restore() -> None:
        for f in reversed(undo):
            f()

    return restore


# ---- the user's source lines -----------------------------------------------------------------


class _UserFrames:
    """Stands in for torch's ``CapturedTraceback`` while a step is traced: fx keeps only the
    frames named ``forward`` and the registered anchors of a node's stack, so only those are
    collected, without reading source lines (torch's full capture and formatting of every
    frame for every node was a third of the tracing time)."""

    def __init__(self, frame: FrameType | None) -> None:
        self.frame = frame

    @classmethod
    def extract(cls, *args: Any, **kwargs: Any) -> _UserFrames:
        return cls(sys._getframe(1))

    def summary(self) -> traceback.StackSummary:
        anchors = getattr(torch.fx.proxy, "_STACK_TRACE_ANCHORS", ())
        frames: list[traceback.FrameSummary] = []
        f = self.frame
        while f is not None:
            code = f.f_code
            if code.co_name == "forward" or (code.co_filename, code.co_name) in anchors:
                frames.append(
                    traceback.FrameSummary(code.co_filename, f.f_lineno, code.co_name, line="")
                )
            f = f.f_back
        return traceback.StackSummary.from_list(frames[::-1])


class _Nothing:
    """A ``None`` in a compiled step's result: a pytree node with no leaves, which unflattens
    back to ``None`` (pytree takes ``None`` for a leaf, and a plan's outputs are tensors)."""


pytree.register_pytree_node(_Nothing, lambda _: ([], None), lambda _children, _context: None)

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def user_location(stack_trace: str | None) -> str:
    """``file:line`` of the innermost user frame in an fx node's recorded stack trace."""
    if not stack_trace:
        return ""
    return innermost_user(_FRAME.findall(stack_trace))


def user_location_of_exception(e: BaseException) -> str:
    return innermost_user(traceback.extract_tb(e.__traceback__))


def _is_data_dependent(e: BaseException) -> bool:
    names = {type(x).__name__ for x in _chain(e)}
    return bool(
        names
        & {
            "DataDependentOutputException",
            "GuardOnDataDependentSymNode",
            "DynamicOutputShapeException",
        }
    ) or any("data-dependent" in str(x) or "data dependent" in str(x) for x in _chain(e))


def _in_foreach(e: BaseException) -> bool:
    """Whether ``e`` was raised in a foreach (multi-tensor) op or a torch function calling
    them (``torch.optim.adam._multi_tensor_adam``, ``_foreach_norm`` in clip_grad_norm_)."""
    for x in _chain(e):
        if FOREACH in str(x):
            return True
        for frame in traceback.extract_tb(x.__traceback__):
            if frame.name.startswith("_multi_tensor_") or FOREACH in frame.name:
                return True
    return False


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


# ---- the graph as a plan ---------------------------------------------------------------------

_DROPPED = {
    "profiler._record_function_enter_new.default",
    "profiler._record_function_exit._RecordFunction",
}


def _type_of(val: Any, ndims: int) -> TensorType:
    rep = (Replicate(),) * ndims
    if isinstance(val, torch.Tensor):
        return TensorType(tuple(int(s) for s in val.shape), dtype_name(val.dtype), rep)
    kind = "float64" if isinstance(val, float) else "bool" if isinstance(val, bool) else "int64"
    return TensorType(None, kind, rep)


def to_plan(captured: Captured, mesh: tuple[tuple[str, int], ...], name: str) -> Plan:
    """The captured graph as a plan over ``mesh`` with every placement Replicate (the
    ``propagate`` pass decides them); profiler markers are dropped."""
    gm = captured.graph
    nd = len(mesh)
    names: dict[Any, str] = {}
    inputs: list[Input] = []
    body: list[Instr] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, iname, kind, value in zip(
        placeholders, captured.input_names, captured.input_kinds, captured.input_values
    ):
        names[node] = iname
        inputs.append(Input(iname, kind, _type_of(node.meta.get("val", value), nd)))

    fresh = FreshNames(captured.input_names).fresh

    def arg(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            if value not in names:
                raise PlanError(f"internal: {value} used before definition")
            return Var(names[value])
        if isinstance(value, (list, tuple)):
            return type(value)(arg(v) for v in value)
        if isinstance(value, torch.SymInt | torch.SymFloat):
            raise PlanError("a dynamic size reached the plan; shapes must be static")
        return value

    getitems: dict[Any, dict[int, Any]] = defaultdict(dict)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator_getitem:
            getitems[node.args[0]][node.args[1]] = node

    outputs: list[Output] = []
    phase: dict[str, str] = {}  # by an instruction's first out
    stage: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if not isinstance(value, torch.Tensor) or value.dim() != 0:
                raise PlanError(
                    "a constant tensor that is not a scalar in the step "
                    f"(shape {tuple(getattr(value, 'shape', ()))}); pass it as an argument",
                    user_location(node.meta.get("stack_trace")),
                )
            names[node] = fresh(node.name.lstrip("_"))
            body.append(
                Instr(
                    (names[node],),
                    "aten.scalar_tensor.default",
                    (value.item(),),
                    # (a device: each worker puts its own there, as for every factory op)
                    (("dtype", value.dtype), ("device", torch.device("cpu"))),
                    (_type_of(value, nd),),
                    loc=user_location(node.meta.get("stack_trace")),
                )
            )
            continue
        if node.op == "output":
            flat = pytree.tree_flatten(node.args[0])[0]
            for oname, okind, value in zip(captured.output_names, captured.output_kinds, flat):
                outputs.append(Output(oname, okind, names[value]))
            continue
        if node.target is operator_getitem:
            continue  # named by its producer
        op = str(node.target)
        if op in _DROPPED:
            continue
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            raise PlanError(f"cannot compile {node.op} {node.target}")
        val = node.meta.get("val")
        loc = user_location(node.meta.get("stack_trace"))
        outs: list[str]
        types: tuple[TensorType, ...]
        if isinstance(val, (list, tuple)):
            outs = []
            for i in range(len(val)):
                g = getitems[node].get(i)
                oname = fresh(g.name if g is not None else f"{node.name}_{i}")
                if g is not None:
                    names[g] = oname
                outs.append(oname)
            types = tuple(_type_of(v, nd) for v in val)
        else:
            outs = [fresh(node.name)]
            names[node] = outs[0]
            types = (_type_of(val, nd),)
        custom = node.meta.get("custom") or {}
        if outs:
            phase[outs[0]] = custom.get("md_phase", "forward")
            if "md_stage" in custom:
                stage[outs[0]] = custom["md_stage"]
        body.append(
            Instr(
                tuple(outs),
                op,
                arg(tuple(node.args)),
                tuple((k, arg(v)) for k, v in node.kwargs.items()),
                types,
                loc=loc,
            )
        )
    return Plan(
        name=name,
        mesh=mesh,
        inputs=tuple(inputs),
        body=tuple(body),
        outputs=tuple(outputs),
        out_spec=captured.out_spec,
        notes={"phase": phase, "stage": stage},
    )


import operator as _operator  # noqa: E402

operator_getitem = _operator.getitem
