"""What a new conditioning length costs on the GPU: cuDNN's attention builds an execution plan for each
new shape it meets. Two parts, in one process with ComfyUI as a library:

1. One cross-attention call (batch 2, 16 heads, 4096 queries of 72, fp16, in torch's own order for the GPU:
   ``core.devices.attention_order``) for key lengths met for the first time, then again: the first call
   and the second, synchronized.
2. KSampler's sampling on the pack's int8 MODEL, kept loaded (1024², 20 steps, cfg 4.5, dpmpp_2m/normal),
   random conditioning of a given token count (the negative one token): prompts of one length, then of
   lengths met for the first time, then of lengths seen before.

    python benchmarks/attention_shapes.py --comfyui ComfyUI --model-dir pixart-full --out DIR [--dynamic-vram]

Writes attention_shapes.json to --out. GPU only.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model_lora import arguments, comfy_modules, ksample, model_here  # noqa: E402

KEY_LENGTHS = (24, 7, 13, 31, 45, 60, 77, 120, 300, 13, 24)
PROMPT_LENGTHS = (
    ("first two (loading)", (24, 24)),
    ("one length", (24,) * 5),
    ("new lengths", (17, 29, 41, 53, 23)),
    ("one length again", (24,) * 3),
    ("lengths seen before", (17, 29, 41)),
)


def timed_ms(function) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def embeds_of(seed: int, tokens: int, width: int):
    from pixart_lowvram.core.contract import PixArtEmbeds

    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randn(1, 300, width, generator=generator) * 0.2
    negative = torch.randn(1, 300, width, generator=generator) * 0.2
    mask, negative_mask = torch.zeros(1, 300, dtype=torch.long), torch.zeros(1, 300, dtype=torch.long)
    mask[:, :tokens], negative_mask[:, :1] = 1, 1
    return PixArtEmbeds(prompt, mask, negative, negative_mask, "random", "none", torch.float16)


def main() -> None:
    args = arguments(__doc__).parse_args()
    comfy, int8_model = comfy_modules(args.comfyui, args.dynamic_vram)

    from pixart_lowvram.core import sampler
    from pixart_lowvram.core.devices import attention_order
    from pixart_lowvram.core.models import resolve_model

    device = model_here(args.model_dir, args.preset)
    if device != "cuda":
        raise SystemExit("attention_shapes.py measures cuDNN's attention: it needs a CUDA GPU")
    cuda = torch.device("cuda")
    query = torch.randn(2, 16, 4096, 72, device=cuda, dtype=torch.float16)
    calls = []
    with attention_order(cuda):
        for length in KEY_LENGTHS:
            keys = torch.randn(2, 16, length, 72, device=cuda, dtype=torch.float16)
            call = lambda keys=keys: torch.nn.functional.scaled_dot_product_attention(query, keys, keys)  # noqa: E731
            first, second = timed_ms(call), timed_ms(call)
            calls.append({"keys": length, "first_ms": first, "second_ms": second})
            print(f"attention, {length} keys: first {first:.2f} ms, then {second:.3f} ms", flush=True)

    settings = sampler.SamplerSettings(
        resolve_model(str(args.model_dir), []),
        width=1024,
        height=1024,
        steps=20,
        cfg=4.5,
        quantization="qint8",
        device=device,
        quant_cache=args.out / "work" / "quantized",
    )
    model = int8_model.load(dataclasses.replace(settings, keep_loaded=True))
    latent = torch.zeros(1, 4, 128, 128)
    prompts = {}
    for name, lengths in PROMPT_LENGTHS:
        seconds = []
        for index, tokens in enumerate(lengths):
            embeds = embeds_of(index, tokens, settings.caption_channels)

            def run(index=index, embeds=embeds):
                return ksample(comfy, model, 1000 + index, embeds, latent, 20, 4.5)

            seconds.append(timed_ms(run) / 1e3)
        pairs = list(zip(lengths, seconds, strict=True))
        prompts[name] = [{"tokens": t, "seconds": s} for t, s in pairs]
        print(name, [(t, round(s, 3)) for t, s in pairs], flush=True)

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "dynamic_vram": args.dynamic_vram,
        "arguments": {
            "attention": "batch 2, 16 heads, 4096 queries, head 72, fp16",
            "ksampler": "1024², 20 steps, cfg 4.5, dpmpp_2m/normal, MODEL kept loaded, negative 1 token",
        },
        "attention_calls": calls,
        "ksampler_prompts": prompts,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_shapes.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
