"""Gradient-bucket kernels for data parallel training: Triton on CUDA, torch elsewhere.

A data-parallel step moves each bucket of gradients through the same few passes: flatten the
gradients into one buffer and scale them (by ``1 / world`` to average), all-reduce the buffer,
copy it back into the gradients, and update the parameters. This module does those passes over
flat buffers:

- ``flatten_scale(tensors, scale, out=None)``: one 1-D buffer holding every tensor's values, in
  order, times ``scale``.
- ``unflatten_into(flat, tensors, scale=1.0)``: the buffer's slices (times ``scale``) copied
  back into the tensors, in place.
- ``sgd_step_(params, grads, momentum_buf, ...)`` and ``adamw_step_(params, grads, exp_avg,
  exp_avg_sq, ...)``: one optimizer update over a flat bucket, in place, with
  ``torch.optim.SGD`` / ``torch.optim.AdamW``'s semantics (their single-tensor algorithm,
  written out in ``_sgd_torch`` and ``_adamw_torch``).

Invariants, and why:

- A bucket is one dtype on one device, and a flat buffer is 1-D and contiguous with exactly as
  many elements as the bucket (no padding): DDP buckets are made per dtype, and the offsets of
  the tensors in the buffer are then just running sums of their sizes.
- Optimizer state has the parameters' dtype, as in torch.optim. Hyperparameters are Python
  floats; derived values (``1 - dampening``, bias corrections) are computed in double on the
  host, as torch does, then each kernel works in the buffer's precision (float32 for
  float16/bfloat16 buffers, rounded once on store, as torch's ``fused=True`` kernels do).
- The Triton kernels follow torch's order of operations, rounding each multiply and add
  separately (no fused multiply-add), with IEEE-rounded ``sqrt`` and division (``tl.sqrt_rn``,
  ``tl.div_rn``) and torch's two-sided ``lerp``. They take hyperparameters as float64 and round
  each to the compute dtype, as torch rounds a Python scalar to a tensor's dtype. They agree
  with torch.optim to a rounding step (torch's own kernels may fuse), not bit for bit. (Triton's
  interpreter rounds float arguments to float32, so on that path float64 buckets see float32
  hyperparameters.)
- flatten/unflatten launch one Triton program per chunk of ``COPY_BLOCK`` elements of one
  tensor, listed in a table of (tensor offset from the flat buffer, offset in the flat buffer,
  length) that depends only on the buffer's and tensors' addresses and sizes: it is cached under
  exactly those, so a bucket flattened into the same ``out`` every step builds its table once
  (a new buffer address means a new table: host work and a copy to the GPU), and a table is
  never stale. A bucket the kernels cannot take -- a non-contiguous tensor, a dtype other than
  the buffer's -- goes through torch, with the same results.
- Kernels run on the current CUDA stream of the tensors' device, like torch ops, and never
  synchronize with the host.
- triton is imported only when a Triton kernel is first needed: the package works without it.

Choosing the implementation. Each op asks ``backend(tensor, op)``, which reads ``KERNELS``:
``{"*": choice}`` plus optional per-op entries (``"adamw_step_": "torch"``), each ``"auto"``,
``"torch"`` or ``"triton"``. ``KERNELS`` starts from the environment variable ``MD_KERNELS``
(``auto``, ``torch``, ``triton``, or a list such as ``auto,adamw_step_=torch``; read at
import), and callers may edit it at any time. ``benchmarks/kernels.py`` times both on a GPU
and prints the ``MD_KERNELS`` value that keeps the winner of each op on that GPU.

- ``auto`` (default): Triton for CUDA tensors when triton imports; torch otherwise.
- ``torch``: torch. On CUDA the optimizer steps call torch's fused kernels (what
  ``torch.optim.SGD/AdamW(fused=True)`` runs), one launch per bucket; elsewhere plain torch ops.
- ``triton``: Triton for CUDA tensors (an error if triton does not import), and for CPU tensors
  too when ``TRITON_INTERPRET=1`` is set -- there triton's interpreter runs the same kernels
  with numpy, which is how the tests check them without a GPU. Other CPU tensors use torch.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from types import SimpleNamespace

import torch

OPS = ("flatten_scale", "unflatten_into", "sgd_step_", "adamw_step_")
CHOICES = ("auto", "torch", "triton")

COPY_BLOCK = 2048  # elements per Triton program in flatten/unflatten
STEP_BLOCK = 1024  # elements per Triton program in the optimizer steps
_TABLE_CACHE_SIZE = 256  # chunk tables kept (one per bucket layout; a DDP model has a few)

# Devices whose "torch" optimizer step calls torch's fused kernel (tests add "cpu" to check that
# path: torch has CPU fused kernels too, but plain ops are the reference there).
_TORCH_FUSED_DEVICES = ("cuda",)


def parse_choice(text: str) -> dict[str, str]:
    """``MD_KERNELS``'s syntax: ``"auto"`` or ``"triton,adamw_step_=torch"`` -> a KERNELS dict."""
    choice = {"*": "auto"}
    for item in filter(None, (part.strip() for part in text.split(","))):
        op, _, value = item.rpartition("=")
        op = op.strip() or "*"
        value = value.strip()
        if op != "*" and op not in OPS:
            raise ValueError(f"MD_KERNELS: unknown op {op!r} in {text!r}; ops are {OPS}")
        if value not in CHOICES:
            raise ValueError(f"MD_KERNELS: unknown choice {value!r} in {text!r}; one of {CHOICES}")
        choice[op] = value
    return choice


