"""What a new conditioning length costs on the GPU: cuDNN's attention builds an execution plan for each
new shape it meets. Two parts, in one process with ComfyUI as a library:

1. One cross-attention call (batch 2, 16 heads, 4096 queries of 72, fp16) for key lengths met for the
   first time, then again: the first call and the second, synchronized; in torch's own order for the GPU
   (``core.devices.attention_order``, cuDNN first on Hopper) and in the MODEL's cross-attention order
   (``core.devices.cross_attention_order``, FlashAttention first), each with lengths of its own. Then each
   order's mean call, warm, at 24 keys (the cross-attention) and 4096 (the self-attention at 1024²).
2. KSampler's sampling on the pack's int8 MODEL, kept loaded (1024², 20 steps, cfg 4.5, dpmpp_2m/normal),
   random conditioning of a given token count (the negative one token): prompts of one length, then of
   lengths met for the first time, then of lengths seen before; with the MODEL's cross-attention in
   cuDNN's order first (as before ``cross_attention_order``), then as the code runs it, each arm with new
   lengths of its own.

    python benchmarks/attention_shapes.py --comfyui ComfyUI --model-dir pixart-full --out DIR [--dynamic-vram]

Writes attention_shapes.json to --out. GPU only.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model_lora import arguments, comfy_modules, ksample, model_here  # noqa: E402

# Key lengths for each order (the second order's are new to cuDNN's plans too).
KEY_LENGTHS = {
    "cuDNN first": (24, 7, 13, 31, 45, 60, 77, 120, 300, 13, 24),
    "FlashAttention first": (25, 8, 14, 32, 46, 61, 78, 121, 299, 14, 25),
}
WARM_CALLS = 200
# Each arm's prompts, by token count; the second arm's lengths are new to cuDNN's plans as well.
PROMPT_LENGTHS = {
    "cross-attention cuDNN first (before)": (
        ("first two (loading)", (24, 24)),
        ("one length", (24,) * 4),
        ("new lengths", (17, 29, 41, 53, 23)),
        ("lengths seen before", (17, 29, 41)),
    ),
    "cross-attention FlashAttention first (the code)": (
        ("first two", (26, 26)),
        ("one length", (26,) * 4),
        ("new lengths", (18, 30, 42, 54, 22)),
        ("lengths seen before", (18, 30, 42)),
    ),
}


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

    from pixart_lowvram.core import devices, sampler
    from pixart_lowvram.core.devices import attention_order, cross_attention_order
    from pixart_lowvram.core.models import resolve_model

    device = model_here(args.model_dir, args.preset)
    if device != "cuda":
        raise SystemExit("attention_shapes.py measures cuDNN's attention: it needs a CUDA GPU")
    cuda = torch.device("cuda")
    query = torch.randn(2, 16, 4096, 72, device=cuda, dtype=torch.float16)
    orders = {"cuDNN first": attention_order, "FlashAttention first": cross_attention_order}
    calls, warm = [], {}
    with attention_order(cuda):
        for order, lengths in KEY_LENGTHS.items():
            for length in lengths:
                keys = torch.randn(2, 16, length, 72, device=cuda, dtype=torch.float16)

                def call(keys=keys, order=order):
                    with orders[order](cuda):
                        torch.nn.functional.scaled_dot_product_attention(query, keys, keys)

                first, second = timed_ms(call), timed_ms(call)
                calls.append({"order": order, "keys": length, "first_ms": first, "second_ms": second})
                print(f"{order}, {length} keys: first {first:.2f} ms, then {second:.3f} ms", flush=True)
        for order, context in orders.items():
            for length in (24, 4096):
                keys = torch.randn(2, 16, length, 72, device=cuda, dtype=torch.float16)

                def calls_of(keys=keys, context=context):
                    for _ in range(WARM_CALLS):
                        with context(cuda):
                            torch.nn.functional.scaled_dot_product_attention(query, keys, keys)

                calls_of()
                warm[f"{order}, {length} keys"] = timed_ms(calls_of) / WARM_CALLS
                print(
                    f"{order}, {length} keys, warm: {warm[f'{order}, {length} keys']:.4f} ms a call",
                    flush=True,
                )

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
    model = int8_model.load(settings.transformer, keep_loaded=True)
    latent = torch.zeros(1, 4, 128, 128)
    prompts = {}
    short_keys = devices.SHORT_KEYS_FIRST
    for arm, sets in PROMPT_LENGTHS.items():
        devices.SHORT_KEYS_FIRST = devices.CUDNN_FIRST if "before" in arm else short_keys
        prompts[arm] = {}
        for name, lengths in sets:
            seconds = []
            for index, tokens in enumerate(lengths):
                embeds = embeds_of(index, tokens, settings.caption_channels)

                def run(index=index, embeds=embeds):
                    return ksample(comfy, model, 1000 + index, embeds, latent, 20, 4.5)

                seconds.append(timed_ms(run) / 1e3)
            pairs = list(zip(lengths, seconds, strict=True))
            prompts[arm][name] = [{"tokens": t, "seconds": s} for t, s in pairs]
            print(arm, name, [(t, round(s, 3)) for t, s in pairs], flush=True)
    devices.SHORT_KEYS_FIRST = short_keys

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "dynamic_vram": args.dynamic_vram,
        "arguments": {
            "attention": "batch 2, 16 heads, 4096 queries, head 72, fp16",
            "attention_warm": f"the mean of {WARM_CALLS} calls after as many, the order's context entered for each",
            "ksampler": "1024², 20 steps, cfg 4.5, dpmpp_2m/normal, MODEL kept loaded, negative 1 token",
        },
        "attention_calls": calls,
        "attention_warm_ms": warm,
        "ksampler_prompts": prompts,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_shapes.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
