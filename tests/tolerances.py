"""How close two different computations of the same numbers must be, per dtype: the one place the tests
state it.

Two computations of the same arithmetic by different code (a convolution over strips of its input and the
whole convolution, the pack's plain layer and quanto's, a model's blocks streamed and resident, the pack's
decoder and diffusers') are not promised the same bits: a backend picks its kernel (its blocking, vector
width and so its order of summation) by shape, CPU, thread count and library version, and promises only
each result's rounding. On an AMD EPYC with AVX-512, 2 threads, the decoder in strips gave values 2.1e-6
from the whole convolutions' (fp32); on an Intel Xeon with AVX-512, 2 threads, 2.5e-6. Where the SAME
kernels run on the SAME data (a repeated prompt, a kept, pooled or cached model run again, a model saved and
read back bit for bit) the tests stay exact; everything else is compared here.

Two bounds:

``operation`` — one operation (a convolution, a matrix product, a linear layer) computed by another kernel:
torch.testing.assert_close's own defaults per dtype (its documentation lists them), float32 rtol 1.3e-6 atol
1e-5, bfloat16 rtol 1.6e-2 atol 1e-5, float16 rtol 1e-3 atol 1e-5. An output is rounded to its dtype once:
another order of summation moves an fp32 result by a few ulps of the sum's terms (atol: results of order 1,
and those that cancel towards 0), and a bf16 or fp16 result, accumulated in fp32, by at most an ulp of
itself where the fp32 sums straddle a rounding boundary (bf16's ulp is at most 2^-7 ≈ 0.0078 of the value,
under 0.016; fp16's at most 2^-10 ≈ 0.00098, under 0.001).

``network`` — a whole model (the VAE decoder's ~30 convolutions, GroupNorms and attention; T5; the
transformer over sampling steps) any layer of which may be summed in another order: each layer's differences
carry into the next and add up, so they are bounded relative to the output's size, atol = ULPS[dtype] × eps
× max|expected| (``operation``'s atol at least), rtol ``operation``'s. ULPS: float32 256, bfloat16 8,
float16 8. Measured on the tiny model's VAE (the SDXL VAE's widths) decoding 128 px on the CPU, torch 2.13.0
(eps × max|expected| units): fp32, convolutions in strips against whole ones 11 (AVX-512, 2 threads); the
whole decode on oneDNN's AVX2, SSE4.1 or plain kernels against its AVX-512 ones up to 67. bf16, strips
against whole 1.6 (oneDNN's AVX512_CORE_BF16 kernels, where its AMX ones gave 0); AVX512_CORE against AMX
kernels 3.2, with over half the pixels beyond ``operation``'s bf16 bound (hence this bound). On an H200
(torch 2.11, cuDNN 9.19) decoding 1024² in bf16: the default strips gave the whole convolutions' bits,
smaller strips (other kernels for other heights) an ulp here and there, 0.23. float16 is set by bf16's
reasoning (fp32 sums, one rounding a layer); no test compares an fp16 network yet.

Both stay far from a real fault: a decoder whose strips were off by one row, or lacked their neighbours'
rows, differed from the whole by 2.1-2.3 at 128 px (about 10^7 eps × max in fp32, 150 in bf16; over 70% of
the pixels beyond the bound) and by 113 and 67 eps × max at 1024² on the H200 (45% and 1% of the pixels
beyond it); one convolution in strips so wrong fails ``operation``'s bound for fp32 and bf16 alike.

Values that are not floating point (masks, token ids, uint8 pixels) are data: compared exactly.
"""

from __future__ import annotations

import torch

# torch.testing.assert_close's defaults (its documentation's table): one operation.
OPERATION = {
    torch.float32: {"rtol": 1.3e-6, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},
    torch.float16: {"rtol": 1e-3, "atol": 1e-5},
}
# Classifier-free guidance in one batch (cond and uncond repeated to a common length) against two passes:
# the latents' cosine similarity after sampling, at least (issue 27's bound; the repeated keys only change
# the order and count of the softmax's sums).
GUIDANCE_COSINE = {torch.float32: 0.99999, torch.float16: 0.9999}
# A whole network: ulps (eps) of the output's largest magnitude, measured as the module's docstring says.
ULPS = {torch.float32: 256, torch.bfloat16: 8, torch.float16: 8}


def tolerance(expected: torch.Tensor, *, network: bool = False) -> dict[str, float]:
    """``rtol`` and ``atol`` for results meant to equal ``expected`` (its dtype picks them; see the module's
    docstring): ``network`` for a whole model's output, else one operation's. Exact for non-float data."""
    dtype = expected.dtype
    if not dtype.is_floating_point:
        return {"rtol": 0.0, "atol": 0.0}
    if dtype not in OPERATION:
        raise ValueError(f"no tolerance is stated for {dtype}; add it to tests/tolerances.py")
    bound = dict(OPERATION[dtype])
    if network and expected.numel():
        scale = expected.detach().abs().max().float().item()
        bound["atol"] = max(bound["atol"], ULPS[dtype] * torch.finfo(dtype).eps * scale)
    return bound


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, network: bool = False, msg=None) -> None:
    """torch.testing.assert_close with :func:`tolerance`'s bound (same shape, dtype and device too)."""
    torch.testing.assert_close(actual, expected, **tolerance(expected, network=network), msg=msg)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖got − expected‖ / ‖expected‖``, in float64."""
    return float((got.double() - expected.double()).norm() / expected.double().norm())
