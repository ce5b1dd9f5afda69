"""Pass: propagate placements through the plan and insert the communication they need.

Every op has a rule that lists its candidate strategies: for one mesh dim, the placements its
tensor inputs must have and the placements its outputs then get (``registry``, ``rules/``).
For each mesh dim the pass takes the candidate whose input redistributions cost the fewest
bytes (ties: the first listed; ``compiler.cost``), inserts those redistributions before the
op (all_reduce, reduce_scatter, all_gather, all_to_all, or a local chunk: ``redistribute``),
and records the op's output placements (``state``). An op without a rule runs replicated,
with a warning naming the op and what gathering costs.

Redistributions of a value are reused until the value (or anything sharing its storage) is
written in place. Where several mesh dims shard one tensor dim, the leftmost mesh dim is the
outer chunk; a redistribution is ordered (gathering an inner mesh dim first where needed) so
that every step keeps that nesting, and no strategy splits a tensor dim into uneven parts.

With micro-batches, the batch is also sharded over a virtual mesh dim ``mb`` (``MB``) whose
"ranks" run one after another on the same devices, so a reduction over it is a local sum
(``pipeline.microbatch`` makes it one). A value Partial over ``mb`` and over real dims (a
weight's gradient, the loss) is reduced over ``mb`` first: the micro-batches' partial
contributions are accumulated locally, the sum stays Partial over the real dims, and it is
all-reduced once instead of once per micro-batch.
"""

from __future__ import annotations

import time

from monarch_dsl.compiler.plan import (
    Instr,
    Placement,
    Plan,
    PlanError,
    Shard,
    TensorType,
    record_pass,
)
from monarch_dsl.compiler.propagate.registry import R
from monarch_dsl.compiler.propagate.state import State


def propagate(
    plan: Plan,
    placements: dict[str, tuple[Placement, ...]],
    out_placements: dict[str, tuple[Placement, ...]] | None = None,
    pipeline_dim: str | None = None,
    gather: dict[str, str] | None = None,
    kept_gathered: set[str] | None = None,
) -> Plan:
    """Placements for every value, starting from ``placements`` of the inputs (by input name;
    missing: Replicate on every dim), with the communication they need inserted. The
    function's results get ``out_placements`` (by output name; default Replicate); a
    gradient kept after the step is its reduced version when the step made one.

    ``gather``: {input: mesh dim} of parameters kept sharded over that dim between steps
    (``md.fully_shard``): the forward and backward passes use them whole -- gathered at their
    first use, once, whatever the cost model would prefer -- so the batch stays sharded and
    their gradients are reduce-scattered back to their layout for the update. As FSDP does
    (``reshard_after_forward``), the backward pass gathers each of them again, and remakes the
    views of the forward's gather that it reads, so the forward's whole copy is freed after
    its last forward use -- except for the last module's parameters (gathered last, used
    first in backward) and those named in ``kept_gathered``, which stay gathered."""
    t0 = time.perf_counter()
    sizes = plan.sizes
    types: dict[str, TensorType] = {}
    inputs = []
    for i in plan.inputs:
        pl = placements.get(i.name, (R,) * len(sizes))
        t = i.type._replace(placements=tuple(pl))
        _check_input(i.name, t, plan)
        types[i.name] = t
        inputs.append(i._replace(type=t))
    st = State(plan, types)
    st.gather = {n: plan.dims.index(d) for n, d in (gather or {}).items()}
    st.kept = set(kept_gathered or ())
    st.phase = (plan.notes or {}).get("phase", {}) if isinstance(plan.notes, dict) else {}
    if pipeline_dim in plan.dims:  # stages, not data: everything is whole along it
        st.flat_dims.add(plan.dims.index(pipeline_dim))
    for ins in plan.body:
        st.step(ins)
    outputs = []
    for o in plan.outputs:
        var = o.var
        t = st.types[var]
        if o.kind == "out" and t.shape is not None:
            want = (out_placements or {}).get(o.name, (R,) * len(plan.sizes))
            if tuple(want) != t.placements:
                var = st.redistribute(
                    var,
                    tuple(want),
                    Instr((), f"the result {o.name}", (), (), (), loc=st.loc_of.get(var, "")),
                )
        elif o.kind == "state" and t.shape is not None and o.name.rpartition(".")[0] in st.gather:
            # Optimizer state made in the step (SGD's momentum buffer, cloned from a gradient
            # the cost model kept whole) of a fully sharded parameter: kept sharded like it.
            param = types[o.name.rpartition(".")[0]]
            if param.shape == t.shape and param.placements != t.placements:
                var = st.redistribute(
                    var,
                    param.placements,
                    Instr(
                        (), f"the sharded state {o.name}", (), (), (), loc=st.loc_of.get(var, "")
                    ),
                )
        elif o.kind == "grad" and t.shape is not None:
            # Laid out like its parameter (DDP's grads are whole and averaged): usually the
            # optimizer already made it so, and this costs nothing.
            param_type = types.get(o.name.removesuffix(".grad"))
            want = param_type.placements if param_type is not None else (R,) * len(plan.sizes)
            if tuple(want) != t.placements:
                var = st.redistribute(
                    var,
                    tuple(want),
                    Instr((), f"the gradient {o.name}", (), (), (), loc=st.loc_of.get(var, "")),
                )
        outputs.append(o._replace(var=var))
    out = plan.replace(inputs=tuple(inputs), body=tuple(st.body), outputs=tuple(outputs))
    return record_pass(out, "propagate", t0)


def _check_input(name: str, t: TensorType, plan: Plan) -> None:
    product: dict[int, int] = {}  # tensor dim -> the product of the mesh dims sharding it
    shape = t.shape or ()  # (a scalar: no dim to shard)
    for (dim, n), p in zip(plan.mesh, t.placements):
        if isinstance(p, Shard):
            nd = len(shape)
            if not 0 <= p.dim < nd:
                raise PlanError(
                    f"placement of {name!r} on {dim!r}: Shard({p.dim}) but the tensor has "
                    f"{nd} dims (shape {list(shape)})"
                )
            if shape[p.dim] % n:
                raise PlanError(
                    f"placement of {name!r} on {dim!r}: Shard({p.dim}) needs dim {p.dim} "
                    f"(size {shape[p.dim]}) divisible by the mesh dim's size {n}"
                )
            product[p.dim] = product.get(p.dim, 1) * n
            if shape[p.dim] % product[p.dim]:
                raise PlanError(
                    f"placement of {name!r}: dim {p.dim} (size {shape[p.dim]}) is sharded "
                    f"over several mesh dims, up to {dim!r}, and needs to be divisible by the "
                    f"product of their sizes ({product[p.dim]})"
                )
