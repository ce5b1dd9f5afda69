"""check_plan on hand-built plans: valid ones pass, each broken invariant is a PlanError that
names the instruction, its loc and what is wrong. Pure: no processes."""

from __future__ import annotations

import pytest

from monarch_dsl.compiler.check import check_plan
from monarch_dsl.compiler.plan import (
    Input,
    Instr,
    Output,
    Partial,
    Plan,
    PlanError,
    Replicate,
    Shard,
    TensorType,
    Var,
)

R = Replicate()
P = Partial("sum")


def t(shape, *placements, dtype="float32"):
    return TensorType(tuple(shape), dtype, tuple(placements))


def op(outs, name, *args, types=(), stream="main", on=(), loc="", **kwargs):
    """An instruction; ``outs`` is a space-separated string, string args are values."""
    args = tuple(Var(a) if isinstance(a, str) else a for a in args)
    return Instr(
        tuple(outs.split()), name, args, tuple(kwargs.items()), tuple(types), stream,
        tuple(on), loc,
    )  # fmt: skip


def plan(mesh, inputs, body, outputs=()):
    return Plan(
        "step",
        tuple(mesh),
        tuple(Input(n, "arg", ty) for n, ty in inputs),
        tuple(body),
        tuple(Output(f"o{k}", "out", v) for k, v in enumerate(outputs)),
    )


def raises(p, *fragments):
    with pytest.raises(PlanError) as info:
        check_plan(p)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in:\n{msg}"
    return info.value


# ---- valid plans -----------------------------------------------------------------------------


def dp_plan(**changes):
    """Data parallel over dp=2: local matmul, gradient all_reduce on the comms stream."""
    x, w = t((8, 4), Shard(0)), t((4, 4), R)
    body = [
        op("y", "aten.mm.default", "x", "w", types=[t((8, 4), Shard(0))], loc="m.py:1"),
        op("xt", "aten.t.default", "x", types=[t((4, 8), Shard(1))], loc="m.py:2"),
        op("g", "aten.mm.default", "xt", "y", types=[t((4, 4), P)], loc="m.py:2"),
        op(
            "g2",
            "all_reduce",
            "g",
            dims=("dp",),
            op="sum",
            types=[t((4, 4), R)],
            stream="comms",
            loc="m.py:2",
        ),  # fmt: skip
        op("w2", "aten.sub.Tensor", "w", "g2", types=[t((4, 4), R)], loc="m.py:3"),
    ]
    return plan([("dp", 2)], [("x", x), ("w", w)], body, ["w2", "y"])


def test_data_parallel_plan_is_valid():
    p = dp_plan()
    check_plan(p)
    assert p.check() is p


def pipeline_body(extra_on=()):
    """Two stages over pp: forward h from 0 to 1, gradient back from 1 to 0. Values are
    replicated over the other mesh dims (``extra_on`` is empty for a 1-D mesh)."""
    n = 1 + len(extra_on)
    a = t((4, 8), *[R] * n)
    s0, s1 = (("pp", 0),), (("pp", 1),)
    return [
        op("h", "aten.relu.default", "x", types=[a], on=s0, loc="m.py:10"),
        op("", "send", "h", dims=("pp",), peer=1, on=s0, loc="m.py:11"),
        op("h1", "recv", dims=("pp",), peer=0, types=[a], on=s1, loc="m.py:11"),
        op("y", "aten.tanh.default", "h1", types=[a], on=s1, loc="m.py:12"),
        op("gy", "aten.neg.default", "y", types=[a], on=s1, loc="m.py:13"),
        op("", "send", "gy", dims=("pp",), peer=0, on=s1, loc="m.py:13"),
        op("gh", "recv", dims=("pp",), peer=1, types=[a], on=s0, loc="m.py:13"),
        op("gx", "aten.mul.Tensor", "gh", "h", types=[a], on=s0, loc="m.py:14"),
    ]


def test_two_stage_pipeline_is_valid():
    p = plan([("pp", 2)], [("x", t((4, 8), R))], pipeline_body(), ["gx", "y"])
    check_plan(p)


