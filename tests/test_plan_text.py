"""Pure tests of a plan's text form (``compiler/text.py``, the ``plan`` rule of ``plan.lark``):
printing, parsing back exactly, and syntax errors that point. No processes, no devices."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch_dsl.compiler import text as plan_text
from monarch_dsl.compiler.plan import (
    COMM_OPS,
    DTYPE_NAMES,
    INPUT_KINDS,
    LOCAL_OPS,
    OUTPUT_KINDS,
    PARTIAL_OPS,
    STREAMS,
    Input,
    Instr,
    Output,
    Partial,
    Plan,
    PlanSyntaxError,
    Replicate,
    Shard,
    TensorType,
    Var,
)
from monarch_dsl.compiler.text import format_plan, parse_plan

R = Replicate()
S0, S1 = Shard(0), Shard(1)
PSUM = Partial("sum")


def f32(shape, *placements):
    return TensorType(shape, "float32", placements)


def assert_round_trip(plan: Plan) -> str:
    """Both directions, exactly; returns the text."""
    text = format_plan(plan)
    assert format_plan(plan) == text  # deterministic
    back = parse_plan(text)
    assert back == plan
    assert format_plan(back) == text
    return text


def instr_plan(*body: Instr, mesh=(("dp", 2),), inputs=(), outputs=()) -> Plan:
    return Plan("step", mesh, tuple(inputs), tuple(body), tuple(outputs))


def op(*args, kwargs=(), outs=("y",), types=None, **fields) -> Instr:
    if types is None:
        types = tuple(f32((4,), R) for _ in outs)
    return Instr(tuple(outs), "aten.foo.default", tuple(args), tuple(kwargs), types, **fields)


# ---- a whole plan, golden text -----------------------------------------------------------------

TRAIN = Plan(
    name="step",
    mesh=(("pp", 2), ("dp", 2)),
    inputs=(
        Input("x", "arg", f32((32, 8), R, S0)),
        Input("model.0.weight", "param", f32((16, 8), R, R)),
        Input("state.fc1.weight.exp_avg", "state", f32((16, 8), R, R)),
    ),
    body=(
        Instr(
            ("t_3",),
            "aten.t.default",
            (Var("model.0.weight"),),
            (),
            (f32((8, 16), R, R),),
            loc="examples/train.py:11",
        ),
        Instr(
            ("mm_1",),
            "aten.mm.default",
            (Var("x"), Var("t_3")),
            (),
            (f32((32, 16), R, S0),),
            loc="examples/train.py:12",
        ),
        Instr(
            ("sum_1",),
            "aten.sum.default",
            (Var("mm_1"),),
            (),
            (TensorType((), "float32", (R, PSUM)),),
            loc="examples/train.py:13",
        ),
        Instr(
            ("ar_1",),
            "all_reduce",
            (Var("sum_1"),),
            (("dims", ("dp",)), ("op", "sum")),
            (TensorType((), "float32", (R, R)),),
            stream="comms",
            loc="examples/train.py:13",
            reason="Partial(sum) -> Replicate for aten.add_.Tensor",
        ),
        Instr(
            (),
            "send",
            (Var("ar_1"),),
            (("dims", ("pp",)), ("peer", 1)),
            (),
            stream="comms",
            on=(("pp", 0),),
            loc="examples/train.py:14",
            reason="stage 0 -> stage 1",
        ),
        Instr(
            ("recv_1",),
            "recv",
            (),
            (("dims", ("pp",)), ("peer", 0)),
            (TensorType((), "float32", (R, R)),),
            stream="comms",
            on=(("pp", 1),),
            loc="examples/train.py:14",
            reason="stage 0 -> stage 1",
        ),
    ),
    outputs=(Output("out0", "out", "ar_1"), Output("model.0.weight", "grad", "t_3")),
    micro_batches=4,
)

TRAIN_TEXT = """\
plan step(pp=2, dp=2) micro_batches=4
  in %x: f32[32,8] {pp: R, dp: S(0)}  # arg
  in %model.0.weight: f32[16,8] {pp: R, dp: R}  # param
  in %state.fc1.weight.exp_avg: f32[16,8] {pp: R, dp: R}  # state
  %t_3 = aten.t.default(%model.0.weight)  # f32[8,16] {pp: R, dp: R} main  examples/train.py:11
  %mm_1 = aten.mm.default(%x, %t_3)  # f32[32,16] {pp: R, dp: S(0)} main  examples/train.py:12
  %sum_1 = aten.sum.default(%mm_1)  # f32[] {pp: R, dp: P(sum)} main  examples/train.py:13
  %ar_1 = all_reduce(%sum_1, dims=(dp,), op="sum")  # f32[] {pp: R, dp: R} comms  \
