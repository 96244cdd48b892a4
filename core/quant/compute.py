"""How the transformer's quantized layers compute: the weights expanded to fp16 (``fp16``), or 8-bit matrix
products on 8-bit weights and activations (``int8``, ``fp8``); ``auto`` (the default) stands for one of them
(:func:`resolve`).

``fp16``: each layer expands its int8 (or float8) weight to the compute dtype and runs one fp16 matrix
product (:class:`.quanto.ScaledWeightLinear`). It stores 8 bits and computes 16.

``int8`` (W8A8): the stored int8 weight with its per-row scale, the activation quantized per token
(symmetric, absmax / 127) as it enters the layer, one int8 × int8 → int32 matrix product
(``torch._int_mm``: int8 tensor cores on NVIDIA Turing and newer), then both scales applied to the int32
result. ``fp8``: the same with float8 e4m3 weight and activation (absmax / 448 per token) and
``torch._scaled_mm``, which applies the per-token and per-row scales and the bias in its epilogue and
writes the activation's dtype (fp8 tensor cores: Ada, Hopper and newer). An int8 weight becomes e4m3
once, when the layer is set to compute in fp8: its integers are exact up to 16 in e4m3 and within 1/16 of
their value above, with the same per-row scale.

The activation's quantization is an absmax over each row and a division, which pays only when it runs
inside the kernel that made the activation (the norm and modulation before the attention's and
feed-forward's inputs, the GELU before the second feed-forward layer): run by themselves they cost more
than the 8-bit product saves (FACTS: ff2 281 µs against 115 µs in fp16, H200). So the blocks' forward
quantizes those inputs in one pass with the op before (:mod:`.block`, :mod:`.fused_kernels`: Triton
kernels on CUDA, the float32 references of :mod:`.fused` elsewhere), and hands them to :func:`product`;
a layer called with a tensor quantizes it here (:func:`quantize_rows`). On a GPU the blocks run compiled
(``torch.compile``: inductor fuses the rest of the block, and the quantization :func:`quantize_rows` does);
on the CPU they run eager (a compile there takes minutes).

Only the layers of the transformer's blocks compute in 8 bits: their rows are the image's tokens (4096 at
1024²) or the caption's. The embeddings, the time conditioning, the caption projection and ``proj_out``
keep the fp16 path (a handful of rows a step, or the layer the recipe keeps in full precision). A call
with fewer than :data:`MIN_ROWS` rows (ComfyUI's unpadded one-token negative caption) also takes the fp16
path: the int8 kernel refuses 16 rows or fewer, and a product that small has nothing to gain.

A LoRA (any patch) on an 8-bit layer goes into the weight: the layer's weight expanded, patched, and
quantized again per row to its 8 bits (:meth:`.quanto.ScaledWeightLinear.requantized`), once a run where the
device has the room for the copy (:func:`.quanto.hold_dense`: 1 byte a weight), else at each call. The run
then makes the same 8-bit products, on the same fused path, as without the LoRA; the stored weight stays
as it was.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

FP16, INT8, FP8 = "fp16", "int8", "fp8"
AUTO = "auto"
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
INT8_MAX = 127.0
# At or below this many rows a call takes the fp16 path (``torch._int_mm`` needs more than 16 on CUDA).
MIN_ROWS = 32
# Hopper's fp8 products accumulate faster in fewer bits between promotions (torchao's inference default).
FAST_ACCUMULATION = True
# The activation dtypes fp8's product writes itself, bias included.
EPILOGUE_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Cards:
    """Where an 8-bit compute runs and where ``auto`` takes it: from CUDA compute ``capability`` on (the
    NVIDIA cards ``names``), and by default on the cards of capability ``fastest`` (``fastest_names``), where
    it is measured faster than fp16 within the fidelity bound (latent cosine >= 0.995 against fp16)."""

    capability: tuple[int, int]
    names: str
    fastest: tuple[int, int] | None = None
    fastest_names: str = ""

    def needs(self) -> str:
        return f"an NVIDIA GPU of compute capability {self.capability[0]}.{self.capability[1]} or newer ({self.names})"


# Which card gets which compute: the one table that the tooltips, the command line's help, the errors and
# ``auto`` read, and that tests/test_compute.py holds README and docs/USAGE.md to. fp8's fastest: measured
# on an H100 by benchmarks/compute.py (git log -p -- benchmarks/results/compute.json); other cards unmeasured.
TABLE = {
    INT8: Cards((7, 5), "RTX 20 and later, T4, A100, H100, H200"),
    FP8: Cards((8, 9), "RTX 40 and later, L4, L40, H100, H200", fastest=(9, 0), fastest_names="H100/H200"),
}

logger = logging.getLogger(__name__)

_AUTO = ", ".join(f"{name} on {cards.fastest_names}" for name, cards in TABLE.items() if cards.fastest)
DESCRIPTIONS = {
    AUTO: f"{_AUTO} (in the sampler not with low_vram), measured faster there than fp16; fp16 elsewhere",
    FP16: "weights expanded to fp16, fp16 matrix products (fp16 on a GPU, bf16 on the CPU)",
    INT8: "int8 weights and per-token int8 activations, int8 tensor-core products "
    f"({TABLE[INT8].names}); compiles the blocks on first use",
    FP8: "float8 e4m3 weights and per-token activations, fp8 tensor-core products "
    f"({TABLE[FP8].names}); compiles the blocks on first use",
}
COMPUTES = tuple(DESCRIPTIONS)


def tooltip() -> str:
    return " ".join(f"{name}: {text}." for name, text in DESCRIPTIONS.items())


def resolve(compute: object, device: torch.device, scheme: object, eight_bit: bool = False) -> object:
    """The compute ``auto`` stands for: where ``eight_bit`` lets it (the int8 MODEL, the sampler without
    low_vram), with quantized weights (``scheme`` not ``none``), on a card of a :data:`TABLE` row's
    ``fastest`` that can run it (:func:`unable`) and with Triton to compile its blocks (:func:`compiler`),
    that row's compute; otherwise fp16. Any other value as it is. Decided here alone, once per settings
    (:class:`..transformer.TransformerSettings`)."""
    if compute != AUTO:
        return compute
    if not eight_bit or device.type != "cuda" or scheme == "none":
        return FP16
    capability = torch.cuda.get_device_capability(device)
    chosen = next((name for name, cards in TABLE.items() if cards.fastest == capability), FP16)
    if chosen == FP16 or unable(chosen, device):
        return FP16
    name = torch.cuda.get_device_name(device)
    if not compiler():
        why = _COMPILER_FAILED[0] or "no Triton"
        logger.info("compute auto: fp16 on %s: %s, which %s's compiled blocks need", name, why, chosen)
        return FP16
    logger.info(
        "compute auto: %s on %s (set compute to fp16 for fp16's products)",
        chosen,
        name,
    )
    return chosen


# Why torch.compile failed in this process, once it has (:func:`compiler_failed`); None until then.
_COMPILER_FAILED: list[str | None] = [None]


def compiler() -> bool:
    """Whether torch.compile can build the 8-bit blocks' GPU code: Triton installed, and no compile of this
    process failed (:func:`compiler_failed`)."""
    return _COMPILER_FAILED[0] is None and importlib.util.find_spec("triton") is not None


def compiler_failed(why: str) -> None:
    """Record that torch.compile failed here (``why``, one line): ``auto`` takes fp16 from now on."""
    _COMPILER_FAILED[0] = f"torch.compile failed ({why})"


def unable(compute: str, device: torch.device) -> str | None:
    """Why ``device`` cannot run the 8-bit ``compute``, in one line naming the compute to set instead; None
    where it can (the CPU, an NVIDIA GPU of the :data:`TABLE`'s capability)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"compute {compute!r} runs on NVIDIA GPUs and the CPU, not on {device.type!r}; set compute to fp16."
    name = torch.cuda.get_device_name(device)
    cards = TABLE[compute]
    if torch.version.hip:  # ROCm reports AMD's architecture as the capability (an MI200: 9.0)
        return f"compute {compute!r} needs {cards.needs()}; {name} is an AMD GPU (ROCm). Set compute to fp16."
    capability = torch.cuda.get_device_capability(device)
    if capability >= cards.capability:
        return None
    other = next((n for n, c in TABLE.items() if n != compute and capability >= c.capability), FP16)
    return (
        f"compute {compute!r} needs {cards.needs()}; {name} is {capability[0]}.{capability[1]}. Set compute "
        f"to {other}."
    )


def require(compute: object, device: torch.device, scheme: object) -> None:
    """Raise one clear line unless ``compute`` (resolved: :func:`resolve`) runs on ``device`` with weights of
    quantization ``scheme``."""
    if not isinstance(compute, str) or compute not in COMPUTES:
        raise ValueError(f"compute {compute!r} is not offered; choose one of {', '.join(COMPUTES)}.")
    if compute == FP16:
        return
    if scheme == "none":
        raise ValueError(
            f"compute {compute!r} runs on quantized weights, and quantization is 'none'; set quantization "
            f"to qint8, or compute to fp16."
        )
    if compute == INT8 and scheme != "qint8":
        raise ValueError(
            f"compute 'int8' runs on qint8 weights, and quantization is {scheme!r}; set quantization to "
            f"qint8, or compute to fp8 or fp16."
        )
    reason = unable(compute, device)
    if reason:
        raise RuntimeError(reason)


def weight_for(compute: str, data: torch.Tensor) -> torch.Tensor:
    """A quantized layer's stored weight values as ``compute`` takes them: e4m3 for fp8 (from int8 or
    float8 values, the per-row scale unchanged), as they are otherwise."""
    if compute == FP8 and data.dtype != E4M3:
        return data.to(torch.float16).to(E4M3)
    return data


@dataclass(frozen=True)
class Rows:
    """An activation quantized per row for an 8-bit product: ``values`` ``[M, K]`` (int8 or e4m3),
    ``scales`` ``[M, 1]`` float32 (a row is its values times its scale), and ``shape``, the activation's
    leading shape (``M`` rows in all)."""

    values: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]