def test_pipeline_with_data_parallel_is_valid():
    # dp=2 x pp=2: each stage all-reduces its own gradient over dp (an on filter over pp is
    # fine for a collective over dp: every dp group lies inside one stage).
    body = pipeline_body(extra_on=("dp",))
    a = t((4, 8), R, P)
    body += [
        op("pg", "aten.mul.Tensor", "gx", "x", types=[a], on=(("pp", 0),), loc="m.py:15"),
        op(
            "pg2",
            "all_reduce",
            "pg",
            dims=("dp",),
            op="sum",
            types=[t((4, 8), R, R)],
            on=(("pp", 0),),
            stream="comms",
            loc="m.py:15",
        ),  # fmt: skip
        op("qg", "aten.mul.Tensor", "gy", "y", types=[a], on=(("pp", 1),), loc="m.py:16"),
        op(
            "qg2",
            "all_reduce",
            "qg",
            dims=("dp",),
            op="avg",
            types=[t((4, 8), R, R)],
            on=(("pp", 1),),
            stream="comms",
            loc="m.py:16",
        ),  # fmt: skip
    ]
    p = plan([("pp", 2), ("dp", 2)], [("x", t((4, 8), R, R))], body, ["pg2", "qg2"])
    check_plan(p)


def test_branches_on_other_dims_are_independent_groups():
    # Ranks at tp=0 all-reduce then all-gather over dp, ranks at tp=1 the other way round: each
    # dp group lies inside one tp index, so every group sees one consistent order.
    mesh = [("dp", 2), ("tp", 2)]
    x = t((4, 4), P, R)
    xs = t((4, 4), Shard(0), R)
    t0, t1 = (("tp", 0),), (("tp", 1),)
    body = [
        op("a", "all_reduce", "x", dims=("dp",), op="sum", types=[t((4, 4), R, R)], on=t0),
        op("b", "all_gather", "xs", dims=("dp",), dim=0, types=[t((4, 4), R, R)], on=t0),
        op("c", "all_gather", "xs", dims=("dp",), dim=0, types=[t((4, 4), R, R)], on=t1),
        op("d", "all_reduce", "x", dims=("dp",), op="sum", types=[t((4, 4), R, R)], on=t1),
    ]
    check_plan(plan(mesh, [("x", x), ("xs", xs)], body))


def test_bucketed_all_reduce_and_other_collectives_are_valid():
    mesh = [("dp", 2), ("tp", 2)]
    body = [
        op(
            "a b",
            "all_reduce",
            "g1",
            "g2",
            dims=("dp",),
            op="sum",
            types=[t((4,), R, R), t((2, 2), R, R)],
            stream="comms",
        ),  # fmt: skip
        op(
            "c", "reduce_scatter", "g1", dims=("tp",), op="sum", dim=0, types=[t((4,), P, Shard(0))]
        ),  # fmt: skip
        op(
            "d",
            "all_to_all",
            "s",
            dims=("dp", "tp"),
            split_dim=1,
            cat_dim=0,
            types=[t((8, 8), Shard(1), Shard(1))],
        ),  # fmt: skip
        op("e", "aten.add.Tensor", "a", "c", types=[t((4,), P, Shard(0))]),
    ]
    inputs = [("g1", t((4,), P, P)), ("g2", t((2, 2), P, R)), ("s", t((8, 8), Shard(0), Shard(0)))]
    check_plan(plan(mesh, inputs, body, ["e", "b", "d"]))


def test_large_generated_plan_runs():
    # 2,000 stages of work x 4 ranks per stage over dp=4 x pp=2 (~6,000 instructions).
    a, g = t((8, 8), R, R), t((8, 8), R, P)
    body = []
    for k in range(1000):
        s0, s1 = (("pp", 0),), (("pp", 1),)
        body += [
            op(f"h{k}", "aten.relu.default", "x", types=[a], on=s0),
            op("", "send", f"h{k}", dims=("pp",), peer=1, on=s0),
            op(f"r{k}", "recv", dims=("pp",), peer=0, types=[a], on=s1),
            op(f"p{k}", "aten.neg.default", f"r{k}", types=[g], on=s1),
            op(
                f"q{k}",
                "all_reduce",
                f"p{k}",
                dims=("dp",),
                op="sum",
                types=[a],
                on=s1,
                stream="comms",
            ),  # fmt: skip
            op(f"z{k}", "aten.add.Tensor", f"q{k}", f"r{k}", types=[a], on=s1),
        ]
    check_plan(plan([("pp", 2), ("dp", 4)], [("x", a)], body, ["z999"]))


# ---- collectives -----------------------------------------------------------------------------