examples/train.py:13  why: "Partial(sum) -> Replicate for aten.add_.Tensor"
  send(%ar_1, dims=(pp,), peer=1) on pp=0  # comms  examples/train.py:14  \
why: "stage 0 -> stage 1"
  %recv_1 = recv(dims=(pp,), peer=0) on pp=1  # f32[] {pp: R, dp: R} comms  \
examples/train.py:14  why: "stage 0 -> stage 1"
  out %out0 = %ar_1  # out
  out %model.0.weight = %t_3  # grad"""


def test_golden_text():
    assert format_plan(TRAIN) == TRAIN_TEXT
    assert parse_plan(TRAIN_TEXT) == TRAIN
    assert_round_trip(TRAIN)


def test_the_module_docstring_example_is_exact():
    lines = plan_text.__doc__.split("::\n\n")[1].split("\n\n")[0].splitlines()
    example = "\n".join(line.removeprefix("  ") for line in lines)
    assert example.startswith("plan step(pp=2, dp=2)")
    assert format_plan(parse_plan(example)) == example


def test_plan_str_and_parse_use_the_text_form():
    assert str(TRAIN) == TRAIN_TEXT
    assert Plan.parse(str(TRAIN)) == TRAIN
    assert str(Plan.parse(TRAIN_TEXT)) == TRAIN_TEXT


def test_line_breaks_are_only_whitespace():
    one_line = " ".join(line.strip() for line in TRAIN_TEXT.splitlines())
    assert parse_plan(one_line) == TRAIN
    assert parse_plan("\n\n" + TRAIN_TEXT.replace("  ", "\t") + "\n") == TRAIN


def test_parse_tolerates_other_spacing():
    text = (
        "plan  step ( dp = 2 )\n"
        "in %x : f32 [ 4 ] { dp: S ( 0 ) } # arg\n"
        "%y=aten.relu.default( %x , inplace = False )#f32[4]{dp: S(0)}main   t.py:1\n"
        "out %y=%y#out"
    )
    plan = parse_plan(text)
    assert plan.body[0].kwargs == (("inplace", False),)
    assert format_plan(plan) == (
        "plan step(dp=2)\n"
        "  in %x: f32[4] {dp: S(0)}  # arg\n"
        "  %y = aten.relu.default(%x, inplace=False)  # f32[4] {dp: S(0)} main  t.py:1\n"
        "  out %y = %y  # out"
    )


# ---- one feature at a time ----------------------------------------------------------------------


def test_header_forms():
    assert assert_round_trip(Plan("step", (), (), (), ())) == "plan step()"
    assert assert_round_trip(Plan("Model.forward", (("a", 1),), (), (), ())) == (
        "plan Model.forward(a=1)"
    )
    assert assert_round_trip(Plan("<lambda>", (), (), (), (), micro_batches=0)) == (
        'plan "<lambda>"() micro_batches=0'
    )
    # a keyword as a name is quoted
    assert assert_round_trip(Plan("plan", (), (), (), ())) == 'plan "plan"()'


@pytest.mark.parametrize(
    "placements, text",
    [
        ((S0, R), "{dp: S(0), tp: R}"),
        ((Shard(-1), PSUM), "{dp: S(-1), tp: P(sum)}"),
        ((Partial("avg"), Partial("max")), "{dp: P(avg), tp: P(max)}"),
        ((Partial("min"), S1), "{dp: P(min), tp: S(1)}"),
        # wrong lengths still print and parse back: extra entries have no label
        ((), "{}"),
        ((R,), "{dp: R}"),
        ((R, R, S0), "{dp: R, tp: R, S(0)}"),
    ],
)
def test_placements(placements, text):
    plan = instr_plan(
        mesh=(("dp", 2), ("tp", 2)), inputs=[Input("x", "arg", f32((4, 4), *placements))]
    )
    assert f"in %x: f32[4,4] {text}  # arg" in assert_round_trip(plan)


