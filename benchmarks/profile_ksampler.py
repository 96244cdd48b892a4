"""Where a later KSampler prompt's time goes, step by step: torch's profiler over core's sampling
(``comfy.sample.sample``, what KSampler runs) with ComfyUI as a library in this process, on the pack's int8
MODEL and on ComfyUI's own fp16 MODEL of the same weights (the full-size architecture with random weights,
1024², 20 steps, cfg 4.5, dpmpp_2m/normal, random conditioning: a 24-token prompt, a 1-token negative).

Configurations (``--only NAME``, repeatable; all by default):

- ``pack MODEL``: the PixArt-Σ int8 Model Loader's MODEL (batched guidance, its default);
- ``pack MODEL, two passes``: the same without its batched guidance (ComfyUI's own batching);
- ``pack MODEL + LoRA 1`` / ``pack MODEL + LoRA 0``: a rank-16 LoRA on every attention and feed-forward
  layer through core's LoRA loading (``comfy.sd.load_lora_for_models``, what LoraLoaderModelOnly runs), at
  strength 1 and 0 (LoraLoaderModelOnly hands the MODEL on unchanged at 0, so this is ``pack MODEL`` again
  through the loader's path);
- ``core fp16`` / ``core fp16 + Batched Guidance``: ComfyUI's own PixArt-Σ
  (``comfy.sd.load_diffusion_model_state_dict``, what Load Diffusion Model runs), without and with the pack's
  patch node.

Each configuration: prompts 1–2 unprofiled (loading, first-call costs), then prompt 3 under
``torch.profiler`` with one ``record_function`` range per forward (``forward``); each forward and each step
(the sampler's callback) is also timed on the wall clock, synchronized, so a step's time splits into its
forwards and what ComfyUI does around them (the synchronizations are the script's, on top of ComfyUI's). The 6th-prompt
check is here too: prompt 4 repeats prompt 1's seed and conditioning; ``same_as_first`` says whether its
latents equal prompt 1's bit for bit (``digest`` per prompt).

Writes to ``--out``: ``profile_ksampler.json`` (per configuration: seconds per prompt, the profiled prompt's
per-step wall time, time in forwards and between them, forwards per step, the 6th-prompt check) and
``profile_ksampler.md`` (the same as tables, then each configuration's top operators by self CUDA and by CPU
time), and ``<configuration>.trace.json`` (a Chrome trace of the profiled prompt: chrome://tracing or
Perfetto).

On the GPU machine (ComfyUI v0.33.0 checkout and its requirements, the pack's requirements; the random
model is built in --model-dir when missing, about 15 s on an H200)::

    python benchmarks/profile_ksampler.py --comfyui ComfyUI --model-dir pixart-full --out DIR [--dynamic-vram]

``--dynamic-vram`` starts comfy-aimdo as ComfyUI's main.py does (its server default on NVIDIA), as
benchmarks/model_lora.py does. On a CPU machine ``--preset tiny --size 272 --steps 3`` checks the script
(no CUDA times).
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model_lora import arguments, comfy_modules, ksampler_settings, random_embeds  # noqa: E402

CONFIGS = (
    "pack MODEL",
    "pack MODEL, two passes",
    "pack MODEL + LoRA 1",
    "pack MODEL + LoRA 0",
    "core fp16",
    "core fp16 + Batched Guidance",
)
PROMPTS = 4  # the 3rd is profiled; the 4th repeats the 1st
PROFILED = 2


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().flatten().view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()[:16]


class Steps:
    """``model_function_wrapper``: each forward timed and named for the profiler; the steps from the
    sampler's callback."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.forwards: list[tuple[int, float, float, int]] = []  # (step, start, end, batch)
        self.step_starts: list[float] = []

    def begin(self):
        self.step_starts = [time.perf_counter()]

    def callback(self, *_args):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.step_starts.append(time.perf_counter())

    def __call__(self, apply_model, args):
        step = len(self.step_starts) - 1
        cuda = torch.cuda.is_available()
        with torch.profiler.record_function("forward"):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = apply_model(args["input"], args["timestep"], **args["c"])
            if cuda:
                torch.cuda.synchronize()
        self.forwards.append((step, start, time.perf_counter(), args["input"].shape[0]))
        return out

    def summary(self) -> dict:
        starts = self.step_starts
        steps = []
        for index in range(len(starts) - 1):
            mine = [f for f in self.forwards if f[0] == index]
            wall = starts[index + 1] - starts[index]
            inside = sum(end - start for _s, start, end, _b in mine)
            steps.append(
                {
                    "wall": wall,
                    "forwards": inside,
                    "between": wall - inside,
                    "batches": [b for *_x, b in mine],
                }
            )
        return {
            "steps": steps,
            "step_wall_mean": sum(s["wall"] for s in steps) / max(len(steps), 1),
            "forward_mean": sum(s["forwards"] for s in steps) / max(len(steps), 1),
            "between_mean": sum(s["between"] for s in steps) / max(len(steps), 1),
            "forwards_per_step": [len(s["batches"]) for s in steps],
        }


