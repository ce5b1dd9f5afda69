"""Pure tests of ``monarch_dsl.mesh.Mesh``: no processes, no devices."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch_dsl.mesh import Mesh

# ---- construction and shape -------------------------------------------------------------------


def test_construct_from_mapping_and_keywords():
    m = Mesh({"host": 2, "gpu": 4})
    assert m == Mesh(host=2, gpu=4)
    assert m.dims == ("host", "gpu")
    assert m.sizes == {"host": 2, "gpu": 4}
    assert list(m.sizes) == ["host", "gpu"]
    assert len(m) == 8
    assert m.ndim == 2
    assert m.ranks == list(range(8))
    assert all(type(r) is int for r in m.ranks)


def test_zero_dim_mesh():
    m = Mesh()
    assert m.dims == ()
    assert m.sizes == {}
    assert len(m) == 1
    assert m.ranks == [0]
    assert m.points() == [{}]


def test_a_dim_may_be_called_sizes():
    assert Mesh(sizes=3).sizes == {"sizes": 3}


@pytest.mark.parametrize(
    "sizes, error, words",
    [
        ({"a": 0}, ValueError, "must be >= 1, got 0"),
        ({"a": -2}, ValueError, "must be >= 1"),
        ({"a": True}, TypeError, "must be an int, got bool"),
        ({"a": 2.0}, TypeError, "must be an int, got float"),
        ({"a b": 2}, ValueError, "Python identifier, got 'a b'"),
        ({"1a": 2}, ValueError, "identifier"),
        ({"é": 2}, ValueError, "ASCII"),
        ({3: 2}, TypeError, "must be a str, got int"),
    ],
)
def test_construct_rejects_bad_sizes(sizes, error, words):
    with pytest.raises(error, match=words):
        Mesh(sizes)


def test_construct_rejects_wrong_arguments():
    with pytest.raises(TypeError, match="Mesh.from_string"):
        Mesh("host=2")
    with pytest.raises(TypeError, match="not both"):
        Mesh({"a": 2}, b=3)
    with pytest.raises(TypeError, match="mapping"):
        Mesh([("a", 2)])


def test_numpy_int_sizes_are_accepted():
    assert Mesh(a=np.int64(3)).sizes == {"a": 3}


def test_size():
    m = Mesh(host=2, gpu=4)
    assert m.size() == 8
    assert m.size("gpu") == 4
    assert m.size(("host", "gpu")) == 8
    assert m.size(["gpu"]) == 4
    assert m.size(()) == 1
    with pytest.raises(KeyError, match=r"no dim 'tp'.*\('host', 'gpu'\)"):
        m.size("tp")
    with pytest.raises(KeyError, match="tp"):
        m.size(("host", "tp"))
    with pytest.raises(TypeError):
        m.size(3)


def test_mesh_is_not_iterable_and_ranks_are_read_only():
    m = Mesh(a=2)
    with pytest.raises(TypeError):
        iter(m)
    with pytest.raises(ValueError):
        m._ranks[0] = 5


# ---- rename -----------------------------------------------------------------------------------


def test_rename():
    m = Mesh(host=2, gpu=4).slice(gpu=slice(1, 3))
    r = m.rename(host="dp", gpu="tp")
    assert r.dims == ("dp", "tp")
    assert r.ranks == m.ranks
    assert Mesh(a=2, b=3).rename(a="b", b="a").sizes == {"b": 2, "a": 3}


def test_rename_errors():
    m = Mesh(host=2, gpu=4)
    with pytest.raises(KeyError, match="no dim 'cpu'"):
        m.rename(cpu="x")
    with pytest.raises(ValueError, match="unique, found 'host'"):
        m.rename(gpu="host")
    with pytest.raises(ValueError, match="identifier"):
        m.rename(gpu="not a name")


# ---- split and flatten ------------------------------------------------------------------------


def test_split():
    m = Mesh(host=2, gpu=4)
    s = m.split(gpu=("dp", "tp"), tp=2)
    assert s.sizes == {"host": 2, "dp": 2, "tp": 2}
    assert s.ranks == m.ranks
    assert s.slice(tp=1).ranks == [1, 3, 5, 7]
    assert m.split(gpu=("dp", "tp"), dp=4).sizes == {"host": 2, "dp": 4, "tp": 1}
    assert m.split(gpu=["dp", "tp"], dp=2, tp=2) == s


def test_split_several_dims_and_reuse_of_the_split_name():
    m = Mesh(host=4, gpu=6)
    s = m.split(host=("pp", "host"), pp=2, gpu=("dp", "tp"), tp=3)
    assert s.sizes == {"pp": 2, "host": 2, "dp": 2, "tp": 3}
    assert s.ranks == m.ranks
    assert m.split(gpu=("gpu", "tp"), tp=2).sizes == {"host": 4, "gpu": 3, "tp": 2}


def test_split_errors():
    m = Mesh(host=2, gpu=4)
    with pytest.raises(ValueError, match="not divisible by 3"):
        m.split(gpu=("dp", "tp"), tp=3)
    with pytest.raises(ValueError, match="multiply to 6, expected 4"):
        m.split(gpu=("dp", "tp"), dp=2, tp=3)
    with pytest.raises(ValueError, match="at most one size"):
        m.split(gpu=("dp", "tp"))
    with pytest.raises(ValueError, match="unique, found 'host'"):
        m.split(gpu=("host", "tp"), tp=2)
    with pytest.raises(ValueError, match="unique, found 'tp'"):
        m.split(gpu=("tp", "tp"), tp=2)
    with pytest.raises(ValueError, match="zz=3, which is not a new dim"):
        m.split(gpu=("dp", "tp"), tp=2, zz=3)
    with pytest.raises(ValueError, match="host=2, which is not a new dim"):
        m.split(gpu=("dp", "tp"), tp=2, host=2)
    with pytest.raises(ValueError, match="needs a dim to split"):
        m.split(tp=2)
    with pytest.raises(ValueError, match="at least one new dim"):
        m.split(gpu=())
    with pytest.raises(KeyError, match="no dim 'cpu'"):
        m.split(cpu=("a", "b"), a=1)
    with pytest.raises(TypeError, match="got gpu='dp'"):
        m.split(gpu="dp")
    with pytest.raises(TypeError, match="got tp=True"):
        m.split(gpu=("dp", "tp"), tp=True)


def test_flatten():
    m = Mesh(a=2, b=4)
    assert m.flatten("x").sizes == {"x": 8}
    assert m.flatten("x").ranks == m.ranks
    column = m.slice(b=slice(1, 3))
    assert column.flatten("x").ranks == [1, 2, 5, 6]
    assert Mesh().flatten("x").ranks == [0]
    with pytest.raises(ValueError, match="identifier"):
        m.flatten("1x")


# ---- slice ------------------------------------------------------------------------------------


def test_spec_example_slice_ranks():
    assert Mesh(a=2, b=4).slice(b=1).ranks == [1, 5]


def test_slice():
    m = Mesh(host=2, gpu=4)
    assert m.slice(host=1).sizes == {"gpu": 4}
    assert m.slice(host=1).ranks == [4, 5, 6, 7]
    assert m.slice(gpu=-1).ranks == [3, 7]
    assert m.slice(gpu=slice(None, None, 2)).ranks == [0, 2, 4, 6]
    assert m.slice(gpu=slice(None, None, -1)).ranks == [3, 2, 1, 0, 7, 6, 5, 4]
    assert m.slice(host=0, gpu=2).dims == ()
    assert m.slice(host=0, gpu=2).ranks == [2]
    assert m.slice() == m
    assert m.slice(gpu=np.int64(1)).ranks == [1, 5]


def test_slice_errors():
    m = Mesh(host=2, gpu=4)
    with pytest.raises(KeyError, match="no dim 'tp'"):
        m.slice(tp=0)
    with pytest.raises(IndexError, match="index 4 is out of range for dim 'gpu' of size 4"):
        m.slice(gpu=4)
    with pytest.raises(IndexError):
        m.slice(gpu=-5)
    with pytest.raises(ValueError, match="selects nothing"):
        m.slice(gpu=slice(4, None))
    with pytest.raises(ValueError, match="selects nothing"):
        m.slice(gpu=slice(2, 1))
    with pytest.raises(ValueError, match="must not be zero"):
        m.slice(gpu=slice(None, None, 0))
    with pytest.raises(TypeError, match="got gpu='0'"):
        m.slice(gpu="0")
    with pytest.raises(TypeError):
        m.slice(gpu=True)
    with pytest.raises(TypeError, match="ints or None"):
        m.slice(gpu=slice("a", None))


def test_slice_of_slice():
    m = Mesh(a=3, b=4, c=5)
    s = m.slice(b=slice(1, None, 2)).slice(a=2, c=slice(3, 0, -2))
    assert s.dims == ("b", "c")
    assert s.ranks == np.arange(60).reshape(3, 4, 5)[2, 1::2, 3:0:-2].reshape(-1).tolist()


# ---- coordinates ------------------------------------------------------------------------------


def test_points_coords_and_index():
    m = Mesh(a=2, b=3)
    assert m.points()[:4] == [
        {"a": 0, "b": 0},
        {"a": 0, "b": 1},
        {"a": 0, "b": 2},
        {"a": 1, "b": 0},
    ]
    assert len(m.points()) == 6
    for i, point in enumerate(m.points()):
        assert m.coords_of(i) == point
        assert m.index_of(**point) == i
    assert m.coords_of(-1) == {"a": 1, "b": 2}
    assert m.index_of(a=-1, b=0) == 3
    assert Mesh().coords_of(0) == {}
    assert Mesh().index_of() == 0


def test_coordinate_errors():
    m = Mesh(a=2, b=3)
    with pytest.raises(IndexError, match="index 6 is out of range"):
        m.coords_of(6)
    with pytest.raises(TypeError):
        m.coords_of(1.0)
    with pytest.raises(KeyError, match="no dim 'c'"):
        m.index_of(a=0, b=0, c=0)
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        m.index_of(a=0)
    with pytest.raises(IndexError, match="dim 'b' of size 3"):
        m.index_of(a=0, b=3)


def test_rank_needs_an_active_mesh():
    with pytest.raises(RuntimeError, match=r"mesh.rank\(.*pm.activate\(\)"):
        Mesh(a=2).rank("a")


# ---- text -------------------------------------------------------------------------------------


def test_to_table_2d():
    assert Mesh(host=2, gpu=4).to_table() == (
        "        gpu=0  gpu=1  gpu=2  gpu=3\n"
        "host=0      0      1      2      3\n"
        "host=1      4      5      6      7"
    )


def test_to_table_3d_slice():
    m = Mesh(a=2, b=3, c=4).slice(b=slice(0, None, 2), c=slice(1, 3))
    assert m.to_table() == (
        "         c=0  c=1\n"
        "a=0,b=0    1    2\n"
        "a=0,b=1    9   10\n"
        "a=1,b=0   13   14\n"
        "a=1,b=1   21   22"
    )


def test_to_table_1d_and_0d():
    assert Mesh(gpu=3).slice(gpu=slice(1, None)).to_table() == "gpu=0  gpu=1\n    1      2"
    assert Mesh(a=2, b=4).slice(a=1, b=2).to_table() == "rank\n   6"


@pytest.mark.parametrize(
    "mesh, text",
    [
        (Mesh(host=2, gpu=4), "host=2,gpu=4"),
        (Mesh(host=2, gpu=4).slice(gpu=slice(1, 3)), "host=2,gpu=2 ranks=[1,2,5,6]"),
        (Mesh(host=2, gpu=4).slice(host=0), "gpu=4"),
        (Mesh(), "()"),
        (Mesh(a=2, b=4).slice(a=1, b=1), "() ranks=[5]"),
        (Mesh(a=8).slice(a=0), "()"),
    ],
)
def test_str_and_from_string(mesh, text):
    assert str(mesh) == text
    assert Mesh.from_string(text) == mesh
    assert repr(mesh) == f"Mesh({text!r})"


def test_from_string_tolerates_whitespace():
    parsed = Mesh.from_string("  host = 2 ,\tgpu=2\n ranks = [ 1, 2,5 ,6 ] ")
    assert parsed == Mesh(host=2, gpu=4).slice(gpu=slice(1, 3))
    assert Mesh.from_string("( )  ranks=[ 7 ]").ranks == [7]


def test_from_string_keyword_is_still_a_dim_name():
    assert Mesh.from_string("ranks=2").sizes == {"ranks": 2}
    assert Mesh.from_string("a=1,ranks=2 ranks=[3,4]").ranks == [3, 4]


@pytest.mark.parametrize(
    "text, words",
    [
        ("host=2,,gpu=4", r"at column 8: expected a name, found ','"),
        ("host=x", "at column 6: expected an integer, found 'x'"),
        ("a=2 b=3", "expected ',' or 'ranks', found 'b'"),
        ("a=2 ranks=[1,2", "found end of input"),
        ("", "expected '\\(' or a name, found end of input"),
        ("a=2;", "found ';'"),
        ("a=2,a=3", "unique, found 'a'"),
        ("a=2 ranks=[1]", "2 positions but ranks=.* lists 1"),
        ("a=2 ranks=[1,1]", r"distinct, found \[1\]"),
        ("a=0", "must be >= 1"),
    ],
)
def test_from_string_errors(text, words):
    with pytest.raises(ValueError, match=words):
        Mesh.from_string(text)


def test_from_string_error_points_at_the_column():
    with pytest.raises(ValueError) as info:
        Mesh.from_string("host=2,,gpu=4")
    assert "host=2,,gpu=4\n       ^" in str(info.value)


def test_from_string_rejects_non_text():
    with pytest.raises(TypeError):
        Mesh.from_string(b"a=2")


def test_importing_mesh_does_not_import_lark():
    # Load mesh.py on its own (not through the package) in a fresh interpreter.
    path = Path(__file__).parents[1] / "monarch_dsl" / "mesh.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('mesh_alone', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "module.Mesh(a=2).slice(a=1).to_table()\n"
        "assert 'lark' not in sys.modules, 'lark was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- value semantics --------------------------------------------------------------------------


def test_equality_and_hash():
    m = Mesh(a=2, b=4)
    assert m == Mesh(a=2, b=4)
    assert hash(m) == hash(Mesh(a=2, b=4))
    assert m != Mesh(b=2, a=4)
    assert m != m.slice(b=slice(0, 2))
    assert m.slice(a=0) == Mesh(b=4)
    assert m.flatten("x") != Mesh(x=2, y=4).flatten("x").rename(x="y")
    assert len({m, Mesh(a=2, b=4), m.slice(b=1)}) == 2
    assert m != "a=2,b=4"


def test_pickle_round_trip():
    m = Mesh(a=2, b=4).slice(b=slice(1, None, 2))
    assert pickle.loads(pickle.dumps(m)) == m


class _Tagged(Mesh):
    """A subclass that, like ProcMesh, keeps its type through every operation."""

    def _derive(self, dims, ranks):
        return _Tagged._from_array(dims, ranks)


def test_every_operation_goes_through_derive():
    m = _Tagged._from_array(("host", "gpu"), np.arange(8).reshape(2, 4))
    results = [
        m.rename(host="dp"),
        m.split(gpu=("a", "b"), b=2),
        m.flatten("x"),
        m.slice(gpu=1),
        m.slice(host=slice(0, 1)),
    ]
    assert all(type(r) is _Tagged for r in results)


# ---- properties -------------------------------------------------------------------------------

NAMES = ["host", "gpu", "dp", "tp", "pp", "ranks", "x_1", "_y"]


@st.composite
def meshes(draw) -> Mesh:
    dims = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    sizes = draw(st.lists(st.integers(1, 5), min_size=len(dims), max_size=len(dims)))
    return Mesh(dict(zip(dims, sizes, strict=True)))


def _selection(draw, size: int) -> int | slice:
    """An int (maybe negative) or a non-empty slice (maybe with a step) of ``range(size)``."""
    if draw(st.booleans()):
        return draw(st.integers(-size, size - 1))
    bound = st.none() | st.integers(-size - 2, size + 2)
    step = draw(st.sampled_from([None, 1, 2, 3, -1, -2]))
    s = slice(draw(bound), draw(bound), step)
    return s if len(range(size)[s]) else slice(None, None, step)


@st.composite
def sliced(draw) -> tuple[Mesh, dict]:
    """A mesh and a slice() argument over a random subset of its dims."""
    m = draw(meshes())
    chosen = draw(st.lists(st.sampled_from(m.dims), unique=True))
    return m, {d: _selection(draw, m.size(d)) for d in chosen}


def _reference(m: Mesh) -> np.ndarray:
    return np.arange(len(m)).reshape(tuple(m.sizes.values()))


def _numpy_index(m: Mesh, index: dict) -> tuple:
    return tuple(index.get(d, slice(None)) for d in m.dims)


@settings(max_examples=60, deadline=None)
@given(sliced())
def test_slice_matches_numpy(case):
    m, index = case
    s = m.slice(**index)
    expected = _reference(m)[_numpy_index(m, index)]
    assert s.ranks == expected.reshape(-1).tolist()
    assert s.dims == tuple(d for d in m.dims if not isinstance(index.get(d), int))
    assert tuple(s.sizes.values()) == expected.shape


@settings(max_examples=40, deadline=None)
@given(sliced(), st.data())
def test_slice_of_slice_matches_numpy(case, data):
    m, first = case
    s = m.slice(**first)
    chosen = data.draw(st.lists(st.sampled_from(s.dims), unique=True)) if s.dims else []
    second = {d: _selection(data.draw, s.size(d)) for d in chosen}
    expected = _reference(m)[_numpy_index(m, first)][_numpy_index(s, second)]
    assert s.slice(**second).ranks == expected.reshape(-1).tolist()


def _factor_split(draw, m: Mesh) -> tuple[str, dict]:
    """split() arguments that split one dim of ``m`` into two factors."""
    dim = draw(st.sampled_from(m.dims))
    size = m.size(dim)
    inner = draw(st.sampled_from([f for f in range(1, size + 1) if size % f == 0]))
    return dim, {dim: ("outer_", "inner_"), "inner_": inner}


@settings(max_examples=40, deadline=None)
@given(sliced(), st.data())
def test_split_then_flatten_keeps_ranks(case, data):
    m = case[0].slice(**case[1])
    if not m.dims:
        m = m.flatten("x")
    dim, kwargs = _factor_split(data.draw, m)
    s = m.split(**kwargs)
    assert s.ranks == m.ranks
    assert s.size(("outer_", "inner_")) == m.size(dim)
    assert s.flatten("x") == m.flatten("x")


@settings(max_examples=40, deadline=None)
@given(sliced())
def test_rename_keeps_ranks(case):
    m = case[0].slice(**case[1])
    renamed = m.rename(**{d: f"{d}_new" for d in m.dims})
    assert renamed.ranks == m.ranks
    assert renamed.dims == tuple(f"{d}_new" for d in m.dims)
    assert renamed.rename(**{f"{d}_new": d for d in m.dims}) == m


@settings(max_examples=40, deadline=None)
@given(meshes())
def test_flatten_of_split_is_identity_on_ranks(m):
    # Split every dim into (size, 1) and (1, size) factors at once, then flatten.
    kwargs: dict = {}
    for d in m.dims:
        kwargs[d] = (f"{d}_o", f"{d}_i")
        kwargs[f"{d}_i"] = 1
    s = m.split(**kwargs)
    assert len(s.dims) == 2 * len(m.dims)
    assert s.flatten("all").ranks == m.ranks == list(range(math.prod(m.sizes.values())))


@settings(max_examples=60, deadline=None)
@given(sliced())
def test_str_round_trip(case):
    m = case[0].slice(**case[1])
    text = str(m)
    parsed = Mesh.from_string(text)
    assert parsed == m
    assert str(parsed) == text
    assert hash(parsed) == hash(m)
