"""Device and dtype choices shared by the stages."""

from __future__ import annotations

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