def test_a_dim_may_be_named_like_a_placement():
    plan = instr_plan(
        mesh=(("S", 2), ("R", 2), ("P", 2)), inputs=[Input("x", "arg", f32((4,), S0, R, PSUM))]
    )
    assert "{S: S(0), R: R, P: P(sum)}" in assert_round_trip(plan)


@pytest.mark.parametrize("dtype, short", sorted(DTYPE_NAMES.items()))
def test_every_short_dtype(dtype, short):
    plan = instr_plan(inputs=[Input("x", "arg", TensorType((2, 3), dtype, (R,)))])
    assert f"in %x: {short}[2,3] {{dp: R}}" in assert_round_trip(plan)


def test_other_torch_dtypes_keep_their_name():
    for dtype in ("float8_e4m3fn", "uint16", "complex128"):
        plan = instr_plan(inputs=[Input("x", "arg", TensorType((2,), dtype, (R,)))])
        assert f"in %x: {dtype}[2] {{dp: R}}" in assert_round_trip(plan)


def test_scalar_and_zero_dim_types():
    plan = instr_plan(
        op(
            Var("x"),
            outs=("n", "z"),
            types=(TensorType(None, "int64", (R,)), TensorType((), "float32", (R,))),
        )
    )
    assert "# i64 {dp: R}, f32[] {dp: R} main" in assert_round_trip(plan)


def test_several_outs_and_no_outs():
    plan = instr_plan(
        op(Var("x"), outs=("a", "b", "c")),
        op(Var("a"), outs=()),
        op(outs=(), types=(f32((1,), R),)),  # more types than outs still round-trips
    )
    text = assert_round_trip(plan)
    assert "  %a, %b, %c = aten.foo.default(%x)  # f32[4] {dp: R}, f32[4] {dp: R}, " in text
    assert "  aten.foo.default(%a)  # main" in text
    assert "  aten.foo.default()  # f32[1] {dp: R} main" in text


@pytest.mark.parametrize(
    "value, text",
    [
        (None, "None"),
        (True, "True"),
        (False, "False"),
        (0, "0"),
        (-7, "-7"),
        (2**70, str(2**70)),
        (1.0, "1.0"),
        (-0.1, "-0.1"),
        (1e-08, "1e-08"),
        (1.5e300, "1.5e+300"),
        (-0.0, "-0.0"),
        (float("inf"), "inf"),
        (float("-inf"), "-inf"),
        ("sum", '"sum"'),
        ("", '""'),
        (
            'it\'s "quoted" \\ -> # : %x\n\t\x00\u2028é',
            r'''"it's \"quoted\" \\ -> # : %x\n\t\x00\u2028é"''',
        ),
        (Var("mm_1"), "%mm_1"),
        (Var("model.0.weight"), "%model.0.weight"),
        (Var("0"), "%0"),
        (Var("a b"), '%"a b"'),
        (Var(""), '%""'),
        ((), "()"),
        ((1,), "(1,)"),
        ((1, 2), "(1, 2)"),
        ([], "[]"),
        ([1], "[1]"),
        ([(1,), [()], ([],)], "[(1,), [()], ([],)]"),
        ((Var("a"), [Var("b"), None]), "(%a, [%b, None])"),
        (torch.float32, "torch.float32"),
        (torch.bfloat16, "torch.bfloat16"),
        (torch.bool, "torch.bool"),
        (torch.strided, "torch.strided"),
        (torch.sparse_coo, "torch.sparse_coo"),
        (torch.contiguous_format, "torch.contiguous_format"),
        (torch.channels_last, "torch.channels_last"),
        (torch.preserve_format, "torch.preserve_format"),
        (torch.device("cpu"), 'device("cpu")'),
        (torch.device("cuda", 1), 'device("cuda:1")'),
        (torch.device("meta"), 'device("meta")'),
    ],
)
def test_argument_values(value, text):
    plan = instr_plan(op(value, kwargs=[("k", value)]))
    printed = assert_round_trip(plan)
    assert f"aten.foo.default({text}, k={text})" in printed
    back = parse_plan(printed).body[0]
    for got in (back.args[0], back.kwargs[0][1]):
        assert type(got) is type(value)  # True is not 1, 1.0 is not 1, a list is not a tuple
        assert got == value


