"""Compiled steps on real workers (gloo): the plan is sent once, then run by every rank."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import local_mesh

import monarch_dsl as md
from monarch_dsl import _build
from monarch_dsl.runtime import worker

sys.path.insert(0, str(Path(__file__).parent))
from actors_lib import Plans, RefTable, shared_last_run  # noqa: E402
from compiler_helpers import (  # noqa: E402
    MEGATRON_MLP,
    Block,
    TwoStages,
    block_batches,
    cross_entropy_step,
    mse_step,
)

ATOL = 1e-5
pytestmark = pytest.mark.procs


pm = local_mesh({"dp": 2, "tp": 2})


def _batches(n=3):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(n)]


def _make(module, opt_cls=torch.optim.SGD, **opt_kwargs):
    """A ``make`` for ``_train_on_workers``: ``module()`` (seeded) trained by ``mse_step``."""

    def make():
        torch.manual_seed(0)
        model = module()
        return model, opt_cls(model.parameters(), **opt_kwargs), mse_step

    return make


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def _train_on_workers(mesh, make, batches, **options):
    """``make()`` -> (model, optimizer, step_of(model, opt) -> fn(x, y)), as for
    ``simulate_training``. Trains one copy with the compiled step on ``mesh``'s workers (then
    pulls its parameters and optimizer state back) and one in plain torch in this process;
    asserts that the losses, the parameters and the optimizer state match. Returns the
    ``mesh_fn`` and its losses (mesh tensors)."""
    model, opt, step_of = make()
    ref, ref_opt = copy.deepcopy((model, opt))
    step = md.mesh_fn(step_of(model, opt), **options)
    with mesh.activate():
        losses = [step(x, y) for x, y in batches]
        got = [md.inspect(loss) for loss in losses]
    step.pull()
    ref_step = step_of(ref, ref_opt)
    want = [ref_step(x, y).detach() for x, y in batches]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg="losses")
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=f"parameter {name}")
        state, ref_state = opt.state.get(a, {}), ref_opt.state.get(b, {})
        assert state.keys() == ref_state.keys(), name
        for key in state:
            torch.testing.assert_close(
                state[key], ref_state[key], atol=ATOL, rtol=0, msg=f"{key} of {name}"
            )
    return step, losses


@pytest.mark.parametrize("layout", ["dp", "dp+tp"])
def test_compiled_training_matches_one_process(pm, layout):
    step, losses = _train_on_workers(
        pm,
        _make(_mlp, lr=0.1, momentum=0.9),
        _batches(),
        data_parallel="dp",
        placements=MEGATRON_MLP if layout == "dp+tp" else None,
    )
    # Replicated result: every rank holds the whole value.
    last = md.inspect(losses[-1]).item()
    assert md.inspect(losses[-1], dp=1, tp=1).item() == pytest.approx(last)
    # The first call compiled with fresh optimizer state, the second with the state the first
    # left on the workers; the third reused the second's plan.
    assert step.compiles == 2


def test_megatron_mlp_tp2_on_workers(pm):
    """tp=2 alone (column- then row-parallel), with AdamW."""
    tp = pm.slice(dp=0)
    _train_on_workers(
        tp,
        _make(_mlp, torch.optim.AdamW, lr=0.01, weight_decay=0.1),
        _batches(),
        placements=MEGATRON_MLP,
    )


def test_a_dim_of_size_one_needs_no_communication(pm):
    """On dp=1 x tp=2 (the dp=0 slice) a data-parallel Megatron step communicates over tp only:
    a shard or a partial sum over one rank is the whole value. Batches sent whole and batches
    distributed as Shard(0) over dp both train like one process."""
    one = pm.slice(dp=slice(0, 1))
    step, _ = _train_on_workers(
        one, _make(_mlp, lr=0.1), _batches(), data_parallel="dp", placements=MEGATRON_MLP
    )
    plans = [c.plan for c in step.cache.values()]
    assert plans and all(c.dims == ("tp",) for p in plans for c in p.collectives)
    assert any(p.collectives for p in plans)  # tp's all-reduces stay
    model, opt, step_of = _make(_mlp, lr=0.1)()
    ref = copy.deepcopy(model)
    step = md.mesh_fn(step_of(model, opt), data_parallel="dp")
    x, y = _batches(1)[0]
    with one.activate():
        xm, ym = md.distribute((x, y), {"dp": md.Shard(0)})
        got = md.inspect(step(xm, ym))
    want = step_of(ref, torch.optim.SGD(ref.parameters(), lr=0.1))(x, y)
    torch.testing.assert_close(got, want.detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("ranks", [2, 1])
def test_failed_step_fails_its_results_and_leaves_workers_usable(pm, ranks):
    """On 1 rank too, where no rank has another to agree with (no agreement collective)."""
    mesh = pm if ranks == 2 else pm.slice(dp=slice(0, 1))
    model = nn.Linear(16, 16)

    @md.mesh_fn(data_parallel="dp", placements={"idx": md.Replicate()})
    def step(x, idx):
        return model(x)[:, 0] + torch.index_select(x, 1, idx).sum(1)

    x = torch.randn(8, 16)
    with mesh.activate():
        bad = step(x, torch.tensor([99]))  # index out of range on the workers
        with pytest.raises(md.RemoteError, match="index_select"):
            md.inspect(bad)
        good = step(x, torch.tensor([1]))
        torch.testing.assert_close(md.inspect(good), model(x)[:, 0] + x[:, 1])
        # A mesh tensor argument is each rank's part: [4, 16] per rank is a [4 x ranks, 16]
        # batch.
        part = torch.ones(4, 16)
        out = step(part, torch.tensor([1]))
        assert md.inspect(out).shape == (4 * ranks,)


def test_a_step_failed_on_one_rank_fails_the_results_everywhere(pm):
    """The failure flag the ranks agree on after a run (in the C++ run): a step that failed
    on one rank only fails the results on the others too, with their own cause, and the
    workers go on. (The index is a mesh tensor said to be replicated, but out of range on
    dp=1 only.)"""

    @md.mesh_fn(data_parallel="dp", placements={"idx": md.Replicate()})
    def step(x, idx):
        return torch.index_select(x, 1, idx).sum(1)

    x = torch.arange(128.0).reshape(8, 16)
    with pm.activate():
        idx = (pm.rank("dp") * 99).long().reshape(1)
        out = step(x, idx)
        with pytest.raises(md.RemoteError, match="index"):
            md.inspect(out, dp=1, tp=0)
        with pytest.raises(md.RemoteError, match="failed on another rank"):
            md.inspect(out, dp=0, tp=0)
        torch.testing.assert_close(md.inspect(step(x, torch.tensor([3]))), x[:, 3])


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "fully_shard"])
def test_an_input_failed_on_one_rank_fails_the_results_everywhere(pm, sharded):
    """No rank hangs: the one whose input failed computes nothing but communicates zeros of
    each collective's argument shape (with fully_shard: a parameter's shard into the gather,
    not the gathered whole)."""
    model = nn.Linear(16, 16)
    if sharded:
        md.fully_shard(model)

    @md.mesh_fn(data_parallel="dp")
    def step(x):
        return model(x).sum()

    want = model(torch.ones(8, 16)).sum()
    with pm.activate():
        x = torch.ones(4, 16)  # each rank's part of an [8, 16] batch
        idx = (pm.rank("dp") * 99).long()  # out of range on dp=1 only
        bad = torch.index_select(x, 1, idx.reshape(1)).expand(4, 16).contiguous()
        out = step(bad)
        with pytest.raises(md.RemoteError, match="index"):
            md.inspect(bad, dp=1, tp=0)
        with pytest.raises(md.RemoteError, match="index"):
            md.inspect(out, dp=1, tp=0)  # its own input's root cause
        with pytest.raises(md.RemoteError, match="failed on another rank"):
            md.inspect(out, dp=0, tp=0)
        torch.testing.assert_close(md.inspect(step(x)), want)  # the workers go on


@pytest.mark.parametrize(
    "layout, make",
    [
        pytest.param("pp", _make(TwoStages, lr=0.1, momentum=0.9), id="pp"),
        pytest.param("dp+pp", _make(TwoStages, lr=0.1), id="dp+pp"),
        pytest.param("pp", _make(TwoStages, torch.optim.Adam, lr=0.01), id="pp-adam"),
    ],
)
def test_pipeline_on_workers(pm, layout, make):
    """pp=2 with 4 micro-batches (the fixture's tp dim is the pipeline dim here), alone and
    under dp=2."""
    pipe = pm.rename(tp="pp")
    dp = "dp" if layout == "dp+pp" else None
    if dp is None:
        pipe = pipe.slice(dp=0)
    _, losses = _train_on_workers(pipe, make, _batches(), data_parallel=dp, micro_batches=4)
    # The loss is held by the last stage's ranks.
    assert losses[0].mesh.sizes == ({"dp": 2} if dp else {})


class _Stages(nn.Module):
    """Two stages whose parameters have shapes no other test's have: (23, 16), (23,) and
    (21, 23), (21,)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(16, 23), nn.Linear(23, 21)

    def forward(self, x):
        with md.pipeline_stage(0):
            h = torch.relu(self.first(x))
        with md.pipeline_stage(1):
            return self.second(h)


def test_a_pipeline_stage_s_parameters_live_on_its_ranks_only(pm):
    """Each rank of pp=2 holds its own stage's parameters (and gradients), not a stale copy of
    the other stage's: a pipeline splits the model's memory. Pulled back, the values are
    one process's."""
    pipe = pm.rename(tp="pp").slice(dp=0)
    make = _make(_Stages, lr=0.1)
    model, opt, step_of = make()
    ref, ref_opt = copy.deepcopy((model, opt))
    step = md.mesh_fn(step_of(model, opt), micro_batches=2)
    refs = pipe.spawn("stage_refs", RefTable)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 21, generator=g)) for _ in "abc"]
    with pipe.activate():
        losses = [md.inspect(step(x, y)) for x, y in batches]
    held = refs.shapes.call().get(timeout=30).values()
    first, second = [(23, 16), (23,)], [(21, 23), (21,)]
    for rank, shapes in enumerate(held):
        own, other = (first, second) if rank == 0 else (second, first)
        assert all(s in shapes for s in own), (rank, shapes)
        assert not any(s in shapes for s in other), (rank, shapes)
    step.pull()
    for (x, y), loss in zip(batches, losses, strict=True):
        torch.testing.assert_close(loss, step_of(ref, ref_opt)(x, y).detach(), atol=ATOL, rtol=0)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


