"""Per prompt, from the first on: five prompts, each with its own text and seed, in one process per
configuration, and the same through a running ComfyUI server.

The anchor is diffusers' PixArtSigmaPipeline in fp16 with everything already on the GPU (loading it is not
timed); every other row is given as a ratio to the anchor's later prompts, measured in the same run. In one
process (``--model-dir``, the full-size model: ``python -m pixart_lowvram demo --preset full --model-dir
pixart-full --device cuda --steps 2``):

- ``anchor``: the pipeline, latents, then its VAE decode;
- ``pack defaults``: encode (T5 nf4), sample (qint8), decode, as the library runs them (the host-memory
  pool on, so later prompts load nothing from disk), with PyTorch's expandable segments as the command line
  asks for them (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``); ``pack defaults, PyTorch's default
  segments``: the same without them (what the caching allocator reserves beyond what is allocated);
  ``pack defaults, 3.0 GiB cap``: with the allocator capped at 3.0 GiB
  (``torch.cuda.set_per_process_memory_fraction``);
- ``pack fast``: the sampler's compiled path;
- ``pack step_cache T``: the sampler's First Block Cache at threshold T (lossy), with its fidelity against
  ``pack defaults`` prompt by prompt (latent cosine, image PSNR);
- ``pack low-VRAM, 1.0 GiB cap``: low_vram on every stage, tiled decode, allocator capped at 1.0 GiB; and
  ``pack low-VRAM + fast``, the same with the compiled sampler (every row but one with expandable segments);
- ``ComfyUI core, card told 8 GB`` (with ``--comfyui``): core's own PixArt-Σ nodes as a library, its
  memory manager told the card has 8 GB (benchmarks/comfyui_path.py's ``simulate_card``), the loaded models
  kept referenced between prompts as a server's node cache keeps them.

Through a server (with ``--comfyui``; a fresh server each, same prompts and seeds), each bundled workflow as
shipped (its Memory Snapshot node included, which only reports unless asked for the allocator history):
``server: pack defaults`` (the bundled basic workflow), ``server: pack defaults, no Memory Snapshot`` (the
snapshot's cost is the difference), ``server: pack fast`` (its sampler's fast on), ``server: pack fast +
step_cache 0.1``, ``server: pack low-VRAM`` (the bundled low-VRAM workflow) and ``server: pack keep_loaded``
(the basic workflow, every model kept); ``server: pack int8 MODEL, core KSampler`` (the bundled LoRA workflow
without its LoRA loader); ``server: LoRA + KSampler, strength 1`` and ``…, strength 0`` (the bundled LoRA
workflow as shipped, a random rank-16 LoRA on every attention and feed-forward layer written into the
server's models/loras) and ``…, strength 1, MODEL kept`` (the same with the int8 Model Loader's keep_loaded
on); ``server: ComfyUI core fp16 + Batched Guidance`` (core's graph below with the pack's
patch node before KSampler); ``server: ComfyUI core fp16``
(core's own graph: CLIPLoader T5-XXL fp16, UNETLoader, KSampler dpmpp_2m, VAELoader, VAEDecode, SaveImage,
on the single files of the same weights) with the server's defaults and with ``--disable-dynamic-vram``.
Every server row also records the card's used memory during each prompt (``cudaMemGetInfo``, what NVML
reads: all processes, this client's CUDA context included). The server runs with ComfyUI's own defaults (its allocator choice included); each stage's seconds and
GPU peaks come from the pack's log line for it in the server's log, and the prompt's from its stages.
``$COMFYUI_EXTRA_ARGS`` goes on the server's command line (e.g. ``--disable-api-nodes --front-end-root
DIR`` where ComfyUI's front-end and API-node packages are not installed).

Per prompt: seconds (wall clock, the stages or the HTTP round trip) and each stage's seconds and peaks,
GPU peak allocated and reserved (in one process; reset at each prompt's start), host RSS after the prompt (the server's whole process tree), bytes
the pack copied from CPU memory to the GPU (``core.streaming.copied_to_device``: models moved back from host
memory and streamed blocks; reads from disk are not counted), and what the pack's host-memory pool holds.
For the anchor also the seconds its image takes to write as ComfyUI's SaveImage writes it (PNG, compress
level 4; not in its seconds), the server rows' share of that. A sixth prompt repeats the first's text and seed: its image must equal the first's bit for bit (digests of
each prompt's embeddings and latents say which stage differs when it does). ``--profile DIR`` writes torch
profiler tables of the third prompt of each configuration; for a server row, of the server's own prompt
worker (``benchmarks/prompt_profiler``): cProfile's tables of its third prompt and torch's of its fourth.
``--phases DIR``: each server prompt's nodes, model loads and unloads and transformer forwards timed in the
server (host seconds, and GPU seconds and idle time from CUDA events), one JSON line a prompt. Every server
prompt also records the host during it (``host``: the share of the machine's CPU time stolen by the
hypervisor and busy, and the server process's CPU seconds, from /proc), a gauge of the host's speed.

    python benchmarks/warm.py --model-dir pixart-full --comfyui /path/to/ComfyUI --out benchmarks/results

Writes warm.json and warm.md to --out (``--stem NAME``: NAME.json and NAME.md).

The server rows of issue 27, on the GPU machine (ComfyUI v0.33.0 and its requirements, websocket-client;
the full-size random model in pixart-full)::

    COMFYUI_EXTRA_ARGS="--disable-api-nodes --front-end-root EMPTY_DIR" python benchmarks/warm.py \
        --model-dir pixart-full --comfyui ComfyUI --out benchmarks/results --stem warm_server \
        --only "server: pack defaults, no Memory Snapshot" --only "server: LoRA + KSampler, strength 1" \
        --only "server: LoRA + KSampler, strength 0" --only "server: ComfyUI core fp16" \
        --only "server: ComfyUI core fp16 + Batched Guidance"

``--laps N``: each server row runs prompts 2–5 again N − 1 times after the six (its later prompts are all
but the first and the repeat), and every further lap's image must equal its first lap's. ``--interleave``:
the server rows side by side, all their servers up at once and each prompt on each server in turn (the
order rotated by one each prompt), so that every row meets the same host periods, with each row compared
prompt by prompt against the first (and the patched core row against core's own); the card's used memory
is not told apart per server there. ``--until SECONDS``: the server rows stop after their last whole lap
that ends within SECONDS of the command's start (a run under a time limit keeps whole laps).

``--cpu-check`` runs server rows on a CPU server (272², 2 steps; core's graph takes the pack's T5 encode and
VAE decode there, since CLIPLoader and VAELoader build full-size models) to check that they run, e.g. with
the smallest model core loads (``build_random_pixart(DIR, "tiny-core")``): the same ``--only`` list with
``--model-dir DIR --comfyui ComfyUI --out OUT --cpu-check``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

GIB = 2**30
SETTINGS = {"width": 1024, "height": 1024, "steps": 20, "cfg": 4.5}
PROMPTS = [
    ("a photo of a red cat sitting in a sunlit garden, detailed fur", 0),
    ("a lighthouse on a rocky coast at dusk, waves, long exposure", 1),
    ("a bowl of ramen with a soft egg, studio lighting, top view", 2),
    ("an astronaut riding a horse across a desert, cinematic", 3),
    ("a watercolour painting of a snowy mountain village", 4),
]
REPEAT = PROMPTS[0]  # the sixth prompt: the first's text and seed again
REPEAT_INDEX = len(PROMPTS)
LAP = len(PROMPTS) - 1  # the prompts of each lap past the first: 2–5


def sequence(laps: int = 1) -> list[tuple[str, int]]:
    """The prompts a row runs: the five, the first again, then for each lap past the first prompts 2–5
    again (each lap's prompt follows a different one, so ComfyUI's cache of the last prompt reruns it)."""
    return [*PROMPTS, REPEAT] + PROMPTS[1:] * (laps - 1)


def laps_by(laps: int, until: float | None = None):
    """``enumerate(sequence(laps))``, but where ``until`` (a ``time.time()``) is given a lap past the first
    starts only where, at the pace so far, it ends by then: a run with a time limit keeps whole laps."""
    began = time.time()
    for index, item in enumerate(sequence(laps)):
        if until and index > REPEAT_INDEX and (index - REPEAT_INDEX - 1) % LAP == 0:
            pace = (time.time() - began) / index
            if time.time() + pace * LAP > until:
                return
        yield index, item


def later_records(records: list[dict]) -> list[dict]:
    """A row's later prompts: 2–5 and every further lap's (not the first, not the repeat)."""
    return records[1:REPEAT_INDEX] + records[REPEAT_INDEX + 1 :]


LORA_FILE = "random_rank16_lora.safetensors"  # the LoRA rows' LoRA, written into the server's models/loras
# --cpu-check: the server rows on a CPU server with a small model, at this size and these steps.
CPU_CHECK = {"width": 272, "height": 272, "steps": 2}
STEP_CACHE = (0.05, 0.1, 0.2)  # the sampler's step_cache thresholds measured

# PyTorch's expandable segments, as the command line asks for them (core.measure.prefer_expandable_segments).
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
CONFIGS: dict[str, dict] = {
    "anchor: diffusers fp16, all on the GPU": {"kind": "anchor"},
    "pack defaults": {"kind": "pack", "env": EXPANDABLE},
    "pack defaults, PyTorch's default segments": {"kind": "pack"},
    "pack defaults, 3.0 GiB cap": {"kind": "pack", "cap_gib": 3.0, "env": EXPANDABLE},
    "pack fast": {"kind": "pack", "fast": True, "env": EXPANDABLE},
    **{
        f"pack step_cache {threshold:g}": {
            "kind": "pack",
            "step_cache": threshold,
            "env": EXPANDABLE,
            "fidelity_vs": "pack defaults",
        }
        for threshold in STEP_CACHE
    },
    # The sampler's 8-bit compute paths (benchmarks/compute.py measures the stage alone), with their
    # fidelity against the fp16 compute of the defaults.
    **{
        f"pack compute {compute}": {
            "kind": "pack",
            "compute": compute,
            "env": EXPANDABLE,
            "fidelity_vs": "pack defaults",
        }
        for compute in ("int8", "fp8")
    },
    "pack low-VRAM, 1.0 GiB cap": {"kind": "pack", "low_vram": True, "cap_gib": 1.0, "env": EXPANDABLE},
    "pack low-VRAM + fast, 1.0 GiB cap": {
        "kind": "pack",
        "low_vram": True,
        "fast": True,
        "cap_gib": 1.0,
        "env": EXPANDABLE,
    },
    # ComfyUI's allocator choice on NVIDIA (its cuda_malloc.py), set before torch loads as main.py sets it.
    "ComfyUI core, card told 8 GB": {
        "kind": "core",
        "card_gb": 8.0,
        "env": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    },
    "server: pack defaults": {"kind": "server"},
    "server: pack defaults, no Memory Snapshot": {"kind": "server", "no_snapshot": True},
    "server: pack fast": {"kind": "server", "sets": ["2.fast=true"]},
    "server: pack fast + step_cache 0.1": {"kind": "server", "sets": ["2.fast=true", "2.step_cache=0.1"]},
    "server: pack compute fp8": {"kind": "server", "sets": ["2.compute=fp8"]},
    "server: pack compute fp8, no Memory Snapshot": {
        "kind": "server",
        "sets": ["2.compute=fp8"],
        "no_snapshot": True,
    },
    "server: pack low-VRAM": {"kind": "server", "workflow": "pixart_lowvram_low_vram_api.json"},
    "server: pack keep_loaded": {"kind": "server", "keep": True},
    # The pack's int8 MODEL under core's KSampler: the bundled LoRA workflow without its LoRA loader.
    "server: pack int8 MODEL, core KSampler": {
        "kind": "server",
        "workflow": "pixart_lowvram_lora_ksampler_api.json",
        "drop": ("LoraLoaderModelOnly",),
    },
    "server: pack int8 MODEL compute fp8, core KSampler": {
        "kind": "server",
        "workflow": "pixart_lowvram_lora_ksampler_api.json",
        "drop": ("LoraLoaderModelOnly",),
        "sets": ["2.compute=fp8"],
    },
    # The bundled LoRA workflow as shipped (the int8 MODEL, core's LoraLoaderModelOnly and KSampler) with a
    # random rank-16 LoRA on every attention and feed-forward layer, at strength 1 and 0.
    "server: LoRA + KSampler, strength 1": {
        "kind": "server",
        "workflow": "pixart_lowvram_lora_ksampler_api.json",
        "lora": 1.0,
    },
    "server: LoRA + KSampler, strength 0": {
        "kind": "server",
        "workflow": "pixart_lowvram_lora_ksampler_api.json",
        "lora": 0.0,
    },
    # The same with the int8 Model Loader's keep_loaded on (node 2): the MODEL stays on the GPU between
    # prompts, as ComfyUI keeps its own; T5 and the VAE still unload as shipped.
    "server: LoRA + KSampler, strength 1, MODEL kept": {
        "kind": "server",
        "workflow": "pixart_lowvram_lora_ksampler_api.json",
        "lora": 1.0,
        "sets": ["2.keep_loaded=true"],
    },
    # ComfyUI core's own fp16 PixArt-Σ as its users build it, through the same server (its defaults:
    # Dynamic VRAM on NVIDIA), with the pack's Batched Guidance (PixArt-Σ) node before KSampler, and with
    # Dynamic VRAM off.
    "server: ComfyUI core fp16": {"kind": "server", "core": True},
    "server: ComfyUI core fp16 + Batched Guidance": {"kind": "server", "core": True, "patch": True},
    "server: ComfyUI core fp16, --disable-dynamic-vram": {
        "kind": "server",
        "core": True,
        "args": ("--disable-dynamic-vram",),
    },
}
ANCHOR = next(iter(CONFIGS))
WARM_UP = "warm-up: fill the pre-quantized cache"
SAMPLING_NODES = ("KSampler", "PixArtQ_Sampler")  # a server row's sampling node (websocket node seconds)
CONFIGS[WARM_UP] = {"kind": "pack", "prompts": 1}


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class Prompt:
    """Clock, peaks and copies of one prompt in this process."""

    def __enter__(self):
        from pixart_lowvram.core import streaming

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.copied = streaming.copied_to_device()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        from pixart_lowvram.core import streaming

        torch.cuda.synchronize()
        self.record = {
            "seconds": time.perf_counter() - self.start,
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "peak_reserved": torch.cuda.max_memory_reserved(),
            "rss": rss(),
            "copied_to_gpu": streaming.copied_to_device() - self.copied,
        }


PROFILED = 2  # the prompt that --profile records (a later one)


@contextmanager
def profiled(out: str | None):
    """torch's profiler around one prompt, its tables (CPU and CUDA time) written to ``out``."""
    if out is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    averages = prof.key_averages()
    Path(out).write_text(
        averages.table(sort_by="cpu_time_total", row_limit=45)
        + "\n\n"
        + averages.table(sort_by="self_cuda_time_total", row_limit=30)
    )


