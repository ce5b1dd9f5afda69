"""``@md.mesh_fn``: a whole training step compiled into one plan and run on a mesh.

```python
@md.mesh_fn(data_parallel="dp")
def step(x, y):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss

plan = step.compile(x, y, mesh=md.Mesh.from_string("dp=2"))   # no processes needed
with pm.activate():
    loss = step(x, y)        # sends the plan once; later calls send "run plan k"
step.pull()                  # the trained parameters and optimizer state back in the module
```

The step keeps the modules' parameters and buffers, the optimizers' state and the gradients
on the workers (each rank its shard), from the first call on a mesh until ``pull()``.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from monarch_dsl import isa
from monarch_dsl.compiler.capture import used_objects
from monarch_dsl.compiler.compile import compile_step
from monarch_dsl.compiler.hyper import Hyper, current, is_setting, liftable_now, sign_of
from monarch_dsl.compiler.interpret import sent_rows
from monarch_dsl.compiler.lower import Program, lower
from monarch_dsl.compiler.ops import ALIASING, base_name
from monarch_dsl.compiler.plan import (
    Partial,
    Placement,
    Plan,
    Replicate,
    Shard,
    TensorType,
    format_placements,
)
from monarch_dsl.compiler.simulate import SimReport
from monarch_dsl.frames import user_line
from monarch_dsl.mesh import Mesh, all_coords
from monarch_dsl.runtime.serialize import PerRank, snapshot
from monarch_dsl.tensor import Engine, Tensor, active_mesh, fetch, lift
from monarch_dsl.tensor.handle import contiguous_desc
from monarch_dsl.tensor.replay import new_plan_id


def mesh_fn(
    fn: Callable | None = None,
    *,
    placements: dict[str, Any] | None = None,
    data_parallel: str | None = None,
    out_placements: dict[str, Any] | None = None,
    mesh: Mesh | Mapping[str, int] | None = None,
    bucket_cap_mb: float = 25,
    micro_batches: int = 1,
):
    """Compile ``fn`` (forward, backward and optimizer step) for a mesh; see the module doc."""

    def wrap(f: Callable) -> MeshFunction:
        return MeshFunction(
            f, placements, data_parallel, out_placements, mesh, bucket_cap_mb, micro_batches
        )

    return wrap(fn) if fn is not None else wrap


class _Compiled:
    """A compiled plan, with what every call of it needs worked out once."""

    def __init__(self, plan: Plan, program: Program, captured) -> None:
        self.plan = plan
        self.program = program
        self.captured = captured
        self.ids: dict[int, int] = {}  # engine id -> plan id on its workers
        sizes = plan.sizes
        self.types = plan.types()
        self.home = _homes(plan)
        self.n_args = sum(1 for i in plan.inputs if i.kind == "arg")
        self.hypers = captured.hypers  # the optimizer settings its inputs of kind hyper follow
        self.lifted = {lift.name: lift for lift in captured.lifted}
        # per input: (name, kind, whole type, local shape, stage)
        self.inputs = [
            (i.name, i.kind, i.type, i.type.local_shape(sizes), self.home.get(i.name, ()))
            for i in plan.inputs
        ]
        self.placements = tuple(i.type.placements for i in plan.inputs)
        # (input index, the mesh's ranks) -> its ranks' rows, where a local argument is sent
        # by parts
        self.rows: dict[tuple[int, tuple], dict[int, tuple[int, int]] | None] = {}
        # per output: (name, kind, whole type, md.Tensor description, stage, in place); in
        # place: state the step updated in place (a momentum buffer): its input's ref stays.
        roots = _roots(plan)
        inputs = {i.name: i.type for i in plan.inputs}
        self.outputs = []
        for o, shape, dtype in zip(plan.outputs, program.output_shapes, program.output_dtypes):
            desc = contiguous_desc(tuple(shape or ()), getattr(torch, dtype))
            t = self.types[o.var]
            inplace = o.kind == "state" and roots.get(o.var) == o.name and inputs.get(o.name) == t
            self.outputs.append((o.name, o.kind, t, desc, self.home.get(o.var, ()), inplace))


def _roots(plan: Plan) -> dict[str, str]:
    """Value -> the input whose storage it is (through writes in place and aliasing views)."""
    root = {i.name: i.name for i in plan.inputs}
    for ins in plan.body:
        uses = ins.uses()
        if not uses or "." not in ins.op or uses[0] not in root:
            continue
        name, inplace = base_name(ins.op)
        if inplace or name in ALIASING:
            for o in ins.outs:
                root[o] = root[uses[0]]
    return root


# Tensors (parameters, buffers) whose up-to-date values a step keeps on the workers, by id ->
# (the tensor, weakly; that step): another step on the same tensors would start from their
# stale local values. (Tensors compare elementwise, so no WeakKeyDictionary.)
_held_by: dict[int, tuple[weakref.ref[torch.Tensor], MeshFunction]] = {}
_held_lock = threading.Lock()


def _claim(mf: MeshFunction) -> None:
    """Before ``mf`` puts its modules' tensors on a mesh: refuse if another step holds any of
    them there (its updates are on the workers, not in the local tensors), else take them."""
    modules, _ = used_objects(mf.fn)
    tensors = [t for m in modules.values() for t in (*m.parameters(), *m.buffers())]
    with _held_lock:
        for t in tensors:
            ref, other = _held_by.get(id(t), (None, None))
            if ref is None or ref() is not t or other is mf:
                continue
            mesh = other.state_mesh
            if mesh is not None and not mesh.stopped:
                raise RuntimeError(
                    f"{mf.__name__}: the parameters it uses are held on the workers by "
                    f"{other.__name__}, which has updated them there (the local tensors are "
                    f"stale); call {other.__name__}.pull() first, then {mf.__name__}"
                )
        for key in [k for k, (r, _) in _held_by.items() if r() is None]:
            del _held_by[key]  # (tensors gone)
        for t in tensors:
            _held_by[id(t)] = (weakref.ref(t), mf)


def _release(mf: MeshFunction) -> None:
    with _held_lock:
        for key in [k for k, (_, holder) in _held_by.items() if holder is mf]:
            del _held_by[key]


class MeshFunction:
    def __init__(
        self, fn, placements, data_parallel, out_placements, mesh, bucket_cap_mb, micro_batches
    ):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.placements = placements
        self.data_parallel = data_parallel
        self.out_placements = out_placements
        self.mesh = mesh
        self.bucket_cap_mb = bucket_cap_mb
        self.micro_batches = micro_batches
        self.cache: dict[tuple, _Compiled] = {}
        self.compiles = 0
        # On a process mesh: name -> (md.Tensor of this rank's shard, whole TensorType, kind:
        # "param" for parameters and buffers, "state" for optimizer state and gradients)
        self.state: dict[str, tuple[Any, TensorType, str]] = {}
        self.state_mesh: Any = None
        self.home: dict[str, tuple] = {}  # state name -> the pipeline stage that holds it
        self._state_key: tuple | None = None  # of the state's layout, while it is unchanged
        # The modules and optimizers the step uses (``used_objects``), found when the step
        # starts from the local objects (its first call, or after pull()).
        self._objects: tuple[dict, dict] | None = None
        self._submodules: dict[str, list] = {}  # each of those modules' submodules, then
        self._settings: tuple | None = None  # the settings key of the latest compile
        # Optimizer settings the plans take as inputs (``compiler/hyper.py``): those a
        # scheduler changed; and (setting, state key) pairs where that failed, not tried again.
        self._lifted: tuple[Hyper, ...] = ()
        self._lift_failed: set[tuple[Hyper, tuple]] = set()

    # ---- compiling -----------------------------------------------------------------------
    def compile(
        self, *args: Any, mesh: Mesh | Mapping[str, int] | None = None, **kwargs: Any
    ) -> Plan:
        """The plan for these example arguments on ``mesh`` (a ``Mesh`` value, or its dims'
        sizes as ``{"dp": 2}``: no processes needed), the decorator's mesh, or the active
        one."""
        mesh = mesh or self.mesh or active_mesh()
        if mesh is None:
            raise ValueError(
                f"{self.__name__}.compile: no mesh: pass mesh=md.Mesh.from_string('dp=2'), "
                "give one to @md.mesh_fn(mesh=...), or call it under pm.activate()"
            )
        return self._compiled(
            args, kwargs, _mesh_spec(mesh, f"{self.__name__}.compile: "), None
        ).plan

    def _compiled(self, args, kwargs, spec, state) -> _Compiled:
        if state is None or self._objects is None:
            self._objects = used_objects(self.fn)
            self._submodules = _submodules(self._objects[0])
        if state is None:  # starting from the local modules and optimizers, as they are now
            skey = ("local", _local_state_key(*self._objects))
        else:
            if self._state_key is None:
                self._state_key = _state_key(state)
            skey = self._state_key
        optimizers = self._objects[1]
        settings = _settings_key(self._submodules, optimizers, self._lifted)
        # (the default dtype: what the step's factories and type promotion give)
        sig = (_signature(args, kwargs), torch.get_default_dtype())
        hit = self.cache.get((spec, sig, skey, settings))
        if hit is not None:
            return hit
        lift, change = self._lifted, ""
        if self._settings is not None and settings != self._settings:
            change = _settings_change(self._settings, settings)
            changed = _changed_settings(self._settings, settings) or []
            new = [
                h
                for h in changed
                if h not in lift
                and (h, skey) not in self._lift_failed
                and liftable_now(h, optimizers)
            ]
            if new:  # a scheduler's: take them in as inputs of the plan from now on
                lift, change = lift + tuple(new), ""
            if change:
                warnings.warn(
                    f"{self.__name__}: {change} since it was compiled; a plan holds this as a "
                    "constant, so it is compiled again",
                    stacklevel=4,
                )
        opt_state = values = placements = None
        if state is not None:  # what the workers hold: whole shapes, and placements

            def example(t: TensorType) -> torch.Tensor:
                return torch.empty(t.shape, dtype=getattr(torch, t.dtype))

            opt_state = {n: example(t) for n, (_, t, k) in state.items() if k == "state"}
            values = {n: example(t) for n, (_, t, k) in state.items() if k != "state"}
            placements = {n: t.placements for n, (_, t, _k) in state.items()}
        ex_args, ex_kwargs = self._examples(args, kwargs, spec)
        # A lifted setting now at zero (a warmup's first step) is a constant of this plan
        # (its cache key says zero: the sign of a lifted setting is part of it).
        now = tuple(h for h in lift if liftable_now(h, optimizers))
        plan, captured = compile_step(
            self.fn,
            ex_args,
            ex_kwargs,
            spec,
            placements=self.placements,
            data_parallel=self.data_parallel,
            out_placements=self.out_placements,
            state=opt_state,
            state_placement=placements,
            values=values,
            bucket_cap_mb=self.bucket_cap_mb,
            name=self.__name__,
            micro_batches=self.micro_batches,
            lift=now,
        )
        if captured.not_lifted:  # they stay constants: a change compiles again, as it did
            self._lift_failed |= {(h, skey) for h in now}
            lift = ()
            warnings.warn(
                f"{self.__name__}: {_settings_change(self._settings or settings, settings)} "
                f"since it was compiled, and it cannot be an input of the plan "
                f"({captured.not_lifted}); a plan holds it as a constant, so it is compiled "
                "again at every change",
                stacklevel=4,
            )
        self._lifted = lift
        self._settings = settings = _settings_key(self._submodules, optimizers, lift)
        compiled = _Compiled(plan, lower(plan), captured)
        self.cache[(spec, sig, skey, settings)] = compiled
        self.compiles += 1
        return compiled

    def _examples(self, args, kwargs, spec):
        """Whole-shape stand-ins for mesh tensors among the arguments: a mesh tensor is each
        rank's part, so its whole shape is its shape times the shards of its placement."""
        from monarch_dsl.compiler.compile import arg_leaf_names, normalize_placements

        leaves = arg_leaf_names(self.fn, args, kwargs)
        if not any(isinstance(v, Tensor) for _, v in leaves):
            return args, kwargs
        dims = tuple(d for d, _ in spec)
        names = [n for n, _ in leaves]
        given = normalize_placements(self.placements, dims, names, self.data_parallel, names)
        whole = {}
        for name, v in leaves:
            if isinstance(v, Tensor):
                shape = list(v.shape)
                for (_, n), p in zip(spec, given.get(name, ())):
                    if isinstance(p, Shard) and p.dim < len(shape):
                        shape[p.dim] *= n
                whole[id(v)] = torch.empty(shape, dtype=v.dtype)
        conv = lambda v: whole.get(id(v), v)  # noqa: E731
        return pytree.tree_map(conv, args), pytree.tree_map(conv, kwargs)

    # ---- running -------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pm = active_mesh()
        if pm is None:
            raise RuntimeError(
                f"{self.__name__}: call it under `with pm.activate():` to run it on a mesh, "
                f"or use {self.__name__}.compile(..., mesh=...) to get its plan"
            )
        if self.state_mesh is not None and self.state_mesh is not pm:
            raise RuntimeError(
                f"{self.__name__}: its state lives on another mesh ({self.state_mesh}); "
                f"call {self.__name__}.pull() first to bring it back"
            )
        # Tracing and the local bookkeeping below are not mesh ops: outside the mesh's mode.
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return _run(self, pm, args, kwargs)

    def timeline(self, *args: Any, **kwargs: Any) -> SimReport:
        """Run one call of the step (a real one: its state is updated as by any call) with
        every worker recording what its C++ runtime did, step by step, and return that as an
        ``md.SimReport`` of measured events (``measured.py``), comparable with
        ``self.compile(...).simulate()``: ``display()``, ``save_trace()``, the totals. Call
        it after a first call, or the first call's one-time work is in it. Needs the C++
        runtime in the workers."""
        pm = active_mesh()
        if pm is None:
            raise RuntimeError(f"{self.__name__}.timeline: call it under `with pm.activate():`")
        from monarch_dsl import measured

        return measured.measure(self, pm, args, kwargs)

    def record(self) -> Any:
        """``with step.record() as rec:`` -- every call of the step in the block, recorded by
        every worker's C++ runtime; when the block ends, ``rec.reports`` holds one
        ``md.SimReport`` per call, in order. Calls issued back to back run as in training
        (each right after the one before), where ``timeline`` records one call from idle
        workers. Under ``pm.activate()``; needs the C++ runtime in the workers."""
        pm = active_mesh()
        if pm is None:
            raise RuntimeError(f"{self.__name__}.record: call it under `with pm.activate():`")
        from monarch_dsl import measured

        return measured.Recording(self, pm)

    def pull(self) -> None:
        """Copy the parameters, buffers, optimizer state and gradients the step keeps on the
        workers back into the local modules and optimizers (whole values), and let go of the
        workers' copies. The next call on a mesh distributes them again."""
        if self.state_mesh is None:
            return
        pm = self.state_mesh
        values = {
            name: _gather(h, t, pm, fetch, self.home.get(name, ()))
            for name, (h, t, _) in self.state.items()
        }
        modules, optimizers = used_objects(self.fn)
        named = _named_tensors(modules, optimizers)
        with torch.no_grad():
            for name, v in values.items():
                if name in named:
                    named[name].copy_(v)
                    continue
                pname, _, key = name.rpartition(".")
                p = named.get(pname)
                if p is None:
                    continue
                if key == "grad":
                    p.grad = v
                    continue
                for opt in optimizers.values():
                    if any(q is p for g in opt.param_groups for q in g["params"]):
                        opt.state[p][key] = v
        self.state = {}
        self._state_key = None
        self._objects = None
        self.state_mesh = None
        _release(self)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole values of the state the step keeps on the workers, by name."""
        return {
            n: _gather(h, t, self.state_mesh, fetch, self.home.get(n, ()))
            for n, (h, t, _) in self.state.items()
        }


def _mesh_spec(mesh: Any, where: str = "") -> tuple[tuple[str, int], ...]:
    """(dim, size) of ``mesh``: a mesh (a ``Mesh`` value, a process mesh) or its dims' sizes
    as ``{"dp": 2}`` (checked as ``Mesh`` checks them)."""
    if isinstance(mesh, Mapping):
        mesh = Mesh(mesh)
    if not hasattr(mesh, "sizes"):
        raise TypeError(
            f"{where}mesh must be a mesh or its sizes ({{'dp': 2}}), got {type(mesh).__name__}"
        )
    return tuple((d, n) for d, n in mesh.sizes.items())


def _plain(args: tuple, kwargs: dict) -> bool:
    """Whether the arguments are tensors, positional only (``step(x, y)``, most steps): their
    signature and leaves are found without pytree (str(spec) alone costs ~20 us a call)."""
    return not kwargs and all(isinstance(a, torch.Tensor) for a in args)


def _signature(args: tuple, kwargs: dict) -> tuple:
    if _plain(args, kwargs):
        return ("tensors", tuple([(tuple(a.shape), a.dtype) for a in args]))
    leaves, spec = pytree.tree_flatten((args, kwargs))
    sig = []
    for v in leaves:
        if isinstance(v, torch.Tensor):
            sig.append(("T", tuple(v.shape), v.dtype))
        else:
            sig.append(("V", repr(v)))
    return (str(spec), tuple(sig))


def _state_key(state) -> tuple:
    if state is None:
        return ()
    return tuple(sorted((n, t, k) for n, (_, t, k) in state.items()))


def _named_tensors(modules, optimizers, state: bool = False) -> dict[str, torch.Tensor]:
    """The local tensors a step uses, by the names its plan gives them: parameters and buffers,
    and with ``state`` also the optimizers' state (``<param>.<key>``) and gradients."""
    named: dict[str, torch.Tensor] = {}
    for mname, mod in modules.items():
        for pname, p in mod.named_parameters():
            named.setdefault(f"{mname}.{pname}", p)
        for bname, b in mod.named_buffers():
            named.setdefault(f"{mname}.{bname}", b)
    if state:
        by_id = {id(t): n for n, t in named.items()}
        for opt in optimizers.values():
            for p, entries in opt.state.items():
                if id(p) in by_id:
                    for key, value in entries.items():
                        if isinstance(value, torch.Tensor):
                            named[f"{by_id[id(p)]}.{key}"] = value
        for n, t in list(named.items()):
            if isinstance(t, torch.nn.Parameter) and t.grad is not None:
                named[f"{n}.grad"] = t.grad
    return named


