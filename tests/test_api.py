"""Pure API pieces (no processes): futures, value meshes, points, current_rank."""

import asyncio
import threading

import pytest

import monarch_dsl as md
from monarch_dsl.actor import ValueMesh
from monarch_dsl.runtime.context import Point


def test_current_rank_outside_a_worker_is_an_error():
    with pytest.raises(RuntimeError, match="worker"):
        md.current_rank()


def test_point_coordinates_and_flat_rank():
    p = Point.of_index(5, ("host", "gpu"), (2, 4))
    assert dict(p) == {"host": 1, "gpu": 1} and p.rank == 5
    assert p["gpu"] == 1 and p.sizes == {"host": 2, "gpu": 4} and p.dims == ("host", "gpu")
    with pytest.raises(KeyError, match="dims are"):
        p["tp"]


def test_value_mesh_access():
    vm = ValueMesh(md.Mesh(a=2, b=3), list(range(6)))
    assert len(vm) == 6 and vm.values() == list(range(6))
    assert vm.item(a=1, b=2) == 5
    assert [(dict(p), v) for p, v in vm.items()][4] == ({"a": 1, "b": 1}, 4)
    with pytest.raises(ValueError, match="single value"):
        vm.item()
    with pytest.raises(IndexError):
        vm.item(a=2, b=0)
    assert ValueMesh(md.Mesh(a=1), ["x"]).item() == "x"


def test_future_get_timeout_result_exception_and_await():
    f = md.Future()
    with pytest.raises(TimeoutError):
        f.get(timeout=0.01)
    threading.Timer(0.05, lambda: f.set_result(3)).start()
    assert f.get(timeout=10) == 3 and f.done()
    assert not f.set_result(4) and f.get() == 3  # first completion wins

    g = md.Future()
    g.set_exception(ValueError("x"))
    with pytest.raises(ValueError):
        g.get()
    assert isinstance(g.exception(), ValueError)

    h = md.Future()

    async def wait():
        threading.Timer(0.05, lambda: h.set_result("later")).start()
        return await h

    assert asyncio.run(wait()) == "later"
    seen = []
    h.add_done_callback(lambda fut: seen.append(fut.get()))
    assert seen == ["later"]
