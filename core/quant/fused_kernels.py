"""The pack's fused quantization kernels (Triton) and the operators that run them.

Each kernel is one program a row: it loads the row, computes in float32 (the op before, if any, then the
row's absmax), and writes the 8-bit values and the row's scale — one read of the activation and one
write of its 8-bit form, where the unfused ops read and write it several times. The operators
``pixart_lowvram::quantize_rows``, ``pixart_lowvram::norm_modulate_quantize`` and
``pixart_lowvram::gelu_quantize`` (``torch.library.triton_op``) run the kernel on CUDA when Triton imports,
the eager reference of :mod:`.fused` otherwise. Under ``torch.compile`` inductor traces into them and
launches the kernels from its own compiled code (it does not re-fuse them); the host then makes no Python
call per kernel.

Rounding matches the references: int8 rounds half to even by adding and subtracting ``1.5 × 2²³`` in
float32 (the sum's last place is 1), and e4m3 rounds to nearest even the same way with ``1.5 × 2²⁰`` times
the value's power of two (e4m3 keeps 3 mantissa bits; at least ``2⁻⁶``, the step of its subnormals), so
the cast that follows is exact. A row is multiplied by the reciprocal of its scale (one IEEE division a
row, ``div_rn``, not one a value); the norm's square root is IEEE's (``sqrt_rn``).
"""

from __future__ import annotations

import torch

from . import fused
from .compute import E4M3, E4M3_MAX, FP8, INT8, INT8_MAX, Rows

try:
    import triton
    import triton.language as tl
except ImportError:  # the references run instead; the kernels below are then plain, unused functions
    triton = tl = None

_jit = triton.jit if triton is not None else (lambda fn: fn)
DTYPES = {INT8: torch.int8, FP8: E4M3}
# The 8-bit ranges of .compute, as the constants a kernel may read from its module.
_E4M3_MAX, _INT8_MAX = (tl.constexpr(E4M3_MAX), tl.constexpr(INT8_MAX)) if tl is not None else (None, None)


