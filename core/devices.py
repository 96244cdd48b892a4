"""Device and dtype choices shared by the stages."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os

import torch

PRECISIONS: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def as_device(device: torch.device | str | None) -> torch.device:
    """The device asked for (None: CUDA when present, else the CPU), refused at once when it is not here."""
    if device is None:
        return default_device()
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a device name; use cpu, cuda or cuda:N.") from exc
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise ValueError(
                f"device {str(device)!r}: this torch {torch.__version__} is a CPU build without CUDA. Use device "
                "cpu, or install a CUDA build of torch (pytorch.org lists the command for your system)."
            )
        count = torch.cuda.device_count()
        if count == 0 or (device.index or 0) >= count:
            raise ValueError(
                f"device {str(device)!r}: {'no CUDA GPU is visible' if count == 0 else f'only {count} CUDA GPU(s)'}"
                f" here. Use {'cpu' if count == 0 else f'cuda:0..cuda:{count - 1}'}, or check the driver and "
                f"CUDA_VISIBLE_DEVICES."
            )
    return device


def bf16_ok(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())


def resolve_dtype(
    precision: str | torch.dtype | None,
    device: torch.device,
    cuda_default: torch.dtype,
    cpu_default: torch.dtype,
) -> torch.dtype:
    """A stage's dtype: the one asked for, else the stage's default for the device."""
    if isinstance(precision, torch.dtype):
        return precision
    if precision not in (None, *PRECISIONS):
        raise ValueError(f"precision {precision!r} is unknown; choose one of {', '.join(PRECISIONS)}.")
    dtype = PRECISIONS.get(precision) if precision else None
    if dtype is None:
        dtype = cuda_default if device.type == "cuda" else cpu_default
    if dtype == torch.bfloat16 and not bf16_ok(device):
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    return dtype


# torch's own attention order on a GPU whose cuDNN kernel it prefers (what its first CUDA attention call
# sets, ``check_prefer_cudnn_attention`` in ATen's sdp_utils.cpp): cuDNN first, then its default order.
CUDNN_FIRST = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


@functools.cache
def prefers_cudnn_attention(device: torch.device) -> bool:
    """Whether torch, left to itself, runs attention on ``device`` with cuDNN's kernel first: Hopper and
    Blackwell data-centre GPUs (compute capability 9.0, 9.3, 10.0, 10.3) with cuDNN 9.15 or later, unless
    ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` says otherwise. Elsewhere its order is FlashAttention first."""
    if device.type != "cuda" or not torch.backends.cudnn.is_available():
        return False
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").lower() in ("1", "true", "on", "yes"):
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return (torch.backends.cudnn.version() or 0) > 91500 and major in (9, 10) and minor in (0, 3)


def attention_order(device: torch.device):
    """A context in which attention on ``device`` runs in torch's own backend order for it.

    torch sets that order at its first CUDA attention call; a priority context entered before that call
    (ComfyUI wraps each of its attention calls in one, FlashAttention first) restores the order it found,
    torch's default, FlashAttention first, for every call after it in the process. So on a GPU where torch
    prefers cuDNN's kernel (:func:`prefers_cudnn_attention`, 1.6× faster than FlashAttention-2 at PixArt-Σ's
    1024² shapes on an H200) the pack's forwards say so themselves; elsewhere nothing changes."""
    return _priority(device, CUDNN_FIRST)


# The cross-attention's order where the keys are a prompt's own tokens (ComfyUI's conditioning, unpadded: a
# new length for almost every new prompt): cuDNN's kernel builds an execution plan for each shape it has not
# met (37-41 and 67 ms a new key length at PixArt-Σ's shapes on two H200s, docs/BENCHMARKS.md),
# FlashAttention none.
SHORT_KEYS_FIRST = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def cross_attention_order(device: torch.device):
    """A context in which a cross-attention over a prompt's own tokens runs FlashAttention first, on a GPU
    where :func:`attention_order` puts cuDNN first (elsewhere FlashAttention is first already)."""
    return _priority(device, SHORT_KEYS_FIRST)


@functools.cache
def _backends(names: tuple[str, ...]) -> list | None:
    """torch's backends of ``names``, or None where its ``sdpa_kernel`` takes no priority order."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if "set_priority" not in inspect.signature(sdpa_kernel).parameters:
        return None
    return [getattr(SDPBackend, name) for name in names]


def _priority(device: torch.device, names: tuple[str, ...]):
    from torch.nn.attention import sdpa_kernel

    backends = _backends(names)
    if backends is None or not prefers_cudnn_attention(device):
        return contextlib.nullcontext()
    return sdpa_kernel(backends, set_priority=True)