KERNELS: dict[str, str] = {}


def configure_from_env() -> None:
    """``KERNELS`` from ``MD_KERNELS``: at import, and again by a worker at its start, since it
    may have been forked from a process that imported this module under another environment
    (the variable reaches a mesh's workers as ``spawn_procs(env={"MD_KERNELS": ...})``)."""
    KERNELS.clear()
    KERNELS.update(parse_choice(os.environ.get("MD_KERNELS", "auto")))


configure_from_env()


@functools.cache
def _triton_import_error() -> str | None:
    """None when triton imports, else why not (cached: a failed import is not retried)."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising something else
        return f"{type(e).__name__}: {e}"
    return None


def backend(tensor: torch.Tensor, op: str = "*") -> str:
    """``"triton"`` or ``"torch"``: the implementation ``op`` (one of ``OPS``; ``"*"`` for the
    default) uses for a bucket of tensors like ``tensor``, per ``KERNELS`` (see the module
    docstring). A bucket the Triton kernels cannot take still falls back to torch."""
    if op != "*" and op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {OPS}")
    choice = KERNELS.get(op, KERNELS.get("*", "auto"))
    if choice not in CHOICES:
        raise ValueError(f"KERNELS[{op!r}] is {choice!r}; one of {CHOICES}")
    device = tensor.device.type
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if device == "cuda" and _triton_import_error() is None else "torch"
    # choice == "triton"
    if device == "cuda" or (device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        error = _triton_import_error()
        if error is not None:
            raise RuntimeError(
                f"KERNELS / MD_KERNELS asks for Triton kernels ({op}), but triton does not import "
                f"({error}); install it (it is in monarch_dsl's dev extra) or choose 'torch'"
            )
        return "triton"
    return "torch"


# ---- checks --------------------------------------------------------------------------------


def _check_flat(name: str, t: torch.Tensor, like: torch.Tensor | None = None, numel=None) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
    if like is not None and (t.dtype, t.device) != (like.dtype, like.device):
        raise ValueError(
            f"{name} must be {like.dtype} on {like.device} like the bucket, "
            f"got {t.dtype} on {t.device}"
        )
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel}")


def _check_bucket(tensors: Sequence[torch.Tensor], what: str) -> None:
    first = tensors[0]
    for i, t in enumerate(tensors):
        if (t.dtype, t.device) != (first.dtype, first.device):
            raise ValueError(
                f"{what}: a bucket is one dtype on one device; tensors[0] is {first.dtype} on "
                f"{first.device}, tensors[{i}] is {t.dtype} on {t.device}"
            )


# ---- flatten / unflatten -------------------------------------------------------------------


@torch.no_grad()
def flatten_scale(
    tensors: Sequence[torch.Tensor], scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One flat 1-D buffer with every tensor's values, in order, times ``scale``.

    The tensors share one dtype and device. ``out`` (optional) is a contiguous 1-D buffer of
    that dtype and device with exactly as many elements as the tensors together, reused instead
    of allocating one; it must not overlap the tensors. Returns the buffer.
    """
    tensors = list(tensors)
    total = sum(t.numel() for t in tensors)
    if not tensors:
        if out is None:
            raise ValueError("flatten_scale: no tensors (and no out= to take dtype and device)")
        _check_flat("out", out, numel=0)
        return out
    _check_bucket(tensors, "flatten_scale")
    if out is None:
        out = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    else:
        _check_flat("out", out, like=tensors[0], numel=total)
    if total == 0:
        return out
    if backend(out, "flatten_scale") == "triton" and _triton_copy(out, tensors, scale, True):
        return out
    _flatten_scale_torch(tensors, scale, out)
    return out


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Copy ``flat``'s consecutive slices, times ``scale``, into ``tensors`` in place.

    ``flat`` is a contiguous 1-D buffer with exactly as many elements as the tensors together,
    on their device (what ``flatten_scale`` returns). Tensors of another dtype are cast, and
    non-contiguous ones are fine (both through torch).
    """
    tensors = list(tensors)
    total = sum(t.numel() for t in tensors)
    _check_flat("flat", flat, numel=total)
    for i, t in enumerate(tensors):
        if t.device != flat.device:
            raise ValueError(
                f"unflatten_into: flat is on {flat.device}, tensors[{i}] on {t.device}"
            )
    if total == 0:
        return
    if backend(flat, "unflatten_into") == "triton" and _triton_copy(flat, tensors, scale, False):
        return
    _unflatten_into_torch(flat, tensors, scale)


def _flatten_scale_torch(tensors: list[torch.Tensor], scale: float, out: torch.Tensor) -> None:
    torch.cat([t.reshape(-1) for t in tensors], out=out)
    if scale != 1:
        out.mul_(scale)


def _unflatten_into_torch(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float) -> None:
    slices = []
    offset = 0
    for t in tensors:
        slices.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    torch._foreach_copy_(tensors, slices)
    if scale != 1:
        torch._foreach_mul_(tensors, scale)


# ---- optimizer steps -----------------------------------------------------------------------


@torch.no_grad()
def sgd_step_(
    params_flat: torch.Tensor,
    grads_flat: torch.Tensor,
    momentum_buf_flat: torch.Tensor | None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    first_step: bool,
) -> None:
    """One ``torch.optim.SGD`` step over a flat bucket, in place.

    ``momentum_buf_flat`` is the bucket's momentum buffer (None when ``momentum == 0``);
    ``first_step=True`` initialises it to the (decayed, sign-adjusted) gradient, as torch does
    when a parameter has no buffer yet; later steps update it.
    """
    _check_flat("params_flat", params_flat)
    _check_flat("grads_flat", grads_flat, like=params_flat, numel=params_flat.numel())
    if momentum != 0:
        if momentum_buf_flat is None:
            raise ValueError("sgd_step_: momentum != 0 needs momentum_buf_flat")
        _check_flat("momentum_buf_flat", momentum_buf_flat, params_flat, params_flat.numel())
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("sgd_step_: nesterov needs momentum > 0 and dampening == 0 (as in torch)")
    hyper = dict(
        lr=float(lr),
        momentum=float(momentum),
        dampening=float(dampening),
        weight_decay=float(weight_decay),
        nesterov=bool(nesterov),
        maximize=bool(maximize),
        first_step=bool(first_step),
    )
    if params_flat.numel() == 0:
        return
    if params_flat.dtype in _TRITON_DTYPES and backend(params_flat, "sgd_step_") == "triton":
        _sgd_triton(params_flat, grads_flat, momentum_buf_flat, **hyper)
    elif params_flat.device.type in _TORCH_FUSED_DEVICES:
        _sgd_torch_fused(params_flat, grads_flat, momentum_buf_flat, **hyper)
    else:
        _sgd_torch(params_flat, grads_flat, momentum_buf_flat, **hyper)


@torch.no_grad()
def adamw_step_(
    params_flat: torch.Tensor,
    grads_flat: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int | float,
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    maximize: bool = False,
    amsgrad: bool = False,
) -> None:
    """One ``torch.optim.AdamW`` step over a flat bucket, in place.

    ``step`` is the step count after this step's increment (1 on the first step), which the
    bias corrections use as torch does; ``exp_avg`` and ``exp_avg_sq`` are the bucket's moment
    buffers (zeros before the first step). ``amsgrad=True`` is not supported.
    """
    if amsgrad:
        raise ValueError("adamw_step_: amsgrad=True is not supported; use torch.optim.AdamW")
    if step < 1:
        raise ValueError(f"adamw_step_: step is the count after the increment (>= 1), got {step}")
    n = params_flat.numel()
    _check_flat("params_flat", params_flat)
    _check_flat("grads_flat", grads_flat, like=params_flat, numel=n)
    _check_flat("exp_avg", exp_avg, like=params_flat, numel=n)
    _check_flat("exp_avg_sq", exp_avg_sq, like=params_flat, numel=n)
    hyper = dict(
        step=float(step),
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        maximize=bool(maximize),
    )
    if n == 0:
        return
    if params_flat.dtype in _TRITON_DTYPES and backend(params_flat, "adamw_step_") == "triton":
        _adamw_triton(params_flat, grads_flat, exp_avg, exp_avg_sq, **hyper)
    elif params_flat.device.type in _TORCH_FUSED_DEVICES:
        _adamw_torch_fused(params_flat, grads_flat, exp_avg, exp_avg_sq, **hyper)
    else:
        _adamw_torch(params_flat, grads_flat, exp_avg, exp_avg_sq, **hyper)


def _sgd_torch(
    param, grad, buf, *, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step
):
    # torch/optim/sgd.py _single_tensor_sgd, on one flat tensor.
    grad = -grad if maximize else grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        if first_step:
            buf.copy_(grad)
        else:
            buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    param.add_(grad, alpha=-lr)


def _sgd_torch_fused(
    param, grad, buf, *, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step
):
    torch._fused_sgd_(
        [param],
        [grad],
        [buf] if momentum != 0 else [],
        weight_decay=weight_decay,
        momentum=momentum,
        lr=lr,
        dampening=dampening,
        nesterov=nesterov,
        maximize=maximize,
        is_first_step=first_step,
    )


def _adam_scalars(step, lr, beta1, beta2):
    """Bias-corrected step size and sqrt(bias correction 2), in double, as torch computes them."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return lr / bias_correction1, bias_correction2**0.5


