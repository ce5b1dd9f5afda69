"""The text form of a plan: ``format_plan`` prints it, ``parse_plan`` reads it back, exactly.

::

  plan step(pp=2, dp=2) micro_batches=4
    in %x: f32[8,16] {pp: R, dp: S(1)}  # arg
    in %w: f32[16,16] {pp: R, dp: S(0)}  # param
    %m = aten.mm.default(%x, %w)  # f32[8,16] {pp: R, dp: P(sum)} main  t.py:3
    %r = all_reduce(%m, dims=(dp,), op="sum")  # f32[8,16] {pp: R, dp: R} comms  t.py:4  why: "P->R"
    send(%r, dims=(pp,), peer=1) on pp=0  # comms  t.py:5  why: "stage 0 -> 1"
    out %out0 = %r  # out

One line per input, instruction and output. An instruction reads like a call; ``on pp=0``
says which ranks run it. What follows ``#`` is data, not a comment: the type of each result
(dtype, shape — none for a Python scalar — and a placement per mesh dim, labelled with the
dim), the stream, the user's ``file:line`` (quoted when it is not a plain path) and, for what
the compiler inserted, ``why:`` and the reason. Strings are double-quoted with backslash
escapes; a name that is not plain (``%"a b"``, an op that is not a dotted name) is quoted the
same way. Mesh dim names in a ``dims=`` argument are written bare: ``dims=(dp, tp)``.

``parse_plan(format_plan(p)) == p`` for every plan, and ``format_plan(parse_plan(s)) == s``
for every text ``format_plan`` gives. The grammar is the ``plan`` rule of ``grammar/plan.lark``.
"""

from __future__ import annotations

import ast
import re
import warnings
from typing import Any

from monarch_dsl.compiler.plan import (
    DTYPE_NAMES,
    IMPLEMENTATIONS,
    INPUT_KINDS,
    OUTPUT_KINDS,
    STREAMS,
    Input,
    Instr,
    Output,
    Partial,
    Placement,
    Plan,
    PlanSyntaxError,
    Replicate,
    Shard,
    TensorType,
    Var,
    format_placements,
)

__all__ = ["format_plan", "parse_plan"]

INDENT = "  "

# What may be written bare; everything else is quoted. These mirror terminals of plan.lark
# (VAR, DOTTED, NAME, LOC); a test checks that they agree.
_BARE_VAR = re.compile(r"[A-Za-z0-9_.]+")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LOC = re.compile(r"""[^\s"'%#(][^\s"'(]*:[0-9]+""")
# Words the grammar reads as keywords (or as a float): a name spelled like one is quoted.
_KEYWORDS = frozenset(
    "plan micro_batches in out on why None True False device inf nan S R P".split()
)
_DTYPES = {short: name for name, short in DTYPE_NAMES.items()}

# ---- printing ------------------------------------------------------------------------------


def format_plan(plan: Plan) -> str:
    """The text of ``plan``: a header, then one indented line per input, instruction, output."""
    dims = plan.dims
    mesh = ", ".join(f"{d}={n}" for d, n in plan.mesh)
    header = f"plan {_plain_or_quoted(plan.name, _DOTTED)}({mesh})"
    if plan.micro_batches != 1:
        header += f" micro_batches={plan.micro_batches}"
    lines = [header]
    for i in plan.inputs:
        lines.append(f"{INDENT}in {_var(i.name)}: {_type(i.type, dims)}  # {i.kind}")
    for ins in plan.body:
        lines.append(INDENT + _instr(ins, dims))
    for o in plan.outputs:
        lines.append(f"{INDENT}out {_var(o.name)} = {_var(o.var)}  # {o.kind}")
    return "\n".join(lines)


def _instr(ins: Instr, dims: tuple[str, ...]) -> str:
    args = [_value(a) for a in ins.args]
    for k, v in ins.kwargs:
        args.append(f"{_plain_or_quoted(k, _IDENT)}={_value(v, bare_names=k == 'dims')}")
    code = f"{_plain_or_quoted(ins.op, _DOTTED)}({', '.join(args)})"
    if ins.outs:
        code = f"{', '.join(_var(o) for o in ins.outs)} = {code}"
    if ins.on:
        code += " on " + ", ".join(f"{d}={i}" for d, i in ins.on)
    types = ", ".join(_type(t, dims) for t in ins.types)
    data = [f"{types} {ins.stream}" if types else ins.stream]
    if ins.loc:
        data.append(ins.loc if _LOC.fullmatch(ins.loc) else _quote(ins.loc))
    if ins.reason:
        data.append(f"why: {_quote(ins.reason)}")
    return f"{code}  # {'  '.join(data)}"