def test_mismatched_collective_order_between_filters():
    # Under tp=0 all_reduce then all_gather over tp, under tp=1 the other way round: the group
    # over tp pairs an all_reduce with an all_gather.
    x, xs, r = t((4, 4), P), t((4, 4), Shard(0)), t((4, 4), R)
    t0, t1 = (("tp", 0),), (("tp", 1),)
    body = [
        op("a", "all_reduce", "x", dims=("tp",), op="sum", types=[r], on=t0, loc="m.py:1"),
        op("b", "all_gather", "xs", dims=("tp",), dim=0, types=[r], on=t0, loc="m.py:2"),
        op("c", "all_gather", "xs", dims=("tp",), dim=0, types=[r], on=t1, loc="m.py:3"),
        op("d", "all_reduce", "x", dims=("tp",), op="sum", types=[r], on=t1, loc="m.py:4"),
    ]
    e = raises(
        plan([("tp", 2)], [("x", x), ("xs", xs)], body),
        "do not match across the group",
        "1st one of rank (tp=0) is instruction 0 `%a = all_reduce(",
        "(at m.py:1)",
        "1st one of rank (tp=1) is instruction 2 `%c = all_gather(",
        "(at m.py:3)",
        "kind 'all_reduce' vs 'all_gather'",
        "local inputs f32[4, 4] vs f32[2, 4]",
        "own dim tp",
    )
    assert e.loc == "m.py:3"


def test_collective_under_filter_on_its_own_dim():
    x = t((4, 4), R, P)
    body = [
        op(
            "a",
            "all_reduce",
            "x",
            dims=("dp",),
            op="sum",
            types=[t((4, 4), R, R)],
            on=(("dp", 0),),
            loc="m.py:7",
        ),  # fmt: skip
    ]
    e = raises(
        plan([("tp", 2), ("dp", 2)], [("x", x)], body),
        "instruction 0 `%a = all_reduce(%x, dims=('dp',), op='sum') on dp=0`",
        "rank (tp=0, dp=0) issues this as its 1st collective over ('dp',) on stream main",
        "rank (tp=0, dp=1) of its group issues only 0",
        "would wait forever",
        "on filter on its own dim dp",
        "(at m.py:7)",
    )
    assert e.loc == "m.py:7"


def test_complementary_branches_on_own_dim_are_still_an_error():
    x, r = t((4, 4), P), t((4, 4), R)
    body = [
        op("a", "all_reduce", "x", dims=("dp",), op="sum", types=[r], on=(("dp", 0),)),
        op("b", "all_reduce", "x", dims=("dp",), op="sum", types=[r], on=(("dp", 1),)),
    ]
    raises(plan([("dp", 2)], [("x", x)], body), "runs only on dp=0", "names its own dim dp")


def test_collective_on_different_streams_does_not_match():
    x, r = t((4, 4), P), t((4, 4), R)
    body = [
        op("a", "all_reduce", "x", dims=("dp",), op="sum", types=[r], on=(("dp", 0),)),
        op(
            "b",
            "all_reduce",
            "x",
            dims=("dp",),
            op="sum",
            types=[r],
            on=(("dp", 1),),
            stream="comms",
        ),  # fmt: skip
    ]
    raises(plan([("dp", 2)], [("x", x)], body), "on stream main", "issues only 0 there")


@pytest.mark.parametrize(
    "dims, fragment",
    [
        (("xx",), "dims names 'xx', which is not a mesh dim; the mesh is dp=2"),
        ((), "expected dims= a non-empty tuple of mesh dims (of dp=2), found ()"),
        (("dp", "dp"), "dims must be distinct, found ('dp', 'dp')"),
        (None, "found None"),
    ],
)
def test_bad_dims(dims, fragment):
    kwargs = {} if dims is None else {"dims": dims}
    body = [op("a", "all_reduce", "x", op="sum", types=[t((4,), R)], loc="m.py:5", **kwargs)]
    raises(plan([("dp", 2)], [("x", t((4,), P))], body), "instruction 0 `%a = all_reduce(",
           fragment, "(at m.py:5)")  # fmt: skip


def test_bad_collective_kwargs():
    mesh, inputs = [("dp", 2)], [("x", t((4, 3), P))]
    bad_op = op("a", "all_reduce", "x", dims=("dp",), op="prod", types=[t((4, 3), R)])
    raises(plan(mesh, inputs, [bad_op]), "expected op= one of ('sum', 'avg', 'max', 'min')")
    bad_dim = op("a", "all_gather", "x", dims=("dp",), dim=2, types=[t((4, 3), R)])
    raises(plan(mesh, inputs, [bad_dim]), "expected dim= a dim of %x f32[4, 3] (0..1), found 2")
    shape = op("a", "all_reduce", "x", dims=("dp",), op="sum", types=[t((3, 4), R)])
    raises(plan(mesh, inputs, [shape]), "keeps the global shape and dtype",
           "expected %a to be f32[4, 3] like %x, found f32[3, 4]")  # fmt: skip


