"""One PixArt-Σ forward at batch 2 (a guidance batch, 1024², the conditioning 24 tokens long), the same
quantized weights held expanded, four ways: the pack's int8 MODEL as KSampler calls it (diffusers' blocks
over the MODEL's layers, its forward since 2026-12-03), ComfyUI's PixArt forward on the same MODEL, the same
with ComfyUI's attention backend order put cuDNN first, and
diffusers' transformer (the Quanto PixArt Sampler's, called as its pipeline calls it, the conditioning
padded to 300 tokens and masked). Each: wall time per forward (synchronized, after warm-up), CUDA time
per forward from torch's profiler, split into attention, matrix products and the rest, and the top
kernels.

On the GPU machine (see benchmarks/profile_ksampler.py for the set-up)::

    python benchmarks/pixart_forwards.py --comfyui ComfyUI --model-dir pixart-full --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model_lora import comfy_modules  # noqa: E402

TOKENS = 24
REPEATS = 10


def kind(name: str) -> str:
    low = name.lower()
    if "attention" in low or "flash" in low or "sdpa" in low or "fmha" in low:
        return "attention"
    if "gemm" in low or "nvjet" in low or "cutlass" in low or "sm90_xmma" in low:
        return "matrix products"
    return "other"


def timed(name: str, forward, out: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    walls = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        forward()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(REPEATS):
            forward()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
            kernels[event.key] = kernels.get(event.key, 0.0) + event.self_device_time_total / 1e3 / REPEATS
    kinds: dict[str, float] = {}
    for key, ms in kernels.items():
        kinds[kind(key)] = kinds.get(kind(key), 0.0) + ms
    launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx"))
    row = {
        "name": name,
        "wall_ms": sorted(walls)[len(walls) // 2] * 1e3,
        "cuda_ms": sum(kernels.values()),
        "ms_by_kind": {k: round(v, 3) for k, v in sorted(kinds.items())},
        "launches_per_forward": launches / REPEATS,
        "top_kernels": sorted(((k[:90], round(v, 3)) for k, v in kernels.items()), key=lambda kv: -kv[1])[
            :12
        ],
    }
    print(
        f"{name}: wall {row['wall_ms']:.1f} ms, CUDA {row['cuda_ms']:.1f} ms {row['ms_by_kind']}, "
        f"{row['launches_per_forward']:.0f} launches",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", type=int, default=1024)
    args = parser.parse_args()

    comfy, int8_model = comfy_modules(args.comfyui, False)
    from pixart_lowvram.core import sampler
    from pixart_lowvram.core.models import resolve_model
    from pixart_lowvram.core.quant import quanto
    from pixart_lowvram.core.transformer import quantized_transformer

    device = torch.device("cuda")
    settings = sampler.SamplerSettings(
        resolve_model(str(args.model_dir), []),
        width=args.size,
        height=args.size,
        quantization="qint8",
        device="cuda",
        quant_cache=args.out / "work" / "quantized",
    )
    side = args.size // 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, side, side, generator=g).to(device, torch.float16)
    t = torch.tensor([500.0, 500.0], device=device)  # diffusers' timestep
    sigma = torch.tensor([1.0, 1.0], device=device)  # ComfyUI's apply_model takes a sigma
    context = (torch.randn(2, TOKENS, settings.caption_channels, generator=g) * 0.2).to(device, torch.float16)
    rows = []

    transformer = quantized_transformer(settings.transformer).to(device)
    quanto.hold_dense(transformer, device)
    padded = torch.zeros(2, 300, settings.caption_channels, device=device, dtype=torch.float16)
    padded[:, :TOKENS] = context
    mask = torch.zeros(2, 300, device=device, dtype=torch.long)
    mask[:, :TOKENS] = 1
    added = {"resolution": None, "aspect_ratio": None}

    def diffusers_forward():
        with torch.no_grad():
            return transformer(
                x,
                encoder_hidden_states=padded,
                encoder_attention_mask=mask,
                timestep=t,
                added_cond_kwargs=added,
                return_dict=False,
            )[0]

    priorities = {"at the start": torch._C._get_sdp_priority_order()}
    rows.append(timed("diffusers' PixArt (pack sampler)", diffusers_forward, args.out))
    quanto.drop_dense(transformer)
    transformer.cpu()
    patcher = int8_model.load(settings.transformer, settings.keep_loaded)
    comfy.model_management.load_models_gpu([patcher])
    model = patcher.model
    quanto.hold_dense(model.diffusion_model, device)

    def comfy_forward():
        with torch.no_grad():
            return model.apply_model(x, sigma, c_crossattn=context)

    # The MODEL's own forward (diffusers' blocks over its layers: the object patch ComfyUI set as it loaded
    # it), then ComfyUI's PixArt forward on the same layers (the patch's attribute taken off for the rows).
    pack = model.diffusion_model.__dict__.pop("forward_orig")
    model.diffusion_model.forward_orig = pack
    rows.append(timed("pack MODEL: diffusers' blocks over its layers", comfy_forward, args.out))
    del model.diffusion_model.forward_orig
    rows.append(timed("ComfyUI's PixArt (pack MODEL)", comfy_forward, args.out))
    order = getattr(comfy.ops, "SDPA_BACKEND_PRIORITY", None)
    if order is not None:
        from torch.nn.attention import SDPBackend

        comfy.ops.SDPA_BACKEND_PRIORITY = [SDPBackend.CUDNN_ATTENTION] + [
            b for b in order if b != SDPBackend.CUDNN_ATTENTION
        ]
        rows.append(timed("ComfyUI's PixArt, cuDNN attention first", comfy_forward, args.out))
        comfy.ops.SDPA_BACKEND_PRIORITY = order
    model.diffusion_model.forward_orig = pack
    quanto.drop_dense(model.diffusion_model)
    model = patcher = None
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()

    transformer.to(device)
    quanto.hold_dense(transformer, device)
    rows.append(
        timed("diffusers' PixArt (pack sampler), after ComfyUI's attention ran", diffusers_forward, args.out)
    )
    priorities["after ComfyUI's forwards"] = torch._C._get_sdp_priority_order()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "size": args.size,
        "rows": rows,
        "sdp_priority_order": priorities,
    }
    (args.out / "pixart_forwards.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