def _type(t: TensorType, dims: tuple[str, ...]) -> str:
    dtype = DTYPE_NAMES.get(t.dtype, t.dtype)
    shape = "" if t.shape is None else f"[{','.join(str(n) for n in t.shape)}]"
    return f"{dtype}{shape} {format_placements(t.placements, dims)}"


def _value(v: Any, bare_names: bool = False) -> str:
    """One argument value. ``bare_names``: write identifier strings bare (mesh dim names)."""
    if isinstance(v, Var):
        return _var(v.name)
    if v is None or isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return int.__repr__(v)
    if isinstance(v, float):
        return float.__repr__(v)
    if isinstance(v, str):
        if bare_names and _IDENT.fullmatch(v) and v not in _KEYWORDS:
            return v
        return _quote(v)
    if isinstance(v, tuple):
        items = [_value(x, bare_names) for x in v]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if isinstance(v, list):
        return f"[{', '.join(_value(x, bare_names) for x in v)}]"
    import torch

    if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
        text = str(v)  # torch.float32, torch.strided, torch.contiguous_format
        if getattr(torch, text.removeprefix("torch."), None) is v:
            return text
    elif isinstance(v, torch.device):
        return f"device({_quote(str(v))})"
    raise TypeError(
        f"cannot print argument value {v!r} of type {type(v).__name__}: plan arguments are "
        "Var, None, bool, int, float, str, torch dtype/layout/memory_format/device, and "
        "tuples and lists of them"
    )


def _var(name: str) -> str:
    return "%" + (name if _BARE_VAR.fullmatch(name) else _quote(name))


def _plain_or_quoted(name: str, plain: re.Pattern[str]) -> str:
    return name if plain.fullmatch(name) and name not in _KEYWORDS else _quote(name)


def _quote(s: str) -> str:
    """``s`` in double quotes: printable characters as they are, the rest as Python escapes."""
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])  # \n, \t, \x00, \u2028, ...
    out.append('"')
    return "".join(out)


# ---- parsing -------------------------------------------------------------------------------


def parse_plan(text: str) -> Plan:
    """The plan whose text is ``text``; ``PlanSyntaxError`` says at which line and column it
    does not parse, and what was expected there."""
    if not isinstance(text, str):
        raise TypeError(f"parse_plan() takes a str, got {type(text).__name__}")
    import lark.exceptions

    from monarch_dsl.grammar import explain, parser

    try:
        tree = parser("plan").parse(text)
    except lark.exceptions.UnexpectedInput as e:
        raise PlanSyntaxError(f"cannot parse plan: {explain(e, text, 'plan')}") from None
    return _Reader(text).plan(tree)