def test_nan_parses():
    back = parse_plan(format_plan(instr_plan(op(float("nan"))))).body[0].args[0]
    assert back != back


def test_kwargs_keep_their_order_and_dims_are_bare_names():
    kwargs = (("z", 1), ("dims", ("dp", "tp")), ("a", "dp"), ("op", "sum"), ("dim", 0))
    plan = instr_plan(Instr(("ar",), "all_reduce", (Var("x"),), kwargs, (f32((4,), R),)))
    assert 'all_reduce(%x, z=1, dims=(dp, tp), a="dp", op="sum", dim=0)' in assert_round_trip(plan)


def test_dims_that_are_not_plain_names_are_quoted():
    dims = ("None", "inf", "device", "a b", "", "x1")
    plan = instr_plan(op(kwargs=[("dims", dims)]))
    assert 'dims=("None", "inf", "device", "a b", "", x1)' in assert_round_trip(plan)


def test_unusual_names_are_quoted():
    plan = instr_plan(
        Instr(
            ("a b", "x\ny", "ok.1"),
            "my op",
            (Var('q"uote'),),
            (("not ident", 1), ("None", 2), ("in", 3)),
            (),
        ),
        Instr((), "out", (), (), ()),  # an op spelled like a keyword
        Instr((), "why", (), (), ()),
        inputs=[Input("in", "arg", f32((1,), R))],
        outputs=[Output("out", "out", "a b"), Output("é", "state", "ok.1")],
    )
    text = assert_round_trip(plan)
    assert '%"a b", %"x\\ny", %ok.1 = "my op"(%"q\\"uote", "not ident"=1, "None"=2, "in"=3)' in text
    assert '  "out"()  # main' in text
    assert '  "why"()  # main' in text
    assert "  in %in: f32[1] {dp: R}  # arg" in text
    assert '  out %"é" = %ok.1  # state' in text


@pytest.mark.parametrize("op_name", COMM_OPS + LOCAL_OPS)
def test_comm_and_local_ops(op_name):
    plan = instr_plan(
        Instr(("v",), op_name, (Var("x"),), (("dims", ("dp",)),), (f32((4,), R),), "comms")
    )
    assert f"%v = {op_name}(%x, dims=(dp,))  # f32[4] {{dp: R}} comms" in assert_round_trip(plan)


@pytest.mark.parametrize("stream", STREAMS)
def test_streams(stream):
    plan = instr_plan(op(Var("x"), stream=stream))
    assert f"{{dp: R}} {stream}" in assert_round_trip(plan)


def test_on_filters():
    plan = instr_plan(
        op(Var("x"), on=(("pp", 1),)),
        op(Var("x"), on=(("pp", 0), ("dp", 3))),
        op(Var("x"), on=(("on", -1),)),
        mesh=(("pp", 2), ("dp", 4)),
    )
    text = assert_round_trip(plan)
    assert "aten.foo.default(%x) on pp=1  #" in text
    assert "aten.foo.default(%x) on pp=0, dp=3  #" in text
    assert "aten.foo.default(%x) on on=-1  #" in text


@pytest.mark.parametrize(
    "loc, text",
    [
        ("", "main"),
        ("examples/train.py:42", "main  examples/train.py:42"),
        ("/abs/path/train.py:7", "main  /abs/path/train.py:7"),
        ("<stdin>:3", "main  <stdin>:3"),
        ("C:\\work\\x.py:12", "main  C:\\work\\x.py:12"),
        ("train.py:12:5", "main  train.py:12:5"),
        ("why:3", "main  why:3"),
        ("My Files/train.py:42", 'main  "My Files/train.py:42"'),
        ("train.py", 'main  "train.py"'),
        ("%x:1", 'main  "%x:1"'),
        ("f(x):1", 'main  "f(x):1"'),
        ('a"b:1', 'main  "a\\"b:1"'),
        ("#1:2", 'main  "#1:2"'),
        ("train.py:12 ", 'main  "train.py:12 "'),
    ],
)
def test_locations(loc, text):
    plan = instr_plan(op(Var("x"), loc=loc), op(Var("y"), outs=()), Instr((), "q", (), (), ()))
    assert f"# f32[4] {{dp: R}} {text}\n" in assert_round_trip(plan)