def _local_state_key(modules, optimizers) -> tuple:
    """The layout of the optimizer state and gradients a step would start from locally."""
    params = _named_tensors(modules, optimizers)
    named = _named_tensors(modules, optimizers, state=True)
    return tuple(
        sorted((n, tuple(t.shape), str(t.dtype)) for n, t in named.items() if n not in params)
    )


def _settings_key(submodules: dict[str, list], optimizers, lifted: tuple = ()) -> tuple:
    """What a plan holds as constants from the objects its step uses, besides their tensors'
    layout: the train/eval mode (dropout, batch norm) of each module's ``submodules``
    (``_submodules``, found once while the step's objects are the same) and each optimizer's
    hyperparameters per parameter group (a scheduler's learning rate). A change compiles the
    step again instead of running the old plan with the old values. Of the ``lifted``
    settings (``hyper.Hyper``: inputs of the plan) only the sign counts."""
    modes = tuple((name, tuple([m.training for m in subs])) for name, subs in submodules.items())
    # (optimizer, group, key, index) of each lifted setting, and (optimizer, group, key)
    taken = {(h.opt, h.group, h.key, h.index) for h in lifted}
    taken |= {t[:3] for t in taken}
    groups = tuple(
        (
            name,
            tuple(
                # (which parameters a group has: its lifted settings are only signs here)
                tuple([_setting(k, v, (name, i), taken) for k, v in g.items() if k != "params"])
                + (("params", tuple(map(id, g["params"]))),)
                for i, g in enumerate(opt.param_groups)
            ),
        )
        for name, opt in optimizers.items()
    )
    return modes, groups