class PlanRuntime(md.Actor):
    """Looks into its worker's tensor engine: which runtime runs compiled plans (the name of
    the C++ module, or None for the Python reference executor) and how many C++ programs it
    has compiled (one per plan and rank)."""

    @md.endpoint
    def compiled(self) -> tuple[str | None, int]:
        runner = worker.current.executor().plan_runner
        if runner is None or runner.core is None:
            return None, 0
        core = runner.core
        return core.__name__, sum(
            isinstance(p, core.CompiledPlan) for p in runner.compiled.values()
        )


def _block(opt):
    def make():
        torch.manual_seed(0)
        model = Block()
        if opt == "adamw":
            # The key bias's true gradient is zero (softmax ignores a shift of all scores in a
            # row): its computed gradient is float noise (~1e-9) that differs with the order of
            # the batch reduction, and Adam scales noise up into steps of ~lr/10. Frozen here,
            # so that AdamW is compared where it is well conditioned.
            model.qkv.bias.requires_grad_(False)
            return model, torch.optim.AdamW(model.parameters(), lr=0.01), cross_entropy_step
        opt_ = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt_, cross_entropy_step

    return make


@pytest.mark.parametrize("opt", ["sgd-momentum", "adamw"])
def test_transformer_block_dp2_on_workers_runs_in_cpp(pm, opt):
    """Attention + MLP + layer norms, dp=2. The workers ran the plans in the C++ runtime
    (monarch_dsl._core): each compiled one program per plan for its rank."""
    dp = pm.slice(tp=0)
    probe = dp.spawn(f"plan_runtime_{opt}", PlanRuntime)
    before = probe.compiled.call().get(timeout=30).values()
    step, _ = _train_on_workers(dp, _block(opt), block_batches(), data_parallel="dp")
    after = probe.compiled.call().get(timeout=30).values()
    assert step.compiles == 2
    new = [(core, n - m) for (core, n), (_, m) in zip(after, before, strict=True)]
    assert new == [(_build.NAME, 2)] * 2, "compiled plans did not run in the C++ runtime"