@pytest.mark.parametrize(
    "reason",
    [
        "Partial(sum) -> Replicate for aten.add_.Tensor",
        'it says "why: x" # not a comment : -> %y',
        "tabs\tand\nnewlines\r",
        "unicode é ∑ 🙂 and \u2028 and \x7f",
        "\\ backslashes \\n",
    ],
)
def test_reasons(reason):
    plan = instr_plan(
        op(Var("x"), reason=reason, loc="t.py:1"),
        op(Var("x"), reason=reason),
        op(Var("x"), reason=reason, loc="no line"),
    )
    text = assert_round_trip(plan)
    assert text.count('  why: "') == 3
    assert len(text.splitlines()) == 4  # one line per instruction whatever the reason holds


def test_inputs_and_outputs_of_every_kind():
    plan = instr_plan(
        inputs=[Input(f"v{i}", kind, f32((2,), R)) for i, kind in enumerate(INPUT_KINDS)],
        outputs=[Output(f"o{i}", kind, f"v{i}") for i, kind in enumerate(OUTPUT_KINDS)],
    )
    text = assert_round_trip(plan)
    for i, kind in enumerate(INPUT_KINDS):
        assert f"  in %v{i}: f32[2] {{dp: R}}  # {kind}\n" in text
    for i, kind in enumerate(OUTPUT_KINDS):
        assert f"  out %o{i} = %v{i}  # {kind}" in text


def test_printing_rejects_values_a_plan_cannot_hold():
    with pytest.raises(TypeError, match="cannot print argument value .* of type complex"):
        format_plan(instr_plan(op(1j)))
    with pytest.raises(TypeError, match="cannot print placement"):
        format_plan(instr_plan(inputs=[Input("x", "arg", f32((1,), "R"))]))


def test_bare_forms_match_the_grammar():
    """The printer's "may this be bare?" patterns are the grammar's terminals."""
    from monarch_dsl.grammar import parser

    grammar = parser("plan")
    assert grammar.get_terminal("LOC").pattern.value == plan_text._LOC.pattern
    assert grammar.get_terminal("DOTTED").pattern.value == plan_text._DOTTED.pattern
    assert grammar.get_terminal("NAME").pattern.value == plan_text._IDENT.pattern
    var = grammar.get_terminal("VAR").pattern.value
    assert var.startswith(f"%(?:{plan_text._BARE_VAR.pattern}|")


# ---- random plans ----------------------------------------------------------------------------

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
DIGITS = "0123456789"


def words(first: str, rest: str, max_size: int):
    """Strings of one character from ``first`` then up to ``max_size`` from ``rest`` (much
    faster to draw than ``st.from_regex``)."""
    return st.builds(str.__add__, st.sampled_from(first), st.text(alphabet=rest, max_size=max_size))


idents = words(LETTERS, LETTERS + DIGITS, 5)
keywords = st.sampled_from(sorted(plan_text._KEYWORDS))
names = st.one_of(
    words(LETTERS + DIGITS, LETTERS + DIGITS + ".", 11), keywords, st.text(max_size=6)
)
op_names = st.one_of(
    st.lists(idents, min_size=1, max_size=3).map(".".join),
    st.sampled_from(COMM_OPS + LOCAL_OPS),
    keywords,
    st.text(max_size=6),
)
plan_names = st.one_of(idents, op_names, st.text(max_size=6))
locs = st.one_of(
    st.just(""),
    st.builds(
        "{}.py:{}".format, words(LETTERS, LETTERS + DIGITS + "/<>.\\", 11), st.integers(0, 9999)
    ),
    st.text(max_size=12),
)
placements = st.one_of(
    st.builds(Shard, st.integers(-3, 5)),
    st.just(R),
    st.builds(Partial, st.sampled_from(PARTIAL_OPS)),
)
dtypes = st.sampled_from(sorted(DTYPE_NAMES) + ["float8_e4m3fn", "uint16", "complex128"])
torch_values = st.sampled_from(
    [torch.float32, torch.int64, torch.bool, torch.float8_e5m2, torch.strided, torch.sparse_csr]
    + [torch.contiguous_format, torch.channels_last, torch.device("cpu"), torch.device("cuda:0")]
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    idents,
    keywords,
    st.builds(Var, names),
    torch_values,
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple)),
    max_leaves=8,
)