def _adamw_torch(
    param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, maximize
):
    # torch/optim/adam.py _single_tensor_adam with decoupled_weight_decay=True, on one flat tensor.
    grad = -grad if maximize else grad
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size, bias_correction2_sqrt = _adam_scalars(step, lr, beta1, beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _adamw_torch_fused(
    param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, maximize
):
    # The fused kernel reads the step count from a tensor on the parameters' device (a fill, no
    # host-device copy).
    steps = torch.full((), step, dtype=torch.float32, device=param.device)
    torch._fused_adamw_(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        [steps],
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=maximize,
    )


# ---- Triton --------------------------------------------------------------------------------
#
# The kernels are plain functions here, made into Triton kernels by _kernels() after it imports
# triton (so that this module imports without it). They name triton.language as the global
# ``tl``, which _kernels() sets: Triton reads a kernel's globals when it compiles it, and its
# interpreter looks for triton.language among them. Their annotations stay strings
# (``from __future__ import annotations``), which Triton parses ("tl.constexpr", "tl.float64").
#
# Every kernel takes MASKED: the launches cover whole blocks unmasked and the rest in a second,
# masked launch, because a mask against a bound of unknown alignment keeps the compiler from
# using vector loads and stores -- on the whole buffer, not just its tail.

tl = None  # triton.language, once _kernels() has imported it

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Multiply-adds are rounded as the separate operations they are in torch.optim's algorithm
# (Triton fuses them by default, and warns that this default will change).
_LAUNCH_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


def _bucket_copy_kernel(
    flat_ptr,
    table_ptr,
    scale: tl.float64,
    TO_FLAT: tl.constexpr,
    UPCAST: tl.constexpr,
    ALIGN: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program c copies chunk c: table row c is (the tensor's chunk as an element offset from
    # flat_ptr, the chunk's offset in flat, its length: BLOCK unless MASKED). Both offsets are
    # multiples of ALIGN (checked on the host), for vector loads and stores. A tensor is
    # addressed from flat_ptr although it is another allocation: one address space on the GPU
    # (and on the CPU, for the interpreter), so one pointer argument reaches every tensor.
    row = table_ptr + 3 * tl.program_id(0)
    tensor_offset = tl.multiple_of(tl.load(row), ALIGN)
    flat_offset = tl.multiple_of(tl.load(row + 1), ALIGN)
    offs = tl.arange(0, BLOCK)
    if MASKED:
        mask = offs < tl.load(row + 2)
    else:
        mask = None
    if TO_FLAT:
        src = flat_ptr + tensor_offset + offs
        dst = flat_ptr + flat_offset + offs
    else:
        src = flat_ptr + flat_offset + offs
        dst = flat_ptr + tensor_offset + offs
    x = tl.load(src, mask=mask)
    if UPCAST:
        x = x.to(tl.float32)
    x = x * tl.cast(scale, x.dtype)
    tl.store(dst, x.to(flat_ptr.dtype.element_ty), mask=mask)


def _sgd_kernel(
    param_ptr,
    grad_ptr,
    buf_ptr,
    n,
    lr: tl.float64,
    momentum: tl.float64,
    one_minus_dampening: tl.float64,
    weight_decay: tl.float64,
    HAS_WEIGHT_DECAY: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    FIRST_STEP: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The order of operations is _sgd_torch's.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if MASKED:
        mask = offs < n
    else:
        mask = None
    p = tl.load(param_ptr + offs, mask=mask)
    g = tl.load(grad_ptr + offs, mask=mask)
    if UPCAST:
        p = p.to(tl.float32)
        g = g.to(tl.float32)
    if MAXIMIZE:
        g = -g
    if HAS_WEIGHT_DECAY:
        g = g + tl.cast(weight_decay, p.dtype) * p
    if HAS_MOMENTUM:
        if FIRST_STEP:
            b = g
        else:
            b = tl.load(buf_ptr + offs, mask=mask)
            if UPCAST:
                b = b.to(tl.float32)
            b = b * tl.cast(momentum, p.dtype)
            b = b + tl.cast(one_minus_dampening, p.dtype) * g
        tl.store(buf_ptr + offs, b.to(buf_ptr.dtype.element_ty), mask=mask)
        if NESTEROV:
            g = g + tl.cast(momentum, p.dtype) * b
        else:
            g = b
    p = p + tl.cast(-lr, p.dtype) * g
    tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)


def _adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    n,
    decay: tl.float64,
    one_minus_beta1: tl.float64,
    beta2: tl.float64,
    one_minus_beta2: tl.float64,
    neg_step_size: tl.float64,
    bias_correction2_sqrt: tl.float64,
    eps: tl.float64,
    HAS_WEIGHT_DECAY: tl.constexpr,
    LERP_FROM_START: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    FP64: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The order of operations is _adamw_torch's.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if MASKED:
        mask = offs < n
    else:
        mask = None
    p = tl.load(param_ptr + offs, mask=mask)
    g = tl.load(grad_ptr + offs, mask=mask)
    m = tl.load(exp_avg_ptr + offs, mask=mask)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask)
    if UPCAST:
        p = p.to(tl.float32)
        g = g.to(tl.float32)
        m = m.to(tl.float32)
        v = v.to(tl.float32)
    dtype = p.dtype
    if MAXIMIZE:
        g = -g
    if HAS_WEIGHT_DECAY:
        p = p * tl.cast(decay, dtype)
    # exp_avg.lerp_(grad, w), evaluated as torch does: from the nearer end.
    w = tl.cast(one_minus_beta1, dtype)
    diff = g - m
    if LERP_FROM_START:
        m = m + w * diff
    else:
        m = g - diff * (1 - w)
    v = v * tl.cast(beta2, dtype)
    v = v + tl.cast(one_minus_beta2, dtype) * (g * g)
    # IEEE-rounded sqrt and division, as torch's (float32 "/" and tl.sqrt are approximate on
    # GPUs; float64 ones are exact, and sqrt_rn / div_rn take float32 only).
    if FP64:
        denom = tl.sqrt(v) / tl.cast(bias_correction2_sqrt, dtype) + tl.cast(eps, dtype)
        update = m / denom
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), tl.cast(bias_correction2_sqrt, dtype))
        denom = denom + tl.cast(eps, dtype)
        update = tl.div_rn(m, denom)
    p = p + tl.cast(neg_step_size, dtype) * update
    tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offs, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _kernels(interpreted: bool) -> SimpleNamespace:
    """The kernels, compiled for the GPU (JITFunction) or run by triton's interpreter on CPU
    tensors. Made explicitly rather than by ``triton.jit``, which picks the interpreter from
    TRITON_INTERPRET at decoration time: CUDA tensors always get compiled kernels."""
    global tl
    import triton.language

    tl = triton.language
    if interpreted:
        from triton.runtime.interpreter import InterpretedFunction as make
    else:
        from triton.runtime.jit import JITFunction as make
    return SimpleNamespace(
        bucket_copy=make(_bucket_copy_kernel),
        sgd=make(_sgd_kernel),
        adamw=make(_adamw_kernel),
    )