def quantize_rows(x: torch.Tensor, compute: str) -> Rows:
    """``x`` ``[..., K]`` quantized per row (token) to ``compute``'s 8 bits, in float32."""
    return quantize_float32(x.reshape(-1, x.shape[-1]).float(), compute, tuple(x.shape[:-1]))


def quantize_float32(rows: torch.Tensor, compute: str, shape: tuple[int, ...]) -> Rows:
    """float32 ``rows`` ``[M, K]`` quantized symmetrically by each row's absmax: over 127 and rounded half to
    even for int8, over 448 and cast (round to nearest even) for e4m3."""
    absmax = rows.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    # Each row times the reciprocal of its scale: one division a row (as the fused kernels do).
    if compute == INT8:
        scales = absmax / INT8_MAX
        values = (rows * (1 / scales)).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        scales = absmax / E4M3_MAX
        values = (rows * (1 / scales)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Rows(values, scales, shape)


def product(
    compute: str,
    rows: Rows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``rows @ (weight × weight_scale)ᵀ + bias`` in ``out_dtype``, shaped ``[*rows.shape, out]``: ``weight``
    holds the layer's values as :func:`weight_for` gave them, ``weight_scale`` ``[out, 1]``."""
    scale_b = weight_scale.reshape(1, -1).float()
    if compute == INT8:
        out = torch._int_mm(rows.values, weight.t()).float() * (rows.scales * scale_b)
    elif out_dtype in EPILOGUE_DTYPES:
        # The scales, the bias and the cast in the product's epilogue: no pass over its output after it
        # (an H100, 2026-12-06: ff1's output in bf16 with a separate cast and bias cost 72 + 204 µs against
        # 81 µs in fp16 with its bias).
        out = torch._scaled_mm(
            rows.values,
            weight.t(),
            scale_a=rows.scales,
            scale_b=scale_b,
            bias=None if bias is None else bias.to(out_dtype),
            out_dtype=out_dtype,
            use_fast_accum=FAST_ACCUMULATION,
        )
        return out.reshape(*rows.shape, out.shape[-1])
    else:  # float32 activations (the CPU's fp32 runs): bf16 out, where torch takes no float32 bias
        out = torch._scaled_mm(
            rows.values,
            weight.t(),
            scale_a=rows.scales,
            scale_b=scale_b,
            out_dtype=torch.bfloat16,
            use_fast_accum=FAST_ACCUMULATION,
        )
    out = out.to(out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.reshape(*rows.shape, out.shape[-1])


def linear(
    compute: str,
    input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``input @ (weight × weight_scale)ᵀ + bias`` with ``input`` quantized per token to ``compute``'s 8 bits
    (:func:`quantize_rows`, then :func:`product`); the result in ``input``'s dtype."""
    return product(compute, quantize_rows(input, compute), weight, weight_scale, bias, input.dtype)


@dataclass(frozen=True)
class LowRank:
    """One LoRA of a layer: ``scale × up @ down`` added to the weight's rows ``rows[0]:rows[0] + rows[1]``
    (all of them when None: ComfyUI's fused q, k, v layer takes the q, k and v LoRAs at their offsets),
    folded into an expanded weight (:meth:`fold_into`)."""

    up: torch.Tensor  # [out rows, rank]
    down: torch.Tensor  # [rank, in]
    scale: float
    rows: tuple[int, int] | None = None

    def fold_into(self, weight: torch.Tensor) -> torch.Tensor:
        """Add ``scale × up @ down`` to ``weight``'s rows in place (a linear or convolution weight of its
        own, in the factors' dtype and on their device): the LoRA merged into an expanded weight, in one
        multiply-add."""
        rows = weight if self.rows is None else weight.narrow(0, *self.rows)
        rows.view(rows.shape[0], -1).addmm_(self.up, self.down, alpha=self.scale)
        return weight