def digest(tensor: torch.Tensor) -> str:
    import hashlib

    data = tensor.detach().cpu().contiguous().flatten().view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()[:16]


def cap(gib: float | None) -> None:
    if gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(gib * GIB / total)


def run_anchor(model_dir: Path) -> tuple[list[dict], list[torch.Tensor]]:
    from diffusers import PixArtSigmaPipeline

    pipe = PixArtSigmaPipeline.from_pretrained(model_dir, dtype=torch.float16).to("cuda")
    records, images = [], []
    for text, seed in [*PROMPTS, REPEAT]:
        # The pipeline runs without autograd; its VAE's decode called here must too, or each prompt's
        # activations stay referenced from the image (11 GiB a prompt at 1024²).
        with Prompt() as p, torch.inference_mode():
            latents = pipe(
                text,
                width=SETTINGS["width"],
                height=SETTINGS["height"],
                num_inference_steps=SETTINGS["steps"],
                guidance_scale=SETTINGS["cfg"],
                generator=torch.Generator("cpu").manual_seed(seed),
                output_type="latent",
                return_dict=False,
            )[0]
            image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
            image = image.float().cpu()
        records.append(p.record | {"png_seconds": png_seconds((image / 2 + 0.5).clamp(0, 1))})
        images.append(image)
    return records, images