def test_reduce_scatter_must_divide():
    body = [op("a", "reduce_scatter", "x", dims=("dp",), op="sum", dim=1,
               types=[t((4, 3), Shard(1))], loc="m.py:9")]  # fmt: skip
    raises(
        plan([("dp", 2)], [("x", t((4, 3), P))], body),
        "splits tensor dim 1 of %x into 2 chunks",
        "each rank holds 3 along it",
        "expected a multiple of 2",
        "(at m.py:9)",
    )


# ---- send / recv -----------------------------------------------------------------------------


def pp_plan(body, inputs=None):
    return plan([("pp", 2)], inputs or [("x", t((4, 8), R))], body)


S0, S1 = (("pp", 0),), (("pp", 1),)


def test_send_without_recv():
    body = [op("", "send", "x", dims=("pp",), peer=1, on=S0, loc="m.py:20")]
    e = raises(
        pp_plan(body),
        "instruction 0 `send(%x, dims=('pp',), peer=1) on pp=0`",
        "1st send from rank (pp=0) to (pp=1) on stream main",
        "(pp=1) posts only 0 matching recv(s)",
        "the send has no recv",
        "(at m.py:20)",
    )
    assert e.loc == "m.py:20"


def test_recv_without_send():
    body = [op("y", "recv", dims=("pp",), peer=0, types=[t((4, 8), R)], on=S1, loc="m.py:21")]
    raises(pp_plan(body), "the recv has no send", "(at m.py:21)")


def test_send_on_another_stream_does_not_match_recv():
    body = [
        op("", "send", "x", dims=("pp",), peer=1, on=S0, stream="comms"),
        op("y", "recv", dims=("pp",), peer=0, types=[t((4, 8), R)], on=S1),
    ]
    raises(pp_plan(body), "on stream comms", "the send has no recv")


def test_recv_type_mismatch():
    body = [
        op("", "send", "x", dims=("pp",), peer=1, on=S0, loc="m.py:30"),
        op("y", "recv", dims=("pp",), peer=0, types=[t((8, 4), R)], on=S1, loc="m.py:31"),
    ]
    e = raises(
        pp_plan(body),
        "instruction 1 `%y = recv(dims=('pp',), peer=0) on pp=1`",
        "meets instruction 0 `send(%x, dims=('pp',), peer=1) on pp=0` (at m.py:30)",
        "expected the recv's type to be the sent value's, f32[4, 8], found f32[8, 4]",
    )
    assert e.loc == "m.py:31"


@pytest.mark.parametrize(
    "peer, on, fragment",
    [
        (0, S0, "peer=0 is this instruction's own index on pp"),
        (2, S0, "peer=2 is out of range: pp has indices 0..1"),
        (1, (), "send over pp must run on one index of pp: expected on pp=<index>, found on "
         "every rank"),
    ],
)  # fmt: skip
def test_bad_peer(peer, on, fragment):
    body = [op("", "send", "x", dims=("pp",), peer=peer, on=on, loc="m.py:40")]
    raises(pp_plan(body), fragment, "(at m.py:40)")


def test_recv_first_on_both_stages_deadlocks():
    a = t((4, 8), R)
    body = [
        op("a", "recv", dims=("pp",), peer=1, types=[a], on=S0, loc="m.py:50"),
        op("b", "recv", dims=("pp",), peer=0, types=[a], on=S1, loc="m.py:51"),
        op("", "send", "x", dims=("pp",), peer=1, on=S0, loc="m.py:52"),
        op("", "send", "x", dims=("pp",), peer=0, on=S1, loc="m.py:53"),
    ]
    e = raises(
        pp_plan(body),
        "deadlock: 2 rank stream(s) can never finish",
        "rank (pp=0) stream main at instruction 0 `%a = recv(dims=('pp',), peer=1) on pp=0` "
        "(at m.py:50)\n    waits for rank (pp=1) to reach the matching send, instruction 3",
        "rank (pp=1) stream main at instruction 1 `%b = recv(dims=('pp',), peer=0) on pp=1` "
        "(at m.py:51)\n    waits for rank (pp=0) to reach the matching send, instruction 2",
    )
    assert e.loc == "m.py:50"