@_jit
def _store_rows(y, row, cols, inside, values, scales, K, FP8: tl.constexpr):
    # ``y``: the float32 row, 0 outside it.
    absmax = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12)
    if FP8:
        scale = tl.div_rn(absmax, _E4M3_MAX)
        q = tl.minimum(tl.maximum(y * tl.div_rn(1.0, scale), -_E4M3_MAX), _E4M3_MAX)
        power = (q.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        rounder = tl.maximum(power, 0.015625) * 1572864.0  # 1.5 × 2²⁰ × max(2^⌊log2|q|⌋, 2⁻⁶)
        q = ((q + rounder) - rounder).to(tl.float8e4nv)
    else:
        scale = tl.div_rn(absmax, _INT8_MAX)
        q = y * tl.div_rn(1.0, scale)
        q = ((q + 12582912.0) - 12582912.0).to(tl.int8)  # 1.5 × 2²³: round half to even
    tl.store(values + row * K + cols, q, mask=inside)
    tl.store(scales + row, scale)


@_jit
def _quantize_rows_kernel(x, values, scales, K, BLOCK: tl.constexpr, FP8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < K
    y = tl.load(x + row * K + cols, mask=inside, other=0.0).to(tl.float32)
    _store_rows(y, row, cols, inside, values, scales, K, FP8)


@_jit
def _gelu_quantize_kernel(x, values, scales, K, BLOCK: tl.constexpr, FP8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < K
    x_ = tl.load(x + row * K + cols, mask=inside, other=0.0).to(tl.float32)
    # GELU's tanh form: ½x(1 + tanh u) = x · sigmoid(2u), u = √(2/π)(x + 0.044715x³); 0 stays 0, and the
    # exponent is capped at 80 (x below about -9.9, where GELU is under 1e-34 of x).
    u = 0.7978845608028654 * (x_ + 0.044715 * x_ * x_ * x_)
    y = x_ / (1.0 + tl.exp(tl.minimum(-2.0 * u, 80.0)))
    _store_rows(y, row, cols, inside, values, scales, K, FP8)


@_jit
def _norm_modulate_quantize_kernel(
    x, values, scales, K, shift, scale, rows_per_item, modulation_stride,
    eps: tl.constexpr,  # a constant: inductor would pass a float argument as fp64
    BLOCK: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < K
    x_ = tl.load(x + row * K + cols, mask=inside, other=0.0).to(tl.float32)
    mean = tl.sum(x_, axis=0) / K
    centred = tl.where(inside, x_ - mean, 0.0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(centred * centred, axis=0) / K + eps))
    at = (row // rows_per_item) * modulation_stride + cols
    shift_ = tl.load(shift + at, mask=inside, other=0.0).to(tl.float32)
    scale_ = tl.load(scale + at, mask=inside, other=0.0).to(tl.float32)
    y = centred * rstd * (1.0 + scale_) + shift_
    _store_rows(y, row, cols, inside, values, scales, K, FP8)


def _outputs(x: torch.Tensor, compute: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = x.shape
    values = torch.empty((rows, width), dtype=DTYPES[compute], device=x.device)
    return values, torch.empty((rows, 1), dtype=torch.float32, device=x.device)


def _launch(kernel, x: torch.Tensor, compute: str, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``kernel`` one program a row of ``x`` ``[M, K]``, with ``args`` after its outputs and ``K``."""
    x = x.contiguous()
    values, scales = _outputs(x, compute)
    block = triton.next_power_of_2(x.shape[1])
    warps = 4 if block <= 2048 else 8
    torch.library.wrap_triton(kernel)[(x.shape[0],)](
        x, values, scales, x.shape[1], *args, BLOCK=block, FP8=compute == FP8, num_warps=warps
    )
    return values, scales


def triton_quantize_rows(x: torch.Tensor, compute: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of :func:`.fused.quantize_rows` on ``x`` ``[M, K]``: values ``[M, K]``, scales
    ``[M, 1]``."""
    return _launch(_quantize_rows_kernel, x, compute)


def triton_gelu_quantize(x: torch.Tensor, compute: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of :func:`.fused.gelu_quantize` on ``x`` ``[M, K]``."""
    return _launch(_gelu_quantize_kernel, x, compute)


def triton_norm_modulate_quantize(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, compute: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of :func:`.fused.norm_modulate_quantize` on ``x`` ``[B, N, K]`` with ``shift`` and
    ``scale`` as ``[B, K]`` or ``[1, K]`` rows."""
    shift, scale = shift.contiguous(), scale.contiguous()
    stride = 0 if shift.shape[0] == 1 else x.shape[-1]
    flat = x.reshape(-1, x.shape[-1])
    return _launch(_norm_modulate_quantize_kernel, flat, compute, shift, scale, x.shape[1], stride, eps)


# The operators (``torch.library.triton_op``): under ``torch.compile`` inductor traces into them and launches
# the Triton kernels from its own compiled code, with no Python call per kernel; without Triton or on another
# device they run the references. (As ``torch.library.Library`` operators with Python CUDA kernels they would
# make six dispatcher-to-Python calls and six Triton launches from Python a block.)
def _on_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


@torch.library.triton_op("pixart_lowvram::quantize_rows", mutates_args=())
def quantize_rows_op(x: torch.Tensor, compute: str) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_triton(x):
        return triton_quantize_rows(x, compute)
    rows = fused.quantize_rows(x, compute)
    return rows.values, rows.scales


@torch.library.triton_op("pixart_lowvram::gelu_quantize", mutates_args=())
def gelu_quantize_op(x: torch.Tensor, compute: str) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_triton(x):
        return triton_gelu_quantize(x, compute)
    rows = fused.gelu_quantize(x, compute)
    return rows.values, rows.scales


@torch.library.triton_op("pixart_lowvram::norm_modulate_quantize", mutates_args=())
def norm_modulate_quantize_op(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, compute: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_triton(x):
        return triton_norm_modulate_quantize(x, shift, scale, eps, compute)
    rows = fused.norm_modulate_quantize(x, shift[:, None], scale[:, None], eps, compute)
    return rows.values, rows.scales


def quantize_rows(x: torch.Tensor, compute: str) -> Rows:
    """``x`` ``[..., K]`` quantized per row to ``compute``'s 8 bits, in one pass (:func:`.fused.quantize_rows`)."""
    values, scales = quantize_rows_op(x.reshape(-1, x.shape[-1]), compute)
    return Rows(values, scales, tuple(x.shape[:-1]))


def gelu_quantize(x: torch.Tensor, compute: str) -> Rows:
    """GELU (tanh) of ``x`` ``[..., K]`` quantized per row, in one pass (:func:`.fused.gelu_quantize`)."""
    values, scales = gelu_quantize_op(x.reshape(-1, x.shape[-1]), compute)
    return Rows(values, scales, tuple(x.shape[:-1]))


def norm_modulate_quantize(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, compute: str
) -> Rows:
    """``x`` ``[B, N, K]`` layer-normed, modulated and quantized per row, in one pass
    (:func:`.fused.norm_modulate_quantize`)."""
    shift, scale = fused.modulation_rows(x, shift, "shift"), fused.modulation_rows(x, scale, "scale")
    values, scales = norm_modulate_quantize_op(x, shift, scale, eps, compute)
    return Rows(values, scales, tuple(x.shape[:-1]))
