"""monarch_dsl.runtime.kernels: bucket flatten/unflatten and SGD/AdamW steps over flat buckets.

Each case runs on three paths: plain torch ops (the CPU path), torch's fused kernels (the
"torch" choice on CUDA; torch has them on CPU too), and the Triton kernels, which triton's
interpreter runs on CPU tensors under TRITON_INTERPRET=1 (set per test with monkeypatch; the
module builds interpreter kernels for CPU tensors itself, so no import order matters). On the
Triton path the torch implementations are replaced by ones that fail, so a silent fallback to
torch cannot pass for Triton. The optimizer steps are compared with torch.optim.SGD / AdamW
(foreach=False) over 4 steps on several parameters flattened into one bucket. The kernels are
also compiled for sm_90 without a GPU (triton's bundled ptxas), and run on CUDA when there is
one (marked gpu).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from monarch_dsl.runtime import kernels


def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


TRITON_MISSING = _triton_missing()
needs_triton = pytest.mark.skipif(
    TRITON_MISSING is not None,
    reason=f"triton does not import ({TRITON_MISSING}); it is in the dev extra",
)

# Sizes around the block sizes (COPY_BLOCK 2048, STEP_BLOCK 1024): whole blocks, a partial last
# block, one element, an empty tensor; their running offsets are not 16-byte aligned.
ODD_SHAPES = [(3, 5), (0,), (2049,), (1,), (7, 300), (4096,), (2, 0, 3), (1023,)]
# Offsets all multiples of 16 elements: the kernels' aligned (vectorized on GPU) case.
ALIGNED_SHAPES = [(16, 8), (2048,), (32,), (3, 1024)]
# The optimizer bucket: 3453 elements = 3 whole STEP_BLOCKs and a tail.
PARAM_SHAPES = [(5, 3), (17,), (1,), (2100,), (33, 40)]


def _fail(*args, **kwargs):
    raise AssertionError("an implementation this test shuts out ran (a silent fallback)")


def _use(monkeypatch, impl: str) -> None:
    """Make every op take ``impl``: "torch", "torch_fused" or "triton"."""
    choice = "triton" if impl == "triton" else "torch"
    monkeypatch.setattr(kernels, "KERNELS", {"*": choice})
    if impl == "triton":
        if TRITON_MISSING is not None:
            pytest.skip(f"triton does not import ({TRITON_MISSING}); it is in the dev extra")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        for name in (
            "_flatten_scale_torch",
            "_unflatten_into_torch",
            "_sgd_torch",
            "_sgd_torch_fused",
            "_adamw_torch",
            "_adamw_torch_fused",
        ):
            monkeypatch.setattr(kernels, name, _fail)
        assert kernels.backend(torch.zeros(1)) == "triton"
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert kernels.backend(torch.zeros(1)) == "torch"
    if impl == "torch_fused":
        monkeypatch.setattr(kernels, "_TORCH_FUSED_DEVICES", ("cpu", "cuda"))
        monkeypatch.setattr(kernels, "_sgd_torch", _fail)
        monkeypatch.setattr(kernels, "_adamw_torch", _fail)


def _cat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


# ---- flatten / unflatten -------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shapes", [ODD_SHAPES, ALIGNED_SHAPES], ids=["odd", "aligned"])
def test_flatten_unflatten_round_trip(monkeypatch, impl, dtype, shapes):
    _use(monkeypatch, impl)
    torch.manual_seed(0)
    tensors = [torch.randn(s).to(dtype) for s in shapes]
    flat = kernels.flatten_scale(tensors, 0.25)  # a power of two: exact in every dtype
    assert flat.shape == (sum(t.numel() for t in tensors),) and flat.dtype == dtype
    assert torch.equal(flat, _cat(tensors) * 0.25)
    back = [torch.full_like(t, float("nan")) for t in tensors]
    kernels.unflatten_into(flat, back, scale=4.0)
    for got, want in zip(back, tensors):
        assert torch.equal(got, want)
    if impl == "triton":
        whole, partial, align = kernels._chunk_table(flat, tensors)
        assert align == (16 // flat.element_size() if shapes is ALIGNED_SHAPES else 1)
        assert int(whole[:, 2].sum() + partial[:, 2].sum()) == flat.numel()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_scale_rounds_like_torch(monkeypatch, impl):
    # float32 with a scale float32 cannot hold: both paths round it to float32 as torch does.
    _use(monkeypatch, impl)
    torch.manual_seed(1)
    tensors = [torch.randn(s) for s in ODD_SHAPES]
    flat = kernels.flatten_scale(tensors, 1 / 3)
    assert torch.equal(flat, _cat(tensors) * (1 / 3))
    out = [torch.empty_like(t) for t in tensors]
    kernels.unflatten_into(flat, out, scale=1 / 7)
    assert torch.equal(_cat(out), flat * (1 / 7))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_flatten_reuses_out(monkeypatch, impl):
    _use(monkeypatch, impl)
    tensors = [torch.randn(s) for s in ODD_SHAPES]
    out = torch.full((sum(t.numel() for t in tensors),), float("nan"))
    assert kernels.flatten_scale(tensors, 0.5, out=out) is out
    assert torch.equal(out, _cat(tensors) * 0.5)
    for t in tensors:  # same bucket (a cached chunk table), new values
        t.mul_(-3)
    assert kernels.flatten_scale(tensors, 0.5, out=out) is out
    assert torch.equal(out, _cat(tensors) * 0.5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_views_and_casts_go_through_torch(monkeypatch, impl):
    # What the kernels cannot take (a transposed view, a float64 tensor filled from a float32
    # buffer) is done by torch on the Triton path too.
    monkeypatch.setattr(kernels, "KERNELS", {"*": impl})
    if impl == "triton":
        if TRITON_MISSING is not None:
            pytest.skip(f"triton does not import ({TRITON_MISSING})")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    base = torch.randn(7, 5)
    tensors = [torch.randn(3), base.t(), base[:, 1]]
    flat = kernels.flatten_scale(tensors, 2.0)
    assert torch.equal(flat, _cat(tensors) * 2)
    out = [torch.zeros(3, dtype=torch.float64), torch.zeros(7, 5).t(), torch.zeros(7, 2)[:, 1]]
    kernels.unflatten_into(flat, out, scale=0.5)
    assert torch.equal(out[0], tensors[0].double())
    assert torch.equal(out[1], tensors[1]) and torch.equal(out[2], tensors[2])


def test_bucket_errors():
    with pytest.raises(ValueError, match=r"one dtype on one device.*tensors\[1\] is torch.float64"):
        kernels.flatten_scale([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], 1.0)
    with pytest.raises(ValueError, match="out has 3 elements, expected 4"):
        kernels.flatten_scale([torch.zeros(2), torch.zeros(2)], 1.0, out=torch.zeros(3))
    with pytest.raises(ValueError, match="no tensors"):
        kernels.flatten_scale([], 1.0)
    assert kernels.flatten_scale([], 1.0, out=torch.zeros(0)).numel() == 0
    with pytest.raises(ValueError, match="flat has 5 elements, expected 4"):
        kernels.unflatten_into(torch.zeros(5), [torch.zeros(2), torch.zeros(2)])
    with pytest.raises(ValueError, match="contiguous 1-D"):
        kernels.unflatten_into(torch.zeros(2, 2), [torch.zeros(4)])


# ---- optimizer steps -----------------------------------------------------------------------


def _compare_with_torch(make_opt, our_step, dtype=torch.float32, steps=4):
    """Train PARAM_SHAPES parameters with ``make_opt(params)`` and, from the same start and
    gradients, a flat bucket with ``our_step(i, params_flat, grads_flat)``; returns
    (reference params, reference optimizer, our params_flat)."""
    gen = torch.Generator().manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in PARAM_SHAPES]
    params_flat = _cat(ref).clone()
    opt = make_opt(ref)
    for i in range(steps):
        grads = [torch.randn(s, generator=gen, dtype=dtype) for s in PARAM_SHAPES]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        our_step(i, params_flat, kernels.flatten_scale(grads, 1.0))
    return ref, opt, params_flat


def _assert_close(got, want, impl="triton"):
    # A few float32 roundings apart. float64 is held as close on the torch paths; Triton's
    # interpreter rounds float arguments (the hyperparameters) to float32, so there float64
    # gets float32's tolerance.
    tol = 1e-12 if got.dtype == torch.float64 and impl != "triton" else 1e-6
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


SGD_CASES = {
    "plain": dict(lr=0.1),
    "weight_decay": dict(lr=0.1, weight_decay=0.1),
    "momentum": dict(lr=0.1, momentum=0.9),
    "dampening": dict(lr=0.1, momentum=0.9, dampening=0.3),
    "nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
    "momentum_weight_decay": dict(lr=0.1, momentum=0.9, weight_decay=0.05),
    "maximize": dict(lr=0.1, momentum=0.5, maximize=True),
    "all": dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, maximize=True),
}


@pytest.mark.parametrize("impl", ["torch", "torch_fused", "triton"])
@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_matches_torch_optim(monkeypatch, impl, case, dtype=torch.float32):
    _use(monkeypatch, impl)
    hyper = SGD_CASES[case]
    momentum = hyper.get("momentum", 0.0)
    buf = torch.full((sum(torch.Size(s).numel() for s in PARAM_SHAPES),), float("nan"), dtype=dtype)

    def our_step(i, params_flat, grads_flat):
        kernels.sgd_step_(
            params_flat, grads_flat, buf if momentum else None, **hyper, first_step=i == 0
        )

    ref, opt, params_flat = _compare_with_torch(
        lambda ps: torch.optim.SGD(ps, foreach=False, **hyper), our_step, dtype
    )
    _assert_close(params_flat, _cat(ref), impl)
    if momentum:
        _assert_close(buf, _cat(opt.state[p]["momentum_buffer"] for p in ref), impl)


@pytest.mark.parametrize("impl", ["torch", "torch_fused", "triton"])
def test_sgd_float64(monkeypatch, impl):
    test_sgd_matches_torch_optim(monkeypatch, impl, "all", dtype=torch.float64)


ADAMW_CASES = {
    "default": dict(lr=1e-2),
    "no_weight_decay": dict(lr=1e-2, weight_decay=0.0),
    "maximize": dict(lr=1e-2, maximize=True),
    # 1 - beta1 >= 0.5: torch's lerp computes from the other end
    "betas": dict(lr=1e-2, betas=(0.3, 0.5), eps=1e-6, weight_decay=0.1),
}


@pytest.mark.parametrize("impl", ["torch", "torch_fused", "triton"])
@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_adamw_matches_torch_optim(monkeypatch, impl, case, dtype=torch.float32):
    _use(monkeypatch, impl)
    hyper = dict(ADAMW_CASES[case])
    n = sum(torch.Size(s).numel() for s in PARAM_SHAPES)
    exp_avg, exp_avg_sq = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    ours = dict(hyper)
    ours["beta1"], ours["beta2"] = ours.pop("betas", (0.9, 0.999))

    def our_step(i, params_flat, grads_flat):
        kernels.adamw_step_(params_flat, grads_flat, exp_avg, exp_avg_sq, step=i + 1, **ours)

    ref, opt, params_flat = _compare_with_torch(
        lambda ps: torch.optim.AdamW(ps, foreach=False, **hyper), our_step, dtype
    )
    _assert_close(params_flat, _cat(ref), impl)
    _assert_close(exp_avg, _cat(opt.state[p]["exp_avg"] for p in ref), impl)
    _assert_close(exp_avg_sq, _cat(opt.state[p]["exp_avg_sq"] for p in ref), impl)


@pytest.mark.parametrize("impl", ["torch", "torch_fused", "triton"])
def test_adamw_float64(monkeypatch, impl):
    test_adamw_matches_torch_optim(monkeypatch, impl, "betas", dtype=torch.float64)


def test_step_errors():
    p, g = torch.zeros(4), torch.zeros(4)
    with pytest.raises(ValueError, match="momentum != 0 needs momentum_buf_flat"):
        kernels.sgd_step_(p, g, None, lr=0.1, momentum=0.9, first_step=True)
    with pytest.raises(ValueError, match="nesterov needs momentum > 0 and dampening == 0"):
        kernels.sgd_step_(p, g, None, lr=0.1, nesterov=True, first_step=True)
    with pytest.raises(ValueError, match="grads_flat has 3 elements, expected 4"):
        kernels.sgd_step_(p, torch.zeros(3), None, lr=0.1, first_step=True)
    with pytest.raises(ValueError, match="exp_avg must be torch.float32"):
        kernels.adamw_step_(p, g, torch.zeros(4, dtype=torch.float64), g.clone(), step=1)
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        kernels.adamw_step_(p, g, g.clone(), g.clone(), step=1, amsgrad=True)
    with pytest.raises(ValueError, match="step is the count after the increment"):
        kernels.adamw_step_(p, g, g.clone(), g.clone(), step=0)


# ---- choosing the implementation -----------------------------------------------------------


def test_parse_choice():
    assert kernels.parse_choice("") == {"*": "auto"}
    assert kernels.parse_choice("torch") == {"*": "torch"}
    assert kernels.parse_choice(" triton , adamw_step_=torch") == {
        "*": "triton",
        "adamw_step_": "torch",
    }
    with pytest.raises(ValueError, match="unknown choice 'fast'"):
        kernels.parse_choice("fast")
    with pytest.raises(ValueError, match="unknown op 'adam_step_'"):
        kernels.parse_choice("adam_step_=torch")


def test_backend_choice(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "KERNELS", {"*": "auto"})
    assert kernels.backend(cpu) == "torch"  # auto: Triton on CUDA only
    monkeypatch.setattr(kernels, "KERNELS", {"*": "triton", "sgd_step_": "torch"})
    assert kernels.backend(cpu) == "torch"  # CPU tensors: only under the interpreter
    if TRITON_MISSING is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert kernels.backend(cpu) == "triton"
        assert kernels.backend(cpu, "adamw_step_") == "triton"
    assert kernels.backend(cpu, "sgd_step_") == "torch"
    with pytest.raises(ValueError, match="unknown op"):
        kernels.backend(cpu, "sgd")


def test_works_without_triton():
    # A fresh interpreter where `import triton` fails: the module imports and runs on torch,
    # and an explicit request for Triton says what is missing.
    code = """