def _changed_settings(old: tuple, new: tuple) -> list[Hyper] | None:
    """The float settings (``hyper.Hyper``) that differ between two ``_settings_key`` values;
    None where anything else changed too (a mode, a group, a setting of another kind)."""
    if old[0] != new[0] or len(old[1]) != len(new[1]):
        return None
    out: list[Hyper] = []
    for (name, a), (name_b, b) in zip(old[1], new[1]):
        if name != name_b or len(a) != len(b):
            return None
        for i, (ga, gb) in enumerate(zip(a, b)):
            if len(ga) != len(gb):
                return None
            for sa, sb in zip(ga, gb):
                if sa == sb:
                    continue
                if sa[0] != sb[0] or len(sa) != 2 or len(sb) != 2:
                    return None
                va, vb = sa[1], sb[1]
                if is_setting(va) and is_setting(vb):
                    out.append(Hyper(name, i, sa[0]))
                elif (
                    isinstance(va, tuple)
                    and isinstance(vb, tuple)
                    and len(va) == len(vb)
                    and all(x == y or (is_setting(x) and is_setting(y)) for x, y in zip(va, vb))
                ):
                    out += [
                        Hyper(name, i, sa[0], j) for j, (x, y) in enumerate(zip(va, vb)) if x != y
                    ]
                else:
                    return None
    return out