shapes = st.none() | st.lists(st.integers(0, 4096), max_size=3).map(tuple)
kwarg_names = st.one_of(idents, st.just("dims"), keywords, st.text(max_size=4))
reasons = st.one_of(st.just(""), st.text(max_size=20))
on_filters = st.lists(st.tuples(idents, st.integers(-2, 8)), max_size=2).map(tuple)


@functools.cache
def tensor_types(ndims: int):
    """Types on a mesh with ``ndims`` dims; now and then with a wrong number of placements.
    (Strategies are built once: hypothesis spends its time validating fresh ones.)"""
    count = st.one_of(st.just(ndims), st.integers(0, 4))
    return st.builds(
        TensorType,
        shapes,
        dtypes,
        count.flatmap(lambda n: st.lists(placements, min_size=n, max_size=n).map(tuple)),
    )


@functools.cache
def instrs(ndims: int):
    types = st.lists(tensor_types(ndims), max_size=3).map(tuple)
    return st.builds(
        Instr,
        outs=st.lists(names, max_size=3).map(tuple),
        op=op_names,
        args=st.lists(values, max_size=3).map(tuple),
        kwargs=st.lists(st.tuples(kwarg_names, values), max_size=2).map(tuple),
        types=types,
        stream=st.sampled_from(STREAMS),
        on=on_filters,
        loc=locs,
        reason=reasons,
    )


@functools.cache
def plans_on(ndims: int):
    inputs = st.builds(Input, names, st.sampled_from(INPUT_KINDS), tensor_types(ndims))
    outputs = st.builds(Output, names, st.sampled_from(OUTPUT_KINDS), names)
    return st.tuples(
        st.lists(inputs, max_size=3).map(tuple),
        st.lists(instrs(ndims), max_size=3).map(tuple),
        st.lists(outputs, max_size=3).map(tuple),
    )


@st.composite
def plans(draw) -> Plan:
    dims = draw(st.lists(idents, max_size=3, unique=True))
    mesh = tuple((d, draw(st.integers(0, 16))) for d in dims)
    inputs, body, outputs = draw(plans_on(len(dims)))
    return Plan(
        name=draw(plan_names),
        mesh=mesh,
        inputs=inputs,
        body=body,
        outputs=outputs,
        micro_batches=draw(st.integers(0, 64)),
    )


@settings(max_examples=200, deadline=None)
@given(plans())
def test_random_plans_round_trip(plan):
    text = format_plan(plan)
    back = parse_plan(text)
    assert back == plan
    assert format_plan(back) == text
    # equality cannot tell True from 1 or 1.0, nor -0.0 from 0.0: the text can
    assert repr(back.body) == repr(plan.body)


# ---- errors ----------------------------------------------------------------------------------

HEADER = "plan step(dp=2)\n"
INPUT = "  in %x: f32[8] {dp: R}  # arg\n"


