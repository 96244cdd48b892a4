"""The fused quantizations (core.quant.fused, core.quant.fused_kernels): each eager reference against a
float64 computation of the same op within a bound derived from its 8-bit format, their custom ops, and the
Triton kernels under Triton's interpreter (when Triton is installed) against the references.

The bounds. A row quantized with scale ``s`` (its float32 absmax over 127 or 448) gives back ``q × s``:
- int8 rounds ``y / s`` to the nearest integer: at most half a step, ``s / 2``, from ``y``;
- e4m3 rounds ``y / s`` to 3 mantissa bits: a step of at most 2^-3 of the value in a binade, so at most
  2^-4 × |y| away, and in the subnormals (``|y / s|`` below 2^-6) a step of 2^-9: at most 2^-10 × s away.
Both on top of float32's own error in ``y`` (the op before, computed in float32): a LayerNorm over K values
sums in float32 (relative error about log2(K) × 2^-24 ≈ 1e-6 of the row's size at K = 4608), the
modulation and GELU add a few ulps; FLOAT32 = 1e-5 of the row's absmax is ten times that. The scale itself
is the float32 absmax over 127 or 448: within FLOAT32 of the float64 one, relatively.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pixart_lowvram.core.quant import compute, fused, fused_kernels

PATHS = ("int8", "fp8")
MAXIMUM = {"int8": 127.0, "fp8": 448.0}
FLOAT32 = 1e-5
EPS = 1e-6  # PixArt-Σ's norm1 and norm2


def _inputs(width: int = 1152, seed: int = 0):
    """Two batch items of 40 tokens, a few of them outliers (as PixArt's activations have), and a shift and
    scale for each item."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 40, width, generator=generator)
    x[:, ::7, :: width // 8] *= 20
    shift = torch.randn(2, 1, width, generator=generator) * 0.5
    scale = torch.randn(2, 1, width, generator=generator) * 0.3
    return x, shift, scale


def _float64(op: str, x, shift, scale) -> torch.Tensor:
    """The op before the quantization in float64, as ``[M, K]`` rows."""
    x = x.double()
    if op == "norm_modulate_quantize":
        normed = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + EPS)
        y = normed * (1 + scale.double()) + shift.double()
    elif op == "gelu_quantize":
        y = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    else:
        y = x
    return y.reshape(-1, x.shape[-1])


def _reference(op: str, x, shift, scale, path: str) -> compute.Rows:
    if op == "norm_modulate_quantize":
        return fused.norm_modulate_quantize(x, shift, scale, EPS, path)
    return getattr(fused, op)(x, path)


def _excess(rows: compute.Rows, expected: torch.Tensor, path: str) -> float:
    """How far beyond its bound ``rows`` is from float64 ``expected`` ``[M, K]`` at its worst (≤ 0: within)."""
    absmax = expected.abs().amax(-1, keepdim=True)
    scales = rows.scales.double()
    scale_excess = float(((scales - absmax / MAXIMUM[path]).abs() / scales).max()) - FLOAT32
    error = (rows.values.double() * scales - expected).abs()
    if path == "int8":
        bound = scales / 2 + FLOAT32 * absmax
    else:
        bound = 2**-4 * expected.abs() + 2**-10 * scales + FLOAT32 * absmax
    return max(scale_excess, float((error - bound).max()))


OPS = ("quantize_rows", "norm_modulate_quantize", "gelu_quantize")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", OPS)
def test_a_reference_is_within_its_formats_bound_of_float64(op, path):
    x, shift, scale = _inputs()
    rows = _reference(op, x, shift, scale, path)
    assert rows.values.dtype == fused_kernels.DTYPES[path] and rows.values.shape == (80, 1152)
    assert rows.scales.dtype == torch.float32 and rows.scales.shape == (80, 1) and rows.shape == (2, 40)
    assert _excess(rows, _float64(op, x, shift, scale), path) <= 0


@pytest.mark.parametrize("path", PATHS)
def test_the_bound_catches_a_modulation_left_out_or_given_to_the_wrong_item(path):
    x, shift, scale = _inputs()
    expected = _float64("norm_modulate_quantize", x, shift, scale)
    unmodulated = fused.norm_modulate_quantize(x, 0 * shift, 0 * scale, EPS, path)
    swapped = fused.norm_modulate_quantize(x, shift.flip(0), scale.flip(0), EPS, path)
    assert _excess(unmodulated, expected, path) > 0.1
    assert _excess(swapped, expected, path) > 0.1


def test_int8_rounds_half_to_even():
    row = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]])
    rows = fused.quantize_rows(row, "int8")
    assert rows.values.tolist() == [[127, 0, 2, 2, 0, -2, -2, 126]] and rows.scales.item() == 1.0


def test_a_modulation_for_another_batch_or_width_is_refused_in_one_line():
    x, shift, scale = _inputs(width=64)
    with pytest.raises(ValueError, match=r"^shift of shape \(3, 1, 64\) does not modulate x of shape"):
        fused.norm_modulate_quantize(x, torch.zeros(3, 1, 64), scale, EPS, "int8")
    with pytest.raises(ValueError, match=r"give x as \[B, N, K\] and scale as \[B, 1, K\]"):
        fused_kernels.norm_modulate_quantize(x, shift, scale[..., :32], EPS, "int8")
    # One shift and scale for every batch item is taken.
    one = fused.norm_modulate_quantize(x, shift[:1], scale[:1], EPS, "int8")
    both = fused.norm_modulate_quantize(
        x, shift[:1].expand(2, 1, 64), scale[:1].expand(2, 1, 64), EPS, "int8"
    )
    assert torch.equal(one.values, both.values)