def _submodules(modules) -> dict[str, list]:
    return {name: list(module.modules()) for name, module in modules.items()}


def _setting(
    key: str, value: Any, where: tuple = (), lifted: set | frozenset = frozenset()
) -> tuple:
    """A setting in the settings key; ``lifted``: (optimizer, group, key, index) of the
    settings the plan takes as inputs (of those only the sign counts); ``where``: (optimizer,
    group) of this one."""
    if lifted and (*where, key) in lifted:
        if is_setting(value) and (*where, key, None) in lifted:
            return (key, ("lifted", sign_of(value)))
        if isinstance(value, tuple):
            return (
                key,
                tuple(
                    ("lifted", sign_of(v)) if is_setting(v) and (*where, key, j) in lifted else v
                    for j, v in enumerate(value)
                ),
            )
    if isinstance(value, torch.Tensor):  # a tensor learning rate: its value, where it is local
        if value.numel() == 1 and not isinstance(value, Tensor):
            return (key, "tensor", value.item())
        return (key, "tensor", id(value))
    try:
        hash(value)
    except TypeError:
        return (key, repr(value))
    return (key, value)


def _settings_change(old: tuple, new: tuple) -> str:
    """What changed between two ``_settings_key`` values, for the recompile warning."""
    if old[0] != new[0]:
        changed = [name for (name, a), (_, b) in zip(old[0], new[0]) if a != b]
        return f"the train/eval mode of {', '.join(changed) or 'a module'} changed"
    for (name, a), (_, b) in zip(old[1], new[1]):
        for i, (ga, gb) in enumerate(zip(a, b)):
            for sa, sb in zip(ga, gb):
                if sa != sb:
                    return (
                        f"{name}.param_groups[{i}][{sa[0]!r}] changed from "
                        f"{_shown(sa[-1])} to {_shown(sb[-1])}"
                    )
    return "the optimizers' settings changed"