@pytest.mark.parametrize(
    "text, words",
    [
        (
            HEADER + "  in %x f32[8] {dp: R}  # arg",
            "at line 2, column 9: expected ':', found 'f32'",
        ),
        (
            HEADER + INPUT + "  %y = aten.relu.default(%x)  f32[8] {dp: R} main",
            "at line 3, column 31: expected '#' or 'on', found 'f32'",
        ),
        (HEADER + '  %y = f(%x, "abc)  # main', "at line 2, column 14: expected .*, found '\"'"),
        (HEADER + "  %y = f(%x  # main", "at line 2, column 14: expected '\\)' or ',' .*found '#'"),
        (HEADER + "  %y = f((1))  # main", "at line 2, column 12: expected ',', found '\\)'"),
        (HEADER + "  %y = f(%x) on pp  # main", "at line 2, column 21: expected '='"),
        (
            HEADER + INPUT + INPUT + "  out %y = %x",
            "at line 4, column 12: expected '#', found end of input",
        ),
        (
            HEADER + "  out %y = %x  # out\n  in %x: f32[] {dp: R}  # arg",
            "line 3, column 3: .*'in'",
        ),
        ("plan step(dp=2", "at column 14: expected '\\)' or ',', found end of input"),
        ("", "expected 'plan', found end of input"),
        ("step(dp=2)", "expected 'plan', found 'step'"),
    ],
)
def test_syntax_errors_name_the_line(text, words):
    with pytest.raises(PlanSyntaxError, match=words):
        parse_plan(text)


@pytest.mark.parametrize(
    "line, words",
    [
        ("  in %x: f33[8] {dp: R}  # arg", "column 10: unknown dtype 'f33' \\(expected one of f32"),
        ("  in %x: float32[8] {dp: R}  # arg", "column 10: write the dtype float32 as f32"),
        ("  %y = f(%x)  # f32[8] {dp: R} gpu", "column 32: unknown stream 'gpu'"),
        ("  in %x: f32[8] {tp: R}  # arg", "column 18: placement 0: expected the label 'dp:'"),
        (
            "  in %x: f32[8] {R}  # arg",
            "column 10: placement 0: expected the label 'dp:', found no label",
        ),
        ("  in %x: f32[8] {dp: R, tp: R}  # arg", "column 25: placement 1: expected no label"),
        ("  in %x: f32[8] {dp: P(prod)}  # arg", "column 24: Partial\\(op\\): op must be one of"),
        ("  in %x: f32[8] {dp: R}  # weight", "column 28: unknown input kind 'weight'"),
        ("  out %x = %y  # loss", "column 18: unknown output kind 'loss'"),
        ("  %y = f(a=1, %x)  # main", "column 15: a positional argument after a keyword"),
        (
            "  %y = f(torch.foo)  # main",
            "column 10: torch.foo is not a torch dtype, layout or memory format",
        ),
        ("  %y = f(torch.zeros)  # main", "column 10: torch.zeros is not a torch dtype"),
        ('  %y = f(device("nope"))  # main', "column 17: not a device"),
        ('  %y = f("\\q")  # main', "column 10: bad string"),
    ],
)
def test_semantic_errors_point_at_the_token(line, words):
    with pytest.raises(PlanSyntaxError, match=f"at line 2, {words}") as info:
        parse_plan(HEADER + line)
    assert f"\n{line}\n" in str(info.value)  # the line itself, then a caret under the token


def test_syntax_error_shows_the_line_and_a_caret():
    with pytest.raises(PlanSyntaxError) as info:
        parse_plan(HEADER + "  in %x f32[8] {dp: R}  # arg")
    assert str(info.value).endswith("  in %x f32[8] {dp: R}  # arg\n        ^")


def test_parse_plan_rejects_non_text():
    with pytest.raises(TypeError, match="takes a str"):
        parse_plan(b"plan step()")


def test_dims_named_like_keywords():
    dims = ("in", "on", "None", "R", "plan", "why", "out", "device", "micro_batches")
    t = TensorType((2,), "float32", (R,) * len(dims))
    plan = Plan(
        "step",
        tuple((d, 2) for d in dims),
        (Input("x", "arg", t),),
        (
            Instr(
                ("y",),
                "all_reduce",
                (Var("x"),),
                (("dims", dims),),
                (t,),
                on=tuple((d, 1) for d in dims),
            ),
        ),
        (Output("y", "out", "y"),),
    )
    text = assert_round_trip(plan)
    assert (
        "plan step(in=2, on=2, None=2, R=2, plan=2, why=2, out=2, device=2, micro_batches=2)"
        in text
    )
    assert 'dims=("in", "on", "None", "R", "plan", "why", "out", "device", "micro_batches")' in text