def test_deadlock_through_a_cross_stream_wait():
    # pp=0: main recvs a, comms computes from a and sends it on. pp=1: comms recvs it, main
    # computes from that and sends back what pp=0's main is waiting for.
    a = t((4, 8), R)
    body = [
        op("a", "recv", dims=("pp",), peer=1, types=[a], on=S0, loc="m.py:60"),
        op("b", "aten.neg.default", "a", types=[a], on=S0, stream="comms", loc="m.py:61"),
        op("", "send", "b", dims=("pp",), peer=1, on=S0, stream="comms", loc="m.py:62"),
        op("c", "recv", dims=("pp",), peer=0, types=[a], on=S1, stream="comms", loc="m.py:62"),
        op("d", "aten.neg.default", "c", types=[a], on=S1, loc="m.py:63"),
        op("", "send", "d", dims=("pp",), peer=0, on=S1, loc="m.py:64"),
    ]
    e = raises(
        pp_plan(body),
        "deadlock: 4 rank stream(s)",
        "waits for %a, which instruction 0 defines on its stream main (at m.py:60)",
        "waits for %c, which instruction 3 defines on its stream comms (at m.py:62)",
        "waits for rank (pp=1) to reach the matching send, instruction 5",
        "waits for rank (pp=0) to reach the matching send, instruction 2",
    )
    assert e.loc


def test_cross_stream_use_without_cycle_is_fine():
    a = t((4, 8), R)
    body = [
        op("", "send", "x", dims=("pp",), peer=1, on=S0, stream="comms"),
        op("b", "recv", dims=("pp",), peer=0, types=[a], on=S1, stream="comms"),
        op("c", "aten.neg.default", "b", types=[a], on=S1),
    ]
    check_plan(pp_plan(body))


# ---- data flow and structure -----------------------------------------------------------------


def test_use_before_def():
    a = t((4,), R)
    body = [
        op("y", "aten.neg.default", "z", types=[a], loc="m.py:70"),
        op("z", "aten.neg.default", "x", types=[a], loc="m.py:71"),
    ]
    e = raises(
        plan([("dp", 2)], [("x", a)], body),
        "instruction 0 `%y = aten.neg.default(%z)`: uses %z before its definition "
        "(instruction 1 defines it)",
    )
    assert e.loc == "m.py:70"
    raises(plan([("dp", 2)], [("x", a)], body[:1]), "uses %z, which is never defined")


def test_use_on_a_rank_where_not_defined():
    a = t((4, 8), R)
    body = [
        op("h", "aten.relu.default", "x", types=[a], on=S0, loc="m.py:80"),
        op("y", "aten.neg.default", "h", types=[a], on=S1, loc="m.py:81"),
    ]
    e = raises(
        pp_plan(body),
        "instruction 1 `%y = aten.neg.default(%h) on pp=1`: uses %h on rank (pp=1), where it "
        "is not defined: %h exists only on pp=0",
        "but this instruction runs on pp=1",
    )
    assert e.loc == "m.py:81"


def test_duplicate_definition():
    a = t((4,), R)
    body = [
        op("y", "aten.neg.default", "x", types=[a], loc="m.py:90"),
        op("y", "aten.relu.default", "x", types=[a], loc="m.py:91"),
    ]
    e = raises(plan([("dp", 2)], [("x", a)], body), "defines %y again; it is already defined "
               "by instruction 0 `%y = aten.neg.default(%x)`")  # fmt: skip
    assert e.loc == "m.py:91"
    redefine_input = [op("x", "aten.neg.default", "x", types=[a])]
    raises(plan([("dp", 2)], [("x", a)], redefine_input), "already defined by an input")


def test_structure_errors():
    mesh, inputs, a = [("dp", 2)], [("x", t((4,), R))], t((4,), R)
    raises(plan(mesh, inputs, [op("y", "aten.neg.default", "x", types=[a], stream="gpu")]),
           "stream must be one of ('main', 'comms'), found 'gpu'")  # fmt: skip
    raises(plan(mesh, inputs, [op("y z", "aten.neg.default", "x", types=[a])]),
           "expected one type per out (2), found 1")  # fmt: skip
    raises(plan(mesh, inputs, [op("y", "aten.neg.default", "x", types=[a], on=(("pp", 0),))]),
           "on names dim 'pp', which is not a mesh dim")  # fmt: skip
    raises(plan(mesh, inputs, [op("y", "aten.neg.default", "x", types=[a], on=(("dp", 2),))]),
           "on dp=2 is out of range")  # fmt: skip
    raises(plan(mesh, inputs, [op("y", "aten.neg.default", "x", types=[t((4,), R, R)])]),
           "type of %y: expected one placement per mesh dim (dp=2), found 2")  # fmt: skip
    raises(plan(mesh, inputs, [op("y", "aten.neg.default", "x", types=[t((4,), Shard(1))])]),
           "placement S(1) shards tensor dim 1")  # fmt: skip
    raises(plan(mesh, inputs, [], ["nope"]), "output o0 = %nope: %nope is not defined")