def _shown(value: Any) -> str:
    """A setting's value in a settings key, as the recompile warning says it (of a lifted
    setting the key holds its sign)."""
    if isinstance(value, tuple) and value[:1] == ("lifted",):
        return {1: "a positive value", -1: "a negative value"}.get(value[1], "zero")
    if isinstance(value, tuple):
        return f"({', '.join(_shown(v) for v in value)})"
    return repr(value)


def _gather(handle, t: TensorType, pm, fetch, home: tuple = ()) -> torch.Tensor:
    """The whole value of a state tensor from its shards (partials reduced); ``home``: the
    pipeline stage ((dim, index),) whose ranks hold it (the others' copies are stale)."""
    from monarch_dsl.compiler.interpret import whole_value

    sizes = tuple(pm.sizes.values())
    dims = tuple(pm.sizes)
    ranks = [c for c in all_coords(sizes) if all(c[dims.index(d)] == i for d, i in home)]
    parts = {c: None for c in all_coords(sizes)}
    own = handle.mesh.sizes  # a stage's value lives on a slice of the mesh
    futures = {c: fetch(handle, **{d: x for d, x in zip(dims, c) if d in own}) for c in ranks}
    for c, f in futures.items():
        parts[c] = f.get(timeout=60)
    return whole_value(parts, t, sizes)