def _kernels_for(t: torch.Tensor) -> SimpleNamespace:
    return _kernels(t.device.type != "cuda")


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the CPU) on ``device``, without a stream sync: a copy from pageable memory
    would wait for the stream, a copy from pinned memory is queued on it."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _on_device(t: torch.Tensor):
    """Triton launches on the current device's current stream: make that ``t``'s device."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _upcast(dtype: torch.dtype) -> bool:
    """Whether kernels compute in float32 rather than in the buffer's dtype."""
    return dtype not in (torch.float32, torch.float64)


_tables: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = OrderedDict()


def _chunk_table(flat: torch.Tensor, tensors: list[torch.Tensor]):
    """(whole chunks, partial chunks, ALIGN) for copying ``tensors`` to or from ``flat``: two
    tables of rows for _bucket_copy_kernel (a tensor's last chunk is partial unless its size
    is a multiple of COPY_BLOCK), and the offsets' alignment in elements.

    The tables are a function of the key alone (addresses, sizes, dtype, device), so a cached
    entry is always right for the bucket in hand."""
    itemsize = flat.element_size()
    key = (flat.device, flat.dtype, flat.data_ptr(), *((t.data_ptr(), t.numel()) for t in tensors))
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        return hit
    base = flat.data_ptr()
    tensor_offsets, flat_offsets, numels = [], [], []
    flat_offset = 0
    for t in tensors:
        if t.numel():
            tensor_offsets.append((t.data_ptr() - base) // itemsize)
            flat_offsets.append(flat_offset)
            numels.append(t.numel())
        flat_offset += t.numel()
    tensor_offsets_t = torch.tensor(tensor_offsets, dtype=torch.int64)
    flat_offsets_t = torch.tensor(flat_offsets, dtype=torch.int64)
    numels_t = torch.tensor(numels, dtype=torch.int64)
    chunks = (numels_t + COPY_BLOCK - 1) // COPY_BLOCK
    owner = torch.repeat_interleave(torch.arange(len(numels)), chunks)
    first_chunk = torch.cumsum(chunks, 0) - chunks
    start = (torch.arange(int(chunks.sum())) - first_chunk[owner]) * COPY_BLOCK
    length = torch.clamp(numels_t[owner] - start, max=COPY_BLOCK)
    table = torch.stack(
        [tensor_offsets_t[owner] + start, flat_offsets_t[owner] + start, length], dim=1
    )
    whole = length == COPY_BLOCK
    tables = tuple(
        _to_device(part.contiguous(), flat.device) for part in (table[whole], table[~whole])
    )
    # Vector width: the offsets' common power-of-two factor, up to 16 bytes, and 1 unless flat
    # itself is 16-byte aligned (Triton assumes so of a pointer argument only when it is).
    align = 16 // itemsize
    if base % 16 == 0:
        common = functools.reduce(math.gcd, tensor_offsets + flat_offsets, 0)
        if common:
            align = min(align, common & -common)
    else:
        align = 1
    entry = (*tables, align)
    _tables[key] = entry
    if len(_tables) > _TABLE_CACHE_SIZE:
        _tables.popitem(last=False)
    return entry


def _triton_copy(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float, to_flat: bool):
    """Run the bucket copy kernel; False (nothing done) for a bucket it cannot take."""
    itemsize = flat.element_size()
    if flat.dtype not in _TRITON_DTYPES or flat.data_ptr() % itemsize:
        return False
    for t in tensors:
        if t.dtype != flat.dtype or not t.is_contiguous() or t.data_ptr() % itemsize:
            return False
    kernel = _kernels_for(flat).bucket_copy
    with _on_device(flat):
        *tables, align = _chunk_table(flat, tensors)
        for table, masked in zip(tables, (False, True)):
            if table.shape[0]:
                kernel[(table.shape[0],)](
                    flat,
                    table,
                    float(scale),
                    TO_FLAT=to_flat,
                    UPCAST=_upcast(flat.dtype),
                    ALIGN=align,
                    MASKED=masked,
                    BLOCK=COPY_BLOCK,
                    **_LAUNCH_OPTIONS,
                )
    return True


def _launch_elementwise(kernel, tensors: list[torch.Tensor], scalars: list, **constexprs) -> None:
    """``kernel`` over the tensors' elements: whole STEP_BLOCKs unmasked, then the rest masked,
    on the tensors' tails (which stay 16-byte aligned: STEP_BLOCK elements are a multiple of 16
    bytes)."""
    n = tensors[0].numel()
    whole = n - n % STEP_BLOCK
    launches = []
    if whole:
        launches.append((whole // STEP_BLOCK, tensors, whole, False))
    if n > whole:
        launches.append((1, [t[whole:] for t in tensors], n - whole, True))
    with _on_device(tensors[0]):
        for programs, args, size, masked in launches:
            kernel[(programs,)](
                *args,
                size,
                *scalars,
                MASKED=masked,
                BLOCK=STEP_BLOCK,
                **constexprs,
                **_LAUNCH_OPTIONS,
            )


def _sgd_triton(
    param, grad, buf, *, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step
):
    _launch_elementwise(
        _kernels_for(param).sgd,
        [param, grad, buf if momentum != 0 else param],  # buf: not touched without momentum
        [lr, momentum, 1 - dampening, weight_decay],
        HAS_WEIGHT_DECAY=weight_decay != 0,
        HAS_MOMENTUM=momentum != 0,
        FIRST_STEP=first_step,
        NESTEROV=nesterov,
        MAXIMIZE=maximize,
        UPCAST=_upcast(param.dtype),
    )


def _adamw_triton(
    param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, maximize
):
    step_size, bias_correction2_sqrt = _adam_scalars(step, lr, beta1, beta2)
    one_minus_beta1 = 1 - beta1
    _launch_elementwise(
        _kernels_for(param).adamw,
        [param, grad, exp_avg, exp_avg_sq],
        [
            1 - lr * weight_decay,
            one_minus_beta1,
            beta2,
            1 - beta2,
            -step_size,
            bias_correction2_sqrt,
            eps,
        ],
        HAS_WEIGHT_DECAY=weight_decay != 0,
        LERP_FROM_START=abs(one_minus_beta1) < 0.5,  # torch's lerp: from the nearer end
        MAXIMIZE=maximize,
        UPCAST=_upcast(param.dtype),
        FP64=param.dtype == torch.float64,
    )


# ---- as torch ops: the bucket passes of a mesh tensor's DDP, run on the workers ------------
# md.DistributedDataParallel calls these on mesh tensors: the controller records one
# instruction per bucket (shapes from the fake implementations below) and each worker's
# executor calls the op through the dispatcher, so a CUDA worker runs the Triton kernels
# (benchmarks/kernels.py: faster than torch.cat / per-tensor copies on an H200) and a CPU worker
# torch. Workers import this module at start, so the ops exist before the first instruction.
# On CPU the C++ runtime registers the ops' CPU kernels when it loads (cpp/kernels.cpp:
# _flatten_scale_torch / _unflatten_into_torch's passes, the same bits, without Python
# or the GIL; through these Python kernels a call cost a CPU worker 60-170 us for a 64 KiB
# bucket): the functions above, and the ops where it is not loaded, keep the choices of
# KERNELS.


@torch.library.custom_op(
    "monarch_dsl::flatten_scale",
    mutates_args=(),
    schema="(Tensor[] tensors, float scale) -> Tensor",
)
def _flatten_scale_op(tensors, scale):
    return flatten_scale(tensors, scale)


@_flatten_scale_op.register_fake
def _flatten_scale_fake(tensors, scale):
    if not tensors:
        raise ValueError("flatten_scale: no tensors")
    _check_bucket(list(tensors), "flatten_scale")
    return tensors[0].new_empty(sum(t.numel() for t in tensors))


@torch.library.custom_op(
    "monarch_dsl::unflatten_into",
    mutates_args=("tensors",),
    schema="(Tensor flat, Tensor(a!)[] tensors, float scale) -> ()",
)
def _unflatten_into_op(flat, tensors, scale):
    unflatten_into(flat, tensors, scale)


@_unflatten_into_op.register_fake
def _unflatten_into_fake(flat, tensors, scale):
    _check_flat("flat", flat, numel=sum(t.numel() for t in tensors))