def run_config(name, model, comfy, args, embeds, out: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    from pixart_lowvram.core import conditioning

    steps = Steps()
    model = model.clone()
    model.set_model_unet_function_wrapper(steps)
    latent = torch.zeros(1, 4, args.size // 8, args.size // 8)
    seconds, digests, profiled = [], [], None
    cuda = torch.cuda.is_available()
    for index in range(PROMPTS):
        which = 0 if index == PROMPTS - 1 else index  # the last repeats the first
        positive, negative = conditioning.core_conditioning(embeds[which])
        noise = comfy.sample.prepare_noise(latent, 1000 + which)
        steps.reset()

        def sample(noise=noise, positive=positive, negative=negative, which=which):
            steps.begin()
            return comfy.sample.sample(
                model,
                noise,
                args.steps,
                args.cfg,
                "dpmpp_2m",
                "normal",
                positive,
                negative,
                latent,
                denoise=1.0,
                seed=1000 + which,
                callback=lambda *_step: steps.callback(),
            )

        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if index == PROFILED:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities, record_shapes=False) as prof, record_function("prompt"):
                latents = sample()
            profiled = prof
            timing = steps.summary()
        else:
            latents = sample()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        digests.append(digest(latents))
    trace = out / (slug(name) + ".trace.json")
    profiled.export_chrome_trace(str(trace))
    averages = profiled.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    tables = averages.table(sort_by=sort, row_limit=25) + "\n\n"
    tables += averages.table(sort_by="cpu_time_total", row_limit=25)
    row = {
        "name": name,
        "seconds": seconds,
        "profiled_seconds": seconds[PROFILED],
        "digests": digests,
        "same_as_first": digests[-1] == digests[0],
        **timing,
        "tables": tables,
        "trace": trace.name,
    }
    print(
        f"{name}: prompt 3 {seconds[PROFILED]:.3f} s (under the profiler), step {timing['step_wall_mean'] * 1e3:.1f} ms "
        f"= forwards {timing['forward_mean'] * 1e3:.1f} + between {timing['between_mean'] * 1e3:.1f}; "
        f"forwards/step {timing['forwards_per_step'][:3]}; 4th = 1st: {row['same_as_first']}",
        flush=True,
    )
    return row


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cfg", type=float, default=4.5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--only", action="append", default=[], choices=CONFIGS)
    args = parser.parse_args()

    comfy, int8_model = comfy_modules(args.comfyui, args.dynamic_vram)
    import importlib

    batched_guidance = importlib.import_module("pixart_lowvram.nodes.batched_guidance")
    guidance = importlib.import_module("pixart_lowvram.nodes.int8_model.guidance")

    args.out.mkdir(parents=True, exist_ok=True)
    device, lora_path, settings = ksampler_settings(args, cfg=args.cfg)
    embeds = [random_embeds(i, settings.caption_channels) for i in range(PROMPTS)]
    wanted = args.only or list(CONFIGS)
    rows = []

    def two_passes(model):
        plain = model.clone()
        plain.model_options.pop(guidance.KEY, None)
        return plain

    if any(name.startswith("pack") for name in wanted):
        pack = int8_model.load(settings.transformer, settings.keep_loaded)
        lora_state = comfy.utils.load_torch_file(str(lora_path), safe_load=True)
        models = {
            "pack MODEL": lambda: pack,
            "pack MODEL, two passes": lambda: two_passes(pack),
            "pack MODEL + LoRA 1": lambda: comfy.sd.load_lora_for_models(pack, None, lora_state, 1.0, 0)[0],
            # LoraLoaderModelOnly at strength 0 hands its MODEL on unchanged (nodes.LoraLoader.load_lora).
            "pack MODEL + LoRA 0": lambda: pack,
        }
        for name in [n for n in wanted if n in models]:
            rows.append(run_config(name, models[name](), comfy, args, embeds, args.out))
        del pack
        comfy.model_management.unload_all_models()
        comfy.model_management.soft_empty_cache()
    if any(name.startswith("core") for name in wanted):
        from safetensors.torch import load_file

        state = load_file(args.model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
        core = comfy.sd.load_diffusion_model_state_dict(state)
        models = {
            "core fp16": lambda: core,
            "core fp16 + Batched Guidance": lambda: batched_guidance.PixArtBatchedGuidance.execute(
                core
            ).result[0],
        }
        for name in [n for n in wanted if n in models]:
            rows.append(run_config(name, models[name](), comfy, args, embeds, args.out))

    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "dynamic_vram": args.dynamic_vram,
        "size": args.size,
        "steps": args.steps,
        "cfg": args.cfg,
        "rank": args.rank,
        "rows": [{k: v for k, v in row.items() if k != "tables"} for row in rows],
    }
    (args.out / "profile_ksampler.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# KSampler step by step ({result['device']}, torch {result['torch']}, {args.size}², {args.steps} steps, "
        f"cfg {args.cfg}, Dynamic VRAM {'on' if args.dynamic_vram else 'off'})",
        "",
        "| configuration | prompt 3 (profiled) | step | in forwards | between forwards | forwards a step | 4th = 1st |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']} | {row['profiled_seconds']:.3f} s | {row['step_wall_mean'] * 1e3:.1f} ms | "
            f"{row['forward_mean'] * 1e3:.1f} ms | {row['between_mean'] * 1e3:.1f} ms | "
            f"{max(row['forwards_per_step'], default=0)} | {'yes' if row['same_as_first'] else '**no**'} |"
        )
    for row in rows:
        lines += ["", f"## {row['name']}", "", "```", row["tables"], "```"]
    (args.out / "profile_ksampler.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: 4 + len(rows)]))


if __name__ == "__main__":
    main()