def _run(mf: MeshFunction, pm, args: tuple, kwargs: dict) -> Any:
    line = user_line()
    spec = _mesh_spec(pm)
    engine = Engine.of(pm)
    engine.ensure_collectives()
    first = mf.state_mesh is None
    if first:
        _claim(mf)
    compiled = mf._compiled(args, kwargs, spec, None if first else mf.state)
    plan = compiled.plan
    mesh_id = engine.mesh_id(pm)
    pid = compiled.ids.get(id(engine))
    if pid is None:
        pid = new_plan_id()
        compiled.ids[id(engine)] = pid
        engine.append(mesh_id, isa.DefinePlan(pid, compiled.program, compiled.placements))
    inputs, split, sent, parts, keep = [], [], [], [], []
    if _plain(args, kwargs):
        flat_args = list(args)
    else:
        leaves = pytree.tree_flatten((args, kwargs))[0]
        flat_args = [v for v in leaves if isinstance(v, torch.Tensor)]
    if len(flat_args) != compiled.n_args:
        raise TypeError(
            f"{mf.__name__}: expected {compiled.n_args} tensor arguments, got {len(flat_args)}"
        )
    named = None  # the modules' own tensors: needed only before the state is on the mesh
    state = mf.state
    settings = current(compiled.hypers, mf._objects[1]) if compiled.hypers else []
    for k, (name, kind, whole_type, local_shape, stage) in enumerate(compiled.inputs):
        if kind == "hyper":  # the optimizers' settings now, sent with the call
            lifted = compiled.lifted[name]
            # (on the CPU, as a local argument is, whatever default device is in force)
            value = torch.tensor(lifted.value(settings), dtype=lifted.dtype, device="cpu")
            sent.append((k, value))
            inputs.append(-1)
            continue
        if kind == "arg":
            value = flat_args[k]
        elif name in state:  # a handle _run made for the layout this plan was compiled for
            value = state[name][0]
            inputs.append(value._md_ref)
            keep.append(value)
            continue
        else:
            if named is None:
                named = _named_tensors(*used_objects(mf.fn), state=True)
            if name not in named:
                raise RuntimeError(f"internal: no value for the plan input {name!r}")
            value = named[name].detach()
        if isinstance(value, Tensor):
            if value._md_mesh_id != mesh_id and value.mesh is not pm:
                if not set(value.mesh.ranks) <= set(pm.ranks):  # not even a stage's slice
                    raise TypeError(
                        f"{mf.__name__}: argument {name!r} lives on another mesh ({value.mesh})"
                    )
            if tuple(value.shape) != local_shape:
                raise TypeError(
                    f"{mf.__name__}: argument {name!r} is a mesh tensor of shape "
                    f"{list(value.shape)}, but each rank's part of a {list(whole_type.shape)} "
                    f"tensor laid out {format_placements(whole_type.placements, plan.dims)} is "
                    f"{list(local_shape)}"
                )
            inputs.append(value._md_ref)
            keep.append(value)
            continue
        if kind == "arg":  # sent with the call (a copy: the caller may change it after)
            copy = snapshot(value)
            rows = _rows(compiled, k, pm)
            if rows is not None and hasattr(copy, "_md_wire"):
                parts.append((k, PerRank(copy, rows)))  # each rank its own rows
            else:
                sent.append((k, copy))
            inputs.append(-1)
            continue
        # (a pipeline stage's parameters and state on that stage's ranks only, as its results)
        home = pm.slice(**dict(stage)) if stage else pm
        whole = lift(value, home)
        ref = engine.new_ref()
        desc = contiguous_desc(local_shape, value.dtype)
        local = Tensor(None, home, engine, ref, "main", desc=desc)
        split.append((whole._md_ref, ref, k))
        inputs.append(ref)
        keep.append(whole)
        state[name] = (local, whole_type, "state" if kind == "state" else "param")
        mf.home[name] = stage
        mf._state_key = None
    outs, results = [], []
    for name, kind, whole_type, desc, stage, inplace in compiled.outputs:
        if inplace and name in state:
            outs.append(-1)  # updated in place: the input's ref holds it
            continue
        if kind != "out":
            old = state.get(name)
            if (
                old is not None
                and old[1] == whole_type
                and old[2] == "state"
                and old[0]._md_desc == desc
                and mf.home.get(name) == stage
            ):
                # A new value of the same layout (a gradient, every step): the workers bind it
                # to the ref of the value it replaces when the run ends. No new handle here,
                # and no delete of the old one (~10 us a value on this side, and its message).
                outs.append(old[0]._md_ref)
                continue
        ref = engine.new_ref()
        # A pipeline stage's result lives on that stage's ranks.
        h = Tensor(None, pm.slice(**dict(stage)) if stage else pm, engine, ref, "main", desc=desc)
        outs.append(ref)
        if kind == "out":
            results.append(h)
        else:
            old = state.get(name)
            if old is None or old[1] != whole_type or old[2] != "state":
                mf._state_key = None  # the state's layout changed: a new cache key
            state[name] = (h, whole_type, "state")
            mf.home[name] = stage
    mf.state_mesh = pm
    engine.append(
        mesh_id,
        isa.RunPlan(
            pid,
            mesh_id,
            tuple(inputs),
            tuple(outs),
            tuple(split),
            "main",
            line,
            tuple(sent),
            tuple(parts),
        ),
    )
    return pytree.tree_unflatten(results, plan.out_spec)


