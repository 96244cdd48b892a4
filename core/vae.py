"""Latents -> images with the VAE, loaded for the decode and freed afterwards."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import estimates, inputs, measure, streaming
from .contract import ProgressCallback, check_latent_tensor
from .devices import as_device, resolve_dtype
from .estimates import Workload
from .models import ModelSource, check_weights
from .pool import cache
from .single_files import read_single_file_header

TILING = ("auto", "on", "off")
TILE_SIZE = (
    512  # pixels; diffusers' default tile is the config's sample_size (1024), too big to engage at 1024²
)
MIN_TILE_SIZE = 64
# A decoder convolution's input larger than this is convolved in horizontal strips of at most this size
# (StripConv2d).
STRIP_BYTES = 64 * 2**20

CONV_IN = "decoder.conv_in.weight"  # the same name in both key layouts
VAE_FILE_HINT = (
    "Use the SDXL VAE as a .safetensors file in models/vae (e.g. sdxl_vae.safetensors, in the original or "
    "the diffusers key layout), or no vae_file to use the PixArt-Σ model's own vae/."
)
# The SDXL VAE's diffusers config, for a single file when the model is not a local folder (a hub id):
# reading a config must never go to the network.
SDXL_VAE_CONFIG = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 1024,
    "scaling_factor": 0.13025,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}


# The decode stage's inputs in its node's order (see inputs.py).
INPUTS = inputs.Inputs(
    inputs.slot("model"),
    inputs.slot("latent"),
    inputs.KEEP_LOADED,
    inputs.Input(
        "tiling",
        inputs.CHOICE,
        TILING[0],
        f"auto: decode in {TILE_SIZE}-px tiles when the whole image would not fit in free GPU memory (about "
        "1.9 GiB at 1024²; tiles need 0.9 GiB). on: always tile. off: never.",
        choices=TILING,
        optional=True,
        help="VAE decode in tiles (auto: when short of memory)",
    ),
    # New inputs go last: saved workflows list widget values by position.
    inputs.slot("vae_file", optional=True),
)


def check_latents(samples: object) -> None:
    check_latent_tensor(
        samples,
        "PixArt-Σ's VAE decodes",
        "Feed it the LATENT of the PixArt-Σ sampler or of an SDXL-family model.",
    )


def check_vae_file(path: str | Path) -> Path:
    """Refuse anything but a readable safetensors file holding an SDXL-family VAE (4 latent channels), reading
    only its header, before anything loads."""
    path, tensors = read_single_file_header(path, "vae_file", VAE_FILE_HINT)
    shape = tensors[CONV_IN][1] if CONV_IN in tensors else None
    if shape is None or len(shape) != 4 or shape[1] != SDXL_VAE_CONFIG["latent_channels"]:
        found = f"no {CONV_IN}" if shape is None else f"{CONV_IN} of shape {shape}"
        raise ValueError(
            f"vae_file {str(path)!r} is not an SDXL VAE ({found}; the SDXL VAE decodes 4 latent channels, "
            f"shape [512, 4, 3, 3]). PixArt-Σ's latents are SDXL-VAE latents. {VAE_FILE_HINT}"
        )
    return path


@dataclass(frozen=True)
class DecoderSettings:
    """Every choice of the decode stage, checked when it is made (before anything loads): what a node or the
    command line builds once and hands to :func:`decode`.

    ``tiling``: ``on`` decodes in overlapping, blended tiles of ``tile_size`` pixels (much less memory),
    ``off`` in one piece, ``auto`` tiles when the whole would not fit in free GPU memory. ``vae_file``: the
    SDXL VAE as one safetensors file instead of the model's vae/ (the model folder's VAE config is used with
    it, so nothing is fetched). ``keep_loaded`` keeps the VAE for the next prompt instead of unloading it."""

    model: ModelSource
    device: torch.device | str | None = None
    precision: str | torch.dtype | None = None
    keep_loaded: bool = INPUTS.field_default("keep_loaded")
    tiling: str = INPUTS.field_default("tiling")
    tile_size: int = TILE_SIZE
    vae_file: str | os.PathLike | None = None
    dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        INPUTS.check(self)
        tile = self.tile_size
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < MIN_TILE_SIZE or tile % 8:
            raise ValueError(
                f"tile_size {tile!r} is not allowed; use a multiple of 8 pixels, at least {MIN_TILE_SIZE}."
            )
        device = as_device(self.device)
        if self.vae_file is None:  # the model's own VAE, there and readable before anything loads
            self.model.check_complete(["vae"])
        derived = {
            "device": device,
            # The SDXL VAE overflows in fp16 (hence ComfyUI decodes it in bf16 or fp32).
            "dtype": resolve_dtype(
                self.precision, device, cuda_default=torch.bfloat16, cpu_default=torch.float32
            ),
            "vae_file": check_vae_file(self.vae_file) if self.vae_file is not None else None,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def cache_key(self, work: Workload) -> tuple:
        """What a kept VAE is found by: the same weights in the same dtype on the same device (for any
        ``work``: tiling is set on the kept VAE for each decode)."""
        weights = str(self.vae_file.resolve()) if self.vae_file is not None else self.model.key
        return ("vae", weights, self.dtype, str(self.device))

    def device_bytes(self, work: Workload) -> tuple[int, int]:
        """(weights, work) bytes of a decode of ``work``, whole or in its tiles."""
        return estimates.vae_decode(work, self.dtype)

    def out_of_memory_advice(self) -> str:
        steps = [] if self.tiling == "on" else ["set tiling to on"]
        return ", ".join([*steps, "lower width, height or batch_size", measure.FREE_OTHERS])


def _load(settings: DecoderSettings):
    from diffusers import AutoencoderKL

    source, dtype, vae_file = settings.model, settings.dtype, settings.vae_file
    if vae_file is None:
        folder = source.folder(["vae"])
        check_weights(folder / "vae", source.name)
        model = AutoencoderKL.from_pretrained(folder, subfolder="vae", dtype=dtype, use_safetensors=True)
    elif source.path is not None and (source.path / "vae" / "config.json").is_file():
        # The model's own VAE config (local: no network), so the file replaces its weights only.
        model = AutoencoderKL.from_single_file(
            str(vae_file), config=str(source.path / "vae"), torch_dtype=dtype
        )
    else:
        with tempfile.TemporaryDirectory() as config:
            (Path(config) / "config.json").write_text(json.dumps(SDXL_VAE_CONFIG))
            model = AutoencoderKL.from_single_file(str(vae_file), config=config, torch_dtype=dtype)
    decode_in_place(model)
    decode_in_strips(model)
    streaming.move_model(model, settings.device)
    model.eval()
    return model


class StripConv2d(torch.nn.Conv2d):
    """A convolution (stride 1, zero padding that keeps the height) run over horizontal strips of its input
    of at most :data:`STRIP_BYTES` each, every strip with the rows of its neighbours the kernel reaches, into
    one output: each output row sums the same inputs, so the numbers are the whole convolution's wherever the
    backend runs a strip with the kernel it runs the whole with (so measured for the decoder's convolutions
    on the CPU and on an H200: the GPU test and test_vae_tiling.py check it). For its kernels cuDNN
    converts a channels-first bf16 input and its output to channels-last, a copy of both: at the decoder's
    widest point (256 channels at full resolution, 0.5 GiB each at 1024²) a whole convolution needs 1 GiB
    beyond its input and output, a strip a strip's worth."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        height = input.shape[-2]
        row_bytes = input[..., :1, :].numel() * input.element_size()
        rows = max(1, STRIP_BYTES // max(row_bytes, 1))
        if rows >= height:
            return super().forward(input)
        reach = self.padding[0]
        out = None
        for top in range(0, height, rows):
            bottom = min(top + rows, height)
            first, last = max(top - reach, 0), min(bottom + reach, height)
            strip = input[..., first:last, :]
            if first > top - reach or last < bottom + reach:  # the image's edge: zeros, as padding gives
                strip = torch.nn.functional.pad(strip, (0, 0, first - top + reach, bottom + reach - last))
            part = torch.nn.functional.conv2d(strip, self.weight, self.bias, 1, (0, self.padding[1]))
            if out is None:
                out = part.new_empty((*part.shape[:-2], height, part.shape[-1]))
            out[..., top:bottom, :] = part
        return out


def strips_fit(conv: torch.nn.Module) -> bool:
    """Whether ``conv`` is a plain Conv2d that can run as a :class:`StripConv2d`: stride and dilation 1, one group (the decoder's
    kind), zero padding that keeps the height."""
    return (
        type(conv) is torch.nn.Conv2d
        and conv.stride == (1, 1)
        and conv.dilation == (1, 1)
        and conv.padding_mode == "zeros"
        and conv.groups == 1
        and isinstance(conv.padding, tuple)
        and 2 * conv.padding[0] == conv.kernel_size[0] - 1
    )


def decode_in_strips(model) -> int:
    """Make every convolution of the decoder that can a :class:`StripConv2d` (the same parameters, in
    place); returns how many."""
    changed = 0
    for module in model.decoder.modules():
        if strips_fit(module):
            module.__class__ = StripConv2d
            changed += 1
    return changed


def decode_in_place(model) -> int:
    """Let the decoder's SiLUs overwrite their input: each follows a GroupNorm whose output nothing else
    reads (diffusers' ResnetBlock2D without a time embedding, and the decoder's ``conv_act``), so the values
    are the same and one image-sized activation fewer is alive at the decoder's widest point (256 channels
    at full resolution: 0.5 GiB at 1024² in bf16). Returns how many."""
    changed = 0
    for module in model.decoder.modules():
        if isinstance(module, torch.nn.SiLU):
            module.inplace = True
            changed += 1
    return changed


def use_tiles(tiling: str, samples: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """``auto`` tiles when the untiled decode would not fit in the device's free memory."""
    if tiling != "auto":
        return tiling == "on"
    if not measure.cuda_in_use(device):
        return False
    return estimates.vae_untiled_bytes(samples, dtype) > measure.device_room(device)


def decode(
    settings: DecoderSettings,
    samples: torch.Tensor,
    report: measure.MemoryReport | None = None,
    on_progress: ProgressCallback | None = None,
) -> torch.Tensor:
    """Decode raw-VAE-space latents ``[B, 4, h, w]`` to images ``[B, 8h, 8w, 3]`` float32 in 0..1 on the CPU.

    ``on_progress(done, total, None)`` is called when the VAE is ready (loaded or kept) and when it has
    decoded."""
    check_latents(samples)
    tile = (
        settings.tile_size if use_tiles(settings.tiling, samples, settings.dtype, settings.device) else None
    )
    with measure.stage("vae_decode", settings.device, report, settings.out_of_memory_advice()):
        return _decode(settings, samples, tile, on_progress)


def _decode(
    settings: DecoderSettings, samples: torch.Tensor, tile: int | None, on_progress: ProgressCallback | None
) -> torch.Tensor:
    # Its own frame: once it has returned or raised, nothing here keeps the VAE alive.
    device = settings.device
    work = Workload.of(samples, tile)
    room = settings.device_bytes(work)
    with cache.use(
        settings.cache_key(work), lambda: _load(settings), settings.keep_loaded, device, *room
    ) as vae:
        if on_progress is not None:
            on_progress(1, 2, None)
        # A kept VAE may come back from a tiled run: set its mode every time.
        vae.use_tiling = tile is not None
        if tile is not None:
            vae.tile_sample_min_size, vae.tile_latent_min_size = tile, tile // 8
        decoded = vae.decode(samples.to(device, settings.dtype), return_dict=False)[0]
        if on_progress is not None:
            on_progress(2, 2, None)
    return (decoded.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()
