"""Gradient-bucket kernels on a GPU: Triton vs torch (issue 11, item 7).

    python benchmarks/kernels.py [--mib 25] [--dtypes float32 bfloat16] [--reps 100]

On CUDA, for a bucket of about ``--mib`` MiB made of many tensors of mixed sizes (the
parameters of a stack of small transformer layers), times each op of
``monarch_dsl.runtime.kernels`` with ``KERNELS`` set to "triton" and to "torch", beside torch's
own ways of doing the same work:

- flatten_scale: Triton vs torch.cat into the buffer + mul_ (the module's torch path, the
  ``_flatten_dense_tensors`` way), and vs torch._foreach_mul + torch.cat.
- unflatten_into: Triton vs torch._foreach_copy_ + torch._foreach_mul_ (the torch path).
- sgd_step_ (momentum 0.9, weight decay) and adamw_step_ over the flat bucket: Triton vs
  torch._fused_sgd_ / torch._fused_adamw_ on the flat buffer (the torch path), and vs
  torch.optim.SGD / AdamW over the bucket's tensors with fused=True and with foreach=True.

Two layouts: "aligned" (every tensor's size a multiple of 16, as in most models) and "odd" (a
tensor of 1001 elements first, so no offset in the flat buffer is 16-byte aligned and the copy
kernels cannot use vector loads). Each time is the median over ``--reps`` single calls timed
with CUDA events after warm-up, with L2 flushed before each (a 25 MiB bucket would otherwise
sit half in an H100's 50 MB L2). The table gives ms, the effective bandwidth (bytes each op must
read and write, over the time) and each row's time over Triton's; the last lines name the
winner of each op and the MD_KERNELS value that keeps it on this GPU.

Results are checked before timing (Triton against the torch path). Without a GPU the timings
are skipped, and a tiny bucket is checked through triton's interpreter on the CPU instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

OPS = ("flatten_scale", "unflatten_into", "sgd_step_", "adamw_step_")


def bucket_shapes(target_bytes: int, itemsize: int, odd: bool) -> list[tuple[int, ...]]:
    """Transformer-layer-like shapes (hidden 256) until the bucket holds ``target_bytes``."""
    h = 256
    layer = [(3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h),
             (h,), (h,), (h,)]  # fmt: skip
    shapes = [(1001,)] if odd else []
    total = sum(torch.Size(s).numel() for s in shapes)
    while total * itemsize < target_bytes:
        for s in layer:
            shapes.append(s)
            total += torch.Size(s).numel()
    return shapes


def bench(fn, reps: int, flush: torch.Tensor) -> float:
    """Median ms of one call of ``fn`` over ``reps`` calls, each after an L2 flush."""
    for _ in range(5):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def run_layout(dtype: torch.dtype, odd: bool, mib: float, reps: int) -> dict[str, dict]:
    """{op: {"bytes": moved, "rows": {name: ms}}} for one bucket layout."""
    from monarch_dsl.runtime import kernels

    dev = "cuda"
    shapes = bucket_shapes(int(mib * 2**20), torch.finfo(dtype).bits // 8, odd)
    gen = torch.Generator(device=dev).manual_seed(0)
    grads = [torch.randn(s, device=dev, dtype=dtype, generator=gen) for s in shapes]
    n = sum(g.numel() for g in grads)
    nbytes = n * grads[0].element_size()
    flat = torch.empty(n, device=dev, dtype=dtype)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    scale = 1 / 8
    out: dict[str, dict] = {}

    def with_choice(choice, fn):
        def call():
            kernels.KERNELS["*"] = choice
            fn()

        return call

    # -- correctness first: Triton against the torch path, on this GPU.
    kernels.KERNELS["*"] = "triton"
    flat_triton = kernels.flatten_scale(grads, scale).clone()
    kernels.KERNELS["*"] = "torch"
    torch.testing.assert_close(flat_triton, kernels.flatten_scale(grads, scale), rtol=0, atol=0)

    flatten = lambda: kernels.flatten_scale(grads, scale, out=flat)
    out["flatten_scale"] = {
        "bytes": 2 * nbytes,
        "rows": {
            "triton": bench(with_choice("triton", flatten), reps, flush),
            "torch (cat + mul_)": bench(with_choice("torch", flatten), reps, flush),
            "torch (_foreach_mul + cat)": bench(
                lambda: torch.cat([t.view(-1) for t in torch._foreach_mul(grads, scale)]),
                reps,
                flush,
            ),
        },
    }
    targets = [torch.empty_like(g) for g in grads]
    unflatten = lambda: kernels.unflatten_into(flat, targets, scale=2.0)
    out["unflatten_into"] = {
        "bytes": 2 * nbytes,
        "rows": {
            "triton": bench(with_choice("triton", unflatten), reps, flush),
            "torch (_foreach_copy_ + _foreach_mul_)": bench(
                with_choice("torch", unflatten), reps, flush
            ),
        },
    }

    # -- optimizer steps: the flat bucket (ours) and the same values as separate parameters.
    params_flat = torch.randn(n, device=dev, dtype=dtype, generator=gen)
    grads_flat = torch.randn(n, device=dev, dtype=dtype, generator=gen) * 1e-3
    state = [torch.zeros(n, device=dev, dtype=dtype) for _ in range(3)]
    sgd = dict(lr=1e-3, momentum=0.9, weight_decay=1e-4)
    adamw = dict(lr=1e-4, weight_decay=1e-2)

    def sgd_flat():
        kernels.sgd_step_(params_flat, grads_flat, state[0], **sgd, first_step=False)

    def adamw_flat():
        kernels.adamw_step_(params_flat, grads_flat, state[1], state[2], step=10, **adamw)

    for step in (sgd_flat, adamw_flat):
        results = {}
        before = [t.clone() for t in (params_flat, *state)]
        for choice in ("triton", "torch"):
            kernels.KERNELS["*"] = choice
            step()
            results[choice] = params_flat.clone()
            for t, t0 in zip((params_flat, *state), before):
                t.copy_(t0)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(results["triton"], results["torch"], rtol=tol, atol=tol)

    def optim_rows(make):
        rows = {}
        for how in ("fused", "foreach"):
            params = [
                torch.nn.Parameter(torch.randn(s, device=dev, dtype=dtype, generator=gen))
                for s in shapes
            ]
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            opt = make(params, **{how: True})
            opt.step()  # state made outside the timing
            rows[f"torch.optim {how}=True ({len(params)} tensors)"] = bench(opt.step, reps, flush)
        return rows

    out["sgd_step_"] = {
        "bytes": 5 * nbytes,  # read param, grad, buffer; write param, buffer
        "rows": {
            "triton": bench(with_choice("triton", sgd_flat), reps, flush),
            "torch (_fused_sgd_ on the flat bucket)": bench(
                with_choice("torch", sgd_flat), reps, flush
            ),
            **optim_rows(lambda ps, **kw: torch.optim.SGD(ps, **sgd, **kw)),
        },
    }
    out["adamw_step_"] = {
        "bytes": 7 * nbytes,  # read param, grad, exp_avg, exp_avg_sq; write three
        "rows": {
            "triton": bench(with_choice("triton", adamw_flat), reps, flush),
            "torch (_fused_adamw_ on the flat bucket)": bench(
                with_choice("torch", adamw_flat), reps, flush
            ),
            **optim_rows(lambda ps, **kw: torch.optim.AdamW(ps, **adamw, **kw)),
        },
    }
    kernels.KERNELS["*"] = "auto"
    out["_meta"] = {"tensors": len(shapes), "mib": nbytes / 2**20}
    return out


def report(dtype: torch.dtype, layout: str, table: dict, wins: dict) -> None:
    meta = table.pop("_meta")
    print(f"\n{dtype} bucket, {layout} layout: {meta['tensors']} tensors, {meta['mib']:.1f} MiB")
    print(f"  {'op':<15} {'implementation':<42} {'ms':>8} {'GB/s':>7} {'vs triton':>9}")
    for op, entry in table.items():
        triton_ms = entry["rows"]["triton"]
        for name, ms in entry["rows"].items():
            gbs = entry["bytes"] / (ms * 1e-3) / 1e9
            print(f"  {op:<15} {name:<42} {ms:>8.4f} {gbs:>7.0f} {ms / triton_ms:>8.2f}x")
        torch_ms = next(ms for name, ms in entry["rows"].items() if name.startswith("torch ("))
        wins.setdefault(op, []).append((torch_ms / triton_ms, f"{dtype} {layout}"))


def cpu_check() -> None:
    """A tiny bucket through the Triton kernels under triton's interpreter, against torch."""
    os.environ["TRITON_INTERPRET"] = "1"
    from monarch_dsl.runtime import kernels

    try:
        import triton  # noqa: F401
    except ImportError as e:
        print(f"triton does not import ({e}): nothing to check")
        return
    tensors = [torch.randn(s) for s in bucket_shapes(0, 4, odd=True) + [(5, 3), (2049,)]]
    results = {}
    for choice in ("triton", "torch"):
        kernels.KERNELS["*"] = choice
        flat = kernels.flatten_scale(tensors, 0.5)
        p, buf = flat.clone(), torch.zeros_like(flat)
        m, v = torch.zeros_like(flat), torch.zeros_like(flat)
        kernels.sgd_step_(p, flat, buf, lr=0.1, momentum=0.9, first_step=True)
        kernels.adamw_step_(p, flat, m, v, step=1)
        results[choice] = (flat, p, buf, m, v)
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    print(f"CPU check (triton's interpreter vs torch, {flat.numel()} elements): ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mib", type=float, default=25.0, help="bucket size (default 25)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: skipping the timings (they compare Triton and torch on a GPU)")
        cpu_check()
        return
    try:
        import triton
    except ImportError as e:
        sys.exit(f"triton does not import ({e}); pip install monarch-dsl[dev]")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    wins: dict[str, list] = {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for layout in ("aligned", "odd"):
            table = run_layout(dtype, layout == "odd", args.mib, args.reps)
            report(dtype, layout, table, wins)
    print("\nwinner per op (torch path time / Triton time; > 1: Triton faster):")
    choice = []
    for op in OPS:
        ratios = wins[op]
        text = ", ".join(f"{r:.2f}x {where}" for r, where in ratios)
        # Keep Triton only where it wins in every configuration measured.
        winner = "triton" if min(r for r, _ in ratios) > 1 else "torch"
        print(f"  {op:<15} {winner:<7} ({text})")
        choice.append(f"{op}={winner}")
    print(f"\nto keep the winners on this GPU: MD_KERNELS={','.join(choice)}")


if __name__ == "__main__":
    main()