class Groups(md.Actor):
    """The streams whose process groups this worker's tensor engine has made."""

    @md.endpoint
    def streams(self) -> list[str]:
        return sorted({key[0] for key in worker.current._executor.groups})


def test_a_plans_comms_do_not_share_groups_with_a_users_comms_stream(pm):
    """A compiled dp step (gradients all-reduced in buckets on the plan's comms stream) runs
    while the user's own md.Stream("comms") keeps reducing: both stay right. The plan's comms
    collectives have groups of their own; on one group, the two threads would mix up their
    messages."""
    dp = pm.slice(tp=0)
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    ref = copy.deepcopy(model)
    step = md.mesh_fn(
        mse_step(model, torch.optim.SGD(model.parameters(), lr=0.1)),
        data_parallel="dp",
        bucket_cap_mb=1e-3,  # ~1 KiB: the weight's and the bias's gradients in two buckets
    )
    comms = md.Stream("comms")
    batches = _batches(3)
    with dp.activate():
        sums = []
        for x, y in batches:
            with comms.activate():
                ones = torch.ones(64)
                for _ in range(4):
                    sums.append(ones.reduce("dp"))  # concurrent with the step's buckets
            loss = step(x, y)
        got = md.inspect(loss)
        with comms.activate():
            totals = [md.inspect(t) for t in sums]
    assert all(t.tolist() == [2.0] * 64 for t in totals)
    ref_step = mse_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1))
    for x, y in batches:
        want = ref_step(x, y).detach()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    streams = dp.spawn("groups", Groups).streams.call().get(timeout=30).values()
    assert all("plan/main/comms" in s and "comms" in s for s in streams), streams


