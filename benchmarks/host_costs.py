"""Where a later KSampler prompt on the pack's int8 MODEL spends the host's time, as the bundled LoRA +
KSampler workflow runs it (``keep_loaded`` off, a rank-16 LoRA at strength 1): Python's own profiler over
one whole prompt (ComfyUI's load, the sampling loop, the unload), and torch's profiler over another with the
Python stack of every call that makes the host wait for the GPU (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, a copy to or from pageable memory). In one process with ComfyUI as a library (the
full-size architecture with random weights, 1024², 20 steps, cfg 4.5, dpmpp_2m/normal as KSampler runs it).

    python benchmarks/host_costs.py --comfyui ComfyUI --model-dir pixart-full --out DIR [--dynamic-vram]

On a CPU machine ``--preset tiny-core --size 272 --steps 3`` checks the script. Writes host_costs.json
(seconds per prompt, the waits with their stacks) and host_costs_profile.txt (cProfile by own and by
cumulative time) to --out.
"""

from __future__ import annotations

import cProfile
import io
import json
import platform
import pstats
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model_lora import arguments, comfy_modules, ksample, ksampler_settings, random_embeds  # noqa: E402

# torch profiler's names of the host-side calls that wait for the device.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy ", "cudaEventSynchronize")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--prompts", type=int, default=3, help="unprofiled prompts before the profiled ones")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--keep-loaded", action="store_true")
    args = parser.parse_args()

    comfy, int8_model = comfy_modules(args.comfyui, args.dynamic_vram)

    device, lora_path, settings = ksampler_settings(args, keep_loaded=args.keep_loaded)
    lora_state = comfy.utils.load_torch_file(str(lora_path), safe_load=True)
    model = int8_model.load(settings.transformer, settings.keep_loaded)
    model, _ = comfy.sd.load_lora_for_models(model, None, lora_state, 1.0, 0)
    latent = torch.zeros(1, 4, args.size // 8, args.size // 8)
    embeds = [random_embeds(i, settings.caption_channels) for i in range(args.prompts + 3)]

    def prompt(index: int) -> float:
        sync()
        start = time.perf_counter()
        ksample(comfy, model, 1000 + index, embeds[index], latent, args.steps, 4.5)
        sync()
        return time.perf_counter() - start

    seconds = [prompt(i) for i in range(args.prompts)]
    print("prompts", [round(s, 3) for s in seconds], flush=True)

    profile = cProfile.Profile()
    profile.enable()
    profiled = prompt(args.prompts)
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    text.write(f"cProfile over prompt {args.prompts + 1}: {profiled:.3f} s\n\nBy own time\n")
    stats.sort_stats("tottime").print_stats(45)
    text.write("\nBy cumulative time\n")
    stats.sort_stats("cumulative").print_stats(70)

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities, with_stack=True) as prof:
        traced = prompt(args.prompts + 1)
    waits = []
    for event in prof.key_averages(group_by_stack_n=12):
        if any(event.key.startswith(name) for name in WAITS):
            waits.append(
                {
                    "name": event.key,
                    "calls": event.count,
                    "cpu_ms": event.cpu_time_total / 1e3,
                    "stack": list(event.stack),
                }
            )
    waits.sort(key=lambda w: -w["calls"])
    untraced = prompt(args.prompts + 2)

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "patcher": type(model).__name__,
        "dynamic_vram": args.dynamic_vram,
        "arguments": {
            "size": args.size,
            "steps": args.steps,
            "cfg": 4.5,
            "rank": args.rank,
            "lora_strength": 1.0,
            "keep_loaded": args.keep_loaded,
            "sampler": "dpmpp_2m/normal",
        },
        "seconds": seconds,
        "cprofiled_seconds": profiled,
        "torch_profiled_seconds": traced,
        "after_seconds": untraced,
        "waits": waits,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_costs.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "host_costs_profile.txt").write_text(text.getvalue())
    for wait in waits[:25]:
        print(wait["calls"], wait["name"], round(wait["cpu_ms"], 2), " <- ".join(wait["stack"][:6]))
    print(text.getvalue()[:3000])


if __name__ == "__main__":
    main()