class _Reader:
    """Builds the Plan from the parse tree of ``plan.lark``'s ``plan`` rule, checking what the
    grammar cannot (dtype names, streams, kinds, placement labels)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.dims: tuple[str, ...] = ()

    def error(self, token: Any, message: str) -> PlanSyntaxError:
        line, column = token.line, token.column
        source = self.text.split("\n")[line - 1]  # lark counts lines by \n alone
        where = f"at line {line}, column {column}"
        caret = " " * (column - 1) + "^"
        return PlanSyntaxError(f"cannot parse plan: {where}: {message}\n{source}\n{caret}")

    def plan(self, tree: Any) -> Plan:
        name_tree, *rest = tree.children
        name = self.string(name_tree.children[0])
        mesh, inputs, body, outputs, micro_batches = [], [], [], [], 1
        for child in rest:
            rule = child.data
            if rule == "mesh_dim":
                dim, size = child.children
                mesh.append((str(dim), int(size)))
                self.dims = tuple(d for d, _ in mesh)
            elif rule == "micro_batches":
                micro_batches = int(child.children[0])
            elif rule == "plan_input":
                var, type_tree, kind_token = child.children
                kind = self.one_of(kind_token, INPUT_KINDS, "input kind")
                inputs.append(Input(self.var(var), kind, self.type(type_tree)))
            elif rule == "plan_instr":
                body.append(self.instr(child))
            else:  # plan_output
                name_token, var, kind_token = child.children
                kind = self.one_of(kind_token, OUTPUT_KINDS, "output kind")
                outputs.append(Output(self.var(name_token), kind, self.var(var)))
        return Plan(name, tuple(mesh), tuple(inputs), tuple(body), tuple(outputs), micro_batches)

    def instr(self, tree: Any) -> Instr:
        outs: tuple[str, ...] = ()
        on: tuple[tuple[str, int], ...] = ()
        types, loc, reason = [], "", ""
        op: str | None = None
        stream: str | None = None
        op_token: Any = None
        args: list[Any] = []
        kwargs: list[tuple[str, Any]] = []
        for child in tree.children:
            if not hasattr(child, "data"):  # the one bare token: the stream
                stream = self.one_of(child, STREAMS, "stream")
            elif child.data == "instr_outs":
                outs = tuple(self.var(v) for v in child.children)
            elif child.data == "op_name":
                op_token = child.children[0]
                op = self.string(op_token)
            elif child.data == "call":
                for arg in child.children:
                    if arg.data == "kwarg":
                        key, value = arg.children
                        kwargs.append((self.string(key), self.value(value)))
                    elif kwargs:
                        raise self.error(
                            _first_token(arg, op_token), "a positional argument after a keyword"
                        )
                    else:
                        args.append(self.value(arg.children[0]))
            elif child.data == "on_filter":
                on = tuple((str(d), int(i)) for d, i in (item.children for item in child.children))
            elif child.data == "type":
                types.append(self.type(child))
            elif child.data == "loc":
                loc = self.string(child.children[0])
            else:  # reason
                reason = self.string(child.children[0])
        assert op is not None and stream is not None  # (the grammar's plan_instr has both)
        return Instr(outs, op, tuple(args), tuple(kwargs), tuple(types), stream, on, loc, reason)

    def type(self, tree: Any) -> TensorType:
        dtype_token, *rest = tree.children
        shape = None
        if rest[0].data == "shape":
            shape = tuple(int(n) for n in rest.pop(0).children)
        placements = []
        for i, item in enumerate(rest[0].children):
            *label, placement = item.children
            want = f"{self.dims[i]}:" if i < len(self.dims) else None
            if (str(label[0]) if label else None) != want:
                token = label[0] if label else _first_token(placement, dtype_token)
                found = f"{str(label[0])!r}" if label else "no label"
                expected = f"the label {want!r}" if want else "no label (the mesh has no more dims)"
                raise self.error(token, f"placement {i}: expected {expected}, found {found}")
            placements.append(self.placement(placement))
        return TensorType(shape, self.dtype(dtype_token), tuple(placements))

    def placement(self, tree: Any) -> Placement:
        if tree.data == "shard":
            return Shard(int(tree.children[0]))
        if tree.data == "replicate":
            return Replicate()
        op = tree.children[0]
        try:
            return Partial(str(op))
        except ValueError as e:
            raise self.error(op, str(e)) from None

    def dtype(self, token: Any) -> str:
        name = str(token)
        if name in _DTYPES:
            return _DTYPES[name]
        if name in DTYPE_NAMES:
            raise self.error(token, f"write the dtype {name} as {DTYPE_NAMES[name]}")
        import torch

        if not isinstance(getattr(torch, name, None), torch.dtype):
            short = ", ".join(_DTYPES)
            raise self.error(
                token, f"unknown dtype {name!r} (expected one of {short}, or a torch dtype name)"
            )
        return name

    def one_of(self, token: Any, allowed: tuple[str, ...], what: str) -> str:
        if str(token) not in allowed:
            raise self.error(
                token, f"unknown {what} {str(token)!r} (expected one of {', '.join(allowed)})"
            )
        return str(token)

    def value(self, tree: Any) -> Any:
        kind, children = tree.data, tree.children
        if kind == "var":
            return Var(self.var(children[0]))
        if kind in ("none", "true", "false"):
            return {"none": None, "true": True, "false": False}[kind]
        if kind == "int":
            return int(children[0])
        if kind == "float":
            return float(children[0])
        if kind in ("string", "name"):
            return self.string(children[0])
        if kind == "tuple":
            return tuple(self.value(c) for c in children)
        if kind == "list":
            return [self.value(c) for c in children]
        import torch

        token = children[0]
        if kind == "torch":
            value = getattr(torch, str(token).removeprefix("torch."), None)
            if not isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                raise self.error(token, f"{token} is not a torch dtype, layout or memory format")
            return value
        try:  # device("cuda:0")
            return torch.device(self.string(token))
        except RuntimeError as e:
            raise self.error(token, f"not a device: {e}") from None

    def var(self, token: Any) -> str:
        return self.string(token, str(token)[1:])

    def string(self, token: Any, text: str | None = None) -> str:
        """A bare name as it is; a quoted one (``"..."``) decoded."""
        text = str(token) if text is None else text
        if not text.startswith(("'", '"')):
            return text
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # an unknown escape such as \q
                value: str = ast.literal_eval(text)  # (a STRING token: a str literal)
        except (SyntaxError, ValueError, Warning) as e:
            raise self.error(token, f"bad string {text}: {e}") from None
        return value


def _first_token(tree: Any, default: Any) -> Any:
    """The first token in ``tree`` (for an error's position), or ``default`` if it has none
    (keywords such as ``R`` or ``None`` are not kept in the tree)."""
    return next(iter(tree.scan_values(lambda v: True)), default)


IMPLEMENTATIONS["format"] = format_plan
IMPLEMENTATIONS["parse"] = parse_plan