def png_seconds(image: torch.Tensor) -> float:
    """Seconds to write ``image`` ([B, C, H, W] in 0..1) as ComfyUI's SaveImage writes it (8-bit PNG,
    compress level 4): what a server prompt pays on top of the generation, for the anchor's side of the
    comparison (not in the anchor's seconds)."""
    import io

    import numpy as np
    from PIL import Image

    start = time.perf_counter()
    for picture in image:
        pixels = (picture.permute(1, 2, 0).numpy() * 255.0).clip(0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(io.BytesIO(), format="PNG", compress_level=4)
    return time.perf_counter() - start


def run_pack(model_dir: Path, config: dict, quant_cache: Path) -> tuple[list[dict], list[torch.Tensor]]:
    from pixart_lowvram.core import measure, models, sampler, text_encoder, vae
    from pixart_lowvram.core.pool import cache

    cap(config.get("cap_gib"))
    source = models.resolve_model(str(model_dir))
    low_vram, fast = config.get("low_vram", False), config.get("fast", False)
    records, images, outputs = [], [], []
    for index, (text, seed) in enumerate([*PROMPTS, REPEAT][: config.get("prompts")]):
        report = measure.MemoryReport()
        with Prompt() as p, profiled(config.get("profile") if index == PROFILED else None):
            encoding = text_encoder.EncoderSettings(
                source, device="cuda", low_vram=low_vram, quant_cache=quant_cache
            )
            embeds = text_encoder.encode(encoding, text, "", report=report)
            sampling = sampler.SamplerSettings(
                source,
                **SETTINGS,
                seed=seed,
                device="cuda",
                low_vram=low_vram,
                fast=fast,
                step_cache=config.get("step_cache", 0.0),
                compute=config.get("compute", "fp16"),
                quant_cache=quant_cache,
            )
            latents = sampler.sample(sampling, embeds, report=report)
            decoding = vae.DecoderSettings(source, device="cuda", tiling="on" if low_vram else "auto")
            image = vae.decode(decoding, latents, report=report)
        # Each stage resets the peak statistics when it starts: the prompt's peaks are its stages' highest.
        peaks = [(stage.peak_allocated, stage.peak_reserved) for stage in report.stages]
        records.append(
            p.record
            | {
                "peak_allocated": max(allocated for allocated, _ in peaks),
                "peak_reserved": max(reserved for _, reserved in peaks),
                "pool_bytes": cache.pool_bytes(),
                "allocated_after": torch.cuda.memory_allocated(),
                "stages": {s.stage: round(s.seconds, 3) for s in report.stages},
                "stage_peaks": {s.stage: (s.peak_allocated, s.peak_reserved) for s in report.stages},
                # which stage's output differs when the 6th image differs from the 1st
                "digests": {"embeds": digest(embeds.prompt_embeds), "latents": digest(latents)},
            }
        )
        images.append(image)
        outputs.append(latents)
    if config.get("keep_outputs"):
        torch.save({"latents": outputs, "images": images}, config["keep_outputs"])
    return records, images


def run_core(
    model_dir: Path, comfyui: Path, config: dict, tree: Path
) -> tuple[list[dict], list[torch.Tensor]]:
    import comfyui_path

    comfyui_path.write_models_tree(model_dir, tree)
    sys.path.insert(0, str(comfyui))
    comfyui_path.simulate_card(config["card_gb"])
    import folder_paths

    import nodes

    for folder in comfyui_path.FILES:
        folder_paths.add_model_folder_path(folder, str(tree / folder), is_default=True)
    files = comfyui_path.FILES
    # Loaded once, as a server's node cache keeps the loaders' outputs between prompts.
    clip = nodes.CLIPLoader().load_clip(files["text_encoders"], "pixart")[0]
    model = nodes.UNETLoader().load_unet(files["diffusion_models"], "default")[0]
    vae = nodes.VAELoader().load_vae(files["vae"])[0]
    records, images = [], []
    for text, seed in [*PROMPTS, REPEAT]:
        with Prompt() as p, torch.inference_mode():  # as ComfyUI's executor runs nodes
            encode = nodes.CLIPTextEncode()
            positive, negative = encode.encode(clip, text)[0], encode.encode(clip, "")[0]
            latent = nodes.EmptyLatentImage().generate(SETTINGS["width"], SETTINGS["height"], 1)[0]
            samples = nodes.KSampler().sample(
                model,
                seed,
                SETTINGS["steps"],
                SETTINGS["cfg"],
                "dpmpp_2m",
                "normal",
                positive,
                negative,
                latent,
            )[0]
            image = nodes.VAEDecode().decode(vae, samples)[0].float().cpu()
        records.append(p.record)
        images.append(image)
    return records, images


def core_workflow(patch: bool = False, cpu_check: bool = False) -> dict:
    """ComfyUI core's own PixArt-Σ graph (API format): CLIPLoader (T5-XXL fp16, type pixart), two
    CLIPTextEncode, UNETLoader, EmptyLatentImage, KSampler (dpmpp_2m, normal), VAELoader, VAEDecode,
    SaveImage, on the single files ``comfyui_path.write_models_tree`` writes; with ``patch`` the pack's
    Batched Guidance (PixArt-Σ) between UNETLoader and KSampler. ``cpu_check``: the conditioning from the
    pack's Quantized T5 Encode and the pack's VAE Decode instead (CLIPLoader builds T5-XXL at its full size,
    4.8 B parameters, and VAELoader the SDXL VAE's widths, whatever the files hold: too large for a CPU check
    or not the small model's)."""
    import comfyui_path

    files, size = comfyui_path.FILES, SETTINGS["width"]
    sampler = {"sampler_name": "dpmpp_2m", "scheduler": "normal", "denoise": 1.0, "seed": 0}
    sampler |= {"steps": SETTINGS["steps"], "cfg": SETTINGS["cfg"]}
    nodes = {
        "1": ("CLIPLoader", {"clip_name": files["text_encoders"], "type": "pixart"}),
        "2": ("CLIPTextEncode", {"clip": ["1", 0], "text": ""}),
        "3": ("CLIPTextEncode", {"clip": ["1", 0], "text": ""}),
        "4": ("UNETLoader", {"unet_name": files["diffusion_models"], "weight_dtype": "default"}),
        "5": ("EmptyLatentImage", {"width": size, "height": size, "batch_size": 1}),
        "6": (
            "KSampler",
            sampler
            | {"model": ["4", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["5", 0]},
        ),
        "7": ("VAELoader", {"vae_name": files["vae"]}),
        "8": ("VAEDecode", {"samples": ["6", 0], "vae": ["7", 0]}),
        "9": ("SaveImage", {"images": ["8", 0], "filename_prefix": "core"}),
    }
    if patch:
        nodes["10"] = ("PixArtQ_BatchedGuidance", {"model": ["4", 0]})
        nodes["6"][1]["model"] = ["10", 0]
    if cpu_check:
        del nodes["1"], nodes["3"]
        encode = {"model": "pixart-full", "prompt": "", "negative_prompt": "", "quantization": "nf4"}
        nodes["2"] = ("PixArtQ_T5Encode", encode | {"keep_loaded": False, "low_vram": False})
        nodes["6"][1].update(positive=["2", 1], negative=["2", 2])
        del nodes["7"]  # and the pack's decode: VAELoader builds the SDXL VAE's widths, not a small one's
        decode = {"model": "pixart-full", "latent": ["6", 0], "keep_loaded": False, "tiling": "auto"}
        nodes["8"] = ("PixArtQ_VAEDecode", decode | {"vae_file": "(from model)"})
    return {key: {"class_type": kind, "inputs": inputs} for key, (kind, inputs) in nodes.items()}


def sized_down(workflow: dict) -> dict:
    """``workflow`` at :data:`SETTINGS`' size and steps (the CPU check's): every width, height and steps
    input."""
    for node in workflow.values():
        for name in ("width", "height", "steps"):
            if name in node["inputs"] and not isinstance(node["inputs"][name], list):
                node["inputs"][name] = SETTINGS[name]
    return workflow


def link_core_models(model_dir: Path, base: Path, tree: Path) -> None:
    """The single files core's loaders read, written once into ``tree`` and linked into the server's
    models/ folders."""
    import comfyui_path

    comfyui_path.write_models_tree(model_dir, tree)
    for folder, name in comfyui_path.FILES.items():
        (base / "models" / folder).mkdir(parents=True, exist_ok=True)
        (base / "models" / folder / name).symlink_to(tree / folder / name)


def without(workflow: dict, kinds: tuple[str, ...]) -> dict:
    """``workflow`` without the nodes of ``kinds``, each one's links taken by what fed its first input."""
    dropped = {key: node for key, node in workflow.items() if node["class_type"] in kinds}
    kept = {key: node for key, node in workflow.items() if key not in dropped}
    for node in kept.values():
        for name, value in node["inputs"].items():
            while isinstance(value, list) and value[0] in dropped:
                value = next(v for v in dropped[value[0]]["inputs"].values() if isinstance(v, list))
            node["inputs"][name] = value
    return kept


class DeviceUsed:
    """The whole card's used memory (``cudaMemGetInfo``, what NVML's "used" reads: every process and
    context, the server's and this client's), polled every 10 ms while it is entered; ``peak`` in bytes."""

    def __init__(self, enabled: bool = True):
        self.peak, self._stop, self.enabled = 0, threading.Event(), enabled

    def _poll(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            self._stop.wait(0.01)

    def __enter__(self):
        if not self.enabled:
            self._stop.set()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_server(
    model_dir: Path, comfyui: Path, config: dict, base: Path, cpu_check: bool = False
) -> tuple[list[dict], list[torch.Tensor]]:
    """A workflow through a real server, its prompts one at a time (:func:`server_row`)."""
    with server_row(model_dir, comfyui, config, base, cpu_check) as prompt:
        done = [
            prompt(index, text, seed) for index, (text, seed) in laps_by(config["laps"], config.get("until"))
        ]
    return [record for record, _ in done], [image for _, image in done]


def run_together(
    names: list[str],
    model_dir: Path,
    comfyui: Path,
    laps: int,
    work: Path,
    cpu_check: bool = False,
    until: float | None = None,
) -> dict[str, tuple[list[dict], list[torch.Tensor]]]:
    """Server rows interleaved (``--interleave``): every row's server started and kept up, then each prompt
    of the sequence on every server in turn, the order rotated by one each prompt, so that each row meets the
    same host periods (the host's speed drifts over minutes, more than the rows differ). The card is shared,
    so its used memory is not told apart per server: those rows' card used is left out."""
    done: dict[str, tuple[list[dict], list[torch.Tensor]]] = {name: ([], []) for name in names}
    with ExitStack() as stack:
        rows = {
            name: stack.enter_context(
                server_row(
                    model_dir,
                    comfyui,
                    CONFIGS[name],
                    Path(tempfile.mkdtemp(dir=work)),
                    cpu_check,
                    card_shared=True,
                )
            )
            for name in names
        }
        for index, (text, seed) in laps_by(laps, until):
            turn = index % len(names)
            for position, name in enumerate(names[turn:] + names[:turn]):
                record, image = rows[name](index, text, seed)
                done[name][0].append(record | {"turn": position})
                done[name][1].append(image)
    return done


@contextmanager
def server_row(
    model_dir: Path,
    comfyui: Path,
    config: dict,
    base: Path,
    cpu_check: bool = False,
    card_shared: bool = False,
):
    """A workflow through a real server: the bundled basic workflow unless the configuration names another,
    or core's own graph. Yields ``prompt(index, text, seed)``, which runs one prompt (submit to images
    downloaded) and gives its record and image: the RSS of the server's whole process tree after it and the
    card's used memory during it (not where ``card_shared``: other servers on the card)."""
    import comfy_server
    import numpy as np
    from PIL import Image
    from soak import without_snapshot

    from pixart_lowvram.cli import client as api

    if config.get("core"):
        workflow, sets = core_workflow(config.get("patch", False), cpu_check), []
        link_core_models(model_dir, base, base.parent / "core_models")
    else:
        name = config.get("workflow", "pixart_lowvram_basic_api.json")
        workflow = api.load_workflow(comfy_server.REPO / "workflows" / "api" / name)
        workflow = without(workflow, config.get("drop", ()))
        sets = [
            f"{key}.model=pixart-full"
            for key, node in workflow.items()
            if isinstance(node["inputs"].get("model"), str)
        ]
        sets += [
            f"{key}.keep_loaded={bool(config.get('keep'))}"
            for key, node in workflow.items()
            if "keep_loaded" in node["inputs"]
        ]
        sets += config.get("sets", [])
        if config.get("no_snapshot"):
            workflow = without_snapshot(workflow)
        if "lora" in config:  # a random rank-16 LoRA on every attention and feed-forward layer
            from pixart_lowvram.cli.random_model import save_random_lora

            save_random_lora(model_dir, base / "models" / "loras" / LORA_FILE, rank=16, scale=0.02)
            for node in workflow.values():
                if node["class_type"] == "LoraLoaderModelOnly":
                    node["inputs"] |= {"lora_name": LORA_FILE, "strength_model": config["lora"]}
    if cpu_check:
        workflow = sized_down(workflow)
    custom_nodes = {}
    if config.get("profile") or config.get("phases"):  # the server's prompts timed where they run
        os.environ |= {
            "PROMPT_PROFILE_DIR": config.get("profile") or config["phases"],
            "PROMPT_PROFILE_NAME": config["name"],
            "PROMPT_PROFILE_TABLES": "1" if config.get("profile") else "0",
        }
        custom_nodes["prompt_profiler"] = Path(__file__).parent / "prompt_profiler"
    with comfy_server.started(
        comfyui,
        base,
        {"pixart-full": model_dir},
        sys.executable,
        cpu=cpu_check,
        extra_args=tuple(config.get("args", ())),
        custom_nodes=custom_nodes,
    ) as server:
        client = api.Client(server.url)
        # The client's check against /object_info, once: a front end does not repeat it per prompt.
        client.check(api.apply_overrides(workflow, sets))
        ws = client.connect()
        card_measured = not (cpu_check or card_shared)

        def run_prompt(index: int, text: str, seed: int) -> tuple[dict, torch.Tensor]:
            # Core's graph has no T5 Encode node: its text goes into its positive CLIPTextEncode.
            prompt = api.apply_overrides(
                workflow, sets, prompt=None if config.get("core") else text, seed=seed
            )
            if config.get("core"):
                prompt["2"]["inputs"]["text" if "text" in prompt["2"]["inputs"] else "prompt"] = text
            log_start = server.log.stat().st_size
            starts: list[tuple[str | None, float]] = []  # (node, when ComfyUI said it started)

            def seen(kind: str, data: dict, starts=starts) -> None:
                if kind == "executing":
                    starts.append((data.get("node"), time.perf_counter()))

            host_before = host_cpu(server.pid)
            start = time.perf_counter()
            with DeviceUsed(enabled=card_measured) as used:
                outcome = client.run(ws, prompt, base / f"images-{index}", 600, None, seen)
            record = {"seconds": time.perf_counter() - start, "rss": comfy_server.tree_rss(server.pid)}
            record["host"] = host_share(host_before, host_cpu(server.pid))
            record["device_used"] = used.peak if card_measured else None
            record |= node_seconds(starts, start, prompt)
            with server.log.open("rb") as log:
                log.seek(log_start)
                record |= server_stages(log.read().decode("utf-8", "replace"))
            with Image.open(outcome.files[0]) as image:
                return record, torch.from_numpy(np.asarray(image).copy())

        try:
            yield run_prompt
        finally:
            if ws is not None:
                ws.close()


def host_cpu(pid: int) -> tuple[list[int], int] | None:
    """The machine's CPU time so far in clock ticks (``/proc/stat``'s first line: user, nice, system, idle,
    iowait, irq, softirq, steal) and the server process's own (``/proc/PID/stat``'s utime and stime; its
    threads, not its children); None where there is no /proc."""
    try:
        machine = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        own = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return machine, int(own[11]) + int(own[12])
    except (OSError, ValueError, IndexError):
        return None


def host_share(before, after) -> dict | None:
    """What the host did during a prompt, from two :func:`host_cpu` readings: the share of all CPUs' time the
    hypervisor gave to others (steal) and that was busy (not idle or iowait), and the server's CPU seconds.
    A gauge of the host's speed: the same prompt's work on a host that is slower for it."""
    if before is None or after is None:
        return None
    delta = [b - a for a, b in zip(before[0], after[0], strict=True)]
    total = sum(delta) or 1
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "steal": delta[7] / total,
        "busy": 1 - (delta[3] + delta[4]) / total,
        "server_cpu_seconds": (after[1] - before[1]) / ticks,
    }


def node_seconds(starts: list[tuple[str | None, float]], submitted: float, prompt: dict) -> dict:
    """Where a server prompt's time went, from the websocket's ``executing`` messages (each node's start,
    then one with no node once the history is written): seconds from submit to the first node, each node
    class's seconds, and SaveImage's apart."""
    if not starts or starts[-1][0] is not None:
        return {}
    nodes: dict[str, float] = {}
    for (node, began), (_next, ended) in itertools.pairwise(starts):
        name = prompt[node]["class_type"]
        nodes[name] = nodes.get(name, 0.0) + ended - began
    return {
        "until_first_node": starts[0][1] - submitted,
        "node_seconds": nodes,
        "save_seconds": nodes.get("SaveImage"),
    }


# The pack's log line for each stage (core.measure.stage): name | device | peak allocated | reserved | seconds
STAGE_LINE = re.compile(r"stage (\w+) \| [^|]+ \| ([\d.]+) (GiB|MiB) \| ([\d.]+) (GiB|MiB) \| ([\d.]+)")
UNITS = {"GiB": 2**30, "MiB": 2**20}
# ComfyUI's own line at a prompt's end: the executor's time, without the HTTP round trip and the download.
EXECUTED = re.compile(r"Prompt executed in ([\d.]+) seconds")


def server_stages(log: str) -> dict:
    """One prompt's stages from the server log: seconds and GPU peaks each, the prompt's peaks, and how many
    models came back from host memory or were reused kept."""
    stages = [
        (m[1], float(m[2]) * UNITS[m[3]], float(m[4]) * UNITS[m[5]], float(m[6]))
        for m in STAGE_LINE.finditer(log)
    ]
    if not stages:
        return {}
    executed = EXECUTED.search(log)
    return {
        "executed_seconds": float(executed[1]) if executed else None,
        "peak_allocated": int(max(allocated for _, allocated, _, _ in stages)),
        "peak_reserved": int(max(reserved for _, _, reserved, _ in stages)),
        "stages": {name: seconds for name, _, _, seconds in stages},
        "stage_peaks": {name: (int(allocated), int(reserved)) for name, allocated, reserved, _ in stages},
        "from_host_memory": log.count("from host memory ("),
        "reused_kept": log.count("reusing kept model"),
    }


def one(name: str, args: argparse.Namespace) -> None:
    """One configuration in this (fresh) process; its records to ``args.one_out``."""
    config = CONFIGS[name]
    kind = config["kind"]
    work = Path(args.work)
    if args.profile:
        config = config | {"profile": str(Path(args.profile) / (slug(name) + ".txt"))}
    if kind == "server":
        config = config | {"laps": args.laps, "until": args.until_time}
    if kind == "server" and (args.profile or args.phases):
        # The server's own prompts, in its prompt worker (benchmarks/prompt_profiler).
        config = config | {
            "name": slug(name),
            "profile": args.profile and str(Path(args.profile).resolve()),
            "phases": str(Path(args.phases or args.profile).resolve()),
        }
    if kind == "anchor":
        records, images = run_anchor(args.model_dir)
    elif kind == "pack":
        # Every pack row's latents and images, for the lossy rows' fidelity against their reference.
        config = config | {"keep_outputs": str(work / f"{slug(name)}.outputs.pt")}
        records, images = run_pack(args.model_dir, config, work / "quant_cache")
    elif kind == "core":
        records, images = run_core(args.model_dir, args.comfyui, config, work / "core_models")
    else:
        # The server's pack reads the pre-quantized cache the warm-up filled.
        os.environ["PIXART_LOWVRAM_QUANT_CACHE"] = str(work / "quant_cache")
        records, images = run_server(
            args.model_dir, args.comfyui, config, Path(tempfile.mkdtemp(dir=work)), args.cpu_check
        )
    Path(args.one_out).write_text(json.dumps(result_of(name, records, images)))


def together(names: list[str], args: argparse.Namespace) -> None:
    """Server rows interleaved in this (fresh) process (:func:`run_together`); their results to
    ``args.one_out``, by name."""
    work = Path(args.work)
    os.environ["PIXART_LOWVRAM_QUANT_CACHE"] = str(work / "quant_cache")
    done = run_together(names, args.model_dir, args.comfyui, args.laps, work, args.cpu_check, args.until_time)
    results = {
        name: result_of(name, records, images) | {"interleaved": names}
        for name, (records, images) in done.items()
    }
    Path(args.one_out).write_text(json.dumps(results))


def result_of(name: str, records: list[dict], images: list[torch.Tensor]) -> dict:
    """A row's result: its arguments, its records, and whether the repeat's image (and each later lap's)
    equals its first; ``laps``: the laps it ran."""
    result = {
        # The configuration as declared (the workflow, its --set overrides, the LoRA's strength …), beside
        # its figures.
        "arguments": CONFIGS[name],
        "records": records,
        "repeat_identical": bool(torch.equal(images[0], images[min(REPEAT_INDEX, len(images) - 1)])),
    }
    if len(images) > REPEAT_INDEX + 1:  # laps: each later lap's prompt against the first lap's
        result["laps"] = 1 + (len(images) - REPEAT_INDEX - 1) // LAP
        result["laps_identical"] = all(
            torch.equal(image, images[1 + index % LAP])
            for index, image in enumerate(images[REPEAT_INDEX + 1 :])
        )
    return result


def fidelity(ours: Path, reference: Path) -> dict:
    """Prompt by prompt, a lossy row's latents and images against its reference row's (the same prompts and
    seeds): the latents' cosine similarity and the 8-bit image's PSNR in dB (inf where equal)."""
    import math

    a, b = torch.load(ours, weights_only=True), torch.load(reference, weights_only=True)
    cosines = [
        float(torch.nn.functional.cosine_similarity(x.flatten().double(), y.flatten().double(), dim=0))
        for x, y in zip(a["latents"], b["latents"], strict=True)
    ]
    psnrs = []
    for x, y in zip(a["images"], b["images"], strict=True):
        mse = float(((x * 255).round().double() - (y * 255).round().double()).pow(2).mean())
        psnrs.append(math.inf if mse == 0 else 10 * math.log10(255**2 / mse))
    return {"latent_cosine": cosines, "image_psnr_db": psnrs}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")[:60]


def summary(records: list[dict], anchor: float | None) -> dict:
    later = later_records(records)
    mean_later = sum(r["seconds"] for r in later) / len(later)
    out = {
        "first_seconds": records[0]["seconds"],
        "later_seconds": mean_later,
        "later_median_seconds": statistics.median(r["seconds"] for r in later),
        "later_ratio": None if not anchor else mean_later / anchor,
    }
    # Through a server: the sampling node's own seconds (KSampler or the Quanto PixArt Sampler), steadier
    # than the whole prompt's.
    sampling = [
        next((r["node_seconds"][n] for n in SAMPLING_NODES if n in r.get("node_seconds", {})), None)
        for r in later
    ]
    if sampling and None not in sampling:
        out["later_sampling_node_seconds"] = sum(sampling) / len(sampling)
        out["later_sampling_node_median_seconds"] = statistics.median(sampling)
    hosts = [r["host"] for r in later if r.get("host")]
    if len(hosts) == len(later):
        for key in ("steal", "busy", "server_cpu_seconds"):
            out[f"later_host_{key}"] = sum(h[key] for h in hosts) / len(hosts)
    # The pack's stages alone (their sum), through a server ComfyUI's executor time, and the anchor's PNG.
    for key, values in (
        ("stages", [sum(r["stages"].values()) for r in later if r.get("stages")]),
        ("executed", [r["executed_seconds"] for r in later if r.get("executed_seconds")]),
        ("png", [r["png_seconds"] for r in later if r.get("png_seconds")]),
        ("save", [r["save_seconds"] for r in later if r.get("save_seconds")]),
        ("unsaved", [r["seconds"] - r["save_seconds"] for r in later if r.get("save_seconds")]),
    ):
        if len(values) == len(later):
            mean = sum(values) / len(values)
            out[f"later_{key}_seconds"] = mean
            out[f"later_{key}_ratio"] = None if not anchor else mean / anchor
    for key in ("peak_allocated", "peak_reserved", "copied_to_gpu", "pool_bytes", "rss", "device_used"):
        values = [r[key] for r in later if r.get(key) is not None]
        if values:
            out[f"later_max_{key}"] = max(values)
    return out


def fmt_gib(value) -> str:
    return "–" if value is None else f"{value / GIB:.2f}"


def seconds_and_ratio(summary: dict, key: str) -> str:
    seconds, ratio = summary.get(f"later_{key}_seconds"), summary.get(f"later_{key}_ratio")
    if seconds is None:
        return "–"
    return f"{seconds:.2f}" + ("" if ratio is None else f" ({ratio:.2f})")


def markdown(meta: dict, results: dict) -> str:
    lines = [
        "# Per prompt, from the first on",
        "",
        f"{meta['device']}, torch {meta['torch']}, {meta['date']}; {SETTINGS['width']}×{SETTINGS['height']}, "
        f"{SETTINGS['steps']} steps, cfg {SETTINGS['cfg']:g}, batch 1, "
        "full-size architecture with random weights; five prompts with their own text and seed, then the "
        "first again"
        + (
            f", then prompts 2–5 again, {meta['laps']} laps in all (server rows)"
            if meta.get("laps", 1) > 1
            else ""
        )
        + ". Ratios: the mean of the later prompts (2–5, and every further lap's) over the anchor's. Later s: the prompt's wall clock (through "
        "a server: submit to image downloaded); stages s: the pack's three stages alone; ComfyUI executed s: "
        "ComfyUI's own time for the prompt (its log), SaveImage's PNG included; PNG s: the anchor's image "
        "written as SaveImage writes it (not in its seconds), and through a server SaveImage's own seconds "
        "(its start to the next node's, from the websocket); later − PNG: a server prompt without them.",
        "",
        "| configuration | 1st prompt s | later s | × anchor | stages s (×) | ComfyUI executed s (×) | "
        "PNG s | later − PNG s (×) | GPU peak alloc / reserved GiB (later) | host→GPU GiB per later prompt | "
        "pool GiB | host RSS GiB | card used GiB (later, server rows) | 6th = 1st (each lap = its first) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, result in results.items():
        if "error" in result:
            lines.append(f"| {name} | failed: {result['error'][:120]} | | | | | | | | | | | | |")
            continue
        s = result["summary"]
        ratio = "–" if s["later_ratio"] is None else f"{s['later_ratio']:.2f}"
        png = s.get("later_png_seconds", s.get("later_save_seconds"))
        lines.append(
            f"| {name} | {s['first_seconds']:.2f} | {s['later_seconds']:.2f} | {ratio} | "
            f"{seconds_and_ratio(s, 'stages')} | {seconds_and_ratio(s, 'executed')} | "
            f"{'–' if png is None else f'{png:.3f}'} | {seconds_and_ratio(s, 'unsaved')} | "
            f"{fmt_gib(s.get('later_max_peak_allocated'))} / {fmt_gib(s.get('later_max_peak_reserved'))} | "
            f"{fmt_gib(s.get('later_max_copied_to_gpu'))} | {fmt_gib(s.get('later_max_pool_bytes'))} | "
            f"{fmt_gib(s.get('later_max_rss'))} | {fmt_gib(s.get('later_max_device_used'))} | "
            f"{'yes' if result['repeat_identical'] and result.get('laps_identical', True) else '**no**'} |"
        )
    anchor = results.get(ANCHOR, {}).get("summary", {})
    if anchor.get("later_png_seconds") is not None:
        both = anchor["later_seconds"] + anchor["later_png_seconds"]
        servers = [
            f"{name} {result['summary']['later_seconds'] / both:.2f}×"
            for name, result in results.items()
            if "summary" in result and result["summary"].get("later_save_seconds") is not None
        ]
        lines += [
            "",
            f"The anchor with its image written as SaveImage writes it: {both:.2f} s"
            + (f"; the server rows over that: {', '.join(servers)}." if servers else "."),
        ]
    lossy = {name: r for name, r in results.items() if "fidelity" in r and "summary" in r}
    if lossy:
        lines += [
            "",
            "Lossy rows against their reference (the same prompts and seeds), prompts 1–5: the latents' "
            "cosine similarity and the image's PSNR (8-bit), worst and mean; later s × the reference's later s.",
            "",
            "| configuration | reference | later s (× reference) | latent cosine min / mean | image PSNR dB min / mean |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, result in lossy.items():
            reference = CONFIGS[name]["fidelity_vs"]
            cos = result["fidelity"]["latent_cosine"][: len(PROMPTS)]
            psnr = result["fidelity"]["image_psnr_db"][: len(PROMPTS)]
            base = results[reference]["summary"]["later_seconds"]
            later = result["summary"]["later_seconds"]
            lines.append(
                f"| {name} | {reference} | {later:.2f} ({later / base:.2f}) | {min(cos):.5f} / "
                f"{sum(cos) / len(cos):.5f} | {min(psnr):.1f} / {sum(psnr) / len(psnr):.1f} |"
            )
    shipped = results.get("server: pack defaults")
    bare = results.get("server: pack defaults, no Memory Snapshot")
    if shipped and "records" in shipped:
        later = shipped["records"][1 : len(PROMPTS)]
        own = [r.get("node_seconds", {}).get("PixArtQ_MemorySnapshot") for r in later]
        if all(value is not None for value in own):
            line = (
                f"The Memory Snapshot node as shipped (reporting only), its own time (its start to the next "
                f"node's): {sum(own) / len(own):.3f} s a later prompt (max {max(own):.3f} s)"
            )
            if bare and "summary" in bare:
                difference = shipped["summary"]["later_seconds"] - bare["summary"]["later_seconds"]
                line += (
                    f"; the rows with and without it differ by {difference:+.3f} s, prompt-to-prompt noise"
                )
            lines += ["", line + "."]
    lines += ["", "Per prompt (seconds):", ""]
    for name, result in results.items():
        if "records" in result:
            lines.append(f"- {name}: " + ", ".join(f"{r['seconds']:.2f}" for r in result["records"]))
    sampled = {
        n: r["summary"] for n, r in results.items() if "later_sampling_node_seconds" in r.get("summary", {})
    }
    if sampled:
        lines += [
            "",
            "Server rows, the later prompts: the prompt's median, and the sampling node's own seconds (KSampler or "
            "the Quanto PixArt Sampler, its start to the next node's) as mean and median; the host during "
            "them (/proc/stat: the CPUs' time stolen by the hypervisor and busy, the server's own CPU "
            "seconds):",
            "",
        ]
        lines += [
            f"- {name}: prompt median {s['later_median_seconds']:.2f} s; sampling node "
            f"{s['later_sampling_node_seconds']:.3f} s mean, {s['later_sampling_node_median_seconds']:.3f} s median"
            + (
                f"; host: steal {100 * s['later_host_steal']:.1f} %, busy {100 * s['later_host_busy']:.1f} %, "
                f"the server's CPU {s['later_host_server_cpu_seconds']:.2f} s a prompt"
                if "later_host_steal" in s
                else ""
            )
            for name, s in sampled.items()
        ]
    together = next((r["interleaved"] for r in results.values() if "interleaved" in r), None)
    if together and all("records" in results.get(name, {}) for name in together):
        lines += [
            "",
            f"Server rows interleaved: {len(together)} servers up at once, each prompt on each in turn (the order "
            "rotated by one each prompt), so every row met the same host periods; the card is shared, so "
            f"its used memory is not told apart per server (the rows one by one give it). Each row against "
            f"{together[0]} (and the patched core against core's own), prompt by prompt (the same prompt's seconds over its; later prompts): the ratio of the means, "
            "and the median and range of the per-prompt ratios:",
            "",
        ]
        guided = " + Batched Guidance"  # the patched core row also against core's own
        against = [(name, together[0]) for name in together[1:]]
        against += [
            (n, n.removesuffix(guided))
            for n in together
            if n.endswith(guided) and n.removesuffix(guided) in together
        ]
        for name, other in against:
            pairs = [
                (r["seconds"], b["seconds"])
                for r, b in zip(
                    later_records(results[name]["records"]),
                    later_records(results[other]["records"]),
                    strict=True,
                )
            ]
            ratios = [r / b for r, b in pairs]
            lines.append(
                f"- {name} against {other}: {sum(r for r, _ in pairs) / sum(b for _, b in pairs):.3f}× (median "
                f"{statistics.median(ratios):.3f}×, {min(ratios):.2f}–{max(ratios):.2f}×)"
            )
    return "\n".join(lines) + "\n"


def write_results(out: Path, names: list[str], results: dict, work: Path, stem: str = "warm") -> str:
    """STEM.json and STEM.md in ``out`` from the configurations measured so far; returns the markdown."""
    for name in names:
        reference = CONFIGS[name].get("fidelity_vs")
        done = "fidelity" in results.get(name, {})  # written after every row: compared once
        if (
            reference
            and not done
            and "records" in results.get(name, {})
            and "records" in results.get(reference, {})
        ):
            results[name]["fidelity"] = fidelity(
                work / f"{slug(name)}.outputs.pt", work / f"{slug(reference)}.outputs.pt"
            )
    anchor = results.get(ANCHOR, {}).get("records")
    anchor_later = (
        None if not anchor else sum(r["seconds"] for r in anchor[1 : len(PROMPTS)]) / (len(PROMPTS) - 1)
    )
    for result in results.values():
        if "records" in result:
            result["summary"] = summary(result["records"], anchor_later)
    meta = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": SETTINGS,
        "prompts": PROMPTS,
        "laps": max((r.get("laps", 1) for r in results.values()), default=1),
    }
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    text = markdown(meta, results)
    (out / f"{stem}.md").write_text(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_PATH"))
    parser.add_argument("--out", type=Path, default=Path("warm"))
    parser.add_argument("--only", action="append", default=[], help="a configuration's name (repeatable)")
    parser.add_argument("--profile", default=None, help="a folder: torch profiler tables of prompt 3")
    parser.add_argument(
        "--phases", default=None, help="a folder: each server prompt's nodes, loads and forwards timed"
    )
    parser.add_argument(
        "--cpu-check",
        action="store_true",
        help="the server rows (--only) on a CPU server, 272², 2 steps: that they run, not their numbers",
    )
    parser.add_argument(
        "--laps",
        type=int,
        default=1,
        help="server rows: after the six prompts, prompts 2-5 again this many times less one; later = all "
        "of them but the first and the repeat",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="server rows: all their servers up at once, each prompt on each in turn (the same host periods "
        "for every row); the card's used memory is then not told apart per server",
    )
    parser.add_argument(
        "--until",
        type=float,
        default=None,
        help="seconds: server rows run a further lap only where, at their pace, it ends within this many "
        "seconds of this command's start (a run under a time limit keeps whole laps)",
    )
    parser.add_argument("--stem", default="warm", help="the results' file name: STEM.json and STEM.md")
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--together", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--until-time", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.until is not None and args.until_time is None:
        args.until_time = time.time() + args.until
    args.model_dir = args.model_dir.resolve()
    if args.cpu_check:
        SETTINGS.update(CPU_CHECK)
        names = [args.one] if args.one else args.together or args.only
        if not names or any(CONFIGS[name]["kind"] != "server" for name in names):
            parser.error("--cpu-check takes server rows only, named with --only")
    if args.interleave and (args.profile or args.phases):
        parser.error("--interleave times prompts side by side; --profile and --phases take rows one by one")
    if args.one:
        one(args.one, args)
        return 0
    if args.together:
        together(args.together, args)
        return 0
    names = args.only or [
        name for name, c in CONFIGS.items() if c["kind"] not in ("core", "server") or args.comfyui
    ]
    if ANCHOR not in names and not args.cpu_check:
        names.insert(0, ANCHOR)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="warm-"))
    results: dict = {}
    # The pre-quantized cache is filled first, so every pack row's first prompt reads it warm.
    if any(CONFIGS[name]["kind"] in ("pack", "server") for name in names) and not args.cpu_check:
        names = [WARM_UP, *names]
    # Each row in a fresh process; with --interleave the server rows all in one, where the first was.
    servers = [name for name in names if CONFIGS[name]["kind"] == "server"] if args.interleave else []
    jobs = [[name] for name in names if name not in servers]
    if servers:
        first = next(i for i, name in enumerate(names) if name in servers)
        jobs.insert(sum(1 for name in names[:first] if name not in servers), servers)
    for job in jobs:
        name = " + ".join(job)
        one_out = work / "one.json"
        command = [sys.executable, __file__, "--model-dir", str(args.model_dir), "--work", str(work)]
        command += ["--one", job[0]] if job is not servers else [a for n in job for a in ("--together", n)]
        command += ["--one-out", str(one_out)]
        if args.profile:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            command += ["--profile", str(Path(args.profile).resolve())]
        if args.phases:
            Path(args.phases).mkdir(parents=True, exist_ok=True)
            command += ["--phases", str(Path(args.phases).resolve())]
        if args.comfyui:
            command += ["--comfyui", str(args.comfyui)]
        if args.cpu_check:
            command += ["--cpu-check"]
        command += ["--laps", str(args.laps)]
        if args.until_time is not None:
            command += ["--until-time", repr(args.until_time)]
        started = time.perf_counter()
        env = os.environ | {k: v for n in job for k, v in CONFIGS[n].get("env", {}).items()}
        proc = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if proc.returncode != 0 or not one_out.is_file():
            lines = (proc.stderr or proc.stdout or "no output").strip().splitlines()
            for n in job:
                results[n] = {"error": lines[-1] if lines else f"exit {proc.returncode}"}
            print(f"{name}: FAILED\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        if job is servers:
            results |= json.loads(one_out.read_text())
        elif name != WARM_UP:
            results[name] = json.loads(one_out.read_text())
        one_out.unlink()
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        # after each: a run cut short keeps what it measured
        write_results(args.out, names, results, work, args.stem)
    print(write_results(args.out, names, results, work, args.stem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