import os, sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch
from monarch_dsl.runtime import kernels
ts = [torch.ones(3), torch.ones(2)]
flat = kernels.flatten_scale(ts, 0.5)
assert flat.tolist() == [0.5] * 5, flat
assert kernels.backend(flat) == "torch"
kernels.KERNELS["*"] = "triton"
os.environ["TRITON_INTERPRET"] = "1"
try:
    kernels.backend(flat)
except RuntimeError as e:
    assert "triton does not import" in str(e), e
else:
    raise AssertionError("no error")
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("MD_KERNELS", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ---- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_triton
def test_cuda_triton_matches_torch(monkeypatch):
    # auto picks Triton for CUDA tensors; results agree with the torch path on the same GPU.
    monkeypatch.setattr(kernels, "KERNELS", {"*": "auto"})
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(s, device="cuda", generator=gen) for s in ODD_SHAPES + ALIGNED_SHAPES]
    assert kernels.backend(tensors[0]) == "triton"
    flat = kernels.flatten_scale(tensors, 1 / 3)
    assert torch.equal(flat, _cat(tensors) * (1 / 3))
    back = [torch.empty_like(t) for t in tensors]
    kernels.unflatten_into(flat, back, scale=3.0)
    assert torch.equal(_cat(back), flat * 3.0)

    n = flat.numel()
    results = {}
    for choice in ("triton", "torch"):
        monkeypatch.setattr(kernels, "KERNELS", {"*": choice})
        p, buf = flat.clone(), torch.empty_like(flat)
        m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
        for i in range(4):
            g = torch.randn(n, device="cuda", generator=gen.manual_seed(i))
            kernels.sgd_step_(p, g, buf, lr=0.1, momentum=0.9, weight_decay=0.01, first_step=i == 0)
            kernels.adamw_step_(p, g, m, v, step=i + 1, lr=1e-2)
        results[choice] = (p, buf, m, v)
    for got, want in zip(results["triton"], results["torch"]):
        _assert_close(got, want)