def test_a_scheduled_learning_rate_is_an_input_and_a_changed_train_mode_compiles_again(pm):
    """A plan holds the optimizer's settings and the modules' train/eval mode as constants;
    its cache key has them. A learning rate a scheduler changes at every step becomes an input
    of the plan (compiler/hyper.py) at the step's second compile: the steps after run that
    plan, each with its own rate, with no warning. Its sign stays in the key: a rate that
    reaches zero compiles once more, with a warning; so does model.train() (dropout)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 16)).eval()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    factors = [0.0, 0.5, 1.0, 0.5, 0.25, 0.0, 0.0]  # a warmup from zero, a decay to zero
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factors.__getitem__)
    step = md.mesh_fn(mse_step(model, opt), data_parallel="dp")
    batches = _batches(6)
    with pm.activate(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches:
            step(x, y)
            sched.step()
        step.pull()
    said = [str(w.message) for w in caught if "compiled again" in str(w.message)]
    want = "opt.param_groups[0]['lr'] changed from a positive value to zero"
    assert len(said) == 1 and want in said[0], said
    # the first call (lr 0: a constant), the second (the state on the mesh; lr an input),
    # the last (lr back at 0)
    assert step.compiles == 3
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, factors.__getitem__)
    for x, y in batches:
        mse_step(ref, ref_opt)(x, y)
        ref_sched.step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, msg=name)  # each step with its own lr
    model.train()
    with pm.activate(), pytest.warns(UserWarning, match="train/eval mode of model changed"):
        md.inspect(step(*batches[0]))
    assert step.compiles == 4


def test_plan_is_sent_once_then_only_run(pm, monkeypatch):
    from monarch_dsl import isa
    from monarch_dsl.tensor import Engine

    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    step = md.mesh_fn(
        mse_step(model, torch.optim.SGD(model.parameters(), lr=0.1)), data_parallel="dp"
    )
    sent = []
    real = Engine.append
    monkeypatch.setattr(
        Engine, "append", lambda self, m, ins: (sent.append(ins), real(self, m, ins))[1]
    )
    x, y = _batches(1)[0]
    with pm.activate():
        for _ in range(5):
            loss = step(x, y)
        md.inspect(loss)
    kinds = [type(i).__name__ for i in sent]
    # Two plans (before and after the optimizer has state), each defined once; five runs.
    assert kinds.count("DefinePlan") == 2 and kinds.count("RunPlan") == 5
    # Copies of local tensors: the parameters once, at the first run (they stay as state)...
    copies = [i for i in sent if isinstance(i, isa.CallOp)]
    assert {i.op for i in copies} == {"aten::_to_copy.default"} and len(copies) == 2
    # ... while the batch travels inside every run, with no ref of its own on the workers.
    for run in (i for i in sent if isinstance(i, isa.RunPlan)):
        # Each rank is sent its own rows only: its dp coordinate's half, whatever its tp.
        assert not run.sent and [k for k, _ in run.parts] == [0, 1], run
        assert run.inputs[:2] == (-1, -1)
        torch.testing.assert_close([v.whole for _, v in run.parts], [x, y], atol=0, rtol=0)
        for _, v in run.parts:
            half = {
                r: (0, 4) if pm.coords_of(i)["dp"] == 0 else (4, 8) for i, r in enumerate(pm.ranks)
            }
            assert v.rows == half


def test_a_local_argument_is_sent_as_it_was_when_the_step_was_called(pm):
    """The batch is copied at the call: changed in place right after (before the batched
    call has even left this process), the step still computes with the value it was given;
    the next call gets the changed value."""
    dp = pm.slice(tp=0)
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    ref = copy.deepcopy(model)
    step = md.mesh_fn(lambda x, y: torch.nn.functional.mse_loss(model(x), y), data_parallel="dp")
    x, y = _batches(1)[0]
    want = []
    with dp.activate():
        losses = []
        for _ in range(3):
            want.append(torch.nn.functional.mse_loss(ref(x), y).detach())
            losses.append(step(x, y))
            x.add_(1.0)
        got = [md.inspect(loss) for loss in losses]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert len({round(w.item(), 3) for w in want}) == 3  # (three different batches)


def test_a_bucket_held_by_the_user_is_not_written_by_the_next_run(pm):
    """The workers reuse an all-reduce's result buffer (a gradient bucket's) from one run to
    the next (as torch DDP keeps its buckets), but only when nothing holds it: here each call
    returns the all-reduced gradients, and the first call's must still hold the first batch's
    after the second and third calls wrote theirs. (Without the check, they hold the third's.)"""
    dp = pm.slice(tp=0)
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)

    def grads(x, y):
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        return [p.grad for p in model.parameters()]

    step = md.mesh_fn(grads, data_parallel="dp")
    batches = _batches(3)
    with dp.activate():
        results = [step(x, y) for x, y in batches]
        got = [[md.inspect(g) for g in r] for r in results]
    for (x, y), gs in zip(batches, got, strict=True):
        ref.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for g, p in zip(gs, ref.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, atol=ATOL, rtol=0)
    plan = step.compile(*batches[0], mesh=md.Mesh.from_string("dp=2"))
    assert [c.reason.split(" of ")[0] for c in plan.collectives] == ["{dp: P(sum)} -> {dp: R}"] * 4