def _rows(compiled: _Compiled, k: int, pm) -> dict[int, tuple[int, int]] | None:
    """Each rank's rows of local argument ``k`` where they are runs of its rows (the batch of
    a data-parallel step), by rank; None where it is sent whole. (Cached by the mesh's ranks
    in order: a plan serves the meshes of any job of its shape.)"""
    key = (k, tuple(pm.ranks))
    if key not in compiled.rows:
        sizes = compiled.program.sizes
        ranges = None
        if math.prod(sizes) == len(pm.ranks):
            ranges = sent_rows(compiled.inputs[k][2], sizes)
        compiled.rows[key] = None if ranges is None else dict(zip(pm.ranks, ranges, strict=True))
    return compiled.rows[key]


def _homes(plan: Plan) -> dict[str, tuple]:
    """For values that live on one pipeline stage: its ``on`` filter. Inputs: the stage of
    their users, where all are on one (a weight two stages use lives on the whole mesh);
    results: the stage of the instruction that makes them."""
    out: dict[str, tuple] = {}
    made: set[str] = set()
    for ins in plan.body:
        for u in ins.uses():
            if u not in made:
                out[u] = ins.on if out.get(u, ins.on) == ins.on else ()
        for o in ins.outs:
            out[o] = ins.on
            made.add(o)
    return {k: v for k, v in out.items() if v}


__all__ = ["mesh_fn", "MeshFunction", "Shard", "Replicate", "Partial", "Placement"]