# ---- compiled for a GPU, without one -------------------------------------------------------


def _compile_for_hopper(kernel, dtype: str, constexprs: dict) -> str:
    """PTX of one of the module's kernels compiled for sm_90 by triton's own compiler and its
    bundled ptxas (no GPU or driver needed), pointers 16-byte aligned as Triton specializes
    them at launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit = kernels._kernels(interpreted=False)
    fn = getattr(jit, kernel)
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*i64" if name == "table_ptr" else f"*{dtype}"
        elif name == "n":
            signature[name] = "i32"
        else:
            signature[name] = "fp64"
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if "_ptr" in a}
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs, aligned),
        target=GPUTarget("cuda", 90, 32),
        options=kernels._LAUNCH_OPTIONS,
    )
    return compiled.asm["ptx"]


@needs_triton
def test_kernels_compile_for_a_gpu():
    # CI has no GPU: this is where a kernel that the interpreter runs but the compiler rejects
    # would show, and where the compiled code's vector loads, IEEE sqrt / division and unfused
    # multiply-adds can be seen.
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    ptx = _compile_for_hopper(
        "bucket_copy",
        "fp32",
        dict(TO_FLAT=True, UPCAST=False, ALIGN=4, MASKED=False, BLOCK=kernels.COPY_BLOCK),
    )
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    ptx = _compile_for_hopper(
        "bucket_copy",
        "bf16",
        dict(TO_FLAT=False, UPCAST=True, ALIGN=1, MASKED=True, BLOCK=kernels.COPY_BLOCK),
    )
    assert "st.global.b16" in ptx
    flags = dict(HAS_WEIGHT_DECAY=True, HAS_MOMENTUM=True, FIRST_STEP=False, NESTEROV=True)
    ptx = _compile_for_hopper(
        "sgd",
        "fp32",
        dict(**flags, MAXIMIZE=True, UPCAST=False, MASKED=False, BLOCK=kernels.STEP_BLOCK),
    )
    assert "ld.global.v4.b32" in ptx and "fma." not in ptx  # unfused, as torch rounds
    for dtype, width in (("fp32", "v4.b32"), ("fp64", "v2.b64")):
        bits = dtype[2:]
        ptx = _compile_for_hopper(
            "adamw",
            dtype,
            dict(
                HAS_WEIGHT_DECAY=True,
                LERP_FROM_START=True,
                MAXIMIZE=False,
                UPCAST=False,
                FP64=dtype == "fp64",
                MASKED=False,
                BLOCK=kernels.STEP_BLOCK,
            ),
        )
        assert f"ld.global.{width}" in ptx
        assert f"sqrt.rn.f{bits}" in ptx.replace(".ftz", "")
        assert f"div.rn.f{bits}" in ptx.replace(".ftz", "")


# ---- as torch ops (what md.DistributedDataParallel records for its buckets) ----------------


def test_bucket_ops_match_the_functions_and_check_on_meta_tensors():
    tensors = [torch.randn(s) for s in ODD_SHAPES]
    flat = torch.ops.monarch_dsl.flatten_scale(tensors, 0.5)
    assert torch.equal(flat, kernels.flatten_scale(tensors, 0.5))
    back = [torch.empty_like(t) for t in tensors]
    torch.ops.monarch_dsl.unflatten_into(flat, back, 2.0)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))
    # the controller sees shapes only (meta tensors) and refuses a bad bucket before sending
    meta = [t.to("meta") for t in tensors]
    assert torch.ops.monarch_dsl.flatten_scale(meta, 1.0).shape == flat.shape
    mixed = [meta[0], meta[1].to(torch.float64)]
    with pytest.raises(ValueError, match="one dtype on one device"):
        torch.ops.monarch_dsl.flatten_scale(mixed, 1.0)
    with pytest.raises(ValueError, match="no tensors"):
        torch.ops.monarch_dsl.flatten_scale([], 1.0)
    with pytest.raises(ValueError, match="elements"):
        torch.ops.monarch_dsl.unflatten_into(torch.empty(3, device="meta"), meta, 1.0)


def test_the_ops_on_cpu_run_the_cpp_kernels_with_the_torch_paths_bits():
    """A worker's runtime calls the bucket ops on CPU tensors without Python: the C++ runtime
    registers their CPU kernels (cpp/kernels.cpp) when it loads. They give the torch path's
    results bit for bit (odd sizes, a transposed tensor, a scale), cast into targets of another
    dtype as it does, and refuse a bad bucket with its ValueError."""
    from monarch_dsl import _core

    _core.require()  # setup built it; loading it registers the kernels
    assert torch._C._dispatch_has_kernel_for_dispatch_key("monarch_dsl::flatten_scale", "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("monarch_dsl::unflatten_into", "CPU")
    torch.manual_seed(0)
    tensors = [torch.randn(s) for s in ODD_SHAPES] + [torch.randn(6, 5).t()]
    want = torch.empty(sum(t.numel() for t in tensors))
    kernels._flatten_scale_torch(tensors, 0.3, want)
    below = torch._C._AutoDispatchBelowADInplaceOrView  # (as the plan runner calls them)
    for guard in (torch.no_grad, below):
        with guard():
            flat = torch.ops.monarch_dsl.flatten_scale(tensors, 0.3)
            assert flat.dtype == torch.float32 and torch.equal(flat, want)
            back = [torch.empty(t.shape, dtype=torch.float64) for t in tensors]
            back[-1] = torch.empty(5, 6, dtype=torch.float64).t()  # (non-contiguous)
            expected = [torch.empty_like(t) for t in back]
            kernels._unflatten_into_torch(flat, expected, 1.7)
            torch.ops.monarch_dsl.unflatten_into(flat, back, 1.7)
            assert all(torch.equal(a, b) for a, b in zip(back, expected))
    with pytest.raises(ValueError, match="one dtype on one device"):
        torch.ops.monarch_dsl.flatten_scale([tensors[0], tensors[2].double()], 1.0)
    with pytest.raises(ValueError, match="expected 2"):
        torch.ops.monarch_dsl.unflatten_into(torch.zeros(3), [torch.zeros(2)], 1.0)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        torch.ops.monarch_dsl.unflatten_into(torch.zeros(2, 1), [torch.zeros(2)], 1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_cpp_flatten_scales_a_half_bucket_as_the_torch_path(dtype):
    """A scale such as 1/3 (an average over 3 ranks) multiplies a half-precision bucket in
    float, as Python's ``out.mul_(scale)`` does, not rounded to the bucket's dtype first."""
    from monarch_dsl import _core

    _core.require()
    torch.manual_seed(0)
    tensors = [torch.randn(500, dtype=dtype), torch.randn(20, 25, dtype=dtype)]
    for scale in (1 / 3, 0.3):
        want = torch.empty(1000, dtype=dtype)
        kernels._flatten_scale_torch(tensors, scale, want)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            got = torch.ops.monarch_dsl.flatten_scale(tensors, scale)
        assert torch.equal(got, want), (dtype, scale)