@pytest.mark.parametrize("width", [16, 160])  # gradients in kept buffers (<= 64 KiB), or not
def test_a_gradient_bucket_is_all_reduced_in_the_gradients_themselves(pm, width):
    """A gradient dies at its bucket's all-reduce and nothing else holds it: the runtime
    reduces the bucket in the gradients (no result buffer, nothing copied out of one), small
    gradients in the buffers their steps keep between runs included; the values are one
    process's."""
    _train_and_check_buckets_in_place(pm.slice(tp=0), width)


@pytest.mark.parametrize("env", [{"MD_SHM": "0"}, {"MD_SHM_SIZE_LIMIT": "16384"}])
def test_a_bucket_in_place_over_gloo_goes_through_one_flat_copy(env):
    """Without shared memory (gloo), or a bucket over its size limit (each gradient under
    it), the bucket is reduced in a flat copy and copied back."""
    dp = md.this_host().spawn_procs({"dp": 2}, env=env)
    try:
        _train_and_check_buckets_in_place(dp, 160)
    finally:
        dp.stop()


def _train_and_check_buckets_in_place(
    dp, width: int, calls: int = 3, shared: int | None = None
) -> None:
    """``calls`` steps of a 2-layer MLP on ``dp`` match one process's, and every plan's last
    run reduced its bucket in place (``shared``: in a block of shared memory in so many
    all-reduces, in the last run of the mesh's plan)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 16))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = md.mesh_fn(mse_step(model, opt), data_parallel="dp")
    batches = _batches(calls)
    with dp.activate():
        losses = [md.inspect(step(x, y)) for x, y in batches]
        got = step.state_dict()
        if shared is not None:
            assert shared_last_run(dp, step) == [shared] * len(dp)
    for (x, y), loss in zip(batches, losses, strict=True):
        torch.testing.assert_close(loss, mse_step(ref, ref_opt)(x, y).detach())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[f"model.{name}"], p.detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(got[f"model.{name}.grad"], p.grad, atol=ATOL, rtol=0)
    plans = sorted({pid for c in step.cache.values() for pid in c.ids.values()})
    per_rank = dp.spawn("plans", Plans).reduced_in_place.call(plans).get().values()
    for made in per_rank:  # (each plan the step made: from local modules, then on the mesh)
        assert len(made) == len(plans) and all(b >= 1 and done == b for b, done, _ in made), made


def test_a_gradient_bucket_goes_into_a_block_of_shared_memory_the_ranks_map(pm):
    """On shared memory, a bucket's gradients are written by the steps that make them into a
    block every rank maps, from the plan's third run on, and reduced there (no copies in or
    out of the group's slots); the values stay one process's. The block has two halves: a
    caller that holds the last two calls' gradients holds both, and the next call reduces in
    place instead; once they are dropped, the next is in the block again."""
    dp = pm.slice(tp=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 160), nn.ReLU(), nn.Linear(160, 16))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def train(x, y):
        loss = mse_step(model, opt)(x, y)
        return loss, model[0].weight.grad

    step = md.mesh_fn(train, data_parallel="dp")
    batches = _batches(8)
    losses, grads, shared = [], [], []
    with dp.activate():
        # the mesh's plan: runs 1 to 3 (the first call's plan is from the local modules)
        for x, y in batches[:4]:
            loss, grad = step(x, y)
            losses.append(md.inspect(loss))
            grads.append(md.inspect(grad))
            del loss, grad
        shared.append(shared_last_run(dp, step))
        held = []
        for x, y in batches[4:7]:  # (each call's gradient held on)
            held.append(step(x, y))
            losses.append(md.inspect(held[-1][0]))  # (the call has run on every rank)
            shared.append(shared_last_run(dp, step))
        grads += [md.inspect(g) for _, g in held]
        del held
        loss, grad = step(*batches[7])
        losses.append(md.inspect(loss))
        grads.append(md.inspect(grad))
        shared.append(shared_last_run(dp, step))
        got = step.state_dict()
    # in a block, in both halves while the caller holds one, in place once it holds both
    assert shared == [[1, 1], [1, 1], [1, 1], [0, 0], [1, 1]]
    for (x, y), loss, grad in zip(batches, losses, grads, strict=True):
        torch.testing.assert_close(loss, mse_step(ref, ref_opt)(x, y).detach())
        torch.testing.assert_close(grad, ref[0].weight.grad, atol=ATOL, rtol=0)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[f"model.{name}"], p.detach(), atol=ATOL, rtol=0)


def test_four_ranks_reduce_a_bucket_in_a_block_each_writing_its_slice_into_every_block():
    """With more than two ranks each rank's slice of the sum is copied into every other rank's
    block (two ranks write both at once)."""
    dp = md.this_host().spawn_procs({"dp": 4})
    try:
        _train_and_check_buckets_in_place(dp, 160, calls=5, shared=1)
    finally:
        dp.stop()


def test_md_shm_blocks_0_keeps_buckets_out_of_shared_blocks():
    """``MD_SHM_BLOCKS=0`` on the workers: buckets are reduced in place through the group's
    slots, with the same values."""
    dp = md.this_host().spawn_procs({"dp": 2}, env={"MD_SHM_BLOCKS": "0"})
    try:
        _train_and_check_buckets_in_place(dp, 160, calls=5, shared=0)
    finally:
        dp.stop()


def test_a_step_that_returns_nothing_and_two_steps_on_one_model(pm):
    """A training step written without a ``return`` (or with ``None`` in its result) gives
    ``None`` back. A second step on the same parameters while the first holds their updated
    values on the workers is refused, naming both, until the first is pulled: it would start
    from the stale local values."""
    dp = pm.slice(tp=0)
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def train(x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    def train_and_tell(x, y):
        train(x, y)
        return {"loss": torch.nn.functional.mse_loss(model(x), y), "note": None}

    step = md.mesh_fn(train, data_parallel="dp")
    other = md.mesh_fn(train_and_tell, data_parallel="dp")
    batches = _batches(3)
    with dp.activate():
        assert step(*batches[0]) is None and step(*batches[1]) is None
        with pytest.raises(RuntimeError, match=r"held on the workers by train\b.*train.pull\(\)"):
            other(*batches[2])
    step.pull()
    with dp.activate():
        out = other(*batches[2])
        assert out["note"] is None
        md.inspect(out["loss"])
    other.pull()
    for x, y in batches:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_the_state_a_step_replaces_keeps_its_refs_and_the_old_value_is_freed_as_the_run_ends(
    pm, monkeypatch
):
    """A step's gradients (state it leaves on the workers) are the next call's inputs and
    are replaced by its results under the same refs: the workers bind each ref to its new
    value when the run ends, which frees the value it replaced then, before the next call
    runs (its memory, one of the two all-reduce buffers a step alternates between, is free to
    be used again), with no new handle on the controller and no Delete message per value."""
    from monarch_dsl import isa
    from monarch_dsl.tensor import Engine

    dp = pm.slice(tp=0)
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    step = md.mesh_fn(
        mse_step(model, torch.optim.SGD(model.parameters(), lr=0.1)), data_parallel="dp"
    )
    engine = Engine.of(dp)
    sent = []
    real = engine.job.post
    monkeypatch.setattr(
        engine.job,
        "post",
        lambda ranks, msg: (sent.extend(i for _, i in getattr(msg, "items", ())), real(ranks, msg))[
            1
        ],
    )
    x, y = _batches(1)[0]
    with dp.activate():
        step(x, y)  # compiles; the rest run the same plan
        results = []
        for _ in range(4):
            loss = step(x, y)
            results.append(loss._md_ref)
        md.inspect(loss)
    runs = [k for k, i in enumerate(sent) if isinstance(i, isa.RunPlan)]
    assert len(runs) == 5
    deleted = {r for i in sent[runs[1] :] if isinstance(i, isa.Delete) for r in i.refs}
    for a, b in zip(runs[1:], runs[2:]):
        state = set(sent[a].outputs) - set(results) - {-1}
        assert state and state == set(sent[b].outputs) - set(results) - {-1}, (sent[a], sent[b])
        assert state <= set(sent[b].inputs) and not state & deleted, (sent[a], sent[b])


def test_each_step_s_gradient_is_read_back_under_the_ref_it_replaced(pm):
    """The gradient a step leaves is bound to the ref of the one it replaced: read right
    after each call (step.state_dict()), it is that step's gradient, as one-process torch
    computes it; and a layout change (another batch size: a new plan, the same gradient
    shapes) keeps working."""
    dp = pm.slice(tp=0)
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = md.mesh_fn(mse_step(model, opt), data_parallel="dp")
    g = torch.Generator().manual_seed(5)
    batches = [
        (torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g)) for n in (8, 8, 8, 4, 4)
    ]
    with dp.activate():
        for x, y in batches:
            step(x, y)
            mse_step(ref, ref_opt)(x, y)
            got = step.state_dict()
            torch.testing.assert_close(got["model.weight.grad"], ref.weight.grad)
            torch.testing.assert_close(got["model.bias.grad"], ref.bias.grad)
            torch.testing.assert_close(got["model.weight"], ref.weight.detach())


def test_a_one_rank_group_agrees_without_a_collective():
    """``exchange.any_failed`` on a group of one rank: no collective (on a GPU its flag's
    ``item()`` would wait for all queued kernels at every call); two ranks still exchange."""
    from monarch_dsl.runtime import exchange

    class Group:
        def __init__(self, n):
            self.n, self.calls = n, 0

        def size(self):
            return self.n

        def allreduce(self, tensors, opts):
            self.calls += 1
            tensors[0].fill_(1)  # another rank failed

            class Done:
                def wait(self):
                    pass

            return Done()

    one, two = Group(1), Group(2)
    assert exchange.any_failed(one, True, "cpu") and not exchange.any_failed(one, False, "cpu")
    assert one.calls == 0
    assert exchange.any_failed(two, False, "cpu") and two.calls == 1


def test_a_batch_sent_by_rows_follows_each_meshs_ranks_and_may_be_empty(pm):
    """A data-parallel step's batch goes to each rank as its rows (serialize.PerRank): on a
    mesh of another job whose ranks differ (the plan is shared: its rows are by the mesh's
    ranks, not by a mesh id each job counts on its own), and with no rows at all, sent as
    any tensor, along with what was issued before it."""
    step = md.mesh_fn(lambda x: (x * 2.0).sum(), data_parallel="dp")
    x = torch.arange(8 * 4, dtype=torch.float32).view(8, 4)
    first, second = (md.this_host().spawn_procs(s) for s in ({"dp": 2}, {"pp": 2, "dp": 2}))
    try:
        with first.activate():
            assert md.inspect(step(x)).item() == 992.0
        step.pull()
        stage = second.slice(pp=1)  # ranks 2 and 3, the first mesh of its job
        with stage.activate():
            assert md.inspect(step(x)).item() == 992.0
        step.pull()
    finally:
        first.stop()
        second.stop()
    rows = md.mesh_fn(lambda x: x * 2.0, data_parallel="dp")
    # (local tensors: made before the activation, under which a factory makes mesh tensors)
    none, four, ones = torch.zeros(0, 3), torch.arange(12.0).view(4, 3), torch.ones(3)
    with pm.slice(tp=0).activate():
        w = md.to_mesh(ones, pm.slice(tp=0))  # (in the same batch as the call)
        empty = md.inspect(rows(none))
        got_w, doubled = md.inspect(w), md.inspect(rows(four))
    assert empty.shape == (0, 3)
    assert torch.equal(got_w, ones) and torch.equal(doubled, four * 2)
