"""md.distribute: layouts by placements on real workers (what each rank holds), uneven chunks
as torch.chunk makes them, tensors made on the mesh, pytrees, and bad placements refused before
anything is sent."""

from __future__ import annotations

import pytest
import torch
from conftest import local_mesh

import monarch_dsl as md
from monarch_dsl.mesh import all_coords

pytestmark = pytest.mark.procs


ab = local_mesh({"a": 2, "b": 2})


def _held(t, mesh):
    """{coords: what that rank holds}."""
    dims = mesh.dims
    return {
        c: md.inspect(t, **dict(zip(dims, c))) for c in all_coords([mesh.size(d) for d in dims])
    }


def test_shard_over_one_dim_replicate_over_the_other(ab):
    x = torch.arange(24.0).reshape(6, 4)
    with ab.activate():
        held = _held(md.distribute(x, {"a": md.Shard(0)}), ab)
    for (a, _b), value in held.items():
        torch.testing.assert_close(value, x[3 * a : 3 * a + 3])


def test_nested_shards_leftmost_dim_is_the_outer_chunk(ab):
    x = torch.arange(32.0).reshape(8, 4)
    with ab.activate():
        same_dim = _held(md.distribute(x, {"a": md.Shard(0), "b": md.Shard(0)}), ab)
        two_dims = _held(md.distribute(x, [md.Shard(0), md.Shard(1)]), ab)  # DTensor's form
    for (a, b), value in same_dim.items():
        torch.testing.assert_close(value, x[4 * a + 2 * b : 4 * a + 2 * b + 2])
    for (a, b), value in two_dims.items():
        torch.testing.assert_close(value, x[4 * a : 4 * a + 4, 2 * b : 2 * b + 2])


def test_uneven_chunks_follow_torch_chunk(ab):
    flat = ab.flatten("dp")
    x = torch.arange(10.0)
    three = torch.arange(3.0)
    with flat.activate():
        uneven = _held(md.distribute(x, {"dp": md.Shard(0)}), flat)
        short = _held(md.distribute(three, md.Shard(0)), flat)  # one placement, 1-D mesh
    want = torch.chunk(x, 4)
    assert [uneven[(i,)].tolist() for i in range(4)] == [c.tolist() for c in want]
    # torch.chunk(3 elements, 4) makes 3 chunks: the last rank holds an empty one
    assert [short[(i,)].tolist() for i in range(4)] == [[0.0], [1.0], [2.0], []]


def test_replicate_pytrees_and_tensors_made_on_the_mesh(ab):
    x = torch.arange(8.0).reshape(4, 2)
    with ab.activate():
        tree = md.distribute({"x": x, "n": 3, "y": [x * 2]}, {"b": md.Shard(0)})
        assert tree["n"] == 3
        whole = md.distribute(x, {})  # every dim replicated
        made_here = torch.arange(8.0).reshape(4, 2)  # a mesh tensor: the same on every rank
        sliced = _held(md.distribute(made_here, {"b": md.Shard(0)}), ab)
        held = _held(tree["y"][0], ab)
        torch.testing.assert_close(md.inspect(whole, a=1, b=1), x)
    for (_a, b), value in held.items():
        torch.testing.assert_close(value, 2 * x[2 * b : 2 * b + 2])
    for (_a, b), value in sliced.items():
        torch.testing.assert_close(value, x[2 * b : 2 * b + 2])


def test_bad_placements_are_refused_before_anything_is_sent(ab):
    x = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="needs a mesh"):
        md.distribute(x, {"a": md.Shard(0)})
    with ab.activate():
        with pytest.raises(ValueError, match="cannot make a Partial"):
            md.distribute(x, {"a": md.Partial("sum")})
        with pytest.raises(KeyError, match="'dp'"):
            md.distribute(x, {"dp": md.Shard(0)})
        with pytest.raises(ValueError, match="1 placements for a mesh with 2 dims"):
            md.distribute(x, [md.Shard(0)])
        with pytest.raises(ValueError, match="one placement is for a 1-D mesh"):
            md.distribute(x, md.Shard(0))
        with pytest.raises(ValueError, match=r"Shard\(2\) over 'a' needs a tensor with dim 2"):
            md.distribute(x, {"a": md.Shard(2)})
        with pytest.raises(TypeError, match="placements must be"):
            md.distribute(x, "dp")


def test_a_local_generator_cannot_drive_a_mesh_op(ab):
    """Under activation torch.randn(..., generator=g) would run on the workers with a copy of
    g's state taken whenever the batch is sent (and g never advancing): refused, saying what to
    do instead."""
    g = torch.Generator().manual_seed(1)
    local = torch.randn(4, 2, generator=g)  # made locally, before activating
    with ab.activate():
        with pytest.raises(TypeError, match="a torch.Generator cannot drive an op on the mesh"):
            torch.randn(4, generator=g)
        with pytest.raises(TypeError, match="torch.Generator"):
            torch.bernoulli(torch.full((4,), 0.5), generator=g)
        x = md.distribute(local, {"a": md.Shard(0)})
        torch.testing.assert_close(md.inspect(x, a=1, b=0), local[2:])