@pytest.mark.parametrize("path", PATHS)
def test_the_custom_ops_are_the_references_off_cuda_and_pass_torchs_checks(path):
    x, shift, scale = _inputs(width=96)
    for op in OPS:
        args = (shift, scale, EPS) if op == "norm_modulate_quantize" else ()
        got = getattr(fused_kernels, op)(x, *args, path)
        expected = _reference(op, x, shift, scale, path)
        assert got.shape == expected.shape == (2, 40)
        assert torch.equal(got.values.view(torch.int8), expected.values.view(torch.int8))
        assert torch.equal(got.scales, expected.scales)
    rows = x.reshape(-1, 96)
    torch.library.opcheck(fused_kernels.quantize_rows_op, (rows, path))
    torch.library.opcheck(fused_kernels.gelu_quantize_op, (rows, path))
    torch.library.opcheck(fused_kernels.norm_modulate_quantize_op, (x, shift[:, 0], scale[:, 0], EPS, path))
    assert hasattr(torch.ops.pixart_lowvram, "norm_modulate_quantize")


# Runs under TRITON_INTERPRET=1 in a fresh interpreter (Triton reads it at import): each kernel on CPU
# tensors against its reference. quantize_rows multiplies by the reciprocal as the reference does and rounds
# by the same rule, so it must give the same bits. The norm (another order of summation) and GELU (its
# exponential) differ from the references' float32 by a few ulps, which moves a value across a rounding
# boundary now and then: one int8 step, or one e4m3 step of the value (at most 2^-3 of it, 2^-9 × s in the
# subnormals). The kernels round to e4m3's grid themselves before the cast, so the interpreter's cast
# (which rounds half up and can lose the carry into the exponent: 127.8 became 64) only casts exact values
# and no looser bound is needed for it.
INTERPRETED = textwrap.dedent(
    """
    import json, sys, torch
    from pixart_lowvram.core.quant import fused, fused_kernels as kernels

    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 24, 1152, generator=generator)
    x[:, ::5, ::100] *= 30
    shift, scale = torch.randn(2, 1152, generator=generator), torch.randn(2, 1152, generator=generator) * 0.3
    hidden = torch.randn(48, 4608, generator=generator) * 2
    x, shift, scale, hidden = (t.to(device) for t in (x, shift, scale, hidden))
    report = {}
    for path in ("int8", "fp8"):
        pairs = {
            "quantize_rows": (kernels.triton_quantize_rows(x.reshape(-1, 1152), path), fused.quantize_rows(x, path)),
            "norm_modulate_quantize": (
                kernels.triton_norm_modulate_quantize(x, shift, scale, 1e-6, path),
                fused.norm_modulate_quantize(x, shift[:, None], scale[:, None], 1e-6, path),
            ),
            "gelu_quantize": (kernels.triton_gelu_quantize(hidden, path), fused.gelu_quantize(hidden, path)),
        }
        for op, ((values, scales), rows) in pairs.items():
            got, expected = values.float(), rows.values.float()
            if path == "int8":
                steps = (got - expected).abs()
            else:
                step = torch.maximum(got.abs(), expected.abs()) * 2**-3 + 2**-9
                steps = (got - expected).abs() / step
            report[f"{op} {path}"] = {
                "scale": float(((scales - rows.scales).abs() / rows.scales).max()),
                "steps": float(steps.max()),
                "moved": float((got != expected).float().mean()),
                "dtype": str(values.dtype) == str(rows.values.dtype),
            }
    print(json.dumps(report))
    """
)


def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _triton(), reason="Triton is not installed (the CUDA torch builds bring it)")
def test_the_triton_kernels_under_the_interpreter_give_the_references_values(tmp_path):
    _kernels_give_the_references_values(tmp_path, {"TRITON_INTERPRET": "1"}, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU tier: pytest -m gpu)")
def test_the_compiled_kernels_on_cuda_give_the_references_values(tmp_path):
    """The same comparison with the kernels compiled for the GPU, against the references run by torch's CUDA
    kernels (their layer norm and tanh sum and round in their own order: the same bound)."""
    _kernels_give_the_references_values(tmp_path, {"TRITON_INTERPRET": "0"}, "cuda")


def _kernels_give_the_references_values(tmp_path, env: dict, device: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETED, device],
        cwd=tmp_path,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 6
    for name, result in report.items():
        assert result["dtype"] and result["scale"] <= FLOAT32, (name, result)
        assert result["steps"] <= 1, (name, result)
        assert result["moved"] <= (0 if name.startswith("quantize_rows") else 0.01), (name, result)


def test_the_kernels_module_imports_without_triton(tmp_path):
    """Triton made unimportable: the module still imports and its ops run the references."""
    script = textwrap.dedent(
        """
        import json, sys
        sys.modules["triton"] = None
        import torch
        from pixart_lowvram.core.quant import fused_kernels
        rows = fused_kernels.gelu_quantize(torch.randn(40, 64), "int8")
        print(json.dumps({"triton": fused_kernels.triton is None, "shape": list(rows.values.shape)}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"triton": True, "shape": [40, 64]}
